"""The Gated DeltaNet layer forward of the three engines: the layer dispatch of docs/method.md §4, §5.

Every engine forward's rows, as a GDN layer sees them, are ``[deferred chunk (optional), rest]`` where the rest
is a turn's input rows, one generated row, or nothing. For the duration of one engine forward (or fast-path
step, or packed forward) the ``forward`` of each ``Qwen3_5GatedDeltaNet`` *instance* (and of its four input
projections) goes through a dispatcher (`_patch`; nothing is patched at import or on the class). There is one
way in, `_scope`: the patches are reference-counted per instance (`patching.CountedPatches`) and the context of
the forward is set for the calling thread only (`patching.ThreadScoped`), so a stock forward of the same model
in another thread runs the original code, and overlapping Raincheck forwards in several threads are fine.
Three contexts, one per engine, each naming its layer forward:

- `eager_forward` (`_StreamContext`, `_split_gdn_forward`, on a `DeferredDynamicCache`): the eager engine.
  Through `gdn.eager.EagerGDNState`, it

  1. runs the chunk through the stock module forward on a `BoundaryStateView` (from the boundary state and conv
     history, so it never sees generated rows), giving S_b', h_b';
  2. joins: ``S_live += M_R (S_L' - S_L)`` with the leading-segment conv repair (`SuffixStateMap.join`),
     written back into HF's cache layer;
  3. runs the rest through the stock module forward on the real cache (from the corrected live state),
     recording the ``in_proj_qkv`` / ``in_proj_a`` / ``in_proj_b`` outputs of those rows (pre-conv and gate
     inputs), then extends the suffix (generated row) or moves the boundary after the input rows (prefill).

  All GDN math (conv, delta rule, gated norm, projections) is transformers' own module code; the only extra
  arithmetic is the join (one ``[dk, dk] @ [dk, dv]`` matmul per head plus at most ``Kc - 1`` rank-1 updates)
  and ``M_R <- A_t M_R`` for the generated row. Weights are read once per fused forward, as docs/method.md §5
  wants: the GDN input projections (``in_proj_*``) run once over ``[chunk, token]`` and the projection
  dispatchers hand each stream its rows. Only ``out_proj`` and the conv / delta-rule kernels run once per
  stream: they sit after the join, inside the module forward.

- `static_step` (`_StaticStepContext`, `_static_gdn_forward`, on a `StaticDeferredCache`): the fast path. The
  same steps on `gdn.static.StaticGDNState` buffers, for rows ``[deferred rows, padding, rest]``: the chunk
  from the boundary (how many rows are real is a device scalar, so padding gets ``g = 0, beta = 0`` and stays
  out of the conv history), the join, the rest from the corrected live state, then ``M <- A_t M`` (or the
  leading segment's record for the first ``Kc - 1`` suffix tokens) for a generated row while deferred rows are
  pending, or the boundary reset after input rows. What the host decides (is the row recorded, as a leading
  token or into M) is part of the step's captured-graph key (`StaticSplit`); the suffix length comes as a
  device scalar. Decode, fused and idle-time chunk steps (up to `RECURRENT_CHUNK_MAX` deferred rows, token by
  token through `gdn.kernels`) are captured, and so are prefills of input rows only, padded in front to a
  bucket (``[padding, input rows]``: padding gets ``g = 0, beta = 0`` and the conv history is moved next to the
  first input row, `StaticGDNState.run_input`; the chunked rule runs all rows). A prefill with leftover
  deferred rows in front, and chunks longer than that, run eagerly (the chunked rule).

- `packed_step` (`_PackedStepContext`, `_packed_gdn_forward`): the batched eager engine, several sequences in
  one packed forward, each sequence's states a row of `batched_gdn.PackedGDNStates`.

Kernels: on CPU (and on CUDA without ``flash-linear-attention``) transformers runs its torch fallbacks, whose
state layout ``[B, HV, K, V]`` is the one `gdn.algebra` uses. When ``fla`` (or a hub kernel) is importable
transformers uses it instead; `check_state_layout` checks once per device type and layout, numerically, that the
state is still ``[B, HV, K, V]`` (a transposed state would pass every shape check when ``dk == dv``, as in real
Qwen3.5) and refuses otherwise. The CPU tests exercise the torch fallbacks; the fla path runs in the GPU tests and
benchmarks.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass

import torch

from ..cache_utils import DEFERRED, GENERATED, INPUT
from ..patching import CountedPatches, ThreadScoped, module_function, patched_for_thread
from .algebra import GDNLayerParams, gdn_gates, l2norm, naive_recurrent_gated_delta
from .eager import EagerGDNState

__all__ = ["RECURRENT_CHUNK_MAX", "ProbeLayout", "RowSplit", "StaticSplit", "check_state_layout", "eager_forward",
           "layer_params", "packed_step", "static_packed_step", "static_step"]

_KIND_NAMES = {INPUT: "INPUT", DEFERRED: "DEFERRED", GENERATED: "GENERATED"}


@dataclass(frozen=True)
class RowSplit:
    """How one forward's ``L`` rows split for the GDN layers: ``n_deferred`` leading deferred rows,
    then ``n_rest`` rows of kind ``rest_kind`` (INPUT or GENERATED; None when there are none)."""

    n_deferred: int
    n_rest: int
    rest_kind: int | None

    @classmethod
    def from_kinds(cls, kinds: torch.Tensor | None, length: int) -> "RowSplit":
        if kinds is None:
            raise ValueError(
                "Qwen3.5's Gated DeltaNet layers need the row kinds of every forward (INPUT / DEFERRED / GENERATED) "
                "to place deferred rows at the insertion boundary; pass kinds= (run_rows does)."
            )
        kinds = torch.as_tensor(kinds, dtype=torch.int8).expand(length).cpu()
        is_deferred = kinds == DEFERRED
        n_deferred = int(is_deferred.sum())
        if n_deferred and not bool(is_deferred[:n_deferred].all()):
            raise ValueError(f"deferred rows must come first in a forward; got kinds {kinds.tolist()}.")
        rest = kinds[n_deferred:]
        rest_kinds = set(rest.tolist())
        if len(rest_kinds) > 1 or rest_kinds - {INPUT, GENERATED}:
            names = sorted(_KIND_NAMES.get(k, str(k)) for k in rest_kinds)
            raise ValueError(
                f"after the deferred rows a forward holds either input rows or generated rows, not {names}."
            )
        if GENERATED in rest_kinds and rest.numel() != 1:
            raise ValueError(f"a decode forward consumes exactly one generated row, got {rest.numel()}.")
        return cls(n_deferred, int(rest.numel()), rest_kinds.pop() if rest_kinds else None)


_IN_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b")
_RECORDED = {"in_proj_qkv": "qkv", "in_proj_a": "a", "in_proj_b": "b"}  # what the suffix map keeps


@dataclass
class _StreamContext:
    """One engine forward, as the GDN layers see it: the cache, the row split, and per projection
    module either the rows it should hand out (a fused forward's stream) or nothing."""

    cache: object
    split: RowSplit
    modules: frozenset  # ids of the GDN modules of this model
    serving: dict  # id(projection) -> precomputed rows of the stream that runs now
    recorded: dict  # "qkv" / "a" / "b" -> the last output of that projection

    def layer_forward(self, module, original, hidden_states, **kwargs):
        return _split_gdn_forward(module, original, self, hidden_states, **kwargs)


# The active engine forward of *this* thread (or task): the dispatchers below read it, so a stock
# forward of the same model in another thread, while a Raincheck forward runs, is left untouched.
_ACTIVE = ThreadScoped("raincheck_gdn_forward")  # a context of this module, for the thread that set it only
_PATCHES = CountedPatches()  # the GDN modules routed through the dispatchers (counted per instance)


def _dispatch_gdn(module, original, hidden_states, *args, **kwargs):
    ctx = _ACTIVE.get()
    if ctx is None or id(module) not in ctx.modules:
        return original(hidden_states, *args, **kwargs)
    if args:  # the decoder layer passes everything by keyword; be strict rather than guess
        raise TypeError("the Raincheck GDN split forward takes hidden_states and keyword arguments only.")
    return ctx.layer_forward(module, original, hidden_states, **kwargs)


def _dispatch_projection(projection, original, name, x, *args, **kwargs):
    ctx = _ACTIVE.get()
    if ctx is None:
        return original(x, *args, **kwargs)
    served = ctx.serving.get(id(projection))
    if served is None:
        out = original(x, *args, **kwargs)
    elif x.shape[:-1] != served.shape[:-1]:
        raise RuntimeError(f"{name} was called on {list(x.shape)} while serving precomputed rows {list(served.shape)}.")
    else:
        out = served
    if name in _RECORDED:
        ctx.recorded[_RECORDED[name]] = out  # the last call wins: the rest stream runs after the chunk stream
    return out


def layer_params(module) -> GDNLayerParams:
    """The GDN layer's conv / gate parameters with their data, also under accelerate offload.

    With cpu / disk offload (``device_map`` with "cpu" / "disk" entries, `cpu_offload`) ``A_log``, ``dt_bias``
    and ``conv1d.weight`` sit on ``meta`` outside their own module's forward, while the state map needs them
    around it (`SuffixStateMap.join` / ``append_suffix``). Their hooks load them onto the execution device
    for the span of `align_module_device`; the detached references kept in `GDNLayerParams` stay valid after
    the hooks put the modules back on ``meta`` (one small copy per layer and forward, offloaded models only).
    """
    tensors = (module.A_log, module.dt_bias, module.conv1d.weight, module.conv1d.bias)
    if not any(t is not None and t.device.type == "meta" for t in tensors):
        return GDNLayerParams.from_module(module)
    from accelerate.utils import align_module_device

    with align_module_device(module), align_module_device(module.conv1d):
        params = GDNLayerParams.from_module(module)
    if any(t is not None and t.device.type == "meta" for t in (params.A_log, params.dt_bias, params.conv_weight)):
        raise RuntimeError(
            f"Gated DeltaNet layer {module.layer_idx}: its parameters are on the meta device and no accelerate "
            "offload hook loads them; load the model with weights (or dispatch it with accelerate)."
        )
    return params


def _split_gdn_forward(module, original, ctx: _StreamContext, hidden_states, **kwargs):
    """``Qwen3_5GatedDeltaNet.forward`` for rows ``[deferred chunk, rest]`` on a `DeferredDynamicCache` (the
    eager engine; see the module docstring)."""
    cache = kwargs.pop("cache", None)
    if cache is not ctx.cache:
        raise RuntimeError("a Gated DeltaNet layer ran on another cache than the Raincheck forward's own.")
    kwargs.pop("attention_mask", None)  # no padding in Raincheck batches; the mask mapping gives None anyway
    split = ctx.split
    state = EagerGDNState(cache, module.layer_idx, layer_params(module))
    n_d = split.n_deferred
    projections = [getattr(module, name) for name in _IN_PROJECTIONS]
    shared = None
    if n_d and split.n_rest:
        # Fusion: each input projection multiplies [chunk, rest] once; the streams get their rows.
        shared = [proj(hidden_states) for proj in projections]
    outs = []
    try:
        if n_d:
            if shared is not None:
                ctx.serving.update({id(p): out[:, :n_d] for p, out in zip(projections, shared)})
            outs.append(state.run_chunk(lambda view: original(hidden_states[:, :n_d], cache=view, **kwargs)))
            state.join()
        if split.n_rest:
            ctx.recorded.clear()
            if shared is not None:
                ctx.serving.update({id(p): out[:, n_d:] for p, out in zip(projections, shared)})
            outs.append(state.run_rest(lambda live: original(hidden_states[:, n_d:], cache=live, **kwargs)))
            if split.rest_kind == GENERATED:
                # The suffix map is only needed while deferred rows wait to be joined at this boundary;
                # with none pending (full, hard, or all restored) no join can follow before the next
                # turn's input resets the boundary, so skip the per-token M update.
                if cache.num_pending:
                    state.record(ctx.recorded["qkv"], ctx.recorded["a"], ctx.recorded["b"])
            else:  # a turn's input: its own deferred rows go after it
                state.reset_boundary()
    finally:
        ctx.serving.clear()
        ctx.recorded.clear()
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


# ---- the fast path: the same split forward on the static cache's buffers ------------------------------

# Deferred rows of a fast-path step up to this many run the recurrent rule token by token in one kernel (a
# captured chunk step: c = 31 by default); longer ones (an idle-time restore of everything at once, a large
# chunk size) transformers' chunked rule, eagerly.
RECURRENT_CHUNK_MAX = 64

@dataclass(frozen=True)
class StaticSplit:
    """What a fast-path step's GDN layers run (part of its captured graph's key): the last ``n_rest`` rows
    are of kind ``rest_kind`` (INPUT, GENERATED or None), the rows before them are deferred rows and
    padding; a generated row is recorded as a ``"lead"`` token (the suffix's first ``Kc - 1``), into the
    suffix map (``"map"``), or not at all (None: nothing is pending any more, so no join can follow before
    the next turn's input moves the boundary)."""

    n_rest: int
    rest_kind: int | None
    record: str | None = None
    # a turn's input rows with no deferred rows in front: the step's rows are ``[padding, input rows]``, how
    # many are padding is the device scalar ``step_info[2]`` (``n_rest`` is then 0), so one captured graph
    # serves every prefill of a bucket (`StaticGDNState.run_input`)
    padded_input: bool = False


@dataclass
class _StaticStepContext:
    """One fast-path step, as the GDN dispatchers see it (the projections run unchanged)."""

    cache: object
    step_info: torch.Tensor  # [3] long on the device: real deferred rows, suffix length before the step, leading
    # padding rows of a padded input (`StaticSplit.padded_input`)
    split: StaticSplit
    modules: frozenset
    serving: dict = dataclasses.field(default_factory=dict)  # always empty: no precomputed streams
    recorded: dict = dataclasses.field(default_factory=dict)

    def layer_forward(self, module, original, hidden_states, **kwargs):
        return _static_gdn_forward(module, self, hidden_states, **kwargs)


def _static_gdn_forward(module, ctx: _StaticStepContext, hidden_states, **kwargs):
    """``Qwen3_5GatedDeltaNet.forward`` for a fast-path step ``[deferred rows, padding, rest]`` on the static
    cache (`gdn.static.StaticGDNState`): the chunk from the boundary (padding gated off by the real
    row count in ``step_info``), the join, the rest from the corrected live state, then the record of a
    generated row or the boundary reset after input rows. Projections, gates, the gated norm and
    ``out_proj`` are the module's own, each run once over all rows."""
    cache = kwargs.get("cache")
    if cache is not ctx.cache:
        raise RuntimeError("a Gated DeltaNet layer ran on another cache than the fast-path step's own.")
    state = cache.gdn_state(module.layer_idx)
    params = GDNLayerParams.from_module(module)
    split = ctx.split
    bsz, rows, _ = hidden_states.shape
    n_chunk = rows - split.n_rest
    qkv = module.in_proj_qkv(hidden_states)
    z = module.in_proj_z(hidden_states)
    b, a = module.in_proj_b(hidden_states), module.in_proj_a(hidden_states)
    g, beta = gdn_gates(a, b, params)
    n_real, suffix_length = ctx.step_info[0:1], ctx.step_info[1:2]
    chunk_rule = module_function(module, "torch_chunk_gated_delta_rule")
    if split.padded_input:  # [padding, a turn's input rows]: the boundary moves after them
        core = state.run_input(qkv, g, beta, ctx.step_info[2:3], params, chunk_rule=chunk_rule)[0]
        state.reset_boundary()
    else:
        # each part writes its rows of the core output (no concatenation)
        core = torch.empty(bsz, rows, params.num_v_heads, params.head_v_dim, dtype=qkv.dtype, device=qkv.device)
        if n_chunk:
            state.run_chunk(qkv[:, :n_chunk], g[:, :n_chunk], beta[:, :n_chunk], n_real, params,
                            chunk_rule=chunk_rule if n_chunk > RECURRENT_CHUNK_MAX else None, out=core[:, :n_chunk])
            state.join(suffix_length, params)
        if split.n_rest:
            rest = slice(n_chunk, rows)
            _, k, v = state.run_rest(qkv[:, rest], g[:, rest], beta[:, rest], params, chunk_rule=chunk_rule,
                                     out=core[:, rest])
            if split.rest_kind == INPUT:
                state.reset_boundary()
            elif split.record is not None:
                state.record(qkv[:, rest], k, v, g[:, rest], beta[:, rest], suffix_length,
                             leading=split.record == "lead")
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(bsz, rows, -1))


