"""What every model adapter shares: the engine's row types, device helpers and the `ModelAdapter` interface.

The engine (`generation.py`, `fast/`, `selection/`, `conversation.py`) talks to a model only through an
adapter: the rows of a turn (`TurnInputs`), the rows of one forward (`RowBatch`) and the methods of
`ModelAdapter`. A family's quirks live in its own `models/<family>.py`.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from ..cache_utils import to_device, to_device_all
from ..masking import check_attention_implementation, visibility_to_attention_mask
from ..patching import module_function
from ..selection import Segment


@dataclass
class TurnInputs:
    """One turn's new tokens, encoded. ``L`` rows, ``n`` of them visual.

    Attributes:
        input_ids: ``[L]``.
        embeds: ``[L, D]`` input embeddings with the visual features scattered into placeholder rows.
        positions: ``[3, L]`` absolute M-RoPE ids (continuing the conversation).
        visual_index: ``[L]`` index into the visual rows, -1 for text rows.
        deepstack: one ``[n, D]`` tensor per DeepStack layer (visual rows in source order), or None.
        segments: the multimodal segments (an image, or one temporal slice of a video) in source order.
        text_rows: ``[m]`` rows of the turn's text (the question a query-aware selector reads).
        next_position: M-RoPE text position following the last row.
        visual_rows: ``[n]`` the visual rows, on the host (what `num_visual` and a plan read without waiting for the
            device); None: read from ``visual_index``.
        host_ids: ``[L]`` ``input_ids`` on the host (what a sequence's bookkeeping keeps without waiting for the
            device); None: read from ``input_ids``.
    """

    input_ids: torch.Tensor
    embeds: torch.Tensor
    positions: torch.Tensor
    visual_index: torch.Tensor
    deepstack: list[torch.Tensor] | None
    segments: list[Segment]
    text_rows: torch.Tensor
    next_position: int
    visual_rows: torch.Tensor | None = None
    host_ids: torch.Tensor | None = None

    def ids_on_host(self) -> torch.Tensor:
        """``input_ids`` on the host (``host_ids`` when the encoding kept them)."""
        return self.host_ids if self.host_ids is not None else self.input_ids.cpu()

    def visual_index_on_host(self) -> torch.Tensor:
        """``visual_index`` on the host, made from ``visual_rows`` when the encoding kept them (else read back)."""
        if self.visual_rows is None:
            return self.visual_index.cpu()
        index = torch.full((self.visual_index.shape[0],), -1, dtype=torch.long)
        index[self.visual_rows] = torch.arange(self.visual_rows.numel())
        return index

    def visual_flags_on_host(self, rows: torch.Tensor) -> torch.Tensor:
        """``[len(rows)]`` bool on the host: which of ``rows`` (indexes into the turn's rows) are visual."""
        return self.visual_index_on_host()[rows.cpu()] >= 0

    @property
    def num_visual(self) -> int:
        if self.visual_rows is not None:
            return int(self.visual_rows.numel())
        return int((self.visual_index >= 0).sum())


@dataclass
class RowBatch:
    """The rows of one forward, in storage order: ``embeds [L, D]``, ``positions [3, L]``,
    ``visual [L]`` (bool), ``deepstack`` (one ``[n_visual_in_batch, D]`` per layer, or None); ``visual_rows``:
    ``visual.nonzero().flatten()`` on ``visual``'s device where it was known on the host (`ModelAdapter.rows`),
    else None (a reader that needs the indices takes them from ``visual``, which waits for the device)."""

    embeds: torch.Tensor
    positions: torch.Tensor
    visual: torch.Tensor
    deepstack: list[torch.Tensor] | None
    visual_rows: torch.Tensor | None = None

    @staticmethod
    def concat(parts: list["RowBatch"]) -> "RowBatch":
        """The parts' rows one after the other (`JoinedRows`: each field concatenated when it is first read)."""
        parts = [p for p in parts if p is not None]
        if len(parts) == 1:
            return parts[0]
        return JoinedRows(parts)

    @property
    def parts(self) -> tuple["RowBatch", ...]:
        """Its rows as batches that are not joins, in order (`row_parts`)."""
        return (self,)

    @property
    def num_deepstack_rows(self) -> int:
        """How many rows carry DeepStack features (from shapes: nothing read from the device)."""
        return 0 if self.deepstack is None else int(self.deepstack[0].shape[0])


class JoinedRows(RowBatch):
    """`RowBatch.concat`'s result: its parts' rows one after the other, each field (``embeds``, ``positions``,
    ``visual``, ``deepstack``) concatenated from the parts when first read, then kept. A decode step's ``[chunk,
    token]`` rows are made for each sequence of a batched step; the captured step copies every sequence's parts into
    its buffers at once (`parts`) and never reads the joined fields: a few device operations per sequence and step
    fewer. The eager forwards read the fields, which equal the parts concatenated."""

    def __init__(self, parts: list[RowBatch]):  # (not the dataclass' fields: they are computed below)
        self._parts = tuple(q for p in parts for q in p.parts)

    @property
    def parts(self) -> tuple[RowBatch, ...]:
        return self._parts

    @property
    def num_deepstack_rows(self) -> int:
        return sum(p.num_deepstack_rows for p in self._parts)

    @functools.cached_property
    def embeds(self) -> torch.Tensor:
        return torch.cat([p.embeds for p in self._parts])

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        return torch.cat([p.positions for p in self._parts], dim=1)

    @functools.cached_property
    def visual(self) -> torch.Tensor:
        return torch.cat([p.visual for p in self._parts])

    @functools.cached_property
    def deepstack(self) -> list[torch.Tensor] | None:
        with_ds = [p.deepstack for p in self._parts if p.deepstack is not None]
        return [torch.cat(layer) for layer in zip(*with_ds)] if with_ds else None

    @functools.cached_property
    def visual_rows(self) -> torch.Tensor | None:
        """The parts' ``visual_rows`` shifted by the rows before each, where every part knows its own; else None."""
        if any(p.visual_rows is None for p in self._parts):
            return None
        shifted, offset = [], 0
        for p in self._parts:
            shifted.append(p.visual_rows + offset)
            offset += int(p.embeds.shape[0])
        return torch.cat(shifted)

    def __repr__(self) -> str:
        return f"JoinedRows({list(self._parts)!r})"


class PendingRowBatch(RowBatch):
    """Deferred rows waiting in a cache (`cache_utils.PendingRows`) as a `RowBatch` (`ModelAdapter.pending_batch`):
    every row visual; ``visual`` made when first read (a captured step never reads a deferred row's flag)."""

    def __init__(self, embeds: torch.Tensor, positions: torch.Tensor, deepstack):
        self.embeds, self.positions, self.deepstack = embeds, positions, deepstack

    @functools.cached_property
    def visual(self) -> torch.Tensor:
        return torch.ones(self.embeds.shape[0], dtype=torch.bool, device=self.embeds.device)

    @functools.cached_property
    def visual_rows(self) -> torch.Tensor:
        return torch.arange(self.embeds.shape[0], device=self.embeds.device)

    def __repr__(self) -> str:
        return f"PendingRowBatch(rows={self.embeds.shape[0]})"


def _hook_devices(module):
    """``(execution_device, offloads)`` of each accelerate `AlignDevicesHook` on ``module`` (none without hooks)."""
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):  # SequentialHook or one hook
        device = getattr(h, "execution_device", None)
        if device is not None:
            device = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
        yield device, bool(getattr(h, "offload", False))


