"""Attention for the fast path's few-query steps: a decode token, a fused ``[chunk, token]`` step.

A fast-path step attends from ``L`` query rows to every slot of the static cache under a boolean
visibility mask, so SDPA cannot take its flash kernel and, on the H200, picked cuDNN's masked kernel:
56 µs per layer for one query over 2,112 slots (36 layers: ≈ 2 ms of a 10.25 ms decode graph, in
`benchmarks/results/profile_qwen3_vl_8b_image_h200.json`), parallel only over the 32 heads. For few
queries the same attention is two small batched matmuls over the key/value heads (the query heads
of a group stacked as rows, GQA without repeating K/V) and a softmax, which spread over all slots
(`_few_query`, the reference form). On CUDA (outside compiled steps) one Triton kernel does it
(`_few_query_triton`, `fast._triton_attention`): each program one key/value head of one sequence over a
split of the slots with an online softmax, the splits merged after. At a batch of 8 sequences with
32-row chunk steps the matmul form wrote and re-read float32 scores and masks several times per layer
(227-342 µs per layer on the H200, `bench attention --batch`).

`few_query_attention` is registered with transformers' `AttentionInterface` (on first use, not at
import) and selected only inside a fast-path step of the calling thread, and only when the model runs
``sdpa``: `fast.scoping.step_scope` gives each attention module a view of its config that names it
there, while the model's config itself keeps ``sdpa`` (other threads never see the switch). Rows above
`FEW_QUERY_MAX` (prefills) and anything it does not handle go to stock `sdpa_attention_forward`,
which is also its reference in the tests.

Precision: scores in float32 (a bf16 score of magnitude ~10 would carry an error of ~0.04 into the
exponent), probabilities cast to the value dtype for the second product, as flash attention does. On CUDA
with half-precision inputs the first product reads the bf16 / fp16 keys as they are and accumulates and
returns float32 (``torch.bmm(..., out_dtype=torch.float32)``, `_scores`): the same products as upcasting
first (a product of two bf16 numbers is exact in float32) without writing a float32 copy of every key, which
at a batch of 8 sequences was most of a decode step's attention time (an fp32 GEMM of 47 µs per layer on the
H200). On the CPU, and inside compiled steps (Inductor fuses the upcast there), the keys are upcast.
"""

from __future__ import annotations

import functools
import os
import threading

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .._triton import cdiv, pow2, triton_available

FEW_QUERY_MAX = 64  # query rows up to which the matmul form runs (decode: 1, fused chunk 31: 32)
NAME = "raincheck_few_query_sdpa"
ENABLED = True  # the fast path uses it (False: stock sdpa inside the steps as well)


def few_query_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """``query [B, Hq, L, D]``, ``key``/``value [B, Hkv, S, D]``, ``attention_mask [B | 1, 1, L, S]`` (bool,
    True = visible) -> ``([B, L, Hq, D], None)``, what `sdpa_attention_forward` returns."""
    b, hq, rows, d = query.shape
    hkv = key.shape[1]
    usable = (
        rows <= FEW_QUERY_MAX and dropout == 0.0 and attention_mask is not None
        and attention_mask.dtype == torch.bool and attention_mask.shape[1] == 1 and hq % hkv == 0
        and kwargs.get("softcap") is None and not kwargs.get("output_attentions", False)
        and value.shape[-1] == d
    )
    if not usable:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = d ** -0.5 if scaling is None else scaling
    from .context import active_scope

    scope = active_scope()
    if scope is not None and scope.compiled_attention:  # compile_steps: the same function, fused by Inductor
        from .compiled import compiled_copy

        # the query as the attention modules make it, ``[B, L, Hq, D]`` before their transpose (contiguous, whatever
        # the row count: one layout, one graph; a copy only where a family made it otherwise)
        rows_first = query.transpose(1, 2).contiguous()
        # one compiled copy per head shape, its head counts static: a graph for one row (the decode step's core,
        # specialised to it) and one for several (its row count dynamic)
        core = compiled_copy(_few_query_rows, (hq, hkv, d), sizes=_FEW_QUERY_SIZES)
        return core(rows_first, key, value, attention_mask, scale), None
    if triton_usable(query, key, value, attention_mask):
        return _few_query_triton(query, key, value, attention_mask, scale, _per_sequence(scope, "key_extent", query),
                                 _per_sequence(scope, "query_rows", query)), None
    return _few_query(query, key, value, attention_mask, scale, low_precision_reads=True), None


