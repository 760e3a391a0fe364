"""The server against careless and hostile clients: limits (body size, prompt tokens, images, pixels,
video), OpenAI's error shape and statuses, the request log, /docs and /v1/models, /metrics through
prometheus_client, a server fault answered without internals, and a seeded fuzz of malformed requests.
The bundled glyph Qwen3-VL on the CPU; nearly every request here is refused before any model compute."""

from __future__ import annotations

import base64
import copy
import io
import json
import logging
import random
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from raincheck_hf.quality.glyphs import benchmark_split  # noqa: E402
from raincheck_hf.tiny import draw_test_image  # noqa: E402

from conftest import serve_settings  # noqa: E402

KEY = "limits-key"
HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def served(glyph, tmp_path_factory):
    from raincheck_hf.serve import ServeSettings, create_app, running

    model, processor = glyph
    media = tmp_path_factory.mktemp("media")
    app = create_app(model, processor, ServeSettings(model_name="glyph", api_key=KEY, media_root=media.resolve(),
                                                     max_tokens=8))
    with running(app) as base:
        yield base, app.state.server, app


def make_server(glyph, **settings):
    """A `Server` (no HTTP) with the given settings, for `Server.prepare` on raw bodies."""
    from raincheck_hf.serve import ServeSettings, create_app

    return create_app(*glyph, ServeSettings(model_name="glyph", **settings)).state.server


def encoded(image, fmt="PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def noise_png() -> bytes:
    """A PNG that does not compress (random pixels, seeded): cut short, its pixel data is truncated."""
    from PIL import Image

    return encoded(Image.frombytes("RGB", (64, 48), random.Random(0).randbytes(64 * 48 * 3)))


def data_url(data: bytes, media_type="image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def image_message(url: str, question: str = "what is the background of the pink g5 ?") -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": question}]}


def post(base, body, headers=HEADERS, **kwargs):
    content = json.dumps(body) if isinstance(body, dict) else body  # bytes, or a generator (sent chunked)
    return httpx.post(base + "/v1/chat/completions", content=content, headers=headers, timeout=60, **kwargs)


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.fixture()
def no_decoding(monkeypatch):
    """Every image decode (not header read) in `protocol`, recorded."""
    from raincheck_hf.serve import protocol

    calls = []
    for name in ("decode_image", "decode_pixels"):  # (without the server's cache; with it, and a video's frames)
        real = getattr(protocol, name)
        monkeypatch.setattr(protocol, name, lambda data, param, real=real: calls.append(param) or real(data, param))
    return calls


# ---- limits ---------------------------------------------------------------------------------------

def test_decompression_bomb_is_refused_from_its_header(served, no_decoding):
    """A 15000 x 15000 PNG of a few KB (1-bit) gets a 400 naming the limit and its size; nothing is decoded.
    So do one of 10000 x 10000 (where Pillow itself would only warn and decode it) and a 7 KB TIFF."""
    from PIL import Image

    base, server, _ = served
    for side, fmt in ((15000, "PNG"), (10000, "PNG"), (15000, "TIFF")):
        buffer = io.BytesIO()
        Image.new("1", (side, side)).save(buffer, fmt, **({"compression": "group4"} if fmt == "TIFF" else {}))
        bomb = buffer.getvalue()
        assert len(bomb) < 50_000
        error = error_of(post(base, {"messages": [image_message(data_url(bomb, f"image/{fmt.lower()}"))]}), 400)
        assert f"{side} x {side} = {side * side:,} pixels" in error["message"], error
        assert "67,108,864" in error["message"] and "--max-image-pixels" in error["message"]
        assert error["param"] == "messages[0].content[0].image_url" and error["code"] == "image_too_large"
    assert no_decoding == []


def test_pixels_per_request_images_and_frames_per_request(glyph, no_decoding):
    from raincheck_hf.serve import APIError, Limits

    png = data_url(encoded(draw_test_image(64, 48, seed=1)))
    server = make_server(glyph, limits=Limits(max_request_pixels=64 * 48 * 2, max_images=3, max_video_frames=4))
    high = {"type": "image_url", "image_url": {"url": png, "detail": "high"}}
    two = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": png}, high]}]}
    server.prepare(json.dumps(two).encode(), 0.0)  # exactly at the limit
    calls = len(no_decoding)
    three = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": png}] * 3}]}
    with pytest.raises(APIError, match=r"more than 6,144 pixels \(9,216 up to this one\).*--max-request-pixels") as e:
        server.prepare(json.dumps(three).encode(), 0.0)
    assert e.value.status == 400 and e.value.param == "messages[0].content[2].image_url"
    four = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": png}] * 4}]}
    with pytest.raises(APIError, match=r"has 4 images .* limit is 3 per request \(--max-images\)"):
        server.prepare(json.dumps(four).encode(), 0.0)
    frames = {"messages": [{"role": "user", "content": [{"type": "video", "video": [png] * 5, "fps": 2}]}]}
    with pytest.raises(APIError, match=r"has 5 video frames.*limit is 4 per request \(--max-video-frames\)"):
        server.prepare(json.dumps(frames).encode(), 0.0)
    assert len(no_decoding) == calls  # refused before decoding


