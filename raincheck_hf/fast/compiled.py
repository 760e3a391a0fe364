"""`RaincheckConfig.compile_steps`: the fast path's steps with their element-wise work fused by `torch.compile`.

A decode step of the stock modules launches dozens of small kernels per decoder layer (RMSNorm alone is
about six: the cast, square, mean, rsqrt, two products), each reading and writing a few KiB. With
``compile_steps`` the step runs compiled code for what `ModelAdapter.compile_targets` names: by default
the modules that are pure per-row functions of their input (the RMSNorms, the dense SwiGLU MLP), each
module class's own ``forward`` compiled; Qwen3-VL's adapter names whole decoder layers, run as two
compiled regions around the cache write and the attention (`models.qwen3_vl.fused_decoder_layer`); and
the few-query attention's softmax part. Inductor fuses each region into a few kernels (the matrix
products stay the library's). One compiled function per region, shared by all layers (the weights are
inputs: the 36 layers of an 8B model compile once, not 36 times), with dynamic row and slot counts: each
function's row dimensions are marked unbacked (`torch._dynamo.decorators.mark_unbacked`), so that one graph
serves a single row and many alike (a size Dynamo sees as 1 would otherwise be specialised, and the first
several-row call would trace the function a second time: two traces, seconds each, in every fresh
process's warm-up), its slot dimensions dynamic, and every other dimension static (a trace over a few
symbols instead of one per dimension: shorter); the step graph is then captured around those kernels as usual.

Like the few-query attention (`fast.scoping`), the compiled forms act only inside a fast-path step of the
calling thread whose scope asks for them; every other caller of the same modules gets their stock
``forward``. The compile happens in the first capture's warm-up; a captured graph replays without any Python.

A fresh process's first compile also imports torch's compiler (Inductor and what it loads: some 700 modules,
a second or more before the first trace begins). `preload_compiler` imports it on a thread of its own, so that it
may overlap what a program does before its first compile (loading the model); the first compiled function made
waits for it (`compiled`), so the compile never runs beside those imports. Nothing calls it by default:
on a 2-core CPU, loading a 3 B-parameter checkpoint with ``from_pretrained`` beside it took longer than the
imports it hid (the interpreter's lock; the first compile 1.11x later, `benchmarks/preload_compiler.py`), and on
a GPU it is not measured yet (``bench cold-start --preload-compiler both`` runs it side by side).

The setting's default (None) compiles exactly when the steps are captured as CUDA graphs
(`resolve_compile_steps`): there the compile, paid once per process and model class, took `full`'s time per
token for Qwen3-VL-8B on an H200 from 10.16 to 7.01 ms. Without graphs (CPU, the eager engine, a failed
capture) no gain was measured to pay the compile for, so it stays off there unless asked for.
"""

from __future__ import annotations

import threading
import types
import warnings

import torch

from ..patching import install_forward

_LOCK = threading.Lock()
_COMPILED: dict = {}  # module class (or function) -> its `_CompiledOrPlain`, made on first use
# what a first compile imports (the rest comes with these); a failure here is left to that compile to raise
COMPILER_MODULES = ("torch._inductor.compile_fx", "torch._inductor.codecache", "torch._inductor.async_compile",
                    "torch._inductor.runtime.triton_heuristics")
_PRELOAD: dict = {}  # "thread" -> the process's preloading thread, "done_at" -> when it ended (time.time())


def preload_compiler() -> threading.Thread:
    """Import torch's compiler (`COMPILER_MODULES`) on a daemon thread and return it (the same thread on later
    calls: once per process). Call it before loading the model, after `persist.enable_persistent_caches` (whose
    environment variables the compiler reads); the first compiled function waits for it. Nothing else changes: the
    modules are those the first compile would import on the calling thread. Opt-in (see the module docstring:
    not shown to shorten a start yet)."""
    import time

    def load():
        try:
            _import_compiler()
        except Exception:  # (the first compile imports them again and reports what failed)
            pass
        finally:
            _PRELOAD["done_at"] = time.time()

    with _LOCK:
        thread = _PRELOAD.get("thread")
        if thread is None:
            thread = _PRELOAD["thread"] = threading.Thread(target=load, name="raincheck-preload-compiler",
                                                           daemon=True)
            thread.start()
        return thread


