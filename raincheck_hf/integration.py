"""`enable` / `disable`: route `model.generate(..., raincheck=...)` to the Raincheck loop.

`generate` rejects unknown keyword arguments, so enabling is an explicit, per-instance step: it
sets an instance attribute ``generate`` that wraps the class's own method. Without ``raincheck``
(or with ``raincheck=False``) the call goes to HF's `generate` untouched; with it, HF's
`generate` still does all input preparation (generation config, logits processors, stopping
criteria, vision encoding) and then calls `raincheck_sample` through its public
``custom_generate=<callable>`` seam. `disable` deletes the attribute. Nothing is patched globally.

A selector whose class sets ``needs_vision_attention = True`` (VisionZip) reads the vision tower's
last block: for that one `generate` call only, forward pre-hooks on the tower and on its last block
record what the block is given (see `VisionAttentionCapture`), and the record travels to
`raincheck_sample` as ``raincheck_captures``. The hooks are removed when the call returns or fails, and
act only in the calling thread (a stock ``generate`` of the same model elsewhere passes untouched).
Otherwise, where `ModelAdapter.use_vision_graphs` holds (CUDA, or ``fast_path=True``), the pixels skip
HF's eager encoding and travel as ``raincheck_pixels``: the loop encodes them with the tower
replayed from a CUDA graph per grid (`fast.vision_graphs`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria

from .cache_utils import DeferredDynamicCache
from .configuration import RaincheckConfig
from .batch_engine import batched_sample
from .batched import expand_return_sequences, validate_batch
from .generation import raincheck_sample
from .models import get_adapter

_ORIGINAL = "_raincheck_original_generate"


def is_enabled(model) -> bool:
    return _ORIGINAL in vars(model)


TRANSFORMERS_RANGE = ("5.24", "5.25")  # >= the first, < the second: pyproject.toml's pin (a test keeps them equal)


def check_transformers(version: str | None = None) -> None:
    """A clear error where the installed transformers is outside the range the engine is built on (its cache layer
    API, ``custom_generate`` and the Qwen3-VL DeepStack arguments change between minor versions: another version
    fails later and obscurely, mid-generate)."""
    from packaging.version import Version

    import transformers

    found = transformers.__version__ if version is None else version
    low, high = TRANSFORMERS_RANGE
    if not Version(low) <= Version(Version(found).base_version) < Version(high):  # (a dev / local build counts)
        raise RuntimeError(f"raincheck_hf needs transformers >={low},<{high}; this environment has transformers "
                           f"{found}. Install a supported version: pip install 'transformers>={low},<{high}'.")


def enable(model):
    """Make ``model.generate`` accept ``raincheck=True | RaincheckConfig | dict``. Idempotent; returns the model."""
    check_transformers()
    get_adapter(model)  # unsupported models fail here, with the list of supported classes
    if is_enabled(model):
        return model
    original = model.generate  # the class's bound method (or an earlier instance-level override)

    @functools.wraps(original)
    def generate(*args, raincheck=None, **kwargs):
        config = RaincheckConfig.coerce(raincheck)
        if config is None:
            return original(*args, **kwargs)
        copies = return_sequences(model, config, kwargs)
        if copies > 1:  # each prompt's copies as rows of a batch, as stock generate runs them
            if args:
                args, kwargs = args[1:], dict(kwargs, input_ids=args[0])
            input_ids, kwargs = expand_return_sequences(model, kwargs["input_ids"], kwargs, copies)
            kwargs["input_ids"] = input_ids
        kwargs = validate_request(model, config, args, kwargs)
        if _hf_cache_unused(model, kwargs):
            kwargs["use_cache"] = False  # the engine keeps its own cache: HF's preparation would build one for nothing
        grids = {name: kwargs.get(name) for name in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")}
        # HF 5.24 does not forward `streamer` to a custom_generate callable (it keeps only the callable's
        # own extra parameters), so it travels under our name and the loop feeds it the prompt itself.
        streamer = kwargs.pop("streamer", None)
        with contextlib.ExitStack() as stack:
            captures = pixels = None
            if _needs_vision_attention(config):
                captures = stack.enter_context(VisionAttentionCapture(model, grids))
            elif (kwargs.get("mm_encoder_outputs") is None and _batch_size(args, kwargs) == 1
                  and get_adapter(model).use_vision_graphs(config)):
                # the loop encodes these itself, through the captured tower (HF would run it eagerly first);
                # a selector reading the tower's attention needs the eager tower and its hooks: kept with HF
                pixels = {k: kwargs.pop(k) for k in ("pixel_values", "pixel_values_videos") if kwargs.get(k) is not None}
            loop = raincheck_sample if _batch_size(args, kwargs) == 1 else batched_sample  # a batch: its own driver
            return original(*args, custom_generate=loop, raincheck_config=config, raincheck_grids=grids,
                            raincheck_streamer=streamer, raincheck_captures=captures, raincheck_pixels=pixels,
                            **kwargs)

    vars(model)[_ORIGINAL] = original
    model.generate = generate
    return model


def disable(model):
    """Undo `enable`: ``model.generate`` is the class's method again. Returns the model."""
    if is_enabled(model):
        del vars(model)["generate"]
        del vars(model)[_ORIGINAL]
    return model


