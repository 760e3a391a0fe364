"""Raincheck on models that accelerate splits or offloads (``device_map=...``; issue 9).

Users whose model does not fit on one device load it with ``device_map="auto"`` (or an explicit map):
accelerate places each block on a device, or offloads its weights to CPU RAM or disk (``meta`` between
forwards, loaded by an `AlignDevicesHook` for the span of the module's own forward). Raincheck must give
the single-device run's answer there: every cache layer's KV and Gated DeltaNet state (and the GDN
boundary map) live on their layer's device, masks / positions / DeepStack rows go where they are used,
and idle-time restoration (`Conversation`'s worker) follows the split.

Every check compares with the same tiny model (same seed, fp32) on one device: greedy tokens identical,
every forward's logits within float noise, the same restoration trace, for every mode and both families.

- CPU (always): ``from_pretrained(device_map={...: "cpu", ...: "disk"}, offload_folder=...)``,
  ``device_map="auto"`` with a ``max_memory`` that forces disk offload, `dispatch_model` with disk
  offload, and `cpu_offload` (every weight on ``meta``, kept in a CPU state dict); every selector on
  the last; a two-turn `Conversation` with background restoration and with leftovers riding along
  with the follow-up; the fast path refused with a clear error before any compute.
- One CUDA device: cuda:0 with layers offloaded to CPU RAM and disk (executed on cuda:0).
- Two CUDA devices: blocks alternating over cuda:0 and cuda:1 (and cuda + cpu + disk).
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForImageTextToText

import raincheck_hf
from raincheck_hf import Conversation, RaincheckConfig
from raincheck_hf.cache_utils import DeferredDynamicCache
from raincheck_hf.models import get_adapter
from raincheck_hf.tiny import build_tiny_qwen3_5, build_tiny_qwen3_vl, draw_test_image

from conftest import make_inputs, no_placeholder_ids

accelerate = pytest.importorskip("accelerate")

FAMILIES = {"qwen3_vl": build_tiny_qwen3_vl, "qwen3_5": build_tiny_qwen3_5}
MODES = ("full", "hard", "post_answer", "raincheck", "serial")
N_NEW = 8
TOL = 1e-5  # same weights, same kernels, one process: float noise at most
IMAGE = dict(width=128, height=96, seed=1)  # 12 visual tokens: 4 selected, 8 deferred at retention 0.3


def cfg(mode="raincheck", **kw):
    # chunk 3 after a guard of 2 over 8 deferred rows: forwards 2, 3, 4 restore 3 + 3 + 2 rows during the answer
    return RaincheckConfig(**{"mode": mode, "retention": 0.3, "chunk_size": 3, "decode_guard": 2, **kw})


def generate(model, inputs, config):
    return model.generate(**inputs, max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                          suppress_tokens=no_placeholder_ids(model), return_dict_in_generate=True,
                          output_logits=True, raincheck=config)


def assert_same_run(got, want, tol=TOL):
    assert torch.equal(got.sequences.cpu(), want.sequences.cpu()), "greedy tokens differ"
    assert len(got.logits) == len(want.logits)
    for i, (a, b) in enumerate(zip(got.logits, want.logits)):
        diff = (a.float().cpu() - b.float().cpu()).abs().max().item()
        assert diff <= tol, f"forward {i}: max abs logit diff {diff:.2e}"
    for name in ("selected", "deferred", "pending", "dropped"):
        assert torch.equal(getattr(got.raincheck, name), getattr(want.raincheck, name)), name
    assert [r.tolist() for r in got.raincheck.restored_per_forward] == [
        r.tolist() for r in want.raincheck.restored_per_forward]


def cache_devices(cache: DeferredDynamicCache) -> dict[int, set[str]]:
    """Layer index -> devices of everything the cache holds for that layer (KV, GDN states, boundary map)."""
    out = {}
    for i, layer in enumerate(cache.layers):
        tensors = []
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.numel():
                tensors.append(t)
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name, None) or {}
            tensors += [t for t in (states.values() if isinstance(states, dict) else states)
                        if isinstance(t, torch.Tensor)]
        smap = getattr(layer, "suffix_map", None)
        if smap is not None:
            tensors += [smap.boundary_state, smap.boundary_conv_history, smap.leading_state, smap.rest_map]
        out[i] = {str(t.device) for t in tensors}
    return out


def layer_kinds(model) -> list[str]:
    text = model.config.get_text_config()
    return list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)


def assert_cache_on(cache, expected: dict[int, str], kinds: list[str]):
    devices = cache_devices(cache)
    for i, kind in enumerate(kinds):
        assert devices[i] == {expected[i]}, f"cache layer {i} ({kind}) holds tensors on {devices[i]}, not {expected[i]}"
    assert str(cache.row_keys.device) != "meta"


# ---- models -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def single():
    """family -> the model on one device (CPU), enabled."""
    return {family: raincheck_hf.enable(build(seed=0)) for family, build in FAMILIES.items()}


@pytest.fixture(scope="module")
def checkpoints(single, tmp_path_factory):
    """family -> a directory holding the single model's `save_pretrained` output."""
    dirs = {}
    for family, model in single.items():
        dirs[family] = tmp_path_factory.mktemp(f"ckpt_{family}")
        model.save_pretrained(dirs[family])
    return dirs