def preload_finished_at() -> float | None:
    """When `preload_compiler`'s imports ended (`time.time`), or None (not started, or still running)."""
    return _PRELOAD.get("done_at")


def _import_compiler() -> None:
    import importlib

    for name in COMPILER_MODULES:
        importlib.import_module(name)


def _wait_for_preload() -> None:
    """The preloading thread's end, if one was started (imports of one module from two threads wait for each other
    anyway; the compile itself should not run beside the rest of them)."""
    thread = _PRELOAD.get("thread")
    if thread is not None and thread is not threading.current_thread():
        thread.join()


class _CompiledOrPlain:
    """``fn`` compiled, or ``fn`` itself once compiling it failed (no C++ compiler or Triton on this machine,
    an op Inductor cannot lower, ...): a warning, then the stock computation for the rest of the process, so
    ``compile_steps=True`` never breaks an answer that the uncompiled step would give."""

    def __init__(self, fn, rows: dict | None = None, sizes: dict | None = None):
        self.fn = fn
        self.rows = dict(rows or {})  # positional argument -> its row dimensions (`mark_rows`)
        self.sizes = dict(sizes or {})  # positional argument -> its other varying dimensions (`mark_sizes`)
        # With the varying dimensions named, they are the only dynamic ones and every other (widths, head counts, a
        # storage's strides) is traced as the number it is: Dynamo then reasons over and guards a few symbols, not one
        # per dimension of every input, and traces a region in a fraction of the time (a fresh process pays each trace
        # again, its compiled kernels loaded from the cache: `raincheck_hf.persist`). A dimension first seen at
        # another value (another model's widths in the same process) takes one more graph, dynamic in it from then on.
        # Without a list, every dimension is dynamic, as a function whose callers vary anything needs.
        self.compiled = torch.compile(fn, dynamic=None if (self.rows or self.sizes) else True)
        self.error: BaseException | None = None

    def __call__(self, *args, **kwargs):
        if self.error is None:
            if self.rows or self.sizes:
                args = list(args)
                for at, dims in self.rows.items():
                    args[at] = dense(args[at])
                    mark_rows(args[at], dims)
                for at, dims in self.sizes.items():
                    if at not in self.rows:
                        args[at] = dense(args[at])
                    mark_sizes(args[at], dims)
            try:
                return self.compiled(*args, **kwargs)
            except _compile_errors() as error:
                self.error = error
                warnings.warn(f"raincheck compile_steps: torch.compile of {getattr(self.fn, '__qualname__', self.fn)} "
                              f"failed ({type(error).__name__}: {str(error)[:200]}); running it uncompiled.",
                              RuntimeWarning, stacklevel=2)
        return self.fn(*args, **kwargs)


def resolve_compile_steps(setting: bool | None, graphs_in_use: bool) -> bool:
    """Whether a call's fast-path steps run compiled: ``setting`` (`RaincheckConfig.compile_steps`) when
    given, else (None, the default) whether its steps are captured as CUDA graphs (``graphs_in_use``:
    `StepGraphs.use_graphs` of the cache's graphs)."""
    return bool(graphs_in_use) if setting is None else bool(setting)


def _compile_errors() -> tuple:
    from torch._dynamo.exc import TorchDynamoException

    errors = [TorchDynamoException]
    try:
        from torch._inductor.exc import InductorError
    except ImportError:
        pass
    else:
        errors.append(InductorError)
    return tuple(errors)