def triton_usable(query, key, value, attention_mask) -> bool:
    """Whether `_few_query_triton` takes these inputs: CUDA tensors (or Triton's interpreter,
    ``TRITON_INTERPRET=1``, as the CPU tests run it), one dtype among fp32 / bf16 / fp16, a power-of-two head
    dim of 16 to 256, the last axis of every input contiguous, a boolean mask ``[B | 1, 1, L, S]``."""
    if not (query.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") or not triton_available():
        return False
    d = query.shape[-1]
    return (query.dtype in (torch.float32, torch.bfloat16, torch.float16) and key.dtype == query.dtype
            and value.dtype == query.dtype and 16 <= d <= 256 and d & (d - 1) == 0 and value.shape[-1] == d
            and query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1
            and attention_mask.dtype == torch.bool and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
            and attention_mask.shape[0] in (1, query.shape[0]) and attention_mask.device == query.device)


BLOCK_N = 64  # key slots per tile (the first choice; `launch_tiles`)
NUM_STAGES = 3  # Triton's software-pipelining depth on NVIDIA GPUs when a launch names none (the first choice)
_TINY = 1e-30  # below any real row's softmax sum (>= 1)
# (key slots per tile, pipelining stages), from the most shared memory a program takes to the least
TILE_CHOICES = ((BLOCK_N, NUM_STAGES), (BLOCK_N, 2), (32, 2), (BLOCK_N, 1), (32, 1), (16, 1))
_TILES: dict = {}  # (head dim, element size, query rows per program, device) -> (BLOCK_N, num_stages) in use
_TILES_LOCK = threading.Lock()


def _per_sequence(scope, name: str, query) -> torch.Tensor | None:
    """The step's per-sequence bound ``name`` (`fast.context.StepScope`'s ``key_extent``: no row of sequence ``b``
    sees a slot at or past ``extent[b]``; ``query_rows``: its query positions from ``rows[b]`` on are padding) where it
    fits this call's batch, else None (every slot, every row)."""
    bound = None if scope is None else getattr(scope, name)
    if bound is None or bound.dim() != 1 or bound.shape[0] != query.shape[0] or bound.device != query.device:
        return None
    return bound


def _block_m(group_rows: int) -> int:
    """Query rows (a group's heads x positions) per program: a power of two from 16 (`tl.dot`'s least) to 64."""
    return min(64, pow2(group_rows, 16))


def shared_bytes(d: int, itemsize: int, block_m: int, block_n: int, stages: int) -> int:
    """The shared memory one program of `fast._triton_attention.few_query_split` asks for: ``stages`` pipelined
    copies of a key and a value tile (``block_n x d`` each), its query block (``block_m x d``) and a mask tile
    (``block_m x block_n`` bytes). On an H100 with 256-dim bf16 heads, 64-row blocks, 64-slot tiles and 3 stages
    this is 233,472 bytes, the figure Triton reported when it refused that launch (its limit there: 232,448)."""
    return stages * 2 * block_n * d * itemsize + block_m * d * itemsize + block_m * block_n


def launch_tiles(d: int, itemsize: int, block_m: int, limit: int | None) -> tuple[int, int]:
    """The first of `TILE_CHOICES` whose `shared_bytes` fit ``limit`` (a program's shared memory on the device;
    None: Triton's interpreter, which has no such limit: the first choice). Half-precision heads of up to 128 dims
    take the first choice on an A100 / H100 / H200 (Qwen3-VL, Qwen2.5-VL: the kernel as before); Qwen3.5's 256-dim
    heads in bf16 at 64-row blocks take 2 stages on a Hopper GPU (3 do not fit); float32 inputs (the tiny test
    models) take fewer stages at 128 dims and more at their own small head dims."""
    if limit is None:
        return TILE_CHOICES[0]
    for block_n, stages in TILE_CHOICES:
        if shared_bytes(d, itemsize, block_m, block_n, stages) <= limit:
            return block_n, stages
    return TILE_CHOICES[-1]


@functools.lru_cache(maxsize=None)
def _shared_limit(device) -> int | None:
    """A program's shared memory on ``device`` (the opt-in maximum, the limit Triton checks a launch against);
    None off CUDA (Triton's interpreter)."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    limit = getattr(props, "shared_memory_per_block_optin", None)
    if not limit:
        import triton

        limit = triton.runtime.driver.active.utils.get_device_properties(_device_index(device))["max_shared_mem"]
    return int(limit)


def _device_index(device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _tiles(d: int, itemsize: int, block_m: int, device) -> tuple[int, int]:
    key = (d, itemsize, block_m, device)
    tiles = _TILES.get(key)
    if tiles is None:
        with _TILES_LOCK:
            tiles = _TILES.setdefault(key, launch_tiles(d, itemsize, block_m, _shared_limit(device)))
    return tiles


def _smaller_tiles(key, failed: tuple[int, int]) -> tuple[int, int] | None:
    """After a launch with ``failed`` tiles ran out of shared memory (the estimate was short on this Triton): the
    next choice, kept for ``key`` from then on; None when none is left."""
    later = TILE_CHOICES[TILE_CHOICES.index(failed) + 1:]  # (every tiles in use are one of the choices)
    if not later:
        return None
    with _TILES_LOCK:
        _TILES[key] = later[0]
    return later[0]


def split_count(programs: int, slots: int, processors: int, block_n: int = BLOCK_N) -> int:
    """Splits of the key slots so that ``programs`` x splits fill about two waves of ``processors``; at least one,
    at most one per ``block_n`` tile."""
    want = cdiv(2 * max(1, processors), max(1, programs))
    return max(1, min(want, cdiv(slots, block_n)))


@functools.lru_cache(maxsize=None)
def _processors(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # the interpreter: two splits, so the CPU tests cover the merge


def _few_query_triton(query, key, value, attention_mask, scale: float, extent: torch.Tensor | None = None,
                      query_rows: torch.Tensor | None = None):
    """`_few_query` as one Triton kernel over the key slots in splits (`fast._triton_attention`), then the splits'
    merge; ``[B, L, Hq, D]`` in the value dtype. ``extent`` (``[B]`` integers, on the device): sequence ``b``'s
    rows see no slot at or past ``extent[b]`` (the caller's promise), so its programs read its keys only up to
    there (the same result in exact arithmetic: the slots skipped are ones its mask hides; on a GPU within the
    rounding of its sums); None: every slot.
    ``query_rows`` (``[B]``): sequence ``b``'s query positions from ``query_rows[b]`` on are padding, whose output
    nobody reads: row blocks of padding only are not computed (their output is 0; the other rows' is the same, as
    above); None: every row computed.
    The key tile and the pipelining depth are the largest whose shared memory fits the device (`launch_tiles`:
    256-dim heads do not fit the first choice on a Hopper GPU), the next smaller if Triton still refuses a launch."""
    from . import _triton_attention as kernels

    b, hq, rows, d = query.shape
    hkv, slots = key.shape[1], key.shape[2]
    group = hq // hkv
    group_rows = group * rows
    block_m = _block_m(group_rows)
    m_blocks = cdiv(group_rows, block_m)
    key_of_tiles = (d, query.element_size(), block_m, query.device)
    tiles = _tiles(*key_of_tiles)
    mask = attention_mask.view(torch.uint8)
    has_extent, has_rows = extent is not None, query_rows is not None
    while True:
        block_n, stages = tiles
        splits = split_count(b * hkv * m_blocks, slots, _processors(query.device), block_n)
        split_len = cdiv(cdiv(slots, splits), block_n) * block_n  # whole tiles per split
        splits = cdiv(slots, split_len)  # (rounding up to whole tiles may leave the last split empty: drop it)
        out = torch.empty(splits, b * hkv, group_rows, d, device=query.device, dtype=torch.float32)
        peak = torch.empty(splits, b * hkv, group_rows, device=query.device, dtype=torch.float32)
        total = torch.empty_like(peak)
        try:
            kernels.few_query_split[(b * hkv, m_blocks, splits)](
                query, key, value, mask, extent.long() if has_extent else mask,
                query_rows.long() if has_rows else mask,
                out, peak, total, slots, hkv, group, rows, split_len, float(scale),
                query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
                value.stride(0), value.stride(1), value.stride(2), mask.stride(0) if mask.shape[0] > 1 else 0,
                mask.stride(2), mask.stride(3), D=d, BLOCK_M=block_m, BLOCK_N=block_n,
                IEEE=query.dtype == torch.float32, HAS_EXTENT=has_extent, HAS_ROWS=has_rows, num_warps=4,
                num_stages=stages)
            break
        except kernels.OutOfResources:  # (raised before anything is launched: retrying is safe, even in a capture)
            tiles = _smaller_tiles(key_of_tiles, tiles)
            if tiles is None:
                raise
    # (a row's sum is at least 1 wherever it saw a slot, every real row sees itself; the padding rows a block skipped
    # have none: their output is 0, not 0 / 0)
    if splits == 1:
        merged = out[0] / (total[0, ..., None] if not has_rows else total[0, ..., None].clamp_min(_TINY))
    else:
        weight = torch.exp(peak - peak.amax(0))  # [splits, B * Hkv, rows]
        norm = (total * weight).sum(0)[..., None]
        merged = (out * weight[..., None]).sum(0) / (norm if not has_rows else norm.clamp_min(_TINY))
    # rows are position-major within a key/value head's group: [B, Hkv, L, G, D] -> [B, L, Hkv * G, D]
    return merged.to(value.dtype).view(b, hkv, rows, group, d).transpose(1, 2).reshape(b, rows, hq, d)


def low_precision_scores(query, key) -> bool:
    """Whether `_scores` can read half-precision keys as they are (CUDA, bf16 / fp16, torch's ``out_dtype``)."""
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and key.dtype == query.dtype
            and hasattr(torch.ops.aten.bmm, "dtype"))


def _scores(q, key, scale: float, low_precision_reads: bool):
    """``scale * q @ key^T`` in float32, ``q [B, Hkv, M, D]`` and ``key [B, Hkv, S, D]`` -> ``[B, Hkv, M, S]``.

    With ``low_precision_reads`` on CUDA half-precision inputs: one batched product over (B, Hkv) that reads the
    keys in their dtype and accumulates into a float32 result (no float32 copy of the keys); otherwise both
    operands upcast first (the reference form; also what compiled steps trace)."""
    if low_precision_reads and low_precision_scores(q, key):
        b, hkv, m, d = q.shape
        s = key.shape[2]
        scores = torch.bmm(q.reshape(b * hkv, m, d), key.reshape(b * hkv, s, d).transpose(1, 2),
                           out_dtype=torch.float32)
        return scores.view(b, hkv, m, s).mul_(scale)
    return torch.matmul(q.float() * scale, key.float().transpose(-1, -2))


def _few_query(query, key, value, attention_mask, scale: float, low_precision_reads: bool = False):
    """The matmul form (see `few_query_attention`); ``[B, L, Hq, D]``."""
    b, hq, rows, d = query.shape
    hkv = key.shape[1]
    group = hq // hkv
    # query head h reads key/value head h // group: stack a group's queries as rows of its key/value head
    q = query.reshape(b, hkv, group * rows, d)
    scores = _scores(q, key, scale, low_precision_reads)  # [B, Hkv, group * L, S], float32
    visible = attention_mask[:, :, None].expand(-1, hkv, group, -1, -1).reshape(attention_mask.shape[0], hkv,
                                                                                 group * rows, -1)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, Hkv, group * L, D]
    return out.reshape(b, hq, rows, d).transpose(1, 2).contiguous()


def _few_query_rows(query_rows, key, value, attention_mask, scale: float):
    """`_few_query` of the query given as ``[B, L, Hq, D]``: the compiled steps' form (`fast.compiled`), its head
    counts and dims static, its slot count dynamic, one graph for a single row and one for several.

    Its rows are not marked unbacked, as the decoder regions' are (`fast.compiled.mark_rows`, one graph for every row
    count): that graph (with the mask's rows and Inductor told there are rows, ``torch._check``) compiled, but in a
    Qwen3-VL-8B decode step on an H100 each token took 9.32 ms against 8.78 with the one-row graph (a cold-start run
    of the twenty-seventh session): the decode step's core is the one worth specialising."""
    return _few_query(query_rows.transpose(1, 2), key, value, attention_mask, scale)


# `_few_query_rows`'s dimensions that vary between calls, for `fast.compiled.compiled`: the query's rows and the
# mask's (1 specialised, several dynamic), the keys', values' and mask's slots
_FEW_QUERY_SIZES = {0: (1,), 1: (2,), 2: (2,), 3: (2, 3)}


def register() -> None:
    """Make `NAME` a valid attention implementation (once; adding a name changes nothing for other models)."""
    from transformers import AttentionInterface

    if NAME not in AttentionInterface().valid_keys():
        AttentionInterface.register(NAME, few_query_attention)