def execution_device(module) -> torch.device:
    """The device ``module`` computes on, also when accelerate dispatched or offloaded it.

    A module with an accelerate `AlignDevicesHook` (``device_map=...``, `dispatch_model`, `cpu_offload`)
    runs on the hook's ``execution_device`` whatever its parameters' device (``meta`` when offloaded);
    otherwise it is the device of its first parameter that holds data, CPU for a module without any.
    """
    for device, _ in _hook_devices(module):
        if device is not None:
            return device
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def accelerate_split(model) -> str | None:
    """How accelerate split ``model`` (a phrase for error messages), or None when it runs whole on one device.

    Split = its modules' hooks execute on more than one device, or some hook offloads weights (cpu / disk
    offload: the parameters sit on ``meta`` between forwards). A model without hooks is not split.
    """
    devices, offloaded = set(), 0
    # a walk over the ``_modules`` dicts (twice per call on Qwen3-VL-8B's 845 modules, where `model.modules()`, with
    # its memo and prefixes, took ~3x as long); a module held twice is counted once, as `modules()` does
    hooked, stack = set(), [model]
    while stack:
        module = stack.pop()
        if module is None:  # (a submodule registered as None)
            continue
        state = module.__dict__
        stack.extend(state["_modules"].values())
        # (accelerate sets the hook as an attribute; most modules have none)
        if state.get("_hf_hook") is None or id(module) in hooked:
            continue
        hooked.add(id(module))
        for device, offloads in _hook_devices(module):
            if device is not None:
                devices.add(str(device))
            offloaded += offloads
    parts = []
    if len(devices) > 1:
        parts.append(f"over the devices {sorted(devices)}")
    if offloaded:
        parts.append(f"with the weights of {offloaded} modules offloaded (cpu / disk)")
    return " and ".join(parts) or None


