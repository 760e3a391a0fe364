"""Gated DeltaNet states of several sequences in one packed forward (`batch_engine.ForwardRunner`), eager engine.

docs/method.md §4 per sequence, batched over the sequences: row ``b`` of every tensor here is sequence
``b`` of the packed forward (its live state and conv history, its boundary, its leading-segment record and
suffix map), and its suffix length is a host integer of its own. A packed forward gives each sequence
``[deferred chunk (d_b rows), rest (r_b rows: input rows or one generated row), padding]``
(`PackedRowLayout`); `PackedGDNState.step` runs one GDN layer's recurrent part for all of them at once:

1. the chunks, from each sequence's boundary ``(S_b, h_b)``: rows ``[0, max d)`` of every sequence that has
   one, the rows after its own ``d_b`` gated off (``g = 0, beta = 0`` leaves a state unchanged) and, since they
   come after its real rows, never read by a real row's conv; ``h_b'`` is the last ``Kc - 1`` of
   ``[h_b, its d_b rows]``, gathered per sequence;
2. the join, per sequence: its leading segment (``min(t_b, Kc - 1)`` recorded tokens, the others gated off)
   recomputed from ``h_b'`` and applied to ``S_b'``, then ``S_live += M_R (S_L' - S_L)``; the live conv window
   follows ``h_b'`` while ``t_b < Kc - 1``;
3. the rests, from each sequence's (corrected) live state: its ``r_b`` rows gathered to the front, padding
   after them gated off and kept out of the conv history; then, per sequence, the boundary moves after input
   rows, or a generated row is recorded (a leading token, or ``M_R <- A_t M_R``) while deferred rows wait.

Every step is batched over the sequences (their records and boundary moves too): a layer launches the same few
operations whatever the batch size, and reads nothing of the device on the host. What it needs of the layouts
(indices, lengths, scatter positions; `_StepPlan`) is built once per forward for all its GDN layers and moved in
one non-blocking copy; the widths and branches come from host ints (an eager engine's decode step is bound by the
host's launches, and a device read stalls it until the device's queue drains).

Everything is the same algebra as the batch-1 engine (`gdn.algebra`, transformers' own chunked / recurrent
rules of the layer's modeling file), so each sequence's states equal those of its own call to float rounding.

A captured batched decode step (`fast.batched_graphs`) runs `PackedGDNState.static_step` instead: the same three
parts on every sequence of the step at once, each one of `gdn.kernels`' operations over the whole batch (the conv
`conv_update_`, the delta rule `recurrent_step_`, the join `join_`, the suffix map `suffix_map_update_`: one Triton
launch each on CUDA, as the batch-1 fast path runs them), with the per-sequence choices passed as per-row counts
(``rows_in`` / ``valid`` ``[B]``: a deferred chunk's length, the leading segment's, 0 or 1 for a token) so a
sequence that carries no chunk, moves no token or records nothing keeps those states exactly. A dense step (batch
row ``b`` is slot ``b``) runs them in place on views of the states' first rows (`take_rows` / `put_rows`), where
another step copies its slots' rows out and back. Where Triton does not
run (CPU, other dtypes) the kernels' references run (`gdn.algebra`, transformers' recurrent rule op for op), the
same math. Counted on the tiny Qwen3.5 (B = 3), a GDN layer's part of a step carrying chunks dispatches 54 non-view
aten ops and 7 kernels, where the eager algebra it replaces (token loops of small ops) dispatched 197 ops; each is a
kernel launch of a few microseconds in a captured graph.

`PackedGDNStates` of `batch_engine.BatchEngine` has a row per slot of its KV pool: a forward takes the rows of
its sequences (`take`, a copy) and puts them back after it (`put`); a sequence that joins or leaves gets its
row reset (`reset`: zeros, ``M_R = I``, no suffix, so nothing of a departed sequence remains), a held
conversation's states are loaded into its row (`PackedGDNState.load`, `export`'s inverse), and the rows grow
with the pool's slots (`grow`). `select` keeps some sequences of a packed batch (the others' rows are gone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache_utils import GENERATED, INPUT, to_device, to_device_all
from .gdn import kernels as gk
from .gdn.algebra import (
    GDNLayerParams,
    LeadingSegment,
    advance_state,
    causal_conv_with_history,
    gdn_factors,
    gdn_gates,
    hf_conv_state_to_history,
    history_to_hf_conv_state,
    identity_map,
    join_state,
    update_suffix_map,
)
from .gdn.dispatch import RECURRENT_CHUNK_MAX
from .gdn.suffix_map import SuffixStateMap
from .kv_pool import grow_each

__all__ = ["PackedGDNState", "PackedGDNStates", "PackedRowLayout"]


@dataclass(frozen=True)
class PackedRowLayout:
    """One sequence's rows in one packed forward: ``n_deferred`` deferred rows first, then ``n_rest`` rows of
    ``rest_kind`` (INPUT, GENERATED, or None when there are none), then padding. ``record``: the generated row
    is recorded into the suffix (deferred rows are still pending after this forward)."""

    n_deferred: int
    n_rest: int
    rest_kind: int | None
    record: bool = False


def _split_heads(y: torch.Tensor, p: GDNLayerParams):
    """Conv outputs ``[B, T, C]`` -> ``q, k [B, T, HK, K]``, ``v [B, T, HV, V]`` (channels ``[q | k | v]``)."""
    bsz, seq, _ = y.shape
    q, k, v = torch.split(y, [p.key_dim, p.key_dim, p.value_dim], dim=-1)
    return (q.reshape(bsz, seq, p.num_k_heads, p.head_k_dim), k.reshape(bsz, seq, p.num_k_heads, p.head_k_dim),
            v.reshape(bsz, seq, p.num_v_heads, p.head_v_dim))


def _gate_off(g: torch.Tensor, beta: torch.Tensor, valid: torch.Tensor):
    """``g = 0, beta = 0`` where ``valid [B, T]`` is False: the delta rule leaves the state unchanged there."""
    v = valid[..., None]
    return torch.where(v, g, torch.zeros_like(g)), torch.where(v, beta, torch.zeros_like(beta))


def _last_window(history: torch.Tensor, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Per sequence, the last ``Kc - 1`` rows of ``[history, x[:, :ends[b]]]``: ``history [B, w, C]``, ``x [B, T, C]``,
    ``ends [B]`` (long, on the device)."""
    width = history.shape[1]
    joined = torch.cat([history, x.to(history.dtype)], dim=1)
    index = ends[:, None] + torch.arange(width, device=ends.device)[None]
    return joined.gather(1, index[..., None].expand(-1, -1, joined.shape[-1]))


