"""The vision tower replayed from a CUDA graph, one graph per image / video grid.

The tower is host-bound at batch 1: on the H200 its forward over one 1,344-token image took 36–40
ms of which ≈ 13 ms were kernels (27 blocks of small launches, and a video's per-frame attention
splits multiply them). Its data-dependent bookkeeping (rotary positions, the resampled position
embedding's taps and weights, window boundaries) depends only on ``grid_thw``; transformers lets a
caller pass it precomputed (the Qwen3 tower: ``interp_indices``, ``interp_weights``, ``position_ids``,
``cu_seqlens``, ``max_seqlen``; Qwen2.5-VL's also ``window_index`` / ``cu_window_seqlens``; see
``transformers.vision_utils``), and what is left is a fixed sequence of kernels for a given grid, which
a graph can hold. What a family's tower derives from a grid is its adapter's ``vision_grid_kwargs``.

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

from . import vision_attention
from .scoping import CAPTURE_LOCK, StreamOrder, graph_capture, used_on

MAX_GRAPHS = 4  # captured grids kept per tower (each holds its output buffers; intermediates share one pool)
CAPTURE_ON_SIGHTING = 2  # capture a grid the second time it is encoded
MAX_SIGHTINGS = 64  # grids remembered (seen, not captured yet)

_TOWERS: "weakref.WeakKeyDictionary[torch.nn.Module, VisionGraphs]" = weakref.WeakKeyDictionary()


def vision_graphs_for(adapter) -> "VisionGraphs":
    """The `VisionGraphs` of the adapter's vision tower (created on first use; held only as long as the tower
    lives)."""
    tower = adapter.vision_tower
    graphs = _TOWERS.get(tower)
    if graphs is None:
        graphs = _TOWERS[tower] = VisionGraphs(adapter)
    return graphs


def release_vision_graphs(tower: torch.nn.Module) -> None:
    """Drop the tower's captured graphs (and their memory pool)."""
    _TOWERS.pop(tower, None)


class CapturedTower(NamedTuple):
    """One captured tower forward: its graph, the static pixel input, the static outputs, and what else
    the graph reads by address (the precomputed index / weight tensors and the grid), kept alive with it:
    freed, their memory would be handed out again and a replay would gather with garbage indices."""

    graph: object
    pixels: torch.Tensor
    outputs: tuple
    reads: tuple = ()


class VisionGraphs:
    """Captured forwards of one vision tower, keyed by grid, pixel shape, dtype and attention backend.

    Built from a model's adapter (`models.base.ModelAdapter` with ``supports_vision_graphs``), whose static
    methods say where the pixels go (``vision_input_device``) and what the tower derives from a grid
    (``vision_grid_kwargs``); it keeps the adapter's class and a weak reference to the tower, never the model.
    """

    def __init__(self, adapter, use_graphs: bool | None = None):
        if not adapter.supports_vision_graphs:
            raise ValueError(f"{type(adapter).__name__}: this family's vision tower is not replayed from CUDA graphs")
        tower = adapter.vision_tower
        self.family = type(adapter)
        device = self.family.vision_input_device(tower)
        if use_graphs is None:
            use_graphs = device.type == "cuda" and torch.cuda.is_available()
        self.tower_ref = weakref.ref(tower)
        self.use_graphs = use_graphs
        self.failure: str | None = None  # why a capture failed (the graphs are off from then on), or None
        self.seen: dict[tuple, int] = {}
        self._captured: OrderedDict[tuple, CapturedTower] = OrderedDict()
        self._pool = None
        self._replay_lock = threading.Lock()
        self._order = StreamOrder()  # (replays from several CUDA streams: one after the other on the device too)

    def _key(self, tower, pixel_values: torch.Tensor, grid: tuple) -> tuple:
        # (with the one-kernel rotation on or off: `fast.vision_attention.one_kernel_rotation`, a benchmark's switch)
        return (grid, tuple(pixel_values.shape), tower.dtype, str(tower.config._attn_implementation),
                vision_attention.rotation_kernel_enabled())

    def _forward(self, tower, pixel_values: torch.Tensor, grid_thw: torch.Tensor, kwargs: dict):
        # the tower pops the precomputed entries from the dict it is given: pass a copy; its attention rotates
        # queries and keys in one kernel (`fast.vision_attention`)
        with vision_attention.vision_attention_scope(tower):
            out = tower(pixel_values, grid_thw=grid_thw, return_dict=True, **dict(kwargs))
        return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])

    def _capture(self, tower, key, pixel_values, grid_thw, kwargs):
        static_pixels = pixel_values.clone()
        with CAPTURE_LOCK:  # one capture at a time in the process (`fast.scoping`)
            # warm-up (lazy inits, cuBLAS workspaces) outside the capture, on the caller's stream (`fast.scoping`)
            self._forward(tower, static_pixels, grid_thw, kwargs)
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph, self._pool):
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
        pixel_values = pixel_values.to(self.family.vision_input_device(tower), tower.dtype)
        grid = tuple(tuple(int(v) for v in row) for row in grid_thw.tolist())
        key = self._key(tower, pixel_values, grid)
        captured = self._captured.get(key)
        if captured is None:
            kwargs = self.family.vision_grid_kwargs(tower, grid_thw)
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
                    self.failure = f"{type(error).__name__}: {error}"
        if captured is not None:
            self._captured.move_to_end(key)
            pooled, deepstack = captured.outputs
            # copy in, replay and copy out are queued as one unit: two threads encoding the same grid (the
            # demo serves several chats on one model) would otherwise replay on each other's pixels; on the
            # device too, when they queue on different streams
            with self._replay_lock:
                self._order.wait(pixel_values.device)
                # (its static tensors, made on the capturing thread's stream: freed, not reused before this replay)
                used_on((captured.pixels, captured.reads), device=pixel_values.device)
                captured.pixels.copy_(pixel_values)
                captured.graph.replay()
                pooled, deepstack = pooled.clone(), [d.clone() for d in deepstack]
                self._order.done(pixel_values.device)
        else:
            pooled, deepstack = self._forward(tower, pixel_values, grid_thw, kwargs)
        merge = int(tower.spatial_merge_size) ** 2
        sizes = [t * h * w // merge for t, h, w in grid]
        return SimpleNamespace(
            pooler_output=torch.split(pooled, sizes),
            deepstack_features=[torch.split(d, sizes) for d in deepstack] or None,
        )
