"""Where each thread of a profiled process spent its samples: a reader of py-spy's raw output.

    py-spy record --threads -r 200 -f raw -o spy.txt -- python -m raincheck_hf.bench serve-load ...
    python benchmarks/spy_summary.py spy.txt --top 30
    python benchmarks/spy_summary.py spy.txt --thread raincheck-batch-loop --under BatchLoop._iteration

py-spy's raw format is one line per distinct stack, ``frame;frame;...;frame count``, the first frame the thread
(``thread (ID): NAME`` with ``--threads``) and each other ``function (file:line)``. Per thread (the most sampled
first) this prints its samples and its functions by inclusive samples (a function counted once per stack however
often it recurs), as a share of the thread's samples. ``--under F`` keeps only stacks through a function whose name
contains F (e.g. one phase of a thread's work); ``--own`` ranks by the innermost frame instead (where the samples
were taken). py-spy samples threads that hold or want the interpreter lock and ones in native code alike; without
``--idle`` at record time it leaves out threads that were waiting.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

_FRAME = re.compile(r"^(?P<name>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def parse(lines) -> list[tuple[str, list[str], int]]:
    """``(thread, [function, ...] outermost first, samples)`` per raw line; a function is ``name file`` (the file's
    last path part, no line number: the lines of one function are one entry)."""
    out = []
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        try:
            samples = int(count)
        except ValueError as error:
            raise ValueError(f"not a py-spy raw line (no sample count at its end): {line[:120]!r}") from error
        frames = stack.split(";")
        thread = frames[0] if frames and frames[0].startswith("thread") else "(no thread)"
        functions = []
        for frame in frames[1:] if thread != "(no thread)" else frames:
            m = _FRAME.match(frame)
            functions.append(f"{m.group('name')} {m.group('file').rsplit('/', 1)[-1]}" if m else frame)
        out.append((thread, functions, samples))
    return out


def summarize(stacks, thread: str | None = None, under: str | None = None, own: bool = False,
              top: int = 25) -> list[dict]:
    """Per thread (matching ``thread`` when given), its samples and its top functions (``[function, samples,
    share]``), inclusive or ``own``; ``under`` keeps only stacks through a function containing it."""
    totals: collections.Counter = collections.Counter()
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for name, functions, samples in stacks:
        if thread is not None and thread not in name:
            continue
        if under is not None:
            at = next((i for i, f in enumerate(functions) if under in f), None)
            if at is None:
                continue
            functions = functions[at:]
        totals[name] += samples
        if own:
            if functions:
                counts[name][functions[-1]] += samples
        else:
            for function in set(functions):
                counts[name][function] += samples
    return [{"thread": name, "samples": total,
             "functions": [[f, n, n / total] for f, n in counts[name].most_common(top)]}
            for name, total in totals.most_common()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="py-spy's raw output (record -f raw)")
    parser.add_argument("--thread", default=None, help="only threads whose name contains this")
    parser.add_argument("--under", default=None, metavar="F", help="only stacks through a function containing F")
    parser.add_argument("--own", action="store_true", help="rank by the innermost frame, not inclusively")
    parser.add_argument("--top", type=int, default=25, help="functions per thread")
    parser.add_argument("--threads", type=int, default=8, help="threads shown (the most sampled)")
    parser.add_argument("--json", default=None, help="write the summary here too")
    args = parser.parse_args(argv)
    if args.top < 1 or args.threads < 1:
        parser.error(f"--top and --threads must be at least 1, got {args.top} and {args.threads}")
    with open(args.path) as f:
        rows = summarize(parse(f), args.thread, args.under, args.own, args.top)[:args.threads]
    if not rows:
        print("no samples matched", file=sys.stderr)
        return 1
    for row in rows:
        print(f"{row['thread']}: {row['samples']} samples")
        for function, n, share in row["functions"]:
            print(f"  {100 * share:5.1f}%  {n:7d}  {function}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"path": args.path, "thread": args.thread, "under": args.under, "own": args.own,
                       "threads": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
