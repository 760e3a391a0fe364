"""The selector interface: which multimodal tokens are prefilled first.

A selector sees one multimodal *segment* at a time (one image, or one temporal slice of a video:
a maximal run of consecutive `<|image_pad|>` / `<|video_pad|>` rows) and returns which of its
rows to keep. The base class fixes the contract every method shares:

- exactly ``round(retention * n)`` rows per segment (at least 1 when ``retention > 0``),
- returned in source order, deterministic for the same inputs,
- the same selection whatever the mode (``hard``, ``post_answer`` and ``raincheck`` all call this).

A concrete selector is a small ``@dataclass`` that validates itself in ``__post_init__`` and
implements one method, :meth:`Selector.select_segment`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import ClassVar

import torch


@dataclass
class Segment:
    """One multimodal segment of the current prompt, as a selector sees it.

    Attributes:
        index: segment number in source order within this prompt (0, 1, ...).
        modality: ``"image"`` or ``"video"``.
        features: ``[n, D]`` merged visual embeddings of the segment's rows (the rows the LLM reads).
        grid: ``(t, h, w)`` of the segment in merged tokens (``t == 1`` for an image or one video slice).
        source_positions: ``[n]`` positions of the rows in the prompt's ``input_ids``.
        extras: model-specific tensors a method may use (e.g. ``"deepstack"``: list of ``[n, D]``).
    """

    index: int
    modality: str
    features: torch.Tensor
    grid: tuple[int, int, int]
    source_positions: torch.Tensor
    extras: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.features.shape[0])


@dataclass
class SelectionContext:
    """What a query-aware selector may read besides the segment itself.

    Attributes:
        text_embeds: ``[m, D]`` input embeddings of the current turn's text rows (the question), or None.
        model: the model being served (read-only use: e.g. reading a layer's weights).
        extras: model-specific tensors (e.g. vision-tower outputs) an adapter chose to expose.
    """

    text_embeds: torch.Tensor | None = None
    model: object | None = None
    extras: dict = field(default_factory=dict)


def keep_count(retention: float, n: int) -> int:
    """``round(retention * n)`` rows, at least one when ``retention > 0`` and the segment is non-empty."""
    if n == 0:
        return 0
    k = int(round(retention * n))
    if retention > 0:
        k = max(k, 1)
    return min(k, n)


class Selector(abc.ABC):
    """Base class of every pruning method. Override :meth:`select_segment` only."""

    #: registry name (set by subclasses; used in error messages and traces)
    name: str = "selector"

    @abc.abstractmethod
    def select_segment(self, segment: Segment, k: int, context: SelectionContext) -> torch.Tensor:
        """Return the indices (``LongTensor [k]``, any order, no repeats) of the rows to keep.

        ``k`` is already ``keep_count(retention, segment.num_tokens)`` and satisfies ``1 <= k < n``
        (the trivial cases ``k == 0`` and ``k == n`` never reach this method).
        """

    def select_group(self, segments: list[Segment], k: int, context: SelectionContext) -> list[torch.Tensor]:
        """Indices for several segments of the same size and ``k`` at once (a video's temporal slices).

        The default calls :meth:`select_segment` per segment; a method that can batch (the greedy ones on a
        GPU) overrides this. Returns one index tensor per segment, as :meth:`select_segment` would.
        """
        return [self.select_segment(segment, k, context) for segment in segments]

    def select(self, segments: list[Segment], retention: float, context: SelectionContext) -> list[torch.Tensor]:
        """Boolean keep-masks, one per segment, obeying the shared contract."""
        groups: list[tuple[int, list[Segment]]] = []  # runs of consecutive segments with the same n and k
        for segment in segments:
            n = segment.num_tokens
            k = keep_count(retention, n)
            if groups and groups[-1][0] == k and 0 < k < n and groups[-1][1][0].features.shape == segment.features.shape:
                groups[-1][1].append(segment)
            else:
                groups.append((k, [segment]))
        masks = []
        for k, group in groups:
            n = group[0].num_tokens
            if k == n or k == 0:
                masks += [torch.full((n,), k == n, dtype=torch.bool) for _ in group]
                continue
            picked = [torch.as_tensor(i, dtype=torch.long).flatten() for i in self.select_group(group, k, context)]
            if len(picked) != len(group):
                raise RuntimeError(f"selector {self.name!r} returned {len(picked)} index sets for {len(group)} segments")
            if len({i.device for i in picked}) == 1 and len({i.numel() for i in picked}) == 1:
                picked = list(torch.stack(picked).cpu())  # one copy to the host for the whole group
            for idx in picked:
                idx = idx.cpu()
                if idx.numel() != k or idx.unique().numel() != k or (idx.numel() and (idx.min() < 0 or idx.max() >= n)):
                    raise RuntimeError(
                        f"selector {self.name!r} returned {idx.tolist()} for a segment of {n} tokens; "
                        f"it must return {k} distinct indices in [0, {n})."
                    )
                keep = torch.zeros(n, dtype=torch.bool)
                keep[idx] = True
                masks.append(keep)
        return masks


class GreedySelector(Selector):
    """A selector that picks one token at a time (`mmtok`, `divprune`, `cdpruner`). On CUDA, unless the call
    asked for the eager engine (``fast_path=False``), its segments of one size go through the Triton step
    kernels of `selection.kernels` together; elsewhere :meth:`select_segment` (the reference loop) runs.
    A subclass names its kernel and builds the kernel's inputs."""

    #: the step kernel of `selection.kernels` (``"mmtok"``, ``"divprune"``, ``"cdpruner"``)
    kernel: ClassVar[str]

    @abc.abstractmethod
    def kernel_inputs(self, features: torch.Tensor, context: SelectionContext) -> dict:
        """The kernel's input tensors for ``features [B, n, D]`` (`selection.kernels`' ``*_inputs``)."""

    def uses_kernels(self, segments: list[Segment], context: SelectionContext) -> bool:
        """Whether `select_group` runs these segments through the step kernels (CUDA, Triton, not the eager engine)."""
        if context.extras.get("fast_path") is False or segments[0].features.device.type != "cuda":
            return False
        from .kernels import triton_available

        return triton_available()

    def select_group(self, segments: list[Segment], k: int, context: SelectionContext) -> list[torch.Tensor]:
        if self.uses_kernels(segments, context):
            from .kernels import greedy_select

            features = torch.stack([segment.features for segment in segments])
            return list(greedy_select(self.kernel, self.kernel_inputs(features, context), k))
        return super().select_group(segments, k, context)
