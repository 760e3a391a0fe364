"""The Gradio demo through its API: `gradio_client` against ``demo.launch(prevent_thread_lock=True)``.

The app runs the bundled tiny model (random weights), so the tests look at the mechanics, never at
the words: streaming, the trace figures, idle-time restoration, bad input, and session isolation.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
pytest.importorskip("gradio")
pytest.importorskip("gradio_client")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `demo` lives beside the package

from gradio_client import Client, handle_file  # noqa: E402

from raincheck_hf.tiny import draw_test_image  # noqa: E402

# outputs of /chat: chatbot, picture, caption, figures, status, timer, model, model note, textbox
CHAT, PICTURE, CAPTION, FIGURES, STATUS = range(5)
ANSWER_TOKENS = 8  # shorter than the decode guard (16): every deferred token is restored after the answer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url():
    from demo.app import build_demo

    demo = build_demo(max_new_tokens=ANSWER_TOKENS)
    port = free_port()
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True, show_error=True)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


@pytest.fixture
def client(app_url):
    return Client(app_url, verbose=False, download_files=False, analytics_enabled=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo-files")
    paths = {"blocks": folder / "blocks.png", "small": folder / "small.png", "big": folder / "big.png",
             "text": folder / "notes.txt", "empty": folder / "empty.png", "broken": folder / "broken.png"}
    draw_test_image(384, 288, seed=1).save(paths["blocks"])  # 12 × 9 = 108 merged tokens
    draw_test_image(128, 96, seed=2).save(paths["small"])  # 4 × 3 = 12 merged tokens
    draw_test_image(1600, 1200, seed=3).save(paths["big"])  # over the processor's pixel limit
    paths["text"].write_text("not a picture")
    paths["empty"].write_bytes(b"")
    paths["broken"].write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
    return {k: str(v) for k, v in paths.items()}


def ask(client, text, *paths, **controls):
    job = client.submit({"text": text, "files": [handle_file(p) for p in paths]}, api_name="/chat", **controls)
    return job.result(timeout=120), job.outputs()


def last_text(chat) -> str:
    return chat[-1]["content"][0].get("text", "")


def texts(chat, role) -> list[str]:
    return [m["content"][0]["text"] for m in chat if m["role"] == role and m["content"][0].get("type") == "text"]


def status_when(client, done, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = client.predict(api_name="/status")[STATUS]
        if done(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


def test_two_turns_stream_and_the_follow_up_comes_after_restoration(client, files):
    final, outputs = ask(client, "What is in this image?", files["blocks"])
    partials = {last_text(o[CHAT]) for o in outputs if isinstance(o[CHAT], list) and o[CHAT]
                and o[CHAT][-1]["role"] == "assistant"}
    assert len(partials) >= 3, "the answer did not stream"
    first = final[STATUS]["turn_figures"][0]
    assert first["visual_tokens"] == 108 and first["selected"] + first["deferred"] == 108
    assert 0 < first["deferred"] < 108 and first["answer_tokens"] == ANSWER_TOKENS
    assert first["restored_during_answer"] == 0  # the answer is shorter than the guard
    assert final[STATUS]["picture"]["segments"] == [
        {"modality": "image", "grid": [1, 9, 12], "size": [384, 288], "label": "image 1"}]
    assert final[PICTURE] and Path(final[PICTURE]["path"]).is_file()

    # idle-time restoration finishes in the background; the status endpoint (the page's timer) sees it
    status = status_when(client, lambda s: s["pending"] == 0)
    assert status["pending"] == 0 and status["restored"] == first["deferred"] and status["restored_once"]
    assert status["turn_figures"][0]["restored_after_answer"] == first["deferred"]

    final, outputs = ask(client, "Which colour is the block in the top-left corner?")
    second = final[STATUS]["turn_figures"][1]
    assert second["restored_at_prefill"] == 0, "the follow-up found deferred tokens still pending"
    assert second["visual_tokens"] == 0 and second["answer_tokens"] == ANSWER_TOKENS
    assert final[STATUS]["restored"] == first["deferred"] and final[STATUS]["restored_once"]
    assert len(final[FIGURES]["data"]) == 2
    assert texts(final[CHAT], "user") == ["What is in this image?", "Which colour is the block in the top-left corner?"]
    assert "every deferred token is in the cache" in final[CAPTION]


def test_bad_input_gets_a_message_and_the_conversation_goes_on(client, files):
    final, _ = ask(client, "What is in this image?", files["small"])
    assert final[STATUS]["turns"] == 1
    cases = {"text": "is not an image or a video", "empty": "is empty", "broken": "could not be read as an image"}
    for key, expected in cases.items():
        final, _ = ask(client, "And this one?", files[key])
        message = last_text(final[CHAT])
        assert expected in message and os.path.basename(files[key]) in message
        assert "Nothing was sent to the model" in message
        assert final[STATUS]["turns"] == 1  # nothing reached the model

    final, _ = ask(client, "")
    assert "The message is empty" in last_text(final[CHAT])
    final, _ = ask(client, "", files["small"])
    assert "Add a question" in last_text(final[CHAT])

    final, _ = ask(client, "Describe it.", files["big"])
    assert any("1600×1200" in t and "resized to" in t for t in texts(final[CHAT], "assistant"))
    assert final[STATUS]["turns"] == 2
    assert final[STATUS]["picture"]["segments"][0]["size"][0] * final[STATUS]["picture"]["segments"][0]["size"][1] \
        <= 384 * 384

    final, _ = ask(client, "Still there?", model="/no/such/model")
    notes = texts(final[CHAT], "assistant")
    assert any("Could not load model" in t and "/no/such/model" in t for t in notes)
    assert final[STATUS]["turns"] == 3 and final[STATUS]["settings"]["model"].startswith("tiny")


def test_changing_a_setting_starts_a_new_conversation_with_a_note(client, files):
    final, _ = ask(client, "What is in this image?", files["small"])
    assert final[STATUS]["conversation"] == 1 and final[STATUS]["turns"] == 1
    final, _ = ask(client, "And now?", files["blocks"], mode="hard", retention=0.5)
    notes = texts(final[CHAT], "assistant")
    assert any("New conversation" in t and "mode → hard" in t and "retention → 0.5" in t for t in notes)
    status = final[STATUS]
    assert status["conversation"] == 2 and status["turns"] == 1  # the earlier turn is not part of it
    figures = status["turn_figures"][0]
    assert figures["selected"] == 54 and figures["dropped"] == figures["deferred"] == 54
    assert status["dropped"] == 54 and status["pending"] == 0 and status["restored"] == 0
    assert "dropped tokens are gone for good" in final[CAPTION]


def test_a_long_video_is_sampled_and_drawn_per_slice(client, tmp_path):
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


def test_two_clients_in_parallel_do_not_share_state(app_url, files):
    clients = [Client(app_url, verbose=False, download_files=False, analytics_enabled=False) for _ in range(2)]
    questions = [("Tell me about the large one.", files["blocks"], 108), ("Tell me about the small one.",
                                                                          files["small"], 12)]
    results: list = [None, None]

    def run(i):
        text, path, _ = questions[i]
        first, _ = ask(clients[i], text, path)
        second, _ = ask(clients[i], f"Follow-up {i}?")
        results[i] = (first, second)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert all(r is not None for r in results), "a client did not finish"
    sessions = set()
    for i, (first, second) in enumerate(results):
        text, _, tokens = questions[i]
        status = second[STATUS]
        sessions.add(status["session"])
        assert status["turns"] == 2 and status["turn_figures"][0]["visual_tokens"] == tokens
        assert texts(second[CHAT], "user") == [text, f"Follow-up {i}?"]
    assert len(sessions) == 2