# ---- the batched eager engine: several sequences in one packed forward (`batch_engine.ForwardRunner`) -------

@dataclass
class _PackedStepContext:
    """One packed forward of several sequences, as the GDN dispatchers see it: each sequence's states are its row
    of ``states`` (`batched_gdn.PackedGDNStates`), its rows laid out as ``layouts[b]`` (`PackedRowLayout`)."""

    states: object
    layouts: list
    modules: frozenset
    serving: dict = dataclasses.field(default_factory=dict)  # always empty: no precomputed streams
    recorded: dict = dataclasses.field(default_factory=dict)
    plans: dict = dataclasses.field(default_factory=dict)  # the forward's `batched_gdn._StepPlan`s, shared by layers

    def layer_forward(self, module, original, hidden_states, **kwargs):
        return _packed_gdn_forward(module, self, hidden_states, **kwargs)


def _packed_gdn_forward(module, ctx: _PackedStepContext, hidden_states, **kwargs):
    """``Qwen3_5GatedDeltaNet.forward`` for a packed forward ``[B, W]`` of several sequences: the projections, gates,
    gated norm and ``out_proj`` are the module's own, each run once over all rows; the recurrent part (chunks from
    each sequence's boundary, the joins, the rests from each live state, the records) is per sequence, batched
    over them (`batched_gdn.PackedGDNState.step`), padding rows gated off and kept out of the conv histories."""
    params = layer_params(module)
    bsz, rows, _ = hidden_states.shape
    qkv = module.in_proj_qkv(hidden_states)
    z = module.in_proj_z(hidden_states)
    b, a = module.in_proj_b(hidden_states), module.in_proj_a(hidden_states)
    state = ctx.states.layer(module.layer_idx, params, qkv.dtype, qkv.device)
    core = state.step(qkv, a, b, ctx.layouts, params, module_function(module, "torch_chunk_gated_delta_rule"),
                      module_function(module, "torch_recurrent_gated_delta_rule"), plans=ctx.plans)
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(bsz, rows, -1))


