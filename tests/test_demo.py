"""The Gradio demo through its API (`gradio_client` against ``demo.launch(prevent_thread_lock=True)``),
the helpers it shares with the CLI, and the CLI chat (``python -m raincheck_hf chat``) in-process.

The app runs its default, the bundled glyph Qwen3-VL (trained on the glyph-grid benchmark), so the
tests look at the words as well as the mechanics: answers against the references read off the
grid, streaming, the trace figures, restoration during and after the answer, bad input, session
isolation, and that the bundled Qwen3.5 and the random tiny model are still one setting away.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from raincheck_hf.quality.glyphs import benchmark_split, dialogue, score_turn
from raincheck_hf.tiny import draw_test_image

from conftest import serve_demo

ROOT = Path(__file__).resolve().parents[1]

# outputs of /chat: chatbot, picture, caption, figures, status, timer, model, model note, textbox
CHAT, PICTURE, CAPTION, FIGURES, STATUS, TIMER, MODEL, MODEL_NOTE = range(8)
ANSWER_TOKENS = 64  # room for a 20-fact list answer (60 words and the end token)
GUARD = 16  # the demo's starting decode guard (not the library's 1): no restoration during shorter answers
DEV = benchmark_split("dev", limit=3)
LIST_FIRST, FACT_FIRST = DEV[0], DEV[1]  # dev-000 starts with a list question, dev-001 with a fact
SMALL = dialogue(7, 4, long_first=True, uid="small-4")  # a 4×4 grid: 16 visual tokens


# ---- helpers shared by the CLI and the demo (no model needed) ------------------------------------

def test_glyph_grids_are_read_back_from_their_pixels():
    from raincheck_hf.quality.references import read_glyph_grid

    for d in [*benchmark_split("dev", limit=8), *(dialogue(s, n) for s, n in ((1, 2), (2, 3), (3, 7)))]:
        cells = read_glyph_grid(d.image())
        assert cells is not None and sorted(cells, key=lambda c: (c.row, c.col)) == sorted(
            d.cells, key=lambda c: (c.row, c.col))
    assert read_glyph_grid(draw_test_image(320, 320, seed=0)) is None  # not a glyph grid
    assert read_glyph_grid(draw_test_image(384, 288, seed=0)) is None  # not square
    jpeg = LIST_FIRST.image().resize((319, 319)).resize((320, 320))  # resampled: no longer exact
    assert read_glyph_grid(jpeg) is None


def test_references_match_the_benchmark_answers():
    from raincheck_hf.quality.references import glyph_reference, judge, missing_from_grid

    for d in benchmark_split("dev"):
        for turn in d.turns:
            reference = glyph_reference(d.cells, turn.question)
            assert reference is not None and reference.answer == turn.answer and reference.facts == turn.facts
            loose = glyph_reference(d.cells, turn.question.upper().rstrip(" ?."))  # case and punctuation aside
            assert loose is not None and (loose.answer, loose.facts) == (reference.answer, reference.facts)
    turn = LIST_FIRST.turns[0]
    assert judge(glyph_reference(LIST_FIRST.cells, turn.question), turn.answer) == f"{len(turn.facts)}/{len(turn.facts)} facts right"
    fact = FACT_FIRST.turns[0]
    assert judge(glyph_reference(FACT_FIRST.cells, fact.question), fact.answer) == "right"
    assert glyph_reference(LIST_FIRST.cells, "what is in this image ?") is None
    absent = next(g for g in (f"g{i}" for i in range(12)) if g not in {c.glyph for c in SMALL.cells})
    colour = SMALL.cells[0].colour
    question = f"what is the background of the {colour} {absent} ?"
    assert glyph_reference(SMALL.cells, question) is None
    assert missing_from_grid(SMALL.cells, question) == f"this grid has no {colour} {absent}"


def test_model_names():
    from raincheck_hf.__main__ import resolve_model

    assert resolve_model(None) == ("bundled", "qwen3_vl")
    assert resolve_model("qwen3_5") == resolve_model("glyph-qwen3_5") == ("bundled", "qwen3_5")
    assert resolve_model("Qwen3-VL") == ("bundled", "qwen3_vl")
    assert resolve_model("tiny") == ("tiny", "tiny")
    assert resolve_model("/models/Qwen3-VL-8B-Instruct") == ("checkpoint", "/models/Qwen3-VL-8B-Instruct")


# ---- the CLI chat ---------------------------------------------------------------------------------

def run_cli(capsys, *argv):
    from raincheck_hf.__main__ import main

    code = main(["chat", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_chat_default_replays_a_dev_dialogue_on_the_bundled_model(capsys):
    code, out, err = run_cli(capsys)
    assert code == 0
    assert "bundled glyph Qwen3-VL" in err and "Qwen3VLForConditionalGeneration" in err
    assert "RANDOM" not in err and "gibberish" not in (out + err)
    assert "glyph grid of dev dialogue dev-000" in err
    first, second = LIST_FIRST.turns[:2]
    assert f"you> {first.question}" in out and f"you> {second.question}" in out
    assert out.count("you> ") == 2  # a two-turn exchange
    assert f"reference> {first.answer}   [" in out and f"reference> {second.answer}   [right]" in out
    answers = [line.removeprefix("assistant> ") for line in out.splitlines() if line.startswith("assistant> ")]
    assert len(answers) == 2
    assert score_turn(first, answers[0])["correct"] >= 15, answers[0]  # Raincheck restores what the list needs
    assert score_turn(second, answers[1])["correct"] == 1, answers[1]
    assert "visual tokens 100: 30 selected (prefilled first), 70 deferred" in out
    stats = [line for line in out.splitlines() if line.startswith("  [ttft ")]
    assert len(stats) == 2 and all(" ms | tpot " in line for line in stats)
    assert "restored during the answer 70" in stats[0]  # a 60-word answer restores everything as it goes
    assert "no new visual tokens" in stats[1]


def test_cli_chat_fact_first_restores_in_idle_time_and_qwen3_5_is_bundled_too(capsys):
    code, out, err = run_cli(capsys, "--model", "qwen3_5", "--dialogue", "1", "--decode-guard", "16")
    assert code == 0 and "bundled glyph Qwen3.5" in err and "Qwen3_5ForConditionalGeneration" in err
    assert "falling back to its reference PyTorch" not in out  # said once on stderr instead, not mid-answer
    first, second = FACT_FIRST.turns[:2]
    assert f"reference> {first.answer}   [right]" in out and f"reference> {second.answer}   [right]" in out
    assert "restored during the answer 0, after it 0, pending 70" in out  # the answer is shorter than guard 16
    assert "[idle-time restoration: 70 restored after the answer, 0 still pending]" in out


def test_cli_chat_tiny_model_still_says_random_weights(capsys):
    code, out, err = run_cli(capsys, "--model", "tiny", "--question", "What is in this image?", "--max-new-tokens", "4")
    assert code == 0 and "RANDOM weights" in err and "gibberish" in err
    assert "reference>" not in out and "visual tokens 48" in out


def test_cli_chat_unknown_words_and_bad_settings(capsys, tmp_path):
    grid = tmp_path / "grid.png"
    SMALL.image().save(grid)
    code, out, err = run_cli(capsys, "--image", str(grid), "--question", "What is in this image?",
                             "--question", SMALL.turns[1].question.upper(), "--max-new-tokens", "8")
    assert code == 0
    assert "does not know 'in', 'this', 'image'" in out
    assert f"reference> {SMALL.turns[1].answer}   [" in out  # read off the user's own (lossless) grid
    code, _, err = run_cli(capsys, "--retention", "1.5")
    assert code == 2 and "retention" in err
    code, _, err = run_cli(capsys, "--dialogue", "99")
    assert code == 2 and "--dialogue" in err


# ---- the demo through its API -----------------------------------------------------------------------

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
sys.path.insert(0, str(ROOT))  # `demo` lives beside the package


def new_client(url):
    gradio_client = pytest.importorskip("gradio_client")
    return gradio_client.Client(url, verbose=False, download_files=False, analytics_enabled=False)


@pytest.fixture(scope="module")
def app_url():
    pytest.importorskip("gradio")
    pytest.importorskip("gradio_client")
    with serve_demo(max_new_tokens=ANSWER_TOKENS) as url:
        yield url


@pytest.fixture
def client(app_url):
    return new_client(app_url)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo-files")
    paths = {"list": folder / "dev-000.png", "fact": folder / "dev-001.png", "small": folder / "small.png",
             "blocks": folder / "blocks.png", "big": folder / "big.png",
             "text": folder / "notes.txt", "empty": folder / "empty.png", "broken": folder / "broken.png"}
    LIST_FIRST.image().save(paths["list"])  # 10 × 10 = 100 merged tokens
    FACT_FIRST.image().save(paths["fact"])
    SMALL.image().save(paths["small"])  # 4 × 4 = 16 merged tokens
    draw_test_image(384, 288, seed=1).save(paths["blocks"])  # 12 × 9 = 108 merged tokens, not a grid
    draw_test_image(1600, 1200, seed=3).save(paths["big"])  # over the processor's pixel limit
    paths["text"].write_text("not a picture")
    paths["empty"].write_bytes(b"")
    paths["broken"].write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
    return {k: str(v) for k, v in paths.items()}


def ask(client, text, *paths, **controls):
    from gradio_client import handle_file

    job = client.submit({"text": text, "files": [handle_file(p) for p in paths]}, api_name="/chat", **controls)
    return job.result(timeout=180), job.outputs()


def texts(chat, role) -> list[str]:
    return [m["content"][0]["text"] for m in chat if m["role"] == role and m["content"][0].get("type") == "text"]


def answer_and_reference(chat) -> tuple[str, str]:
    """The last model answer and the reference note after it."""
    said = texts(chat, "assistant")
    assert said[-1].startswith("*Reference"), said[-3:]
    return said[-2], said[-1]


def status_when(client, done, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = client.predict(api_name="/status")[STATUS]
        if done(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


def test_demo_default_is_the_bundled_glyph_model_with_glyph_examples(app_url):
    from demo.app import DEFAULT_MODEL, build_demo, load_model

    note = load_model(None).note  # what the page's model note says (the app loaded it already)
    assert DEFAULT_MODEL == "qwen3_vl" and "knows only that task" in note and "<unk>" in note
    assert "Qwen3VLForConditionalGeneration" in note and "random weights" not in note
    config = build_demo(preload=False).config
    labels = [label for c in config["components"] for label in (c.get("props", {}).get("sample_labels") or [])]
    assert labels[:2] == ["Grid 1 (10×10): list question", "Grid 1: follow-up"], labels
    samples = [s for c in config["components"] for s in (c.get("props", {}).get("samples") or [])]
    assert samples[0][0]["text"] == LIST_FIRST.turns[0].question, samples[0]


def test_demo_list_question_streams_restores_during_the_answer_and_the_follow_up_is_right(client, files):
    first_turn, second_turn = LIST_FIRST.turns[:2]
    # 10 ms per token (slow motion): the page shows the text every 0.1 s, so a 60-word answer shows in parts
    final, outputs = ask(client, first_turn.question, files["list"], slow_motion_ms=10)
    partials = {texts(o[CHAT], "assistant")[-1] for o in outputs if isinstance(o[CHAT], list) and o[CHAT]
                and o[CHAT][-1]["role"] == "assistant"}
    assert len(partials) >= 3, "the answer did not stream"
    first = final[STATUS]["turn_figures"][0]
    assert first["visual_tokens"] == 100 and first["selected"] == 30 and first["deferred"] == 70
    assert first["answer_tokens"] > GUARD and first["restored_during_answer"] > 0
    answer, reference = answer_and_reference(final[CHAT])
    assert score_turn(first_turn, answer)["correct"] >= 15, answer
    assert first_turn.answer in reference and "facts right" in reference
    assert final[STATUS]["picture"]["segments"] == [
        {"modality": "image", "grid": [1, 10, 10], "size": [320, 320], "label": "image 1"}]
    assert final[PICTURE] and Path(final[PICTURE]["path"]).is_file()

    status = status_when(client, lambda s: s["pending"] == 0)
    assert status["pending"] == 0 and status["restored"] == 70 and status["restored_once"]
    figures = status["turn_figures"][0]
    assert figures["restored_during_answer"] + figures["restored_after_answer"] == 70

    final, _ = ask(client, second_turn.question)
    second = final[STATUS]["turn_figures"][1]
    assert second["restored_at_prefill"] == 0 and second["visual_tokens"] == 0
    answer, reference = answer_and_reference(final[CHAT])
    assert answer.split()[0] == second_turn.answer and reference.endswith("**right**.*")
    assert len(final[FIGURES]["data"]) == 2
    assert texts(final[CHAT], "user") == [first_turn.question, second_turn.question]
    assert "every deferred token is in the cache" in final[CAPTION]


def test_demo_fact_question_restores_in_idle_time(client, files):
    first_turn, second_turn = FACT_FIRST.turns[:2]
    final, _ = ask(client, first_turn.question, files["fact"])
    first = final[STATUS]["turn_figures"][0]
    assert first["answer_tokens"] < GUARD and first["restored_during_answer"] == 0
    answer, reference = answer_and_reference(final[CHAT])
    assert answer.split()[0] == first_turn.answer and reference.endswith("**right**.*")
    status = status_when(client, lambda s: s["pending"] == 0 and s["turn_figures"][0]["pending"] == 0)
    assert status["turn_figures"][0]["restored_after_answer"] == 70 and status["restored_once"]
    final, _ = ask(client, second_turn.question.upper())  # the vocabulary is lowercase: the demo lowercases
    assert final[STATUS]["turn_figures"][1]["restored_at_prefill"] == 0
    answer, _ = answer_and_reference(final[CHAT])
    assert answer.split()[0] == second_turn.answer


def test_demo_bad_input_gets_a_message_and_the_conversation_goes_on(client, files):
    final, _ = ask(client, SMALL.turns[0].question, files["small"])
    assert final[STATUS]["turns"] == 1 and final[STATUS]["turn_figures"][0]["visual_tokens"] == 16
    cases = {"text": "is not an image or a video", "empty": "is empty", "broken": "could not be read as an image"}
    for key, expected in cases.items():
        final, _ = ask(client, "And this one?", files[key])
        message = texts(final[CHAT], "assistant")[-1]
        assert expected in message and os.path.basename(files[key]) in message
        assert "Nothing was sent to the model" in message
        assert final[STATUS]["turns"] == 1  # nothing reached the model

    final, _ = ask(client, "")
    assert "The message is empty" in texts(final[CHAT], "assistant")[-1]
    final, _ = ask(client, "", files["small"])
    assert "Add a question" in texts(final[CHAT], "assistant")[-1]

    final, _ = ask(client, "Describe it.", files["big"])
    notes = texts(final[CHAT], "assistant")
    assert any("1600×1200" in t and "resized to" in t for t in notes)
    assert any("does not know **describe**, **it**" in t and "<unk>" in t for t in notes)
    assert not notes[-1].startswith("*Reference")  # not a glyph grid: no reference
    assert final[STATUS]["turns"] == 2
    size = final[STATUS]["picture"]["segments"][0]["size"]
    assert size[0] * size[1] <= 448 * 448  # the glyph processor keeps at most 14 × 14 cells

    final, _ = ask(client, "Still there?", model="/no/such/model")
    notes = texts(final[CHAT], "assistant")
    assert any("Could not load model" in t and "/no/such/model" in t for t in notes)
    assert final[STATUS]["turns"] == 3 and final[STATUS]["settings"]["model"] == "qwen3_vl"


def test_demo_changing_a_setting_starts_a_new_conversation_with_a_note(client, files):
    final, _ = ask(client, SMALL.turns[0].question, files["small"])
    assert final[STATUS]["conversation"] == 1 and final[STATUS]["turns"] == 1
    final, _ = ask(client, FACT_FIRST.turns[0].question, files["fact"], mode="hard", retention=0.5)
    notes = texts(final[CHAT], "assistant")
    assert any("New conversation" in t and "mode → hard" in t and "retention → 0.5" in t for t in notes)
    status = final[STATUS]
    assert status["conversation"] == 2 and status["turns"] == 1  # the earlier turn is not part of it
    figures = status["turn_figures"][0]
    assert figures["selected"] == 50 and figures["dropped"] == figures["deferred"] == 50
    assert status["dropped"] == 50 and status["pending"] == 0 and status["restored"] == 0
    assert "dropped tokens are gone for good" in final[CAPTION]


def test_demo_bundled_qwen3_5_and_the_random_tiny_model_are_one_setting_away(client, files):
    final, outputs = ask(client, FACT_FIRST.turns[0].question, files["fact"], model="qwen3_5")
    assert final[STATUS]["settings"]["model"] == "qwen3_5"
    notes = [o[MODEL_NOTE] for o in outputs if isinstance(o[MODEL_NOTE], str)]
    assert any("glyph Qwen3.5" in n and "Qwen3_5ForConditionalGeneration" in n for n in notes), notes
    answer, reference = answer_and_reference(final[CHAT])
    assert answer.split()[0] == FACT_FIRST.turns[0].answer and reference.endswith("**right**.*")

    final, outputs = ask(client, "What is in this image?", files["blocks"], model="tiny")
    assert final[STATUS]["settings"]["model"].startswith("tiny")
    assert any(isinstance(o[MODEL_NOTE], str) and "random weights" in o[MODEL_NOTE] for o in outputs)
    assert final[STATUS]["turn_figures"][0]["visual_tokens"] == 108
    assert not any("does not know" in t for t in texts(final[CHAT], "assistant"))  # a subword tokenizer


def test_demo_a_long_video_is_sampled_and_drawn_per_slice(client, tmp_path):
    av = pytest.importorskip("av")
    import numpy as np

    from raincheck_hf.tiny import draw_test_video

    path = tmp_path / "long.mp4"
    frames = draw_test_video(num_frames=40, width=128, height=96, seed=5).permute(0, 2, 3, 1).numpy()
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = 128, 96, "yuv420p"
        for array in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(array), format="rgb24")))
        container.mux(stream.encode())
    final, _ = ask(client, "What happens in the video?", str(path))
    assert any("has 40 frames" in t and "sampled 16" in t for t in texts(final[CHAT], "assistant"))
    segments = final[STATUS]["picture"]["segments"]
    assert len(segments) == 8 and {s["modality"] for s in segments} == {"video"}  # 16 frames, 2 per slice
    figures = final[STATUS]["turn_figures"][-1]
    assert figures["visual_tokens"] == sum(s["grid"][1] * s["grid"][2] for s in segments)


def test_demo_two_clients_in_parallel_do_not_share_state(app_url, files):
    clients = [new_client(app_url) for _ in range(2)]
    grids = [(LIST_FIRST, files["list"], 100), (SMALL, files["small"], 16)]
    results: list = [None, None]

    def run(i):
        d, path, _ = grids[i]
        first, _ = ask(clients[i], d.turns[0].question, path)
        second, _ = ask(clients[i], d.turns[1].question)
        results[i] = (first, second)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(r is not None for r in results), "a client did not finish"
    sessions = set()
    for i, (first, second) in enumerate(results):
        d, _, tokens = grids[i]
        status = second[STATUS]
        sessions.add(status["session"])
        assert status["turns"] == 2 and status["turn_figures"][0]["visual_tokens"] == tokens
        assert texts(second[CHAT], "user") == [d.turns[0].question, d.turns[1].question]
        answer, _ = answer_and_reference(second[CHAT])
        assert answer.split()[0] == d.turns[1].answer  # each session's references follow its own grid
    assert len(sessions) == 2


def test_demo_a_stopped_answer_leaves_the_session_usable(app_url, files):
    """The client stops the list answer mid-way (Gradio closes the handler): the turn keeps what was
    generated, the session takes the next question at once and the follow-up goes on from that history."""
    from gradio_client import handle_file

    client = new_client(app_url)
    first_turn, second_turn = LIST_FIRST.turns[:2]
    job = client.submit({"text": first_turn.question, "files": [handle_file(files["list"])]}, api_name="/chat",
                        slow_motion_ms=60)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait until the answer streams
        outputs = [o for o in job.outputs() if isinstance(o[CHAT], list) and o[CHAT]]
        if len({texts(o[CHAT], "assistant")[-1] for o in outputs if o[CHAT][-1]["role"] == "assistant"}) >= 3:
            break
        time.sleep(0.02)
    job.cancel()
    status = status_when(client, lambda s: not s["answering"] and s["turns"] == 1)
    assert not status["answering"] and status["turns"] == 1
    stopped = status["turn_figures"][0]["answer_tokens"]
    assert 0 < stopped < ANSWER_TOKENS - 5, stopped  # stopped well before the end (60 ms a token)
    status = status_when(client, lambda s: s["pending"] == 0)
    assert status["restored_once"] and status["restored"] == 70  # every deferred token restored, once

    final, _ = ask(client, second_turn.question)  # the same session, right away: no "still answering"
    notes = texts(final[CHAT], "assistant")
    assert any(t.startswith(f"*Stopped after {stopped} tokens") for t in notes), notes
    assert not any("Still answering" in t for t in notes)
    assert final[STATUS]["conversation"] == 1 and final[STATUS]["turns"] == 2
    answer, reference = answer_and_reference(final[CHAT])
    assert answer.split()[0] == second_turn.answer and reference.endswith("**right**.*")


def test_demo_a_failed_turn_leaves_the_session_usable(client, files, monkeypatch):
    """The model fails mid-answer (a decode forward raises): the chat says so, and the next question
    starts a new conversation that answers normally."""
    import raincheck_hf.generation as generation

    run, calls = generation._DecodeForward.run, []

    def failing(self, adapter, cache):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the device went away")
        return run(self, adapter, cache)

    monkeypatch.setattr(generation._DecodeForward, "run", failing)
    final, _ = ask(client, LIST_FIRST.turns[0].question, files["list"])  # a long answer: it fails mid-way
    notes = texts(final[CHAT], "assistant")
    assert any("the model failed on this turn" in t and "the device went away" in t for t in notes), notes
    assert not final[STATUS]["answering"]
    first_turn = FACT_FIRST.turns[0]
    final, _ = ask(client, first_turn.question, files["fact"])
    assert final[STATUS]["conversation"] == 2 and final[STATUS]["turns"] == 1
    answer, reference = answer_and_reference(final[CHAT])
    assert answer.split()[0] == first_turn.answer and reference.endswith("**right**.*")


# ---- what Raincheck does, shown: the four modes side by side, the restoration timeline ---------------

# outputs of /compare: the table, the four maps, the four texts, the note
COMPARE_TABLE, COMPARE_MAPS, COMPARE_TEXTS, COMPARE_NOTE = 0, slice(1, 5), slice(5, 9), 9


def test_demo_compare_runs_the_four_modes_on_one_selection(client, files):
    from gradio_client import handle_file

    first, follow_up = LIST_FIRST.turns[:2]
    job = client.submit(handle_file(files["list"]), first.question, follow_up.question, api_name="/compare")
    final = job.result(timeout=300)
    assert len(job.outputs()) >= 5, "the comparison did not show each mode as it finished"
    table = final[COMPARE_TABLE]
    assert table["headers"][:3] == ["mode", "answer", "follow-up"]
    rows = {row[0]: dict(zip(table["headers"], row)) for row in table["data"]}
    assert list(rows) == ["full", "hard", "post_answer", "raincheck"]
    assert rows["full"]["answer"] == f"{len(first.facts)}/{len(first.facts)} facts right"
    assert rows["hard"]["dropped"] == "70" and rows["hard"]["follow-up"] == "wrong"  # pruning lost the cell
    assert rows["post_answer"]["restored after it"] == "70" and rows["post_answer"]["restored during answer"] == "0"
    assert rows["raincheck"]["restored during answer"] == "70"  # a 60-word answer restores as it goes
    for mode in ("full", "post_answer", "raincheck"):
        assert rows[mode]["follow-up"] == "right", rows
    correct = {mode: int(rows[mode]["answer"].split("/")[0]) for mode in rows}
    assert correct["raincheck"] > correct["hard"] == correct["post_answer"]  # the same selection, then restored
    assert all(float(rows[mode]["T1 (ms)"]) > 0 and float(rows[mode]["TPOT (ms)"]) > 0 for mode in rows)
    assert all(m and Path(m["path"]).is_file() for m in final[COMPARE_MAPS])
    texts_ = final[COMPARE_TEXTS]
    assert texts_[1].startswith("**hard** · T1 ") and "reference: " in texts_[1] and "Follow-up" in texts_[1]
    assert final[COMPARE_NOTE].startswith("*Done")
    assert "Why `full` can have the fastest first token here" in final[COMPARE_NOTE]  # the bundled model, a CPU

    final = client.predict(handle_file(files["list"]), "  ", "", api_name="/compare")
    assert "Type a question" in final[COMPARE_NOTE]


def test_demo_timeline_says_which_patch_came_back_at_which_token(client, files):
    first, second = LIST_FIRST.turns[:2]
    ask(client, first.question, files["list"])
    status = status_when(client, lambda s: "timeline" in s)
    timeline = status["timeline"]
    steps = [step for step in timeline["restored"]]
    assert sum(s["count"] for s in steps) == 70
    during = [s for s in steps if s["phase"] == "during"]
    assert during and during[0]["label"] == f"token {GUARD}" and during[0]["count"] == 31  # after the guard, a chunk
    answer_tokens = status["turn_figures"][0]["answer_tokens"]
    assert timeline["steps"] == answer_tokens + sum(s["phase"] == "after" for s in steps)
    picture, strip, text, caption = client.predict(0, api_name="/timeline")
    assert "the first token" in text and "0 of 70" in text
    assert Path(picture["path"]).is_file() and Path(strip["path"]).is_file()
    # the caption describes the step shown, not the live cache (where every deferred token is back by now)
    assert "the timeline at the first token" in caption and "30 prefilled first · 70 still deferred then" in caption
    assert "every deferred token is in the cache" not in caption
    _, _, text, caption = client.predict(GUARD, api_name="/timeline")  # the slider's value is the decode step
    assert f"decode step {GUARD} of {answer_tokens - 1}**, which read generated token {GUARD}:" in text
    assert "31 came back in this step" in text
    assert f"the timeline at decode step {GUARD}**" in caption and "31 restored during the answer" in caption
    _, _, text, caption = client.predict(timeline["steps"] - 1, api_name="/timeline")  # the last step
    assert "70 of 70" in text and "The end of the timeline" in caption

    final, _ = ask(client, second.question)  # a follow-up without an image: its row says so
    rows = final[FIGURES]["data"]
    assert rows[1][:3] == ["2", "no new visual tokens", "–"] and rows[1][5:] == ["–"] * 4


def test_demo_a_hub_id_that_is_not_here_fails_fast_with_what_to_do(client, files, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the server runs in this process
    final, outputs = ask(client, SMALL.turns[0].question, files["small"], model="raincheck-tests/not-a-model")
    notes = [texts(o[CHAT], "assistant") for o in outputs if isinstance(o[CHAT], list)]
    assert any(n and n[-1].startswith("*Loading model **raincheck-tests/not-a-model**") for n in notes)
    said = texts(final[CHAT], "assistant")
    problem = next(t for t in said if t.startswith("**Problem:**"))
    assert "not in the Hugging Face cache" in problem and "HF_HUB_OFFLINE" in problem
    assert "qwen3_vl" in problem and "local folder" in problem
    assert final[STATUS]["settings"]["model"] == "qwen3_vl" and final[STATUS]["turns"] == 1  # the turn went on


def test_demo_a_question_asked_while_a_model_loads_is_told_so(client, files, monkeypatch):
    from dataclasses import replace

    import demo.models as app

    release, started = threading.Event(), threading.Event()
    real = app._load_uncached

    def slow_load(key):  # a checkpoint that takes a while: held until the second question was answered
        if key == "slow-checkpoint":
            started.set()
            assert release.wait(60)
            return replace(real(app.TINY_MODEL), name=key)
        return real(key)

    monkeypatch.setattr(app, "_load_uncached", slow_load)
    try:
        first = client.submit({"text": "What is in this image?", "files": []}, api_name="/chat",
                              model="slow-checkpoint")
        assert started.wait(60)
        final, _ = ask(client, "And now?")  # the same session, while the model loads
        said = texts(final[CHAT], "assistant")
        assert any(t.startswith("*Loading model **slow-checkpoint**") for t in said), said
        assert said[-1] == "Still loading model slow-checkpoint; send this one when it is done."
        release.set()
        final = first.result(timeout=120)
        assert final[STATUS]["settings"]["model"] == "slow-checkpoint" and final[STATUS]["turns"] == 1
    finally:
        release.set()
        app._MODELS.pop("slow-checkpoint", None)


# ---- the page's pace, the captions, the legend ---------------------------------------------------

def test_a_streamed_answer_is_shown_at_most_every_so_often():
    """Per token the page would redraw the picture, the caption, the figures and the JSON panel; that work
    slowed the answer it showed (demo/README.md has the numbers). `pace` spaces it out."""
    from demo.app import Step, pace

    now = [0.0]
    steps = [Step(picture=False)] + [Step(token=True) for _ in range(40)] + [Step(picture="force")]

    def timed():  # a token every 20 ms
        for step in steps:
            yield step
            if step.token:
                now[0] += 0.02

    shown = list(pace(timed(), text_every=0.1, picture_every=0.5, clock=lambda: now[0]))
    kinds = [what for what, step in shown]
    assert shown[0][1] is steps[0] and shown[-1][1] is steps[-1] and kinds[0] == kinds[-1] == "all"
    tokens = [what for what, step in shown if step.token]
    assert tokens.count("all") == 2  # at 0 and 0.5 s: the picture, caption and figures
    assert tokens.count("text") == 6  # at 0.1, 0.2, ... s (not 0.5): the text only
    assert len(tokens) == 8  # of 40 tokens


def test_the_legend_keeps_every_entry_at_count_zero():
    from demo.cache_map import _legend_lines

    def entries(states):
        return [text for line in _legend_lines(states, 640) for _, text, _ in line]

    assert entries(["selected"] * 3 + ["deferred"] * 7) == [
        "prefilled first 3", "deferred 7", "restored during answer 0", "restored after it 0", "dropped 0"]
    assert entries(["waiting"] * 4)[-1] == "prefilling 4"  # shown only while a turn is being prefilled


def test_the_caption_names_the_turn_being_answered_when_it_has_no_image(client, files):
    ask(client, SMALL.turns[0].question, files["small"])
    job = client.submit({"text": SMALL.turns[1].question, "files": []}, api_name="/chat", slow_motion_ms=40)
    job.result(timeout=180)
    captions = [o[CAPTION] for o in job.outputs() if isinstance(o[CAPTION], str)]
    answering = [c for c in captions if "answered" in c]
    assert answering, captions
    assert "the picture is turn 1's; turn 2 (no new image) is being answered" in answering[0]
    assert not any("Turn 1** (16 visual tokens): **answering" in c for c in captions)


def test_the_share_hint_names_the_flag_and_uploads_are_capped(monkeypatch, capsys):
    import gradio as gr

    import demo.app as app

    launched = {}

    class Blocks(gr.Blocks):
        def launch(self, **kwargs):
            launched.update(kwargs)
            self.local_url, self.share_url = "http://127.0.0.1:7999/", None

        def block_thread(self):
            launched["blocked"] = True

    monkeypatch.setattr(app, "build_demo", lambda *args, **kwargs: Blocks())
    warmed = []
    monkeypatch.setattr(app, "warm_up_loaded", lambda args: warmed.append(args.warm_up))
    assert app.main(["--port", "7999"]) == 0
    assert warmed == [True]  # the page's model warms up before the page serves (--no-warm-up skips it)
    err = capsys.readouterr().err
    assert launched["quiet"] and launched["blocked"] and not launched["share"]  # Gradio's own banner is off
    assert launched["max_file_size"] == app.MediaLimits().max_file_bytes
    assert "running at http://127.0.0.1:7999/ (this machine only); --share adds a public" in err
    assert "share=True" not in err


# ---- uploads: over a limit or damaged, a message and nothing sent to the model --------------------

def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header says ``width`` × ``height`` but whose pixel data is a few bytes: decoding it fails,
    so a refusal that names the size was decided from the header alone."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 8)) + chunk(b"IEND", b"")


def _write_clip(path, frames: int = 8, fps: int = 2, width: int = 64, height: int = 48):
    av = pytest.importorskip("av")
    import numpy as np

    from raincheck_hf.tiny import draw_test_video

    video = draw_test_video(num_frames=frames, width=width, height=height, seed=1).permute(0, 2, 3, 1).numpy()
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for array in video:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(array), format="rgb24")))
        container.mux(stream.encode())
    return str(path)


def test_images_over_the_limits_are_refused_from_their_header(tmp_path):
    from demo.app import MediaLimits, read_media

    bomb, large = tmp_path / "bomb.png", tmp_path / "large.png"
    bomb.write_bytes(_png_header(15000, 15000))  # 225 M pixels in a few bytes: Pillow's own limit is 179 M
    large.write_bytes(_png_header(9000, 9000))  # 81 M: over the demo's 64 M, under Pillow's
    kind, message, _ = read_media(str(bomb))
    assert kind is None and "**bomb.png** is an image too large to decode safely" in message
    assert "this demo takes images up to 64,000,000 pixels" in message and str(tmp_path) not in message
    kind, message, _ = read_media(str(large))
    assert kind is None and "9000×9000 = 81,000,000 pixels" in message and "Nothing was decoded" in message
    good = tmp_path / "good.png"
    draw_test_image(64, 48, seed=0).save(good)
    kind, message, _ = read_media(str(good), limits=MediaLimits(max_image_pixels=1000))
    assert kind is None and "64×48 = 3,072 pixels: this demo takes images up to 1,000 pixels" in message
    kind, message, _ = read_media(str(good), limits=MediaLimits(max_file_bytes=100))
    assert kind is None and "this demo takes files up to 100 bytes" in message
    assert read_media(str(good))[0] == "image"


def test_damaged_images_and_videos_get_a_message(tmp_path):
    import io

    from demo.app import read_media

    buffer = io.BytesIO()
    draw_test_image(64, 48, seed=0).save(buffer, "PNG")
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    kind, message, _ = read_media(str(truncated))
    assert kind is None and "**truncated.png** could not be read as an image" in message
    clip = _write_clip(tmp_path / "clip.mp4")
    broken = tmp_path / "broken.mp4"
    data = open(clip, "rb").read()
    broken.write_bytes(data[: len(data) // 3])
    kind, message, _ = read_media(str(broken))
    assert kind is None and "**broken.mp4**" in message and "could not be read as a video" in message
    assert read_media(clip)[0] == "video"


def test_videos_over_the_limits_are_refused_before_decoding(tmp_path):
    from demo.app import MediaLimits, read_media

    clip = _write_clip(tmp_path / "clip.mp4", frames=8, fps=2)  # 4 s, 64 × 48
    kind, message, _ = read_media(clip, limits=MediaLimits(max_video_seconds=2))
    assert kind is None and "**clip.mp4** is a video of 4 s: this demo takes videos up to 2 s" in message
    kind, message, _ = read_media(clip, limits=MediaLimits(max_frame_pixels=1000))
    assert kind is None and "64×48 pixels per frame" in message and "up to 1,000 pixels per frame" in message
    kind, message, _ = read_media(clip, limits=MediaLimits(max_video_frames=3))
    assert kind is None and "it stopped after 3 frames" in message


def test_an_upload_over_a_limit_never_reaches_the_model(client, files, tmp_path):
    final, _ = ask(client, SMALL.turns[0].question, files["small"])
    assert final[STATUS]["turns"] == 1
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(_png_header(15000, 15000))
    final, _ = ask(client, "And this one?", str(bomb))
    message = texts(final[CHAT], "assistant")[-1]
    assert "**bomb.png** is an image too large to decode safely" in message
    assert "Nothing was sent to the model" in message and "Traceback" not in message
    assert final[STATUS]["turns"] == 1  # the conversation is as it was
    final, _ = ask(client, SMALL.turns[1].question)
    assert final[STATUS]["turns"] == 2


@pytest.mark.parametrize("argv, message", [(["--max-new-tokens", "-3"], "--max-new-tokens must be in [1, 512]"),
                                           (["--slow-motion-ms", "-1"], "--slow-motion-ms must be in [0, 200]"),
                                           (["--port", "70000"], "--port must be in [1, 65535]"),
                                           (["--warm-up-tokens", "1"], "--warm-up-tokens must be >= 2")])
def test_the_demo_command_checks_its_options_before_loading(argv, message, monkeypatch, capsys):
    import demo.app as app

    def must_not_build(*args, **kwargs):
        raise AssertionError("the demo was built before its options were checked")

    monkeypatch.setattr(app, "build_demo", must_not_build)
    with pytest.raises(SystemExit) as exit_:
        app.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_message_over_the_file_count_or_the_pixel_total_decodes_nothing(tmp_path, monkeypatch):
    import demo.media as app

    paths = []
    for i in range(3):
        paths.append(str(tmp_path / f"grid{i}.png"))
        draw_test_image(64, 48, seed=i).save(paths[-1])

    def must_not_decode(*args, **kwargs):
        raise AssertionError("a file was decoded although the message is over a limit")

    monkeypatch.setattr(app, "_open_image", must_not_decode)
    monkeypatch.setattr(app, "_open_video", must_not_decode)
    turn = app.prepare_turn(paths, None, limits=app.MediaLimits(max_files=2))
    assert turn.problems == ["3 files are attached: this demo takes up to 2 per message. Nothing was decoded; "
                             "attach fewer."] and not turn.images
    turn = app.prepare_turn(paths, None, limits=app.MediaLimits(max_message_pixels=9000))
    assert len(turn.problems) == 1 and not turn.images
    assert "The attached images have 9,216 pixels together: this demo takes up to 9,000 per message" in turn.problems[0]


def test_a_message_s_videos_share_one_decoding_budget(tmp_path, monkeypatch):
    import types

    import demo.media as app

    clock = [0.0]
    given = []

    def slow_read(path, max_video_frames, limits, decode_seconds=None):  # each file takes 40 s of the budget
        given.append(decode_seconds)
        clock[0] += 40
        return None, f"{os.path.basename(path)} read", None

    monkeypatch.setattr(app, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(app, "read_media", slow_read)
    turn = app.prepare_turn([str(tmp_path / f"clip{i}.mp4") for i in range(3)], None,
                            limits=app.MediaLimits(max_decode_seconds=60))
    assert given == [60, 20]  # the second file gets what the first left, the third none
    assert turn.problems[:2] == ["clip0.mp4 read", "clip1.mp4 read"]
    assert turn.problems[2] == ("**clip2.mp4** was not decoded: the message's files used up the 60 s of decoding "
                                "this demo gives a message.")


def test_the_map_resizes_its_picture_once_per_size_and_redraws_the_same(monkeypatch):
    """The map is redrawn while an answer streams and while the timeline replays: the picture's resized,
    washed-out tile is made once per size (it was made at every redraw), and a redraw equals a fresh draw."""
    import numpy as np

    from demo.app import SegmentView, draw_picture

    picture = draw_test_image(128, 96, seed=3)
    states = [["selected", "deferred", "during", "after", "dropped", "deferred"] * 2]
    fresh = np.asarray(draw_picture([SegmentView("image", (1, 3, 4), picture, "image 1")], states))
    view = SegmentView("image", (1, 3, 4), picture.copy(), "image 1")
    draw_picture([view], [["deferred"] * 12])
    assert len(view.tiles) == 1

    def no_resize(*args, **kwargs):
        raise AssertionError("the picture was resized again for a size already drawn")

    monkeypatch.setattr(view.picture, "resize", no_resize)
    assert np.array_equal(np.asarray(draw_picture([view], states)), fresh)


# ---- the demo's code ------------------------------------------------------------------------------

def test_no_function_in_the_demo_is_over_80_lines():
    """demo/ is a package of small functions: none over 80 lines, methods and nested functions included (a
    function's lines run from its ``def`` to its last line, nested functions within it counted)."""
    import ast

    paths = sorted((ROOT / "demo").rglob("*.py"))
    assert len(paths) > 5, paths  # the package's modules, not one file
    too_long = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not too_long, too_long


def test_the_demo_warms_up_its_loaded_model_at_its_starting_settings(monkeypatch):
    import argparse

    import demo.app as app
    import raincheck_hf.warmup as warmup
    from demo.models import load_model

    loaded = load_model("tiny")
    calls = []
    real = warmup.warm_up

    def recording(model, processor, config, **kwargs):
        calls.append((model, config))
        return real(model, processor, config, **kwargs)

    monkeypatch.setattr(warmup, "warm_up", recording)
    args = argparse.Namespace(warm_up=True, warm_up_tokens=256, cache_dir=None, mode="raincheck", max_new_tokens=8)
    app.warm_up_loaded(args)
    assert any(model is loaded.model and config.mode == "raincheck" for model, config in calls)
    calls.clear()
    app.warm_up_loaded(argparse.Namespace(**{**vars(args), "warm_up": False}))
    assert calls == []  # --no-warm-up
