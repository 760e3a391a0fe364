"""The vision tower replayed from a CUDA graph, one graph per image / video grid.

The tower is host-bound at batch 1: on the H200 its forward over one 1,344-token image took 36–40
ms of which ≈ 13 ms were kernels (27 blocks of small launches, and a video's per-frame attention
splits multiply them). Its data-dependent bookkeeping (rotary positions, the resampled position
embedding's taps and weights, window boundaries) depends only on ``grid_thw``; transformers lets a
caller pass it precomputed (``interp_indices``, ``interp_weights``, ``position_ids``, ``cu_seqlens``,
``max_seqlen``, see ``transformers.vision_utils``), and what is left is a fixed sequence of
kernels for a given grid, which a graph can hold.

Policy: a grid is captured the second time it is seen (a one-off image size never pays for a
capture; a chat or a benchmark that repeats a size replays from then on); at most `MAX_GRAPHS`
graphs per tower, the least recently used evicted. Outputs are cloned out of the graph's buffers,
so a later replay never overwrites what a caller holds.

Without graphs (``use_graphs=False``: CPU, or a capture that failed) the same precomputed call
runs eagerly: it is what CPU tests compare with the stock ``get_image_features``.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import OrderedDict
from types import SimpleNamespace
from typing import NamedTuple

import torch

from .scoping import CAPTURE_LOCK

MAX_GRAPHS = 4  # captured grids kept per tower (each holds its output buffers; intermediates share one pool)
CAPTURE_ON_SIGHTING = 2  # capture a grid the second time it is encoded
MAX_SIGHTINGS = 64  # grids remembered (seen, not captured yet)

_TOWERS: "weakref.WeakKeyDictionary[torch.nn.Module, VisionGraphs]" = weakref.WeakKeyDictionary()


def vision_graphs_for(tower: torch.nn.Module) -> "VisionGraphs":
    """The tower's `VisionGraphs` (created on first use; held only as long as the tower lives)."""
    graphs = _TOWERS.get(tower)
    if graphs is None:
        graphs = _TOWERS[tower] = VisionGraphs(tower)
    return graphs


def release_vision_graphs(tower: torch.nn.Module) -> None:
    """Drop the tower's captured graphs (and their memory pool)."""
    _TOWERS.pop(tower, None)


def _uses_flash_varlen(tower) -> bool:
    return "flash" in str(getattr(tower.config, "_attn_implementation", "") or "")


def grid_kwargs(tower, grid_thw: torch.Tensor) -> dict:
    """What the tower derives from ``grid_thw`` on the host, computed ahead (the keyword names the
    tower pops from its kwargs). ``cu_seqlens`` stays on the host for the SDPA / eager backends,
    which only read the window lengths from it (a device tensor would be read back inside the graph)."""
    from transformers.utils.generic import get_max_seqlen
    from transformers.vision_utils import (
        get_vision_attention_seqlens,
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    device = tower.patch_embed.proj.weight.device
    grid = grid_thw.to("cpu")
    indices, weights = get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=tower.num_grid_per_side, mode=tower.interpolation_mode,
        align_corners=tower.interpolation_align_corners, spatial_merge_size=tower.config.spatial_merge_size,
    )
    position_ids = get_vision_position_ids(grid, tower.spatial_merge_size)
    cu_seqlens, _ = get_vision_attention_seqlens(grid, tower.config)
    kwargs = {"interp_indices": indices.to(device), "interp_weights": weights.to(device),
              "position_ids": position_ids.to(device)}
    if _uses_flash_varlen(tower):
        kwargs["cu_seqlens"] = cu_seqlens.to(device)
        kwargs["max_seqlen"] = get_max_seqlen(cu_seqlens, tower.config)
    else:
        kwargs["cu_seqlens"] = cu_seqlens
    return kwargs


class CapturedTower(NamedTuple):
    """One captured tower forward: its graph, the static pixel input, the static outputs, and what else
    the graph reads by address (the precomputed index / weight tensors and the grid), kept alive with it:
    freed, their memory would be handed out again and a replay would gather with garbage indices."""

    graph: object
    pixels: torch.Tensor
    outputs: tuple
    reads: tuple = ()


