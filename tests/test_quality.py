"""The quality testbed: glyph benchmark, tokenizer/processor, fast batches vs the processor, trainer,
JSONL loader and scorers, and the bundled models' behaviour on a fixed, seeded subset."""

from __future__ import annotations

import json

import pytest
import torch

from raincheck_hf.quality.batching import glyph_batch, patchify, processor_batch
from raincheck_hf.quality.glyphs import (
    BACKGROUNDS, CELL_PIXELS, COLOURS, GLYPHS, Turn, benchmark_split, dialogue, glyph_library, parse_facts,
    score_turn,
)
from raincheck_hf.quality.tokenizer import build_glyph_processor, build_word_tokenizer


@pytest.fixture(scope="module")
def glyph_processor():
    return build_glyph_processor()


# ---- benchmark ------------------------------------------------------------------------------

def test_dialogues_are_deterministic_and_well_formed():
    a, b = dialogue(7, 10), dialogue(7, 10)
    assert a.cells == b.cells and a.turns == b.turns
    assert dialogue(8, 10).cells != a.cells
    pairs = {(c.colour, c.glyph) for c in a.cells}
    assert len(pairs) == len(a.cells) == 100  # each (colour, glyph) once: a content address
    assert {(c.row, c.col) for c in a.cells} == {(r, c) for r in range(10) for c in range(10)}


@pytest.mark.parametrize("seed", range(6))
def test_follow_ups_ask_about_colours_turn_one_did_not_name(seed):
    d = dialogue(seed, 10, long_first=bool(seed % 2))
    first_colours = {f[0] for f in d.turns[0].facts}
    assert 2 <= len(d.turns) - 1 <= 3
    for turn in d.turns[1:]:
        assert turn.kind == "fact" and turn.facts[0][0] not in first_colours
    if d.turns[0].kind == "list":
        assert len(d.turns[0].facts) == 20 and len(first_colours) == 2


def test_split_is_fixed_and_balanced():
    test = benchmark_split("test")
    assert len(test) == 100 and len({d.uid for d in test}) == 100
    assert sum(d.turns[0].kind == "list" for d in test) == 50
    assert [t.answer for t in benchmark_split("test", limit=3)[2].turns] == [t.answer for t in test[2].turns]
    train_seeds = dialogue(0, 10).meta["seed"]
    assert all(d.meta["seed"] > 100_000 + train_seeds for d in test)
    with pytest.raises(ValueError, match="split"):
        benchmark_split("train")
    with pytest.raises(ValueError, match="grid"):
        dialogue(0, 11)


def test_rendered_cells_show_their_glyph_colour_and_background():
    d = dialogue(3, 6)
    pixels = d.render()
    library = glyph_library()
    assert pixels.shape == (3, 6 * CELL_PIXELS, 6 * CELL_PIXELS)
    scale = CELL_PIXELS // library.shape[-1]
    for cell in d.cells[:12]:
        block = pixels[:, cell.row * CELL_PIXELS:(cell.row + 1) * CELL_PIXELS, cell.col * CELL_PIXELS:(cell.col + 1) * CELL_PIXELS]
        bits = library[GLYPHS.index(cell.glyph)].repeat_interleave(scale, 0).repeat_interleave(scale, 1)
        colour = torch.tensor(COLOURS[cell.colour], dtype=torch.uint8)
        grey = torch.full((3,), BACKGROUNDS[cell.background], dtype=torch.uint8)
        assert torch.equal(block.permute(1, 2, 0)[bits], colour.expand(int(bits.sum()), 3))
        assert torch.equal(block.permute(1, 2, 0)[~bits], grey.expand(int((~bits).sum()), 3))
    # glyphs are far apart (Hamming distance >= 5) so a small vision tower can tell them apart
    flat = library.flatten(1).int()
    dist = (flat[:, None] != flat[None]).sum(-1) + 100 * torch.eye(len(flat), dtype=torch.long)
    assert dist.min() >= 5


def test_scoring_fact_and_list_turns():
    fact = Turn("q", "dim", "fact", (("red", "g3", "dim"),))
    assert score_turn(fact, "dim")["correct"] == 1
    assert score_turn(fact, "pale dim")["correct"] == 0
    assert score_turn(fact, "")["correct"] == 0
    facts = (("red", "g0", "dark"), ("red", "g2", "pale"), ("blue", "g1", "light"))
    lst = Turn("q", " ".join(" ".join(f) for f in facts), "list", facts)
    s = score_turn(lst, "red g0 dark red g2 dim blue g1 light blue g1 light junk")
    assert (s["correct"], s["total"], s["stated"]) == (2, 3, 3)  # a repeated triple counts once
    assert s["precision"] == pytest.approx(2 / 3)
    assert parse_facts("x red g0 dark y blue") == [("red", "g0", "dark")]


