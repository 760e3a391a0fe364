"""Shared fixtures: a tiny Qwen3-VL and its processor, built in code (nothing is downloaded)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from raincheck_hf.tiny import draw_test_image, draw_test_video

from families import BY_NAME, FAMILIES, family_model, family_processor  # noqa: F401 (the shared family list)

torch.set_num_threads(1)  # tiny models: threading overhead outweighs the work


@pytest.fixture(scope="session")
def processor():
    return family_processor("qwen3_vl")


@pytest.fixture(scope="session")
def model():
    return family_model("qwen3_vl")


@pytest.fixture(scope="session")
def eager_model():
    return family_model("qwen3_vl", "eager")


@pytest.fixture(scope="session")
def qwen35():
    return family_model("qwen3_5")


@pytest.fixture(scope="session")
def eager_qwen35():
    return family_model("qwen3_5", "eager")


@pytest.fixture
def family(request):
    """``(Family, model, processor)`` of the family named by the test's ``family`` parameter."""
    name = request.param
    return BY_NAME[name], family_model(name), family_processor(name)


def no_placeholder_ids(model):
    """Placeholder and vision-marker ids: a random model may "answer" with one, which would upset the next
    turn's (and the references') rope index and feature count; stock and Raincheck runs get the same
    suppression."""
    c = model.config
    return [c.image_token_id, c.video_token_id, c.vision_start_token_id, c.vision_end_token_id]


def video_metadata(num_frames: int, fps: float = 2.0):
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(total_num_frames=num_frames, fps=fps, frames_indices=list(range(num_frames)))


