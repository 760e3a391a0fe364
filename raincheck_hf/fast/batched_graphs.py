"""The batched engine's steps as CUDA graphs, one per key (batch bucket, width, span bucket, ...).

`batch_engine.BatchEngine` runs a decode step (`decode_only`: each sequence's decode rows ``[chunk?, token]``, or a
restoring sequence's piece of pending deferred rows, `batched.RestoringState`) through `BatchedStepGraphs` instead
of the eager `batch_engine.ForwardRunner`: the step's inputs are copied into static buffers and a graph captured on
them is replayed. Prompts do too (`accepts`): on the attention families a short prompt's piece (a follow-up
question, `ride_rows`) rides in the decode step like one more sequence, its rows at its slot's offsets with their
order keys; any other prompt piece runs alone in a step of its own (``prefill`` keys: batch 1, a width of
`PREFILL_WIDTHS`, its slot gathered), which an eager forward would launch layer by layer for tens of
milliseconds of host time. A graph's key (`BatchStepKey`):

- ``batch``: the step's sequences (restoring ones included) rounded up on `BATCH_BUCKETS` (1, 2, 4, ..., 64, then
  multiples of 64); the unused rows of a bucket are padding sequences in free slots or the pool's scratch slot
  (`kv_pool.SlotKVPool.scratch`): their keys are ``MAX_KEY``, so no real query sees what they write, and their
  logits are ignored;
- ``width``: the widest sequence's rows rounded up to the chunk ladder (`width_bucket`: 1, or ``c + 1`` for a
  chunk size ``c`` the configuration can take; a restoring piece of at most the idle chunk, `BatchEngine.restore`'s
  default, lands on the same ladder); a shorter sequence's rows are padded at its end, as on the eager engine (they
  write after its length with the empty key, which its next rows overwrite);
- ``span``: the slot rows attention reads, the step's longest ``length + width`` on the geometric ladder of
  `static_cache.slot_bucket` (at most the pool's capacity);
- ``dense`` (below) and, on the Gated DeltaNet families, ``records`` / ``chunks``: some sequence records its token /
  carries deferred rows (below).

Static buffers (`BatchStepBuffers`): embeddings ``[B, W, D]``, positions ``[3, B, W]``, query keys ``[B, W]``,
the step's slots ``[B]`` and write offsets ``[B, W]``, one dense DeepStack addend ``[B, W, D]`` per DeepStack
layer (zero on rows without features; added by the decoder layers' hooks of `fast.scoping`, as the
single-sequence fast path does, instead of HF's boolean-indexed add), the last real row of each sequence, and the
logits ``[B, V]`` (a restoring piece's, like a padding sequence's, are computed and ignored: a restoring sequence
generates nothing). Every buffer is rewritten before every replay, so nothing of one step (or call) is read by
the next. Inside the step (`BatchedStepGraphs._step`) the keys are written into the pool's ``slot_keys`` and
the visibility ``[B, W, T]`` is computed from them on the device (docs/method.md §3 per sequence: a real query
sees its slot's rows whose key is not larger than its own; a padding query sees only its own row, so its output
stays finite); no value is read back to the host.

Attention reads views ``keys[:B, :, :T]`` of the pool's layers (no copy) when the step's sequences hold slots
``0 .. n - 1`` (a *dense* step; the bucket's padding sequences then take the free slots ``n .. B - 1``, the pool
growing to ``B`` slots): an engine with graphs keeps its sequences in the lowest slots, moving the one in the
highest slot into the hole a leaving sequence makes (`kv_pool.SlotKVPool.move`, in `BatchEngine.remove`), and a
step orders its sequences by slot (a restoring sequence holds a slot like any other). Otherwise (a sequence not in
the step holds one of the slots ``0 .. B - 1``: one still prefilling, one not fed this step, a restoring one the
step's budget gave no rows) the step gathers its slots (``index_select``, a copy of ``[B, H, T, D]`` per layer, as
the eager engine does) and its padding sequences write to the pool's scratch slot; ``dense`` is part of the key.

Graphs belong to the engine's pool: captured once per key, recaptured when the pool reallocates its tensors
(`kv_pool.SlotKVPool.version`) or the recurrent states theirs (`batched_gdn.PackedGDNStates.version`). A capture's
warm-up runs the real step it is captured for: on attention-only families a step is idempotent (it writes the same
rows with the same values and keys), so the replay that follows gives the same result. A prompt piece's DeepStack
rows between its text rows (an image inside the prompt) are placed row by row on the device: each visual row takes
the features of its rank among the piece's visual rows (`_fill`). On the Gated DeltaNet families no prompt rides (a
prompt's rows advance the states as the step's ``[deferred, token]`` layout does not); a piece alone runs its GDN
layers through `batched_gdn.PackedGDNState.static_prefill` (a continued conversation's leftover deferred rows in
front of the turn's input rows, if any, from the boundary and joined: ``chunks`` in the key; the counts on the
device).

Gated DeltaNet families (Qwen3.5, Qwen3.5-MoE): the per-slot recurrent states (`batched_gdn.PackedGDNStates`, a row
per slot of the pool, the scratch slot included) belong to the pool too (`BatchedStepGraphs.recurrent`; the engine's
eager forwards take and put the same rows). Every `decode_only` step runs here, as on the attention families: the
plain decode step (every sequence one generated row: ``full`` mode, and an answer whose deferred rows are all
restored), ``[chunk, token]`` steps and restoring pieces. Each GDN layer reads and writes its sequences' rows
through the step's slot indices (``slots``, a device tensor: no host int from the device inside the step;
`batched_gdn.PackedGDNState.static_step`), or in a dense step in place on views of rows ``0 .. B - 1`` (no copy of
the states in and out); `RecurrentStepBuffers` say per batch row whether it is a real sequence
(a padding sequence's rows are written back unchanged), how many deferred rows it carries (the chunk runs over the
step's whole width from each boundary, the rows after a sequence's own chunk gated off, ``g = 0, beta = 0``),
whether a token follows them (gathered from its row), and whether that token is recorded as a leading token or into
``M_R`` at its suffix length; the join, the conv window and the records are chosen per sequence by masks
(``torch.where`` with the old values). They are rewritten before every replay like the other buffers. Whether some
sequence carries deferred rows (``chunks``) and whether some records (``records``) are part of the key, so the plain
decode step computes neither; the host's suffix lengths move after the step (`PackedGDNStates.advance_suffix`). A
step is not idempotent here (the states advance), so the capture copies the step's rows of the states before its
warm-up and puts them back after it: the replay that follows runs the real step once.

The batched steps run the few-query attention of `fast.attention` (on ``sdpa`` models, its Triton kernel on CUDA, which
reads each sequence's keys only up to its own rows, ``write[:, -1] + 1``, not the whole span the step's longest sequence
sets, and computes no block of only padding rows: a one-token sequence beside 32-row chunks costs one block of its rows;
`fast.context.StepScope`'s ``key_extent`` and ``query_rows``) and, with ``RaincheckConfig.compile_steps`` (by default
wherever the steps are captured, i.e. on CUDA: `resolve_compile_steps`), the family's compiled forms
(`ModelAdapter.compile_targets`, `fast.compiled`) as the single-sequence fast path's steps do: Qwen3-VL's decoder layers
as two compiled regions around the cache write and the attention, the other families' norms and dense MLPs. Unlike
there, the attention's core is not compiled (``compile_attention=False``): at a batch the kernel beats the compiled
matmul form. Whether a step is compiled is part of its key (`BatchStepKey.compiled`), so engines of one model with
either setting share its kept pool. Inductor compiles a region once per process, inside the first capture: its row
dimensions are unbacked (`fast.compiled.mark_rows`), so one graph serves a single row, several rows and a batch.

Without CUDA (``graphs=True`` on a CPU model) the same step runs eagerly on the same static buffers (no capture:
there is nothing to replay), which is what the CPU tests exercise.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..cache_utils import DEFERRED, GENERATED, INPUT, to_device_all
from ..configuration import CHUNK_LADDER, RaincheckConfig
from ..kv_pool import DEFAULT_SLOTS, MAX_KEY, SlotKVPool, SlotStep
from ..masking import batched_visibility_to_attention_mask
from ..models.base import accelerate_split
from . import static_cache
from .compiled import resolve_compile_steps
from .scoping import CAPTURE_LOCK, graph_capture, step_scope

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # then multiples of the largest


def batch_bucket(n: int) -> int:
    """The batch size a step of ``n`` sequences runs at (`BATCH_BUCKETS`, then multiples of 64)."""
    for b in BATCH_BUCKETS:
        if n <= b:
            return b
    top = BATCH_BUCKETS[-1]
    return -(-int(n) // top) * top


PREFILL_WIDTHS = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)  # a prompt piece alone: its widths


def width_bucket(widest: int, config: RaincheckConfig) -> int:
    """Rows per sequence of a decode step whose widest sequence has ``widest`` rows: 1 (tokens only), else the
    smallest ``c + 1`` >= ``widest`` for a chunk size ``c`` of the configuration (its fixed size, the ladder)."""
    if widest <= 1:
        return 1
    sizes = {c + 1 for c in CHUNK_LADDER}
    if not config.auto_chunk:
        sizes.add(int(config.chunk_size) + 1)
    fitting = [s for s in sorted(sizes) if s >= widest]
    return fitting[0] if fitting else int(widest)


def split_width(config: RaincheckConfig) -> int:
    """The width of the wide half of a step split by width (`BatchedStepGraphs.prepare`'s ``gather``): the largest
    chunk + 1 on the ladder, which holds any chunk, restoring piece (at most the idle chunk, the largest chunk) or
    riding prompt (`BatchedStepGraphs.ride_width`) such a half carries."""
    return width_bucket(config.max_chunk_size + 1, config)


def _alone(entries) -> bool:
    """A prompt piece alone in its step: it takes a prefill width and gathers its slot (views would pad every lower
    slot to its width)."""
    return len(entries) == 1 and _piece(*entries[0])


def step_width(entries, config: RaincheckConfig, gather: bool = False) -> int:
    """The rows per sequence `BatchedStepGraphs.prepare` runs the forward ``entries`` at (each entry padded to them,
    written in its slot from its length on): a prompt piece alone its `prefill_width`, else the `width_bucket` of the
    widest entry, and the wide half of a step split by width (``gather``) at least `split_width`."""
    widest = max(len(g) for _, g in entries)
    if _alone(entries):
        return prefill_width(widest)
    width = width_bucket(widest, config)
    return max(width, split_width(config)) if gather else width


def prefill_width(rows: int) -> int:
    """The width of a step that runs a prompt piece of ``rows`` rows alone: the smallest of `PREFILL_WIDTHS` that holds
    it (``rows`` beyond them: such a piece runs eagerly)."""
    return next((w for w in PREFILL_WIDTHS if w >= rows), int(rows))


def _piece(seq, group) -> bool:
    """Whether ``group`` is a prompt piece (of a turn's prefill: not a decode group ``[chunk?, token]``, whose last row
    is its generated token, nor a restoring sequence's piece); host data only."""
    return not seq.restores_only and int(torch.as_tensor(group.kinds)[-1]) != GENERATED


def _leading_deferred(kinds: torch.Tensor) -> int:
    """How many of a group's rows (host ``kinds``) are deferred rows before its first other row."""
    other = kinds.ne(DEFERRED)
    return int(other.to(torch.int8).argmax()) if bool(other.any()) else int(kinds.numel())


def _piece_layout(group) -> tuple[int, int] | None:
    """``(leading deferred rows, input rows)`` of a prompt piece ``group`` laid out as a captured prefill step runs
    it on the Gated DeltaNet families (`PackedGDNState.static_prefill`): a continued conversation's leftover deferred
    rows, then the turn's input rows (either part may be empty); None for any other layout. Host data only."""
    kinds = torch.as_tensor(group.kinds, dtype=torch.int8).cpu()
    deferred = _leading_deferred(kinds)
    if not bool(kinds[deferred:].eq(INPUT).all()):
        return None
    return deferred, int(kinds.numel()) - deferred


def batched_graph_blocker(adapter) -> str | None:
    """Why this model's batched decode steps cannot run as captured steps, or None."""
    if not adapter.supports_fast_path:
        return "the family has no fast path"
    split = accelerate_split(adapter.model)
    if split is not None:
        return f"accelerate placed the model {split} (captured steps need it on one device)"
    return None


def resolve_graphs(adapter, config: RaincheckConfig, graphs: bool | None) -> bool:
    """Whether a `BatchEngine` runs its decode steps through `BatchedStepGraphs` (``graphs``: the engine's setting;
    None follows ``config.fast_path``; auto, None for both: captured on CUDA where the family and the model allow
    it, else eager). A ValueError where they were asked for and cannot run, or where the two settings disagree."""
    if graphs is not None and not isinstance(graphs, bool):
        raise ValueError(f"BatchEngine graphs must be None (auto), True or False, got {graphs!r}.")
    if graphs is not None and config.fast_path is not None and graphs != config.fast_path:
        raise ValueError(f"BatchEngine graphs={graphs} contradicts RaincheckConfig.fast_path={config.fast_path}; "
                         "set one of them (or both the same).")
    wanted = config.fast_path if graphs is None else graphs
    blocker = batched_graph_blocker(adapter)
    on_cuda = adapter.device.type == "cuda"
    if wanted is True:
        if blocker is None and on_cuda:
            blocker = adapter.step_graph_blocker()
        if blocker is not None:
            raise ValueError(f"RaincheckConfig.fast_path=True (BatchEngine graphs=True) with a batch: {blocker}. "
                             "Use fast_path=None (auto) or False for batches on this model.")
        return True
    if wanted is False or not on_cuda or blocker is not None:
        return False
    # auto (None) on CUDA: the captured steps wherever they can run, as the single-sequence fast path
    return adapter.step_graph_blocker() is None


def decode_only(entries) -> bool:
    """The step carries no prompt piece, so it can be replayed: every entry is a decode group ``[deferred chunk?,
    generated token]`` that wants its logits, or a restoring sequence's piece (a sequence with ``restores_only``,
    `batched.RestoringState`: deferred rows only, no logits wanted)."""
    # one comparison over every entry's kinds (a few tensor operations per step, whatever the batch): every row
    # DEFERRED but each decode group's last, which is GENERATED
    if any(group.want_logits == seq.restores_only for seq, group in entries):
        return False
    kinds = torch.cat([torch.as_tensor(group.kinds, dtype=torch.int8).reshape(-1) for _, group in entries])
    lengths = [len(group) for _, group in entries]
    want = torch.full((kinds.shape[0],), DEFERRED, dtype=torch.int8)
    ends, end = [], 0
    for (seq, _), n in zip(entries, lengths):
        end += n
        if not seq.restores_only:
            ends.append(end - 1)
    want[ends] = GENERATED
    return torch.equal(kinds.cpu(), want)


# the rows (batch bucket x width) a step may reach by a prompt riding in it (`ride_rows`). Measured on the H200 at the
# Qwen3-VL-8B shape (`bench serve-load --ride-rows any,1024`, the server's loop, one round each): a 32-row follow-up
# riding in the decode step of 8 answers (256 rows) made that step 13.9 ms against 18.6 ms for the decode step
# and the follow-up's own forward after it (its pass over the weights again, and the host's second launch); at 32
# answers (1,024 rows) every step a follow-up rode in was wider (20.1 against 14.7 ms a replayed step) but the round
# gave more tokens/s (901 against 879) and an earlier median first token (346 against 390 ms). Beyond 1,024 rows
# (64 answers) a prompt runs in a forward of its own: not measured there
RIDE_MAX_ROWS = 1024


def _visual_rows_lead(group) -> bool:
    """Whether ``group``'s DeepStack rows are exactly its leading deferred rows (none, or a chunk's, a restoring
    piece's or a continued conversation's leftover deferred rows before a text prompt), the layout a captured step
    places DeepStack features in (`BatchedStepGraphs._fill`); from host data only (the features' row count and the
    rows' kinds). A prompt whose image rows sit between its text rows is not."""
    visual = group.batch.num_deepstack_rows
    if visual == 0:
        return True
    return visual == _leading_deferred(torch.as_tensor(group.kinds, dtype=torch.int8).cpu())


class BatchStepKey(NamedTuple):
    batch: int  # sequences, padding rows included (`batch_bucket`)
    width: int  # rows per sequence (`width_bucket`)
    span: int  # slot rows attention reads
    dense: bool  # the step's slots are 0 .. batch - 1 (padding sequences in the free ones): attention reads views
    records: bool = False  # Gated DeltaNet families: some sequence records its generated row (deferred rows pending)
    chunks: bool = False  # Gated DeltaNet families: some sequence carries deferred rows (a chunk, a restoring piece)
    compiled: bool = False  # the step runs the family's compiled forms (`RaincheckConfig.compile_steps`)
    prefill: bool = False  # a prompt piece alone (batch 1, a width of `PREFILL_WIDTHS`, its slot gathered)


@dataclass
class RecurrentStepBuffers:
    """The Gated DeltaNet part of a captured step's buffers (`batched_gdn.PackedGDNState.static_step`): the step's
    slots (the `BatchStepBuffers`' own tensor) index the per-slot states; per batch row ``real`` (False: a padding
    sequence, its states written back unchanged), ``deferred`` (its leading deferred rows), ``token`` (a generated
    row follows them: a decode group, not a restoring piece), ``lead`` / ``record_map`` (its generated row is
    recorded as a leading token / into M_R) and ``suffix`` (its recorded suffix length before the step); a prompt
    piece's step (``prefill`` keys: `PackedGDNState.static_prefill`) reads ``deferred`` (a continued conversation's
    leftover deferred rows in front), ``inputs`` (the turn's input rows after them) and ``suffix``."""

    slots: torch.Tensor  # [B] long
    real: torch.Tensor  # [B] bool
    deferred: torch.Tensor  # [B] long
    token: torch.Tensor  # [B] bool
    lead: torch.Tensor  # [B] bool
    record_map: torch.Tensor  # [B] bool
    suffix: torch.Tensor  # [B] long
    inputs: torch.Tensor  # [B] long

    @classmethod
    def empty(cls, slots: torch.Tensor) -> "RecurrentStepBuffers":
        b, device = slots.shape[0], slots.device
        flag, long = dict(dtype=torch.bool, device=device), dict(dtype=torch.long, device=device)
        return cls(slots, torch.zeros(b, **flag), torch.zeros(b, **long), torch.zeros(b, **flag),
                   torch.zeros(b, **flag), torch.zeros(b, **flag), torch.zeros(b, **long), torch.zeros(b, **long))

    def tensors(self) -> list[torch.Tensor]:
        return [self.real, self.deferred, self.token, self.lead, self.record_map, self.suffix, self.inputs]


@dataclass
class BatchStepBuffers:
    embeds: torch.Tensor  # [B, W, D]
    positions: torch.Tensor  # [3, B, W]
    query_keys: torch.Tensor  # [B, W]
    slots: torch.Tensor  # [B]
    write: torch.Tensor  # [B, W]
    last: torch.Tensor  # [B]: each sequence's last real row
    deepstack: list[torch.Tensor]  # [B, W, D] per DeepStack layer
    logits: torch.Tensor | None = None  # [B, V], set by the step
    recurrent: RecurrentStepBuffers | None = None  # Gated DeltaNet families

    @classmethod
    def empty(cls, key: BatchStepKey, hidden: int, num_deepstack: int, dtype, device,
              recurrent: bool = False) -> "BatchStepBuffers":
        b, w = key.batch, key.width
        long = dict(dtype=torch.long, device=device)
        buffers = cls(torch.zeros(b, w, hidden, dtype=dtype, device=device), torch.zeros(3, b, w, **long),
                      torch.full((b, w), MAX_KEY, **long), torch.zeros(b, **long), torch.zeros(b, w, **long),
                      torch.zeros(b, **long),
                      [torch.zeros(b, w, hidden, dtype=dtype, device=device) for _ in range(num_deepstack)])
        if recurrent:
            buffers.recurrent = RecurrentStepBuffers.empty(buffers.slots)
        return buffers

    def tensors(self) -> list[torch.Tensor]:
        """The input buffers (what every fill rewrites)."""
        extra = self.recurrent.tensors() if self.recurrent is not None else []
        return [self.embeds, self.positions, self.query_keys, self.slots, self.write, self.last, *self.deepstack,
                *extra]


class PreparedBatchStep(NamedTuple):
    """A step `BatchedStepGraphs.prepare` made ready: its entries in slot order, their slots and start rows, its key
    and the filled buffers, and the pool's setting it was made on."""

    entries: list
    slots: list
    starts: list
    key: BatchStepKey
    buffers: BatchStepBuffers
    setting: tuple
    recorded: tuple = ()  # Gated DeltaNet families: the slots whose generated row the step records
    padding: tuple = ()  # a dense step's padding sequences: ((slot, start row), ...) (`BatchedStepGraphs.prepare`)
    rows: tuple = ()  # each entry's batch row (a dense step: its slot)
    inputs_ran: tuple = ()  # Gated DeltaNet prompt piece: its slot if input rows ran (its suffix goes back to 0)


class _DeviceStep(SlotStep):
    """The pool's running step as device tensors (the step's buffers), for `kv_pool.SlotKVLayer.update`."""

    def __init__(self, buffers: BatchStepBuffers, span: int, dense: bool):
        super().__init__(buffers.slots, buffers.write, span, [], int(buffers.slots.shape[0]) if dense else None)
        self._buffers = buffers

    def on(self, device):
        if device != self._buffers.slots.device:  # one device only (`batched_graph_blocker`)
            raise RuntimeError(f"a captured batched step runs on {self._buffers.slots.device}, a layer on {device}")
        return self._buffers.slots, self._buffers.write


class _EagerStep:
    """A step that runs the captured callable eagerly on its buffers (no CUDA: nothing to capture)."""

    def __init__(self, run):
        self.run = run

    def replay(self):
        self.run()


class BatchedStepGraphs:
    """The captured decode steps of one `BatchEngine` (its adapter and pool; see the module docstring)."""

    views = True  # dense steps read views of their slots (False: every step gathers, as the eager engine does)

    def __init__(self, adapter, pool: SlotKVPool):
        if not pool.has_scratch:
            raise ValueError("BatchedStepGraphs needs a SlotKVPool with a scratch slot (scratch_slot=True).")
        self.adapter, self.pool = adapter, pool
        self.made_for = (adapter.device, adapter.dtype)  # where the pool's tensors live
        self.use_cuda = torch.cuda.is_available() and adapter.device.type == "cuda"
        self.hidden = adapter.text_model.config.hidden_size
        self.num_deepstack = adapter.num_deepstack_layers
        self._captured: dict[BatchStepKey, tuple] = {}
        self._prefill_buffers: dict[int, BatchStepBuffers] = {}  # a prompt piece alone: one set per width
        # Gated DeltaNet families: the per-slot recurrent states (`batched_gdn.PackedGDNStates`, a row per slot of the
        # pool, scratch slot included), kept with the pool: the engine's eager forwards use them too
        self.recurrent = adapter.packed_states(pool.total_slots)
        self._setting = self._current_setting()  # what the captured graphs were made on
        self._mempool = None
        self.capture_log: list[BatchStepKey] = []  # every capture, in order
        self.replays = 0
        self.failed = False  # a capture raised: every decode step runs eagerly from then on
        self.failure: str | None = None  # what the failed capture raised
        # a prompt step's capture raised: prompt pieces run on the eager forward from then on, the decode steps keep
        # their graphs (a failure there does not cost every answer its captured decode steps)
        self.prefill_failed = False
        self.ran_eagerly = False  # the last `launch` ran its step eagerly on its buffers (its capture failed)

    def _current_setting(self) -> tuple:
        """What captured graphs depend on beyond their key: the pool's tensors, the attention backend, the recurrent
        states' tensors."""
        return (self.pool.version, self.adapter.attn_implementation,
                None if self.recurrent is None else self.recurrent.version)

    def accepts(self, entries, config: RaincheckConfig) -> bool:
        """Whether the forward ``entries`` runs here (else on the eager `batch_engine.ForwardRunner`), decided on the
        host from the entries' kinds and sizes: a `decode_only` step (decode groups ``[chunk?, token]`` and restoring
        pieces), on every family (the Gated DeltaNet ones: `PackedGDNState.static_step`); a prompt piece alone of up
        to the largest of `PREFILL_WIDTHS` rows (`batch_engine.RowScheduler` gives each piece that does not ride a
        forward of its own), on the Gated DeltaNet families too (`PackedGDNState.static_prefill`: a continued
        conversation's leftover deferred rows, then the turn's input rows, `_piece_layout`); on the attention families
        also a step with short prompt pieces beside decode rows (`ride_rows`: no wider than the widest warmed
        width)."""
        if decode_only(entries):
            return True
        if len(entries) == 1 and _piece(*entries[0]):
            group = entries[0][1]
            return (not self.prefill_failed and len(group) <= PREFILL_WIDTHS[-1]
                    and (self.recurrent is None or _piece_layout(group) is not None))
        if not self.rides:
            return False
        return width_bucket(max(len(g) for _, g in entries), config) <= self.ride_width(config)

    @property
    def rides(self) -> bool:
        """Whether a short prompt piece may ride in a decode step (the attention families: `ride_rows`); on the Gated
        DeltaNet families a prompt's rows advance the recurrent states as the step's ``[deferred, token]`` layout
        does not, so each piece runs alone in a step of its own."""
        return self.recurrent is None

    def ride_width(self, config: RaincheckConfig) -> int:
        """The widest step `warm_keys` captures for ``config`` on an attention family (``width_bucket`` of the largest
        chunk + 1: prompt pieces up to it ride in the captured steps), 0 where no prompt rides (`rides`)."""
        return width_bucket(config.max_chunk_size + 1, config) if self.rides else 0

    def ride_rows(self, prefill, config: RaincheckConfig, width: int, sequences: int,
                  max_rows: int = RIDE_MAX_ROWS) -> int:
        """How many rows of a sequence's remaining prompt ``prefill`` (its `batched.RowGroup`: a continued
        conversation's leftover deferred rows, then the turn's rows) ride in this step's captured forward beside the
        decode rows (the whole prompt), or 0: it runs in a forward of its own after theirs (alone in a captured
        prefill step: `accepts`). ``width``: the step's rows per sequence so far (its widest decode group);
        ``sequences``: its sequences with this one. A prompt rides when it fits in `ride_width` (a follow-up
        question) and the step stays within ``max_rows`` rows (batch bucket x width; `RIDE_MAX_ROWS` unless the
        engine's ``ride_max_rows`` says otherwise), or is already as wide:
        there a forward of its own would cost one more pass over the weights, while beyond it every sequence of
        the step would pay the prompt's width."""
        rows = len(prefill)
        most = self.ride_width(config)
        if most == 0 or rows > most:
            return 0
        need = width_bucket(rows, config)
        if need <= width_bucket(width, config) or batch_bucket(sequences) * need <= max_rows:
            return rows
        return 0

    # ---- the step itself, identical in eager and captured form ----
    def _step(self, buffers: BatchStepBuffers, key: BatchStepKey) -> None:
        adapter, pool = self.adapter, self.pool
        span = key.span
        slots, write, queries = buffers.slots, buffers.write, buffers.query_keys
        pool.slot_keys[slots[:, None], write] = queries  # the rows' own keys first: a row sees itself
        stored = pool.slot_keys[:, :span].index_select(0, slots)  # [B, T]
        visible = stored[:, None, :] <= queries[:, :, None]
        own = write[:, :, None] == torch.arange(span, device=write.device)[None, None]
        visible = torch.where((queries == MAX_KEY)[:, :, None], own, visible)
        mask = batched_visibility_to_attention_mask(visible, adapter.attn_implementation, adapter.dtype)
        text_model = adapter.text_model
        # each batch row's rows sit at ``write`` (its start + 0 .. W - 1) and see nothing past them: stored rows below,
        # empty slots (``MAX_KEY``) above; the attention reads each sequence's keys up to there only, and skips its
        # padding rows (those after its real ones, `_placement`; their keys are ``MAX_KEY``) where a block holds only
        # such rows
        extent = write[:, -1] + 1
        query_rows = (queries != MAX_KEY).sum(-1)
        pool.step = _DeviceStep(buffers, span, key.dense)
        try:
            with step_scope(text_model, buffers.deepstack, layers=adapter.deepstack_layers(),
                            compile_targets=adapter.compile_targets() if key.compiled else (),
                            compile_attention=False, key_extent=extent, query_rows=query_rows), \
                    adapter.static_packed_step(self.recurrent, buffers.recurrent, key.chunks, key.records,
                                               key.prefill, key.dense):
                hidden = text_model(inputs_embeds=buffers.embeds, position_ids=buffers.positions,
                                    attention_mask=adapter.text_attention_mask(mask), cache=pool,
                                    use_cache=True).last_hidden_state
        finally:
            pool.step = None
        picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), buffers.last]  # [B, D]
        logits = adapter.lm_head(picked[:, None])[:, 0]
        if buffers.logits is None:
            buffers.logits = logits
        else:
            buffers.logits.copy_(logits)

    def _capture_new(self, key: BatchStepKey, buffers: BatchStepBuffers):
        """Capture ``key``'s step on ``buffers`` (filled) and keep it; None when the capture failed on CUDA: a warning,
        and every decode step runs eagerly from then on (``failed``), or for a prompt step (``key.prefill``) every
        prompt piece runs on the eager forward from then on (``prefill_failed``) while the decode steps keep their
        graphs. Without CUDA a failure raises."""
        try:
            graph = self._capture(key, buffers)
        except RuntimeError as error:
            if not self.use_cuda:
                raise
            step, instead = (("prompt", "prompt pieces on the eager forward") if key.prefill
                             else ("decode", "batched decode steps eagerly"))
            warnings.warn(f"raincheck batched engine: CUDA-graph capture of the {step} step {tuple(key)} failed "
                          f"({error}); running {instead} instead.", RuntimeWarning, stacklevel=4)
            if key.prefill:
                self.prefill_failed = True
            else:
                self.failed = True
            self.failure = f"{type(error).__name__}: {error}"
            return None
        self._captured[key] = (graph, buffers)
        self.capture_log.append(key)
        return graph

    def _capture(self, key: BatchStepKey, buffers: BatchStepBuffers):
        """A replayable step on ``buffers`` (filled with the real step: the warm-up runs execute it). Recurrent states
        advance with every run (a step is not idempotent there): the rows of the step's slots are copied before the
        warm-up and put back after it, so the replay that follows runs the real step once."""
        saved = None
        if self.recurrent is not None:
            saved = self.recurrent.save_rows(buffers.slots)
        try:
            return self._warm_and_capture(key, buffers)
        finally:
            if saved is not None:
                self.recurrent.restore_rows(buffers.slots, saved)

    def _warm_and_capture(self, key: BatchStepKey, buffers: BatchStepBuffers):
        run = lambda: self._step(buffers, key)  # noqa: E731
        if not self.use_cuda:
            run()  # (the first run: `BatchStepBuffers.logits` gets its tensor)
            return _EagerStep(run)
        with CAPTURE_LOCK:
            for _ in range(2):  # the warm-up, on the caller's stream (`fast.scoping`: what it allocates and keeps)
                run()
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph, self._mempool):
                run()
            self._mempool = graph.pool()
        return graph

    # ---- captures ahead of the first steps (`raincheck_hf.warm_up(batch=...)`) ----
    def warm_keys(self, config: RaincheckConfig, max_batch: int, split_batches=()) -> list[BatchStepKey]:
        """Every key a decode step of at most ``max_batch`` sequences of ``config`` can take on this pool as it is
        (its capacity: the span buckets), sequences in the lowest slots (`BatchEngine` keeps them there: the dense
        steps), smallest first: batch buckets up to ``batch_bucket(max_batch)``; widths 1 and, where the mode leaves
        deferred rows to restore beside tokens (chunks, or held conversations' restoring pieces), every `width_bucket`
        size up to the largest chunk + 1 (a last chunk is shorter; a ``batch_chunk_rows`` cap cuts chunks to ladder
        sizes); on the Gated DeltaNet families with and without recorded rows. A step beside sequences it does not carry
        (a turn's prompt piece in its own forward: `batch_engine.RowScheduler`'s ``separate_prefill``; a held
        conversation restoring that the budget gave no rows) is one of these keys too: those sequences' slots hold
        padding rows after their own rows, in the batch bucket of the step's highest slot (`prepare`). Only where that
        bucket is larger than the pool (and than the bucket of the step's sequences), or a padding row would not fit
        after its slot's rows, does a step gather its slots; its key is captured when it first runs. On every family
        also a prompt piece alone (`accepts`): batch 1, each of `PREFILL_WIDTHS` with every span that holds it, its slot
        gathered. ``split_batches``: the batch buckets of the wide halves of steps split by width
        (`batch_engine.split_batches`): each at `split_width`, every span, its slots gathered."""
        top = batch_bucket(max_batch)
        batches = [b for b in BATCH_BUCKETS if b <= top] + list(range(2 * BATCH_BUCKETS[-1], top + 1,
                                                                      BATCH_BUCKETS[-1]))
        widths = [1]
        if config.defers or self.recurrent is None:  # (chunks and restoring pieces; short prompt pieces: `ride_rows`)
            most = config.max_chunk_size + 1
            widths += sorted({width_bucket(w, config) for w in range(2, most + 1)})
        capacity = self.pool.capacity
        spans = sorted({static_cache.slot_bucket(rows, capacity) for rows in range(1, capacity + 1)})
        compiled = resolve_compile_steps(config.compile_steps, self.use_cuda and not self.failed)
        gdn = self.recurrent is not None
        keys = []
        for batch in batches:
            for width in widths:
                # GDN: whether some sequence records its token (deferred rows still pending after the step), and
                # whether some carries deferred rows (every step wider than one row; a one-row step carries none
                # but a one-row restoring piece, captured when it first runs)
                variants = [(False, False)] if not gdn else (
                    [(False, False), (True, False)] if width == 1 else [(False, True), (True, True)])
                for span in spans:
                    if span < width:
                        continue
                    for records, chunks in variants:
                        keys.append(BatchStepKey(batch, width, span, self.views, records, chunks, compiled))
        # the wide half of a step split by width (`batch_engine.WideForward`): its slots gathered, the largest chunk's width
        if config.defers or self.recurrent is None:
            width = split_width(config)
            for batch in split_batches:
                for span in spans:
                    if span < width:
                        continue
                    for records, chunks in ([(False, False)] if not gdn else [(False, True), (True, True)]):
                        keys.append(BatchStepKey(batch, width, span, False, records, chunks, compiled))
        # a prompt piece alone: batch 1, its slot gathered, up to the pool's capacity; on the Gated DeltaNet families
        # in the modes that defer also with a continued conversation's leftover deferred rows in front (``chunks``)
        leftovers = [False, True] if gdn and config.defers else [False]
        for width in PREFILL_WIDTHS:
            keys += [BatchStepKey(1, width, span, False, False, chunks, compiled, True)
                     for span in spans if span >= width for chunks in leftovers]
        return keys

    def warm(self, config: RaincheckConfig, max_batch: int, on_capture=None, split_batches=()) -> int:
        """Capture every key of `warm_keys` not captured yet, on padding-only buffers (every row a padding row of the
        free slots: nothing is stored, no state moves); returns how many were captured. The pool must have no
        sequence; it grows to ``batch_bucket(max_batch)`` slots first, at least the `DEFAULT_SLOTS` an engine asks
        for (a pool that grows later drops its graphs).
        ``on_capture(i, total)`` after each capture (a progress bar). On a CPU (nothing to capture) each key's
        step runs once on its buffers, as a first step of that key would."""
        pool = self.pool
        if pool.step is not None or len(pool._free) != pool.num_slots:
            raise RuntimeError("BatchedStepGraphs.warm needs a pool with no sequence in it.")
        pool.grow_slots(max(batch_bucket(max_batch), DEFAULT_SLOTS))
        if self.recurrent is not None:
            self.adapter.make_packed_layers(self.recurrent)
            self.recurrent.grow(pool.total_slots)
        setting = self._current_setting()
        if setting != self._setting:
            self._captured.clear()
            self._mempool, self._setting = None, setting
        todo = [key for key in self.warm_keys(config, max_batch, split_batches) if key not in self._captured]
        with torch.no_grad():  # (called outside `generate` too: no autograd record kept with a step's outputs)
            return self._warm_keys(todo, on_capture)

    def _warm_keys(self, todo: list, on_capture) -> int:
        """Capture the keys ``todo`` on padding-only buffers (`warm`); how many were captured."""
        captured = 0
        for key in todo:
            if self.failed:
                break
            if key.prefill and self.prefill_failed:  # (prompt pieces run on the eager forward now)
                continue
            buffers = self._buffers(key)
            self._fill_padding(buffers, key)
            if self._capture_new(key, buffers) is None:
                continue
            captured += 1
            if on_capture is not None:
                on_capture(captured, len(todo))
        return captured

    def _fill_padding(self, buffers: BatchStepBuffers, key: BatchStepKey) -> None:
        """Buffers of a step whose every row is padding: the free slots ``0 .. B - 1`` (dense) or the scratch slot,
        order keys ``MAX_KEY`` (each row sees only itself, its keys stay empty), zero inputs; GDN rows not real."""
        batch, width = key.batch, key.width
        device = buffers.slots.device
        slots = (torch.arange(batch, dtype=torch.long) if key.dense
                 else torch.full((batch,), self.pool.scratch, dtype=torch.long))
        buffers.slots.copy_(slots.to(device))
        buffers.write.copy_(torch.arange(width, device=device).expand(batch, width))
        buffers.last.zero_()
        buffers.embeds.zero_()
        buffers.positions.zero_()
        buffers.query_keys.fill_(MAX_KEY)
        for addend in buffers.deepstack:
            addend.zero_()
        if buffers.recurrent is not None:
            for t in buffers.recurrent.tensors():
                t.zero_()

    # ---- one step ----
    def run(self, entries, config: RaincheckConfig, gather: bool = False) -> dict:
        """Run the forward ``entries`` (`decode_only`: decode groups and restoring pieces) of an engine with
        ``config``; the logits ``[V]`` of each sequence whose group wants them (a restoring piece's are ignored)."""
        return self.launch(self.prepare(entries, config, gather))

    def prepare(self, entries, config: RaincheckConfig, gather: bool = False) -> "PreparedBatchStep":
        """The step of ``entries`` made ready to `launch`: its key chosen and its buffers filled (device copies
        enqueued behind whatever runs; nothing read back), the pool grown for it; its rows are not stored yet (the
        slots' lengths move at `launch`). The engine prepares step ``i + 1`` before it waits for step ``i``'s tokens,
        so this host work overlaps the device's; it launches it only if no sequence joined or left since.
        ``gather``: the wide half of a step split by width (`batch_engine.WideForward`): it gathers its slots (a dense
        step would pad every lower slot's sequence to its width, what the split avoids) at the width of the largest
        chunk + 1 (the one width `warm_keys` captures such steps at: whatever its entries are, a chunk, a restoring
        piece or a riding prompt, none is wider)."""
        pool = self.pool
        entries = sorted(entries, key=lambda e: e[0].slot)  # (batch rows rise with the slots)
        n = len(entries)
        alone = _alone(entries)
        layout = None  # (a Gated DeltaNet prompt piece's leftover deferred rows and input rows)
        if alone and self.recurrent is not None:
            layout = _piece_layout(entries[0][1])
            if layout is None:
                raise ValueError("a prompt piece of the Gated DeltaNet families must be leftover deferred rows, then "
                                 "input rows (BatchedStepGraphs.accepts says False for any other).")
        key_batch, width = batch_bucket(n), step_width(entries, config, gather)
        slots = [seq.slot for seq, _ in entries]
        dense_layout = None if alone or gather else self._dense_layout(slots, key_batch, width)
        dense = dense_layout is not None
        if dense:
            key_batch, padding = dense_layout
        else:
            padding = {}
        pool.reserve(max(pool.lengths[s] for s in slots) + width)
        if self.recurrent is not None:
            if not self.recurrent.layers:  # (a first step before any eager forward made them)
                self.adapter.make_packed_layers(self.recurrent)
            self.recurrent.grow(pool.total_slots)  # a row per slot, the scratch slot and the bucket's padding included
        setting = self._current_setting()
        if setting != self._setting:  # the tensors moved (graphs hold the old addresses), or another backend
            self._captured.clear()
            self._mempool, self._setting = None, setting
        starts = [pool.lengths[s] for s in slots]
        # (every row sees at least itself: a padding row's own row is inside the span too)
        span = static_cache.slot_bucket(max(starts + list(padding.values())) + width, pool.capacity)
        recorded = [] if alone else self._recorded(entries)
        if self.recurrent is None:
            chunks = False
        elif layout is not None:  # (a continued conversation's leftover deferred rows in front of the piece)
            chunks = layout[0] > 0
        else:
            chunks = any(len(g) > 1 or seq.restores_only for seq, g in entries)
        compiled = resolve_compile_steps(config.compile_steps, self.use_cuda and not self.failed)
        key = BatchStepKey(key_batch, width, span, dense, bool(recorded), chunks, compiled, alone)
        captured = self._captured.get(key)
        buffers = captured[1] if captured is not None else self._buffers(key)
        # each entry's batch row (dense: its slot) and the padding rows (row, slot, start row)
        rows = slots if dense else list(range(n))
        pads = ([(slot, slot, start) for slot, start in padding.items()] if dense
                else [(row, pool.scratch, 0) for row in range(n, key_batch)])
        self._fill(buffers, entries, starts, rows, pads)
        if self.recurrent is not None:
            self._fill_recurrent(buffers.recurrent, entries, recorded, rows, layout)
        inputs_ran = tuple(slots) if layout is not None and layout[1] > 0 else ()
        return PreparedBatchStep(entries, slots, starts, key, buffers, setting, tuple(recorded),
                                 tuple(sorted(padding.items())), tuple(rows), inputs_ran)

    def _buffers(self, key: BatchStepKey) -> BatchStepBuffers:
        """New buffers for ``key``'s step; a prompt piece alone shares them with the other spans of its width (at 2,048
        rows of an 8B model's width, with three DeepStack addends, 64 MB a set; one step is filled and launched at a
        time, and each fill is enqueued on the stream after the launch before it, so no replay reads another's
        inputs)."""
        if key.prefill and key.width in self._prefill_buffers:
            return self._prefill_buffers[key.width]
        buffers = BatchStepBuffers.empty(key, self.hidden, self.num_deepstack, self.adapter.dtype,
                                         self.adapter.device, self.recurrent is not None)
        if key.prefill:
            self._prefill_buffers[key.width] = buffers
        return buffers

    def _dense_layout(self, slots: list[int], key_batch: int, width: int) -> tuple[int, dict] | None:
        """``(batch bucket, {padding slot: its start row})`` of a dense step over ``slots`` (rows ``width``), or None
        (it gathers its slots, the padding in the scratch slot). Dense: batch row b reads slot b's views, for the
        slots below a batch bucket that holds the step's slots: the bucket of its sequences (``key_batch``; the engine
        keeps them in the lowest slots: `BatchEngine.remove`), or a larger one the pool already has (a step beside
        sequences that are not in it, in lower slots), whose key the warm-up captured where a gathered one would be
        captured in the middle of the answers. Every slot below the bucket that the step does not carry holds a
        padding sequence: a free one from its row 0, one held by a sequence outside the step (a turn whose prompt
        piece runs in its own forward after this one, `RowScheduler`'s ``separate_prefill``; a held conversation
        restoring that the budget gave no rows) after that sequence's rows, where its keys are MAX_KEY (no row sees
        them) and its next rows overwrite what the padding wrote; its GDN states, read as a padding row's (not
        real, no rows), are written back unchanged."""
        pool = self.pool
        top = batch_bucket(max(slots) + 1)
        if not self.views or (top != key_batch and top > pool.num_slots):
            return None
        pool.grow_slots(top)
        taken = set(slots)
        padding = {s: pool.lengths[s] for s in range(top) if s not in taken}
        if max(padding.values(), default=0) + width > pool.capacity:
            return None
        return top, padding

    def launch(self, step: "PreparedBatchStep") -> dict:
        """Run a `prepare`d step (capture its graph the first time its key runs, else replay it); the logits ``[V]``
        of each sequence whose group wants them. The pool must be as `prepare` left it (the same tensors, the slots'
        lengths unchanged): a RuntimeError otherwise, before anything runs."""
        pool = self.pool
        entries, slots, starts, key, buffers = step.entries, step.slots, step.starts, step.key, step.buffers
        if (self._current_setting() != step.setting or [pool.lengths[s] for s in slots] != starts
                or any(pool.lengths[s] != start for s, start in step.padding)):
            raise RuntimeError("a batched step was prepared on a pool that changed before its launch (its slots' "
                               "rows or tensors); prepare it again.")
        captured = self._captured.get(key)
        if captured is not None and captured[1] is not buffers:  # (another step of the key was captured since)
            raise RuntimeError("a batched step was prepared on buffers its key no longer replays; prepare it again.")
        for slot, (_, group) in zip(slots, entries):
            pool.lengths[slot] += len(group)
        ok = False
        self.ran_eagerly = False
        try:
            # (no autograd record, whatever the caller's grad mode: the static buffers serve every caller, and a buffer
            # made under `no_grad`, e.g. by a `BatchLoop`'s thread, cannot be written in place with grad mode on)
            with torch.no_grad():
                if captured is None and not self.failed and not (key.prefill and self.prefill_failed):
                    graph = self._capture_new(key, buffers)
                    if graph is not None:
                        captured = (graph, buffers)
                if captured is None:  # capture failed: the same step, eagerly on these buffers
                    self.ran_eagerly = True
                    self._step(buffers, key)
                else:
                    captured[0].replay()
                    self.replays += 1
            ok = True
        finally:
            if not ok:  # the step's rows are taken back (as `SlotKVPool.end_step(False)`)
                for slot, was in zip(slots, starts):
                    pool.slot_keys[slot, was:pool.lengths[slot]] = MAX_KEY
                    pool.lengths[slot] = was
        if step.recorded:  # (the host's suffix lengths: the step recorded those rows on the device)
            self.recurrent.advance_suffix(list(step.recorded))
        if step.inputs_ran:  # (its boundary moved after the piece's input rows)
            self.recurrent.reset_suffix(list(step.inputs_ran))
        for seq, group in entries:
            seq.stored(group)
        wanted = [b for b, (_, group) in enumerate(entries) if group.want_logits]  # (restoring pieces: none)
        if not wanted:
            return {}
        # (every batch row's logits copied, then picked on the host's side: an index tensor made here would be a
        # copy to the device that waits for the step)
        logits = buffers.logits[:max(step.rows[b] for b in wanted) + 1].clone().unbind(0)
        return {entries[b][0]: logits[step.rows[b]] for b in wanted}

    def _fill(self, buffers: BatchStepBuffers, entries, starts: list[int], rows: list[int], pads: list) -> None:
        """Rewrite every input buffer for this step: entry ``i``'s rows at ``[rows[i], :n_i]`` (padding after them),
        each padding sequence ``(row, slot, start)`` of ``pads`` writing its row from ``start`` in ``slot`` (a dense
        step: the slots below the bucket that no entry has; else the scratch slot from 0); last row 0. A few copies
        per buffer, whatever the batch (host time per step), and nothing read back from the device."""
        device = buffers.embeds.device
        batch, width = buffers.query_keys.shape
        lengths = [len(g) for _, g in entries]
        slot_of, start_of, last_of, count_of = [0] * batch, [0] * batch, [0] * batch, [0] * batch
        for row, (seq, _), start, n_rows in zip(rows, entries, starts, lengths):
            slot_of[row], start_of[row], last_of[row], count_of[row] = seq.slot, start, n_rows - 1, n_rows
        for row, slot, start in pads:
            slot_of[row], start_of[row] = slot, start
        host = torch.tensor([slot_of, start_of, last_of], dtype=torch.long)  # slots, starts, last rows
        dest = _placement(count_of, width)  # (entries in row order: ``rows`` rises with the entries' slots)
        visual = [g.batch.num_deepstack_rows for _, g in entries]
        scattered = []  # (entry, its batch row): a prompt piece whose DeepStack rows sit between its other rows
        if buffers.deepstack:
            # a decode group's or a restoring piece's visual rows are its leading deferred rows (`decode_only`): all
            # of a restoring piece's rows, all of a decode group's but its token; a prompt piece's where they lead
            # (a continued conversation's leftover deferred rows before its text: `_visual_rows_lead`)
            for i, ((seq, g), n_rows, v) in enumerate(zip(entries, lengths, visual)):
                if v == 0:
                    continue
                piece = _piece(seq, g)
                if piece and not _visual_rows_lead(g):
                    scattered.append((i, rows[i]))
                    visual[i] = 0  # (placed below, row by row)
                elif v > n_rows or (v == n_rows and not (piece or seq.restores_only)):  # (a decode group's token)
                    what = "a prompt piece" if piece else "a restoring piece" if seq.restores_only else "a decode group"
                    raise RuntimeError(f"{what} of {n_rows} rows carries {v} DeepStack rows")
        visual_of = [0] * batch
        for row, v in zip(rows, visual):
            visual_of[row] = v
        ds_dest = _placement(visual_of, width)
        groups = [g for _, g in entries]
        # (each group's rows as its parts: a decode group's [chunk, token] is copied from them, never joined first)
        parts = [p for g in groups for p in g.batch.parts]
        # every host tensor of the step (the placement, and the order keys of the sequences' token rows, which the
        # scheduler makes on the host) goes over in one non-blocking copy from pinned memory: no wait for the device
        write = host[1][:, None] + torch.arange(width)  # [B, W] each row's write offset in its slot
        moved = to_device_all([host, write, dest, ds_dest, *[g.keys.long() for g in groups]], device)
        host, write, dest, ds_dest, keys = moved[0], moved[1], moved[2], moved[3], moved[4:]
        buffers.slots.copy_(host[0])
        buffers.write.copy_(write)
        buffers.last.copy_(host[2])
        buffers.embeds.zero_()
        buffers.positions.zero_()
        buffers.query_keys.fill_(MAX_KEY)
        buffers.embeds.view(batch * width, -1).index_copy_(
            0, dest, torch.cat([p.embeds.to(device, buffers.embeds.dtype) for p in parts]))
        buffers.positions.view(3, batch * width).index_copy_(
            1, dest, torch.cat([p.positions.to(device) for p in parts], dim=1))
        buffers.query_keys.view(-1).index_copy_(0, dest, torch.cat(keys))
        for i, addend in enumerate(buffers.deepstack):
            addend.zero_()
            features = [p.deepstack[i] for g, v in zip(groups, visual) if v
                        for p in g.batch.parts if p.deepstack is not None]
            if features:
                addend.view(batch * width, -1).index_copy_(
                    0, ds_dest, torch.cat(features).to(device, addend.dtype))
        for e, row in scattered:  # each row its visual rank's features (a gather on the device: nothing read back)
            group = groups[e]
            flags = group.batch.visual.to(device)
            rank = (flags.cumsum(0) - 1).clamp_(min=0)
            for addend, features in zip(buffers.deepstack, group.batch.deepstack):
                picked = features.to(device, addend.dtype)[rank]
                addend[row, :lengths[e]] = torch.where(flags[:, None], picked, torch.zeros_like(picked))


    # ---- the Gated DeltaNet part of a step ----
    def _recorded(self, entries) -> list[int]:
        """The slots whose generated row the step records in the GDN states (a decode group's token while deferred
        rows are still pending after the step, as `batched.SequenceState.layout` says); none on attention
        families."""
        if self.recurrent is None:
            return []
        return [seq.slot for seq, _ in entries if not seq.restores_only and seq.num_pending > 0]

    def _fill_recurrent(self, buffers: RecurrentStepBuffers, entries, recorded: list[int], rows: list[int],
                        layout: tuple[int, int] | None = None) -> None:
        """Rewrite the GDN buffers for this step (entry ``i`` at batch row ``rows[i]``, as `_fill` placed it): which
        rows are real sequences, their deferred rows and whether a token follows them (a decode group's rows are
        ``[chunk, token]``, a restoring piece's deferred rows only: `decode_only`), which tokens record as a leading
        token or into M_R, and the suffix lengths (host ints of the per-slot states); for a prompt piece alone its
        ``layout`` (`_piece_layout`: leftover deferred rows, input rows) and suffix length; padding rows: not real,
        no rows, no record. One non-blocking copy, nothing read back."""
        batch = buffers.real.shape[0]
        layer = next(iter(self.recurrent.layers.values()))  # (suffix lengths: equal in every layer)
        records = set(recorded)
        table = [[0] * batch for _ in range(7)]  # real, deferred, token, lead, record_map, suffix, inputs
        for row, (seq, group) in zip(rows, entries):
            table[0][row] = 1
            suffix = layer.suffix_length[seq.slot]
            if layout is not None:  # (a prompt piece alone: leftover deferred rows, then input rows)
                table[1][row], table[6][row] = layout
                table[5][row] = suffix
                continue
            token = int(not seq.restores_only)
            rec = seq.slot in records
            for i, value in enumerate((len(group) - token, token, int(rec and suffix < layer.width),
                                       int(rec and suffix >= layer.width), suffix), start=1):
                table[i][row] = value
        host = torch.tensor(table, dtype=torch.long)
        host = to_device_all([host], buffers.real.device)[0]
        buffers.real.copy_(host[0].bool())
        buffers.deferred.copy_(host[1])
        buffers.token.copy_(host[2].bool())
        buffers.lead.copy_(host[3].bool())
        buffers.record_map.copy_(host[4].bool())
        buffers.suffix.copy_(host[5])
        buffers.inputs.copy_(host[6])


