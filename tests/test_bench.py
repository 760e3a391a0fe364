"""The latency benchmark harness on CPU: structure of its JSON, never its wall-clock values."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys

import pytest
import torch

from raincheck_hf.bench import latency, plot, shapes

EXPECTED_VARIANTS = {"stock_dynamic", "stock_static", "stock_static_reused", "full", "hard", "post_answer",
                     "raincheck c=7", "serial c=7"}
ANSWER, TURNS = 4, 2


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "latency.json"
    # guard 1 so that chunks ride along within a 4-token answer
    out = latency.run(models=("tiny_qwen3_vl",), inputs=("image",), turns=TURNS, answer_tokens=ANSWER, reps=1,
                      chunk_sizes=(7,), decode_guard=1, warmup_tokens=2, json_path=str(path), strict=True, device="cpu",
                      log=lambda *a, **k: None)
    with open(path) as f:
        written = json.load(f)
    assert written["runs"][0]["variants"].keys() == out["runs"][0]["variants"].keys()
    return written


def test_json_has_every_variant_with_positive_numbers(result):
    assert result["benchmark"] == "latency"
    for key in ("date", "command", "hardware", "settings", "runs"):
        assert key in result
    hw = result["hardware"]
    assert hw["torch"] == torch.__version__ and hw["transformers"] and hw["cpu"] and hw["gpu"] is None
    (run,) = result["runs"]
    assert run["status"] == "ok" and run["model"] == "tiny_qwen3_vl" and run["input"] == "image"
    assert run["prompt"]["visual_tokens"] > 0 and run["prompt"]["prompt_tokens"] > run["prompt"]["visual_tokens"]
    assert set(run["variants"]) == EXPECTED_VARIANTS
    for name, entry in run["variants"].items():
        assert entry["status"] == "ok", (name, entry["status"])
        (rep,) = entry["reps"]
        assert len(rep["turns"]) == TURNS
        for turn in rep["turns"]:
            assert turn["generated_tokens"] == ANSWER and turn["streamed_tokens"] == ANSWER, name
            for key in ("ttft_s", "tpot_s", "e2e_s"):
                assert turn[key] > 0, (name, key)
            assert turn["ttft_s"] <= turn["e2e_s"]
            assert turn["peak_mem_bytes"] is None  # CPU
        assert len(rep["turns"][0]["token_intervals_ms"]) == ANSWER - 1
        idle = rep["idle"]
        assert idle["ttft_s"] > 0 and idle["restore_s"] >= 0
        med = entry["median"]
        for key in ("t1_s", "tpot1_s", "e2e1_s", "t2_s", "tpot2_s", "t2_idle_s", "t2_barrier_s", "e2e_total_s"):
            assert med[key] > 0, (name, key)
        assert entry["ratio_to_stock_dynamic"]["t1_s"] > 0 and entry["ratio_to_full"]["t1_s"] > 0
    assert run["variants"]["stock_dynamic"]["ratio_to_stock_dynamic"]["t1_s"] == pytest.approx(1.0)
    floor = run["memory_floor"]
    assert floor["bandwidth_bytes_per_s"] > 0 and floor["floor_s"] > 0
    assert floor["total_bytes"] == floor["weight_bytes"] + floor["kv_bytes"] + floor["linear_state_bytes"]
    assert floor["context_tokens"] == run["prompt"]["prompt_tokens"] + ANSWER // 2
    for entry in run["variants"].values():
        assert entry["tpot_plain_over_floor"] > 0
    assert run["lengths"] == {"consistent": True, "mismatches": []}
    assert "stock_static" in run["warmup"] and run["warmup"]["stock_static"]["compiled"] is False  # no compile on CPU
    for name, entry in run["variants"].items():  # the library's default compile_steps, uncompiled on CPU
        if entry["kind"] == "raincheck":
            assert entry["config"]["compile_steps"] is None, name
            assert all(t["steps_compiled"] is False for t in entry["reps"][0]["turns"]), name


def test_restoration_counts_follow_the_modes(result):
    variants = result["runs"][0]["variants"]
    first = {name: entry["reps"][0]["turns"][0] for name, entry in variants.items()}
    deferred = first["post_answer"]["deferred_tokens"]
    assert deferred > 0 and first["full"]["deferred_tokens"] == 0
    assert first["hard"]["dropped_tokens"] == deferred and first["hard"]["pending_after"] == 0
    assert first["post_answer"]["restored_during_answer"] == 0 and first["post_answer"]["pending_after"] == deferred
    for name in ("raincheck c=7", "serial c=7"):
        assert first[name]["restored_during_answer"] > 0 and first[name]["steps_with_chunk"] > 0
        assert first[name]["tpot_restoring_s"] > 0
        idle = variants[name]["reps"][0]["idle"]
        assert idle["restored_tokens"] == first[name]["pending_after"]  # what complete() would restore
    # the follow-up right after the answer prefills the leftovers together with the new turn
    second = variants["post_answer"]["reps"][0]["turns"][1]
    assert second["restored_in_prefill"] == deferred
    assert variants["post_answer"]["reps"][0]["idle"]["restored_in_prefill"] == 0


def test_real_shapes_match_the_baselines():
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3VLForConditionalGeneration

    tok = shapes.build_processor().tokenizer
    for cls, config, params in ((Qwen3VLForConditionalGeneration, shapes.qwen3_vl_8b_config(tok), 8.767e9),
                                (Qwen3_5ForConditionalGeneration, shapes.qwen3_5_9b_config(tok), 9.410e9)):
        with torch.device("meta"):
            model = cls._from_config(config, dtype=torch.bfloat16)
        assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=1e-3)
        assert config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
        assert config.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
        assert config.get_text_config().vocab_size > len(tok)
    text = shapes.qwen3_vl_8b_config(tok).text_config
    assert (text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (36, 32, 8, 128)
    with pytest.raises(ValueError, match="needs a GPU"):
        shapes.build_model("qwen3_vl_8b", "cpu")


def test_real_image_prompt_has_1344_visual_tokens():
    processor = shapes.build_processor()
    inputs, info = shapes.build_prompt(processor, shapes.MODELS["qwen3_vl_8b"], "image")
    assert info["grid_thw"] == [1, 64, 84] and info["visual_tokens"] == 1344
    assert inputs["input_ids"].shape[1] == info["prompt_tokens"]


def test_fast_random_init_builds_a_working_model():
    from transformers import Qwen3VLForConditionalGeneration

    from raincheck_hf.tiny import build_tiny_qwen3_vl, tiny_qwen3_vl_config

    model = shapes.build_from_config(Qwen3VLForConditionalGeneration, tiny_qwen3_vl_config(), "cpu", torch.float32)
    reference = build_tiny_qwen3_vl()
    for (name, buf), (_, ref) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.equal(buf, ref), name  # RoPE frequencies as __init__ computes them
    assert all(torch.isfinite(p).all() for p in model.parameters())
    inputs, _ = shapes.build_prompt(shapes.build_processor(), shapes.MODELS["tiny_qwen3_vl"], "image")
    with torch.no_grad():
        assert torch.isfinite(model(**inputs).logits).all()


def test_invalid_settings_fail_before_any_compute():
    with pytest.raises(ValueError, match="unknown model"):
        latency.run(models=("nope",))
    with pytest.raises(ValueError, match="chunk_size"):
        latency.run(chunk_sizes=(0,))
    with pytest.raises(ValueError, match="--variants"):
        latency.build_variants((7,), 7, 1, 1, only=["nope"])


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_plot_writes_pngs(result, tmp_path):
    paths = plot.plot([result, result], str(tmp_path))  # several files: one panel per run of each
    assert {p.rsplit("/", 1)[-1] for p in paths} >= {"ttft.png", "tpot.png", "chunk_sweep.png", "fused_vs_serial.png",
                                                     "follow_up.png"}
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_install(result, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot.plot(result, str(tmp_path))
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    assert plot.main([str(path), "--out", str(tmp_path / "figs")]) == 1
    assert "pip install matplotlib" in capsys.readouterr().err


def test_gdn_state_map_benchmark_smoke():
    from raincheck_hf.bench.gdn_state_map import run

    result = run(heads=2, dk=4, dv=3, gdn_layers=2, iters=2, device="cpu")
    assert [r["op"] for r in result["rows"]] == ["join (one layer)", "online update, 1 token (one layer)"]
    assert all(r["eager_us"] > 0 and r["graph_us"] is None for r in result["rows"])
    assert result["memory_per_layer_bytes"]["M (suffix map, fp32)"] == 2 * 4 * 4 * 4


def test_gdn_kernel_benchmark_runs_the_references_on_cpu(tmp_path):
    from raincheck_hf.bench import gdn

    path = tmp_path / "gdn.json"
    result = gdn.run("cpu", iters=2, replays=2, json_path=str(path), log=lambda *a: None)
    saved = json.loads(path.read_text())
    assert saved["benchmark"] == "gdn_kernels" and saved["hardware"]["device"] == "cpu"
    assert [(r["op"], r["impl"]) for r in result["rows"]] == [(op, "reference") for op in gdn.OPS]
    assert all(r["eager_us"] > 0 and r["graph_us"] is None for r in result["rows"])
    assert result["shape"]["conv_channels"] == 2 * 2 * 32 + 4 * 32
    with pytest.raises(SystemExit):
        gdn.main(["--iters", "0"])
    subset = gdn.run("cpu", iters=2, replays=2, log=lambda *a: None, ops=["join", "conv_update"])
    assert [r["op"] for r in subset["rows"]] == ["join", "conv_update"]
    with pytest.raises(SystemExit):
        gdn.main(["--ops", "join,nope"])
    with pytest.raises(ValueError, match="ops must be"):
        gdn.run("cpu", iters=2, ops=[])


def test_profile_tool_stages_add_up_on_cpu(tmp_path):
    from raincheck_hf.bench import profile

    path = tmp_path / "profile.json"
    out = profile.run("tiny_qwen3_vl", "image", modes=("full", "raincheck"), tokens=20, replays=2, decode_guard=2,
                      chunk_size=4, json_path=str(path), log=lambda *a, **k: None)
    assert json.loads(path.read_text())["modes"].keys() == {"full", "raincheck"}
    for mode, entry in out["modes"].items():
        s = entry["stages"]
        # the first token comes after HF's preparation, the encoding, selection and the prefill (all synced)
        parts = s["hf_before_loop_s"] + s["encode_turn_s"] + s["selection_s"] + s["prefill_forward_s"]
        assert 0 < parts <= s["first_token_s"] <= s["total_s"]
        assert s["vision_tower_s"] > 0 and s["vision_tower_s"] <= s["encode_turn_s"]
        assert entry["replay_s"] == {} and entry["profiler"] == {}  # CUDA only
        # the unsynced call: every stage up to the first token, in the host's order, host times only on a CPU
        line = entry["timeline"]
        stages = [r["stage"] for r in line["stages"]]
        assert stages.count("forward") == 1 and "vision_tower" in stages
        # after the forward's start, up to the first token: the plan (the selection read, inside the forward on the
        # eager engine: its visibility needs the rows' sources), the sampling and the next step's rows
        after = stages[stages.index("forward") + 1:]
        assert after[0] == "plan" and after[-2:] == ["sample", "decode_step"]
        assert ("pending_rows" in after) == (mode == "raincheck")  # this turn's deferred rows, after the launch
        assert stages.index("encode_turn") < stages.index("selection") < stages.index("forward")
        starts = [r["host_start_ms"] for r in line["stages"]]
        assert starts == sorted(starts) and all(r["host_end_ms"] >= r["host_start_ms"] for r in line["stages"])
        assert 0 < line["hf_before_loop_ms"] <= starts[0]
        assert line["stages"][-1]["host_end_ms"] <= line["first_token_ms"]
        assert not any("device_start_ms" in r for r in line["stages"])
    assert out["modes"]["raincheck"]["stages"]["decode_forward_chunk_median_s"] is not None
    assert out["modes"]["full"]["stages"]["decode_forward_chunk_median_s"] is None


def test_first_tokens_side_by_side_run_each_variant_in_turn_with_its_setup():
    """`profile.first_tokens_side_by_side` (the first-token scripts of benchmarks/): warm-up calls, then rounds in
    which every variant runs once, its setup called before each of its calls; `timeline_summary` prints every stage."""
    from raincheck_hf import RaincheckConfig
    from raincheck_hf.bench import profile

    model, info, inputs, prompt = shapes.image_turn("tiny_qwen3_vl", "cpu")
    assert prompt["kind"] == "image" and inputs["input_ids"].shape[1] == prompt["prompt_tokens"]
    order = []

    @contextlib.contextmanager
    def around():  # a setup's context manager: entered around that variant's call
        order.append("in")
        yield
        order.append("out")

    full = profile.first_token_kwargs(inputs, RaincheckConfig(mode="full"))
    variants = {"full": (full, lambda: order.append("full")), "stock": (profile.first_token_kwargs(inputs), None),
                "static": (profile.first_token_kwargs(inputs, RaincheckConfig(fast_path=True)), around)}
    times = profile.first_tokens_side_by_side(model, torch.device("cpu"), variants, reps=2, warm_up=1)
    assert set(times) == set(variants) and all(len(t) == 2 and min(t) > 0 for t in times.values())
    assert order == ["full", "in", "out"] * 3  # one warm-up and two rounds
    lines = []
    rows = profile.t1_rows({"full": [2.0, 4.0, 3.0], "stock": [6.0], "mmtok": [1.5]},
                           log=lambda text, **kw: lines.append(text))
    assert rows["mmtok"] == {"median": 1.5, "reps": [1.5], "x_full": 0.5, "x_stock": 0.25}
    assert rows["full"]["x_full"] == 1.0 and lines[2] == "[t1] mmtok: 1.50 ms, x full 0.500, x stock 0.250"
    assert "x_stock" not in profile.t1_rows({"full": [1.0]}, log=lambda *a, **k: None)["full"]
    with torch.no_grad():
        line = profile.timeline(model, torch.device("cpu"), variants["full"][0])
        static = profile.timeline(model, torch.device("cpu"), variants["static"][0])
    text = profile.timeline_summary("full", line)
    assert text.startswith("[timeline] full: first token") and all(r["stage"] in text for r in line["stages"])
    assert " host " not in profile.timeline_summary("full", line, host=False)
    # the finer marks between the selection and the prefill: the rows, the plan, the deferred ones; on the static
    # cache the plan (a step run eagerly, as on a CPU: its sources first), the slots and the graph buffers' fill
    # inside the forward, the deferred rows after it
    stages = [r["stage"] for r in static["stages"]]
    assert stages.index("selection") < stages.index("rows") < stages.index("forward") < stages.index("plan")
    assert stages.index("plan") < stages.index("assign_slots") < stages.index("fill") < stages.index("pending_rows")
    assert "pending_rows" not in [r["stage"] for r in line["stages"]]
    # and after the forward's launch, up to the first token: the sampling, the next step's rows and its fill
    assert stages.index("fill") < stages.index("sample") < stages.index("decode_step") < stages.index("prepare")


def test_compile_twins_force_the_setting_and_run_only_when_named():
    """The plain variants take the library's default (or --compile-steps / --no-compile-steps); the twins force
    compile_steps whatever that says, and run only when named (by name or family)."""
    twins = {"full_uncompiled": False, "raincheck_uncompiled c=31": False, "full_compiled": True,
             "raincheck_compiled c=31": True}
    assert not set(twins) & {v.name for v in latency.build_variants((7, 31), 31, 1, 1)}
    named = latency.build_variants((7, 31), 31, 1, 1, only=["full", "full_uncompiled", "raincheck_uncompiled",
                                                            "full_compiled", "raincheck_compiled c=31"])
    assert [v.name for v in named] == ["full", *twins]
    settings = dict(retention=0.3, decode_guard=16, selector="mmtok")
    for flag in (None, True, False):
        for v in named:
            config = v.config(dict(settings, compile_steps=flag))
            assert config.compile_steps is twins.get(v.name, flag), (v.name, flag)
            assert (config.mode, config.chunk_size) == (v.mode, 31)


@pytest.mark.parametrize("argv, want", [([], None), (["--compile-steps"], True), (["--no-compile-steps"], False)])
def test_bench_compile_steps_flags_are_tri_state(monkeypatch, argv, want):
    from raincheck_hf.bench import profile

    seen = {}
    monkeypatch.setattr(latency, "run", lambda **kw: seen.setdefault("latency", kw["compile_steps"]))
    monkeypatch.setattr(profile, "run", lambda *a, **kw: seen.setdefault("profile", kw["compile_steps"]))
    latency.main(argv)
    profile.main(argv)
    assert seen == {"latency": want, "profile": want}


def test_slow_first_warmup_is_repeated(monkeypatch):
    monkeypatch.setattr(latency, "SLOW_FIRST_WARMUP_S", 0.0)  # every first call counts as slow
    out = latency.run(models=("tiny_qwen3_vl",), inputs=("image",), turns=1, answer_tokens=2, reps=1, chunk_sizes=(7,),
                      variants=["full", "stock_dynamic"], warmup_tokens=2, device="cpu", strict=True,
                      log=lambda *a, **k: None)
    warmup = out["runs"][0]["warmup"]
    assert warmup["other_repeated_s"].keys() == warmup["other_s"].keys() == {"full", "stock_dynamic"}


def test_a_spaced_chunk_size_is_a_variant_of_its_own():
    out = latency.run(models=("tiny_qwen3_vl",), inputs=("image",), turns=1, answer_tokens=8, reps=1,
                      chunk_sizes=("3", "3/3"), variants=["raincheck"], warmup_tokens=2, device="cpu", strict=True,
                      log=lambda *a, **k: None)
    run = out["runs"][0]
    spaced = run["variants"]["raincheck c=3/3"]
    assert spaced["config"]["chunk_size"] == 3 and spaced["config"]["chunk_every"] == 3
    assert run["variants"]["raincheck c=3"]["config"]["chunk_every"] == 1
    turn = spaced["reps"][0]["turns"][0]
    assert turn["chunk_sizes_chosen"] and turn["steps_with_chunk"] <= 3  # forwards 1, 4, 7 of 7
    assert latency.parse_chunk_spec("63/1") == 63 and latency.split_chunk_spec("63/10") == (63, 10)
    with pytest.raises(ValueError, match="chunk_every"):
        latency.run(models=("tiny_qwen3_vl",), chunk_sizes=("auto/2",))


def test_several_answer_lengths_are_a_run_each_on_one_model(tmp_path):
    path = str(tmp_path / "latency_{answer_tokens}.json")
    out = latency.run(models=("tiny_qwen3_vl",), inputs=("image",), turns=1, answer_tokens=[2, 5], reps=1,
                      chunk_sizes=(7,), variants=["full", "raincheck"], warmup_tokens="answer", warm_up_api=True,
                      device="cpu", strict=True, json_path=path, log=lambda *a, **k: None)
    assert [r["settings"]["answer_tokens"] for r in out] == [2, 5]
    for n, result in zip((2, 5), out):
        saved = json.loads((tmp_path / f"latency_{n}.json").read_text())
        assert saved["settings"]["answer_tokens"] == saved["settings"]["warmup_tokens"] == n
        run = saved["runs"][0]
        assert run["lengths"]["consistent"] and run["status"] == "ok"
        assert set(run["warmup"]["api"]) == {"full", "raincheck c=7"}  # warm_up per Raincheck variant
        assert run["timed_captures"] == {"full": 0, "raincheck c=7": 0}
        assert all(rep["turns"][0]["generated_tokens"] == n for rep in run["variants"]["full"]["reps"])
    with pytest.raises(ValueError, match="answer_tokens"):
        latency.run(models=("tiny_qwen3_vl",), answer_tokens=[2, 5], json_path=str(tmp_path / "one.json"))
    with pytest.raises(ValueError, match="answer_tokens"):
        latency.run(models=("tiny_qwen3_vl",), answer_tokens=[2, 2])


def test_attention_benchmark_reports_both_variants_and_their_difference(tmp_path):
    from raincheck_hf.bench import attention

    path = tmp_path / "attention.json"
    result = attention.run(rows=(1, 5), slots=(40,), heads=4, kv_heads=2, dim=16, layers=2, reps=2,
                           device="cpu", json_path=str(path), log=lambda *_: None, batches=(1, 3))
    assert [(e["batch"], e["rows"], e["slots"]) for e in result["results"]] == [(1, 1, 40), (1, 5, 40), (3, 1, 40),
                                                                                 (3, 5, 40)]
    for e in result["results"]:
        assert set(e["median_s"]) == {"sdpa", "few_query", "few_query_matmul", "few_query_upcast"}
        assert all(t > 0 for t in e["median_s"].values())
        assert e["max_abs_diff"] <= 1e-5
    assert json.loads(path.read_text())["shape"]["kv_heads"] == 2
    with pytest.raises(SystemExit):
        attention.main(["--heads", "6", "--kv-heads", "4"])


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_decode_bytes_count_what_a_step_reads(family, model, qwen35):
    m = model if family == "qwen3_vl" else qwen35
    text = m.config.get_text_config()
    embed, head = m.get_input_embeddings().weight, m.get_output_embeddings().weight
    got = latency.decode_bytes(m, context_tokens=100)
    every = sum(p.numel() * p.element_size() for p in m.parameters())
    visual = sum(p.numel() * p.element_size() for p in m.model.visual.parameters())
    table = 0 if embed is head else embed.numel() * embed.element_size()  # a step reads one row of it
    assert got["weight_bytes"] == every - visual - table
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    full = sum(k == "full_attention" for k in kinds)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    assert got["kv_bytes"] == 2 * full * text.num_key_value_heads * head_dim * embed.element_size() * 100
    assert (got["linear_state_bytes"] > 0) == (family == "qwen3_5")



def test_bench_selectors_json(tmp_path):
    from raincheck_hf.bench import selectors

    path = tmp_path / "selectors.json"
    result = selectors.run("bundled_qwen3_vl", "cpu", ("image",), reps=1, warmup=0, t1=True, t1_reps=1,
                           out=str(path), log=lambda *a: None)
    saved = json.loads(path.read_text())
    assert saved["benchmark"] == "selectors" and saved["date"] and saved["hardware"]["device"] == "cpu"
    rows = {(r["selector"], r["variant"]): r for r in saved["rows"]}
    assert set(rows) == {(s, "default") for s in selectors.SELECTORS} | {(s, "reference") for s in selectors.GREEDY}
    for r in saved["rows"]:
        assert r["tokens"] == 100 and r["device"] == "cpu" and r["median_ms"] > 0 and r["kept"] == 30
    t1 = {r["variant"]: r for r in result["t1_rows"]}
    assert set(t1) == {"stock", "full", *selectors.SELECTORS}
    assert t1["full"]["x_full"] == 1.0 and t1["stock"]["x_stock"] == 1.0


def test_auto_chunk_size_in_the_sweep(tmp_path):
    """``--chunk-sizes ...,auto`` runs chunk_size="auto" beside the fixed sizes; the JSON says which sizes it chose."""
    lines = []
    out = latency.run(models=("tiny_qwen3_vl",), inputs=("image",), turns=2, answer_tokens=ANSWER, reps=1,
                      chunk_sizes=(7, latency.parse_chunk_size(" auto")), decode_guard=1,
                      warmup_tokens=2, strict=True, device="cpu", variants=["raincheck"], tpot_slack=0.05,
                      json_path=str(tmp_path / "auto.json"), log=lines.append)
    variants = out["runs"][0]["variants"]
    assert set(variants) == {"raincheck c=7", "raincheck c=auto"}
    auto = variants["raincheck c=auto"]
    assert auto["chunk_size"] == "auto" and auto["config"]["chunk_size"] == "auto"
    assert out["settings"]["tpot_slack"] == 0.05
    turn = auto["reps"][0]["turns"][0]
    # no timings on a CPU: the smallest ladder size every step after the guard
    assert turn["chunk_sizes_chosen"] == {"7": turn["steps_with_chunk"]} and turn["steps_with_chunk"] > 0
    assert variants["raincheck c=7"]["reps"][0]["turns"][0]["chunk_sizes_chosen"] == {"7": turn["steps_with_chunk"]}
    assert turn["decode_captures"] == []  # no CUDA graphs on a CPU
    assert any("chunk sizes chosen" in line for line in lines)
    assert any(line.startswith("warm-up (first call") and "raincheck c=auto" in line for line in lines)
    with pytest.raises(ValueError):
        latency.parse_chunk_size("big")


def test_batch_benchmark_rows_ratios_and_exact_lengths(tmp_path):
    from raincheck_hf.bench import batch

    path = tmp_path / "batch.json"
    result = batch.run("tiny_qwen3_vl", [1, 2], ["raincheck", "full", "raincheck_eager", "stock"], answer_tokens=3,
                       reps=1, device="cpu", json_path=str(path), log=lambda *a: None)
    assert json.loads(path.read_text())["benchmark"] == "batch"
    rows = {(r["variant"], r["batch"]): r for r in result["rows"]}
    # eager-only variants run at B = 1 only; every other variant at every batch size
    assert set(rows) == {("raincheck", 1), ("full", 1), ("raincheck_eager", 1), ("stock", 1),
                         ("raincheck", 2), ("full", 2), ("stock", 2)}
    for r in rows.values():
        assert r["exact_lengths"] and r["tokens_per_s"] > 0 and r["tpot_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 3 / r["e2e_s"])
    two = rows[("raincheck", 2)]
    assert two["tokens_per_s_over_b1"] == pytest.approx(two["tokens_per_s"] / rows[("raincheck", 1)]["tokens_per_s"])
    assert two["tokens_per_s_over_eager_b1"] == pytest.approx(
        two["tokens_per_s"] / rows[("raincheck_eager", 1)]["tokens_per_s"])
    assert two["tpot_over_full"] == pytest.approx(two["tpot_s"] / rows[("full", 2)]["tpot_s"])
    assert two["tokens_per_s_over_stock"] == pytest.approx(two["tokens_per_s"] / rows[("stock", 2)]["tokens_per_s"])
    assert "tpot_over_full" not in rows[("full", 2)]
    assert result["settings"]["batch_chunk_rows"] is None


def test_batch_benchmark_profiles_a_call_per_row(tmp_path):
    """``--profile``: two more calls per row under torch.profiler, the whole call and its decode steps alone (from the
    first token, per step); on CPU their top operators by self time and no device figures."""
    from raincheck_hf.bench import batch

    result = batch.run("tiny_qwen3_vl", [2], ["raincheck"], answer_tokens=3, reps=1, device="cpu",
                       json_path=str(tmp_path / "batch.json"), log=lambda *a: None, profile=True)
    (row,) = result["rows"]
    prof = row["profile"]
    assert result["settings"]["profile"] is True
    assert prof["wall_s"] > 0 and prof["device_s"] is None and prof["host_waits"] == 0
    assert 0 < len(prof["top"]) <= 30 and all(t["calls"] >= 1 and t["self_s"] >= 0 for t in prof["top"])
    assert prof["top"] == sorted(prof["top"], key=lambda t: -t["self_s"])
    assert any(t["name"] in ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul") for t in prof["top"])
    # the decode steps alone (no prompt encoding or prefill: a shorter time than the whole call's), per step
    decode = row["decode_profile"]
    assert decode["steps"] == 2 and decode["device_s"] is None and decode["per_step_ms"]["device"] is None
    assert decode["per_step_ms"]["wall"] == pytest.approx(decode["wall_s"] * 1e3 / 2)
    assert 0 < decode["wall_s"] < prof["wall_s"]
    assert decode["top"] and decode["top"] == sorted(decode["top"], key=lambda t: -t["self_s"])
    assert all(t["per_step_ms"] == pytest.approx(t["self_s"] * 1e3 / 2) for t in decode["top"])


def test_batch_benchmark_takes_the_shared_chunk_budget(tmp_path, monkeypatch):
    """``--batch-chunk-rows`` reaches the raincheck / full variants' configs (``none``: no sharing) and the JSON."""
    from raincheck_hf.bench import batch

    seen = []
    time_call = batch.time_call
    monkeypatch.setattr(batch, "time_call", lambda model, device, inputs, kwargs: (
        seen.append(kwargs["raincheck"].batch_chunk_rows) if "raincheck" in kwargs else None,
        time_call(model, device, inputs, kwargs))[1])
    for arg, want in (("none", None), ("8", 8)):
        seen.clear()
        result = batch.main(["--model", "tiny_qwen3_vl", "--batch", "2", "--variants", "raincheck", "--answer-tokens",
                             "2", "--reps", "1", "--device", "cpu", "--batch-chunk-rows", arg])
        assert seen == [want, want] and result["settings"]["batch_chunk_rows"] == want
    # several side by side: each raincheck / full variant once per cap (the first under its own name), stock once,
    # raincheck over the full of its own cap
    seen.clear()
    result = batch.main(["--model", "tiny_qwen3_vl", "--batch", "2", "--variants", "raincheck,full,stock",
                         "--answer-tokens", "2", "--reps", "1", "--device", "cpu", "--batch-chunk-rows", "none,8"])
    assert seen == [None, None, 8, 8, None, None, 8, 8]
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["raincheck", "raincheck_cap8", "full", "full_cap8", "stock"]
    assert [rows[v].get("batch_chunk_rows", "-") for v in rows] == [None, 8, None, 8, "-"]
    assert result["settings"]["batch_chunk_rows"] == [None, 8]
    assert rows["raincheck_cap8"]["tpot_over_full"] == pytest.approx(
        rows["raincheck_cap8"]["tpot_s"] / rows["full_cap8"]["tpot_s"])
    assert batch.cap_suffix(None, 8) == "_uncapped" and batch.cap_suffix(64, None) == "_cap64"
    with pytest.raises(SystemExit):
        batch.main(["--batch-chunk-rows", "many"])
    with pytest.raises(ValueError, match="distinct"):
        batch.run("tiny_qwen3_vl", [1], ["raincheck"], batch_chunk_rows=[8, 8])


