"""The first token (T1) of an image turn with the vision tower's rotation in one kernel (`fast.vision_attention`, the
library's default) and with the stock rotation, side by side in one process, for `full` and the default `mmtok`;
`uniform` and stock `generate` beside them; and an unsynced timeline of the default variants' first token
(`bench.profile.timeline`).

    python benchmarks/vision_rotary_t1.py OUT.json [REPS] [MODEL]

Qwen3-VL-8B's shape (random bf16 weights) on CUDA, the 1,344x1024 image, ``max_new_tokens=1``, the library's default
settings; each variant warmed up three times (the tower's graph of the image's grid is captured on its second
sighting, one graph per rotation form), then the repetitions round robin. The stock rotation is the scoped switch
`fast.vision_attention.one_kernel_rotation(False)` around those calls (a context variable: the library has no
setting for it)."""
import json
import sys

import torch

from raincheck_hf.bench import profile, shapes
from raincheck_hf.bench.latency import hardware_info
from raincheck_hf.configuration import RaincheckConfig
from raincheck_hf.fast import vision_attention


def main(out: str, reps: int = 9, model_name: str = "qwen3_vl_8b") -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, info, inputs, prompt = shapes.image_turn(model_name, device)
    forms = {"full": (RaincheckConfig(mode="full"), True), "mmtok": (RaincheckConfig(), True),
             "uniform": (RaincheckConfig(selector="uniform"), True), "stock": (None, True),
             "full_stock_rotary": (RaincheckConfig(mode="full"), False),
             "mmtok_stock_rotary": (RaincheckConfig(), False)}

    def kwargs(name):
        return profile.first_token_kwargs(inputs, forms[name][0])

    def switch(name):
        return lambda: vision_attention.one_kernel_rotation(forms[name][1])

    times = profile.first_tokens_side_by_side(model, device, {n: (kwargs(n), switch(n)) for n in forms}, reps)
    result = {"benchmark": "vision_rotary_t1", "command": " ".join(["python", *sys.argv]),
              "hardware": hardware_info(device), "model": info, "prompt": prompt,
              "settings": {"reps": reps, "defaults": "RaincheckConfig()", "max_new_tokens": 1},
              "t1_ms": profile.t1_rows(times), "timelines": {}}
    for name in ("full", "mmtok", "full_stock_rotary"):
        with switch(name)(), torch.no_grad():
            line = profile.timeline(model, device, kwargs(name))
        result["timelines"][name] = line
        print(profile.timeline_summary(name, line, host=False), flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 9, sys.argv[3] if len(sys.argv) > 3 else "qwen3_vl_8b")
