"""`fast.autotune_ahead`: an autotuned Triton kernel's other configurations compiled on threads when its first one
compiles, so that the autotuner finds each in Triton's cache. On this CPU the kernels are compiled for a CUDA target
(Triton's compiler needs no GPU) and each step of the autotuner's loop is played as Triton's own run plays it: its
argument binding and packing, the cache hook, then the compile."""

from __future__ import annotations

import inspect

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from raincheck_hf.fast import autotune_ahead  # noqa: E402

CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b in (16, 32) for w in (1, 2)]


@triton.autotune(configs=CONFIGS, key=["n"])
@triton.jit
def _scaled(x, y, n, scale, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n) * scale, mask=i < n)


@triton.heuristics({"EVEN": lambda args: args["n"] % 2 == 0})  # (as fla's kernels: heuristics over the autotuner)
@triton.autotune(configs=CONFIGS, key=["n"])
@triton.jit
def _wrapped(x, n, EVEN: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x + i, tl.load(x + i, mask=i < n) * (2 if EVEN else 3), mask=i < n)


@triton.jit
def _plain(x, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x + i, tl.load(x + i, mask=i < n) + 1, mask=i < n)


class _Kernel:
    """A JIT function's run up to its compile, as `JITFunction.run` / `_do_compile` do it, for a CUDA target."""

    def __init__(self, jit, device=0):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        self.jit, self.device = jit, device
        self.target = GPUTarget("cuda", 90, 32)
        self.backend = make_backend(self.target)
        binder = create_function_from_signature(jit.signature, jit.params, self.backend)
        jit.device_caches[device] = ({}, {}, self.target, self.backend, binder)
        self.binder = binder

    def compile(self, *args, **kwargs):
        import torch
        from triton import knobs

        kwargs.setdefault("debug", False)
        kwargs.setdefault("instrumentation_mode", "")
        args = [torch.empty(64) if a == "tensor" else a for a in args]
        bound, specialization, options = self.binder(*args, **kwargs)
        options, signature, constexprs, attrs = self.jit._pack_args(self.backend, kwargs, bound, specialization,
                                                                     options)
        key = (tuple(specialization), str(options))
        hook_args = [knobs.runtime.jit_cache_hook, key, signature]
        if "target" in inspect.signature(self.jit._call_hook).parameters:  # (newer Triton passes the target too)
            hook_args.append(self.target)
        hook_args += [self.device, constexprs, options, [attrs], False]
        self.jit._call_hook(*hook_args)
        from triton.compiler import ASTSource, compile as triton_compile

        triton_compile(ASTSource(self.jit, signature, constexprs, attrs), target=self.target, options=options.__dict__)


@pytest.fixture
def heard(tmp_path, monkeypatch):
    """Triton's cache in a fresh folder; each compile's ``(kernel, cache hit)`` as Triton reports it."""
    from triton import knobs

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    seen = []
    monkeypatch.setattr(knobs.compilation, "listener",
                        lambda *, src, cache_hit, **_: seen.append((src.name, cache_hit)))
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    return seen


def _tune(kernel, n=64):
    """The autotuner's loop on an empty cache: each configuration compiled in turn, in this thread."""
    for config in CONFIGS:
        kernel.compile("tensor", "tensor", n, 2.0, **config.all_kwargs())


def test_the_other_configurations_are_compiled_ahead_and_found_in_the_cache(heard):
    from triton import knobs

    kernel = _Kernel(_scaled.fn)
    with autotune_ahead.compiling_configs_ahead(workers=2) as ahead:
        assert knobs.runtime.jit_cache_hook is autotune_ahead._hook
        _tune(kernel)
    assert knobs.runtime.jit_cache_hook is None  # (put back as it was)
    assert ahead.submitted == len(CONFIGS) - 1 and ahead.errors == 0
    mine = [hit for name, hit in heard if name == "_scaled"]
    # the first configuration compiled by the tuning thread; each other one twice heard: compiled on a pool thread,
    # then found in the cache by the tuning thread (which waited where it was still compiling)
    assert len(mine) == 1 + 2 * (len(CONFIGS) - 1)
    assert mine.count(True) == len(CONFIGS) - 1 and mine.count(False) == len(CONFIGS)
    # a second tuning of the same specialisation hands nothing more to the pool; a new one (another n: its
    # alignment) does
    with autotune_ahead.compiling_configs_ahead(workers=2) as again:
        _tune(kernel)
        assert again.submitted == len(CONFIGS) - 1  # (a fresh context: its own record)
        before = again.submitted
        _tune(kernel)
        assert again.submitted == before
        _tune(kernel, n=63)
        assert again.submitted == before + len(CONFIGS) - 1 and again.errors == 0


