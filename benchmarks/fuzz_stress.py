"""The schedule fuzz's threaded conversations in a loop: how often a conversation run beside others on one model
differs from the same dialogue alone on the eager engine.

    python benchmarks/fuzz_stress.py --family qwen2_5_vl --seconds 170 [--restore-order source]

`tests/schedule_fuzz.py`'s cases of one family (its first ``--cases``, as `tests/test_gpu.py`'s fuzz draws them:
`schedule_fuzz.family_cases`; ``bundled_qwen3_vl`` / ``bundled_qwen3_5``: the trained glyph models) are each run
once alone (the fast path where the device has one, then the eager engine's twin: the references), then again and
again all at once, one thread each on the one model, until ``--seconds`` have passed; every run is compared with its
reference (equal tokens, logits within 1e-3 + 1e-3 of the largest; a case with ``chunk_size="auto"`` against an eager
twin of that run's own chunk sizes). It prints when the runs alone are done, each run that differs (the loop's
iteration, the seed, the first differences), each distinct warning once (``<tag> warning ...``: a graph capture that
failed and fell back to eager forwards, for one) and at the end ``<tag> iterations N failed cases M``.
``--restore-order``: that restoration order for every case instead of its own (to tell whether a failure depends on
it). Switches that each take one suspect away, for the run only: ``--no-step-graphs`` (the text steps eagerly on the
static slots, nothing captured), ``--no-vision-graphs`` (the tower eagerly), ``--one-at-a-time`` (one lock around
every ``generate`` on the model: the threads' answers never overlap), ``--device-work`` (every ``generate`` inside
`fast.scoping.device_work`, as a batching loop's steps are: a graph capture waits until no other thread's answer is
running, and they wait for it). Several processes side by side on one GPU (`h200_run.sh fuzz_stress`) add the
contention the GPU suite's parallel workers give. Storages are small (``SLOT_ROUNDING`` 64, as in the GPU fuzz), so
conversations grow into pooled storages often. Nothing is asserted; a CPU run checks the tool itself.

With these switches it found why answers differed under threads on CUDA (``--no-step-graphs`` and ``--device-work``
took the differences away, ``--no-vision-graphs`` did not): a step capture's warm-up on a side stream
(`fast.scoping`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from families import BY_NAME
    from schedule_fuzz import FUZZ_FAMILIES

    parser.add_argument("--family", default="qwen2_5_vl", choices=sorted(set(FUZZ_FAMILIES) | set(BY_NAME)),
                        help="a test family, or a bundled glyph model (bundled_qwen3_vl, bundled_qwen3_5)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--restore-order", default=None, help="every case's restoration order (default: its own)")
    parser.add_argument("--tag", default=None, help="the name the lines start with (default: the order)")
    parser.add_argument("--no-step-graphs", action="store_true", help="the text steps eagerly (no capture)")
    parser.add_argument("--no-vision-graphs", action="store_true", help="the vision tower eagerly (no capture)")
    parser.add_argument("--one-at-a-time", action="store_true", help="one lock around every generate on the model")
    parser.add_argument("--device-work", action="store_true",
                        help="every generate inside fast.scoping.device_work (captures wait for the others)")
    args = parser.parse_args(argv)

    import raincheck_hf.fast.graphs as graphs
    import raincheck_hf.fast.static_cache as static_cache
    import raincheck_hf.fast.vision_graphs as vision_graphs

    rounding, static_cache.SLOT_ROUNDING = static_cache.SLOT_ROUNDING, 64  # (as the GPU fuzz: into pooled storages)
    with contextlib.ExitStack() as undo:  # (the process as it was afterwards: a caller's, a test's)
        undo.callback(setattr, static_cache, "SLOT_ROUNDING", rounding)
        if args.no_step_graphs:
            undo.enter_context(_after_init(graphs.StepGraphs, use_graphs=False, pad_prefill=False))
        if args.no_vision_graphs:
            undo.enter_context(_after_init(vision_graphs.VisionGraphs, use_graphs=False))
        return _stress(args)


@contextlib.contextmanager
def _after_init(cls, **values):
    """``cls``'s new instances get ``values`` as attributes after their own ``__init__``, for the block."""
    init = cls.__init__

    def patched(self, *a, **kw):
        init(self, *a, **kw)
        for name, value in values.items():
            setattr(self, name, value)

    cls.__init__ = patched
    try:
        yield
    finally:
        cls.__init__ = init


