"""`DeferredPlan`: which rows of a turn are prefilled first and which are deferred.

Selection (`selection/`) decides *which* visual rows go first; this module only turns its masks
into row lists with their order keys, in source order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache_utils import DEFERRED, INPUT, order_key
from .selection import SelectionContext, Selector


@dataclass
class DeferredPlan:
    """Rows of one turn (indices into the turn's new tokens), all in source order.

    Attributes:
        turn: the turn number on the cache.
        source_offset: position of the turn's first new token in the conversation's ``input_ids``.
        input_rows: text rows and selected visual rows, prefilled first (T ∪ S).
        selected_rows: the selected visual rows (S).
        deferred_rows: the deferred visual rows (D).
    """

    turn: int
    source_offset: int
    input_rows: torch.Tensor
    selected_rows: torch.Tensor
    deferred_rows: torch.Tensor

    @property
    def input_keys(self) -> torch.Tensor:
        return order_key(self.turn, INPUT, self.input_rows)

    @property
    def deferred_keys(self) -> torch.Tensor:
        return order_key(self.turn, DEFERRED, self.deferred_rows)

    def sources(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.cpu() + self.source_offset


def select_visual_rows(turn, config, selector: Selector | torch.Tensor, model=None, captures=None) -> torch.Tensor:
    """Boolean keep-mask over the turn's visual rows in source order (True = prefill first).

    The context's ``extras`` hold ``"turn"`` (the adapter's `TurnInputs`, for model-dependent selectors
    such as FastV) and ``"vision_captures"`` (the vision tower's last-block inputs recorded by the
    generate wrapper for selectors with ``needs_vision_attention``, else None).
    """
    n = turn.num_visual
    if config.mode == "full" or config.retention >= 1.0:
        return torch.ones(n, dtype=torch.bool)
    if isinstance(selector, torch.Tensor):
        if selector.numel() != n:  # also checked before any compute by the generate wrapper
            raise ValueError(
                f"RaincheckConfig.selector is a keep-mask of {selector.numel()} entries but the prompt's new "
                f"tokens hold {n} multimodal tokens."
            )
        return selector.cpu().clone()
    context = SelectionContext(text_embeds=turn.embeds[turn.text_rows], model=model,
                               extras={"turn": turn, "vision_captures": captures,
                                       "fast_path": config.fast_path})
    masks = selector.select(turn.segments, config.retention, context)
    return torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)


def build_plan(turn, keep: torch.Tensor, turn_index: int, source_offset: int) -> DeferredPlan:
    visual_rows = (turn.visual_index >= 0).nonzero().flatten().cpu()
    keep = keep.cpu()
    selected = visual_rows[keep]
    deferred = visual_rows[~keep]
    is_input = torch.ones(turn.input_ids.shape[0], dtype=torch.bool)
    is_input[deferred] = False
    return DeferredPlan(turn_index, source_offset, is_input.nonzero().flatten(), selected, deferred)
