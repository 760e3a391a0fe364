"""`visionzip`: dominant tokens by vision-tower attention, plus strided contextual tokens; question-agnostic.

After VisionZip (Yang et al. 2024, "VisionZip: Longer is Better but Not Necessary in Vision Language
Models"): a few visual tokens receive most of the vision encoder's attention and carry most of the
image's information (*dominant* tokens); the rest are covered by a handful of *contextual* tokens.

**Dominant tokens.** The paper ranks tokens by the attention the CLS token pays them, or, for encoders
without CLS (SigLIP), by the average attention each token receives. The Qwen towers have no
CLS and run SDPA (no weights come back), so the attention of the tower's **last block** is recomputed
from that block's own inputs, recorded during the `generate` call by
`raincheck_hf.integration.VisionAttentionCapture`:

1. ``q, k`` = what the block computes from its input, as the model's adapter says
   (`ModelAdapter.vision_block_query_key`; for Qwen's blocks ``norm1`` -> ``attn.qkv`` -> the tower's
   own vision rotary);
2. per attention window (``cu_seqlens``: one image, or one video temporal slice; windows never see
   each other) and per head, ``A = softmax(q k^T * head_dim^-0.5)`` over the window's keys;
3. patch ``p`` receives ``a_p = mean over heads and over the window's queries of A[:, :, p]``
   (each window's ``a`` sums to 1);
4. **merged-token level**: the merger concatenates ``spatial_merge_size ** 2`` (= 4) consecutive
   patches (the tower orders patches merge-block-major) into one LLM token, so an LLM token's score
   is the **sum** of its patches' ``a_p``: the share of the window's attention mass that lands on
   the patches it is made of (the sum ranks exactly as the mean over the 4 patches would); a tower that
   holds its tokens in another order (Qwen2.5-VL: window by window) is put back in source order.

The ``round(dominant_fraction * k)`` best-scoring rows of the segment are kept (ties: lowest row).

**Contextual tokens.** The paper samples target tokens at a uniform stride among the non-dominant
tokens and merges every other remaining token into its most similar target. Raincheck is
**prune-only**: a deferred token must stay exactly the model's own token so that restoring it later
gives the full prefill back, so nothing is merged; the ``k - k_dom`` contextual rows are the strided
targets alone, row ``floor((i + 0.5) * m / k_ctx)`` of the ``m`` non-dominant rows in source order.

**Cost.** One extra attention of the last block over the turn's patches (queries processed in chunks
of ``query_chunk`` rows, so memory stays ``O(heads * query_chunk * window)``); no tower re-run. Scores
are computed once per turn and modality and reused for every segment.

The paper's default split, 54 dominant + 10 contextual of 64 kept tokens, is ``dominant_fraction =
54 / 64`` here, applied per segment to its own ``k``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Segment, SelectionContext, Selector

_SCORES_KEY = "_visionzip_scores"


@torch.no_grad()
def last_block_qk(record: dict) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(q, k, scaling)``: the captured block's queries and keys after rotary (each ``[heads, P, head_dim]``
    float32) and its softmax scale, computed by the model's adapter (``record["query_key"]``)."""
    return record["query_key"](record["block"], record["hidden_states"], record["position_embeddings"])


@torch.no_grad()
def patch_received_attention(record: dict, query_chunk: int = 1024) -> torch.Tensor:
    """``[P]`` float32: attention each patch receives in the last block, mean over heads and over the
    queries of its own window (step 3 of the module doc)."""
    q, k, scale = last_block_qk(record)
    heads, n_patches = q.shape[0], q.shape[1]
    bounds = [int(b) for b in record["cu_seqlens"].tolist()]
    if bounds[0] != 0 or bounds[-1] != n_patches:
        raise ValueError(f"visionzip: cu_seqlens {bounds} do not cover the {n_patches} captured patches")
    received = torch.zeros(n_patches, dtype=torch.float32, device=q.device)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        keys = k[:, start:end]  # [H, w, d]
        total = torch.zeros(end - start, dtype=torch.float32, device=q.device)
        for qs in range(start, end, query_chunk):
            qe = min(end, qs + query_chunk)
            probs = torch.softmax(torch.matmul(q[:, qs:qe], keys.transpose(1, 2)) * scale, dim=-1)
            total += probs.sum(dim=(0, 1))
        received[start:end] = total / (heads * (end - start))
    return received