@dataclass
class _StaticPackedContext:
    """One captured batched decode step (`fast.batched_graphs`), as the GDN dispatchers see it: the per-slot states
    ``states`` (`batched_gdn.PackedGDNStates`) read and written through the step's device buffers ``step``
    (`fast.batched_graphs.RecurrentStepBuffers`); ``chunks`` / ``record``: some sequence carries deferred rows /
    records its token; ``prefill``: the step is a prompt piece's input rows; ``dense``: batch row ``b`` is slot
    ``b`` (the states' rows are updated in place through views: `batched_gdn.take_rows`) (host flags, part of the
    graph's key)."""

    states: object
    step: object
    chunks: bool
    record: bool
    modules: frozenset
    prefill: bool = False
    dense: bool = False
    serving: dict = dataclasses.field(default_factory=dict)  # always empty: no precomputed streams
    recorded: dict = dataclasses.field(default_factory=dict)

    def layer_forward(self, module, original, hidden_states, **kwargs):
        return _static_packed_gdn_forward(module, self, hidden_states, **kwargs)


def _static_packed_gdn_forward(module, ctx: _StaticPackedContext, hidden_states, **kwargs):
    """``Qwen3_5GatedDeltaNet.forward`` for a captured batched step ``[B, W]``: the module's projections, gates,
    gated norm and ``out_proj`` over every row at once; the recurrent part on the per-slot states at the step's slots
    (`batched_gdn.PackedGDNState.static_step`, or `static_prefill` for a prompt piece), nothing read back to the
    host."""
    params = layer_params(module)
    bsz, rows, _ = hidden_states.shape
    qkv = module.in_proj_qkv(hidden_states)
    z = module.in_proj_z(hidden_states)
    b, a = module.in_proj_b(hidden_states), module.in_proj_a(hidden_states)
    state = ctx.states.layers.get(module.layer_idx)
    if state is None:  # (`BatchedStepGraphs.prepare` makes every layer's states before a step)
        raise RuntimeError(f"a captured batched step reached Gated DeltaNet layer {module.layer_idx} before its "
                           "per-slot states were made.")
    rules = (module_function(module, "torch_chunk_gated_delta_rule"),
             module_function(module, "torch_recurrent_gated_delta_rule"))
    if ctx.prefill:
        core = state.static_prefill(qkv, a, b, ctx.step, params, *rules, ctx.chunks)
    else:
        core = state.static_step(qkv, a, b, ctx.step, params, *rules, ctx.chunks, ctx.record, dense=ctx.dense)
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(bsz, rows, -1))