def _per_row(mask: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A ``[B]`` mask viewed to broadcast against ``t [B, ...]``."""
    return mask.view(-1, *([1] * (t.dim() - 1)))


def take_rows(t: torch.Tensor, slots: torch.Tensor, batch: int, dense: bool) -> torch.Tensor:
    """A captured step's rows of the per-slot tensor ``t``: a view of rows ``0 .. batch - 1`` when the step is dense
    (batch row ``b`` is slot ``b``), which in-place updates change in ``t`` itself; else a copy of rows ``slots``."""
    return t[:batch] if dense else t.index_select(0, slots)


def put_rows(t: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, dense: bool) -> None:
    """Write a step's ``rows`` back into the per-slot tensor ``t`` (`take_rows`' inverse): nothing to do for the view
    `take_rows` gave (updated in place), a copy into rows ``0 .. B - 1`` for a new tensor of a dense step, else
    ``index_copy_`` at ``slots``."""
    if not dense:
        t.index_copy_(0, slots, rows)
    elif rows.data_ptr() != t.data_ptr():
        t[:rows.shape[0]].copy_(rows)


def _row_index(rows: list[int], device) -> torch.Tensor:
    """``rows`` as a long tensor on ``device`` (`cache_utils.to_device`: a pinned non-blocking copy, where a plain
    ``torch.tensor(..., device=cuda)`` copies from pageable memory and waits for the device's queue)."""
    return to_device(torch.tensor(rows, dtype=torch.long), device)


class _StepPlan:
    """What one packed forward's layouts say, on the host and as device index tensors, built once per forward and
    shared by its GDN layers (`PackedGDNState.step` with ``plans``): every index, length and mask the step needs,
    moved in one pinned non-blocking copy (`cache_utils.to_device_all`), and the host facts it branches on (widths,
    which sequences record where). So a layer's step launches the same few batched ops whatever the batch size and
    never waits for the device (no ``.item()``, no pageable host -> device copy).

    ``suffix_length``: the sequences' recorded suffix lengths before the forward (host ints; equal in every layer of
    a forward, and part of the cache key all the same)."""

    def __init__(self, layouts: list[PackedRowLayout], suffix_length: list[int], width: int, rows: int, device):
        host: dict[str, list] = {}
        chunked = [i for i, lay in enumerate(layouts) if lay.n_deferred]
        rested = [i for i, lay in enumerate(layouts) if lay.n_rest]
        self.chunked, self.rested = chunked, rested
        if chunked:
            d = [layouts[i].n_deferred for i in chunked]
            self.chunk_width = max(d)
            self.chunk_short = any(suffix_length[i] < width for i in chunked)
            host["c_idx"], host["c_len"] = chunked, d
            host["c_suffix"] = [suffix_length[i] for i in chunked]
        if rested:
            starts = [layouts[i].n_deferred for i in rested]
            lengths = [layouts[i].n_rest for i in rested]
            w = self.rest_width = max(lengths)
            host["r_idx"], host["r_len"] = rested, lengths
            # every sequence's rest at its front and of the same length (a step of decode rows only: `full`, or
            # every answer past its deferred rows): the rests are the forward's rows as they are, nothing to gather
            self.rest_in_place = rested == list(range(len(layouts))) and set(starts) == {0} and set(lengths) == {w}
            # [s, w] source row of each gathered step, clamped into the sequence's own rows
            host["r_pos"] = [st + min(t, n - 1) for st, n in zip(starts, lengths) for t in range(w)]
            # the real rows of the gathered outputs ([s * w]) and where they go in the core output ([B * rows])
            host["r_src"] = [j * w + t for j, n in enumerate(lengths) for t in range(n)]
            host["r_dst"] = [i * rows + st + t for i, st, n in zip(rested, starts, lengths) for t in range(n)]
            inputs = [(j, i) for j, i in enumerate(rested) if layouts[i].rest_kind == INPUT]
            recorded = [(j, i) for j, i in enumerate(rested)
                        if layouts[i].rest_kind == GENERATED and layouts[i].record]
            self.inputs = [i for _, i in inputs]
            self.recorded = [i for _, i in recorded]
            if inputs:
                host["in_i"] = self.inputs
            if recorded:
                host["rec_j"] = [j for j, _ in recorded]
                lead = [(k, i) for k, (_, i) in enumerate(recorded) if suffix_length[i] < width]
                rest = [(k, i) for k, (_, i) in enumerate(recorded) if suffix_length[i] >= width]
                self.has_lead, self.has_rest = bool(lead), bool(rest)
                if lead:  # a leading token: its inputs go to slot t of the leading record, S_L advances by it
                    host["lead_k"], host["lead_i"] = [k for k, _ in lead], [i for _, i in lead]
                    host["lead_t"] = [suffix_length[i] for _, i in lead]
                if rest:  # past the leading segment: M_R <- A_t M_R
                    host["rest_k"], host["rest_i"] = [k for k, _ in rest], [i for _, i in rest]
        names = list(host)
        moved = to_device_all([torch.tensor(host[n], dtype=torch.long) for n in names], device)
        self.index = dict(zip(names, moved))
        if rested:
            self.index["r_pos"] = self.index["r_pos"].view(len(rested), self.rest_width)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.index[name]


class PackedGDNState:
    """One GDN layer's states of ``batch`` sequences (docs/method.md §4), row ``b`` for sequence ``b``.

    Tensors (fp32 states, pre-conv inputs and gate inputs in the model's dtype):
        state ``[B, HV, K, V]``, conv ``[B, Kc - 1, C]``: live recurrent state and conv history;
        boundary_state / boundary_conv: S_b and h_b; leading_state: S_L;
        leading_qkv ``[B, Kc - 1, C]``, leading_a / leading_b ``[B, Kc - 1, HV]``: the first ``Kc - 1`` suffix
        tokens' ``in_proj_qkv`` / ``in_proj_a`` / ``in_proj_b`` outputs (slot ``j``: suffix token ``j``);
        rest_map ``[B, HV, K, K]``: M_R.
    ``suffix_length``: per sequence, the generated tokens recorded since its boundary (host ints).
    """

    _NAMES = ("state", "conv", "boundary_state", "boundary_conv", "leading_state", "leading_qkv", "leading_a",
              "leading_b", "rest_map")

    def __init__(self, batch: int, params: GDNLayerParams, dtype: torch.dtype, device):
        p = params
        hv, dk, dv, width = p.num_v_heads, p.head_k_dim, p.head_v_dim, p.kernel_size - 1
        f32 = dict(dtype=torch.float32, device=device)
        own = dict(dtype=dtype, device=device)
        self.width = width
        self.state = torch.zeros(batch, hv, dk, dv, **f32)
        self.conv = torch.zeros(batch, width, p.conv_dim, **own)
        self.boundary_state = torch.zeros(batch, hv, dk, dv, **f32)
        self.boundary_conv = torch.zeros(batch, width, p.conv_dim, **own)
        self.leading_state = torch.zeros(batch, hv, dk, dv, **f32)
        self.leading_qkv = torch.zeros(batch, width, p.conv_dim, **own)
        self.leading_a = torch.zeros(batch, width, hv, **own)
        self.leading_b = torch.zeros(batch, width, hv, **own)
        self.rest_map = identity_map(batch, hv, dk, device=device)
        self.suffix_length = [0] * batch

    @property
    def batch(self) -> int:
        return len(self.suffix_length)

    def select(self, keep: list[int]) -> None:
        """Keep the sequences ``keep`` (in that order); the others' rows are gone."""
        index = _row_index(keep, self.state.device)
        for name in self._NAMES:
            setattr(self, name, getattr(self, name).index_select(0, index))
        self.suffix_length = [self.suffix_length[k] for k in keep]

    # ---- rows as slots (`batch_engine`: row ``i`` is slot ``i`` of the pool) -----------------------
    def take(self, rows: list[int], index: torch.Tensor | None = None) -> "PackedGDNState":
        """A state of ``len(rows)`` sequences holding copies of rows ``rows`` (one packed forward's sequences);
        ``index``: ``rows`` already on the device (`PackedGDNStates` moves it once for every layer)."""
        sub = object.__new__(PackedGDNState)
        index = _row_index(rows, self.state.device) if index is None else index
        for name in self._NAMES:
            setattr(sub, name, getattr(self, name).index_select(0, index))
        sub.width = self.width
        sub.suffix_length = [self.suffix_length[r] for r in rows]
        return sub

    def put(self, rows: list[int], sub: "PackedGDNState", index: torch.Tensor | None = None) -> None:
        """Write ``sub`` (from `take`, after a forward) back into rows ``rows`` (``index``: as in `take`)."""
        index = _row_index(rows, self.state.device) if index is None else index
        for name in self._NAMES:
            getattr(self, name).index_copy_(0, index, getattr(sub, name))
        for r, t in zip(rows, sub.suffix_length):
            self.suffix_length[r] = t

    def reset(self, row: int) -> None:
        """Row ``row`` back to a fresh sequence's states (zeros, ``M_R = I``, no suffix)."""
        for name in self._NAMES:
            getattr(self, name)[row].zero_()
        self.rest_map[row] = torch.eye(self.rest_map.shape[-1], dtype=self.rest_map.dtype, device=self.rest_map.device)
        self.suffix_length[row] = 0

    def fresh(self, batch: int) -> "PackedGDNState":
        """A state of ``batch`` fresh sequences with this one's shapes and dtypes."""
        new = self.take([])
        new.grow(batch)
        return new

    def grow_growth(self, batch: int) -> tuple[int, int]:
        """``(net, peak)`` of `grow` to ``batch`` (as `kv_pool.SlotKVLayer.resize_growth`): every new tensor is made
        (from a block of fresh rows) before any old one is let go; ``(0, 0)``: room for them already."""
        net = peak = made = 0
        if batch <= self.batch:
            return net, peak
        for t in (getattr(self, name) for name in self._NAMES):
            row = t[:1].numel() * t.element_size()
            peak = max(peak, made + row * (batch - self.batch) + row * batch)  # (the fresh rows beside the new tensor)
            made, net = made + row * batch, net + row * (batch - self.batch)
        return net, peak

    def grow(self, batch: int) -> None:
        """Room for ``batch`` sequences; the new rows are fresh. All of the layer's tensors or none (an allocation
        that fails leaves them as they were)."""
        old = self.batch
        if batch <= old:
            return
        grown = {name: torch.cat([t, t.new_zeros(batch - old, *t.shape[1:])])
                 for name, t in ((name, getattr(self, name)) for name in self._NAMES)}
        for name, t in grown.items():
            setattr(self, name, t)
        self.suffix_length += [0] * (batch - old)
        for row in range(old, batch):
            self.reset(row)

    def load(self, i: int, layer, params: GDNLayerParams) -> None:
        """Row ``i`` from ``layer``, a `cache_utils.DeferredLinearAttentionLayer` of a batch-1 cache (`export`'s
        inverse): its live conv window and recurrent state, and its boundary record."""
        k = params.kernel_size
        self.reset(i)
        self.conv[i] = hf_conv_state_to_history(layer.conv_states[0], k)[0].to(self.conv.dtype)
        self.state[i] = layer.recurrent_states[0][0].to(self.state.dtype)
        smap = layer.suffix_map
        if smap is None:  # no boundary yet recorded: it sits at the live state
            self.boundary_state[i], self.leading_state[i] = self.state[i], self.state[i]
            self.boundary_conv[i] = self.conv[i]
            return
        self.boundary_state[i] = smap.boundary_state[0].to(self.boundary_state.dtype)
        self.boundary_conv[i] = smap.boundary_conv_history[0].to(self.boundary_conv.dtype)
        self.leading_state[i] = smap.leading_state[0].to(self.leading_state.dtype)
        self.rest_map[i] = smap.rest_map[0].to(self.rest_map.dtype)
        lead = smap.leading.mixed_qkv.shape[1]
        self.leading_qkv[i, :lead] = smap.leading.mixed_qkv[0].to(self.leading_qkv.dtype)
        self.leading_a[i, :lead] = smap.leading.a[0].to(self.leading_a.dtype)
        self.leading_b[i, :lead] = smap.leading.b[0].to(self.leading_b.dtype)
        self.suffix_length[i] = int(smap.suffix_length)

    # ---- one forward ------------------------------------------------------------------------
    def step(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, layouts: list[PackedRowLayout],
             params: GDNLayerParams, chunk_rule, recurrent_rule, plans: dict | None = None) -> torch.Tensor:
        """The recurrent part of one GDN layer for a packed forward: ``qkv [B, W, C]`` (``in_proj_qkv``), ``a, b
        [B, W, HV]`` (``in_proj_a`` / ``in_proj_b``), the rows laid out per sequence as ``layouts[b]`` says.
        Returns the core outputs ``[B, W, HV, V]`` (zeros on padding rows); updates every sequence's states.
        ``plans``: a dict the forward's GDN layers share (`gdn.dispatch`), so its `_StepPlan` (index tensors on the
        device) is built once per forward; None: built for this call."""
        bsz, rows, _ = qkv.shape
        if len(layouts) != bsz or bsz != self.batch:
            raise ValueError(f"a packed GDN step got {len(layouts)} layouts for {bsz} rows of a {self.batch}-sequence "
                             "state.")
        key = (tuple(self.suffix_length), rows, qkv.device)
        plan = None if plans is None else plans.get(key)
        if plan is None:
            plan = _StepPlan(layouts, self.suffix_length, self.width, rows, qkv.device)
            if plans is not None:
                plans[key] = plan
        p = params
        g, beta = gdn_gates(a, b, p)
        core = torch.zeros(bsz, rows, p.num_v_heads, p.head_v_dim, dtype=qkv.dtype, device=qkv.device)
        if plan.chunked:
            self._chunks(qkv, g, beta, plan, p, chunk_rule, recurrent_rule, core)
        if plan.rested:
            self._rests(qkv, a, b, g, beta, plan, p, chunk_rule, recurrent_rule, core)
        return core

    def _rule(self, single: bool, chunk_rule, recurrent_rule, q, k, v, g, beta, state):
        # transformers' module runs the recurrent rule for one row on a cached state, the chunked rule otherwise
        fn = recurrent_rule if single else chunk_rule
        return fn(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)

    def _join(self, idx, lead, boundary_conv, boundary_state, state, leading_state, p):
        """Step 2 of the module docstring for the rows ``idx`` of the states: their leading segments (``lead`` recorded
        tokens each, the others gated off) recomputed from the new boundary ``(boundary_state, boundary_conv)`` and
        the live ``state`` corrected by them (``S_live += M_R (S_L' - S_L)``). Returns ``(the leading segments' conv
        inputs, the repaired leading states S_L', the joined live states)``."""
        lead_qkv = self.leading_qkv.index_select(0, idx)
        factors = gdn_factors(lead_qkv, boundary_conv, self.leading_a.index_select(0, idx),
                              self.leading_b.index_select(0, idx), p)
        lead_valid = torch.arange(self.width, device=lead.device)[None] < lead[:, None]
        lg, lb = _gate_off(factors.g, factors.beta, lead_valid)
        repaired = advance_state(boundary_state.float(), factors.k, factors.v, lg, lb)
        live = join_state(state, self.rest_map.index_select(0, idx), leading_state, repaired)
        return lead_qkv, repaired, live

    def _chunks(self, qkv, g, beta, plan: _StepPlan, p, chunk_rule, recurrent_rule, core):
        """Step 1 and 2 of the module docstring for the sequences ``plan.chunked`` (each with deferred rows)."""
        device = qkv.device
        idx, lengths, width = plan["c_idx"], plan["c_len"], plan.chunk_width
        x = qkv.index_select(0, idx)[:, :width]
        valid = torch.arange(width, device=device)[None] < lengths[:, None]
        history = self.boundary_conv.index_select(0, idx)
        y = causal_conv_with_history(x, history, p.conv_weight, p.conv_bias, p.activation)
        q, k, v = _split_heads(y, p)
        gc, bc = _gate_off(g.index_select(0, idx)[:, :width], beta.index_select(0, idx)[:, :width], valid)
        out, boundary_state = self._rule(width == 1, chunk_rule, recurrent_rule, q, k, v, gc, bc,
                                         self.boundary_state.index_select(0, idx))
        # each sequence's chunk rows of the core output (rows after its own chunk: zeros, a rest overwrites them)
        kept = torch.where(valid[..., None, None], out.to(core.dtype), torch.zeros((), dtype=core.dtype, device=device))
        core[:, :width].index_copy_(0, idx, kept)
        boundary_conv = _last_window(history, x, lengths)
        lead = plan["c_suffix"].clamp(max=self.width)
        lead_qkv, repaired, live = self._join(idx, lead, boundary_conv, boundary_state, self.state.index_select(0, idx),
                                              self.leading_state.index_select(0, idx), p)
        self.state.index_copy_(0, idx, live.to(self.state.dtype))
        self.leading_state.index_copy_(0, idx, repaired.to(self.leading_state.dtype))
        self.boundary_state.index_copy_(0, idx, boundary_state.to(self.boundary_state.dtype))
        self.boundary_conv.index_copy_(0, idx, boundary_conv)
        # the live conv window still reaches into h_b while the suffix is shorter than Kc - 1 (known on the host)
        if plan.chunk_short:
            short = lead < self.width
            window = _last_window(boundary_conv, lead_qkv, lead)
            conv = torch.where(short[:, None, None], window, self.conv.index_select(0, idx))
            self.conv.index_copy_(0, idx, conv)

    def _rests(self, qkv, a, b, g, beta, plan: _StepPlan, p, chunk_rule, recurrent_rule, core):
        """Step 3 of the module docstring for the sequences ``plan.rested`` (each with input rows or a generated
        row), the boundary moves and the records batched over the sequences that have them."""
        device = qkv.device
        idx, lengths, width, pos = plan["r_idx"], plan["r_len"], plan.rest_width, plan["r_pos"]
        if plan.rest_in_place:  # no row to move, none to gate off
            x, xa, xb, rg, rb = qkv[:, :width], a[:, :width], b[:, :width], g[:, :width], beta[:, :width]
        else:
            valid = torch.arange(width, device=device)[None] < lengths[:, None]

            def gather(t):
                t = t.index_select(0, idx)
                return t.gather(1, pos.view(*pos.shape, *([1] * (t.dim() - 2))).expand(-1, -1, *t.shape[2:]))

            x, xa, xb = gather(qkv), gather(a), gather(b)
            rg, rb = _gate_off(gather(g), gather(beta), valid)
        history = self.conv.index_select(0, idx)
        y = causal_conv_with_history(x, history, p.conv_weight, p.conv_bias, p.activation)
        q, k, v = _split_heads(y, p)
        out, state = self._rule(width == 1, chunk_rule, recurrent_rule, q, k, v, rg, rb,
                                self.state.index_select(0, idx))
        if plan.rest_in_place:
            core[:, :width] = out
        else:
            flat = core.view(-1, *core.shape[2:])  # (core is fresh and contiguous)
            flat.index_copy_(0, plan["r_dst"],
                             out.reshape(-1, *out.shape[2:]).index_select(0, plan["r_src"]).to(core.dtype))
        conv = _last_window(history, x, lengths)
        self.state.index_copy_(0, idx, state.to(self.state.dtype))
        self.conv.index_copy_(0, idx, conv)
        if plan.inputs:  # the boundary moves after a turn's input rows
            rows = plan["in_i"]
            live, live_conv = self.state.index_select(0, rows), self.conv.index_select(0, rows)
            self.boundary_state.index_copy_(0, rows, live)
            self.leading_state.index_copy_(0, rows, live)
            self.boundary_conv.index_copy_(0, rows, live_conv)
            eye = torch.eye(p.head_k_dim, dtype=self.rest_map.dtype, device=device)
            self.rest_map.index_copy_(0, rows, eye.expand(len(plan.inputs), *self.rest_map.shape[1:]))
            for i in plan.inputs:
                self.suffix_length[i] = 0
        if plan.recorded:
            # the tokens' factors from the conv window before them, as `SuffixStateMap.append_suffix` computes them
            rec = plan["rec_j"]
            xr, ar, br = x[:, :1].index_select(0, rec), xa[:, :1].index_select(0, rec), xb[:, :1].index_select(0, rec)
            f = gdn_factors(xr, history.index_select(0, rec), ar, br, p)
            if plan.has_lead:
                k_, i_, t_ = plan["lead_k"], plan["lead_i"], plan["lead_t"]
                self.leading_qkv.index_put_((i_, t_), xr[:, 0].index_select(0, k_))
                self.leading_a.index_put_((i_, t_), ar[:, 0].index_select(0, k_))
                self.leading_b.index_put_((i_, t_), br[:, 0].index_select(0, k_))
                pick = lambda t: t.index_select(0, k_)  # noqa: E731
                advanced = advance_state(self.leading_state.index_select(0, i_), pick(f.k), pick(f.v), pick(f.g),
                                         pick(f.beta))
                self.leading_state.index_copy_(0, i_, advanced.to(self.leading_state.dtype))
            if plan.has_rest:
                k_, i_ = plan["rest_k"], plan["rest_i"]
                pick = lambda t: t.index_select(0, k_)  # noqa: E731
                moved = update_suffix_map(self.rest_map.index_select(0, i_), pick(f.k), pick(f.g), pick(f.beta))
                self.rest_map.index_copy_(0, i_, moved.to(self.rest_map.dtype))
            for i in plan.recorded:
                self.suffix_length[i] += 1

    # ---- a decode step on static buffers (`fast.batched_graphs`) ----------------------------------
    def static_step(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, step, params: GDNLayerParams,
                    chunk_rule, recurrent_rule, chunks: bool, record: bool, *, dense: bool = False,
                    reference: bool | None = None) -> torch.Tensor:
        """The recurrent part of one GDN layer for a captured batched decode step: sequence ``b``'s rows are
        ``[d_b deferred rows, its generated token (a decode group) or nothing (a restoring piece), padding]`` of
        ``qkv [B, W, C]``, ``a, b [B, W, HV]``, its states read and written at row ``step.slots[b]`` of this per-slot
        state (device indices), so one captured graph serves every assignment of sequences to slots and every
        ``d_b``. ``step`` (`fast.batched_graphs.RecurrentStepBuffers`) is device tensors only: ``real``, ``deferred``
        (``d_b``), ``token`` (a generated row follows the deferred rows), ``lead`` / ``record_map`` (the token is
        recorded as leading token ``suffix[b]`` / into M_R) and ``suffix``. Host flags, part of the graph's key:
        ``chunks`` (some sequence carries deferred rows) and ``record`` (some token is recorded); without them those
        parts are not computed at all.

        The operations of `step` (`_chunks`, then `_rests` on the tokens) on every sequence at once, each one a
        `gdn.kernels` operation over the whole batch (one Triton launch on CUDA; its reference elsewhere, or with
        ``reference=True``; ``reference=False`` forces the kernels, on CPU in Triton's interpreter), on copies of
        the slots' rows (``index_select``) written back after (``index_copy_``); with ``dense`` (a host flag of the
        key: batch row ``b`` is slot ``b`` for every ``b < B``, `fast.batched_graphs`' dense steps) on views of rows
        ``0 .. B - 1`` instead, updated in place (each copy and write-back of a 2 MiB state per sequence and layer
        at the Qwen3.5-9B shape saved; the same values: `take_rows` / `put_rows`):

        1. the chunks from the boundaries: `conv_update_` (``rows_in = d_b`` per sequence: ``h_b'``, and ``h_b``
           itself for ``d_b = 0``), the delta rule token by token (`recurrent_step_`, ``valid = d_b``: the rows
           after a sequence's own chunk run as ``g = 0, beta = 0``; transformers' chunked rule past
           `gdn.dispatch.RECURRENT_CHUNK_MAX` rows);
        2. the joins: the leading segments recomputed from ``h_b'`` (`conv_update_` over the leading records, which
           also writes the live conv window of a suffix shorter than ``Kc - 1``, and `recurrent_step_` with ``valid =
           min(t_b, Kc - 1)`` into S_L'), then `join_` (``S_live += M_R (S_L' - S_L)``);
        3. the tokens, each gathered from its row ``d_b``, from the (corrected) live states: `conv_update_` and
           `recurrent_step_` with a count of 1 for a sequence that moves and 0 for one that does not;
        4. the records: leading-record slot ``t_b`` (``torch.where``), S_L advanced by a leading token
           (`recurrent_step_`, count 0 or 1) and ``M_R <- A_t M_R`` (`suffix_map_update_`, the rows that do not
           record into M_R gated off to ``g = 0, beta = 0``).

        A sequence that carries no chunk, moves no token or records nothing keeps those states exactly: its count
        is 0 (a token with ``g = 0, beta = 0`` multiplies the state by ``exp(0) = 1`` and adds ``k * 0``), its
        S_L' is its S_L (``torch.where``: the join then adds ``M_R @ 0``), its conv windows are copied back. Returns
        the core outputs ``[B, W, HV, V]`` (zeros on rows that are neither a chunk row nor the token). The host's
        ``suffix_length`` is not touched here (`PackedGDNStates.advance_suffix` after the step)."""
        p = params
        device = qkv.device
        slots, real = step.slots, step.real
        bsz, rows, _ = qkv.shape
        conv_args = (p.conv_weight, p.conv_bias, p.activation)
        g, beta = gdn_gates(a, b, p)
        take = lambda t: take_rows(t, slots, bsz, dense)  # noqa: E731
        put = lambda t, rows: put_rows(t, rows, slots, dense)  # noqa: E731
        state = take(self.state)  # the slots' rows (copies, or views of a dense step): the kernels update them
        conv = take(self.conv)
        leading_state = rest_map = None
        if chunks:
            core, leading_state, rest_map = self._chunk_join(qkv, g, beta, step, state, conv, p, chunk_rule,
                                                             recurrent_rule, take, put, reference)
            d = step.deferred
            has_token = step.token
            at = d.clamp(max=rows - 1)[:, None]  # each sequence's token row
            pick = lambda t: t.gather(1, at.view(-1, 1, *([1] * (t.dim() - 2))).expand(-1, 1, *t.shape[2:]))  # noqa
            x, xa, xb, rg, rb = pick(qkv), pick(a), pick(b), pick(g), pick(beta)
        else:
            has_token = real
            core = None
            x, xa, xb, rg, rb = qkv, a, b, g, beta
        # 3. the tokens, from each sequence's (corrected) live state; a sequence without one keeps its states
        moved = has_token & real
        count = moved.long()
        y = gk.conv_update_(conv, x, *conv_args, rows_in=count, reference=reference)  # the window before the token
        q, k, v = _split_heads(y, p)
        out = gk.recurrent_step_(state, q, k, v, rg, rb, valid=count, reference=reference)
        put(self.state, state)
        put(self.conv, conv)
        if record:
            # 4. the records, the token's factors from the conv window before it (`SuffixStateMap.append_suffix`)
            lead_token, into_map = step.lead & moved, step.record_map & moved
            at_t = (torch.arange(self.width, device=device)[None] == step.suffix[:, None]) & lead_token[:, None]
            for name, new in (("leading_qkv", x), ("leading_a", xa), ("leading_b", xb)):
                old = take(getattr(self, name))
                put(getattr(self, name), torch.where(at_t[..., None], new.to(old.dtype), old))
            if leading_state is None:
                leading_state = take(self.leading_state)
            gk.recurrent_step_(leading_state, k, k, v, rg, rb, valid=lead_token.long(), reference=reference)
            if rest_map is None:
                rest_map = take(self.rest_map)
            mg, mb = gk.gate_off(rg, rb, _per_row(into_map, rg))
            gk.suffix_map_update_(rest_map, k, mg, mb, l2norm=True, reference=reference)
            put(self.rest_map, rest_map)
        if leading_state is not None:
            put(self.leading_state, leading_state)
        out = out.to(qkv.dtype)
        if core is None:
            return out
        token_row = (torch.arange(rows, device=device)[None] == step.deferred[:, None]) & moved[:, None]
        return torch.where(token_row[..., None, None], out, core)

    def _chunk_join(self, qkv, g, beta, step, state, conv, p: GDNLayerParams, chunk_rule, recurrent_rule, take, put,
                    reference):
        """Steps 1 and 2 of `static_step` (shared with `static_prefill`): each sequence's leading ``step.deferred``
        rows of ``qkv`` run from its boundary (``h_b``, ``S_b`` updated and written back), then its live ``state``
        is joined (in place) and its live conv window ``conv`` follows ``h_b'`` while its suffix is shorter than
        ``Kc - 1``. Returns ``(the chunk rows' core outputs [B, W, HV, V], zeros elsewhere; S_L'; M_R)`` (the last two
        the step's rows, not yet written back)."""
        device = qkv.device
        rows = qkv.shape[1]
        conv_args = (p.conv_weight, p.conv_bias, p.activation)
        d = step.deferred
        carries = d > 0
        # 1. the chunks from each sequence's boundary; h_b <- h_b' in place (d_b = 0: h_b itself)
        boundary_conv = take(self.boundary_conv)
        boundary_state = take(self.boundary_state)
        y = gk.conv_update_(boundary_conv, qkv, *conv_args, rows_in=d, reference=reference)
        q, k, v = _split_heads(y, p)
        valid = torch.arange(rows, device=device)[None] < d[:, None]
        if rows > RECURRENT_CHUNK_MAX:  # (as the batch-1 fast path: a long chunk takes transformers' chunked rule)
            gc, bc = _gate_off(g, beta, valid)
            out, final = self._rule(False, chunk_rule, recurrent_rule, q, k, v, gc, bc, boundary_state)
            boundary_state.copy_(final)
        else:
            out = gk.recurrent_step_(boundary_state, q, k, v, g, beta, valid=d, reference=reference)
        core = torch.where(valid[..., None, None], out.to(qkv.dtype), torch.zeros((), dtype=qkv.dtype, device=device))
        put(self.boundary_state, boundary_state)
        put(self.boundary_conv, boundary_conv)
        # 2. the joins: each carrying sequence's leading segment (min(t_b, Kc - 1) recorded tokens) recomputed from
        # (S_b', h_b'); its live conv window follows h_b' while t_b < Kc - 1 (a count of Kc - 1 writes none: the
        # sequences without a chunk)
        lead = step.suffix.clamp(max=self.width)
        window = torch.where(carries, lead, self.width)
        lead_qkv = take(self.leading_qkv)
        y = gk.conv_update_(boundary_conv, lead_qkv, *conv_args, rows_in=window, history_out=conv,
                            only_within_window=True, reference=reference)
        lq, lk, lv = _split_heads(y, p)
        lg, lb = gdn_gates(take(self.leading_a), take(self.leading_b), p)
        repaired = torch.empty_like(boundary_state)
        gk.recurrent_step_(boundary_state, lq, lk, lv, lg, lb, valid=lead, state_out=repaired, reference=reference)
        leading_before = take(self.leading_state)
        leading_state = torch.where(_per_row(carries, repaired), repaired, leading_before)  # S_L' (S_L: no chunk)
        rest_map = take(self.rest_map)
        gk.join_(state, rest_map, leading_state, leading_before, reference=reference)
        return core, leading_state, rest_map

    def static_prefill(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, step, params: GDNLayerParams,
                       chunk_rule, recurrent_rule, chunks: bool = False, *,
                       reference: bool | None = None) -> torch.Tensor:
        """The recurrent part of one GDN layer for a captured prompt piece (`fast.batched_graphs`' ``prefill`` keys):
        sequence ``b``'s rows are ``[d_b leftover deferred rows of a continued conversation, n_b input rows of the
        turn, padding]`` of ``qkv [B, W, C]``, ``a, b [B, W, HV]`` (``d_b = step.deferred[b]``, ``n_b =
        step.inputs[b]``: device tensors, so one captured graph serves every piece of its width), its states at row
        ``step.slots[b]``. What `step` does for such a layout (`_chunks`, then `_rests` on input rows), with the counts
        on the device:

        1. with ``chunks`` (a host flag of the key: some piece carries deferred rows), the deferred rows from the
           boundary and the join (`_chunk_join`, as in `static_step`): ``d_b = 0`` leaves every state as it was;
        2. the input rows, moved to the front of the width (a gather: row ``j`` from row ``d_b + j``), continue the
           (joined) live conv window (a real row never reads the padding after it); the new window is the last
           ``Kc - 1`` of ``[h, the n_b rows]`` (`_last_window`); the rule runs from the live state with transformers'
           chunked rule, the rows after ``n_b`` gated off (``g = 0, beta = 0`` passes the state unchanged: exact);
        3. where ``n_b > 0`` the boundary moves after the input rows: ``S_b = S_L = S_live``, ``h_b`` the live window,
           ``M_R = I`` (the host's suffix length goes to 0 after the step: `PackedGDNStates.reset_suffix`); a piece of
           deferred rows only keeps the boundary the chunk moved, its ``S_L'`` and ``M_R``.

        A padding sequence (``step.real`` False, no rows) keeps every state exactly (``torch.where`` with its old
        rows). Returns the core outputs ``[B, W, HV, V]`` (padding rows' are not read)."""
        p = params
        device = qkv.device
        slots, real, n = step.slots, step.real, step.inputs
        bsz, rows, _ = qkv.shape
        take = lambda t: take_rows(t, slots, bsz, False)  # noqa: E731
        put = lambda t, new: put_rows(t, new, slots, False)  # noqa: E731
        g, beta = gdn_gates(a, b, p)
        state, conv = take(self.state), take(self.conv)
        position = torch.arange(rows, device=device)[None]
        if chunks:
            core, leading_state, rest_map = self._chunk_join(qkv, g, beta, step, state, conv, p, chunk_rule,
                                                             recurrent_rule, take, put, reference)
            d = step.deferred
            at = (d[:, None] + position).clamp(max=rows - 1)  # each input row's source row

            def front(t):
                return t.gather(1, at.view(*at.shape, *([1] * (t.dim() - 2))).expand(-1, -1, *t.shape[2:]))

            x, xg, xbeta = front(qkv), front(g), front(beta)
        else:
            core = leading_state = rest_map = None
            x, xg, xbeta = qkv, g, beta
        y = causal_conv_with_history(x, conv, p.conv_weight, p.conv_bias, p.activation)
        q, k, v = _split_heads(y, p)
        xg, xbeta = _gate_off(xg, xbeta, position < n[:, None])
        out, after = self._rule(rows == 1, chunk_rule, recurrent_rule, q, k, v, xg, xbeta, state)
        moved = real & (n > 0)
        state = torch.where(_per_row(moved, state), after.to(state.dtype), state)
        conv = torch.where(_per_row(moved, conv), _last_window(conv, x, n), conv)
        put(self.state, state)
        put(self.conv, conv)
        # the boundary after the input rows where some ran; elsewhere as it was (or as the chunk moved it)
        if leading_state is None:
            leading_state = take(self.leading_state)
        if rest_map is None:
            rest_map = take(self.rest_map)
        eye = torch.eye(p.head_k_dim, dtype=rest_map.dtype, device=device).expand_as(rest_map)
        for name, new, old in (("boundary_state", state, take(self.boundary_state)),
                               ("boundary_conv", conv, take(self.boundary_conv)),
                               ("leading_state", state, leading_state), ("rest_map", eye, rest_map)):
            put(getattr(self, name), torch.where(_per_row(moved, old), new.to(old.dtype), old))
        out = out.to(qkv.dtype)
        if core is None:
            return out
        # each input row's output back at its row d_b + j
        src = (position - step.deferred[:, None]).clamp(min=0)
        placed = out.gather(1, src.view(bsz, rows, 1, 1).expand(-1, -1, *out.shape[2:]))
        inputs_here = (position >= step.deferred[:, None]) & (position < (step.deferred + n)[:, None])
        return torch.where(inputs_here[..., None, None], placed, core)

    # ---- one sequence as the batch-1 engine keeps it ---------------------------------------------
    def export(self, i: int, layer, params: GDNLayerParams) -> None:
        """Write sequence ``i``'s states into ``layer`` (an empty `cache_utils.DeferredLinearAttentionLayer` of its
        own cache): the live conv window (HF's ``[1, C, Kc]`` layout) and recurrent state, and the boundary record
        (`SuffixStateMap`) that a later join at its boundary needs."""
        k = params.kernel_size
        layer.update_conv_state(history_to_hf_conv_state(self.conv[i:i + 1], k))  # first update: stored as given
        layer.update_recurrent_state(self.state[i:i + 1].clone())
        smap = SuffixStateMap(params)
        smap.reset_boundary(self.boundary_state[i:i + 1], self.boundary_conv[i:i + 1])
        t = self.suffix_length[i]
        lead = min(t, self.width)
        smap.restore_suffix(
            leading=LeadingSegment(self.leading_qkv[i:i + 1, :lead].clone(), self.leading_a[i:i + 1, :lead].clone(),
                                   self.leading_b[i:i + 1, :lead].clone()),
            leading_state=self.leading_state[i:i + 1], rest_map=self.rest_map[i:i + 1], suffix_length=t,
            tail=(self.leading_qkv[i:i + 1, :t] if t < self.width else self.conv[i:i + 1]))
        layer.suffix_map = smap

    def export_rows(self, rows: list[int], layers: list, params: GDNLayerParams,
                    index: torch.Tensor | None = None) -> None:
        """`export` for the sequences ``rows`` at once, sequence ``rows[j]`` into ``layers[j]``: the same states and
        record, from one gathered copy of each state tensor (a launch per tensor for all of them, where `export` makes
        a dozen copies a sequence). Each cache's tensors are its own row of those copies (views), which nothing else
        holds: a later in-place update of one cache writes only its row. ``index``: ``rows`` already on the device
        (`PackedGDNStates.row_index`, once for every layer)."""
        if len(rows) != len(layers):
            raise ValueError(f"export_rows got {len(rows)} rows for {len(layers)} layers.")
        if not rows:
            return
        k = params.kernel_size
        index = _row_index(rows, self.state.device) if index is None else index
        got = {name: getattr(self, name).index_select(0, index) for name in self._NAMES}
        conv = history_to_hf_conv_state(got["conv"], k)
        for j, (r, layer) in enumerate(zip(rows, layers)):
            one = {name: t[j:j + 1] for name, t in got.items()}
            layer.update_conv_state(conv[j:j + 1])  # first update: stored as given
            layer.update_recurrent_state(one["state"])
            t = self.suffix_length[r]
            lead = min(t, self.width)
            layer.suffix_map = SuffixStateMap.restored(
                params, one["boundary_state"], one["boundary_conv"],
                LeadingSegment(one["leading_qkv"][:, :lead], one["leading_a"][:, :lead], one["leading_b"][:, :lead]),
                one["leading_state"], one["rest_map"], t, one["leading_qkv"][:, :t] if t < self.width else one["conv"])


class PackedGDNStates:
    """Every GDN layer's `PackedGDNState` of a packed batch of ``batch`` sequences (created at the layer's first
    packed forward, from its parameters)."""

    def __init__(self, batch: int):
        self.batch = int(batch)
        self.layers: dict[int, PackedGDNState] = {}
        self.version = 0  # bumped whenever a layer's tensors are (re)allocated: captured steps hold their addresses
        self.on_short = None  # `kv_pool.SlotKVPool.on_short`'s twin, for a growth of these states

    def layer(self, layer_idx: int, params: GDNLayerParams, dtype: torch.dtype, device) -> PackedGDNState:
        state = self.layers.get(layer_idx)
        if state is None:
            state = self.layers[layer_idx] = PackedGDNState(self.batch, params, dtype, device)
            self.version += 1
        return state

    def select(self, keep: list[int]) -> None:
        """Keep the sequences ``keep`` (in that order) in every layer."""
        for state in self.layers.values():
            state.select(keep)
        self.batch = len(keep)
        self.version += 1

    # ---- rows as slots (`batch_engine`) ------------------------------------------------------------
    def take(self, rows: list[int]) -> "PackedGDNStates":
        """The states of rows ``rows`` as a `PackedGDNStates` of ``len(rows)`` sequences (copies), for one packed
        forward; layers not created yet are created fresh in it (and in this one by `put`)."""
        sub = PackedGDNStates(len(rows))
        if self.layers:
            index = self.row_index(rows)  # once for every layer
            sub.layers = {i: state.take(rows, index) for i, state in self.layers.items()}
        return sub

    def put(self, rows: list[int], sub: "PackedGDNStates") -> None:
        """Write ``sub``'s states (after a forward) back into rows ``rows``."""
        index = None
        for i, state in sub.layers.items():
            mine = self.layers.get(i)
            if mine is None:
                mine = self.layers[i] = state.fresh(self.batch)
                self.version += 1
            if index is None:  # once for every layer
                index = _row_index(rows, mine.state.device)
            mine.put(rows, state, index)

    def reset(self, row: int) -> None:
        for state in self.layers.values():
            state.reset(row)

    def row_index(self, rows: list[int]) -> torch.Tensor | None:
        """``rows`` on the states' device (None while no layer exists), for the calls that take an ``index``."""
        if not self.layers:
            return None
        return _row_index(rows, next(iter(self.layers.values())).state.device)

    def reset_rows(self, rows: list[int]) -> None:
        """`reset` of every row of ``rows`` at once (a launch per tensor for all of them)."""
        if not rows or not self.layers:
            return
        index = self.row_index(rows)
        for state in self.layers.values():
            for name in PackedGDNState._NAMES:
                if name != "rest_map":
                    getattr(state, name).index_fill_(0, index, 0)
            eye = torch.eye(state.rest_map.shape[-1], dtype=state.rest_map.dtype, device=state.rest_map.device)
            state.rest_map.index_copy_(0, index, eye.expand(len(rows), *state.rest_map.shape[1:]))
            for r in rows:
                state.suffix_length[r] = 0

    def grow(self, batch: int) -> None:
        """Every layer's rows to ``batch``. A layer whose allocation fails asks `on_short` for the bytes still needed
        and, if room was made, tries again. An allocation that fails still leaves the layers before it grown (a retry
        skips them) and ``version`` bumped all the same where one grew: captured steps hold the replaced tensors'
        addresses."""
        if batch <= self.batch:
            return
        before = [state.batch for state in self.layers.values()]
        grown = False
        try:
            grow_each(self.layers.values(), lambda state: state.grow(batch), lambda state: state.grow_growth(batch),
                      self.on_short)
            grown = True
        finally:
            if grown or [state.batch for state in self.layers.values()] != before:  # (a failure that grew no layer
                self.version += 1  # leaves the captured steps theirs)
        self.batch = int(batch)

    def move(self, src: int, dst: int) -> None:
        """Row ``src``'s states into row ``dst`` (in place); ``src`` is reset (`kv_pool.SlotKVPool.move`'s twin)."""
        for state in self.layers.values():
            for name in PackedGDNState._NAMES:
                t = getattr(state, name)
                t[dst] = t[src]
            state.suffix_length[dst] = state.suffix_length[src]
        self.reset(src)

    def advance_suffix(self, rows: list[int]) -> None:
        """One generated token recorded in each of ``rows`` (host ints; after a captured step, whose device part
        `PackedGDNState.static_step` made the records)."""
        for state in self.layers.values():
            for r in rows:
                state.suffix_length[r] += 1

    def reset_suffix(self, rows: list[int]) -> None:
        """No generated token recorded in ``rows`` any more (host ints; after a captured prompt piece, whose device
        part `PackedGDNState.static_prefill` moved their boundaries after its input rows)."""
        for state in self.layers.values():
            for r in rows:
                state.suffix_length[r] = 0

    def save_rows(self, index: torch.Tensor) -> list:
        """Copies of rows ``index`` (a device tensor) of every layer's tensors, for `restore_rows`."""
        return [[getattr(state, name).index_select(0, index) for name in PackedGDNState._NAMES]
                for state in self.layers.values()]

    def restore_rows(self, index: torch.Tensor, saved: list) -> None:
        """Rows ``index`` back to what `save_rows` copied (in place)."""
        for state, rows in zip(self.layers.values(), saved):
            for name, row in zip(PackedGDNState._NAMES, rows):
                getattr(state, name).index_copy_(0, index, row)