def _wrapped_generate(model, one_at_a_time: bool, device_work: bool) -> None:
    """``model.generate`` (its Raincheck wrapper) under one lock for the model and / or inside `device_work`."""
    from raincheck_hf.fast.scoping import device_work as shared_device_work

    lock, generate = threading.Lock(), model.generate

    def guarded(*args, **kwargs):
        with (lock if one_at_a_time else contextlib.nullcontext()), \
                (shared_device_work() if device_work else contextlib.nullcontext()):
            return generate(*args, **kwargs)

    model.generate = guarded


def _stress(args) -> int:
    import torch

    import raincheck_hf
    from conftest import no_placeholder_ids
    from families import BY_NAME, family_processor
    from schedule_fuzz import family_cases

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.family.startswith("bundled_"):  # (as the GPU fuzz: the trained glyph model and its processor)
        from raincheck_hf.quality import load_bundled

        model, processor = load_bundled(args.family[len("bundled_"):], device=device)
        raincheck_hf.enable(model)
    else:
        model = raincheck_hf.enable(BY_NAME[args.family].build(seed=0).to(device))
        processor = family_processor(args.family)
    if args.one_at_a_time or args.device_work:
        _wrapped_generate(model, args.one_at_a_time, args.device_work)
    cases = family_cases(args.family, args.cases)
    if args.restore_order is not None:
        for case in cases:
            case.config["restore_order"] = args.restore_order
    tag = args.tag or args.restore_order or "own"
    suppress = no_placeholder_ids(model)
    with warnings.catch_warnings():  # (each distinct warning printed once: a capture that failed, for one)
        warnings.simplefilter("always")
        seen = set()

        def show(message, category, *_, **__):
            text = f"{category.__name__}: {message}"
            if text not in seen:
                seen.add(text)
                print(tag, "warning", text[:400], flush=True)

        warnings.showwarning = show
        return _loop(args, model, processor, cases, tag, suppress)


def _loop(args, model, processor, cases, tag, suppress) -> int:
    from schedule_fuzz import compare, eager_twin, replayed_chunk_sizes, run_case

    def report(what, case, problems):
        print(tag, what, "seed", case.seed, [p[-160:] for p in problems], flush=True)

    with replayed_chunk_sizes():
        references, started = {}, time.monotonic()
        for case in cases:
            run = run_case(model, processor, case, None, suppress=suppress)
            references[case.seed] = eager_twin(model, processor, case, run, suppress)
            problems = compare(case, run, references[case.seed], 1e-3, 1e-3)
            if problems:
                report("alone", case, problems)
        # (a run cut short by a time limit still says how far it got)
        print(tag, "alone, each case once", f"{time.monotonic() - started:.1f} s", flush=True)
        iterations = failed = 0
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            runs, errors = {}, {}

            def work(case):
                try:
                    runs[case.seed] = run_case(model, processor, case, None, suppress=suppress)
                except Exception as error:  # noqa: BLE001 (reported)
                    errors[case.seed] = f"{type(error).__name__}: {error}"

            threads = [threading.Thread(target=work, args=(case,)) for case in cases]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            iterations += 1
            for case in cases:
                if case.seed in errors:
                    failed += 1
                    report(f"iteration {iterations}", case, [errors[case.seed]])
                    continue
                want = (eager_twin(model, processor, case, runs[case.seed], suppress)
                        if case.config["chunk_size"] == "auto" else references[case.seed])
                problems = compare(case, runs[case.seed], want, 1e-3, 1e-3)
                if problems:
                    failed += 1
                    report(f"iteration {iterations}", case, problems)
    print(tag, "iterations", iterations, "failed cases", failed, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
