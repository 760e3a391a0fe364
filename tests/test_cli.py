"""The CLI (``python -m raincheck_hf chat``) as a user drives it: ``--interactive`` through a pipe,
its error handling, its help, and the fast failure of a checkpoint that is not here.

The bundled model's replayed dialogues are tested in `tests/test_demo.py` (in-process).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from raincheck_hf.__main__ import CheckpointError, locate_checkpoint, main, printable, turn_summary
from raincheck_hf.generation import RaincheckTrace
from raincheck_hf.tiny import draw_test_image

ROOT = Path(__file__).resolve().parents[1]


def run_chat(*argv, stdin: str = "", env: dict | None = None, timeout: float = 300):
    """``python -m raincheck_hf chat ARGV`` in a subprocess, ``stdin`` through a pipe."""
    environment = {**os.environ, "PYTHONIOENCODING": "utf-8", **(env or {})}
    done = subprocess.run([sys.executable, "-m", "raincheck_hf", "chat", *argv], input=stdin, capture_output=True,
                          text=True, encoding="utf-8", cwd=ROOT, env=environment, timeout=timeout)
    return done.returncode, done.stdout, done.stderr


def test_interactive_errors_keep_the_session_and_commands_are_not_sent(tmp_path):
    good, text_file = tmp_path / "photo.png", tmp_path / "notes.txt"
    draw_test_image(96, 64, seed=2).save(good)
    text_file.write_text("not a picture")
    lines = ["/help", f"/image {tmp_path / 'missing.png'}", f"/image {text_file}", "/frobnicate now",
             f"/image {good}", "what is in this image?", "and now?", "/grid 99", "/quit", "never asked"]
    code, out, err = run_chat("--model", "tiny", "--interactive", "--max-new-tokens", "6", "--idle-wait", "2",
                              stdin="\n".join(lines) + "\n")
    assert code == 0, err
    assert out.startswith("[raincheck] interactive chat") and "/image PATH" in out and "/quit" in out  # the banner
    assert out.count("Commands: /image PATH") == 3  # banner, /help, the unknown command
    assert "there is no file" in out and "missing.png" in out
    assert "notes.txt' is not a readable image" in out
    assert "unknown command '/frobnicate now' (not sent to the model)" in out
    assert "attached to the next question: a generated 256x192 test image, photo.png (2 pending)" in out
    assert out.count("assistant> ") == 2  # the two questions, nothing else reached the model
    stats = [line for line in out.splitlines() if line.startswith("  [")]
    assert "visual tokens 54" in stats[0]  # 48 (the default test image) + 6 (photo.png)
    assert any("no new visual tokens" in line for line in stats)  # the follow-up
    assert "/grid N: N must be in [0, 63]" in out
    assert "never asked" not in out  # /quit ended the session
    assert "tpot nan" not in out
    control = {c for c in out if ord(c) < 32 and c not in "\n\t"}
    assert not control, f"raw control characters reached the terminal: {control}"
    assert "RANDOM weights" in err and "Traceback" not in err


def test_a_bad_image_on_the_command_line_is_a_clear_error(tmp_path):
    code, out, err = run_chat("--model", "tiny", "--image", str(tmp_path / "nope.jpg"), "--question", "hi")
    assert code == 2 and "--image: there is no file" in err and "Traceback" not in err


def test_a_hub_id_that_is_not_here_fails_at_once_offline(tmp_path):
    code, _, err = run_chat("--model", "raincheck-tests/not-a-model", env={"HF_HUB_OFFLINE": "1",
                                                                           "HF_HOME": str(tmp_path / "hf")})
    assert code != 0 and "Traceback" not in err
    assert "not in the Hugging Face cache" in err and "HF_HUB_OFFLINE" in err
    assert "qwen3_vl" in err and "local folder" in err


def test_locate_checkpoint(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="without config.json"):
        locate_checkpoint(str(empty))
    with pytest.raises(CheckpointError, match="there is no folder"):
        locate_checkpoint(str(tmp_path / "missing"))
    (empty / "config.json").write_text("{}")
    assert locate_checkpoint(str(empty)) == (str(empty), True)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(CheckpointError, match="HF_HUB_OFFLINE"):
        locate_checkpoint("raincheck-tests/not-a-model")


def test_figures_line_without_a_tpot_and_control_bytes_escaped():
    trace = RaincheckTrace(mode="raincheck", selected=torch.empty(0, dtype=torch.long),
                           deferred=torch.empty(0, dtype=torch.long))
    from raincheck_hf.conversation import TurnResult

    one = TurnResult(text="a", token_ids=torch.tensor([5]), trace=trace, time_to_first_token=0.01, token_times=[],
                     restored_during_answer=0)
    line = turn_summary(one)
    assert "nan" not in line and "1 token, no tpot" in line and "no new visual tokens" in line
    none = TurnResult(text="", token_ids=torch.empty(0, dtype=torch.long), trace=trace,
                      time_to_first_token=float("nan"), token_times=[], restored_during_answer=0)
    assert "nan" not in turn_summary(none) and "no tokens" in turn_summary(none)
    assert printable("ok\x00\x1b[2J\té\n\u200b") == "ok\\x00\\x1b[2J\té\n\\u200b"


def test_help_names_every_option_with_its_default_and_choices(capsys):
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    options = text.split("options:", 1)[1]
    for option in ("--model", "--image", "--video", "--question", "--interactive", "--dialogue", "--turns",
                   "--glyphs", "--save-image", "--mode", "--selector", "--retention", "--chunk-size",
                   "--decode-guard", "--max-new-tokens", "--idle-wait", "--compile-steps", "--no-compile-steps",
                   "--device"):
        assert option in options
    for default in ("(default: qwen3_vl)", "(default: 0)", "(default: 2)", "(default: raincheck)", "(default: mmtok)",
                    "(default: 0.3)", "(default: 31)", "(default: 64)", "(default: 5.0)"):
        assert default in options, default
    assert "(default: 1)" in options.split("--decode-guard", 1)[1].split(" --", 1)[0]
    assert "{full,hard,post_answer,raincheck,serial}" in options and "mmtok" in options.split("--selector", 1)[1]
    assert "these machines" not in text and "sandbox" not in text


@pytest.mark.parametrize("argv, want", [([], None), (["--compile-steps"], True), (["--no-compile-steps"], False)])
def test_chat_compile_steps_is_auto_unless_forced(argv, want):
    """Neither flag: RaincheckConfig's default (None: compiled where the steps are captured as CUDA graphs)."""
    import argparse

    from raincheck_hf.__main__ import add_chat_arguments, chat_config

    parser = argparse.ArgumentParser()
    add_chat_arguments(parser)
    config = chat_config(parser.parse_args(["--mode", "serial", *argv]))
    assert config.compile_steps is want and config.mode == "serial"