def _batch_size(args, kwargs) -> int:
    """Rows of the call's ``input_ids`` (a batch runs on the eager engine, with HF's eager vision encoding)."""
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    return int(input_ids.shape[0])


def _needs_vision_attention(config: RaincheckConfig) -> bool:
    if config.mode == "full" or config.retention >= 1.0 or isinstance(config.selector, torch.Tensor):
        return False
    return bool(getattr(config.build_selector(), "needs_vision_attention", False))


class VisionAttentionCapture(contextlib.AbstractContextManager):
    """What the vision tower's last block was given, per modality, during one `generate` call.

    HF's `generate` encodes a prompt's images in one tower call and its videos in another (images
    first); `encode_turn` does the same when it has to encode itself. A pre-hook on the tower reads
    each call's ``grid_thw`` and names the call's modality by comparing it with the request's
    ``image_grid_thw`` / ``video_grid_thw`` (images first when both are equal); a pre-hook on the
    last block (the adapter's ``vision_last_block``) then stores, without copying, what the block receives.
    ``self[modality]`` is a dict:

    - ``hidden_states``: ``[P, C]`` the block's input, P patches in the tower's (merge-block-major) order;
    - ``cu_seqlens``: ``[W + 1]`` window boundaries (one window per image / video temporal slice);
    - ``position_embeddings``: the tower's rotary ``(cos, sin)``;
    - ``grid_thw``: the call's grid; ``block``: the block module; ``merge_unit``: patches per LLM token
      (``spatial_merge_size ** 2``);
    - ``query_key``: the adapter's ``vision_block_query_key`` (the block's q, k and scale from its inputs);
    - ``merged_order``: None, or the permutation from the block's merged-token order to source order
      (Qwen2.5-VL's tower holds its tokens window by window).

    A modality the tower did not encode inside the call (pre-computed ``mm_encoder_outputs``) is absent.
    The tensors are references, kept only as long as this object (one `generate` call).
    """

    def __init__(self, model, grids: dict):
        self.adapter = get_adapter(model)
        self.tower = self.adapter.vision_tower
        self.block = self.adapter.vision_last_block
        self.merge_unit = self.adapter.vision_merge_unit
        self.grids = {"image": grids.get("image_grid_thw"), "video": grids.get("video_grid_thw")}
        self.calls: dict[str, dict] = {}
        self._current = None
        self._handles = []
        self._thread = None

    def __enter__(self):
        self._thread = threading.get_ident()  # the hooks sit on the shared tower: they record this call only
        self._handles = [
            self.tower.register_forward_pre_hook(self._tower_hook, with_kwargs=True),
            self.block.register_forward_pre_hook(self._block_hook, with_kwargs=True),
        ]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return False

    def __getitem__(self, modality: str) -> dict:
        return self.calls[modality]

    def __contains__(self, modality: str) -> bool:
        return modality in self.calls

    def _tower_hook(self, module, args, kwargs):
        if threading.get_ident() != self._thread:
            return
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        self._current = None
        for modality in ("image", "video"):
            want = self.grids[modality]
            if modality in self.calls or want is None or grid is None:
                continue
            if tuple(want.shape) == tuple(grid.shape) and torch.equal(want.cpu(), grid.cpu()):
                self._current = modality
                self.calls[modality] = {"grid_thw": grid, "block": self.block, "merge_unit": self.merge_unit,
                                        "query_key": self.adapter.vision_block_query_key,
                                        "merged_order": self.adapter.vision_merged_order(grid)}
                break

    def _block_hook(self, module, args, kwargs):
        if threading.get_ident() != self._thread or self._current is None:
            return
        record = self.calls[self._current]
        record["hidden_states"] = kwargs.get("hidden_states", args[0] if args else None)
        record["cu_seqlens"] = kwargs.get("cu_seqlens", args[1] if len(args) > 1 else None)
        record["position_embeddings"] = kwargs.get("position_embeddings", args[2] if len(args) > 2 else None)
        self._current = None


_UNSUPPORTED_GENERATE_KWARGS = {
    "num_beams": 1,
    "output_attentions": False,
    "output_hidden_states": False,
}


