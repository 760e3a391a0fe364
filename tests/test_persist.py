"""The persistent cache folder (`raincheck_hf.persist`): its manifest keyed by versions, GPU and CUDA; stale or
corrupt entries set aside, never used; `cache info` / `cache clear`; the environment it sets (only what the user
has not). Plus the CLI's warm-up options and the cold-start benchmark's harness, on CPU."""

from __future__ import annotations

import json
import os

import pytest

from raincheck_hf import persist
from raincheck_hf.__main__ import main

ENV = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_AUTOTUNING")


@pytest.fixture
def clean_env(monkeypatch):
    for name in ENV + ("RAINCHECK_CACHE_DIR",):
        # set first, so that monkeypatch records the old state (absent too) and puts it back after the test, also
        # over what `enable_persistent_caches` wrote into os.environ
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    yield


def test_a_fresh_folder_gets_a_manifest_that_matches(tmp_path):
    current, set_aside = persist.prepare(tmp_path)
    assert set_aside is None and current == tmp_path / "current"
    manifest = json.loads((current / persist.MANIFEST).read_text())
    assert manifest["fingerprint"] == persist.fingerprint()
    assert set(manifest["fingerprint"]) >= {"torch", "triton", "fla", "transformers", "raincheck_hf", "gpu", "cuda"}
    assert persist.check(current, persist.fingerprint()) is None
    assert persist.prepare(tmp_path) == (current, None)  # a second start keeps it


@pytest.mark.parametrize("change", ["torch", "gpu", "cuda", "raincheck_hf"])
def test_entries_built_by_other_versions_are_set_aside_and_rebuilt(tmp_path, change):
    current, _ = persist.prepare(tmp_path)
    (current / "triton").mkdir()
    (current / "triton" / "kernel.bin").write_bytes(b"old kernel")
    other = dict(persist.fingerprint(), **{change: "something else"})
    assert persist.check(current, other) == f"built with another {change}"
    current2, (stale, reason) = persist.prepare(tmp_path, other)
    assert current2 == current and reason == f"built with another {change}"
    assert stale.parent == tmp_path / "stale" and (stale / "triton" / "kernel.bin").read_bytes() == b"old kernel"
    assert not (current / "triton").exists()  # the new folder starts empty ...
    assert json.loads((current / persist.MANIFEST).read_text())["fingerprint"] == other  # ... with its own manifest


@pytest.mark.parametrize("manifest", [b"{not json", b"[1, 2]", b'{"fingerprint": 3}', None])
def test_a_corrupt_or_missing_manifest_is_never_trusted(tmp_path, manifest):
    current = tmp_path / "current"
    current.mkdir()
    (current / "inductor.bin").write_bytes(b"x")
    if manifest is not None:
        (current / persist.MANIFEST).write_bytes(manifest)
    reason = persist.check(current, persist.fingerprint())
    assert reason == ("no manifest" if manifest is None else "unreadable manifest")
    _, (stale, why) = persist.prepare(tmp_path)
    assert why == reason and (stale / "inductor.bin").exists() and not (current / "inductor.bin").exists()


def test_enable_sets_only_the_environment_the_user_has_not(tmp_path, clean_env, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    caches = persist.enable_persistent_caches(tmp_path / "cache")
    assert os.environ["TRITON_CACHE_DIR"] == str((tmp_path / "cache").resolve() / "current" / "triton")
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")  # the user's own setting wins
    assert caches.user_env == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "mine")}
    assert set(caches.env) == {"TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING"}
    assert persist.enable_persistent_caches(tmp_path / "cache") is caches  # once per folder per process