def test_two_hundred_images_are_refused_before_decoding(served, no_decoding):
    base, server, _ = served
    png = data_url(encoded(draw_test_image(64, 48, seed=3)))
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": png}}] * 200}
    error = error_of(post(base, {"messages": [message]}), 400)
    assert "200 images" in error["message"] and "limit is 32" in error["message"] and "--max-images" in error["message"]
    assert error["code"] == "too_many_images" and no_decoding == []


def test_sixty_megabytes_get_413_before_being_read(served):
    """With a Content-Length the server answers from the headers; sent chunked, it stops at the limit."""
    base, server, _ = served
    body = json.dumps({"messages": [{"role": "user", "content": "dark " * (12 << 20)}]}).encode()
    assert len(body) > 60 << 20
    error = error_of(post(base, body), 413)
    assert f"{len(body):,} bytes" in error["message"] and "33,554,432" in error["message"]
    assert error["code"] == "request_too_large" and "--max-body-mb" in error["message"]

    def chunks():
        for i in range(0, len(body), 1 << 20):
            yield body[i:i + (1 << 20)]

    r = post(base, chunks())
    assert r.request.headers.get("transfer-encoding") == "chunked"
    error = error_of(r, 413)
    assert "over 33,554,432 bytes" in error["message"]
    assert httpx.get(base + "/health").json()["status"] == "ok"


def test_prompt_tokens_against_the_context_the_kv_budget_and_the_option(glyph, served):
    from raincheck_hf.serve import APIError, Limits

    base, server, _ = served
    question = "what is the background of the pink g5 ? "  # 9 tokens of the glyph tokenizer
    # 4 MB of text (the processor would take seconds over it): refused after tokenizing its first chunk
    long = {"messages": [{"role": "user", "content": question * 100_000}]}
    error = error_of(post(base, long), 400)
    assert "the model's context is 4,096 tokens" in error["message"] and error["code"] == "context_length_exceeded"
    assert "its text alone, counted up to the limit" in error["message"]
    more = int(error["message"].split("more than ", 1)[1].split(" tokens", 1)[0].replace(",", ""))
    assert 4095 < more < 4095 + 2 * server.TEXT_CHUNK
    # the exact count, after the processor: 4 x 9 text tokens pass the early count, the chat template's 5 do not
    with pytest.raises(APIError, match=r"prompt is 41 tokens \(the messages in the chat template.*limit is 38 prompt"):
        make_server(glyph, limits=Limits(max_prompt_tokens=38)).prepare(
            json.dumps({"messages": [{"role": "user", "content": question * 4}]}).encode(), 0.0)
    # the KV budget: --max-cache-gb in tokens (keys and values of the 4 attention layers: 2 * 4 * 2 heads * 64 * 4 B)
    budget = make_server(glyph, max_cache_bytes=100 * 4096)
    assert budget.kv_bytes_per_token == 4096 and budget.kv_tokens == 100
    short = {"messages": [{"role": "user", "content": "what is the background of the pink g5 ? " * 20}]}
    with pytest.raises(APIError, match=r"the model's context is 4,096 tokens; the server's KV budget "
                                       r"\(--max-cache-gb\) holds 100 tokens"):
        budget.prepare(json.dumps(short).encode(), 0.0)
    limited = make_server(glyph, limits=Limits(max_prompt_tokens=10))
    with pytest.raises(APIError, match=r"limit is 10 prompt tokens \(--max-prompt-tokens\)"):
        limited.prepare(json.dumps(short).encode(), 0.0)
    # a fitting prompt: the answer's length is capped at the room left in the context
    turn = server.prepare(json.dumps({**short, "max_tokens": 1 << 20, "min_tokens": 1 << 20}).encode(), 0.0)
    kwargs = turn.request.generate_kwargs
    assert kwargs["max_new_tokens"] == kwargs["min_new_tokens"] == 4096 - turn.prompt_tokens


