"""Device memory a CUDA thread leaves behind: N threads alive at once, each running one bf16 matmul on the default
stream, then ended; prints ``torch.cuda.memory_allocated`` before, while they live and after (MB). torch gives each
thread a cuBLAS handle from its pool and keeps a workspace per (handle, stream) for as long as the handle lives, and
the pool keeps the handle after the thread ends: what `restorer.IdleRestorer` (one restoring thread per model, not
one per conversation) avoids.

    python benchmarks/thread_workspace_probe.py --threads 1,4,16
"""

from __future__ import annotations

import argparse
import json
import threading

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,4,16", help="threads alive at once, comma-separated")
    args = parser.parse_args()
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()  # the main thread's own handle and workspace first
    rows = []
    for n in (int(x) for x in args.threads.split(",")):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated() / 2**20
        gate, ran = threading.Barrier(n + 1), threading.Barrier(n + 1)

        def work():
            (a @ a).sum().item()
            ran.wait()
            gate.wait()

        threads = [threading.Thread(target=work) for _ in range(n)]
        for t in threads:
            t.start()
        ran.wait()
        during = torch.cuda.memory_allocated() / 2**20
        gate.wait()
        for t in threads:
            t.join()
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated() / 2**20
        rows.append({"threads": n, "before_mb": round(before, 1), "during_mb": round(during, 1),
                     "after_mb": round(after, 1)})
        print(json.dumps(rows[-1]))
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
