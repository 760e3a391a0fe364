"""Time per output token of an answer streamed by the demo's Chat tab, against the same streamed answer
without a page (what the CLI does), on the bundled glyph Qwen3-VL.

    python -m demo.bench_streaming [--runs 9] [--json results.json]

The demo runs in a process of its own (as it does for a browser) and `gradio_client` plays the page,
asking the glyph grid's 20-fact list question; the comparison streams the same question through
`raincheck_hf.Conversation.ask(stream=True)` in another process. The first run of each is a warm-up;
the table gives the median of the others. Timings depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BARE = """
import json, sys
import raincheck_hf
from raincheck_hf.quality import load_bundled
from raincheck_hf.quality.glyphs import benchmark_split
model, processor = load_bundled("qwen3_vl")
raincheck_hf.enable(model)
grid = benchmark_split("dev", limit=1)[0]
out = []
for _ in range({runs}):
    with raincheck_hf.Conversation(model, processor, raincheck_hf.RaincheckConfig(), max_new_tokens={tokens}) as chat:
        stream = chat.ask(grid.turns[0].question, images=[grid.image()], stream=True)
        for _ in stream:
            pass
        out.append(stream.result.time_per_output_token * 1e3)
print(json.dumps(out))
"""


def page_runs(runs: int, tokens: int) -> tuple[list[float], list[int]]:
    from gradio_client import Client, handle_file

    from raincheck_hf.quality.glyphs import benchmark_split

    grid = benchmark_split("dev", limit=1)[0]
    folder = tempfile.mkdtemp(prefix="raincheck-bench-")
    image = os.path.join(folder, "grid.png")
    grid.image().save(image)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-c", f"import demo.app as app; app.build_demo(max_new_tokens={tokens}).launch("
                               f"server_name='127.0.0.1', server_port={port}, quiet=True)"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                client = Client(f"http://127.0.0.1:{port}/", verbose=False, download_files=False)
                break
            except Exception:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the demo did not start")
                time.sleep(1)
        tpot, updates = [], []
        for _ in range(runs):
            client.predict(api_name="/new_conversation")
            job = client.submit({"text": grid.turns[0].question, "files": [handle_file(image)]}, api_name="/chat")
            final = job.result(timeout=600)
            tpot.append(final[4]["turn_figures"][0]["tpot_ms"])  # the status panel's figures of turn 1
            updates.append(len(job.outputs()))
        return tpot, updates
    finally:
        server.terminate()
        server.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo.bench_streaming", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=9, help="answers per variant, the first a warm-up (default 9)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="answer length limit (default 64)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the runs to this file")
    args = parser.parse_args(argv)
    if args.runs < 2:
        parser.error(f"--runs must be >= 2 (the first is a warm-up), got {args.runs}")
    if args.max_new_tokens < 2:
        parser.error(f"--max-new-tokens must be >= 2 (a time per token needs two), got {args.max_new_tokens}")
    page, updates = page_runs(args.runs, args.max_new_tokens)
    done = subprocess.run([sys.executable, "-c", BARE.format(runs=args.runs, tokens=args.max_new_tokens)],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    bare = json.loads(done.stdout.strip().splitlines()[-1])
    rows = [("demo page (Chat tab)", page[1:], f"{statistics.median(updates[1:]):.0f} updates per answer"),
            ("stream without a page", bare[1:], "")]
    print(f"{'variant':<24} {'ms per token (median)':>22}  runs")
    for name, values, note in rows:
        print(f"{name:<24} {statistics.median(values):>22.1f}  {len(values)}  {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"page_ms_per_token": page, "page_updates": updates, "no_page_ms_per_token": bare}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
