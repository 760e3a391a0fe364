"""Train a bundled glyph model from scratch (seeded, resumable, GPU-first).

    python -m raincheck_hf.quality.train --family qwen3_vl --work runs/qwen3_vl --max-minutes 8
    python -m raincheck_hf.quality.train --family qwen3_vl --work runs/qwen3_vl --export raincheck_hf/checkpoints/glyph-qwen3-vl

Content-addressed retrieval learned from scratch on a full 10×10 grid sits at chance for
thousands of steps (the answer carries no gradient until attention finds the matching cell), so
training follows a curriculum of grid sizes (``--curriculum 3:600,5:600,7:1200,10:3600``: grid
side : steps). A batch holds one grid size: the stage's with probability 0.8, else a random
smaller one, so earlier sizes are not forgotten. Data are drawn from seeds ``step * batch + i``,
far below the benchmark's splits (`glyphs.SPLITS`).

Every ``--checkpoint-every`` steps, and when ``--max-minutes`` runs out, the trainer writes
``model.safetensors`` (fp32 weights) and ``optim.safetensors`` (AdamW moments in bf16, so each
file stays under the device tool's 16 MB transfer limit; the step and schedule in the metadata)
to ``--work``; a later run with the same ``--work`` resumes there. ``--export`` turns the work
directory into a bundled, `from_pretrained`-loadable model (weights, config, processor, card).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from .batching import batch_on_device, encode_dialogues
from .glyphs import BACKGROUNDS, MIN_GRID, SPLITS, benchmark_split, dialogue
from .models import FAMILIES, build_glyph_model
from .tokenizer import build_glyph_processor

DEFAULT_CURRICULUM = "3:600,5:600,7:1200,10:3600"


def parse_curriculum(text: str) -> list[tuple[int, int]]:
    try:
        stages = [tuple(int(x) for x in part.split(":")) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--curriculum must look like '3:600,5:600,10:3000' (grid:steps), got {text!r}") from None
    if not stages or any(len(s) != 2 or s[1] <= 0 or not MIN_GRID <= s[0] <= 10 for s in stages):
        raise ValueError(f"--curriculum stages need a grid in [{MIN_GRID}, 10] and steps > 0, got {text!r}")
    return stages


def grid_for_step(step: int, stages: list[tuple[int, int]], rng: random.Random) -> int:
    end = 0
    for grid, steps in stages:
        end += steps
        if step < end:
            break
    if grid > 3 and rng.random() < 0.2:
        return rng.randint(3, grid - 1)
    return grid


class GlyphStream(torch.utils.data.IterableDataset):
    """Encoded training batches for steps ``start, start + 1, …`` (worker k takes every k-th step)."""

    def __init__(self, processor, stages, batch_size: int, start: int, total: int, seed: int):
        self.processor, self.stages, self.batch_size = processor, stages, batch_size
        self.start, self.total, self.seed = start, total, seed

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for step in range(self.start + wid, self.total, nw):
            rng = random.Random(self.seed * 1_000_003 + step)
            grid = grid_for_step(step, self.stages, rng)
            base = step * self.batch_size
            yield encode_dialogues([dialogue(base + i, grid) for i in range(self.batch_size)], self.processor)


def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def masked_loss(logits: torch.Tensor, batch) -> torch.Tensor:
    target = batch.input_ids[:, 1:]
    mask = batch.loss_mask[:, 1:]
    picked = logits[:, :-1][mask].float()
    return torch.nn.functional.cross_entropy(picked, target[mask])


@torch.no_grad()
def teacher_forced_accuracy(model, processor, dialogues, device, batch_size: int = 32) -> dict:
    """Per-fact accuracy with the reference answer fed in: is the background word the argmax?

    Split into first-turn facts, first-turn list items and follow-up facts. A quick training
    monitor only; the benchmark's numbers come from generation (`raincheck_hf.eval`).
    """
    tok = processor.tokenizer
    background_ids = set(tok.convert_tokens_to_ids(list(BACKGROUNDS)))
    end, start = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")
    assistant = tok.convert_tokens_to_ids("assistant")
    counts = {k: [0, 0] for k in ("first_fact", "first_list", "follow_up")}
    model.eval()
    for i in range(0, len(dialogues), batch_size):
        group = dialogues[i:i + batch_size]
        batch = batch_on_device(encode_dialogues(group, processor), device)
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16,
                            enabled=torch.device(device).type == "cuda"):
            pred = model(**batch.model_inputs()).logits.argmax(-1)
        for row, d in enumerate(group):
            ids = batch.input_ids[row].tolist()
            turn = -1
            for j in range(1, len(ids)):
                if ids[j - 1] == start and ids[j] == assistant:
                    turn += 1
                if batch.loss_mask[row, j] and ids[j] in background_ids and ids[j] != end:
                    key = "follow_up" if turn > 0 else ("first_list" if d.turns[0].kind == "list" else "first_fact")
                    counts[key][0] += int(pred[row, j - 1].item() == ids[j])
                    counts[key][1] += 1
    model.train()
    return {k: (c / n if n else float("nan")) for k, (c, n) in counts.items()}


def save_checkpoint(work: Path, model, optimizer, step: int, meta: dict) -> None:
    from safetensors.torch import save_file

    work.mkdir(parents=True, exist_ok=True)
    names = dict(model.named_parameters())
    index = {id(p): n for n, p in names.items()}
    moments = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state:
                moments[f"m.{index[id(p)]}"] = state["exp_avg"].to(torch.bfloat16).contiguous()
                moments[f"v.{index[id(p)]}"] = state["exp_avg_sq"].to(torch.bfloat16).contiguous()
    text_meta = {"step": str(step), "meta": json.dumps(meta)}
    weights = {n: t.detach().float().contiguous() for n, t in model.state_dict().items()}
    save_file(weights, str(work / "model.safetensors.tmp"), metadata=text_meta)
    save_file(moments, str(work / "optim.safetensors.tmp"), metadata=text_meta)
    # rename last, so an interrupted save never leaves a half-written checkpoint behind
    (work / "model.safetensors.tmp").replace(work / "model.safetensors")
    (work / "optim.safetensors.tmp").replace(work / "optim.safetensors")


def load_checkpoint(work: Path, model, optimizer) -> int:
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not (work / "model.safetensors").is_file():
        return 0
    model.load_state_dict(load_file(str(work / "model.safetensors"), device=str(next(model.parameters()).device)))
    step = 0
    if (work / "optim.safetensors").is_file():
        with safe_open(str(work / "optim.safetensors"), "pt") as f:
            step = int(f.metadata()["step"])
            keys = set(f.keys())
            for name, p in model.named_parameters():
                if f"m.{name}" in keys:
                    optimizer.state[p] = {
                        "step": torch.tensor(float(step)),
                        "exp_avg": f.get_tensor(f"m.{name}").to(p.device, torch.float32),
                        "exp_avg_sq": f.get_tensor(f"v.{name}").to(p.device, torch.float32),
                    }
    return step


def train(args) -> dict:
    stages = parse_curriculum(args.curriculum)
    total = sum(s for _, s in stages)
    if total * args.batch_size > SPLITS["test"][0]:
        raise ValueError(f"{total} steps × batch {args.batch_size} would reach the benchmark's seeds "
                         f"({SPLITS['test'][0]}); shorten --curriculum or --batch-size")
    device = args.device
    processor = build_glyph_processor()
    model = build_glyph_model(args.family, processor.tokenizer, seed=args.seed).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    work = Path(args.work)
    step = load_checkpoint(work, model, optimizer)
    log_path = work / "train_log.jsonl"
    work.mkdir(parents=True, exist_ok=True)
    dev = benchmark_split("dev", limit=args.dev_limit)
    loader = torch.utils.data.DataLoader(GlyphStream(processor, stages, args.batch_size, step, total, args.seed),
                                         batch_size=None, num_workers=args.workers, prefetch_factor=4 if args.workers else None,
                                         persistent_workers=False)
    meta = {"family": args.family, "curriculum": args.curriculum, "batch_size": args.batch_size, "lr": args.lr,
            "seed": args.seed, "train_command": getattr(args, "command", None)}
    began, last_log = time.time(), time.time()
    model.train()
    print(f"[{args.family}] resuming at step {step}/{total}" if step else f"[{args.family}] training {total} steps",
          flush=True)
    record = {}
    with log_path.open("a") as log:
        for encoded in loader:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, total, args.lr, args.warmup)
            batch = batch_on_device(encoded, device)
            with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16,
                                enabled=torch.device(device).type == "cuda"):
                logits = model(**batch.model_inputs()).logits
            loss = masked_loss(logits, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            out_of_time = args.max_minutes and (time.time() - began) > args.max_minutes * 60
            if step % args.log_every == 0 or step == total or out_of_time:
                record = {"step": step, "loss": round(loss.item(), 4), "grid": int(encoded["colour"].shape[-1]),
                          "lr": optimizer.param_groups[0]["lr"], "elapsed_s": round(time.time() - began, 1)}
                if step % args.eval_every == 0 or step == total or out_of_time:
                    record["dev_teacher_forced"] = teacher_forced_accuracy(model, processor, dev, device)
                log.write(json.dumps(record) + "\n")
                log.flush()
                print(f"[{args.family}] {json.dumps(record)} ({(time.time() - last_log) / args.log_every:.3f} s/step)",
                      flush=True)
                last_log = time.time()
            if step % args.checkpoint_every == 0 or step == total or out_of_time:
                save_checkpoint(work, model, optimizer, step, meta)
            if out_of_time:
                print(f"[{args.family}] out of time at step {step}; resume with the same --work", flush=True)
                break
    return {"step": step, "total": total, **record}


def export(family: str, work: Path, out: Path, command: str | None = None) -> Path:
    """Write a `from_pretrained` directory (fp32 safetensors, config, processor, model card) from a work dir."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    processor = build_glyph_processor()
    model = build_glyph_model(family, processor.tokenizer)
    model.load_state_dict(load_file(str(work / "model.safetensors")))
    with safe_open(str(work / "model.safetensors"), "pt") as f:
        step = int(f.metadata()["step"])
        meta = json.loads(f.metadata()["meta"])
    out.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    log = []
    if (work / "train_log.jsonl").is_file():
        log = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines() if line.strip()]
    last_eval = next((r for r in reversed(log) if "dev_teacher_forced" in r), None)
    (out / "training.json").write_text(json.dumps({"step": step, **meta, "export_command": command,
                                                   "last_dev_eval": last_eval}, indent=1) + "\n")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m raincheck_hf.quality.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=FAMILIES, required=True)
    parser.add_argument("--work", required=True, help="checkpoint directory (resumed when it holds one)")
    parser.add_argument("--export", help="after training (or instead, with --steps 0), write a bundled model here")
    parser.add_argument("--curriculum", default=DEFAULT_CURRICULUM)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--max-minutes", type=float, default=0.0, help="checkpoint and stop after this long (0: no limit)")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=400)
    parser.add_argument("--checkpoint-every", type=int, default=500)
    parser.add_argument("--dev-limit", type=int, default=64, help="dev dialogues of the teacher-forced monitor")
    parser.add_argument("--no-train", action="store_true", help="only --export the work directory")
    args = parser.parse_args(argv)
    import shlex
    import sys

    args.command = "python -m raincheck_hf.quality.train " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.batch_size <= 0:
        parser.error(f"--batch-size must be positive, got {args.batch_size}")
    if not args.no_train:
        print(json.dumps(train(args)))
    if args.export:
        path = export(args.family, Path(args.work), Path(args.export), command=args.command)
        print(f"exported {args.family} to {path}")


if __name__ == "__main__":
    main()