def test_a_configuration_already_chosen_compiles_nothing_ahead(heard, monkeypatch):
    """A process whose tuning came from Triton's cache (an earlier process's): the autotuner holds an equal
    configuration as its choice and compiles only that one; nothing is handed to the threads."""
    kernel = _Kernel(_scaled.fn)
    chosen = CONFIGS[2]
    monkeypatch.setattr(_scaled, "best_config", triton.Config(dict(chosen.kwargs), num_warps=chosen.num_warps),
                        raising=False)
    with autotune_ahead.compiling_configs_ahead(workers=2) as ahead:
        kernel.compile("tensor", "tensor", 48, 2.0, **chosen.all_kwargs())
        assert ahead.submitted == 0
        kernel.compile("tensor", "tensor", 48, 2.0, **CONFIGS[0].all_kwargs())  # (another: a tuning's)
        assert ahead.submitted == len(CONFIGS) - 1


def test_an_autotuner_inside_heuristics_is_found(heard):
    """fla's kernels are `triton.heuristics` over `triton.autotune` over the kernel: the module holds the heuristics."""
    kernel = _Kernel(_wrapped.fn.fn)
    with autotune_ahead.compiling_configs_ahead(workers=2) as ahead:
        for config in CONFIGS:
            kernel.compile("tensor", 64, EVEN=True, **config.all_kwargs())
    assert ahead.submitted == len(CONFIGS) - 1 and ahead.errors == 0
    assert [hit for name, hit in heard if name == "_wrapped"].count(True) == len(CONFIGS) - 1


def test_nothing_happens_outside_the_context_or_for_kernels_without_an_autotuner(heard):
    from triton import knobs

    kernel = _Kernel(_scaled.fn)
    _tune(kernel)  # (no hook: each compiled by this thread alone)
    assert [hit for _, hit in heard] == [False] * len(CONFIGS)
    with autotune_ahead.compiling_configs_ahead(workers=2) as ahead:
        _Kernel(_plain).compile("tensor", 8, BLOCK=16)
        assert ahead.submitted == 0
        with autotune_ahead.compiling_configs_ahead(workers=2) as inner:  # (nested: the outer one serves)
            assert inner is None
    assert knobs.runtime.jit_cache_hook is None
    with autotune_ahead.compiling_configs_ahead(enabled=False) as off:
        assert off is None and knobs.runtime.jit_cache_hook is None
    with autotune_ahead.switched_off(), autotune_ahead.compiling_configs_ahead(workers=2) as off:
        assert off is None
        _tune(kernel, n=33)
    assert [hit for _, hit in heard[-len(CONFIGS):]] == [False] * len(CONFIGS)


def test_a_hook_set_before_is_called_first_and_can_still_skip_a_compile(heard, monkeypatch):
    from triton import knobs

    calls = []

    def earlier(**kwargs):
        calls.append(kwargs["fn"].name)
        return False

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", earlier)
    kernel = _Kernel(_scaled.fn)
    with autotune_ahead.compiling_configs_ahead(workers=2) as ahead:
        _tune(kernel)
    assert calls == ["_scaled"] * len(CONFIGS) and ahead.submitted == len(CONFIGS) - 1
    assert knobs.runtime.jit_cache_hook is earlier
    with autotune_ahead.compiling_configs_ahead(workers=2) as ahead:  # (the earlier hook skips: nothing ahead)
        monkeypatch.setattr(autotune_ahead, "_previous_hook", lambda **kwargs: True)
        _tune(kernel, n=17)
        assert ahead.submitted == 0