def _placement(counts: list[int], width: int) -> torch.Tensor:
    """Flat rows ``b * width + j`` for ``j < counts[b]`` (each sequence's first ``counts[b]`` rows of its ``width``):
    ``cat([b * width + arange(counts[b])])``, in a few operations whatever the batch."""
    total = int(sum(counts))
    if total == 0:  # (no DeepStack rows in the step)
        return torch.empty(0, dtype=torch.long)
    if all(c == 1 for c in counts):  # one row each (a step of decode tokens): the first row of every sequence
        return torch.arange(len(counts), dtype=torch.long) * width
    counts_t = torch.tensor(counts, dtype=torch.long)
    starts = torch.cumsum(counts_t, 0) - counts_t  # where each sequence's rows start in the flat list
    base = torch.arange(len(counts), dtype=torch.long) * width - starts
    return torch.repeat_interleave(base, counts_t, output_size=total) + torch.arange(total, dtype=torch.long)


# ---- pools and their graphs, kept per model for later engines (a capture is paid once per key and model) ----

_POOLED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # text model -> [BatchedStepGraphs], free ones
_POOLED_LOCK = threading.Lock()
POOLED_PER_MODEL = 2


def pool_bytes(adapter, num_sequences: int, max_tokens: int) -> dict:
    """What the key / value storage of a batched pool for ``num_sequences`` sequences of ``max_tokens`` rows takes on
    the device (`acquire`'s pool: ``batch_bucket(num_sequences)`` places and the scratch slot, each of ``max_tokens``
    rows as the pool rounds them, a key and a value tensor in every attention layer; Gated DeltaNet layers hold none):
    ``{"bytes", "places", "rows", "layers", "kv_heads", "head_dim", "dtype"}``."""
    from ..kv_pool import MIN_CAPACITY, ROW_ROUNDING, _round_up, attention_kv_shape

    layers, kv_heads, head_dim = attention_kv_shape(adapter.text_model.config)
    places = batch_bucket(num_sequences) + 1  # (the scratch slot)
    rows = _round_up(max(int(max_tokens), MIN_CAPACITY), ROW_ROUNDING)
    return {"bytes": 2 * layers * places * kv_heads * rows * head_dim * adapter.dtype.itemsize, "places": places,
            "rows": rows, "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
            "dtype": str(adapter.dtype).replace("torch.", "")}


