"""The engine interface: the decoding loop talks to a `Runner` only, and the scheduler decides the rows it runs."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

import raincheck_hf.generation as generation
from raincheck_hf import RaincheckConfig
from raincheck_hf.cache_utils import DEFERRED, INPUT
from raincheck_hf.configuration import CHUNK_LADDER
from raincheck_hf.fast.graphs import StepFigures
from raincheck_hf.fast.runner import StaticRunner
from raincheck_hf.models import get_adapter
from raincheck_hf.runner import EagerRunner, Runner, runner_for
from raincheck_hf.tiny import draw_test_image

from conftest import make_inputs, no_placeholder_ids

N = 8


class RecordingRunner:
    """A runner double: the protocol and nothing else, each call recorded and passed on to a real runner."""

    def __init__(self, inner):
        self._inner = inner
        self.adapter, self.cache = inner.adapter, inner.cache
        self.calls = []

    def _record(self, name, *args, **kwargs):
        self.calls.append((name, args))
        return getattr(self._inner, name)(*args, **kwargs)

    def begin_call(self, config):
        return self._record("begin_call", config)

    def reserve(self, rows, chunk_size):
        return self._record("reserve", rows, chunk_size)

    def prepare(self, rows):
        return self._record("prepare", rows)

    def run(self, rows, prepared=None):
        return self._record("run", rows, prepared)

    def run_ahead(self, rows, sources):
        return self._record("run_ahead", rows, sources)

    def step_figures(self, rows, want_logits, real_rows=None, pending_after=1):
        return self._record("step_figures", rows, want_logits, real_rows, pending_after)

    def capture_watch(self):
        return self._record("capture_watch")

    def named(self, name):
        return [args for n, args in self.calls if n == name]


def _generate(model, processor, **cfg):
    inputs = make_inputs(processor, images=[draw_test_image(256, 256, seed=s) for s in (4, 5)], text="Describe it.")
    return model.generate(**inputs, max_new_tokens=N, do_sample=False, return_dict_in_generate=True,
                          output_logits=True, suppress_tokens=no_placeholder_ids(model),
                          raincheck=RaincheckConfig(retention=0.2, decode_guard=2, **cfg))


def test_generation_has_no_attribute_probing_or_fast_path_imports():
    """generation.py neither probes a cache for its engine (``is_static``, ``graphs``, getattr) nor names the fast
    path's classes, and imports nothing from fast/ inside a function: the engine is the runner's business."""
    tree = ast.parse(inspect.getsource(generation))
    banned = {"is_static", "graphs", "step_graphs", "StaticDeferredCache", "StepGraphs", "StaticRunner", "getattr"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            assert node.attr not in banned, f"line {node.lineno}: .{node.attr}"
        elif isinstance(node, ast.Name):
            assert node.id not in banned, f"line {node.lineno}: {node.id}"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            assert node.value not in banned, f"line {node.lineno}: {node.value!r}"
    for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for node in ast.walk(function):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                assert not (module == "fast" or module.startswith(("fast.", "raincheck_hf.fast"))), \
                    f"{function.name} imports {module} (line {node.lineno})"


@pytest.mark.parametrize("fast_path", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("chunk_size", [4, "auto"])
def test_the_loop_drives_a_runner_double_through_the_protocol(model, processor, monkeypatch, fast_path, chunk_size):
    """A runner double with only the protocol's methods runs a whole answer: the same tokens and logits as the real
    runner alone; one forward per `run`, the prefill first; every decode step prepared ahead; the scheduler's chunk
    rows (padded to the trace's chunk size) are what the runner ran; ``"auto"`` asks the runner for figures."""
    want = _generate(model, processor, chunk_size=chunk_size, fast_path=fast_path)
    made, real_open = [], generation.open_runner

    def open_recording(*args, **kwargs):
        made.append(RecordingRunner(real_open(*args, **kwargs)))
        return made[-1]

    monkeypatch.setattr(generation, "open_runner", open_recording)
    got = _generate(model, processor, chunk_size=chunk_size, fast_path=fast_path)
    (runner,) = made
    assert isinstance(runner._inner, StaticRunner if fast_path else EagerRunner)
    assert got.cache is runner.cache
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))

    trace = got.raincheck
    # the prefill first, by `run_ahead` (its sources asked for by the runner: the plan is made after the launch)
    (ahead,), runs = runner.named("run_ahead"), runner.named("run")
    assert [name for name, _ in runner.calls if name in ("run", "run_ahead")][0] == "run_ahead"
    assert 1 + len(runs) == len(trace.restored_per_forward) == N  # the last token is generated, never fed back
    prefill, sources = ahead
    assert bool((prefill.kinds == INPUT).any()) and prefill.want_logits and prefill.pad_to is None
    assert callable(sources)
    runs = [ahead] + runs
    assert len(runner.named("prepare")) == N  # every decode step made ready before the stopping check
    for i, (rows, _) in enumerate(runs[1:], start=1):
        assert torch.equal(rows.sources[rows.kinds == DEFERRED], trace.restored_per_forward[i])
        assert rows.pad_to == (trace.chunk_size_per_forward[i] or None)
        assert rows.want_logits
    assert trace.restored_during_decode > 0
    assert len(runner.named("capture_watch")) == 1
    assert bool(runner.named("step_figures")) == (chunk_size == "auto")