def explicit_map(model, place) -> dict[str, str]:
    """A device map over the model's blocks; ``place(i)`` gives text layer i's device."""
    n = model.config.get_text_config().num_hidden_layers
    dm = {
        "model.visual": place("visual"),
        "model.language_model.embed_tokens": place("embed"),
        "model.language_model.rotary_emb": place("rotary"),
        "model.language_model.norm": place("norm"),
        "lm_head": place("lm_head"),
    }
    dm.update({f"model.language_model.layers.{i}": place(i) for i in range(n)})
    return dm


# Text layers 0 and 2 offloaded to disk, 1 and 3 on cpu: on Qwen3.5 (GDN, GDN, attention, GDN) a GDN layer
# and the attention layer are offloaded, the other GDN layers are not; the embedding and lm_head are on
# disk too, so `embed_tokens.weight` is `meta` between forwards.
CPU_DISK = {"visual": "cpu", "embed": "disk", "rotary": "cpu", "norm": "cpu", "lm_head": "disk",
            0: "disk", 1: "cpu", 2: "disk", 3: "cpu"}


def load_cpu_disk(family, single, checkpoints, tmp_path):
    dm = explicit_map(single[family], CPU_DISK.__getitem__)
    return AutoModelForImageTextToText.from_pretrained(checkpoints[family], device_map=dm, dtype=torch.float32,
                                                       offload_folder=str(tmp_path / "offload"))


