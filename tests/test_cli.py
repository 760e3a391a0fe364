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
                    "(default: 0.3)", "(default: 31)", "(default: 16)", "(default: 64)", "(default: 5.0)"):
        assert default in options, default
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
