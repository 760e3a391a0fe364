"""OpenAI's chat-completions request, read and checked before any compute.

`parse_chat_request` turns a decoded JSON body into a `ChatRequest` (the model's messages with
their images and videos decoded, the generation settings, the Raincheck settings) or raises
`APIError`, which the app answers with OpenAI's error body::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "messages[0].role", "code": null}}
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from ..configuration import RaincheckConfig

ROLES = ("system", "developer", "user", "assistant")
RAINCHECK_FIELDS = ("mode", "retention", "chunk_size", "decode_guard", "selector", "tpot_slack")
MAX_STOP = 4
MAX_VIDEO_FRAMES = 64


class APIError(Exception):
    """An error answered with OpenAI's body and ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class Media:
    """One image (a PIL image) or video (``[frames, 3, H, W]`` uint8 and its fps), with its content hash."""

    kind: str  # "image" | "video"
    value: object
    digest: str
    fps: float | None = None


@dataclass
class ChatRequest:
    """A checked request.

    Attributes:
        messages: transformers chat messages (content parts ``{"type": "text" | "image" | "video"}``).
        media: the images and videos in the order they appear.
        generate_kwargs: `generate` settings (``max_new_tokens``, ``do_sample``, ``temperature``, ...).
        config: the request's `RaincheckConfig` (server defaults overridden by the ``raincheck`` field).
        stop: stop strings (the answer ends before the first one).
        seed: seed for sampling (a generator of its own; None: unseeded).
        stream / include_usage: SSE streaming and ``stream_options.include_usage``.
    """

    model: str
    messages: list
    media: list[Media]
    generate_kwargs: dict
    config: RaincheckConfig
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logit_bias: dict = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False

    @property
    def images(self) -> list:
        return [m.value for m in self.media if m.kind == "image"]

    @property
    def videos(self) -> list[Media]:
        return [m for m in self.media if m.kind == "video"]


def _number(body: dict, name: str, low: float, high: float, integer: bool = False):
    value = body.get(name)
    if value is None:
        return None
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value):
        raise bad(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}.", param=name)
    if not low <= value <= high:
        raise bad(f"{name} must be in [{low}, {high}], got {value!r}.", param=name)
    return value


def _config(body: dict, defaults: RaincheckConfig) -> RaincheckConfig:
    given = body.get("raincheck")
    if given is None:
        return defaults
    if not isinstance(given, dict):
        raise bad(f"raincheck must be an object with some of {list(RAINCHECK_FIELDS)}, got {given!r}.", param="raincheck")
    unknown = [k for k in given if k not in RAINCHECK_FIELDS]
    if unknown:
        raise bad(f"unknown Raincheck setting(s) {unknown}; the settings are {list(RAINCHECK_FIELDS)}.",
                  param=f"raincheck.{unknown[0]}")
    if "selector" in given and not isinstance(given["selector"], str):
        raise bad(f"raincheck.selector must be a selector name, got {given['selector']!r}.", param="raincheck.selector")
    settings = {name: getattr(defaults, name) for name in (*RAINCHECK_FIELDS, "fast_path", "compile_steps")}
    settings.update(given)
    try:
        return RaincheckConfig(**settings)
    except (ValueError, TypeError) as error:
        raise bad(f"raincheck: {error}", param="raincheck") from None


def _generation(body: dict, max_tokens_default: int) -> tuple[dict, list[str], int | None]:
    if body.get("n", 1) != 1:
        raise bad(f"n must be 1 (one answer per request), got {body.get('n')!r}.", param="n")
    for name in ("tools", "functions"):
        if body.get(name):
            raise bad(f"{name} are not supported by this server.", param=name)
    if body.get("logprobs"):
        raise bad("logprobs are not supported by this server.", param="logprobs")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad(f"response_format must be {{'type': 'text'}}, got {fmt!r}.", param="response_format")
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name, -2.0, 2.0) not in (None, 0, 0.0):
            raise bad(f"{name} other than 0 is not supported by this server.", param=name)
    kwargs: dict = {}
    limit = None
    for name in ("max_completion_tokens", "max_tokens"):  # the newer name wins
        value = _number(body, name, 1, 1 << 20, integer=True)
        if value is not None and limit is None:
            limit = value
    kwargs["max_new_tokens"] = limit if limit is not None else max_tokens_default
    min_tokens = _number(body, "min_tokens", 0, kwargs["max_new_tokens"], integer=True)  # vLLM's extension
    if min_tokens:
        kwargs["min_new_tokens"] = min_tokens
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    top_k = _number(body, "top_k", -1, 1 << 20, integer=True)  # vLLM's extension; -1 or 0: off
    if top_p is not None and top_p <= 0:
        raise bad(f"top_p must be in (0, 1], got {top_p!r}.", param="top_p")
    if temperature is not None:
        if temperature == 0:  # OpenAI's greedy
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=float(temperature))
    if kwargs.get("do_sample") is not False:
        if top_p is not None:
            kwargs["top_p"] = float(top_p)
        if top_k is not None and top_k > 0:
            kwargs["top_k"] = top_k
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise bad(f"stop must be a non-empty string or a list of up to {MAX_STOP} of them, got {body.get('stop')!r}.",
                  param="stop")
    seed = _number(body, "seed", -(1 << 63), (1 << 63) - 1, integer=True)
    return kwargs, stop, seed


