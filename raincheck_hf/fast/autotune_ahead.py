"""An autotuned Triton kernel's configurations compiled side by side and timed briefly, the first time it is tuned.

Triton's autotuner (`triton.autotune`; fla's Gated DeltaNet kernels, which transformers' Qwen3.5 and the fast path's
prefills run, are autotuned over up to about 30 configurations each) tries a kernel's configurations one after the
other the first time it meets a key: it compiles one, times it, then compiles the next. On an empty Triton cache (a
first start) each compile takes a fraction of a second to seconds, its timed runs about a tenth of a second
(Triton's benchmark). Within `compiling_configs_ahead()`, when such a kernel compiles one of its
configurations, its other configurations are handed at once to a pool of threads, which compile them into Triton's
cache (Triton's compiler leaves Python's interpreter lock for most of its work); when the autotuner reaches each one it
finds it compiled there, or waits for the thread still compiling it. What runs is unchanged: the same kernels, each
configuration timed and the fastest chosen as before; only their compiles overlap. A compile made ahead under a key that
the autotuner's own compile does not reproduce is never used (Triton's cache is keyed by the kernel's source,
specialisation and options): it costs that thread's time and nothing else.

Within the same contexts an autotuner's timed runs are brief (`BRIEF_WARMUP_MS`, `BRIEF_REP_MS`: Triton's
`do_bench` over ~30 ms a configuration instead of its default ~125 ms, most of which, for fla's small kernels, is the
cache flush between runs): still the median of many runs each (the figure is Triton's estimate of a run's time
divided into the 25 ms), so the same choice wherever configurations differ by more than noise, in about a quarter
of the time. Only autotuners with Triton's default
benchmark are timed so (a kernel's own ``do_bench`` is kept); elsewhere, and outside those contexts, they time as
Triton does.

It listens through Triton's ``knobs.runtime.jit_cache_hook`` (called before each compile of a ``triton.jit`` kernel),
installed while a context uses it and chained to a hook set before it; outside those contexts (a context variable, so
another thread's compiles too) it does nothing but call that earlier hook. What it cannot read (another Triton's data,
a configuration with fields it does not know, pruned or modelled autotuning) it leaves to the autotuner's own compiles.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

logger = logging.getLogger(__name__)

_OPTION_FIELDS = ("num_warps", "num_ctas", "num_stages", "maxnreg")
_active: contextvars.ContextVar = contextvars.ContextVar("raincheck_autotune_ahead", default=None)
_install_lock = threading.Lock()
_users = 0
_previous_hook = None
_OFF = object()  # (`switched_off`: this context compiles nothing ahead)
_FULL = contextvars.ContextVar("raincheck_autotune_full_timing", default=False)  # (`timing_in_full`)
BRIEF_WARMUP_MS = 5  # Triton's do_bench: 25 and 100 ms
BRIEF_REP_MS = 25
_briefed: dict[int, tuple] = {}  # id(autotuner) -> (autotuner, its `do_bench` before: (True, value) or (False, None))
_walked: set[str] = set()  # modules already searched for autotuners while installed


def default_workers() -> int:
    """Threads compiling ahead: one per core but the one that runs the autotuner, at most 16."""
    return max(1, min(16, (os.cpu_count() or 2) - 1))


class _Ahead:
    """One context's compiles ahead: its pool, what it handed to the pool, and counts for a summary."""

    def __init__(self, workers: int):
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="raincheck-compile-ahead")
        self.futures: dict[tuple, Future] = {}
        self.groups: set = set()
        self.tuners: dict[str, dict] = {}  # module name -> {JITFunction: its Autotuner}
        self.lock = threading.Lock()
        self.submitted = 0
        self.waited = 0
        self.errors = 0

    # -- which autotuner a kernel belongs to -----------------------------------------------------------------------

    def tuner_of(self, jit, module_name: str):
        import sys

        found = self.tuners.get(module_name)
        if found is None:
            found = {id(jit_fn): tuner for tuner, jit_fn in autotuners_in(sys.modules.get(module_name))}
            self.tuners[module_name] = found
            with _install_lock:  # (a module imported after the context began: its tuners' next tunings are brief)
                for tuner in found.values():
                    _brief_timing_on(tuner)
        return found.get(id(jit))

    # -- the hook's work -------------------------------------------------------------------------------------------

    def on_compile(self, jit, module_name: str, device, data: dict) -> None:
        tuner = self.tuner_of(jit, module_name)
        if tuner is None or len(tuner.configs) < 2 or getattr(tuner, "early_config_prune", None) \
                or getattr(tuner, "perf_model", None):
            return
        paths = {name: [i] for i, name in enumerate(jit.arg_names)}
        constants = _constants(data)
        options = data["options"]
        fields = [config_fields(config, paths) for config in tuner.configs]
        now = [i for i, f in enumerate(fields) if f is not None and _matches(f, constants, options)]
        if not now:
            return  # (not one of its configurations: a direct call, or fields this module cannot read)
        current = now[0]
        group = _group_key(data, constants, fields[current])
        with self.lock:
            waiting = self.futures.get((group, current))
            fresh = group not in self.groups
            # (a configuration the autotuner has chosen already, here or from the tuning an earlier process kept in
            # Triton's cache (an equal `triton.Config`, not the same object): its run, not a tuning)
            chosen = getattr(tuner, "best_config", None)
            if fresh and not (chosen is not None and type(chosen) is type(tuner.configs[current])
                              and chosen == tuner.configs[current]):
                self.groups.add(group)
                for i, f in enumerate(fields):
                    if i != current and f is not None and (group, i) not in self.futures:
                        sibling = _with_fields(data, f)
                        self.futures[(group, i)] = self.pool.submit(self._compile, jit, device, sibling)
                        self.submitted += 1
        if waiting is not None and not waiting.done():  # (compiling on the pool: wait rather than compile it twice)
            self.waited += 1
            try:
                waiting.result()
            except Exception:
                pass

    def _compile(self, jit, device, data: dict) -> None:
        """Compile one configuration as `JITFunction.preload` rebuilds a specialisation, into Triton's cache only (the
        kernel's own table of compiled kernels is left to the autotuner's run)."""
        import triton.language as tl
        from triton.compiler import ASTSource, compile as triton_compile

        try:
            constexprs = {
                tuple(key): (tl.dtype(value) if tl.dtype.is_dtype(value) else
                             tl.constexpr(value["constexpr"]) if isinstance(value, dict) and "constexpr" in value
                             else value)
                for key, value in zip(data["constant_keys"], data["constant_vals"])}
            attrs = dict(zip(map(tuple, data["attrs_keys"]), data["attrs_vals"]))
            signature = {k: _tuples(v) for k, v in data["signature"].items()}
            options = {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()}
            _, _, target, backend, _ = jit.device_caches[device]  # (as the kernel's own run reads them)
            options = backend.parse_options(options)
            triton_compile(ASTSource(jit, signature, constexprs, attrs), target=target, options=options.__dict__)
        except Exception as error:  # (the autotuner compiles it itself)
            with self.lock:
                self.errors += 1
            logger.debug("compiling a configuration ahead failed: %s: %s", type(error).__name__, error)
            raise

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def autotuners_in(module) -> list:
    """``(autotuner, its kernel)`` for each autotuned Triton kernel a module names, also under other wrappers
    (fla's kernels are `triton.heuristics` over `triton.autotune` over `triton.jit`)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction, KernelInterface

    found = []
    for value in list(vars(module).values()) if module is not None else ():
        if not isinstance(value, KernelInterface):  # (only Triton's own objects: a lazy module's names import)
            continue
        tuner, inner, depth = None, value, 0
        while isinstance(inner, KernelInterface) and not isinstance(inner, JITFunction) and depth < 8:
            if isinstance(inner, Autotuner) and tuner is None:
                tuner = inner
            inner, depth = inner.fn, depth + 1
        if tuner is not None and isinstance(inner, JITFunction):
            found.append((tuner, inner))
    return found


def config_fields(config, paths: dict) -> dict | None:
    """A `triton.Config`'s fields as ``{"constants": {path: value}, "options": {name: value}}``, or None where it has
    one this module cannot place (a keyword that is no parameter of the kernel, an IR override, a pre-hook)."""
    if getattr(config, "ir_override", None) is not None or getattr(config, "pre_hook", None) is not None:
        return None
    constants = {}
    for name, value in config.kwargs.items():
        if name not in paths or not isinstance(value, (int, float, str, bool)):
            return None
        constants[json.dumps(paths[name])] = value
    options = {name: getattr(config, name) for name in _OPTION_FIELDS if getattr(config, name, None) is not None}
    return {"constants": constants, "options": options}


def _plain(value):
    return value["constexpr"] if isinstance(value, dict) and "constexpr" in value else value


def _matches(fields: dict, constants: dict, options: dict) -> bool:
    return (all(path in constants and _plain(constants[path]) == value for path, value in fields["constants"].items())
            and all(name in options and options[name] == value for name, value in fields["options"].items()))


def _constants(data: dict) -> dict:
    """A serialised specialisation's constants keyed by their parameter path as JSON text (``"[3]"``)."""
    return {json.dumps(k): v for k, v in zip(data["constant_keys"], data["constant_vals"])}


