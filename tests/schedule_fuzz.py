"""Seeded schedule fuzz (issue 28): many conversations on one model, each on the engine under test against the
eager engine (`fast_path=False`), which is the reference for the fast path.

A case is a family, a `RaincheckConfig` (mode, retention, chunk size including ``"auto"``, guard, selector,
restoration order) and
two or three turns (an image, two images or a video at 0.5 / 1 / 2 fps first; sometimes new media later; answer
lengths from 1 to 20 tokens), and before each follow-up one of: the leftovers merged into its prefill,
`Conversation.complete`, ``k`` idle-time chunks (`restore_pending`), or the previous answer streamed and cancelled
at a fixed token. ``"auto"`` picks chunk sizes from measured step costs, which the eager engine does not have: the
eager run then replays the chunk sizes the run under test chose (its trace's ``chunk_size_per_forward``), so the
two compute the same thing.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList

from raincheck_hf import Conversation, RaincheckConfig, restore_pending
from raincheck_hf.generation import ChunkScheduler
from raincheck_hf.tiny import draw_test_image, draw_test_video

from test_conversation import _Gate  # holds an answer at a fixed token until it is cancelled

MODES = ["raincheck", "serial", "post_answer", "hard", "full"]
SELECTORS = ["mmtok", "fastv", "visionzip", "divprune", "cdpruner", "random", "uniform"]
QUESTIONS = ["What is in this image?", "And the corner?", "Which colour is most common?", "Anything else?"]
BEFORE = ["merge", "complete", "idle", "cancel"]
RESTORE_ORDERS = ["source", "relevance", "attention"]


@dataclass
class Turn:
    text: str
    images: list = field(default_factory=list)
    videos: list = field(default_factory=list)
    fps: float = 2.0
    tokens: int = 8
    before: str | None = None  # what happens before this follow-up (None: the first turn)
    idle_chunks: int = 1
    cancel_at: int = 0  # this answer is streamed and cancelled at this token (0: it runs to its end)


@dataclass
class Case:
    seed: int
    family: str
    config: dict
    turns: list[Turn]

    def __repr__(self):
        return f"Case(seed={self.seed}, family={self.family}, config={self.config}, turns={self.turns})"


def make_case(seed: int, family: str, videos: bool = True) -> Case:
    rng = random.Random(seed)
    config = dict(mode=rng.choice(MODES), retention=rng.choice([0.0, 0.15, 0.3, 0.5, 1.0]),
                  chunk_size=rng.choice([1, 2, 5, 31, "auto"]), decode_guard=rng.choice([0, 1, 3, 16]),
                  selector=rng.choice(SELECTORS))
    # drawn from a stream of its own, so that the rest of a seed's case stays what it was before this setting
    config["restore_order"] = random.Random(f"restore_order-{seed}").choice(RESTORE_ORDERS)
    if config["chunk_size"] != "auto":  # (the same: a stream of its own)
        config["chunk_every"] = random.Random(f"chunk_every-{seed}").choice([1, 1, 2, 3])

    def media():
        kind = rng.choice(["image", "two_images", "video"] if videos else ["image", "two_images"])
        if kind == "video":
            return dict(videos=[draw_test_video(rng.choice([2, 4, 6]), 64, rng.choice([64, 96]), seed=rng.randrange(99))],
                        fps=rng.choice([0.5, 1.0, 2.0]))
        count = 1 if kind == "image" else 2
        return dict(images=[draw_test_image(rng.choice([64, 96, 128]), rng.choice([64, 96, 160]), seed=rng.randrange(99))
                            for _ in range(count)])

    turns = [Turn(QUESTIONS[0], tokens=rng.choice([1, 3, 8, 20]), **media())]
    for i in range(rng.choice([1, 2])):
        extra = media() if rng.random() < 0.3 else {}
        turns.append(Turn(QUESTIONS[1 + i], tokens=rng.choice([1, 4, 12]), before=rng.choice(BEFORE),
                          idle_chunks=rng.choice([1, 2, 3]), **extra))
    for previous, turn in zip(turns, turns[1:]):
        if turn.before == "cancel":  # the answer before this follow-up is streamed and cancelled mid-way
            previous.tokens = max(previous.tokens, 6)
            previous.cancel_at = rng.choice([2, 3, 5])
    return Case(seed, family, config, turns)


# the GPU fuzz's families (`tests/test_gpu.py`), each drawing its cases from seeds of its own
FUZZ_FAMILIES = ["bundled_qwen3_vl", "bundled_qwen3_5", "qwen2_5_vl", "qwen3_vl_moe", "qwen3_5_moe"]


def family_cases(family: str, count: int) -> list[Case]:
    """The GPU fuzz's first ``count`` cases of ``family``: seeds ``1000 x`` its place in `FUZZ_FAMILIES` and up (0 and
    up for a family outside it)."""
    base = 1000 * FUZZ_FAMILIES.index(family) if family in FUZZ_FAMILIES else 0
    return [make_case(base + i, family) for i in range(count)]


_SCHEDULE = threading.local()  # chunk sizes the eager engine replays for "auto" (this thread's run only)


@contextlib.contextmanager
def replayed_chunk_sizes():
    """Patch `ChunkScheduler.chunk_size` (process-wide, restored on exit) so that a thread with a schedule set
    replays it: ``_SCHEDULE.sizes`` a list per turn of per-forward sizes, ``_SCHEDULE.turn`` the current turn."""
    original = ChunkScheduler.chunk_size

    def chunk_size(self, adapter, cache, forward_index: int, cap=None) -> int:
        sizes = getattr(_SCHEDULE, "sizes", None)
        if sizes is None or not self.config.auto_chunk:
            return original(self, adapter, cache, forward_index, cap)
        turn = sizes[_SCHEDULE.turn]
        return turn[forward_index] if forward_index < len(turn) else 0

    ChunkScheduler.chunk_size = chunk_size
    try:
        yield
    finally:
        ChunkScheduler.chunk_size = original


def _wait_for_cancel_point(gate, streamed, timeout: float = 600.0) -> None:
    """Wait until the streamed answer is held at its cancel point (``gate.reached``). If its thread ends first, its
    own error is raised here (else the wait would only time out and hide it); the timeout is generous because a
    process's first answers on a GPU shared with other test processes pay kernel autotuning and graph captures."""
    deadline = time.monotonic() + timeout
    while not gate.reached.wait(timeout=0.2):
        if not streamed._thread.is_alive():
            streamed.result  # noqa: B018 (raises the answer's own error, if it had one)
            raise AssertionError("the streamed answer ended before its cancel point")
        if time.monotonic() > deadline:
            raise AssertionError(f"the streamed answer did not reach its cancel point in {timeout:.0f} s")