class ModelAdapter:
    """The interface between the engine and one model family, in the style of transformers' cache layers:
    a few methods the engine calls, and capability flags it reads instead of asking what the model is.

    A family subclasses this (sharing code through the mixins of `models/mixins.py`), sets
    ``model_classes`` and the flags, and implements `encode_turn` (and `forward` when its text model is not
    plain attention). Everything the engine, the fast path, the selectors and the conversation need to know
    about a family is a method or a flag here; ``docs/adding_a_model.md`` walks through one.

    Capability flags (class attributes):
        has_deepstack: the vision tower returns DeepStack features that the text model adds to the hidden
            states of its first decoder layers (`num_deepstack_layers` of them).
        has_linear_attention: some text layers keep a recurrent state (Gated DeltaNet) instead of KV rows;
            `forward` needs the row kinds to place deferred rows (``kinds``).
        supports_fast_path: the CUDA fast path (static KV slots, graph replay of the text steps) can run
            this family: every text layer keeps its state in `fast.StaticDeferredCache` (attention layers in
            KV slots; a recurrent family reserves its layers' buffers through `static_recurrent_layout` and
            runs them through `static_step`). Which layer types that covers: ``static_layer_types``.
        bucketed_prefill: on CUDA the fast path pads prefills to 64-row buckets and captures them; False:
            prefills run eagerly, unpadded, on the static cache (decode and chunk steps are still captured).
        supports_vision_graphs: `fast.vision_graphs` can replay this family's vision tower per grid
            (`vision_grid_kwargs` precomputes what the tower derives from ``grid_thw``).
    """

    model_classes: tuple[str, ...] = ()
    has_deepstack: bool = False
    has_linear_attention: bool = False
    supports_fast_path: bool = False
    supports_vision_graphs: bool = False
    bucketed_prefill: bool = True
    static_layer_types: tuple[str, ...] = ("full_attention",)

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.text_model = model.model.language_model
        self.lm_head = model.lm_head

    # ---- what the model is made of ------------------------------------------------------------
    @property
    def vision_tower(self):
        """The vision encoder module (the one ``get_image_features`` runs)."""
        return self.model.model.visual

    @property
    def attn_implementation(self) -> str:
        return self.text_model.config._attn_implementation

    def check_attention(self) -> str:
        return check_attention_implementation(self.attn_implementation)

    @property
    def device(self) -> torch.device:
        """Where the engine builds a forward's rows: the input embedding's *execution* device.

        Not ``embed_tokens.weight.device``: under accelerate's cpu / disk offload that weight sits on
        ``meta`` between forwards and the hook moves it to its execution device only inside the call.
        """
        return execution_device(self.text_model.embed_tokens)

    @property
    def dtype(self) -> torch.dtype:
        return self.text_model.embed_tokens.weight.dtype

    def text_config(self):
        return self.config.get_text_config()

    @property
    def num_deepstack_layers(self) -> int:
        """How many text layers DeepStack adds visual features to (layers ``0 .. n-1``); 0 without DeepStack."""
        return 0

    def deepstack_layers(self) -> list:
        """The decoder layers whose outputs receive DeepStack feature ``i`` (the fast path adds them by hooks)."""
        return []

    def compile_targets(self) -> list:
        """``(module, forward)`` pairs that `RaincheckConfig.compile_steps` runs inside the fast path's steps
        (`fast.compiled`): ``forward(module, *args, **kwargs)`` replaces the module's own forward there, None
        meaning the module class's ``forward`` compiled. Default: every RMSNorm of the decoder layers (the
        attention's query / key norms included) and each dense SwiGLU MLP (``gate_proj``, ``up_proj``,
        ``down_proj``; a mixture of experts routes tokens and stays as it is): pure per-row functions of
        their input, no cache, no hooks, each run on its input viewed as rows (`fast.compiled.RowWise`: one
        compiled graph for every shape it is called with). A family may fuse more (`models.qwen3_vl`)."""
        from ..fast.compiled import rowwise

        targets = []
        for layer in self.text_model.layers:
            targets += [(m, rowwise(type(m).forward)) for m in layer.modules() if type(m).__name__.endswith("RMSNorm")]
            mlp = getattr(layer, "mlp", None)
            if mlp is not None and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
                targets.append((mlp, rowwise(type(mlp).forward)))
        return targets

    def deepstack_kwargs(self, visual: torch.Tensor, deepstack: list[torch.Tensor] | None) -> dict:
        """Text-model keyword arguments that add ``deepstack`` (one ``[n_visual, D]`` per layer) to the rows
        where ``visual [L]`` is True; ``{}`` for a family without DeepStack."""
        return {}

    def packed_deepstack_kwargs(self, visual: torch.Tensor, deepstack: list[torch.Tensor] | None) -> dict:
        """`deepstack_kwargs` for a packed forward of several sequences (`batch_engine.ForwardRunner`): ``visual [B, W]``,
        ``deepstack`` one ``[n_visual, D]`` per layer with the visual rows in row-major order of ``visual``."""
        return {}

    # ---- the prompt ---------------------------------------------------------------------------
    def placeholder_masks(self, input_ids: torch.Tensor, text_prefix: int = 0):
        """``(is_image, is_video)`` over ``input_ids [L]``, the first ``text_prefix`` rows counted as text."""
        raise NotImplementedError

    def multimodal_mask(self, input_ids: torch.Tensor, text_prefix: int = 0) -> torch.Tensor:
        is_image, is_video = self.placeholder_masks(input_ids, text_prefix)
        return is_image | is_video

    def encode_turn(self, input_ids: torch.Tensor, position_offset: int, mm_encoder_outputs: dict | None = None,
                    image_grid_thw: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                    pixel_values: torch.Tensor | None = None, pixel_values_videos: torch.Tensor | None = None,
                    text_prefix: int = 0, vision_graphs=None, second_per_grid_ts: torch.Tensor | None = None,
                    ) -> TurnInputs:
        """Embed one turn's new tokens ``input_ids [L]`` and give them absolute 3-D positions from
        ``position_offset`` on (the conversation's next position); see `TurnInputs` for the shapes."""
        raise NotImplementedError

    def turn_glue(self, tokenizer, last_token: int) -> list[int]:
        """Token ids that close the previous answer (ending in ``last_token``) before the next user turn, as
        the family's chat template writes a finished assistant turn."""
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
        return ([] if int(last_token) == end else [end]) + list(newline)

    # ---- one forward over arbitrary rows ------------------------------------------------------
    def rows(self, turn: TurnInputs, row_index: torch.Tensor, num_visual: int | None = None) -> RowBatch:
        """The given rows of a turn as a batch (``row_index`` indexes the turn's rows).

        A ``row_index`` on the turn's (non-CPU) device with ``num_visual`` (how many of its rows are visual, known on
        the host): `rows_from_device_index`, which reads nothing back.

        Host ``row_index`` of a turn whose visual rows are known on the host (`TurnInputs.visual_rows`): which rows
        are visual, and which DeepStack rows they take, are worked out on the host and moved in one non-blocking
        copy, so nothing waits for the device (a plan's rows are host tensors; a boolean index on the device waits
        for its count, and a plain copy of pageable memory for the device's queue). Otherwise `rows_reference`."""
        if row_index.device.type != "cpu" and num_visual is not None and row_index.dtype != torch.bool:
            return self.rows_from_device_index(turn, row_index, num_visual)
        if turn.visual_rows is None or row_index.device.type != "cpu" or row_index.dtype == torch.bool:
            return self.rows_reference(turn, row_index)
        vis = turn.visual_index_on_host()[row_index]
        visual = vis >= 0
        index, picked, flags, visual_rows = to_device_all(
            [row_index.long(), vis[visual], visual.long(), visual.nonzero().flatten()], self.device)
        deepstack = None if turn.deepstack is None else [d.index_select(0, picked) for d in turn.deepstack]
        return RowBatch(turn.embeds.index_select(0, index), turn.positions.index_select(1, index), flags.bool(),
                        deepstack, visual_rows)

    def rows_from_device_index(self, turn: TurnInputs, row_index: torch.Tensor, num_visual: int) -> RowBatch:
        """`rows` of a ``row_index`` on the turn's device, of which ``num_visual`` rows are visual, gathered there
        without reading anything back (the visual rows found with a known count: `torch.nonzero_static`); the
        indices are chosen on the device (a turn's first forward, `generation.raincheck_sample`)."""
        vis = turn.visual_index.index_select(0, row_index)
        visual = vis >= 0
        visual_rows = torch.nonzero_static(visual, size=num_visual).flatten()
        deepstack = None
        if turn.deepstack is not None:
            picked = vis.index_select(0, visual_rows)
            deepstack = [d.index_select(0, picked) for d in turn.deepstack]
        return RowBatch(turn.embeds.index_select(0, row_index), turn.positions.index_select(1, row_index), visual,
                        deepstack, visual_rows)

    def rows_reference(self, turn: TurnInputs, row_index: torch.Tensor) -> RowBatch:
        """`rows` read from the device's ``visual_index`` (the reference it is tested against)."""
        row_index = row_index.to(self.device)
        vis = turn.visual_index[row_index]
        visual = vis >= 0
        deepstack = None if turn.deepstack is None else [d[vis[visual]] for d in turn.deepstack]
        return RowBatch(turn.embeds[row_index], turn.positions[:, row_index], visual, deepstack)

    def text_row(self, token_id: torch.Tensor, position: int) -> RowBatch:
        """A single text token (a generated one) at M-RoPE position ``position`` on all three axes."""
        device = self.device  # looked up once: it walks accelerate's hooks and the parameters (a decode step's host time)
        ids = token_id.reshape(1).to(device)
        pos = torch.full((3, 1), position, dtype=torch.long, device=device)
        return RowBatch(self.text_model.embed_tokens(ids), pos, torch.zeros(1, dtype=torch.bool, device=device), None)

    def text_rows(self, token_ids, positions: list[int]) -> list[RowBatch]:
        """Several sequences' generated tokens, each a `text_row` (token ``token_ids[i]`` at M-RoPE position
        ``positions[i]`` on all three axes), made together: one host-to-device copy and one embedding lookup
        whatever their number (the batched engine's decode step), the rows views of them. ``token_ids``: host ints,
        or a tensor ``[n]`` already on the device (tokens chosen there and not read back)."""
        device = self.device
        n = len(positions)
        if isinstance(token_ids, torch.Tensor):
            moved = to_device(torch.tensor([positions, positions, positions], dtype=torch.long), device)
            ids = token_ids.to(device=device, dtype=torch.long)
        else:
            moved = to_device(torch.tensor([token_ids, positions, positions, positions], dtype=torch.long), device)
            ids, moved = moved[0], moved[1:]
        embeds = self.text_model.embed_tokens(ids)  # [n, D]
        return [RowBatch(e, p, v, None) for e, p, v in
                zip(embeds.unsqueeze(1).unbind(0), moved.t().unsqueeze(2).unbind(0),
                    torch.zeros(n, 1, dtype=torch.bool, device=device).unbind(0))]

    def pending_batch(self, pending) -> RowBatch:
        """Deferred rows waiting in the cache (`cache_utils.PendingRows`) as a batch (`PendingRowBatch`)."""
        return PendingRowBatch(pending.embeds, pending.positions, pending.deepstack)

    def forward(self, cache, batch: RowBatch, visible: torch.Tensor | None, want_logits: bool = True, kinds=None):
        """Run ``batch`` through the text model on ``cache``; logits of its last row (``[1, V]``) or None.

        ``visible`` is the ``[L, n_rows]`` visibility from `DeferredDynamicCache.add_rows`, passed as a 4-D
        mask; None means plain causal (a single decode token that sees every stored row). ``kinds`` (``[L]``
        INPUT / DEFERRED / GENERATED; deferred rows always come first) is not needed by attention layers.
        This is the forward of a text model made of attention layers only; DeepStack arguments come from
        `deepstack_kwargs`.
        """
        mask = None
        if visible is not None:
            mask = visibility_to_attention_mask(visible.to(self.device), self.attn_implementation, self.dtype)
        return self.run_text_model(cache, batch, mask, want_logits)

    def run_text_model(self, cache, batch: RowBatch, mask, want_logits: bool):
        """The text model's own forward over ``batch`` on ``cache`` with the attention ``mask`` as built by
        `forward` (DeepStack arguments from `deepstack_kwargs`); logits of the last row (``[1, V]``) or None."""
        out = self.text_model(
            inputs_embeds=batch.embeds[None],
            position_ids=batch.positions[:, None, :],
            attention_mask=mask,
            cache=cache,
            use_cache=True,
            **self.deepstack_kwargs(batch.visual, batch.deepstack),
        )
        if not want_logits:
            return None
        return self.lm_head(out.last_hidden_state[:, -1:])[:, -1]

    # ---- which engine runs a call (the one place that decides) --------------------------------
    def execution_path(self, config) -> str:
        """``"fast"`` (static KV slots + CUDA graphs, `fast/`) or ``"eager"`` (`DeferredDynamicCache`) for a call.

        ``fast_path=False``, a family without ``supports_fast_path``, a text model with layers outside the
        family's ``static_layer_types`` and an accelerate-split model take the eager engine; otherwise
        ``fast_path=True`` or a CUDA model takes the fast path. ``fast_path=True`` on a split model of a
        fast-path family is a ValueError.
        """
        if config.fast_path is False or not self.supports_fast_path:
            return "eager"
        layer_types = getattr(self.text_model.config, "layer_types", None) or ["full_attention"]
        if any(t not in self.static_layer_types for t in layer_types):  # state the static cache cannot hold
            return "eager"
        split = accelerate_split(self.model)
        if split is not None:
            # Static buffers and captured graphs live on one device and a graph replay skips accelerate's
            # hooks (no weight loading, no cross-device copies).
            if config.fast_path is True:
                raise ValueError(
                    f"RaincheckConfig.fast_path=True needs the whole model on one device with its weights resident "
                    f"(static KV slots and CUDA graphs live on one device, and a graph replay skips accelerate's "
                    f"hooks), but accelerate placed this model {split}. Use fast_path=False (the eager engine, which "
                    "supports device_map splits and offload) or fast_path=None (auto: picks the eager engine here)."
                )
            return "eager"
        if config.fast_path is None and self.step_graph_blocker() is not None:
            return "eager"  # auto: static slots without captured steps buy nothing over the eager engine
        return "fast" if (config.fast_path is True or self.device.type == "cuda") else "eager"

    def step_graph_blocker(self) -> str | None:
        """Why this model's text steps cannot be captured as CUDA graphs (some layer reads the device back to
        the host), or None. ``fast_path=None`` then picks the eager engine; ``fast_path=True`` runs the fast
        path's steps eagerly on the static slots."""
        return None

    # ---- the text model on the fast path's static cache (`fast.graphs`) -------------------------
    def static_recurrent_layout(self):
        """The recurrent layers the static cache reserves buffers for (`gdn.static.RecurrentLayout`),
        or None when every text layer is attention."""
        return None

    def text_attention_mask(self, mask):
        """The text model's ``attention_mask`` argument for the attention layers' 4-D ``mask``."""
        return mask

    def static_step_variant(self, kinds: torch.Tensor, pending_after: int, suffix_length: int):
        """What a fast-path step over rows of ``kinds`` (``[L]`` on the host) runs beyond its shape, as a hashable
        (part of its captured graph's key), or None. ``pending_after``: deferred rows still pending after it;
        ``suffix_length``: the cache's generated rows since the last input rows."""
        return None

    def capturable(self, variant, rows: int) -> bool:
        """Whether a step of this variant and ``rows`` rows (padding included) may be captured as a CUDA graph
        (else it runs eagerly)."""
        return True

    def static_step(self, cache, step_info: torch.Tensor, variant):
        """A context manager around one fast-path step's text-model call (captured or not): the family's
        layers that keep state outside KV slots run on ``cache``'s static buffers. ``step_info [3]`` (device,
        long; None for families without such state): real deferred rows of the step, the suffix length before it,
        and the leading padding of a prefill without deferred rows."""
        return contextlib.nullcontext()

    # ---- the batched eager engine (`batched.py`): state kept outside KV rows, per sequence ------------
    def packed_states(self, batch: int):
        """The per-sequence state of the family's layers that keep it outside KV rows for a packed batch of
        ``batch`` sequences (with ``select(keep)``), or None when every text layer is attention."""
        return None

    def make_packed_layers(self, states) -> None:
        """Create every layer's part of ``states`` (`packed_states`) ahead of any packed forward (which otherwise makes
        each at its first use): a captured step needs them before it can be captured ahead (`warm_up`'s ``batch``).
        Nothing for a family whose text layers are all attention."""

    def packed_step(self, states, layouts):
        """A context manager around one packed forward's text-model call: those layers run on ``states`` with each
        sequence's rows laid out as ``layouts[b]`` (`batched_gdn.PackedRowLayout`)."""
        return contextlib.nullcontext()

    def static_packed_step(self, states, step, chunks: bool, record: bool, prefill: bool = False,
                           dense: bool = False):
        """A context manager around a captured batched step's text-model call (`fast.batched_graphs`): those layers
        run on the per-slot ``states`` through the step's device buffers ``step`` (``chunks`` / ``record``: some
        sequence carries deferred rows / records its token; ``prefill``: the step is a prompt piece's input rows;
        ``dense``: batch row ``b`` is slot ``b``)."""
        return contextlib.nullcontext()

    def export_packed_states(self, states, indices: list[int], caches: list) -> None:
        """Write sequence ``indices[j]``'s part of ``states`` into its own `DeferredDynamicCache` ``caches[j]``, for
        every sequence leaving the engine at once (`BatchEngine.remove_many`). Attention-only families keep no packed
        states: nothing to write."""

    def load_packed_state(self, states, index: int, cache) -> None:
        """Fill sequence ``index``'s part of ``states`` from its own `DeferredDynamicCache` ``cache`` (a held
        conversation joining a `batch_engine.BatchEngine`; `export_packed_states`' inverse for one sequence)."""

    def use_vision_graphs(self, config) -> bool:
        """Whether this call's pixels go through `fast.vision_graphs` (the tower replayed per grid).

        Decided apart from the text side (a family whose text cannot take the fast path may still replay its tower).
        Off for a family without ``supports_vision_graphs`` and under accelerate splits (a replay skips
        accelerate's hooks); on CPU with ``fast_path=True`` the same precomputed tower call runs without graphs.
        """
        if config.fast_path is False or not self.supports_vision_graphs or accelerate_split(self.model) is not None:
            return False
        return config.fast_path is True or self.device.type == "cuda"

    # ---- the vision tower, for the fast path (static: `fast.vision_graphs` keeps no model reference) --
    @staticmethod
    def vision_input_device(tower) -> torch.device:
        """The device the tower's pixels go to."""
        return next(tower.parameters()).device

    @staticmethod
    def vision_grid_kwargs(tower, grid_thw: torch.Tensor) -> dict:
        """What the tower derives from ``grid_thw [N, 3]`` on the host, computed ahead, as the keyword
        arguments the tower pops (transformers' ``vision_utils``), so a captured graph holds only kernels."""
        raise NotImplementedError("this family's vision tower is not replayed from CUDA graphs")

    # ---- the vision tower's last block, for VisionZip --------------------------------------------
    @property
    def vision_last_block(self):
        """The tower's last transformer block (VisionZip recomputes its attention from its inputs)."""
        return self.vision_tower.blocks[-1]

    @property
    def vision_merge_unit(self) -> int:
        """Tower patches per LLM token (``spatial_merge_size ** 2``)."""
        return int(self.config.vision_config.spatial_merge_size) ** 2

    def vision_block_query_key(self, block, hidden_states: torch.Tensor, position_embeddings):
        """``(q, k, scaling)``: the block's queries and keys after rotary, each ``[heads, P, head_dim]`` float32,
        computed from its input ``hidden_states [P, C]`` exactly as the block does; ``scaling`` its softmax scale."""
        raise NotImplementedError

    def vision_merged_order(self, grid_thw: torch.Tensor) -> torch.Tensor | None:
        """Permutation taking the tower's merged tokens (in the order its blocks hold them) to source order,
        or None when the blocks already hold them in source order."""
        return None

    # ---- a text layer's attention, for FastV ---------------------------------------------------
    def attention_query_key(self, layer: int):
        """``(attention module, q source, k source, rotary)`` of text layer ``layer``: the outputs of the two
        source modules, viewed as ``[B, L, heads, head_dim]``, are the per-head queries and keys right before
        rotary; ``rotary(q, k, cos, sin)`` (``[B, H, L, d]``) applies the layer's position embedding."""
        attn = self.text_model.layers[layer].self_attn
        return attn, attn.q_norm, attn.k_norm, module_function(attn, "apply_rotary_pos_emb")