# ---- tokenizer and processor ----------------------------------------------------------------

def test_word_tokenizer_round_trip(glyph_processor):
    tok = build_word_tokenizer()
    d = dialogue(11, 10, long_first=True)
    for turn in d.turns:
        for text in (turn.question, turn.answer):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert tok.unk_token_id not in ids
            assert len(ids) == len(text.split())  # one token per word
            assert tok.decode(ids) == text
    assert tok("zebra", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]
    chat = glyph_processor.apply_chat_template(d.messages(), tokenize=False)
    ids = tok(chat, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and tok.convert_tokens_to_ids("<|image_pad|>") in ids


def test_saved_processor_round_trip(glyph_processor, tmp_path):
    from transformers import AutoProcessor, PreTrainedTokenizerFast

    glyph_processor.save_pretrained(tmp_path)
    loaded = AutoProcessor.from_pretrained(tmp_path, tokenizer=PreTrainedTokenizerFast.from_pretrained(tmp_path))
    ds = [dialogue(i, 5) for i in range(2)]
    a, b = processor_batch(ds, glyph_processor), processor_batch(ds, loaded)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.pixel_values, b.pixel_values)


@pytest.mark.parametrize("grid", [3, 7, 10])
def test_fast_batches_match_the_processor(glyph_processor, grid):
    ds = [dialogue(100 + i, grid, long_first=bool(i % 2)) for i in range(3)]
    fast, slow = glyph_batch(ds, glyph_processor), processor_batch(ds, glyph_processor)
    for name in ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw", "loss_mask"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    torch.testing.assert_close(fast.pixel_values, slow.pixel_values, rtol=0, atol=1e-6)
    # the loss covers exactly the answers and their end-of-turn tokens
    tok = glyph_processor.tokenizer
    taught = tok.decode(fast.input_ids[0][fast.loss_mask[0]]).split()
    want = " <|im_end|> ".join(t.answer for t in ds[0].turns).split() + ["<|im_end|>"]
    assert taught == want


def test_patchify_on_random_images():
    # the same reordering as the processor's, on arbitrary (non-glyph) pixels
    from transformers import Qwen2VLImageProcessor

    g = torch.Generator().manual_seed(0)
    img = torch.randint(0, 256, (3, 64, 96), generator=g, dtype=torch.uint8)
    proc = Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                 image_std=[0.5] * 3, size={"shortest_edge": 64 * 64, "longest_edge": 512 * 512})
    want = proc(images=[img], return_tensors="pt")["pixel_values"]
    got = patchify(img[None].float().div(255).sub(0.5).div(0.5))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


# ---- trainer --------------------------------------------------------------------------------