def run_case(model, processor, case: Case, fast_path, schedule=None, suppress=None) -> list[dict]:
    """The case's conversation; per turn: ``tokens`` (list), ``logits`` (``[n, V]`` float32 on the CPU), ``sizes``
    (the trace's chunk sizes per forward). ``schedule``: chunk sizes to replay (see `replayed_chunk_sizes`)."""
    config = RaincheckConfig(fast_path=fast_path, compile_steps=False, **case.config)
    results = []
    _SCHEDULE.sizes = schedule
    try:
        with Conversation(model, processor, config, background=False, early_follow_up=True) as conv:
            for i, turn in enumerate(case.turns):
                _SCHEDULE.turn = i
                if turn.before == "complete":
                    conv.complete()
                elif turn.before == "idle" and conv.cache is not None:
                    for _ in range(turn.idle_chunks):
                        restore_pending(model, conv.cache, max_tokens=config.idle_chunk_size)
                kw = dict(images=turn.images, videos=turn.videos, video_fps=turn.fps, max_new_tokens=turn.tokens,
                          output_logits=True)
                if suppress is not None:
                    kw["suppress_tokens"] = suppress
                if turn.cancel_at:
                    gate = _Gate(conv, turn.cancel_at)
                    streamed = conv.ask(turn.text, stream=True, min_new_tokens=turn.tokens,
                                        logits_processor=LogitsProcessorList([gate]), **kw)
                    _wait_for_cancel_point(gate, streamed)
                    streamed.close()
                    result = streamed.result
                    assert result.cancelled and result.token_ids.numel() == turn.cancel_at
                else:
                    result = conv.ask(turn.text, **kw)
                logits = torch.stack([x[0].float().cpu() for x in result.output.logits])
                results.append(dict(tokens=result.token_ids.tolist(), logits=logits,
                                    sizes=list(result.trace.chunk_size_per_forward)))
    finally:
        _SCHEDULE.sizes = None
    return results


def compare(case: Case, got: list[dict], want: list[dict], atol: float = 1e-3, rtol: float = 0.0) -> list[str]:
    """Differences between a run and the eager engine's (empty: equal tokens, and each forward's logits within
    ``atol + rtol * (its largest eager logit magnitude)``)."""
    problems = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g["tokens"] != w["tokens"]:
            problems.append(f"{case!r} turn {i}: tokens {g['tokens']} != eager {w['tokens']}")
            continue
        if not g["logits"].numel():
            continue
        diff = (g["logits"] - w["logits"]).abs().amax(dim=-1)
        allowed = atol + rtol * w["logits"].abs().amax(dim=-1)
        if bool((diff > allowed).any()):
            worst = int((diff - allowed).argmax())
            problems.append(f"{case!r} turn {i}: forward {worst}'s logits differ by {float(diff[worst]):.3g} "
                            f"(allowed {float(allowed[worst]):.3g})")
    if len(got) != len(want):
        problems.append(f"{case!r}: {len(got)} turns against {len(want)}")
    return problems


def eager_twin(model, processor, case: Case, run: list[dict], suppress=None) -> list[dict]:
    """The eager engine on ``case``, with ``run``'s chunk sizes when the case uses ``"auto"``."""
    schedule = [r["sizes"] for r in run] if case.config["chunk_size"] == "auto" else None
    return run_case(model, processor, case, False, schedule=schedule, suppress=suppress)


def check_cases(model, processor, cases: list[Case], fast_path=None, threads: bool = True, suppress=None,
                atol: float = 1e-3, rtol: float = 0.0) -> list[str]:
    """Every case on the engine under test (``fast_path``; None: what the device picks) against its eager twin,
    sequentially on one model, then the same cases again interleaved from one thread each on that model."""
    problems = []
    with replayed_chunk_sizes():
        for case in cases:
            run = run_case(model, processor, case, fast_path, suppress=suppress)
            problems += compare(case, run, eager_twin(model, processor, case, run, suppress), atol, rtol)
        if threads:
            runs, errors = {}, []

            def work(case):
                try:
                    runs[case.seed] = run_case(model, processor, case, fast_path, suppress=suppress)
                except BaseException as error:  # reported below
                    errors.append(f"{case!r}: {type(error).__name__}: {error}")

            workers = [threading.Thread(target=work, args=(case,)) for case in cases]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            problems += errors
            for case in cases:
                if case.seed in runs:
                    problems += [f"(threads) {p}" for p in compare(
                        case, runs[case.seed], eager_twin(model, processor, case, runs[case.seed], suppress), atol, rtol)]
    return problems