def _swap_forward(module, new_forward):
    """Set ``module.forward`` on the instance; return the callback that puts the old one back."""
    had_own, own = "forward" in vars(module), vars(module).get("forward")
    module.forward = new_forward

    def restore():
        if had_own:
            module.forward = own
        else:
            vars(module).pop("forward", None)

    return restore


def _patch(module):
    """Route ``module``'s and its input projections' forwards through the dispatchers; returns the undo."""
    restores = [_swap_forward(module, functools.partial(_dispatch_gdn, module, module.forward))]
    for name in _IN_PROJECTIONS:
        proj = getattr(module, name)
        restores.append(_swap_forward(proj, functools.partial(_dispatch_projection, proj, proj.forward, name)))

    def undo():
        for restore in reversed(restores):
            restore()

    return undo


def _scope(modules, context):
    """The one way the dispatchers are installed: on ``modules`` (counted per instance) with ``context`` as the
    calling thread's engine forward, for the ``with`` block (removed on exit, on error too)."""
    return patched_for_thread(_PATCHES, modules, _patch, _ACTIVE, context)


def _ids(modules) -> frozenset:
    return frozenset(id(m) for m in modules)


def eager_forward(modules, cache, split: RowSplit):
    """Context manager: inside it, this thread's forwards of the GDN ``modules`` run the split forward on
    ``cache`` (a `DeferredDynamicCache`) for rows laid out as ``split``."""
    modules = list(modules)
    return _scope(modules, _StreamContext(cache, split, _ids(modules), {}, {}))


