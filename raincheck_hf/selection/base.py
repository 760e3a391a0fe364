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
        return self.start(segments, retention, context).masks()

    def start(self, segments: list[Segment], retention: float, context: SelectionContext) -> "StartedSelection":
        """:meth:`select` without waiting for the device: the picks of each run of segments of one size are made
        (on a GPU: queued, with their copy to the host), and the keep-masks come from `StartedSelection.masks`,
        checked against the contract there. `StartedSelection.keep_on` gives them on a device before that."""
        groups: list[tuple[int, list[Segment]]] = []  # runs of consecutive segments with the same n and k
        for segment in segments:
            n = segment.num_tokens
            k = keep_count(retention, n)
            if groups and groups[-1][0] == k and 0 < k < n and groups[-1][1][0].features.shape == segment.features.shape:
                groups[-1][1].append(segment)
            else:
                groups.append((k, [segment]))
        parts = []
        for k, group in groups:
            n = group[0].num_tokens
            if k == n or k == 0:
                parts.append(_TrivialPart(n, k, len(group)))
                continue
            picked = [torch.as_tensor(i, dtype=torch.long).flatten() for i in self.select_group(group, k, context)]
            if len(picked) != len(group):
                raise RuntimeError(f"selector {self.name!r} returned {len(picked)} index sets for {len(group)} segments")
            part = _PickedPart(self.name, n, k, picked)
            if not self.picks_checked_later(group, context):
                part.masks()  # read and checked now (kept: `masks` returns them again)
            parts.append(part)
        return StartedSelection(parts)

    def picks_checked_later(self, segments: list[Segment], context: SelectionContext) -> bool:
        """Whether :meth:`start` may leave the contract's check of these segments' picks until they are read
        (picks the library's own kernels make on a device, tested against the contract); otherwise they are
        checked at once, before anything runs on them."""
        return False


class _TrivialPart:
    """Segments that keep all of their ``n`` rows or none (``k`` is ``n`` or 0)."""

    def __init__(self, n: int, k: int, count: int):
        self.n, self.k, self.count = n, k, count
        self.kept = k * count

    def masks(self) -> list[torch.Tensor]:
        return [torch.full((self.n,), self.k == self.n, dtype=torch.bool) for _ in range(self.count)]

    def keep_on(self, device) -> torch.Tensor:
        return torch.full((self.n * self.count,), self.k == self.n, dtype=torch.bool, device=device)


class _PickedPart:
    """Segments of ``n`` rows, ``k`` picked in each by the selector (``picked``: one index tensor a segment).

    Picks made on a CUDA device (the step kernels') are stacked and copied to pinned host memory without waiting,
    an event recorded behind the copy: the host reads them after waiting for that event only, not for whatever was
    queued after it (the turn's first forward, `generation.raincheck_sample`). Others are read at once."""

    def __init__(self, name: str, n: int, k: int, picked: list[torch.Tensor]):
        self.name, self.n, self.k, self.picked = name, n, k, picked
        self.kept = k * len(picked)
        self._host, self._event, self._checked, self._stacked = None, None, None, None
        if len({i.device for i in picked}) == 1 and len({i.numel() for i in picked}) == 1:
            stacked = self._stacked = torch.stack(picked)  # ``[segments, k]``, where the picks are
            if stacked.device.type == "cuda":
                self._host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
                self._host.copy_(stacked, non_blocking=True)  # (queued on the picks' device's current stream)
                self._event = torch.cuda.Event()
                self._event.record(torch.cuda.current_stream(stacked.device))
            else:  # on the host already (a no-op), or read now from another device
                self._host = stacked.cpu()

    def host_picks(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()  # the copy's own wait (the pinned buffer is read only after it)
            self._event = None
        if self._host is not None:
            return list(self._host.unbind(0))
        return [i.cpu() for i in self.picked]

    def masks(self) -> list[torch.Tensor]:
        if self._checked is None:
            self._checked = self._check(self.host_picks())
        return self._checked

    def _check(self, host_picks: list[torch.Tensor]) -> list[torch.Tensor]:
        masks = []
        n, k = self.n, self.k
        for idx in host_picks:
            if idx.numel() != k or idx.unique().numel() != k or (idx.numel() and (idx.min() < 0 or idx.max() >= n)):
                raise RuntimeError(
                    f"selector {self.name!r} returned {idx.tolist()} for a segment of {n} tokens; "
                    f"it must return {k} distinct indices in [0, {n})."
                )
            keep = torch.zeros(n, dtype=torch.bool)
            keep[idx] = True
            masks.append(keep)
        return masks

    def keep_on(self, device) -> torch.Tensor:
        stacked = self._stacked
        if stacked is None or stacked.device != torch.device(device) or stacked.shape[1] != self.k:
            from ..cache_utils import to_device  # (here: importing the selectors stays free of transformers)

            return to_device(torch.cat(self.masks()), device)  # picks elsewhere (checked first), or of a wrong size
        # scattered where they are: indices out of range are clamped (no device-side error), and `masks` then
        # raises the contract's error
        index = stacked.clamp(0, self.n - 1)
        keep = torch.zeros(index.shape[0], self.n, dtype=torch.bool, device=index.device)
        return keep.scatter_(1, index, True).flatten()


class _FixedPart:
    """A keep-mask already on the host (every segment's, in source order)."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask
        self.kept = int(mask.sum())

    def masks(self) -> list[torch.Tensor]:
        return [self.mask]

    def keep_on(self, device) -> torch.Tensor:
        from ..cache_utils import to_device  # (here: importing the selectors stays free of transformers)

        return to_device(self.mask, device)


class StartedSelection:
    """A selection made and not yet read (`Selector.start`): the keep-masks on the host once the picks are there
    (`masks`, checked against the contract), or on a device without waiting for them (`keep_on`); ``count``: the
    rows kept, known without reading the picks (from the segments' sizes)."""

    def __init__(self, parts: list):
        self.parts = parts
        self.count = sum(p.kept for p in parts)

    @classmethod
    def fixed(cls, mask: torch.Tensor) -> "StartedSelection":
        """The selection of a keep-mask known on the host (``[n]`` bool, every segment's rows)."""
        return cls([_FixedPart(mask)])

    def masks(self) -> list[torch.Tensor]:
        """One host keep-mask per segment, in source order; raises where a selector broke the contract."""
        return [mask for part in self.parts for mask in part.masks()]

    def keep(self) -> torch.Tensor:
        """``[n]`` bool on the host: every segment's keep-mask in source order (`masks` concatenated)."""
        masks = self.masks()
        return torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)

    def keep_on(self, device) -> torch.Tensor:
        """``[n]`` bool on ``device``, every segment's keep-mask in source order, made where the picks are without
        reading them (unchecked: `masks` checks them)."""
        if not self.parts:
            return torch.zeros(0, dtype=torch.bool, device=device)
        return torch.cat([part.keep_on(device) for part in self.parts])


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

    def picks_checked_later(self, segments: list[Segment], context: SelectionContext) -> bool:
        return self.uses_kernels(segments, context)

    def select_group(self, segments: list[Segment], k: int, context: SelectionContext) -> list[torch.Tensor]:
        if self.uses_kernels(segments, context):
            from .kernels import greedy_select

            features = torch.stack([segment.features for segment in segments])
            return list(greedy_select(self.kernel, self.kernel_inputs(features, context), k))
        return super().select_group(segments, k, context)