def _video_file(seconds: float, fps: int = 4, size=(64, 48)) -> bytes:
    import av
    import numpy as np

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(int(seconds * fps)):
            frame = av.VideoFrame.from_ndarray(np.full((size[1], size[0], 3), i * 7 % 255, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buffer.getvalue()


def test_video_duration_frame_size_and_decoding_time(glyph):
    pytest.importorskip("av")
    from raincheck_hf.serve import APIError, Limits

    video = _video_file(3.0)

    def request(data):
        return json.dumps({"messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": data_url(data, "video/mp4")}},
            {"type": "text", "text": "what is the background of the pink g5 ?"}]}]}).encode()

    turn = make_server(glyph).prepare(request(video), 0.0)
    assert tuple(turn.request.videos[0].value.shape) == (12, 3, 48, 64)
    with pytest.raises(APIError, match=r"the video is 3.0 s long; the server's limit is 2 s per video "
                                       r"\(--max-video-seconds\)") as e:
        make_server(glyph, limits=Limits(max_video_seconds=2)).prepare(request(video), 0.0)
    assert e.value.code == "video_too_long"
    with pytest.raises(APIError, match=r"the video's frame is 64 x 48 = 3,072 pixels.*limit is 3,000"):
        make_server(glyph, limits=Limits(max_image_pixels=3000)).prepare(request(video), 0.0)
    # a deadline already past: refused between the frames, with the option's name
    with pytest.raises(APIError, match=r"longer than the server's limit of 1e-09 s \(--media-timeout\)") as e:
        make_server(glyph, limits=Limits(media_timeout_s=1e-9)).prepare(request(video), 0.0)
    assert e.value.code == "media_timeout"
    image = json.dumps({"messages": [image_message(data_url(encoded(draw_test_image(64, 48))), "x")]}).encode()
    with pytest.raises(APIError, match="--media-timeout"):
        make_server(glyph, limits=Limits(media_timeout_s=1e-9)).prepare(image, 0.0)
    with pytest.raises(APIError, match=r"a data URL of type 'image/png' where an video is expected") as e:
        make_server(glyph).prepare(request(encoded(draw_test_image(64, 48))).replace(b"video/mp4", b"image/png"), 0.0)


# ---- errors ---------------------------------------------------------------------------------------

