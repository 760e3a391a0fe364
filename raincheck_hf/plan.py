"""`DeferredPlan`: which rows of a turn are prefilled first and which are deferred.

Selection (`selection/`) decides *which* visual rows go first; this module turns its masks into
row lists with their order keys, and decides in which order the deferred rows are restored
(`restoration_order`, ``RaincheckConfig.restore_order``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache_utils import DEFERRED, INPUT, order_key, to_device
from .selection import SelectionContext, Selector, StartedSelection



@dataclass
class DeferredPlan:
    """Rows of one turn (indices into the turn's new tokens), all in source order.

    Attributes:
        turn: the turn number on the cache.
        source_offset: position of the turn's first new token in the conversation's ``input_ids``.
        input_rows: text rows and selected visual rows, prefilled first (T ∪ S).
        selected_rows: the selected visual rows (S).
        deferred_rows: the deferred visual rows (D).
        restore_order: ``[d]`` a permutation of ``range(d)``: ``deferred_rows[restore_order]`` is the order in
            which the deferred rows are restored (their physical order, docs/method.md §3), or None for
            source order.
    """

    turn: int
    source_offset: int
    input_rows: torch.Tensor
    selected_rows: torch.Tensor
    deferred_rows: torch.Tensor
    restore_order: torch.Tensor | None = None

    @property
    def input_keys(self) -> torch.Tensor:
        return order_key(self.turn, INPUT, self.input_rows)

    @property
    def restore_rows(self) -> torch.Tensor:
        """``[d]`` the deferred rows in restoration order."""
        return self.deferred_rows if self.restore_order is None else self.deferred_rows[self.restore_order]

    @property
    def deferred_keys(self) -> torch.Tensor:
        """``[d]`` order keys of `restore_rows`: increasing in restoration order, so that visibility (keys and
        forward indices, `masking.reference_visibility`) follows the physical order whatever the order is. The
        k-th restored row takes the k-th smallest deferred row's key: the same set of keys as source order."""
        return order_key(self.turn, DEFERRED, self.deferred_rows)

    def sources(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.cpu() + self.source_offset


def select_visual_rows(turn, config, selector: Selector | torch.Tensor, model=None, captures=None) -> torch.Tensor:
    """Boolean keep-mask over the turn's visual rows in source order (True = prefill first).

    The context's ``extras`` hold ``"turn"`` (the adapter's `TurnInputs`, for model-dependent selectors
    such as FastV) and ``"vision_captures"`` (the vision tower's last-block inputs recorded by the
    generate wrapper for selectors with ``needs_vision_attention``, else None).
    """
    return start_visual_selection(turn, config, selector, model=model, captures=captures).keep()


def start_visual_selection(turn, config, selector: Selector | torch.Tensor, model=None,
                           captures=None) -> StartedSelection:
    """`select_visual_rows` without waiting for the device (`Selector.start`): its keep-mask on the host from
    ``.keep()``, on a device from ``.keep_on(device)`` before the picks are read, and ``.count`` kept rows."""
    n = turn.num_visual
    if config.mode == "full" or config.retention >= 1.0:
        return StartedSelection.fixed(torch.ones(n, dtype=torch.bool))
    if isinstance(selector, torch.Tensor):
        if selector.numel() != n:  # also checked before any compute by the generate wrapper
            raise ValueError(
                f"RaincheckConfig.selector is a keep-mask of {selector.numel()} entries but the prompt's new "
                f"tokens hold {n} multimodal tokens."
            )
        return StartedSelection.fixed(selector.cpu().clone())
    context = SelectionContext(text_embeds=turn.embeds[turn.text_rows], model=model,
                               extras={"turn": turn, "vision_captures": captures,
                                       "fast_path": config.fast_path})
    if type(selector).select is not Selector.select:  # a selector of its own that chose its masks its own way
        masks = selector.select(turn.segments, config.retention, context)
        return StartedSelection.fixed(torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool))
    return selector.start(turn.segments, config.retention, context)


def input_rows_on_device(turn, keep: torch.Tensor, kept: int) -> torch.Tensor:
    """``[L - n + kept]`` the turn's input rows (its text rows and the visual rows ``keep`` marks, ``[n]`` bool on
    the turn's device), ascending, on the turn's device, made there without reading anything back (``kept``: how
    many ``keep`` marks, known on the host): `build_plan`'s ``input_rows`` before the keep-mask reaches the host."""
    device = turn.embeds.device
    length = int(turn.visual_index.shape[0])
    visual_rows = turn.visual_rows if turn.visual_rows is not None else (turn.visual_index >= 0).nonzero().flatten()
    is_input = torch.ones(length, dtype=torch.bool, device=device)
    is_input.index_put_((to_device(visual_rows, device),), keep)
    size = length - int(visual_rows.numel()) + kept
    return torch.nonzero_static(is_input, size=size).flatten()


def build_plan(turn, keep: torch.Tensor, turn_index: int, source_offset: int) -> DeferredPlan:
    visual_rows = (turn.visual_rows if turn.visual_rows is not None
                   else (turn.visual_index >= 0).nonzero().flatten().cpu())
    keep = keep.cpu()
    selected = visual_rows[keep]
    deferred = visual_rows[~keep]
    is_input = torch.ones(turn.input_ids.shape[0], dtype=torch.bool)
    is_input[deferred] = False
    return DeferredPlan(turn_index, source_offset, is_input.nonzero().flatten(), selected, deferred)


def restoration_order(turn, plan: DeferredPlan, order: str, model=None, selector=None) -> torch.Tensor | None:
    """The order in which the deferred rows of ``plan`` are restored: a permutation of ``range(d)`` over
    ``plan.deferred_rows`` (None: source order). Ties keep source order (stable sort).

    - ``"source"``: source order (docs/method.md §1's chunks of consecutive deferred tokens).
    - ``"relevance"``: most relevant to the turn's text first, by the mean cosine similarity of each deferred
      row's embedding to the text rows' embeddings (`selection.cdpruner.relevance_scores`; no model pass).
    - ``"attention"``: what the question attends to first: the attention the turn's last prompt row pays
      each row at the first full-attention layer after DeepStack, from a scoring pass over the turn's rows
      (`selection.fastv.turn_last_row_attention`; with the ``fastv`` selector it is the selection's own pass,
      otherwise an extra pass of a few layers before the prefill).
    """
    n = int(plan.deferred_rows.numel())
    if order == "source" or n < 2:
        return None
    device = turn.embeds.device
    rows = plan.deferred_rows.to(device)
    if order == "relevance":
        from .selection.cdpruner import relevance_scores

        scores = relevance_scores(turn.embeds[rows].float(), turn.embeds[turn.text_rows].float())
    elif order == "attention":
        from .selection.fastv import FastVSelector, turn_last_row_attention

        layer = selector.layer if isinstance(selector, FastVSelector) else None
        scores = turn_last_row_attention(model, turn, layer)[0].to(device)[rows]
    else:
        from .configuration import RESTORE_ORDERS

        raise ValueError(f"RaincheckConfig.restore_order={order!r} is not one of {list(RESTORE_ORDERS)}.")
    return torch.sort(scores.float().cpu(), descending=True, stable=True).indices