def test_configuration_fields_it_cannot_place_are_left_to_the_autotuner():
    paths = {"x": [0], "BLOCK": [4]}
    assert autotune_ahead.config_fields(triton.Config({"BLOCK": 16}, num_warps=2, num_stages=3), paths) == {
        "constants": {"[4]": 16}, "options": {"num_warps": 2, "num_ctas": 1, "num_stages": 3}}
    assert autotune_ahead.config_fields(triton.Config({"OTHER": 16}), paths) is None  # (no such parameter)
    assert autotune_ahead.config_fields(triton.Config({"BLOCK": 16}, pre_hook=lambda a: None), paths) is None
    assert 1 <= autotune_ahead.default_workers() <= 16


@pytest.fixture
def timed(monkeypatch):
    """Triton's `do_bench` and the driver's default benchmark replaced by recorders: ``("brief" | "own", warmup,
    rep)`` per timing (no GPU is touched)."""
    import triton.testing
    from triton.runtime import driver

    calls = []

    def brief(fn, warmup=25, rep=100, quantiles=None, **_):
        calls.append(("brief", warmup, rep))
        return [1.0, 1.0, 1.0]

    class StandIn:
        def get_benchmarker(self):
            return lambda fn, quantiles=None, **_: calls.append(("own", None, None)) or [2.0, 2.0, 2.0]

    monkeypatch.setattr(triton.testing, "do_bench", brief)
    monkeypatch.setattr(driver, "_active", StandIn())  # (`set_active`, put back as it was after the test)
    return calls


def _time(tuner):
    return tuner.do_bench(lambda: None, quantiles=(0.5, 0.2, 0.8))


def test_autotuners_time_briefly_inside_the_context_only(timed):
    """Inside `compiling_configs_ahead` a tuning's timed runs are Triton's `do_bench` over `BRIEF_WARMUP_MS` /
    `BRIEF_REP_MS` (autotuners under heuristics too); with `timing_in_full`, in another thread, and after the block,
    the autotuner's own benchmark; a kernel's own ``do_bench`` is always kept; the attribute is put back."""
    import threading

    own_bench = []
    custom = triton.autotune(configs=CONFIGS, key=["n"], do_bench=lambda fn, quantiles: own_bench.append(1) or [3.0])(
        _plain)
    with autotune_ahead.compiling_configs_ahead(workers=1):
        _time(_scaled)
        _time(_wrapped.fn)
        assert _time(custom) == [3.0] and own_bench == [1]
        with autotune_ahead.timing_in_full():
            _time(_scaled)
        elsewhere = threading.Thread(target=_time, args=(_scaled,))
        elsewhere.start()
        elsewhere.join()
    brief = ("brief", autotune_ahead.BRIEF_WARMUP_MS, autotune_ahead.BRIEF_REP_MS)
    assert timed == [brief, brief, ("own", None, None), ("own", None, None)]
    assert not isinstance(vars(_scaled).get("do_bench"), autotune_ahead._BriefBench)
    _time(_scaled)
    assert timed[-1] == ("own", None, None)


def test_a_module_loaded_inside_the_context_times_briefly_from_its_first_compile(timed, monkeypatch):
    """An autotuner whose module is imported after the block began gets the brief timing when one of its kernels first
    compiles there (`_Ahead.tuner_of`), and loses it after the block."""
    import sys
    import types

    later = types.ModuleType("raincheck_hf._kernels_loaded_later")
    later.triton = triton
    later.tuned = triton.autotune(configs=CONFIGS, key=["n"])(_plain)
    with autotune_ahead.compiling_configs_ahead(workers=1) as ahead:
        monkeypatch.setitem(sys.modules, later.__name__, later)
        assert ahead.tuner_of(_plain, later.__name__) is later.tuned
        _time(later.tuned)
    assert timed == [("brief", autotune_ahead.BRIEF_WARMUP_MS, autotune_ahead.BRIEF_REP_MS)]
    assert "do_bench" not in vars(later.tuned)