class PoolTooLarge(ValueError):
    """A batched pool larger than the device's free memory (`check_pool_fits`)."""


def check_pool_fits(adapter, num_sequences: int, max_tokens: int, free_bytes: int | None = None) -> None:
    """`PoolTooLarge` (a ValueError), before anything is allocated, when the batched pool for ``num_sequences``
    sequences of ``max_tokens`` rows (`pool_bytes`) would not fit the device's free memory (``free_bytes``; None:
    what CUDA reports free on the model's device, nothing checked elsewhere), less what this model's kept pools hold
    already (a larger one is grown, not added to). Without it a server started for more sequences than its GPU holds
    ran out of memory in its warm-up and then in every request's first step."""
    if free_bytes is None:
        if adapter.device.type != "cuda" or not torch.cuda.is_available():
            return
        free_bytes, _ = torch.cuda.mem_get_info(adapter.device)
    need = pool_bytes(adapter, num_sequences, max_tokens)
    with _POOLED_LOCK:
        kept = [g.pool for g in _POOLED.get(adapter.text_model, ())]
    held = max((sum(t.numel() * t.element_size() for layer in pool.layers if layer.is_initialized
                    for t in (layer.keys, layer.values)) for pool in kept), default=0)
    if need["bytes"] - held > free_bytes:
        gib = 2 ** 30
        raise PoolTooLarge(
            f"{num_sequences} sequences at once of up to {max_tokens} rows each need {need['bytes'] / gib:.1f} GiB of "
            f"key / value storage in the batched engine ({need['places']} places of {need['rows']} rows, "
            f"{need['layers']} attention layers, {need['kv_heads']} key / value heads of {need['head_dim']} "
            f"{need['dtype']} values, a key and a value each), more than the {free_bytes / gib:.1f} GiB free on "
            f"{adapter.device}: run fewer sequences at once or fewer rows each")


