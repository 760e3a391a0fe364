"""`fastv`: rank visual rows by the attention the last prompt token pays them at an early LLM layer.

After FastV (Chen et al. 2024, "An Image is Worth 1/2 Tokens After Layer 2: Plug-and-Play Inference
Acceleration for Large Vision-Language Models"): after layer K of the LLM, the visual tokens that
receive little attention matter little; FastV keeps the best-ranked ones for the layers after K.

**What is ranked.** ``s_i = mean over heads of A_K[last, i]``: the attention the turn's **last**
prompt row (the generation prompt's final token, the row whose output predicts the first answer
token) pays row ``i`` in layer ``K``, with ``A_K = softmax(q k^T * head_dim^-0.5)`` causal. Each
segment keeps its ``k`` best rows (ties: lowest row). The paper's formula averages the attention a
token receives over *all* query rows; the last-row variant is the query-aware one commonly run as
"FastV" and what this project asks for (it is also ``O(L)`` instead of ``O(L^2)`` to score).

**Layer.** ``layer=None`` (default) picks the first full-attention layer at or after the last layer
DeepStack feeds: layer 3 on Qwen3-VL (DeepStack adds features after layers 0-2, so the visual rows
are complete only from layer 3's input on), the first full-attention layer on Qwen3.5 (its GDN
layers have no attention weights). The paper's K = 2 is therefore not used on Qwen3-VL; an explicit
``layer`` before DeepStack is done, or on a GDN layer, is a ValueError.

**Compatibility with deferral.** FastV normally prunes *inside* the prefill. Raincheck must decide
before the prefill, and deferred tokens must later be restored exactly, so the ranking comes from a
separate **scoring pass** over all of the turn's rows (the same embeddings, 3-D M-RoPE positions and
DeepStack features as a full prefill, causal, no cache) that stops inside layer ``K``:

- the text model's own forward runs layers ``0 .. K-1`` unchanged (rotary embedding, masks,
  DeepStack injection are the model's); hooks record layer ``K``'s ``position_embeddings`` and the
  outputs of the modules the adapter names (`ModelAdapter.attention_query_key`: ``q_norm`` / ``k_norm``
  on Qwen3 families, i.e. after the per-head RMSNorm, so Qwen3.5's gated query projection needs no
  special case; ``q_proj`` / ``k_proj`` on Qwen2.5-VL), then abort the forward;
- the adapter's rotary (the modeling file's own ``apply_rotary_pos_emb``) applies M-RoPE; only the last row's scores
  against all keys (GQA heads repeated) are formed, in float32.

**Cost:** ``K`` decoder layers plus one layer's q/k projections over the turn's rows, i.e. about
``K / num_layers`` of a full prefill of the turn (Qwen3-VL-8B: 3/36 ~ 8%), spent before the initial
prefill, so it adds to time to first token; nothing goes into the cache (the scoring pass's keys and
values are discarded: the real prefill recomputes the kept rows, and the deferred rows later). The
pass runs once per turn (cached in the `SelectionContext`) and serves every segment.

**Multi-turn:** the scoring pass sees only the turn's new rows (earlier turns are in the cache, which
it does not read), so in a follow-up turn the scores are those of the turn on its own, at its true
absolute positions; in a first turn they are exactly the full prefill's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from .base import Segment, SelectionContext, Selector

_CACHE_KEY = "_fastv_last_row_attention"


class _StopScoringPass(Exception):
    """Raised by a hook once layer K's queries and keys are recorded: the rest of the forward is not needed."""


def _layer_kinds(text_model) -> list[str]:
    kinds = getattr(text_model.config, "layer_types", None)
    if kinds:
        return list(kinds)
    return ["full_attention" if hasattr(layer, "self_attn") else "other" for layer in text_model.layers]


def resolve_layer(text_model, layer: int | None, num_deepstack: int) -> int:
    """The scoring layer ``K`` for this model (see the module doc); ValueError for an unusable one."""
    kinds = _layer_kinds(text_model)
    n_layers = len(text_model.layers)
    if layer is None:
        for i in range(num_deepstack, n_layers):
            if kinds[i] == "full_attention":
                return i
        raise ValueError(f"FastVSelector: the model has no full-attention layer at or after layer {num_deepstack}")
    if layer >= n_layers:
        raise ValueError(f"FastVSelector.layer={layer} but the text model has {n_layers} layers")
    if kinds[layer] != "full_attention":
        raise ValueError(f"FastVSelector.layer={layer} is a {kinds[layer]!r} layer; it needs a full-attention layer")
    if layer < num_deepstack:
        raise ValueError(
            f"FastVSelector.layer={layer}: DeepStack still adds visual features after layers 0-{num_deepstack - 1}, "
            f"so the visual rows are complete only from layer {num_deepstack} on; use layer >= {num_deepstack}"
        )
    return layer