def static_step(modules, cache, step_info: torch.Tensor, variant: StaticSplit):
    """Context manager: inside it, this thread's forwards of the GDN ``modules`` run a fast-path step on the
    static cache's buffers (``step_info``: `_StaticStepContext`'s device scalars; ``variant``: the step's
    `StaticSplit`)."""
    modules = list(modules)
    return _scope(modules, _StaticStepContext(cache, step_info, variant, _ids(modules)))


def packed_step(modules, states, layouts):
    """Context manager: inside it, this thread's forwards of the GDN ``modules`` run one packed forward of
    several sequences (``states``: `batched_gdn.PackedGDNStates`; ``layouts``: one `PackedRowLayout` each)."""
    modules = list(modules)
    return _scope(modules, _PackedStepContext(states, list(layouts), _ids(modules)))


def static_packed_step(modules, states, step, chunks: bool, record: bool, prefill: bool = False,
                       dense: bool = False):
    """Context manager: inside it, this thread's forwards of the GDN ``modules`` run a captured batched step
    (`_StaticPackedContext`: decode rows, or with ``prefill`` a prompt piece's input rows) on the per-slot ``states``
    through the step's device buffers ``step``."""
    modules = list(modules)
    return _scope(modules, _StaticPackedContext(states, step, bool(chunks), bool(record), _ids(modules),
                                                prefill=bool(prefill), dense=bool(dense)))