def acquire(adapter, num_layers: int, num_slots: int, capacity: int) -> BatchedStepGraphs:
    """A free pool of this model (with its captured graphs) grown to ``num_slots`` x ``capacity``, or a new one. Of
    several kept pools, the one with the most captured steps (one `warm_up(batch=...)` sized and filled, say):
    growing a pool drops its graphs, so the largest of those is taken first. The pool gets ``batch_bucket(num_slots)``
    slots (and the recurrent states a row each) before any step runs: the decode steps of ``num_slots`` sequences run
    dense over that bucket's slots, and growing to it after a prompt step was captured would drop that capture (every
    graph holds the tensors' addresses), so a first call would capture its prompt steps twice."""
    num_slots = batch_bucket(num_slots)
    with _POOLED_LOCK:
        free = _POOLED.get(adapter.text_model)
        graphs = None
        if free:
            best = max(range(len(free)), key=lambda i: (len(free[i]._captured), free[i].pool.num_slots,
                                                          free[i].pool.capacity))
            graphs = free.pop(best)
    if graphs is None or graphs.made_for != (adapter.device, adapter.dtype):  # (the model moved or was cast since)
        pool = SlotKVPool(num_layers, num_slots, capacity, adapter.device, scratch_slot=True)
        return BatchedStepGraphs(adapter, pool)
    graphs.adapter = adapter
    graphs.pool.grow_slots(num_slots)
    graphs.pool.reserve(capacity)
    if graphs.recurrent is not None:
        graphs.recurrent.grow(graphs.pool.total_slots)
    return graphs


def release(graphs: BatchedStepGraphs) -> None:
    """Give an engine's pool back for the next engine on the model (only when every slot is free: its keys are all
    ``MAX_KEY`` then, so nothing it held is visible to the next user)."""
    pool = graphs.pool
    if pool.step is not None or len(pool._free) != pool.num_slots:
        return
    text_model = graphs.adapter.text_model
    with _POOLED_LOCK:
        free = _POOLED.setdefault(text_model, [])
        if len(free) < POOLED_PER_MODEL and all(g is not graphs for g in free):
            graphs.adapter = None  # a kept pool holds no reference to the model (the key is weak)
            free.append(graphs)


def release_all(model=None) -> None:
    """Drop the kept pools (of ``model``'s text model, or of every model)."""
    with _POOLED_LOCK:
        if model is None:
            _POOLED.clear()
        else:
            from ..models import get_adapter

            _POOLED.pop(get_adapter(model).text_model, None)