@torch.no_grad()
def layer_query_key(adapter, embeds, positions, layer: int, visual=None, deepstack=None):
    """Layer ``layer``'s queries and keys over rows ``embeds [L, D]`` at M-RoPE ``positions [3, L]``.

    Runs the text model's own forward (no cache) and stops it inside that layer; where the per-head
    queries and keys come from, and the rotary applied to them, is the adapter's `attention_query_key`.
    Returns ``(q, k, attn)``: ``q [1, H, L, d]`` and ``k [1, H_kv, L, d]`` after rotary, and the attention module.
    """
    text_model = adapter.text_model
    block = text_model.layers[layer]
    attn, q_source, k_source, rope = adapter.attention_query_key(layer)
    seen: dict = {}
    owner = threading.get_ident()  # the hooks sit on shared modules: they act for this thread's pass only

    def pre_layer(_module, args, kwargs):
        if threading.get_ident() == owner:
            seen["position_embeddings"] = kwargs["position_embeddings"]

    def record(name):
        def hook(_module, _inputs, output):
            if threading.get_ident() != owner:
                return None
            seen[name] = output
            if "q" in seen and "k" in seen:
                raise _StopScoringPass

        return hook

    handles = [
        block.register_forward_pre_hook(pre_layer, with_kwargs=True),
        q_source.register_forward_hook(record("q")),
        k_source.register_forward_hook(record("k")),
    ]
    kwargs = adapter.deepstack_kwargs(visual, deepstack) if visual is not None else {}
    try:
        text_model(inputs_embeds=embeds[None], position_ids=positions[:, None, :], use_cache=False, **kwargs)
    except _StopScoringPass:
        pass
    finally:
        for handle in handles:
            handle.remove()
    if "q" not in seen or "k" not in seen:
        raise RuntimeError(f"FastV: layer {layer}'s query / key projections did not run during the scoring pass")
    cos, sin = seen["position_embeddings"]
    q, k = (seen[n].reshape(*seen[n].shape[:2], -1, attn.head_dim).transpose(1, 2) for n in ("q", "k"))
    q, k = rope(q, k, cos, sin)
    return q, k, attn


def last_row_attention(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """``[L]`` float32: the last query row's softmax attention over all ``L`` keys, mean over heads."""
    heads, kv_heads = q.shape[1], k.shape[1]
    keys = k[0].float().repeat_interleave(heads // kv_heads, dim=0)  # [H, L, d]
    scores = torch.einsum("hd,hld->hl", q[0, :, -1].float(), keys) * scaling
    return torch.softmax(scores, dim=-1).mean(dim=0)


def turn_last_row_attention(model, turn, layer: int | None) -> tuple[torch.Tensor, int]:
    """``([L] attention of the turn's last row at layer K, K)`` via the scoring pass of the module doc."""
    from ..models import get_adapter

    adapter = get_adapter(model)
    k_layer = resolve_layer(adapter.text_model, layer, adapter.num_deepstack_layers)
    visual = turn.visual_index >= 0
    q, k, attn = layer_query_key(adapter, turn.embeds, turn.positions, k_layer, visual, turn.deepstack)
    return last_row_attention(q, k, float(attn.scaling)).cpu(), k_layer


@dataclass
class FastVSelector(Selector):
    """Keep each segment's rows that the last prompt row attends to most at layer K (FastV, see the module doc).

    Needs ``context.model`` and ``context.extras["turn"]`` (the adapter's `TurnInputs`), which
    `generate(raincheck=...)` provides.

    Attributes:
        layer: the scoring layer K (0-based), or None for the first full-attention layer after DeepStack
            (3 on Qwen3-VL, the first full-attention layer on Qwen3.5). An int must be ``>= 0``.
    """

    name: str = "fastv"
    layer: int | None = None

    def __post_init__(self) -> None:
        layer = self.layer
        if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or layer < 0):
            raise ValueError(f"FastVSelector.layer={self.layer!r} must be None or an integer >= 0")

    def check_model(self, model) -> int:
        """The scoring layer on ``model``; ValueError (before any compute) when ``layer`` cannot be used there."""
        from ..models import get_adapter

        adapter = get_adapter(model)
        return resolve_layer(adapter.text_model, self.layer, adapter.num_deepstack_layers)

    def turn_scores(self, context: SelectionContext) -> torch.Tensor:
        """``[L]`` last-row attention over the turn's rows (one scoring pass per context)."""
        turn = context.extras.get("turn")
        if turn is None or context.model is None:
            raise ValueError("selector 'fastv' needs the model and context.extras['turn'] (generate provides both)")
        cache = context.extras.setdefault(_CACHE_KEY, {})
        if self.layer not in cache:
            cache[self.layer] = turn_last_row_attention(context.model, turn, self.layer)[0]
        return cache[self.layer]

    def select_segment(self, segment: Segment, k: int, context: SelectionContext) -> torch.Tensor:
        scores = self.turn_scores(context)[segment.source_positions.cpu()]
        return torch.sort(scores, descending=True, stable=True).indices[:k]