def test_default_folder(clean_env, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert persist.default_cache_dir() == tmp_path / "xdg" / "raincheck_hf"
    monkeypatch.setenv("RAINCHECK_CACHE_DIR", str(tmp_path / "set"))
    assert persist.default_cache_dir() == tmp_path / "set"


def test_corrupt_compile_artifacts_are_set_aside(tmp_path, clean_env, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # (the file is read only then)
    current, _ = persist.prepare(tmp_path)
    (current / persist.ARTIFACTS).write_bytes(b"truncated garbage")
    with pytest.warns(RuntimeWarning, match="could not be loaded"):
        caches = persist.enable_persistent_caches(tmp_path)
    assert not caches.loaded_artifacts and not (current / persist.ARTIFACTS).exists()
    assert any(p.name.endswith(persist.ARTIFACTS) for p in (tmp_path / "stale").iterdir())


@pytest.mark.parametrize("own", [None, "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"])
def test_compile_artifacts_are_saved_and_loaded_only_where_the_caches_live_elsewhere(tmp_path, clean_env, monkeypatch,
                                                                                      own):
    """With the folder's own inductor / triton directories the compiled entries are already there, so the artifacts
    file is neither written nor read (a second process would only write each entry again); with a directory of the
    user's own it is both, and what was saved is what is loaded."""
    import torch

    if own is not None:
        monkeypatch.setenv(own, str(tmp_path / "mine"))
    saved, loaded = b"artifacts of an earlier process", []
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (saved, None))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: loaded.append(data) or object())
    monkeypatch.setattr(persist, "_ENABLED", {})
    caches = persist.enable_persistent_caches(tmp_path / "cache")
    assert persist.artifacts_needed(caches) == (own is not None)
    path = persist.save_compile_artifacts(tmp_path / "cache")
    assert (path is not None) == (own is not None)
    assert (caches.entries / persist.ARTIFACTS).exists() == (own is not None)
    (caches.entries / persist.ARTIFACTS).write_bytes(saved)  # (a file left there either way)
    # as a new process; the environment the first start set stays, and a directory that is the folder's own does not
    # count as the user's
    monkeypatch.setattr(persist, "_ENABLED", {})
    again = persist.enable_persistent_caches(tmp_path / "cache")
    assert again.loaded_artifacts == (own is not None)
    assert loaded == ([saved] if own is not None else [])