@dataclass(frozen=True)
class ProbeLayout:
    """The head split and dtype `check_state_layout` probes the kernels with: the model's own, so that what the probe
    makes the kernels do first (fla's autotuning and compiles, keyed by heads, head dims and dtypes) is what the
    model's own calls need, not a tuning of its own. Qwen3.5-9B: 16 key and 32 value heads of 128, bf16. The
    defaults, a tiny fp32 layout, serve a check without a model."""

    num_k_heads: int = 2
    num_v_heads: int = 2
    head_k_dim: int = 64
    head_v_dim: int = 64
    dtype: torch.dtype = torch.float32

    @classmethod
    def of(cls, module, dtype: torch.dtype) -> ProbeLayout:
        """A GDN module's (``Qwen3_5GatedDeltaNet``: its head counts and dims) with ``dtype``, the model's hidden
        states' (what its q, k and v come in; not the projections' weights, which a quantised model stores
        otherwise)."""
        return cls(int(module.num_k_heads), int(module.num_v_heads), int(module.head_k_dim), int(module.head_v_dim),
                   dtype)


# the probe's rows on CUDA: fla's tuning keys leave the sequence length out, so the length of the first call decides
# what every later length runs with; this is a prefill's size (a multiple of `fast.graphs.PREFILL_BUCKET` as the
# padded prefills are), not a few rows. Elsewhere nothing is tuned and a few rows check the layout as well.
PROBE_ROWS = {"cuda": 512}
PROBE_ROWS_ELSEWHERE = 64