def _hf_cache_unused(model, kwargs: dict) -> bool:
    """Whether HF's `generate` would build a `DynamicCache` that no part of the call reads (a raincheck call runs its
    own cache; building HF's walks every layer's config: ~0.5-1 ms before the first token): the call did not name
    ``use_cache`` itself, and no setting reads HF's cache or would warn without it (classifier-free guidance runs the
    model with it; a ``cache_implementation`` / ``cache_config`` is warned about when ``use_cache`` is False)."""
    if "use_cache" in kwargs:
        return False
    gen_config = kwargs.get("generation_config") or model.generation_config
    guidance = kwargs.get("guidance_scale", getattr(gen_config, "guidance_scale", None))
    if guidance not in (None, 1):
        return False
    return all(kwargs.get(name, getattr(gen_config, name, None)) is None
               for name in ("cache_implementation", "cache_config"))


def return_sequences(model, config: RaincheckConfig, kwargs: dict) -> int:
    """``num_return_sequences`` of the call (its argument, else its generation config's), checked before any compute:
    an int >= 1; above 1 only with sampling (stock `generate` refuses copies of a greedy answer, which would all be
    the same) and only where the copies can run as rows of a batch (new conversations, a selector rather than a
    keep-mask, the vision tower run on the call's pixels rather than given ``mm_encoder_outputs``)."""
    gen_config = kwargs.get("generation_config") or model.generation_config
    n = kwargs.get("num_return_sequences")
    n = getattr(gen_config, "num_return_sequences", 1) if n is None else n
    n = 1 if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"generate(raincheck=...) got num_return_sequences={n!r}; it must be an int >= 1.")
    if n == 1:
        return 1
    sampling = kwargs.get("do_sample", getattr(gen_config, "do_sample", False))
    why = None
    if not sampling:
        why = ("greedy decoding (do_sample != True) would give the same answer n times; pass do_sample=True, as "
               "stock generate asks")
    elif kwargs.get("mm_encoder_outputs") is not None:
        why = "precomputed mm_encoder_outputs are one prompt's each; pass pixel_values (or call once per copy)"
    elif isinstance(config.selector, torch.Tensor):
        why = ("a keep-mask tensor as selector pins one prompt's selection and the copies run as rows of a batch; "
               "use a selector name or instance")
    else:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, DeferredDynamicCache) or (cache is not None and cache.get_seq_length() > 0):
            why = ("the copies start new conversations; continue a conversation with num_return_sequences=1, or "
                   "copy its cache per answer")
    if why is not None:
        raise ValueError(f"generate(raincheck=...) got num_return_sequences={n}: {why}.")
    return n


def _check_chunk_schedule(config: RaincheckConfig, schedule, batch: int) -> None:
    """``generate(..., raincheck_chunk_schedule=...)`` (internal, for tests: a chunk schedule that
    `generation.ChunkScheduler` replays): one prompt, a list of per-forward padded chunk sizes, forward 0 (the
    prefill) 0, none above the config's largest chunk, and none at all in a mode that restores nothing during
    decoding."""
    if schedule is None:
        return
    if batch != 1:
        raise ValueError(f"generate(raincheck_chunk_schedule=...) replays one sequence's chunk sizes; got a batch of "
                         f"{batch} prompts. Run each row alone with its row's trace.chunk_size_per_forward.")
    sizes = list(schedule) if isinstance(schedule, (list, tuple)) else None
    limit = config.max_chunk_size if config.restores_during_decode else 0
    if (sizes is None or any(isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= limit for c in sizes)
            or (sizes and sizes[0] != 0)):
        raise ValueError(f"generate(raincheck_chunk_schedule={schedule!r}) must be a list of per-forward chunk sizes "
                         f"(a trace's chunk_size_per_forward): integers from 0 to {limit} (mode={config.mode!r}, "
                         f"chunk_size={config.chunk_size!r}), 0 for forward 0 (the prefill).")