def test_errors_name_the_parameter_and_value(served):
    base, server, _ = served
    good = {"model": "glyph", "messages": [{"role": "user", "content": "hi"}]}
    not_image = data_url(b"hello", "image/png")
    cases = [  # (body, status, param, words in the message)
        ({**good, "model": "gpt-9"}, 404, "model", ["'gpt-9'", "['glyph']"]),
        ({**good, "messages": [image_message(not_image)]}, 400, "messages[0].content[0].image_url",
         ["not an image this server reads"]),
        ({**good, "messages": [image_message(data_url(b"hello", "text/plain"))]}, 400,
         "messages[0].content[0].image_url", ["'text/plain'"]),
        ({**good, "messages": [image_message(data_url(noise_png()[:-400]))]}, 400,
         "messages[0].content[0].image_url", ["truncated"]),
        ({**good, "messages": [image_message("data:image/png;base64,@@@")]}, 400,
         "messages[0].content[0].image_url", ["base64"]),
        ({**good, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": data_url(encoded(draw_test_image(64, 48))), "detail": "low"}}]}]}, 400,
         "messages[0].content[0].image_url.detail", ["'auto' or 'high'", "'low'"]),
        ({**good, "temperature": "0.5"}, 400, "temperature", ["valid number", "'0.5'"]),
        ({**good, "max_tokens": 2.5}, 400, "max_tokens", ["valid integer", "2.5"]),
        ({**good, "max_tokens": -3}, 400, "max_tokens", ["greater than or equal to 1", "-3"]),
        ({**good, "seed": 1 << 70}, 400, "seed", ["less than or equal to"]),
        ({**good, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", ["'wizard'", "'user'"]),
        ({**good, "messages": [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]}, 400,
         "messages[0].content[0].type", ["'audio'"]),
        ({**good, "raincheck": {"speed": 3}}, 400, "raincheck.speed", ["unknown field"]),
        ({**good, "raincheck": {"retention": 1.5}}, 400, "raincheck", ["retention=1.5"]),
        ({**good, "logit_bias": {"7": 500}}, 400, "logit_bias['7']", ["less than or equal to 100", "500"]),
        ({**good, "frobnicate": 1}, 400, "frobnicate", ["unknown field"]),
        ({**good, "n": 2}, 400, "n", ["1", "2"]),
        ({**good, "tools": [{"type": "function"}]}, 400, "tools", ["not supported"]),
        ({**good, "messages": [{"role": "user", "content": "a\ud800b"}]}, 400, "messages[0].content",
         ["not valid Unicode", "\\ud800"]),
    ]
    for body, status, param, words in cases:
        error = error_of(post(base, body), status)
        assert error["param"] == param, (body, error)
        assert all(w in error["message"] for w in words), (words, error)
        assert "<_io" not in error["message"] and " at 0x" not in error["message"], error
    assert error_of(post(base, {**good, "model": "gpt-9"}), 404)["code"] == "model_not_found"
    raw = b'{"model": "glyph", "messages": [{"role": "user", "content": "hi"}], "model": "other"}'
    error = error_of(post(base, raw), 400)
    assert "'model' twice" in error["message"] and error["code"] == "duplicate_field"
    for raw in (b'{"messages": NaN}', b'{"messages": [' * 100_000, b'\xff\xfe{}', b'[1, 2]', b'"hi"', b''):
        assert error_of(post(base, raw), 400)["type"] == "invalid_request_error"


def logged(caplog, count: int, timeout: float = 30.0, match: str = "") -> list[str]:
    """The request log's lines (those with ``match`` in them), once there are ``count``: a line is written when its
    response has ended, which may be after the client has read it (so a line of the test before may land in this
    test's capture on a loaded machine: ``match`` leaves it out)."""
    def lines():
        return [r.getMessage() for r in caplog.records
                if r.name == "raincheck_hf.serve" and not r.exc_info and match in r.getMessage()]

    deadline = time.monotonic() + timeout
    while len(lines()) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return lines()


def test_a_server_fault_is_a_500_that_leaks_nothing_and_is_logged_once(served, monkeypatch, caplog):
    base, server, _ = served
    from raincheck_hf.serve import store

    def fail(*args, **kwargs):
        raise RuntimeError("secret internals /opt/weights")

    monkeypatch.setattr(store.ServedConversation, "answer", fail)
    caplog.set_level(logging.INFO, logger="raincheck_hf.serve")
    for stream in (False, True):
        r = post(base, {"messages": [{"role": "user", "content": "hi"}], "stream": stream})
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            error = events[-1]["error"]
        else:
            error = error_of(r, 500)
        assert error["type"] == "server_error"
        assert "secret" not in error["message"] and "Runtime" not in error["message"]
    faults = [r for r in caplog.records if r.exc_info]
    assert len(faults) == 2 and all("secret internals" in str(r.exc_info[1]) for r in faults)
    plain, streamed = logged(caplog, 2, match="error=internal_error")
    assert plain.startswith("POST /v1/chat/completions 500 ") and "error=internal_error" in plain
    assert streamed.startswith("POST /v1/chat/completions 200 ") and "error=internal_error" in streamed


def test_fastapis_422_is_openais_400(served):
    """A route with a typed parameter (FastAPI validates it): its error comes back as OpenAI's 400."""
    base, server, app = served

    @app.get("/probe-validation")
    async def probe(n: int):
        return {"n": n}

    error = error_of(httpx.get(base + "/probe-validation", params={"n": "x"}, headers=HEADERS), 400)
    assert error["param"] == "n" and "integer" in error["message"]


# ---- log, docs, models, metrics ---------------------------------------------------------------------

def test_requests_are_logged_4xx_included(served, caplog):
    base, server, _ = served
    caplog.set_level(logging.INFO, logger="raincheck_hf.serve")
    d = benchmark_split("dev", limit=1)[0]
    ok = post(base, {"messages": [image_message(data_url(encoded(d.image())), d.turns[0].question)],
                     "temperature": 0, "user": "alice"})
    assert ok.status_code == 200
    conv = ok.json()["raincheck"]["conversation_id"]
    post(base, {"messages": [], "user": "bob"})
    httpx.get(base + "/v1/models")  # no key: 401
    lines = logged(caplog, 3)
    assert any(line.startswith(f"POST /v1/chat/completions 200 conversation={conv} cached=0 t1_ms=")
               and 'user="alice" client=127.0.0.1 duration_ms=' in line for line in lines), lines
    assert any(line.startswith("POST /v1/chat/completions 400 ") and "duration_ms=" in line for line in lines), lines
    assert any(line.startswith("GET /v1/models 401 error=invalid_api_key") for line in lines), lines


def test_models_docs_and_openapi_state_the_limits_and_the_schema(served):
    base, server, _ = served
    (model,) = httpx.get(base + "/v1/models", headers=HEADERS).json()["data"]
    assert model["id"] == "glyph" and model["max_model_len"] == 4096
    assert model["limits"]["max_images"] == 32 and model["limits"]["max_body_bytes"] == 32 << 20
    assert model["limits"]["max_image_pixels"] == 1 << 26 and model["limits"]["context_tokens"] == 4096
    assert httpx.get(base + "/docs").status_code == 200  # open, like /health
    spec = httpx.get(base + "/openapi.json").json()
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    schemas = spec["components"]["schemas"]
    assert "Raincheck" in schemas["ChatCompletionRequest"]["properties"]["raincheck"]["description"]
    assert set(schemas["RaincheckSettings"]["properties"]) == {"mode", "retention", "chunk_size", "decode_guard",
                                                              "selector", "tpot_slack", "chunk_every"}
    assert "413" in spec["paths"]["/v1/chat/completions"]["post"]["responses"]


def test_metrics_registry_is_the_apps_own(glyph, served):
    from raincheck_hf.serve import ServeSettings, create_app, running

    base, server, _ = served
    httpx.get(base + "/health")  # (counted whatever ran before on this server)
    text = httpx.get(base + "/metrics", headers=HEADERS).text
    assert "process_resident_memory_bytes" in text and "python_gc_objects_collected_total" in text
    assert 'raincheck_requests_total{endpoint="/health",status="200"}' in text
    with running(create_app(*glyph, ServeSettings(model_name="glyph"))) as other:
        httpx.get(other + "/health")
        fresh = httpx.get(other + "/metrics").text
    counts = dict(line.rsplit(" ", 1) for line in fresh.splitlines() if line and not line.startswith("#"))
    assert float(counts['raincheck_requests_total{endpoint="/health",status="200"}']) == 1.0
    assert "raincheck_requests_total{endpoint=\"/v1/chat/completions\"" not in fresh


# ---- fuzz -----------------------------------------------------------------------------------------

JUNK = [None, True, False, 0, -1, 1 << 64, -(1 << 70), 1e308, -1e-308, 3.5, "", "x" * 5000, "\x00", "\ud800",
        "\udfff\ud800", "\u202e\u0301", "🙂" * 50, "NaN", "1", [], [[]], [None], {}, {"url": 5}, {"": {"": []}}]


def junk(rng):
    return copy.deepcopy(rng.choice(JUNK))  # a fresh object: mutations never share (or nest) one


def _paths(value, path=()):
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, path + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _paths(item, path + (i,))


def _set(value, path, new):
    for key in path[:-1]:
        value = value[key]
    value[path[-1]] = new


def _delete(value, path):
    for key in path[:-1]:
        value = value[key]
    del value[path[-1]]


def fuzz_bodies(png: bytes, seed: int, count: int):
    """``count`` request bodies (bytes), each a valid request with one to three mutations: wrong types, huge
    and negative numbers, unicode edge cases, unknown or missing fields, broken base64, truncated or
    oversized images, wrong media types; or the JSON text itself broken (duplicate fields, truncation,
    bytes that are not UTF-8, NaN, deep nesting)."""
    from PIL import Image

    rng = random.Random(seed)
    bad_urls = ["data:image/png;base64,@@@@", data_url(png[:len(png) // 2]), data_url(png, "text/plain"),
                data_url(png, "video/mp4"), data_url(bytes(rng.getrandbits(8) for _ in range(300))),
                "data:image/png,plain", "data:;base64,", "https://example.com/a.png", "file:///etc/passwd",
                "ftp://x", data_url(encoded(Image.new("1", (12000, 12000)))), data_url(b"GIF89a" + b"\xff" * 20),
                data_url(png[:8] + b"\x00" * 40), data_url(encoded(Image.new("RGB", (1, 1)))),
                data_url(encoded(Image.new("RGB", (4000, 8)))), "data:image/png;base64," + "A" * 1001]
    for _ in range(count):
        body = {"model": "glyph", "max_tokens": 4, "temperature": 0, "stream": rng.random() < 0.3,
                "messages": [image_message(data_url(png), "what is the background of the pink g5 ?")]}
        text = None
        for _ in range(rng.randint(1, 3)):
            kind = rng.random()
            paths = [p for p in _paths(body) if p]
            if kind < 0.35:
                _set(body, rng.choice(paths), junk(rng))
            elif kind < 0.5:
                _set_image_url(body, rng.choice(bad_urls))
            elif kind < 0.6:
                path = rng.choice(paths)
                try:
                    _delete(body, path)
                except (TypeError, KeyError, IndexError):
                    pass
            elif kind < 0.7:
                target = rng.choice([p for p in paths + [()] if isinstance(_get(body, p), dict)] or [()])
                _get(body, target)[rng.choice(["extra", "role", "type", "", "raincheck", "n", "🙂"])] = junk(rng)
            elif kind < 0.8:
                body[rng.choice(["max_tokens", "min_tokens", "top_k", "seed", "temperature", "top_p", "n"])] = \
                    rng.choice([-(1 << 63) - 1, 1 << 63, -5, 0, 1 << 21, 2.0000001, -0.0, 1e-320])
            else:
                text = json.dumps(body).encode() if text is None else text
                cut = rng.randrange(1, len(text))
                text = rng.choice([
                    text.replace(b'{"model": "glyph", ', b'{"model": "glyph", "model": "glyph", ', 1),
                    text.replace(b'"role": "user"', b'"role": "user", "role": "user"', 1),
                    text[:cut],
                    text[:cut] + b"\xc3\x28" + text[cut:],
                    text.replace(b'"temperature": 0', b'"temperature": NaN', 1),
                    text.replace(b'"temperature": 0', b'"temperature": Infinity', 1),
                    b"[" * 50_000 + b"]" * 50_000,
                    text.replace(b"what", b"\\ud83d what", 1),
                ])
        yield text if text is not None else json.dumps(body).encode()


def _set_image_url(body, url):
    """The first part's image URL (when the request still has one there), else one message with that image."""
    try:
        part = body["messages"][0]["content"][0]
        part["image_url"]["url"] = url
    except (KeyError, IndexError, TypeError):
        body["messages"] = [{"role": "user", "content": [{"type": "image_url", "image_url": url}]}]


def _get(value, path):
    for key in path:
        value = value[key]
    return value


def server_errors(base) -> float:
    """5xx answers so far, from /metrics."""
    text = httpx.get(base + "/metrics", headers=HEADERS).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("raincheck_requests_total{") and 'status="5' in line)


def test_fuzz_malformed_requests_get_4xx_and_leave_the_held_conversation_alone(served):
    base, server, _ = served
    d = benchmark_split("dev", limit=2)[1]
    png = encoded(d.image())
    first = [image_message(data_url(png), d.turns[0].question)]
    held = post(base, {"messages": first, "temperature": 0, "max_tokens": 8}).json()
    conv = server.store.get(held["raincheck"]["conversation_id"])
    before = (conv.sequences.clone(), conv.digests, len(conv.turns), conv.cache.source_length)
    faults_before = server_errors(base)
    statuses = {}
    for i, body in enumerate(fuzz_bodies(png, seed=1234, count=160)):
        r = post(base, body)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (i, body[:300], r.text[:300])
        if r.status_code >= 400:
            error = r.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error", (i, error)
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) >= 120, statuses
    assert httpx.get(base + "/health").json()["status"] == "ok"
    after = server.store.get(conv.id)
    assert after is conv and torch.equal(conv.sequences, before[0])
    assert (conv.digests, len(conv.turns), conv.cache.source_length) == before[1:]
    # and it continues
    answer = held["choices"][0]["message"]["content"]
    follow = post(base, {"messages": first + [{"role": "assistant", "content": answer},
                                              {"role": "user", "content": d.turns[1].question}],
                         "temperature": 0, "max_tokens": 8}).json()
    assert follow["raincheck"]["reused"] and follow["raincheck"]["conversation_id"] == conv.id
    assert server_errors(base) == faults_before


@pytest.mark.parametrize("argv, message", [(["--max-images", "0"], "--max-images must be an integer > 0, got 0"),
                                           (["--max-body-mb", "-1"], "--max-body-mb must be a number > 0"),
                                           (["--media-timeout", "nan"], "--media-timeout must be a number > 0"),
                                           (["--max-prompt-tokens", "0"], "--max-prompt-tokens must be")])
def test_limit_options_are_checked_and_name_the_option(argv, message):
    with pytest.raises(ValueError, match=message):
        serve_settings(argv)
    limits = serve_settings(["--max-body-mb", "0.5", "--max-images", "3", "--max-prompt-tokens", "100"]).limits
    assert (limits.max_body_bytes, limits.max_images, limits.max_prompt_tokens) == (1 << 19, 3, 100)