def test_cache_info_and_clear(tmp_path, capsys):
    folder = tmp_path / "c"
    assert main(["cache", "info", "--cache-dir", str(folder)]) == 0
    assert "does not exist yet" in capsys.readouterr().out
    current, _ = persist.prepare(folder, dict(persist.fingerprint(), torch="0.0"))
    (current / "triton").mkdir()
    (current / "triton" / "k").write_bytes(b"0" * 2048)
    (folder / "README.txt").write_text("not ours")
    assert main(["cache", "info", "--cache-dir", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "torch 0.0" in out and "matches this installation: no (built with another torch" in out
    persist.prepare(folder)  # sets the mismatching entries aside
    assert main(["cache", "info", "--cache-dir", str(folder)]) == 0
    assert "stale/" in capsys.readouterr().out
    assert main(["cache", "clear", "--cache-dir", str(folder)]) == 0
    assert "cleared" in capsys.readouterr().out
    assert sorted(p.name for p in folder.iterdir()) == ["README.txt"]  # only our entries go


@pytest.mark.parametrize("argv", [["chat", "--warm-up-tokens", "1"], ["serve", "--warm-up-tokens", "0"]])
def test_warm_up_tokens_checked_before_loading(argv, capsys, monkeypatch):
    if argv[0] == "serve":
        pytest.importorskip("uvicorn")
    import raincheck_hf.__main__ as cli

    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("loaded before checking"))
    assert main(argv) == 2
    assert "--warm-up-tokens must be >= 2, got" in capsys.readouterr().err


def test_chat_warms_up_unless_told_not_to(monkeypatch, capsys):
    import raincheck_hf.__main__ as cli
    import raincheck_hf.warmup as warmup

    calls = []
    real = warmup.warm_up
    monkeypatch.setattr(warmup, "warm_up", lambda *a, **k: calls.append(k) or real(*a, **k))
    argv = ["chat", "--model", "tiny", "--question", "hi", "--max-new-tokens", "2", "--device", "cpu"]
    assert cli.main(argv) == 0
    assert len(calls) == 1 and calls[0]["max_new_tokens"] == 2 and calls[0]["max_tokens"] == 4096
    assert calls[0]["image_sizes"] == [(192, 256)] and calls[0]["progress"] is True
    assert cli.main(argv + ["--no-warm-up"]) == 0
    assert len(calls) == 1


def test_cold_start_harness_on_cpu(tmp_path, monkeypatch):
    """One child in this process (a tiny model on CPU, its first answer), and the parent's report from children
    stood in by that child's result (fresh processes cost imports, which this test does not need to pay)."""
    import subprocess
    import sys

    from raincheck_hf.bench import cold_start

    child = ["--child", "--launched-at", "0", "--model", "tiny_qwen3_vl", "--device", "cpu", "--cache-dir",
             str(tmp_path / "c"), "--max-tokens", "512", "--max-new-tokens", "2"]
    import io
    from contextlib import redirect_stdout

    buffer = io.StringIO()
    with redirect_stdout(buffer):
        assert cold_start.main(child) == 0
    result = json.loads(buffer.getvalue().strip().splitlines()[-1])
    assert result["answer_tokens"] == 2 and result["captures_during_answer"] == []
    assert result["tpot_s"] == pytest.approx(result["first_answer_s"] - result["first_token_s"])  # (one token after)
    assert result["warm_up"]["path"] == "eager" and result["warm_up"]["captures"]["each"] == []
    assert result["first_token_s"] <= result["first_answer_s"] <= result["rest_done_s"]
    assert result["imports_s"] <= result["caches_s"] <= result["device_s"] <= result["model_s"]
    # (the default scope, the chat's: the first turn's warm-up, then the rest after the answer, timed apart)
    assert result["warm_up_scope"] == "first" and result["rest"]["graphs_captured"] == 0
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        assert cold_start.main(child + ["--warm-up-scope", "all"]) == 0
    everything = json.loads(buffer.getvalue().strip().splitlines()[-1])
    assert everything["warm_up_scope"] == "all" and everything["rest"] is None and "rest_done_s" not in everything
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        assert cold_start.main(child + ["--no-rest", "--compile-steps", "off", "--profile-warm-up",
                                        "--compile-ahead", "off"]) == 0
    answered = json.loads(buffer.getvalue().strip().splitlines()[-1])
    assert answered["warm_up_scope"] == "first" and answered["rest"] is None and "rest_done_s" not in answered
    assert answered["compile_ahead"] == "off" and result["compile_ahead"] == "on"
    assert result["warm_up"]["compiled_ahead"] == 0 and result["warm_up_triton"] is None  # (CPU: no Triton compile)
    assert result["warm_up_profile"] is None  # (where the warm-up's time went: only when asked)
    profile = answered["warm_up_profile"]
    assert any("warm_up" in row[0] for row in profile["by_cumulative"]) and isinstance(profile["compile_times"], dict)
    assert isinstance(result["compile_times"], dict)  # (torch's compile-time table: always)
    assert result["preload_compiler"] is False and "compiler_preloaded_s" not in result  # (on CUDA only)
    imports = result["warm_up_imports"]  # (the modules the warm-up imported first: counted per package)
    assert imports["modules"] == sum(p["imported"] for p in imports["by_package"].values())
    assert all(0 <= p["without_bytecode"] <= p["imported"] for p in imports["by_package"].values())
    assert all(len(row) == 4 and row[3] >= row[2] >= 0 for row in profile["by_own"])
    launched, kept = [], []

    def fake_run(command, env, timeout):
        assert command[:3] == [sys.executable, "-m", "raincheck_hf.bench.cold_start"] and "--child" in command
        assert command[command.index("--warm-up-scope") + 1] == "first"
        assert not any(name in env for name in ENV)  # each child finds only the cache folder
        launched.append(command[command.index("--cache-dir") + 1])
        kept.append(command)
        return subprocess.CompletedProcess(command, 0, stdout="noise\n" + json.dumps(result) + "\n", stderr="")

    monkeypatch.setattr(cold_start, "_launch", fake_run)
    out = tmp_path / "cold.json"
    report = cold_start.run("tiny_qwen3_vl", processes=3, device="cpu", max_tokens=512, max_new_tokens=2,
                            out=str(out))
    assert len(launched) == 3 and len(set(launched)) == 1  # one folder, empty for the first
    saved = json.loads(out.read_text())
    assert saved["benchmark"] == "cold_start" and saved["hardware"]["device"] == "cpu"
    assert saved["settings"]["answer_tokens"] == 2 and len(saved["later"]) == 2
    assert [p["cache"] for p in report["processes"]] == ["empty (first ever)"] + ["left by the processes before"] * 2
    assert saved["settings"]["warm_up_scope"] == "first" and saved["settings"]["rest_after_answer"]
    cold_start.run("tiny_qwen3_vl", processes=2, device="cpu", max_tokens=512, max_new_tokens=2, rest=False,
                   compile_steps="off", profile_warm_up=True)
    assert all("--no-rest" in c and c[c.index("--compile-steps") + 1] == "off" for c in kept[-2:])
    assert all("--profile-warm-up" in c for c in kept[-2:]) and not any("--profile-warm-up" in c for c in kept[:3])
    assert all("--compile-steps" not in c for c in kept[:3])  # (the default settings' unless asked)
    assert [c[c.index("--preload-compiler") + 1] for c in kept] == ["off"] * 5  # (as the CLI does, by default)
    assert [c[c.index("--compile-ahead") + 1] for c in kept] == ["on"] * 5  # (as warm_up does, by default)
    cold_start.run("tiny_qwen3_vl", processes=2, device="cpu", max_tokens=512, max_new_tokens=2, compile_ahead="off")
    assert [c[c.index("--compile-ahead") + 1] for c in kept[-2:]] == ["off"] * 2
    with pytest.raises(ValueError, match="--compile-ahead"):
        cold_start.run("tiny_qwen3_vl", compile_ahead="maybe")
    cold_start.run("tiny_qwen3_vl", processes=4, device="cpu", max_tokens=512, max_new_tokens=2,
                   preload_compiler="both")
    assert [c[c.index("--preload-compiler") + 1] for c in kept[-4:]] == ["off", "on", "off", "on"]
    with pytest.raises(ValueError, match="--preload-compiler"):
        cold_start.run("tiny_qwen3_vl", preload_compiler="later")
    with pytest.raises(ValueError, match="--compile-steps"):
        cold_start.run("tiny_qwen3_vl", compile_steps="maybe")
    with pytest.raises(ValueError, match="--processes must be >= 2"):
        cold_start.run("tiny_qwen3_vl", processes=1)
    with pytest.raises(ValueError, match="--warm-up-scope"):
        cold_start.run("tiny_qwen3_vl", warm_up_scope="some")


def test_preload_compiler_imports_torchs_compiler_once_on_a_thread(monkeypatch):
    """`fast.compiled.preload_compiler` imports `COMPILER_MODULES` on one daemon thread per process (the same thread
    on a second call), and a compiled function made afterwards waits for that thread before its first compile."""
    import threading
    import time

    from raincheck_hf.fast import compiled

    monkeypatch.setattr(compiled, "_COMPILED", {})  # (this test's functions leave no entry behind)
    compiled.compiled(lambda x: x + 1)  # (torch.compile's own first call, before the clock matters)
    monkeypatch.setattr(compiled, "_PRELOAD", {})
    gate, imported = threading.Event(), []

    def slow_import():  # (the thread's imports, held until the compiled function is being made)
        gate.wait(timeout=30)
        imported.extend(compiled.COMPILER_MODULES)
        imported.append(time.monotonic())

    monkeypatch.setattr(compiled, "_import_compiler", slow_import)
    thread = compiled.preload_compiler()
    assert thread.daemon and thread.name == "raincheck-preload-compiler" and compiled.preload_compiler() is thread
    made = []

    def make():
        compiled.compiled(lambda x: x + 2)
        made.append(time.monotonic())

    maker = threading.Thread(target=make)
    maker.start()
    maker.join(timeout=0.5)
    gate.set()
    maker.join(timeout=30)
    assert imported[:-1] == list(compiled.COMPILER_MODULES) and not thread.is_alive()
    assert made and made[0] >= imported[-1]  # (made once the thread's imports had ended)
    assert compiled.preload_finished_at() is not None


@pytest.mark.parametrize("batching", [False, True])
def test_serve_warms_up_the_steps_it_runs(batching, monkeypatch):
    """``serve`` warms up before its port opens: the single-sequence steps (one conversation's storages), or with
    ``--batching`` (every turn in the batched engine) only the batched decode steps of up to ``--max-running``
    sequences."""
    uvicorn = pytest.importorskip("uvicorn")
    import raincheck_hf.warmup as warmup

    calls = []
    real = warmup.warm_up
    monkeypatch.setattr(warmup, "warm_up", lambda *a, **k: calls.append(k) or real(*a, **k))
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    argv = ["serve", "--model", "tiny", "--device", "cpu", "--max-running", "6"] + (["--batching"] if batching else [])
    assert main(argv) == 0
    assert len(calls) == 1
    # (--batching: the running answers and the held conversations restoring beside them)
    assert (calls[0]["batch"], calls[0]["conversations"]) == ((8, 0) if batching else (None, 1))


def test_cold_start_splits_the_warm_up_captures_by_kind_and_first_sighting():
    from raincheck_hf.bench.cold_start import capture_figures

    captured = [(2048, 32, True, None, 1536, 0.5), (2048, 32, True, None, 1792, 0.2), (2048, 512, True, None, 512, 0.3),
                (4096, 32, True, None, 4096, 0.1), (4096, 512, True, None, 512, 0.2), (2048, 32, True, "v", 1536, 0.4)]
    figures = capture_figures(captured, step_rows=32)
    groups = figures["groups"]
    assert groups["step_first"]["count"] == 2 and groups["step_first"]["total_s"] == pytest.approx(0.9)  # 2 variants
    assert groups["step_again"] == {"count": 2, "total_s": pytest.approx(0.3), "median_s": pytest.approx(0.15)}
    assert groups["prefill_first"]["count"] == 1 and groups["prefill_again"]["count"] == 1
    assert figures["total_s"] == pytest.approx(1.7) and figures["each"][2] == [2048, 512, 512, 0.3]


def test_cold_start_records_triton_compiles_and_autotuning(tmp_path, monkeypatch):
    """`TritonRecord`: each kernel's compiles and cache hits through Triton's compilation listener (a kernel compiled
    for a CUDA target on this CPU, then found in the cache), the listener before it kept and put back, and an
    autotuned kernel's last tuning and its keys read from its module (once, though two modules hold it)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.autotuner import Autotuner
    import types
    import sys

    from raincheck_hf.bench.cold_start import TritonRecord

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    import triton.language as tl

    @triton.jit
    def _double(x, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x + i, tl.load(x + i, mask=i < n) * 2, mask=i < n)

    seen = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **kw: seen.append(kw["cache_hit"]))
    tuned = Autotuner(_double, _double.arg_names, [triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})],
                      ["n"], None, None)
    tuned.bench_time, tuned.configs_timings = 1.25, {c: [1.0] for c in tuned.configs}
    tuned.cache = {(64, "torch.float32"): tuned.configs[0], (128, "torch.bfloat16"): tuned.configs[1]}
    module = types.ModuleType("raincheck_hf._recorded_kernels")
    module.tuned = triton.heuristics({"UNUSED": lambda args: 0})(tuned)  # (found under another wrapper, as fla's)
    again = types.ModuleType("raincheck_hf._recorded_kernels_again")  # (the same tuner imported by another module)
    again.tuned = module.tuned
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(sys.modules, again.__name__, again)
    record = TritonRecord.start()
    src = ASTSource(_double, {"x": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 16})
    for _ in range(2):
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    figures = record.figures()
    assert seen == [False, True]  # (the listener before it still heard both)
    assert triton.knobs.compilation.listener is not record
    assert figures["compiled"] == 1 and figures["cached"] == 1 and figures["compile_s"] > 0
    assert list(figures["kernels"]) == ["_double"] and figures["kernels"]["_double"]["compiled"] == 1
    assert figures["autotuned"] == {"raincheck_hf._recorded_kernels._double": {
        "configs": 2, "seconds": 1.25, "keys": {"(64, 'torch.float32')": str(tuned.configs[0]),
                                                "(128, 'torch.bfloat16')": str(tuned.configs[1])}}}


def test_cold_start_records_how_far_a_process_past_its_limit_got(tmp_path, monkeypatch, capsys):
    """A process that passes ``--timeout``: its marks as it wrote them (each mark goes to stderr as it is set), no
    later process, and the JSON written with what there is."""
    import subprocess

    from raincheck_hf.bench import cold_start

    marks = cold_start._Marks()
    marks["imports_s"] = 1.25
    marks["model_s"] = 6.5
    written = capsys.readouterr().err
    assert "[cold-start-mark] imports_s 1.250" in written and "[cold-start-mark] model_s 6.500" in written
    assert cold_start.marks_from(written.encode() + b"noise\n[cold-start-mark] broken x\n") == {
        "imports_s": 1.25, "model_s": 6.5}
    launched = []

    def slow(command, env, timeout):
        launched.append(command)
        raise subprocess.TimeoutExpired(command, timeout, output=b"", stderr=written.encode())

    monkeypatch.setattr(cold_start, "_launch", slow)
    out = tmp_path / "cold.json"
    report = cold_start.run("tiny_qwen3_vl", processes=3, device="cpu", max_tokens=512, max_new_tokens=2,
                            out=str(out), timeout=12.0)
    assert len(launched) == 1  # (its cache is partial: no later process)
    saved = json.loads(out.read_text())
    assert saved["processes"] == report["processes"] == [
        {"imports_s": 1.25, "model_s": 6.5, "process": 0, "timed_out_after_s": 12.0, "cache": "empty (first ever)"}]
    assert saved["first_ever"] == {"first_token_s": None, "first_answer_s": None, "warm_up_done_s": None}
    assert "passed its 12-s limit; its last mark: model_s at 6.5 s" in capsys.readouterr().err