class VisionGraphs:
    """Captured forwards of one vision tower, keyed by grid, pixel shape, dtype and attention backend."""

    def __init__(self, tower: torch.nn.Module, use_graphs: bool | None = None):
        device = tower.patch_embed.proj.weight.device
        if use_graphs is None:
            use_graphs = device.type == "cuda" and torch.cuda.is_available()
        self.tower_ref = weakref.ref(tower)
        self.use_graphs = use_graphs
        self.seen: dict[tuple, int] = {}
        self._captured: OrderedDict[tuple, CapturedTower] = OrderedDict()
        self._pool = None
        self._replay_lock = threading.Lock()

    def _key(self, tower, pixel_values: torch.Tensor, grid: tuple) -> tuple:
        return (grid, tuple(pixel_values.shape), tower.dtype, str(tower.config._attn_implementation))

    def _forward(self, tower, pixel_values: torch.Tensor, grid_thw: torch.Tensor, kwargs: dict):
        # the tower pops the precomputed entries from the dict it is given: pass a copy
        out = tower(pixel_values, grid_thw=grid_thw, return_dict=True, **dict(kwargs))
        return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])

    def _capture(self, tower, key, pixel_values, grid_thw, kwargs):
        static_pixels = pixel_values.clone()
        with CAPTURE_LOCK:  # one capture at a time in the process (`fast.scoping`)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up (lazy inits, cuBLAS workspaces) outside the capture
                self._forward(tower, static_pixels, grid_thw, kwargs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                outputs = self._forward(tower, static_pixels, grid_thw, kwargs)
            self._pool = graph.pool()
        return self._store(key, CapturedTower(graph, static_pixels, outputs, (kwargs, grid_thw)))

    def _store(self, key, entry: CapturedTower) -> CapturedTower:
        """Keep ``entry`` under ``key``, evicting the least recently used beyond `MAX_GRAPHS`."""
        self._captured[key] = entry
        while len(self._captured) > MAX_GRAPHS:
            self._captured.popitem(last=False)
        return entry

    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        """The tower on ``pixel_values`` / ``grid_thw`` as ``get_image_features`` returns it: ``pooler_output``
        and ``deepstack_features`` (one tuple per DeepStack layer, or None) split per image / video."""
        tower = self.tower_ref()
        if tower is None:
            raise RuntimeError("the vision tower these graphs belong to was freed")
        pixel_values = pixel_values.to(tower.patch_embed.proj.weight.device, tower.dtype)
        grid = tuple(tuple(int(v) for v in row) for row in grid_thw.tolist())
        key = self._key(tower, pixel_values, grid)
        captured = self._captured.get(key)
        if captured is None:
            kwargs = grid_kwargs(tower, grid_thw)
            sightings = self.seen.pop(key, 0) + 1
            self.seen[key] = sightings
            while len(self.seen) > MAX_SIGHTINGS:  # a bounded memory of grids seen once
                self.seen.pop(next(iter(self.seen)))
            if self.use_graphs and sightings >= CAPTURE_ON_SIGHTING:
                try:
                    captured = self._capture(tower, key, pixel_values, grid_thw, kwargs)
                except RuntimeError as error:  # an op that cannot be captured: this tower runs eagerly from now on
                    warnings.warn(f"raincheck fast path: CUDA-graph capture of the vision tower failed ({error}); "
                                  "running it eagerly instead.", RuntimeWarning, stacklevel=2)
                    self.use_graphs, self._captured, self._pool = False, OrderedDict(), None
        if captured is not None:
            self._captured.move_to_end(key)
            pooled, deepstack = captured.outputs
            # copy in, replay and copy out are queued as one unit: two threads encoding the same grid (the
            # demo serves several chats on one model) would otherwise replay on each other's pixels
            with self._replay_lock:
                captured.pixels.copy_(pixel_values)
                captured.graph.replay()
                pooled, deepstack = pooled.clone(), [d.clone() for d in deepstack]
        else:
            pooled, deepstack = self._forward(tower, pixel_values, grid_thw, kwargs)
        merge = int(tower.spatial_merge_size) ** 2
        sizes = [t * h * w // merge for t, h, w in grid]
        return SimpleNamespace(
            pooler_output=torch.split(pooled, sizes),
            deepstack_features=[torch.split(d, sizes) for d in deepstack] or None,
        )