def _group_key(data: dict, constants: dict, fields: dict) -> str:
    """The compile's specialisation without the configuration's own fields: the same for each configuration tried
    under one tuning."""
    constants = {path: v for path, v in constants.items() if path not in fields["constants"]}
    options = {k: v for k, v in data["options"].items() if k not in fields["options"]}
    return json.dumps([data.get("name"), data["signature"], constants, data["attrs_keys"], data["attrs_vals"], options],
                      sort_keys=True, default=str)


def _with_fields(data: dict, fields: dict) -> dict:
    """``data`` (a specialisation, as Triton serialises it) with another configuration's fields."""
    sibling = dict(data)
    sibling["constant_vals"] = [fields["constants"].get(path, value) for path, value in _constants(data).items()]
    sibling["options"] = {**data["options"], **fields["options"]}
    return sibling


def _tuples(value):
    """Lists (JSON's tuples) as tuples, nested too: Triton's ``convert_to_tuple_if_list`` without its writes into the
    list it is given (the signature is shared by the configurations' threads)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
    """Triton's ``jit_cache_hook``: the hook set before this one first (its answer kept: True skips the compile), then,
    in a context that compiles ahead, this compile's sibling configurations handed to the pool."""
    previous = _previous_hook
    skip = previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                    already_compiled=already_compiled) if previous is not None else None
    ahead = _active.get()
    if ahead is not None and ahead is not _OFF and not skip:
        try:
            ahead.on_compile(fn.jit_function, fn.module if isinstance(fn.module, str) else fn.module.__name__,
                             compile["device"], json.loads(compile["specialization_data"]))
        except Exception as error:  # (never in the way of the compile itself)
            ahead.errors += 1
            logger.debug("compiling ahead skipped: %s: %s", type(error).__name__, error)
    return skip


