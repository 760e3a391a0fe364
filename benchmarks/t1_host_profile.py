"""Where the host's time goes in an image turn's first token, `raincheck` (mmtok) and `full`: cProfile over five
`generate(max_new_tokens=1)` calls each after four warm-up calls, the 70 largest cumulative entries printed and written
to OUT.json. Cumulative times include the host's waits for the device; cProfile inflates pure-Python time.

    python benchmarks/t1_host_profile.py OUT.json [MODEL]   (default qwen3_vl_8b: random bf16 weights, CUDA)"""
import cProfile
import io
import json
import pstats
import sys

import torch

from raincheck_hf.bench import profile, shapes
from raincheck_hf.configuration import RaincheckConfig

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model, info, inputs, prompt = shapes.image_turn(sys.argv[2] if len(sys.argv) > 2 else "qwen3_vl_8b", device)
out = {}
for mode in ("raincheck", "full"):
    kw = profile.first_token_kwargs(inputs, RaincheckConfig(mode=mode))
    with torch.no_grad():
        for _ in range(4):
            model.generate(**kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(5):
            model.generate(**kw)
        pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(70)
    out[mode] = s.getvalue()
    print("=====", mode)
    print(s.getvalue()[:12000])
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