def mark_rows(tensor, dims) -> None:
    """Mark ``tensor``'s dimensions ``dims`` (its row counts: a step's one row, a chunk's 32, a prompt's
    hundreds) unbacked for the compile: Dynamo then traces them as sizes it knows nothing about, neither 1 nor
    any other, and one graph serves every row count. A marked size that is 1 stays generic too (a backed one
    would be specialised, and the first call with several rows would trace the function again). Where this
    torch has no such mark (or ``tensor`` is not a tensor), nothing is marked: the function then takes a graph
    for one row and one for several, as before."""
    mark = getattr(torch._dynamo.decorators, "mark_unbacked", None)
    if mark is None or not isinstance(tensor, torch.Tensor):
        return
    for dim in dims:
        mark(tensor, dim)


def mark_sizes(tensor, dims) -> None:
    """Mark ``tensor``'s dimensions ``dims`` dynamic for the compile (sizes that vary but are never 0 or 1: a step's
    slot bucket), so that the first call traces them as symbols and one graph serves every value. Where this torch
    has no such mark (or ``tensor`` is not a tensor), nothing is marked: a second value then takes a second graph,
    dynamic in that dimension."""
    mark = getattr(torch._dynamo, "maybe_mark_dynamic", None)
    if mark is None or not isinstance(tensor, torch.Tensor):
        return
    for dim in dims:
        mark(tensor, dim)