class _BriefBench:
    """An autotuner's ``do_bench`` while installed: brief timed runs for a tuning in a context that compiles ahead,
    the autotuner's own benchmark everywhere else."""

    def __init__(self, previous):
        self.previous = previous  # the autotuner's attribute before: (True, its value) or (False, None)

    def own(self):
        had, value = self.previous
        if had:
            return value
        from triton.runtime import driver

        return driver.active.get_benchmarker()  # (what Triton's autotuner uses when it is given no do_bench)

    def __call__(self, kernel_call, quantiles=None, **kwargs):
        ahead = _active.get()
        if ahead is None or ahead is _OFF or _FULL.get():
            return self.own()(kernel_call, quantiles=quantiles, **kwargs)
        from triton.testing import do_bench

        return do_bench(kernel_call, warmup=BRIEF_WARMUP_MS, rep=BRIEF_REP_MS, quantiles=quantiles)


def _benchmark_attribute(tuner):
    for klass in type(tuner).__mro__:
        if "do_bench" in vars(klass):
            return vars(klass)["do_bench"]
    return None


def _brief_timing_on(tuner) -> bool:
    """Give ``tuner`` (a Triton `Autotuner`) the brief benchmark while installed, where it times with Triton's
    default one (no ``do_bench`` of its own) and reads it through a cached attribute (as Triton's `Autotuner` does;
    otherwise it is left as it is). Under `_install_lock`."""
    if id(tuner) in _briefed:
        return True
    if getattr(tuner, "_do_bench", None) is not None or not isinstance(_benchmark_attribute(tuner),
                                                                      functools.cached_property):
        return False
    own = vars(tuner)
    previous = (True, own["do_bench"]) if "do_bench" in own else (False, None)
    own["do_bench"] = _BriefBench(previous)
    _briefed[id(tuner)] = (tuner, previous)
    return True