def merged_received_attention(record: dict, query_chunk: int = 1024) -> torch.Tensor:
    """``[P / merge_unit]`` float32 on the CPU: per LLM token (source order), the sum of its patches' received
    attention."""
    patch = patch_received_attention(record, query_chunk)
    unit = int(record["merge_unit"])
    if patch.numel() % unit:
        raise ValueError(f"visionzip: {patch.numel()} patches are not a multiple of the merge unit {unit}")
    merged = patch.view(-1, unit).sum(dim=1).cpu()
    order = record.get("merged_order")
    return merged if order is None else merged[order.cpu()]


def strided(m: int, count: int) -> torch.Tensor:
    """``count`` of ``range(m)`` at a uniform stride: ``floor((i + 0.5) * m / count)``."""
    if count <= 0:
        return torch.empty(0, dtype=torch.long)
    return ((torch.arange(count, dtype=torch.float64) + 0.5) * m / count).floor().long().clamp_(max=m - 1)


@dataclass
class VisionZipSelector(Selector):
    """Dominant rows by last-block vision attention, plus strided contextual rows (VisionZip, prune-only).

    Needs the vision tower to run inside the `generate` call (the default: HF encodes the images
    there); the generate wrapper records the last block's inputs because this class sets
    ``needs_vision_attention``. The segment's scores are read from ``context.extras["vision_captures"]``
    (a `VisionAttentionCapture`, or any mapping modality -> record dict with its keys) and its place
    among the modality's LLM tokens from ``context.extras["turn"].segments``.

    Attributes:
        dominant_fraction: share of each segment's ``k`` kept as dominant tokens, in ``[0, 1]``
            (default ``54 / 64``, the paper's 54 + 10 split); the rest are contextual.
        query_chunk: query rows per attention block when recomputing the last block's attention, ``>= 1``.
    """

    name: str = "visionzip"
    dominant_fraction: float = 54 / 64
    query_chunk: int = 1024
    needs_vision_attention: ClassVar[bool] = True

    def __post_init__(self) -> None:
        f = self.dominant_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not (0.0 <= float(f) <= 1.0):
            raise ValueError(f"VisionZipSelector.dominant_fraction={f!r} must be a number in [0, 1]")
        q = self.query_chunk
        if isinstance(q, bool) or not isinstance(q, int) or q < 1:
            raise ValueError(f"VisionZipSelector.query_chunk={q!r} must be an integer >= 1")

    def split(self, k: int) -> tuple[int, int]:
        """``(dominant, contextual)`` counts for ``k`` kept rows."""
        dominant = min(k, int(round(float(self.dominant_fraction) * k)))
        return dominant, k - dominant

    def segment_scores(self, segment: Segment, context: SelectionContext) -> torch.Tensor:
        """``[n]`` merged-token received attention of the segment's rows (cached per turn and modality)."""
        captures = context.extras.get("vision_captures")
        turn = context.extras.get("turn")
        if captures is None or segment.modality not in captures:
            raise ValueError(
                f"selector 'visionzip' needs the vision tower's last-block inputs for the {segment.modality}s "
                "of this turn, recorded while generate(raincheck=...) encodes them; none were recorded (were "
                "pre-computed mm_encoder_outputs passed, or was the selector called outside generate?)."
            )
        if turn is None:
            raise ValueError("selector 'visionzip' needs context.extras['turn'] (its segments) to place each segment")
        cache = context.extras.setdefault(_SCORES_KEY, {})
        if segment.modality not in cache:
            cache[segment.modality] = merged_received_attention(captures[segment.modality], self.query_chunk)
        scores = cache[segment.modality]
        offset = sum(s.num_tokens for s in turn.segments if s.modality == segment.modality and s.index < segment.index)
        if offset + segment.num_tokens > scores.numel():
            raise ValueError(
                f"visionzip: the recorded {segment.modality} tower call holds {scores.numel()} LLM tokens, fewer than "
                f"the turn's {segment.modality} segments up to segment {segment.index} ({offset + segment.num_tokens})"
            )
        return scores[offset:offset + segment.num_tokens]

    def select_segment(self, segment: Segment, k: int, context: SelectionContext) -> torch.Tensor:
        scores = self.segment_scores(segment, context)
        n_dom, n_ctx = self.split(k)
        order = torch.sort(scores, descending=True, stable=True).indices  # lowest row first on ties
        dominant = order[:n_dom]
        rest = torch.ones(segment.num_tokens, dtype=torch.bool)
        rest[dominant] = False
        remaining = rest.nonzero().flatten()  # source order
        contextual = remaining[strided(remaining.numel(), n_ctx)]
        return torch.cat([dominant, contextual])