def validate_request(model, config: RaincheckConfig, args, kwargs) -> dict:
    """Everything that can be checked before any compute. Returns the kwargs to pass on to HF."""
    adapter = get_adapter(model)
    adapter.check_attention()
    if config.fast_path is True:
        adapter.execution_path(config)  # a ValueError where the fast path cannot run (an accelerate split)
    if kwargs.get("custom_generate") is not None:
        raise ValueError("generate(raincheck=...) runs its own decoding loop; do not pass custom_generate as well.")
    if kwargs.get("assistant_model") is not None:
        raise ValueError("generate(raincheck=...) does not support assisted decoding (assistant_model).")
    gen_config = kwargs.get("generation_config") or model.generation_config
    for name, allowed in _UNSUPPORTED_GENERATE_KWARGS.items():
        value = kwargs.get(name, getattr(gen_config, name, allowed))
        if value not in (allowed, None):
            raise ValueError(f"generate(raincheck=...) supports only {name}={allowed!r}; got {name}={value!r}.")
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if input_ids is None or not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise ValueError("generate(raincheck=...) needs input_ids of shape [batch, length] (as the processor returns).")
    _check_chunk_schedule(config, kwargs.get("raincheck_chunk_schedule"), input_ids.shape[0])
    attention_mask = kwargs.get("attention_mask")
    if input_ids.shape[0] != 1:  # a batch of prompts: the batched engine's own checks
        validate_batch(model, config, input_ids, kwargs)
    elif attention_mask is not None and not bool((attention_mask == 1).all()):
        raise ValueError("generate(raincheck=...) got an attention_mask with padding; pass the unpadded prompt.")
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    start = 0
    if isinstance(cache, DeferredDynamicCache):
        start = cache.source_length
        prefix = input_ids[0, :start].cpu()
        if input_ids.shape[1] <= start or not torch.equal(prefix, cache.source_ids):
            raise ValueError(
                f"input_ids must be the whole conversation: the first {start} ids the cache accounts for, then "
                f"at least one new token; got {input_ids.shape[1]} ids"
                + ("" if input_ids.shape[1] <= start else " whose prefix differs from the cache's")
                + ". Pass the previous call's `sequences` followed by the new turn's tokens."
            )
    elif cache is not None and cache.get_seq_length() > 0:
        raise ValueError(
            f"generate(raincheck=...) continues only a DeferredDynamicCache, got a non-empty {type(cache).__name__}."
        )
    check_model = getattr(config.build_selector(), "check_model", None)
    if check_model is not None:  # model-dependent settings of a selector (e.g. FastV's layer)
        check_model(model)
    if isinstance(config.selector, torch.Tensor):  # (counted only then: on a GPU the count waits for the device)
        n_multimodal = int(adapter.multimodal_mask(input_ids[0, start:], text_prefix=1 if start > 0 else 0).sum())
        if config.selector.numel() != n_multimodal:
            raise ValueError(
                f"RaincheckConfig.selector is a keep-mask of {config.selector.numel()} entries but the prompt's new "
                f"tokens hold {n_multimodal} multimodal tokens; give one entry per <|image_pad|>/<|video_pad|> token."
            )
    # HF derives M-RoPE from mm_token_type_ids over *all* of input_ids and the grids of the new
    # images only, which disagree on a continued conversation. Raincheck builds every position
    # itself from input_ids, so it checks the given types against input_ids and does not pass them on.
    mm_types = kwargs.pop("mm_token_type_ids", None)
    if mm_types is not None:
        expected = (input_ids == adapter.image_token_id).long() + 2 * (input_ids == adapter.video_token_id).long()
        if mm_types.shape != input_ids.shape or not torch.equal(mm_types[:, start:].long().cpu(),
                                                                  expected[:, start:].cpu()):
            raise ValueError("mm_token_type_ids disagrees with the image/video placeholders in input_ids.")
    _own_stop_strings(model, kwargs)
    return kwargs


def _own_stop_strings(model, kwargs: dict) -> None:
    """Stop strings as stock ``generate`` takes them (``stop_strings=`` or the generation config's, with
    ``tokenizer=``), as a `StopStringCriteria` in ``kwargs["stopping_criteria"]``: HF builds that criterion from the
    ``tokenizer`` argument, which it drops when a ``custom_generate`` callable runs (only the callable's own
    parameters are kept), so it would fail with "could not locate a tokenizer". HF then sees no stop strings."""
    gen_config = kwargs.get("generation_config") or model.generation_config
    stop = kwargs.pop("stop_strings", None)
    from_config = stop is None and getattr(gen_config, "stop_strings", None) is not None
    if from_config:
        stop = gen_config.stop_strings
    if stop is None:
        return
    tokenizer = kwargs.pop("tokenizer", None)
    if tokenizer is None:
        raise ValueError(f"generate(raincheck=...) got stop_strings={stop!r} but no tokenizer; pass the model's "
                         "tokenizer too (tokenizer=processor.tokenizer), as stock generate asks.")
    if from_config:  # (a copy: the caller's config keeps its stop strings)
        gen_config = copy.deepcopy(gen_config)
        gen_config.stop_strings = None
        kwargs["generation_config"] = gen_config
    kwargs["stopping_criteria"] = StoppingCriteriaList(
        [*(kwargs.get("stopping_criteria") or []), StopStringCriteria(tokenizer=tokenizer, stop_strings=stop)])