class FiguresRunner:
    """A runner that only answers `step_figures`, from a table: ``(rows, want_logits) -> StepFigures``."""

    def __init__(self, table):
        self.table, self.asked = table, []

    def step_figures(self, rows, want_logits, real_rows=None, pending_after=1):
        self.asked.append((rows, want_logits, real_rows, pending_after))
        return self.table.get((rows, want_logits))


class Pending:
    def __init__(self, n):
        self.num_pending = n


@pytest.mark.parametrize("mode", ["raincheck", "serial"])
def test_the_scheduler_weighs_the_runner_figures(mode):
    """`ChunkScheduler.step_costs` comes from the runner's answers alone: a size the runner has no figures for is no
    candidate, ``serial`` adds the token's own step to a chunk's, capture state passes through; no runner (the
    batched engine's schedulers) or no measured decode step: None."""
    fused = mode != "serial"
    small, large = min(CHUNK_LADDER), max(CHUNK_LADDER)
    table = {(1, True): StepFigures(0.010, True, 0.5),
             (small + fused, fused): StepFigures(0.011, True, 0.5),
             (large + fused, fused): StepFigures(None, False, 2.0)}
    runner = FiguresRunner(table)
    config = RaincheckConfig(chunk_size="auto", mode=mode)
    costs = generation.ChunkScheduler(config, runner).step_costs(None, Pending(20))
    assert costs.decode == 0.010
    assert costs.chunk == {small: 0.011 + (0.0 if fused else 0.010), large: None}
    assert costs.captured == frozenset({small}) and costs.capture == {small: 0.5, large: 2.0}
    assert runner.asked[0] == (1, True, None, 20)
    assert (large + fused, fused, 20 + fused, 0) in runner.asked  # a short last chunk: 20 real rows, none after
    assert generation.ChunkScheduler(config).step_costs(None, Pending(20)) is None
    assert generation.ChunkScheduler(config, FiguresRunner({})).step_costs(None, Pending(20)) is None


def test_a_scheduler_without_a_runner_asks_the_cache_runner(model, processor, monkeypatch):
    """`ChunkScheduler(config)` (no runner given) weighs the figures of the runner of the cache it is asked about:
    a static cache's runner's (stand-in figures here: a CPU times nothing), none on the eager engine; an object
    that is no cache (a batched sequence's rows) gets None, and `runner_for` refuses it."""
    adapter = get_adapter(model)
    config = RaincheckConfig(chunk_size="auto", decode_guard=2)
    static = _generate(model, processor, chunk_size=4, fast_path=True).cache
    eager = _generate(model, processor, chunk_size=4, fast_path=False).cache
    assert static.num_pending > 0 and eager.num_pending > 0
    assert generation.ChunkScheduler(config).step_costs(adapter, static) is None  # no CUDA graphs: nothing timed
    small = min(CHUNK_LADDER)
    figures = FiguresRunner({(1, True): StepFigures(0.010, True, 0.5), (small + 1, True): StepFigures(0.012, True, 0.5)})
    monkeypatch.setattr(StaticRunner, "step_figures", lambda self, *args, **kw: figures.step_figures(*args, **kw))
    costs = generation.ChunkScheduler(config).step_costs(adapter, static)
    assert costs.decode == 0.010 and costs.chunk == {small: 0.012} and costs.captured == frozenset({small})
    assert generation.ChunkScheduler(config).step_costs(adapter, eager) is None
    assert generation.ChunkScheduler(config).step_costs(adapter, Pending(3)) is None
    with pytest.raises(TypeError, match="no Raincheck runner for a Pending"):
        runner_for(adapter, Pending(3))


def test_runner_for_picks_the_engine_of_a_cache(model, processor):
    """An existing cache gets the runner of its kind; both satisfy the protocol, and the eager one answers
    neutrally (nothing prepared, no figures, no captures)."""
    adapter = get_adapter(model)
    eager = runner_for(adapter, _generate(model, processor, chunk_size=4, fast_path=False).cache)
    static = runner_for(adapter, _generate(model, processor, chunk_size=4, fast_path=True).cache)
    assert type(eager) is EagerRunner and type(static) is StaticRunner
    assert isinstance(eager, Runner) and isinstance(static, Runner)
    assert eager.step_figures(1, True) is None and eager.capture_watch().new(3) == []
    assert static.capture_watch().new(3) == []  # no CUDA graphs on a CPU