MAX_LOGIT_BIAS = 1024


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float]:
    given = body.get("logit_bias")
    if given is None:
        return {}
    if not isinstance(given, dict) or len(given) > MAX_LOGIT_BIAS:
        raise bad(f"logit_bias must be an object of up to {MAX_LOGIT_BIAS} token ids (as strings) to numbers in "
                  f"[-100, 100], got {str(given)[:80]}.", param="logit_bias")
    bias = {}
    for key, value in given.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if not 0 <= token < vocab_size:
            raise bad(f"logit_bias: {key!r} is not a token id of this model (0 to {vocab_size - 1}).", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad(f"logit_bias[{key!r}] must be a number in [-100, 100], got {value!r}.", param="logit_bias")
        bias[token] = float(value)
    return bias


# ---- media ----------------------------------------------------------------------------------------

def _read_url(url, param: str, media_root: Path | None, expected: str) -> bytes:
    if not isinstance(url, str) or not url:
        raise bad(f"{param} must be a data URL or a file URL, got {url!r}.", param=param)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise bad(f"{param}: this server does not fetch remote URLs ({url[:80]!r}); send the {expected} inline as a "
                  f"data URL (data:{expected}/...;base64,...) or, for a file on the server's machine, a file:// URL.",
                  param=param, code="remote_url_not_allowed")
    if scheme == "data":
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise bad(f"{param}: a data URL must be base64 encoded (data:{expected}/...;base64,...).", param=param)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise bad(f"{param}: the data URL's base64 payload is invalid ({error}).", param=param) from None
    if scheme == "file":
        if media_root is None:
            raise bad(f"{param}: file URLs are off (start the server with --media-root DIR to allow files under DIR).",
                      param=param)
        path = Path(unquote(urlparse(url).path)).resolve()
        if not path.is_relative_to(media_root):
            raise bad(f"{param}: {str(path)!r} is outside the server's --media-root {str(media_root)!r}.", param=param)
        try:
            return path.read_bytes()
        except OSError as error:
            raise bad(f"{param}: cannot read {str(path)!r}: {error.strerror or error}.", param=param) from None
    raise bad(f"{param} must be a data URL (data:{expected}/...;base64,...) or a file:// URL, got {url[:80]!r}.",
              param=param)


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()


def decode_image(data: bytes, param: str):
    """``(RGB PIL image, content hash of its pixels)``: two encodings of one picture share a hash."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image = image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as error:
        raise bad(f"{param} is not a readable image ({type(error).__name__}: {error}).", param=param,
                  code="invalid_image") from None
    return image, _digest(f"{image.size}".encode(), image.tobytes())


def decode_video(data: bytes, param: str):
    """``([frames, 3, H, W] uint8, fps)`` by PyAV, at most `MAX_VIDEO_FRAMES` evenly spaced frames."""
    try:
        import av
    except ImportError:
        raise bad(f"{param}: video files need PyAV on the server (pip install av); or send the video as a list of "
                  "frames ({'type': 'video', 'video': [image URLs], 'fps': 2}).", param=param) from None
    import numpy as np
    import torch

    with tempfile.NamedTemporaryFile(suffix=".video") as handle:
        handle.write(data)
        handle.flush()
        try:
            with av.open(handle.name) as container:
                if not container.streams.video:
                    raise ValueError("it has no video stream")
                stream = container.streams.video[0]
                rate = stream.average_rate or stream.guessed_rate
                fps = float(rate) if rate else 2.0
                frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        except Exception as error:  # PyAV raises its own error classes for bad data
            raise bad(f"{param} is not a readable video ({type(error).__name__}: {error}).", param=param,
                      code="invalid_video") from None
    if not frames:
        raise bad(f"{param} is not a readable video (it has no frames).", param=param, code="invalid_video")
    total = len(frames)
    if total > MAX_VIDEO_FRAMES:
        keep = np.linspace(0, total - 1, MAX_VIDEO_FRAMES).round().astype(int)
        frames = [frames[i] for i in keep]
        fps = fps * len(frames) / total
    video = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous()
    return video, fps


def _frames_video(part: dict, param: str, media_root):
    import numpy as np
    import torch

    frames = part.get("video")
    if not isinstance(frames, list) or not frames:
        raise bad(f"{param}.video must be a non-empty list of image URLs (the frames).", param=f"{param}.video")
    if len(frames) > MAX_VIDEO_FRAMES:
        raise bad(f"{param}.video has {len(frames)} frames; at most {MAX_VIDEO_FRAMES}.", param=f"{param}.video")
    fps = part.get("fps", 2.0)
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps <= 240:
        raise bad(f"{param}.fps must be a number in (0, 240], got {fps!r}.", param=f"{param}.fps")
    arrays = []
    for k, frame in enumerate(frames):
        url = frame.get("url") if isinstance(frame, dict) else frame
        image, _ = decode_image(_read_url(url, f"{param}.video[{k}]", media_root, "image"), f"{param}.video[{k}]")
        arrays.append(np.asarray(image))
    if len({a.shape for a in arrays}) != 1:
        raise bad(f"{param}.video: every frame must have the same size.", param=f"{param}.video")
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous(), float(fps)


def _video_digest(video, fps: float) -> str:
    return _digest(f"{tuple(video.shape)} {fps:.6g}".encode(), video.numpy().tobytes())


class DecodedImages:
    """Images already decoded, by the SHA-256 of their encoded bytes (least recently used dropped beyond
    ``capacity``). A client resends a conversation's images with every follow-up; decoding and hashing
    the pixels of a 1344x1024 picture again takes ~25 ms, looking up its encoded bytes ~0.05 ms. The
    same bytes always decode to the same picture, so an entry is never stale."""

    def __init__(self, capacity: int = 32):
        import collections
        import threading

        self.capacity = int(capacity)
        self._entries: collections.OrderedDict[str, tuple] = collections.OrderedDict()
        self._lock = threading.Lock()

    def decode(self, data: bytes, param: str):
        """`decode_image`'s ``(image, pixel hash)``, from the cache when these bytes were seen."""
        key = _digest(data)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit
        decoded = decode_image(data, param)  # outside the lock: other requests go on meanwhile
        with self._lock:
            self._entries[key] = decoded
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return decoded

    def __len__(self) -> int:
        return len(self._entries)


def _content(message: dict, i: int, media: list, media_root, images: DecodedImages | None = None) -> list | str:
    role, content = message["role"], message.get("content")
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return content if role != "user" else [{"type": "text", "text": content}]
    if not isinstance(content, list) or (role == "assistant" and not content):
        raise bad(f"{param} must be a string or a list of content parts, got {content!r}.", param=param)
    parts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
            continue
        if role != "user" or kind not in ("image_url", "video_url", "video"):
            allowed = "text, image_url, video_url, video" if role == "user" else "text"
            raise bad(f"{where}: a {role} message's content part must be one of ({allowed}), got {part!r:.120}.",
                      param=where)
        if kind == "image_url":
            spec = part.get("image_url")
            url = spec.get("url") if isinstance(spec, dict) else spec
            data = _read_url(url, f"{where}.image_url", media_root, "image")
            image, digest = (images.decode if images is not None else decode_image)(data, f"{where}.image_url")
            media.append(Media("image", image, digest))
            parts.append({"type": "image"})
        else:
            if kind == "video_url":
                spec = part.get("video_url")
                url = spec.get("url") if isinstance(spec, dict) else spec
                video, fps = decode_video(_read_url(url, f"{where}.video_url", media_root, "video"), f"{where}.video_url")
            else:
                video, fps = _frames_video(part, where, media_root)
            media.append(Media("video", video, _video_digest(video, fps), fps))
            parts.append({"type": "video"})
    return parts


def parse_chat_request(body, *, model_names: tuple[str, ...], defaults: RaincheckConfig, max_tokens_default: int,
                       media_root: Path | None, vocab_size: int, images: DecodedImages | None = None) -> ChatRequest:
    """Check a chat-completions body and decode its media (images through ``images``, a cache of decoded
    images, when given); `APIError` (400) on anything wrong."""
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}.")
    model = body.get("model", model_names[0])
    if model not in model_names:
        raise APIError(400, f"model {model!r} is not served here; this server serves {list(model_names)} "
                            "(GET /v1/models).", param="model", code="model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {'role', 'content'} objects.", param="messages")
    converted, media = [], []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}] must be an object, got {message!r:.80}.", param=f"messages[{i}]")
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}.", param=f"messages[{i}].role")
        content = _content(message, i, media, media_root, images)
        converted.append({"role": "system" if role == "developer" else role, "content": content})
    if converted[-1]["role"] != "user":
        raise bad(f"the last message must be the user's (the one to answer), got role {converted[-1]['role']!r}.",
                  param=f"messages[{len(converted) - 1}].role")
    config = _config(body, defaults)
    generate_kwargs, stop, seed = _generation(body, max_tokens_default)
    logit_bias = _logit_bias(body, vocab_size)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad(f"stream must be true or false, got {stream!r}.", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad(f"stream_options must be an object, got {options!r}.", param="stream_options")
    return ChatRequest(model=model, messages=converted, media=media, generate_kwargs=generate_kwargs, config=config,
                       stop=stop, seed=seed, logit_bias=logit_bias, stream=stream, include_usage=bool(options.get("include_usage")))


def media_root_from(path: str | os.PathLike | None) -> Path | None:
    return None if path is None else Path(path).resolve()