def test_chat_chunk_every_goes_to_the_config_and_a_bad_one_names_the_option():
    import argparse

    from raincheck_hf.__main__ import add_chat_arguments, chat_config

    parser = argparse.ArgumentParser()
    add_chat_arguments(parser)
    assert chat_config(parser.parse_args([])).chunk_every == 1
    assert chat_config(parser.parse_args(["--chunk-size", "63", "--chunk-every", "10"])).chunk_every == 10
    with pytest.raises(ValueError, match="--chunk-every 2 needs a fixed chunk_size"):
        chat_config(parser.parse_args(["--chunk-size", "auto", "--chunk-every", "2"]))


# ---- the command line before anything loads ------------------------------------------------------

def _imports_after(*argv) -> tuple[int, list[str], str]:
    """Run ``main(argv)`` in a fresh interpreter: its exit code, which of torch / transformers it imported,
    and what it printed."""
    code = ("import sys\nfrom raincheck_hf.__main__ import main\ntry:\n    rc = main(sys.argv[1:])\n"
            "except SystemExit as e:\n    rc = e.code\n"
            "print('IMPORTED', [m for m in ('torch', 'transformers') if m in sys.modules], file=sys.stderr)\n"
            "sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=ROOT, timeout=120)
    imported = done.stderr.rsplit("IMPORTED ", 1)[1].strip()
    return done.returncode, eval(imported), done.stdout + done.stderr.rsplit("IMPORTED ", 1)[0]


@pytest.mark.parametrize("argv", [["--help"], ["chat", "--help"], ["chat", "--selector", "nope"],
                                  ["chat", "--chunk-size", "many"]])
def test_help_and_option_errors_answer_without_importing_torch(argv):
    code, imported, text = _imports_after(*argv)
    assert imported == [], f"{argv} imported {imported} before parsing"
    assert code == (0 if "--help" in argv else 2)
    assert "Traceback" not in text


@pytest.mark.parametrize("argv", [["chat", "--max-new-tokens", "-3"], ["chat", "--turns", "-1"],
                                  ["chat", "--device", "gpu"], ["chat", "--retention", "2"]])
def test_a_bad_option_value_answers_before_transformers_is_imported(argv):
    """The checks that need torch (the device, the config) import it; transformers and the model come after."""
    code, imported, text = _imports_after(*argv)
    assert code == 2 and "transformers" not in imported, f"{argv} imported {imported} before its checks"
    assert text.startswith("[raincheck] --") and text.count("\n") == 1 and "Traceback" not in text


def test_the_top_level_help_lists_the_commands_and_no_help_shows_rest_markup(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "chat" in top and "serve" in top and "COMMAND --help" in top
    assert "Without --model it runs" not in top  # the chat command's own text is under `chat --help`
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    chat_help = capsys.readouterr().out
    assert "Without --model it runs" in chat_help
    for text in (top, chat_help):
        assert "``" not in text and "`" not in text


def test_the_options_written_out_for_the_help_match_the_config():
    from raincheck_hf import MODES, RaincheckConfig, available_selectors
    from raincheck_hf.__main__ import CHAT_DEFAULTS, CHAT_MODES, CHAT_SELECTORS

    assert CHAT_MODES == MODES and list(CHAT_SELECTORS) == available_selectors()
    defaults = RaincheckConfig()
    assert CHAT_DEFAULTS == {name: getattr(defaults, name) for name in CHAT_DEFAULTS}


@pytest.mark.parametrize("argv, message", [
    (["--device", "gpu"], "--device 'gpu' is not a torch device: use cpu, cuda or cuda:N"),
    (["--device", "cuda"], "--device cuda: CUDA is not available"),
    (["--device", "cuda:1"], "--device cuda:1: CUDA is not available"),
    (["--max-new-tokens", "-3"], "--max-new-tokens must be >= 1, got -3"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--turns", "-1"], "--turns must be >= 0"),
    (["--idle-wait", "nan"], "--idle-wait must be a number of seconds >= 0, got nan"),
    (["--retention", "1.5"], "--retention 1.5 must be a number in [0, 1]"),
    (["--chunk-size", "0"], "--chunk-size 0 must be an integer >= 1"),
    (["--decode-guard", "-1"], "--decode-guard -1"),
    (["--tpot-slack", "-0.5"], "--tpot-slack -0.5"),
    (["--dialogue", "64"], "--dialogue must be in [0, 63]"),
    (["--video", "missing.mp4"], "--video: there is no file 'missing.mp4'"),
    (["--image", "missing.png"], "--image: there is no file 'missing.png'"),
    (["--save-image", "grid.txt"], "--save-image 'grid.txt': give a file name ending in an image format's"),
    (["--save-image", "no/such/folder/grid.png"], "there is no folder"),
    (["--model", "./ckpt-folder-that-is-not-here", "--glyphs"], "--glyphs is for --model tiny"),
])
def test_every_bad_option_is_one_line_before_the_model_loads(argv, message, monkeypatch, capsys):
    import raincheck_hf.__main__ as cli

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(cli, "_load", must_not_load)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU machine
    assert main(["chat", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_good_device_passes_the_check(monkeypatch):
    from raincheck_hf.__main__ import check_device

    assert check_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check_device(None) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_device(None) == "cuda" and check_device("cuda:1") == "cuda:1"
    with pytest.raises(ValueError, match=r"there are 2 CUDA devices \(cuda:0 to cuda:1\)"):
        check_device("cuda:2")


def test_chat_captures_the_rest_of_its_warm_up_only_while_it_waits_for_a_question(monkeypatch, capsys):
    """The chat warms only the first turn before the first question (``run_warm_up(..., first_turn=True)``), and
    the rest (its `IdleWarmUp`) runs while the chat waits for a question: resumed before each prompt, paused as
    soon as a question comes and before the process ends; scripted questions come at once, so the rest is
    finished before the second one."""
    import builtins

    import raincheck_hf.__main__ as cli

    events = []

    class Idle:
        def resume(self):
            events.append("resume")

        def pause(self):
            events.append("pause")

        def finish(self):
            events.append("finish")

    def warm(*args, first_turn=False, **kwargs):
        events.append(("warm", first_turn))
        return Idle()

    asked = iter(["what is in this image?", "and now?"])

    def typed(prompt=""):
        events.append("input")
        try:
            return next(asked)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(cli, "run_warm_up", warm)
    monkeypatch.setattr(builtins, "input", typed)
    assert main(["chat", "--model", "tiny", "--interactive", "--max-new-tokens", "2", "--idle-wait", "0"]) == 0
    assert events == [("warm", True)] + ["resume", "input", "pause"] * 3 + ["pause"]
    assert capsys.readouterr().out.count("assistant> ") == 2
    events.clear()
    assert main(["chat", "--model", "tiny", "--question", "a?", "--question", "b?", "--max-new-tokens", "2",
                 "--idle-wait", "0"]) == 0
    assert events == [("warm", True), "finish", "pause"]


def test_bytecode_note_says_when_every_start_compiles_torch_again(tmp_path):
    """`startup.bytecode_note` (a line the CLI and the server print at start on CUDA): a module without its bytecode
    where Python writes none names PYTHONDONTWRITEBYTECODE, and PYTHONPYCACHEPREFIX too where the folder cannot be
    written; one whose bytecode is there, or that this process will write, needs no line."""
    import importlib.util

    from raincheck_hf.startup import bytecode_note

    package = tmp_path / "pkg"
    package.mkdir()
    source = package / "__init__.py"
    source.write_text("x = 1\n")
    note = bytecode_note(str(source), dont_write=True)
    assert "PYTHONDONTWRITEBYTECODE" in note and "PYTHONPYCACHEPREFIX" not in note
    assert bytecode_note(str(source), dont_write=False) is None  # (written by this process: found by the next)
    unwritable = bytecode_note(str(source), dont_write=True, writable=False)
    assert "PYTHONDONTWRITEBYTECODE" in unwritable and "PYTHONPYCACHEPREFIX" in unwritable
    assert "PYTHONPYCACHEPREFIX" in bytecode_note(str(source), dont_write=False, writable=False)
    cached = Path(importlib.util.cache_from_source(str(source)))
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_bytes(b"")
    assert bytecode_note(str(source), dont_write=True) is None