def test_trainer_steps_checkpoints_resumes_and_exports(tmp_path):
    from raincheck_hf.quality import train as trainer

    work = tmp_path / "work"
    common = ["--family", "qwen3_vl", "--work", str(work), "--batch-size", "2", "--workers", "0", "--device", "cpu",
              "--log-every", "1", "--eval-every", "1000", "--checkpoint-every", "1000", "--warmup", "1", "--dev-limit", "2"]
    trainer.main(common + ["--curriculum", "3:2"])
    log = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2] and all(r["loss"] > 0 for r in log)
    from safetensors.torch import load_file

    before = load_file(str(work / "model.safetensors"))
    trainer.main(common + ["--curriculum", "3:3", "--export", str(tmp_path / "out")])
    log = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3]  # resumed at step 2, one more step
    after = load_file(str(work / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "out")
    assert all(torch.equal(model.state_dict()[k], after[k]) for k in after)
    meta = json.loads((tmp_path / "out" / "training.json").read_text())
    assert meta["step"] == 3 and "--curriculum 3:3" in meta["train_command"]


def test_trainer_rejects_bad_curriculum():
    from raincheck_hf.quality.train import parse_curriculum

    assert parse_curriculum("3:10,10:5") == [(3, 10), (10, 5)]
    for bad in ("3-10", "12:5", "3:0", ""):
        with pytest.raises(ValueError, match="curriculum"):
            parse_curriculum(bad)


# ---- evaluation data and scorers ------------------------------------------------------------

def test_jsonl_loader(tmp_path):
    from raincheck_hf.eval import get_scorer, load_jsonl

    dialogue(1, 4).image().save(tmp_path / "a.png")
    rows = [
        {"id": "one", "images": ["a.png"], "turns": [{"question": "what ?", "answer": "red", "kind": "text", "note": 1},
                                                      {"question": "and ?", "answer": "Blue"}]},
        {"turns": [{"question": "text only ?", "answer": "yes"}]},
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = load_jsonl(tmp_path / "d.jsonl")
    assert [d.uid for d in got] == ["one", "d-2"]
    assert got[0].turns[0].extra == {"note": 1} and got[0].turns[1].kind == "text"
    assert got[0].load_images()[0].size == (128, 128)
    assert get_scorer("exact")(got[0].turns[1], " blue ")["correct"] == 1
    assert get_scorer("contains")(got[0].turns[0], "it is red.")["correct"] == 1
    (tmp_path / "bad.jsonl").write_text(json.dumps({"images": ["missing.png"], "turns": [{"question": "q", "answer": "a"}]}))
    with pytest.raises(ValueError, match="bad.jsonl:1.*missing.png"):
        load_jsonl(tmp_path / "bad.jsonl")
    (tmp_path / "bad2.jsonl").write_text(json.dumps({"turns": [{"question": "q"}]}))
    with pytest.raises(ValueError, match="turn 0"):
        load_jsonl(tmp_path / "bad2.jsonl")
    with pytest.raises(ValueError, match="scorer"):
        get_scorer("nope")


# ---- the bundled models on a fixed subset ---------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_bundled_model_learned_the_task_and_raincheck_recovers(family):
    """full >= 95% per fact; on follow-ups full >= raincheck > hard (retention 0.3, uniform selection)."""
    from raincheck_hf.eval import evaluate, get_scorer, glyph_dialogues
    from raincheck_hf.eval.harness import accuracy
    from raincheck_hf.quality import load_bundled

    model, processor = load_bundled(family)
    dialogues = glyph_dialogues("test", limit=12)
    runs = evaluate(model, processor, dialogues, modes=("full", "hard", "raincheck"), selectors=("uniform",),
                    scorer=get_scorer("glyph"), progress=None)
    full, hard, rc = (accuracy(runs[k]) for k in ("full/-", "hard/uniform", "raincheck/uniform"))
    facts = sum(r["total"] for d in runs["full/-"] for r in d)
    correct = sum(r["correct"] for d in runs["full/-"] for r in d)
    assert facts > 150 and correct / facts >= 0.95
    assert full["follow_up"] >= rc["follow_up"] > hard["follow_up"] + 0.15
    assert rc["first_list"] > hard["first_list"]


def test_recovery_and_merging_results_split_over_processes():
    from raincheck_hf.eval.__main__ import markdown, merge
    from raincheck_hf.eval.harness import summarize

    def run(hits):  # one dialogue per entry: a follow-up fact and a 4-item first-turn list
        return [[{"turn": 0, "category": "first_list", "correct": l, "total": 4},
                 {"turn": 1, "category": "follow_up", "correct": f, "total": 1}] for l, f in hits]

    runs = {"full/-": run([(4, 1)] * 4), "hard/uniform": run([(1, 0)] * 4),
            "raincheck/uniform": run([(4, 1), (3, 1), (4, 0), (3, 1)])}
    summary = summarize(runs, bootstrap=200)
    rec = summary["recovery"]["raincheck/uniform"]
    assert rec["follow_up"]["ratio"] == pytest.approx(0.75) and rec["first_list"]["ratio"] == pytest.approx(10 / 12)
    lo, hi = rec["follow_up"]["ci95"]
    assert 0 <= lo <= 0.75 <= hi <= 1
    base = {"model": "m", "data": "glyph:test", "dialogues": 4, "uids": list("abcd"), "elapsed_s": 1.0,
            "settings": {"retention": 0.3, "chunk_size": 31, "decode_guard": 16, "margin": 2, "scorer": "glyph"}}
    a = dict(base, command="a", runs={k: runs[k] for k in ("full/-", "hard/uniform")},
             settings=dict(base["settings"], selectors=["uniform"], modes=["full", "hard"]))
    b = dict(base, command="b", runs={"raincheck/uniform": runs["raincheck/uniform"]},
             settings=dict(base["settings"], selectors=["uniform"], modes=["raincheck"]))
    merged = merge([a, b], bootstrap=200)
    assert merged["summary"]["accuracy"] == summary["accuracy"] and merged["command"] == ["a", "b"]
    assert "raincheck | uniform" in markdown([merged])
    with pytest.raises(ValueError, match="model"):
        merge([a, dict(b, model="other")])
    # full / hard runs do not depend on the restoration settings: they merge with a run under another guard ...
    b4 = dict(b, settings=dict(b["settings"], decode_guard=4, restore_order="attention"))
    merged4 = merge([a, b4], bootstrap=200)
    assert merged4["settings"]["decode_guard"] == 4 and merged4["settings"]["restore_order"] == "attention"
    assert merged4["summary"]["accuracy"] == summary["accuracy"]
    # ... but two results that restore must agree on them
    with pytest.raises(ValueError, match="decode_guard"):
        merge([a, b, dict(b4, runs={"post_answer/uniform": runs["raincheck/uniform"]})])


def test_eval_cli_on_a_saved_checkpoint_and_user_jsonl(tmp_path):
    """`--model PATH` (what a Hub id resolves to) with user data and a custom scorer, end to end."""
    from raincheck_hf.eval.__main__ import main
    from raincheck_hf.eval.scoring import get_scorer
    from raincheck_hf.tiny import build_tiny_processor, build_tiny_qwen3_vl, draw_test_image

    build_tiny_qwen3_vl(seed=0).save_pretrained(tmp_path / "model")
    build_tiny_processor().save_pretrained(tmp_path / "model")
    draw_test_image(128, 96, seed=3).save(tmp_path / "photo.png")
    row = {"id": "photo", "images": ["photo.png"],
           "turns": [{"question": "What is in this image?", "answer": "blocks"}, {"question": "And now?", "answer": "yes"}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(row) + "\n")
    assert get_scorer("raincheck_hf.eval.scoring:exact_scorer") is get_scorer("exact")
    main(["run", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "d.jsonl"), "--modes", "full,hard,raincheck",
          "--selectors", "uniform", "--scorer", "raincheck_hf.eval.scoring:contains_scorer", "--bootstrap", "10",
          "--json", str(tmp_path / "out.json"), "--markdown", str(tmp_path / "out.md")])
    out = json.loads((tmp_path / "out.json").read_text())
    assert set(out["runs"]) == {"full/-", "hard/uniform", "raincheck/uniform"} and out["uids"] == ["photo"]
    records = out["runs"]["raincheck/uniform"][0]
    assert [r["category"] for r in records] == ["first_text", "follow_up"]
    assert records[0]["selected"] > 0 and records[0]["deferred"] > 0
    assert "raincheck | uniform" in (tmp_path / "out.md").read_text()


def test_levers_cli_runs_full_and_hard_once_and_each_lever(tmp_path):
    """`python -m raincheck_hf.eval levers`: one table row per ORDER/GUARD/CHUNK against the same full / hard runs."""
    from raincheck_hf.eval.__main__ import main, parse_lever

    assert parse_lever("attention/4/31") == {"restore_order": "attention", "decode_guard": 4, "chunk_size": 31}
    assert parse_lever("source/1/15/4") == {"restore_order": "source", "decode_guard": 1, "chunk_size": 15,
                                            "chunk_every": 4}
    for bad, match in (("source/4", "ORDER/GUARD/CHUNK"), ("source/x/31", "integers"),
                       ("sideways/4/31", "restore_order"), ("source/-1/31", "decode_guard"),
                       ("source/1/31/0", "chunk_every"), ("source/1/2/3/4", "ORDER/GUARD/CHUNK")):
        with pytest.raises(ValueError, match=match):
            parse_lever(bad)
    main(["levers", "--model", "qwen3_vl", "--data", "glyph:dev", "--limit", "2", "--selectors", "uniform",
          "--levers", "source/16/31,relevance/0/31,source/1/3/4", "--bootstrap", "10", "--json", str(tmp_path / "l.json"),
          "--markdown", str(tmp_path / "l.md")])
    out = json.loads((tmp_path / "l.json").read_text())
    assert set(out["base"]["runs"]) == {"full/-", "hard/uniform"}
    assert [e["lever"]["decode_guard"] for e in out["levers"]] == [16, 0, 1]
    for entry in out["levers"]:
        assert set(entry["runs"]) == {"raincheck/uniform"}
        assert "first_list" in entry["summary"]["recovery"]["raincheck/uniform"]
    # the list answer (turn 1 of the first dialogue): guard 0 restores during the whole answer, guard 16 later
    restored = [e["runs"]["raincheck/uniform"][0][0]["restored_during_answer"] for e in out["levers"]]
    assert restored[1] >= restored[0] > 0
    table = (tmp_path / "l.md").read_text()
    assert "| relevance | 0 | 31 |" in table and "| source | 1 | 3 every 4 |" in table
    assert "levers --model qwen3_vl" in table
    # chunks of 3 every 4th step: restored on forwards 1, 5, 9, ... only
    spaced = out["levers"][2]["runs"]["raincheck/uniform"][0][0]
    assert 0 < spaced["restored_during_answer"] <= restored[1]