def make_inputs(processor, images=(), videos=(), text="What is in this image?", history=None, video_fps=2.0):
    """Processor inputs for one user turn, as users make them (chat template + processor)."""
    content = [{"type": "image"} for _ in images] + [{"type": "video"} for _ in videos]
    content.append({"type": "text", "text": text})
    messages = [{"role": "user", "content": content}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    kwargs = {}
    if images:
        kwargs["images"] = list(images)
    if videos:
        kwargs["videos"] = list(videos)
        kwargs["videos_kwargs"] = {"video_metadata": [video_metadata(v.shape[0], video_fps) for v in videos]}
    return processor(text=[prompt], return_tensors="pt", **kwargs)


INPUT_CASES = {
    "one_image": dict(images=(draw_test_image(128, 96, seed=1),)),
    "two_images": dict(images=(draw_test_image(96, 64, seed=2), draw_test_image(64, 128, seed=3))),
    "video": dict(videos=(draw_test_video(4, 64, 96, seed=4),), text="What happens in the video?"),
    "image_and_video": dict(images=(draw_test_image(64, 64, seed=5),), videos=(draw_test_video(2, 64, 64, seed=6),)),
}


@pytest.fixture(params=sorted(INPUT_CASES), ids=sorted(INPUT_CASES))
def case_inputs(request, processor):
    return make_inputs(processor, **INPUT_CASES[request.param])


@pytest.fixture(scope="module")
def glyph():
    """The bundled glyph Qwen3-VL, Raincheck enabled: ``(model, processor)``, one a test module."""
    import raincheck_hf
    from raincheck_hf.quality import load_bundled

    model, processor = load_bundled("qwen3_vl")
    return raincheck_hf.enable(model), processor


def serve_settings(argv: list[str]):
    """The `ServeSettings` that ``raincheck_hf serve``'s command line ``argv`` gives (`serve.cli`'s options)."""
    import argparse

    from raincheck_hf.serve import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.settings_from(parser.parse_args(argv))


def assert_same_output(got, want, tol: float, what: str = "forward") -> None:
    """Two `generate` outputs (``return_dict_in_generate``, ``output_logits``): the same sequences, and each
    forward's logits within ``tol`` (max abs)."""
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == len(want.logits)
    for i, (a, b) in enumerate(zip(got.logits, want.logits)):
        diff = (a - b).abs().max().item()
        assert diff <= tol, f"{what} {i}: max abs logit diff {diff:.2e}"


def wait_for(predicate, timeout: float = 60.0) -> None:
    """Return once ``predicate()`` is true, looking every few milliseconds; fail after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.005)


def in_threads(worker, count: int, on_error=None) -> list[BaseException]:
    """Run ``worker(i)`` for each ``i < count`` in a thread of its own and wait for them all; returns what they
    raised. ``on_error()`` runs after each failure (a barrier's ``abort``, so the others do not wait for it)."""
    import threading

    errors = []

    def run(i):
        try:
            worker(i)
        except BaseException as error:  # noqa: BLE001 - returned to the test
            errors.append(error)
            if on_error is not None:
                on_error()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


@contextlib.contextmanager
def serve_demo(**build_kwargs):
    """The Gradio demo served on a free local port for the span of the block; yields its URL."""
    import socket

    from demo.app import build_demo

    demo = build_demo(**build_kwargs)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True, show_error=True)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


def count_compiled_calls(monkeypatch) -> list:
    """Every call of a `fast.compiled` form from now on (the function compiled), in order, through ``monkeypatch``
    (the compiled forms themselves still run)."""
    from raincheck_hf.fast import compiled as compiled_module

    calls = []
    real = compiled_module.compiled

    def counting(fn, rows=None, sizes=None):
        out = real(fn, rows, sizes)

        def call(*args, **kwargs):
            calls.append(fn)
            return out(*args, **kwargs)

        return call

    monkeypatch.setattr(compiled_module, "compiled", counting)
    return calls


def gate_restoring_pieces(monkeypatch, steps: int) -> dict:
    """Restoring sequences get pieces (`batch_engine.RowScheduler.restoring_pieces`) in only ``steps`` more steps;
    the returned dict's ``"left"`` counts them down, and a test opens the gate again by raising it."""
    from raincheck_hf.batch_engine import RowScheduler

    pieces, gate = RowScheduler.restoring_pieces, {"left": steps}

    def gated(self, adapter, sequences, left):
        if gate["left"] <= 0:
            return []
        taken = pieces(self, adapter, sequences, left)
        gate["left"] -= bool(taken)
        return taken

    monkeypatch.setattr(RowScheduler, "restoring_pieces", gated)
    return gate


def failing_slot_resize(monkeypatch, fails) -> list:
    """`kv_pool.SlotKVLayer.resize` raising a CUDA out-of-memory error for an allocated layer where ``fails(layer,
    num_slots, capacity)`` says so, otherwise as usual; the returned list gets each failed layer's index."""
    from raincheck_hf.kv_pool import SlotKVLayer

    resize, failed = SlotKVLayer.resize, []

    def failing(self, num_slots, capacity):
        if self.is_initialized and fails(self, num_slots, capacity):
            failed.append(self.layer_idx)
            raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
        return resize(self, num_slots, capacity)

    monkeypatch.setattr(SlotKVLayer, "resize", failing)
    return failed


class Room:
    """What a pool's ``on_short`` asks (a growth short of memory): ``asked``, the bytes of each ask; ``made``, whether
    room is said to be made."""

    def __init__(self, made: bool = True):
        self.made, self.asked = made, []

    def relieve(self, nbytes: int) -> bool:
        self.asked.append(nbytes)
        return self.made


def fail_remove_many(monkeypatch, error=lambda: RuntimeError("remove broke")) -> dict:
    """`BatchEngine.remove_many` raising ``error()`` (as a bug, a device error or a lack of memory would) on its next
    ``state["left"]`` calls that remove sequences (1; a test sets it again to fail again), otherwise as usual; the
    returned ``state["failed"]`` lists how many sequences each failed call had."""
    from raincheck_hf.batch_engine import BatchEngine

    remove, state = BatchEngine.remove_many, {"left": 1, "failed": []}

    def failing(self, seqs):
        if state["left"] > 0 and seqs:
            state["left"] -= 1
            state["failed"].append(len(seqs))
            raise error()
        return remove(self, seqs)

    monkeypatch.setattr(BatchEngine, "remove_many", failing)
    return state