@functools.lru_cache(maxsize=8)
def check_state_layout(device_type: str, modeling: str = "transformers.models.qwen3_5.modeling_qwen3_5",
                       layout: ProbeLayout = ProbeLayout()) -> None:
    """Refuse GDN kernels whose state is not ``[B, HV, K, V]``, once per device type and layout.

    transformers picks its kernels at import (flash-linear-attention or hub kernels when present,
    else its torch fallbacks, whose layout `gdn.algebra` is tested against), so the
    check runs the functions the model will call, as the model calls them (``layout``: its heads, head dims and
    dtype; q, k and v split from one projection, fp32 gates and state, ``beta`` in the model's dtype, as
    `StaticGDNState.run_input` passes them), against the naive reference in fp32. A transposed state passes every
    shape check when ``dk == dv`` (real Qwen3.5), so the values decide: the state must be near the reference and
    nearer than its transpose. On CUDA the probe has a prefill's rows (`PROBE_ROWS`) and its reference runs there too:
    tens of milliseconds once the kernels are compiled; on a first start fla's autotuning of the model's own key
    happens here rather than at its first prefill (the probe's key is that prefill's).
    """
    hf = importlib.import_module(modeling)  # the GDN layer's own modeling file (Qwen3.5 or Qwen3.5-MoE)
    gen = torch.Generator().manual_seed(0)
    hk, hv, dk, dv, dtype = (layout.num_k_heads, layout.num_v_heads, layout.head_k_dim, layout.head_v_dim,
                             layout.dtype)
    bsz, seq, dev = 1, PROBE_ROWS.get(device_type, PROBE_ROWS_ELSEWHERE), torch.device(device_type)
    qkv = torch.randn(bsz, seq, 2 * hk * dk + hv * dv, generator=gen).to(device=dev, dtype=dtype)
    q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(bsz, seq, hk, dk), k.reshape(bsz, seq, hk, dk), v.reshape(bsz, seq, hv, dv)
    g = (-0.1 * torch.rand(bsz, seq, hv, generator=gen)).to(dev)
    beta = torch.rand(bsz, seq, hv, generator=gen).to(device=dev, dtype=dtype)
    s0 = torch.randn(bsz, hv, dk, dv, generator=gen).to(dev)
    repeat = hv // hk  # (the reference's queries and keys are per value head; it runs on the device too)
    wide = [x.float().repeat_interleave(repeat, dim=2) for x in (q, k)]
    _, want = naive_recurrent_gated_delta(l2norm(wide[0]), l2norm(wide[1]), v.float(), g, beta.float(), s0)
    # fla's Triton kernels run their dots in TF32 or in the inputs' half precision and keep half-precision
    # intermediates (relative error ~1e-3 per step in fp32; bf16's rounding of q and k alone is ~2e-3 of the state's
    # largest entry here), so relative errors, against both layouts; a transposed state is off by ~1 (1.11 here)
    tolerance = 2e-2 if dtype in (torch.float32, torch.float64) else 2.5e-1
    for fn in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        _, got = fn(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        got = got.float()
        scale = want.abs().max()
        err = ((got - want).abs().max() / scale).item() if got.shape == want.shape else float("inf")
        flipped = got.transpose(-1, -2)
        err_transposed = ((flipped - want).abs().max() / scale).item() if flipped.shape == want.shape else float("inf")
        if err < tolerance and err < err_transposed:
            continue
        transposed = err_transposed < tolerance
        raise ValueError(
            f"transformers' Qwen3.5 GDN kernel {getattr(fn, '__name__', fn)!r} on {device_type} returns a recurrent "
            f"state that is not [B, HV, K, V]{' (it is transposed: [B, HV, V, K])' if transposed else ''}; "
            "Raincheck's state map assumes [B, HV, K, V]. Uninstall flash-linear-attention to use the torch "
            "fallbacks, or use a version whose kernels keep the key-first layout "
            f"(relative error {err:.2e}, transposed {err_transposed:.2e}, {layout.dtype} inputs)."
        )