def _brief_timing_in_loaded_modules() -> None:
    """`_brief_timing_on` for the autotuners of the modules loaded now that use Triton (fla's are imported with the
    model; one imported later gets it when its kernel first compiles, `_Ahead.tuner_of`). Under `_install_lock`."""
    import sys

    try:
        import triton
        import triton.language as language
    except ImportError:
        return
    for name, module in list(sys.modules.items()):
        if name in _walked or module is None:
            continue
        _walked.add(name)
        names = vars(module).values() if isinstance(getattr(module, "__dict__", None), dict) else ()
        if not any(value is triton or value is language for value in list(names)):
            continue  # (only modules that import Triton: no other module's objects are looked at)
        for tuner, _ in autotuners_in(module):
            _brief_timing_on(tuner)


def _restore_timing() -> None:
    for tuner, (had, value) in _briefed.values():
        if had:
            vars(tuner)["do_bench"] = value
        else:
            vars(tuner).pop("do_bench", None)
    _briefed.clear()
    _walked.clear()


def _install() -> bool:
    global _users, _previous_hook
    try:
        from triton import knobs
    except ImportError:  # (no Triton, or one without knobs: nothing to overlap)
        return False
    if not hasattr(knobs.runtime, "jit_cache_hook"):
        return False
    with _install_lock:
        if _users == 0:
            current = knobs.runtime.jit_cache_hook
            _previous_hook = None if current is _hook else current
            knobs.runtime.jit_cache_hook = _hook
        _users += 1
        _brief_timing_in_loaded_modules()
    return True


def _uninstall() -> None:
    global _users, _previous_hook
    from triton import knobs

    with _install_lock:
        _users -= 1
        if _users == 0:
            if knobs.runtime.jit_cache_hook is _hook:
                knobs.runtime.jit_cache_hook = _previous_hook
            _previous_hook = None
            _restore_timing()


@contextlib.contextmanager
def compiling_configs_ahead(enabled: bool = True, workers: int | None = None):
    """Within this block (this thread's context only), an autotuned Triton kernel's configurations are compiled side by
    side the first time it is tuned, and timed briefly (see the module docstring). Yields the context's record
    (``submitted``: compiles handed to the pool; ``waited``: configurations the autotuner reached while still
    compiling; ``errors``), or None where it is off (``enabled`` False, no Triton, or already on in this context). On
    leaving, outstanding compiles are finished or cancelled."""
    if not enabled or _active.get() is not None or not _install():
        yield None
        return
    ahead = _Ahead(workers or default_workers())
    token = _active.set(ahead)
    try:
        yield ahead
    finally:
        _active.reset(token)
        try:
            ahead.close()
        finally:
            _uninstall()


@contextlib.contextmanager
def timing_in_full():
    """Within this block (this context only), autotuners time with their own benchmark, not briefly, while
    configurations are still compiled ahead (for comparisons; `bench cold-start --compile-ahead full-timing`)."""
    token = _FULL.set(True)
    try:
        yield
    finally:
        _FULL.reset(token)


@contextlib.contextmanager
def switched_off():
    """Within this block (this context only), `compiling_configs_ahead` compiles nothing ahead: the autotuner compiles
    each configuration itself, as without this module (for comparisons; `bench cold-start --compile-ahead off`)."""
    token = _active.set(_OFF)
    try:
        yield
    finally:
        _active.reset(token)