def dense(tensor):
    """``tensor``'s elements as a tensor that is no view, with a contiguous tensor's strides where it is contiguous
    (a dimension of size 1 may carry any stride: a decode step's one query row, transposed out of ``[B, heads, 1,
    head_dim]``, has the head dimension's, which addresses nothing, yet Dynamo guards on it; with row counts
    unbacked, `mark_rows`, such a stride would take a graph of its own). Anything not a tensor is returned as it
    is."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    if tensor.is_contiguous():
        strides, step = [], 1
        for size in reversed(tensor.shape):
            strides.append(step)
            step *= max(int(size), 1)
        strides = tuple(reversed(strides))
        if tensor.stride() != strides:
            tensor = tensor.as_strided(tensor.shape, strides)
    # not a view for Dynamo (which guards on a view's base: the buffer or the projection it was cut from, whose
    # row count would take a graph per size 1 / several again); the compiled forms never write their inputs
    return tensor.detach()


def compiled(fn, rows: dict | None = None, sizes: dict | None = None):
    """The `torch.compile`d form of ``fn`` (a module class's ``forward``, or a function), made once; ``fn``
    itself after a failed compile (`_CompiledOrPlain`). ``rows``: positional argument -> the dimensions of that
    tensor that count rows (`mark_rows`, each call); ``sizes``: positional argument -> its other dimensions that vary
    between calls (`mark_sizes`); both the same at every call of ``fn``. With either given, the dimensions they name
    are the only dynamic ones; with neither, every dimension is."""
    out = _COMPILED.get(fn)  # (made already: the call of every layer of every step needs no lock and no wait)
    if out is not None:
        return out
    _wait_for_preload()  # (outside the lock: other functions' lookups need not wait for it)
    with _LOCK:
        out = _COMPILED.get(fn)
        if out is None:
            out = _COMPILED[fn] = _CompiledOrPlain(fn, rows, sizes)
        return out


def compiled_copy(fn, key, rows: dict | None = None, sizes: dict | None = None):
    """`compiled` of a copy of ``fn`` made for ``key`` (its own code object: its own Dynamo graphs, recompile limit
    and failure), for callers whose static dimensions differ by ``key`` (another model's head counts in the same
    process). Within a copy those dimensions never change, so none of them turns dynamic on a second value (Dynamo's
    automatic dynamic shapes), which a function whose compile needs them static (the few-query attention's core) could
    not take."""
    with _LOCK:
        copies = _COPIES.setdefault(fn, {})
        copy = copies.get(key)
        if copy is None:
            copy = copies[key] = _copy(fn, key)
    return compiled(copy, rows, sizes)


_COPIES: dict = {}  # function -> {key: its copy} (`compiled_copy`)


class RowWise:
    """The compiled form of a module whose ``forward(x)`` is a function of each row of ``x [..., D]`` alone (an
    RMSNorm, a dense MLP), run on ``x`` viewed as rows ``[N, D]``, one compiled copy of the function per row width
    and row stride. Dynamo keeps its graphs per code object and stops compiling a function after
    ``recompile_limit`` (8) of them: the class's ``forward`` compiled as called took one graph per rank, per
    leading dimension of size 1 or more, per width (Qwen3.5's layer norms and its query / key norms share a class)
    and per stride (the query half of a projection), past the limit in a batched benchmark, and every shape after
    that ran uncompiled. Viewed as rows, each copy sees one width and stride and takes one graph per dtype (its row
    count unbacked and its rows passed as no view, `mark_rows` / `dense`; a single row, whose stride is any, shares
    the contiguous rows' copy), far below the limit. The view is free where the rows' strides
    allow it (a contiguous tensor, the query half of a projection); otherwise ``reshape`` copies, as the stock
    ``forward`` would not."""

    def __init__(self, fn):
        self.fn = fn
        self.copies: dict = {}  # (row width, row stride) -> a copy of ``fn`` with its own code object

    def __call__(self, module, *args, **kwargs) -> torch.Tensor:
        if kwargs or len(args) != 1:  # (not the one-input call this form is for: the function as it is, compiled)
            return compiled(self.fn)(module, *args, **kwargs)
        (x,) = args
        rows = dense(x.reshape(-1, x.shape[-1]))  # (a single row then shares the contiguous rows' copy)
        key = (rows.shape[-1], rows.stride(0))
        fn = self.copies.get(key)
        if fn is None:
            with _LOCK:
                fn = self.copies.setdefault(key, _copy(self.fn, key))
        y = compiled(fn, ROWS_FIRST)(module, rows)
        return y.reshape(*x.shape[:-1], y.shape[-1])


ROWS_FIRST = {1: (0,)}  # `RowWise`'s copies: the rows ``[N, D]`` (argument 1) count rows in their first dimension


def _copy(fn, key=()):
    """``fn`` with a code object of its own (the same code), named for ``key``: Dynamo's graphs and limit are per code
    object, and what it learns of a function's shapes (which dimensions turned dynamic, also kept on disk for the next
    process) per file, line and code name, so each copy's code carries a name of its own."""
    tag = "_".join(str(part) for part in (key if isinstance(key, tuple) else (key,))).replace("-", "m")
    code = fn.__code__
    if tag:
        names = {"co_name": f"{code.co_name}__{tag}"}
        if hasattr(code, "co_qualname"):
            names["co_qualname"] = f"{code.co_qualname}__{tag}"
        code = code.replace(**names)
    else:
        code = code.replace()
    out = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__qualname__ = fn.__qualname__
    out.__dict__.update(fn.__dict__)
    return out


def rowwise(fn) -> RowWise:
    """The `RowWise` form of ``fn`` (a module class's ``forward``), made once."""
    with _LOCK:
        key = ("rowwise", fn)
        out = _COMPILED.get(key)
        if out is None:
            out = _COMPILED[key] = RowWise(fn)
        return out


def dispatcher(impl=None):
    """The install function (`patching.CountedPatches`) that makes a module run ``impl(module, *args, **kwargs)``
    (None: its class's compiled ``forward``) inside a compiling step of the calling thread and its own
    ``forward`` everywhere else."""
    return lambda module: install_dispatch(module, impl)


def install_dispatch(module, impl=None):
    """See `dispatcher`; returns the undo callable."""
    from .context import active_scope

    def acts() -> bool:
        scope = active_scope()
        return scope is not None and scope.compiled

    return install_forward(module, acts, compiled(type(module).forward) if impl is None else impl)