def load_auto(family, single, checkpoints, tmp_path):
    size = sum(p.numel() * p.element_size() for p in single[family].parameters())
    model = AutoModelForImageTextToText.from_pretrained(
        checkpoints[family], device_map="auto", max_memory={"cpu": size // 2}, dtype=torch.float32,
        offload_folder=str(tmp_path / "offload"))
    assert {"cpu", "disk"} <= set(model.hf_device_map.values()), model.hf_device_map  # the test's premise
    return model


def load_dispatch(family, single, checkpoints, tmp_path):
    from accelerate import dispatch_model

    model = FAMILIES[family](seed=0)
    return dispatch_model(model, device_map=explicit_map(model, CPU_DISK.__getitem__),
                          offload_dir=str(tmp_path / "offload"))


def load_cpu_offload(family, single, checkpoints, tmp_path):
    from accelerate import cpu_offload

    model = cpu_offload(FAMILIES[family](seed=0), execution_device="cpu")
    assert all(p.device.type == "meta" for p in model.parameters())  # the test's premise
    return model


PLACEMENTS = {
    "cpu+disk": load_cpu_disk,
    "auto-max_memory": load_auto,
    "dispatch_model-disk": load_dispatch,
    "cpu_offload-meta": load_cpu_offload,
}


@pytest.fixture(scope="module")
def placed(single, checkpoints, tmp_path_factory):
    """(placement, family) -> the model placed that way, enabled (loaded once per module)."""
    models = {}

    def get(placement, family):
        if (placement, family) not in models:
            tmp = tmp_path_factory.mktemp(f"{placement}_{family}")
            model = PLACEMENTS[placement](family, single, checkpoints, tmp)
            model.generation_config = single[family].generation_config
            models[placement, family] = raincheck_hf.enable(model.eval())
        return models[placement, family]

    return get


@pytest.fixture(scope="module")
def inputs(processor):
    return make_inputs(processor, images=(draw_test_image(**IMAGE),))


@pytest.fixture(scope="module")
def reference(single, inputs):
    """(family, mode, selector) -> the single-device run (computed once)."""
    runs = {}

    def get(family, mode, selector="mmtok"):
        if (family, mode, selector) not in runs:
            runs[family, mode, selector] = generate(single[family], inputs, cfg(mode, selector=selector))
        return runs[family, mode, selector]

    return get


# ---- CPU: every placement, family and mode ------------------------------------------------------

# Every mode on the explicit cpu + disk map and on cpu_offload; the other two placements (the same hooks,
# reached through "auto" and through dispatch_model) run the modes with chunks in and after the answer.
GRID = [(placement, mode) for placement in PLACEMENTS for mode in MODES
        if placement in ("cpu+disk", "cpu_offload-meta") or mode in ("post_answer", "raincheck")]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("placement,mode", GRID, ids=[f"{p}-{m}" for p, m in GRID])
def test_split_matches_single_device(placed, reference, inputs, placement, family, mode):
    model = placed(placement, family)
    assert get_adapter(model).device == torch.device("cpu")  # the embedding's execution device, never meta
    want = reference(family, mode)
    if mode in ("raincheck", "serial"):
        assert want.raincheck.restored_during_decode == 8  # chunks really ran during the answer
    got = generate(model, inputs, cfg(mode))
    assert_same_run(got, want)
    assert_cache_on(got.cache, {i: "cpu" for i in range(len(got.cache.layers))}, layer_kinds(model))
    if mode == "post_answer":  # idle-time restoration on the split model leaves the same cache
        assert got.cache.num_pending == 8
        assert torch.equal(raincheck_hf.restore_pending(model, got.cache, max_tokens=3), want.raincheck.deferred[:3])
        raincheck_hf.restore_pending(model, got.cache)
        assert got.cache.num_pending == 0
        assert torch.equal(torch.sort(got.cache.restored_sources()).values, want.raincheck.deferred)


SELECTORS = ("divprune", "cdpruner", "visionzip", "fastv", "random", "uniform")


@pytest.mark.parametrize("selector", SELECTORS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_selectors_on_meta_offloaded_model(placed, reference, inputs, family, selector):
    """Selectors read the vision tower (VisionZip), run early layers (FastV) or the features: all under offload."""
    got = generate(placed("cpu_offload-meta", family), inputs, cfg(selector=selector))
    assert_same_run(got, reference(family, "raincheck", selector))


# ---- CPU: two-turn Conversation with background restoration --------------------------------------

CONV_CFG = RaincheckConfig(retention=0.3, chunk_size=2, decode_guard=4)  # 6 tokens: 4 of 8 restored in the answer


def _wait_until_restored(conv, timeout=30.0):
    deadline = time.monotonic() + timeout
    while conv.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert conv.pending == 0


def _two_turns(model, processor, background):
    kw = dict(suppress_tokens=no_placeholder_ids(model), output_logits=True, min_new_tokens=6)
    with Conversation(model, processor, CONV_CFG, background=background, max_new_tokens=6) as conv:
        first = conv.ask("What is in this image?", images=[draw_test_image(**IMAGE)], **kw)
        assert first.trace.pending.numel() == 4  # leftovers for the worker / the follow-up
        if background:
            _wait_until_restored(conv)
        second = conv.ask("And what colour is the corner?", images=[draw_test_image(64, 96, seed=9)], **kw)
    return conv, first, second


@pytest.fixture(scope="module")
def reference_conversation(single, processor):
    runs = {}

    def get(family, background):
        if (family, background) not in runs:
            runs[family, background] = _two_turns(single[family], processor, background)
        return runs[family, background]

    return get


@pytest.mark.parametrize("background", [True, False],
                         ids=["worker-restores-between-turns", "leftovers-ride-with-follow-up"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("placement", ["cpu+disk", "cpu_offload-meta"])  # the latter: model.device is meta
def test_conversation_on_split_model(placed, reference_conversation, processor, placement, family, background):
    model = placed(placement, family)
    conv, first, second = _two_turns(model, processor, background)
    ref, ref_first, ref_second = reference_conversation(family, background)
    for got, want in ((first, ref_first), (second, ref_second)):
        assert torch.equal(got.token_ids, want.token_ids)
        assert_same_run(got.output, want.output)
    assert first.restored_during_answer == 4
    assert first.restored_during_answer + first.restored_after_answer == first.trace.deferred.numel()
    if not background:
        assert second.trace.restored_per_forward[0].numel() == 4
    assert torch.equal(conv.cache.row_sources, ref.cache.row_sources)
    assert torch.equal(conv.cache.row_keys, ref.cache.row_keys)
    assert_cache_on(conv.cache, {i: "cpu" for i in range(len(conv.cache.layers))}, layer_kinds(model))


# ---- what cannot work is refused before any compute ---------------------------------------------

@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_accelerate_split_reads_every_module_as_modules_does(placed, single, placement):
    """`models.base.accelerate_split` walks the ``_modules`` dicts itself (it runs twice per call): the phrase that
    reading the hooks of `model.modules()` gives, a module held twice counted once, a submodule set to None skipped."""
    from raincheck_hf.models.base import _hook_devices, accelerate_split

    def by_modules(model):
        devices, offloaded = set(), 0
        for module in model.modules():
            for device, offloads in _hook_devices(module):
                if device is not None:
                    devices.add(str(device))
                offloaded += offloads
        parts = [f"over the devices {sorted(devices)}"] if len(devices) > 1 else []
        parts += [f"with the weights of {offloaded} modules offloaded (cpu / disk)"] if offloaded else []
        return " and ".join(parts) or None, bool(devices or offloaded)

    model = placed(placement, "qwen3_vl")
    want, hooked = by_modules(model)
    assert hooked and accelerate_split(model) == want
    merger = model.model.visual.merger
    shared = torch.nn.Sequential(merger, merger, torch.nn.Identity())
    shared.register_module("nothing", None)
    assert accelerate_split(shared) == by_modules(shared)[0]
    assert accelerate_split(single["qwen3_vl"]) is None  # no hooks: not split


@pytest.mark.parametrize("placement", ["cpu_offload-meta", "cpu+disk"])
def test_fast_path_refused_on_split_model(placed, inputs, placement):
    model = placed(placement, "qwen3_vl")
    calls = []
    handles = [m.register_forward_pre_hook(lambda *a: calls.append(1))
               for m in (model.model.visual, get_adapter(model).text_model.embed_tokens)]
    try:
        with pytest.raises(ValueError, match=r"RaincheckConfig\.fast_path=True .*offloaded"):
            generate(model, inputs, cfg(fast_path=True))
    finally:
        for h in handles:
            h.remove()
    assert not calls, "the error came after compute had started"
    # auto (None) picks the eager engine on a split model instead of failing
    out = generate(model, inputs, cfg(fast_path=None))
    assert type(out.cache) is DeferredDynamicCache


# ---- GPUs ---------------------------------------------------------------------------------------

def _cuda_inputs(inputs, device):
    return {k: v.to(device) for k, v in inputs.items()}


@pytest.fixture(scope="module")
def single_gpu():
    return {family: raincheck_hf.enable(build(seed=0).to("cuda:0")) for family, build in FAMILIES.items()}


def _gpu_split(family, tmp_path, checkpoints, single, spec):
    """Load the family with the device map ``spec`` (values: cuda devices, "cpu", "disk")."""
    dm = explicit_map(single[family], spec.__getitem__)
    model = AutoModelForImageTextToText.from_pretrained(checkpoints[family], device_map=dm, dtype=torch.float32,
                                                       offload_folder=str(tmp_path / "offload"))
    model.generation_config = single[family].generation_config
    return raincheck_hf.enable(model.eval())


def _expected_layer_devices(spec, n_layers, main="cuda:0"):
    # offloaded ("cpu" / "disk") blocks execute on accelerate's main device, so their cache lives there
    return {i: (main if spec[i] in ("cpu", "disk") else spec[i]) for i in range(n_layers)}


def _check_gpu_split(family, spec, tmp_path, checkpoints, single, single_gpu, inputs, modes=MODES):
    model = _gpu_split(family, tmp_path, checkpoints, single, spec)
    ref_model = single_gpu[family]
    expected = _expected_layer_devices(spec, model.config.get_text_config().num_hidden_layers)
    assert str(get_adapter(model).device) == (spec["embed"] if spec["embed"] not in ("cpu", "disk") else "cuda:0")
    for mode in modes:
        want = generate(ref_model, _cuda_inputs(inputs, "cuda:0"), cfg(mode))
        got = generate(model, _cuda_inputs(inputs, "cuda:0"), cfg(mode))
        assert_same_run(got, want, tol=1e-4)
        assert_cache_on(got.cache, expected, layer_kinds(model))
    # fast path: refused when asked for, the eager engine when automatic (the reference runs it on one GPU)
    with pytest.raises(ValueError, match=r"RaincheckConfig\.fast_path=True"):
        generate(model, _cuda_inputs(inputs, "cuda:0"), cfg(fast_path=True))
    got = generate(model, _cuda_inputs(inputs, "cuda:0"), cfg(fast_path=None))
    assert type(got.cache) is DeferredDynamicCache
    assert_same_run(got, generate(ref_model, _cuda_inputs(inputs, "cuda:0"), cfg()), tol=1e-4)
    return model


# One GPU too small for the model: some layers offloaded to CPU RAM and disk, all executed on cuda:0.
GPU_OFFLOAD = {"visual": "cuda:0", "embed": "cuda:0", "rotary": "cuda:0", "norm": "cpu", "lm_head": "disk",
               0: "cuda:0", 1: "cpu", 2: "disk", 3: "cuda:0"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gpu_with_cpu_and_disk_offload_matches_single_gpu(family, tmp_path, checkpoints, single, single_gpu, inputs):
    _check_gpu_split(family, GPU_OFFLOAD, tmp_path, checkpoints, single, single_gpu, inputs)


# Two GPUs: blocks alternate, the embedding on cuda:1 while the vision tower and the first layer are on
# cuda:0 (so positions, masks and DeepStack rows cross devices at every layer), lm_head back on cuda:1.
TWO_GPUS = {"visual": "cuda:0", "embed": "cuda:1", "rotary": "cuda:0", "norm": "cuda:0", "lm_head": "cuda:1",
            0: "cuda:0", 1: "cuda:1", 2: "cuda:0", 3: "cuda:1"}
TWO_GPUS_OFFLOAD = {"visual": "cuda:1", "embed": "cuda:0", "rotary": "cuda:0", "norm": "cuda:1", "lm_head": "disk",
                    0: "cuda:0", 1: "cpu", 2: "cuda:1", 3: "disk"}
needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs 2 CUDA devices")


@needs_two_gpus
@pytest.mark.parametrize("spec", [TWO_GPUS, TWO_GPUS_OFFLOAD], ids=["cuda0-cuda1", "cuda0-cuda1-cpu-disk"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_gpu_split_matches_single_gpu(family, spec, tmp_path, checkpoints, single, single_gpu, inputs, processor):
    model = _check_gpu_split(family, spec, tmp_path, checkpoints, single, single_gpu, inputs)
    conv, first, second = _two_turns(model, processor, background=True)
    _, ref_first, ref_second = _two_turns(single_gpu[family], processor, background=True)
    for got, want in ((first, ref_first), (second, ref_second)):
        assert torch.equal(got.token_ids, want.token_ids)
        assert_same_run(got.output, want.output, tol=1e-4)
    assert_cache_on(conv.cache, _expected_layer_devices(spec, len(conv.cache.layers)), layer_kinds(model))