@pytest.mark.parametrize("kwargs, word", [({"batches": [0]}, "--batch"), ({"variants": ["fast"]}, "--variants"),
                                          ({"answer_tokens": 1}, "--answer-tokens"),
                                          ({"batch_chunk_rows": 0}, "--batch-chunk-rows")])
def test_batch_benchmark_refuses_bad_settings_before_building(kwargs, word, monkeypatch):
    from raincheck_hf.bench import batch

    monkeypatch.setattr(batch, "build_model", lambda *a, **k: pytest.fail("built a model"))
    args = {"batches": [1], "variants": ["stock"], "answer_tokens": 4, "batch_chunk_rows": 64}
    args.update(kwargs)
    with pytest.raises(ValueError, match=word):
        batch.run("tiny_qwen3_vl", args["batches"], args["variants"], args["answer_tokens"], device="cpu",
                  batch_chunk_rows=args["batch_chunk_rows"])


def _load_script(name: str):
    """A script of ``benchmarks/`` imported as a module (it is not part of the package)."""
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_spy_summary_counts_each_threads_functions_inclusively_once_per_stack(tmp_path, capsys):
    spy = _load_script("spy_summary")
    raw = tmp_path / "spy.txt"
    raw.write_text(
        "thread (1): loop;run (a/loop.py:10);step (a/engine.py:5);step (a/engine.py:7) 6\n"
        "thread (1): loop;run (a/loop.py:10);choose (a/loop.py:40) 4\n"
        "thread (2): io;select (selectors.py:3) 9\n"
        "\n")
    rows = spy.summarize(spy.parse(raw.read_text().splitlines()))
    assert [r["thread"] for r in rows] == ["thread (1): loop", "thread (2): io"]  # (the most sampled first)
    loop = {f: (n, share) for f, n, share in rows[0]["functions"]}
    assert loop["run loop.py"] == (10, 1.0) and loop["step engine.py"] == (6, 0.6)  # (two lines of step: once)
    assert loop["choose loop.py"] == (4, 0.4)
    (under,) = spy.summarize(spy.parse(raw.read_text().splitlines()), thread="loop", under="step")
    assert under["samples"] == 6 and under["functions"] == [["step engine.py", 6, 1.0]]
    (own,) = spy.summarize(spy.parse(raw.read_text().splitlines()), thread="loop", own=True)
    assert own["functions"] == [["step engine.py", 6, 0.6], ["choose loop.py", 4, 0.4]]
    assert spy.main([str(raw), "--thread", "nobody"]) == 1
    assert spy.main([str(raw), "--json", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["threads"][1]["samples"] == 9
    with pytest.raises(ValueError, match="no sample count"):
        spy.parse(["thread (1): x;f (a.py:1) many"])


def test_prepare_syncs_reports_each_first_turns_preparation(tmp_path, capsys):
    """`benchmarks/prepare_syncs.py` on a CPU (no synchronization to count): one row per first turn with its
    preparation's times, the JSON with the command."""
    script = _load_script("prepare_syncs")
    path = tmp_path / "syncs.json"
    assert script.main(["--image-size", "128x96", "--turns", "2", "--json", str(path)]) == 0
    written = json.loads(path.read_text())
    assert [r["turn"] for r in written["rows"]] == [0, 1] and written["command"].startswith("python benchmarks/")
    assert all(r["wall_ms"] > 0 and r["syncs"] == 0 for r in written["rows"]) and written["device"] == "cpu"
    assert "synchronizing calls" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        script.main(["--image-size", "12x9"])


def test_fuzz_stress_runs_the_threaded_cases_and_reports_each_difference(capsys, monkeypatch):
    """`benchmarks/fuzz_stress.py` on a CPU: the family's fuzz cases alone, then all at once in threads until its
    time is up, each run compared with its eager twin; a run that differs is printed with its seed and counted. Its
    switches (each takes a suspect away) run, and leave the classes they patched as they were."""
    import schedule_fuzz

    import raincheck_hf.fast.static_cache as static_cache

    script, rounding = _load_script("fuzz_stress"), static_cache.SLOT_ROUNDING
    assert script.main(["--family", "qwen2_5_vl", "--seconds", "0.2", "--cases", "2"]) == 0
    assert static_cache.SLOT_ROUNDING == rounding  # (its small storages for its run only: the process as it was)
    last = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert last[:2] == ["own", "iterations"] and int(last[2]) >= 1 and last[3:] == ["failed", "cases", "0"]
    compare, calls = schedule_fuzz.compare, []

    def differing(case, got, want, atol=1e-3, rtol=0.0):
        calls.append(case.seed)
        return compare(case, got, want, atol, rtol) + (["turn 1: a difference (a test's)"] if len(calls) > 2 else [])

    monkeypatch.setattr(schedule_fuzz, "compare", differing)
    assert script.main(["--seconds", "0.2", "--cases", "2", "--restore-order", "source"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("source iteration 1 seed 2000") and "a test's" in line for line in out), out
    assert out[-1].startswith("source iterations") and int(out[-1].split()[-1]) == 2 * int(out[-1].split()[2])
    monkeypatch.setattr(schedule_fuzz, "compare", compare)
    import raincheck_hf.fast.graphs as graphs
    import raincheck_hf.fast.vision_graphs as vision_graphs

    inits = graphs.StepGraphs.__init__, vision_graphs.VisionGraphs.__init__
    assert script.main(["--seconds", "0.2", "--cases", "2", "--no-step-graphs", "--no-vision-graphs",
                        "--one-at-a-time", "--device-work", "--tag", "switches"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("failed cases 0")
    assert (graphs.StepGraphs.__init__, vision_graphs.VisionGraphs.__init__) == inits  # (put back)


def test_token_clock_waits_for_the_device_only_for_a_token_still_on_it(monkeypatch):
    """The benchmarks' `TokenClock` times a token when ``put`` is handed it. Host tensors (what every generate loop
    here hands over, read after their step) are not waited for: the batched engine launches its next step before it
    hands over this step's tokens, and a device-wide wait there held the host until that next step had ended. A
    token still on a device is synchronized first."""
    from raincheck_hf.bench import latency

    waits = []
    monkeypatch.setattr(latency, "_sync", lambda device: waits.append(device))
    clock = latency.TokenClock(torch.device("cuda"))
    clock.put(torch.tensor([[1, 2, 3]]))  # the prompt: not a token
    clock.put(torch.tensor([4, 5]))
    assert waits == [] and len(clock.times) == 1
    clock.put(torch.empty(2, dtype=torch.long, device="meta"))  # (a tensor not on the host)
    assert waits == [torch.device("cuda")] and len(clock.times) == 2
    assert clock.times[0] <= clock.times[1]


def test_batch_benchmark_times_each_row_again_with_the_old_clock_when_asked(tmp_path):
    """``--clock-check``: each row's call timed again with a device-wide wait at every token (`SyncedClock`, the
    clock until 2026-12-06), side by side in the row."""
    from raincheck_hf.bench import batch

    result = batch.main(["--model", "tiny_qwen3_vl", "--batch", "2", "--variants", "raincheck,stock", "--answer-tokens",
                         "3", "--reps", "1", "--device", "cpu", "--clock-check", "--json", str(tmp_path / "b.json")])
    assert result["settings"]["clock_check"] is True
    for row in result["rows"]:  # (each run's captures from its traces: none on a CPU, none for stock)
        assert [(r["captures"], r["capture_s"]) for r in row["runs"]] == [(0, 0)]
    for row in result["rows"]:
        synced = row["synced_clock"]
        assert set(synced) == {"e2e_s", "ttft_s", "tpot_s", "tokens_per_s"}
        assert synced["tokens_per_s"] == pytest.approx(2 * 3 / synced["e2e_s"])
    plain = batch.run("tiny_qwen3_vl", [2], ["raincheck"], answer_tokens=2, reps=1, device="cpu", log=lambda *a: None)
    assert "synced_clock" not in plain["rows"][0] and plain["settings"]["clock_check"] is False


def test_batch_benchmark_counts_the_captures_its_calls_traces_report():
    """`bench.batch.time_call` gives each call's CUDA-graph captures from its traces (one trace at B = 1, a list at
    B > 1): how many and their seconds, so a first timed call that still captured shows why it was slow."""
    from types import SimpleNamespace

    from raincheck_hf.bench import batch

    class Model:
        def __init__(self, traces):
            self.traces = traces

        def generate(self, input_ids, streamer, **kwargs):
            streamer.put(input_ids)
            for _ in range(3):
                streamer.put(torch.tensor([7]))
            return SimpleNamespace(sequences=torch.zeros(1, input_ids.shape[1] + 3), raincheck=self.traces)

    inputs = {"input_ids": torch.zeros(1, 5, dtype=torch.long)}
    one = SimpleNamespace(captures=[(0, 512, 0.125), (3, 32, 0.25)])
    run = batch.time_call(Model(one), torch.device("cpu"), inputs, {})
    assert (run["captures"], run["capture_s"], run["generated_tokens"], run["steps"]) == (2, 0.375, 3, 3)
    run = batch.time_call(Model([one, SimpleNamespace(captures=[])]), torch.device("cpu"), inputs, {})
    assert (run["captures"], run["capture_s"]) == (2, 0.375)
    run = batch.time_call(Model(None), torch.device("cpu"), inputs, {})
    assert (run["captures"], run["capture_s"]) == (0, 0)


def test_kernel_categories_sum_a_profiles_kernels_by_kind_per_step(tmp_path, capsys):
    """`benchmarks/kernel_categories.py`: a `bench batch --profile` row's listed kernels summed by kind (per step for
    a decode profile), host-side operators left out (their kernels are listed on their own), what the list leaves of
    the device time as ``unlisted``; rows without the profile skipped, a CPU row's figures None."""
    cats = _load_script("kernel_categories")
    top = [{"name": "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", "calls": 10, "self_s": 0.010},
           {"name": "void cublasLt::splitKreduce_kernel<32, 16, int, float>", "calls": 10, "self_s": 0.002},
           {"name": "few_query_split", "calls": 4, "self_s": 0.003},
           {"name": "aten::_cudnn_attention_forward", "calls": 2, "self_s": 0.004},
           {"name": "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "calls": 2, "self_s": 0.004},
           {"name": "recurrent_step", "calls": 8, "self_s": 0.005},
           {"name": "join", "calls": 2, "self_s": 0.001},
           {"name": "mmtok_gain", "calls": 3, "self_s": 0.0005},
           {"name": "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "calls": 8, "self_s": 0.002},
           {"name": "Memcpy DtoD (Device -> Device)", "calls": 5, "self_s": 0.001},
           {"name": "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add>", "calls": 5,
            "self_s": 0.0015},
           {"name": "some_unknown_kernel", "calls": 1, "self_s": 0.0005}]
    rows = [{"variant": "raincheck", "batch": 8, "profile": {"device_s": 0.040, "top": top},
             "decode_profile": {"device_s": 0.040, "steps": 4, "top": top}},
            {"variant": "full", "batch": 1},
            {"variant": "full", "batch": 2, "profile": {"device_s": None, "top": top}}]
    path = tmp_path / "batch.json"
    path.write_text(json.dumps({"rows": rows}))
    table = cats.main([str(path), "--profile", "decode_profile"])
    (row,) = table
    assert row["per"] == "step" and row["total"] == pytest.approx(10.0)
    want = {"gemm": 3.0, "attention": 1.75, "gdn": 1.5, "selection": 0.125, "compiled": 0.5, "copies": 0.25,
            "elementwise": 0.375, "other": 0.125}
    for k, v in want.items():
        assert row[k] == pytest.approx(v), k
    assert row["unlisted"] == pytest.approx(10.0 - sum(want.values()))
    whole = cats.main([str(path)])
    assert [r["batch"] for r in whole] == [8, 2] and whole[0]["per"] == "call"
    assert whole[0]["gemm"] == pytest.approx(12.0) and whole[1]["total"] is None and whole[1]["unlisted"] is None
    assert "ms/call" in capsys.readouterr().out


def test_large_results_are_written_compactly_and_read_back_the_same(tmp_path, monkeypatch):
    monkeypatch.setattr(latency, "COMPACT_ABOVE", 2_000)
    small, large = {"rows": [{"ttft_s": 0.1}]}, {"rows": [{"ttft_s": k / 7, "client": k} for k in range(200)]}
    for name, result in (("small", small), ("large", large)):
        latency._write(result, str(tmp_path / f"{name}.json"))
        assert json.loads((tmp_path / f"{name}.json").read_text()) == result
    assert "\n " in (tmp_path / "small.json").read_text()  # indented
    text = (tmp_path / "large.json").read_text()
    assert text.count("\n") == 1 and ", " not in text and len(text) < len(json.dumps(large, indent=1)) * 0.8
