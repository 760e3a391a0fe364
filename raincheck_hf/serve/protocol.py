"""OpenAI's chat-completions request, read and checked before any compute.

`read_json` parses the body (duplicate fields, ``NaN`` and text that is not Unicode refused),
`parse_chat_request` validates it against the schema (`schema.ChatCompletionRequest`), checks what
needs the server (the model's id, its vocabulary, the Raincheck settings, the limits) and decodes
the media (`media`) into a `ChatRequest`, or raises `APIError`, which the app answers with OpenAI's
error body::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "messages[0].role", "code": null}}

The order is the cheap checks first: the schema, the counts of images and frames, each image's
header and each video's metadata against the pixel / duration limits, and only then decoding.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from ..configuration import RaincheckConfig
from .errors import APIError, bad
from .media import (Deadline, Limits, check_pixels, check_video, decode_image, decode_pixels, decode_video, digest,
                    pixel_digest, probe_image, probe_video, read_url)
from .schema import (MAX_VIDEO_FRAMES, AssistantMessage, ChatCompletionRequest, ImagePart, RaincheckSettings,
                     SystemMessage, TextPart, VideoFramesPart, VideoURLPart, shown, validation_error)

RAINCHECK_FIELDS = tuple(RaincheckSettings.model_fields)

__all__ = ["APIError", "ChatRequest", "DecodedImages", "Limits", "Media", "bad", "decode_image", "decode_video",
           "media_root_from", "parse_chat_request", "read_json"]


@dataclass
class Media:
    """One image (a PIL image) or video (``[frames, 3, H, W]`` uint8 and its fps), with its content hash (a string, or a
    `PixelDigest` still being worked out: ``f"{media.digest}"`` waits for it)."""

    kind: str  # "image" | "video"
    value: object
    digest: object
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
        user: OpenAI's ``user`` (the end user's id, for the request log).
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
    user: str | None = None

    @property
    def images(self) -> list:
        return [m.value for m in self.media if m.kind == "image"]

    @property
    def videos(self) -> list[Media]:
        return [m for m in self.media if m.kind == "video"]


# ---- the JSON body --------------------------------------------------------------------------------

class _Duplicate(Exception):
    pass


def _object(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(key)
        out[key] = value
    return out


def _no_constant(name):
    raise ValueError(f"{name} is not JSON (a number must be finite)")


def read_json(raw: bytes):
    """The body, parsed; `APIError` (400) for anything that is not strict JSON of Unicode text."""
    try:
        body = json.loads(raw, object_pairs_hook=_object, parse_constant=_no_constant)
    except _Duplicate as error:
        raise bad(f"the JSON body has the field {shown(error.args[0])} twice in one object; send each field once.",
                  param=str(error.args[0])[:80], code="duplicate_field") from None
    except RecursionError:
        raise bad("the JSON body is nested too deeply.") from None
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
        raise bad(f"the request body is not valid JSON ({str(error)[:200]}).") from None
    _check_text(body, "")
    return body


def _check_text(value, path: str) -> None:
    """JSON's ``\\ud800`` escapes give strings that are not Unicode text (lone surrogates): refused here."""
    stack = [(value, path)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as error:
                where = path or "the request body"
                raise bad(f"{where}: the text is not valid Unicode (a lone surrogate "
                          f"{value[error.start]!r} at character {error.start}).", param=path or None) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, path))
                stack.append((item, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))


# ---- settings -------------------------------------------------------------------------------------

def _raincheck(given: RaincheckSettings | None, defaults: RaincheckConfig) -> RaincheckConfig:
    if given is None:
        return defaults
    settings = {name: getattr(defaults, name)
                for name in (*RAINCHECK_FIELDS, "fast_path", "compile_steps", "batch_chunk_rows")}
    asked = given.model_dump(exclude_none=True)
    settings.update(asked)
    if asked.get("chunk_size") == "auto" and "chunk_every" not in asked:
        settings["chunk_every"] = 1  # (the server's spacing of fixed-size chunks: "auto" decides which steps carry one)
    try:
        return RaincheckConfig(**settings)
    except (ValueError, TypeError) as error:
        raise bad(f"raincheck: {error}", param="raincheck") from None


def _config(body: dict, defaults: RaincheckConfig) -> RaincheckConfig:
    """The request's `RaincheckConfig` from a body's ``raincheck`` object over the server's ``defaults``."""
    try:
        given = None if body.get("raincheck") is None else RaincheckSettings.model_validate(body["raincheck"])
    except ValidationError as error:
        raise _validation(error, prefix="raincheck") from None
    return _raincheck(given, defaults)


def _validation(error: ValidationError, prefix: str = "") -> APIError:
    def make(message, param):
        if prefix:
            param = f"{prefix}.{param}" if param else prefix
            message = f"{prefix}.{message}" if not message.startswith("the request body") else \
                message.replace("the request body", prefix, 1)
        return bad(message, param=param)

    return validation_error(error, make)


def _generation(request: ChatCompletionRequest, max_tokens_default: int) -> dict:
    kwargs: dict = {}
    limit = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    kwargs["max_new_tokens"] = limit if limit is not None else max_tokens_default
    if request.min_tokens is not None and request.min_tokens > kwargs["max_new_tokens"]:
        raise bad(f"min_tokens must be at most the answer's limit ({kwargs['max_new_tokens']}), got "
                  f"{request.min_tokens}.", param="min_tokens")
    if request.min_tokens:
        kwargs["min_new_tokens"] = request.min_tokens
    if request.temperature is not None:
        if request.temperature == 0:  # OpenAI's greedy
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=float(request.temperature))
    if kwargs.get("do_sample") is not False:
        if request.top_p is not None:
            kwargs["top_p"] = float(request.top_p)
        if request.top_k is not None and request.top_k > 0:
            kwargs["top_k"] = request.top_k
    return kwargs


def _logit_bias(given: dict | None, vocab_size: int) -> dict[int, float]:
    bias = {}
    for key, value in (given or {}).items():
        token = int(key) if key.isascii() and key.lstrip("-").isdigit() and len(key) < 20 else -1
        if not 0 <= token < vocab_size:
            raise bad(f"logit_bias: {shown(key)} is not a token id of this model (0 to {vocab_size - 1}).",
                      param="logit_bias")
        bias[token] = float(value)
    return bias


# ---- media ----------------------------------------------------------------------------------------

class PixelDigest:
    """A decoded picture's pixel hash (`media.pixel_digest`), worked out on a thread beside the request's: hashlib
    gives the interpreter's lock up while it hashes (~3 ms for a 1344x1024 picture), so the request's processor
    reads the same picture meanwhile (both only read it). ``str()`` (an f-string) waits for the hash; two compare
    equal when their hashes do."""

    __slots__ = ("_future",)

    def __init__(self, future):
        self._future = future

    def __str__(self) -> str:
        return self._future.result()

    def __eq__(self, other) -> bool:
        return isinstance(other, (PixelDigest, str)) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))


class DecodedImages:
    """Images already decoded, by the SHA-256 of their encoded bytes (least recently used dropped beyond
    ``capacity`` entries or ``max_pixels`` pixels in all). A client resends a conversation's images with
    every follow-up; decoding and hashing the pixels of a 1344x1024 picture again takes ~10 ms of a CPU, looking
    up its encoded bytes ~0.2 ms. The same bytes always decode to the same picture, so an entry is never
    stale. A new picture's pixel hash is a `PixelDigest`, worked out on this cache's hashing threads (started
    with the first picture)."""

    def __init__(self, capacity: int = 32, max_pixels: int = 1 << 26):
        self.capacity, self.max_pixels = int(capacity), int(max_pixels)
        self._entries: collections.OrderedDict[str, tuple] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._hashing = None  # a ThreadPoolExecutor, made with the first new picture

    def _hash(self, image) -> PixelDigest:
        with self._lock:
            if self._hashing is None:
                from concurrent.futures import ThreadPoolExecutor

                self._hashing = ThreadPoolExecutor(max_workers=2, thread_name_prefix="raincheck-pixel-hash")
            return PixelDigest(self._hashing.submit(pixel_digest, image))

    def decode(self, data: bytes, param: str):
        """``(image, pixel hash)`` as `decode_image` gives them (the hash a `PixelDigest`, or a string), from the cache
        when these bytes were seen."""
        key = digest(data)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit
        image = decode_pixels(data, param)  # outside the lock: other requests go on meanwhile
        decoded = (image, self._hash(image))
        with self._lock:
            self._entries[key] = decoded
            pixels = sum(image.width * image.height for image, _ in self._entries.values())
            while len(self._entries) > 1 and (len(self._entries) > self.capacity or pixels > self.max_pixels):
                image, _ = self._entries.popitem(last=False)[1]
                pixels -= image.width * image.height
        return decoded

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forget every decoded image (the next request decodes its images again)."""
        with self._lock:
            self._entries.clear()


class ProcessedImages:
    """An image processor (``inner``) that keeps its output per image: a follow-up resends the conversation's images,
    `DecodedImages` gives back the same decoded picture for the same bytes, and this gives back what the processor
    made of it then (resizing, normalizing and patching a 1344x1024 picture: ~7 ms of a CPU, every follow-up) instead
    of making it again. Stands in for ``processor.image_processor`` on the server's own copy of the processor
    (`with_processed_images`; the caller's processor is left as it was): the processor's ``__call__`` calls it with
    the prompt's images, and reads ``image_grid_thw`` of its output to expand the image placeholders.

    An entry is the picture's object (held by a weak reference, compared by identity: a picture decoded again is
    processed again) with the call's keyword arguments, least recently used dropped beyond ``capacity``. Each image
    is processed alone (the Qwen processors process every image on its own and concatenate: the output of several
    is their outputs one after the other, which the server's tests check); a call whose images are not a flat list
    of pictures, or whose output is not one tensor per key with a row per patch, goes to ``inner`` as it is."""

    def __init__(self, inner, capacity: int = 32):
        self.inner, self.capacity = inner, int(capacity)
        self._entries: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.processed = 0  # images given to ``inner`` (what a test counts)

    def __getattr__(self, name):  # (the processor reads ``merge_size`` and the like from its image processor)
        return getattr(self.inner, name)

    def __call__(self, images, **kwargs):
        import torch
        from PIL import Image

        if isinstance(images, Image.Image):
            images = [images]
        if not isinstance(images, (list, tuple)) or not images or not all(isinstance(i, Image.Image) for i in images):
            return self._process(images, kwargs)
        try:
            setting = repr(sorted(kwargs.items()))
        except TypeError:  # (keyword values that do not sort): processed as they come
            return self._process(images, kwargs)
        outputs = []
        for image in images:
            key = (id(image), setting)
            with self._lock:
                hit = self._entries.get(key)
                if hit is not None and hit[0]() is image:
                    self._entries.move_to_end(key)
                    outputs.append(hit[1])
                    continue
            out = self._process([image], kwargs)
            if not all(isinstance(v, torch.Tensor) and v.dim() >= 1 for v in out.values()):
                return self._process(images, kwargs)  # (an output this class does not know how to join): all at once
            with self._lock:
                self._entries[key] = (weakref.ref(image), out)
                while len(self._entries) > self.capacity:
                    self._entries.popitem(last=False)
            outputs.append(out)
        if len(outputs) == 1:
            return outputs[0]
        joined = {k: torch.cat([o[k] for o in outputs]) for k in outputs[0].keys()}
        return type(outputs[0])(data=joined)

    def clear(self) -> None:
        """Forget every processed image (the next request processes its images again)."""
        with self._lock:
            self._entries.clear()

    def _process(self, images, kwargs: dict):
        """``inner``'s output for ``images``, counted in ``processed``."""
        with self._lock:
            self.processed += len(images) if isinstance(images, (list, tuple)) else 1
        return self.inner(images, **kwargs)


def with_processed_images(processor, capacity: int = 32):
    """A shallow copy of ``processor`` whose image processor keeps its output per image (`ProcessedImages`), or
    ``processor`` itself when it has no image processor; the copy shares the tokenizer and everything else."""
    import copy

    inner = getattr(processor, "image_processor", None)
    if inner is None:
        return processor
    twin = copy.copy(processor)
    twin.image_processor = ProcessedImages(inner, capacity)
    return twin


def _url(spec) -> str:
    return spec if isinstance(spec, str) else spec.url


class _MediaPlan:
    """A request's media, read and sized (headers and metadata only) before anything is decoded."""

    def __init__(self, limits: Limits, media_root: Path | None):
        self.limits, self.media_root = limits, media_root
        self.items: list[tuple] = []  # (kind, param, payload)
        self.pixels = 0

    def _add_pixels(self, pixels: int, param: str) -> None:
        self.pixels += pixels
        if self.pixels > self.limits.max_request_pixels:
            raise bad(f"{param}: this request's images and video frames come to more than "
                      f"{self.limits.max_request_pixels:,} pixels ({self.pixels:,} up to this one); the server's "
                      "limit is that many per request (--max-request-pixels).", param=param,
                      code="request_too_large")

    def image(self, url: str, param: str) -> bytes:
        data = read_url(url, param, self.media_root, "image")
        width, height = probe_image(data, param)
        self._add_pixels(check_pixels(width, height, param, self.limits), param)
        return data

    def add(self, part, param: str) -> None:
        if isinstance(part, ImagePart):
            where = f"{param}.image_url"
            self.items.append(("image", where, self.image(_url(part.image_url), where)))
        elif isinstance(part, VideoFramesPart):
            frames = [self.image(_url(f), f"{param}.video[{k}]") for k, f in enumerate(part.video)]
            self.items.append(("frames", f"{param}.video", (frames, float(part.fps))))
        elif isinstance(part, VideoURLPart):
            where = f"{param}.video_url"
            data = read_url(_url(part.video_url), where, self.media_root, "video")
            info = probe_video(data, where)
            check_video(info, where, self.limits)
            self._add_pixels(info.sampled * info.width * info.height, where)
            self.items.append(("video", where, data))


def _count(request: ChatCompletionRequest, limits: Limits) -> None:
    """Images and frames per request, from the request alone (a video file counts `MAX_VIDEO_FRAMES`)."""
    images, frames, first = 0, 0, {}
    for i, message in enumerate(request.messages):
        if isinstance(message.content, str) or isinstance(message, (SystemMessage, AssistantMessage)):
            continue
        for j, part in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            if isinstance(part, ImagePart):
                images += 1
                first.setdefault("image", where)
            elif isinstance(part, VideoFramesPart):
                frames += len(part.video)
                first.setdefault("frames", where)
            elif isinstance(part, VideoURLPart):
                frames += MAX_VIDEO_FRAMES
                first.setdefault("frames", where)
    if images > limits.max_images:
        raise bad(f"this request has {images} images (image_url parts); the server's limit is {limits.max_images} "
                  "per request (--max-images).", param="messages", code="too_many_images")
    if frames > limits.max_video_frames:
        raise bad(f"this request has {frames} video frames (a video file counts {MAX_VIDEO_FRAMES}, its most after "
                  f"sampling); the server's limit is {limits.max_video_frames} per request (--max-video-frames).",
                  param="messages", code="too_many_video_frames")


def _decode(plan: _MediaPlan, deadline: Deadline, images: DecodedImages | None) -> list[Media]:
    import numpy as np
    import torch

    out = []
    for kind, param, payload in plan.items:
        deadline.check(param)
        if kind == "image":
            image, pixels = (images.decode if images is not None else decode_image)(payload, param)
            out.append(Media("image", image, pixels))
            continue
        if kind == "frames":
            data, fps = payload
            arrays = []
            for k, frame in enumerate(data):
                deadline.check(f"{param}[{k}]")
                arrays.append(np.asarray(decode_pixels(frame, f"{param}[{k}]")))  # (the video is hashed whole)
            if len({a.shape for a in arrays}) != 1:
                raise bad(f"{param}: every frame must have the same size.", param=param)
            video = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()
        else:
            video, fps = decode_video(payload, param, plan.limits, deadline)
        out.append(Media("video", video, digest(f"{tuple(video.shape)} {fps:.6g}".encode(), video.numpy().tobytes()),
                         fps))
    return out


def _texts(request: ChatCompletionRequest) -> list[str]:
    out = []
    for message in request.messages:
        if isinstance(message.content, str):
            out.append(message.content)
        else:
            out.extend(part.text for part in message.content if isinstance(part, TextPart))
    return out


def _messages(request: ChatCompletionRequest) -> list:
    """transformers chat messages: a user's text as a part, media as ``{"type": "image" | "video"}``."""
    converted = []
    for message in request.messages:
        role = "system" if message.role == "developer" else message.role
        if isinstance(message.content, str):
            content = message.content if role != "user" else [{"type": "text", "text": message.content}]
        else:
            content = []
            for part in message.content:
                if isinstance(part, TextPart):
                    content.append({"type": "text", "text": part.text})
                else:
                    content.append({"type": "image" if isinstance(part, ImagePart) else "video"})
        entry = {"role": role, "content": content}
        if message.name is not None:
            entry["name"] = message.name
        converted.append(entry)
    return converted


def parse_chat_request(body, *, model_names: tuple[str, ...], defaults: RaincheckConfig, max_tokens_default: int,
                       media_root: Path | None, vocab_size: int, images: DecodedImages | None = None,
                       limits: Limits | None = None, check_text=None) -> ChatRequest:
    """Check a chat-completions body (parsed JSON, or the raw bytes) and decode its media (images through
    ``images``, a cache of decoded images, when given); `APIError` on anything wrong: 404 for a model not
    served here (OpenAI's ``model_not_found``), 400 otherwise. ``check_text``, when given, gets the messages'
    texts before any media is read (the server's early prompt-length check)."""
    limits = limits or Limits()
    if isinstance(body, (bytes, bytearray)):
        body = read_json(bytes(body))
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as error:
        raise _validation(error) from None
    model = request.model if request.model is not None else model_names[0]
    if model not in model_names:
        raise APIError(404, f"The model {shown(model)} does not exist on this server; it serves {list(model_names)} "
                            "(GET /v1/models).", param="model", code="model_not_found")
    last = request.messages[-1]
    if last.role != "user":
        raise bad(f"the last message must be the user's (the one to answer), got role {last.role!r}.",
                  param=f"messages[{len(request.messages) - 1}].role")
    config = _raincheck(request.raincheck, defaults)
    generate_kwargs = _generation(request, max_tokens_default)
    logit_bias = _logit_bias(request.logit_bias, vocab_size)
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if check_text is not None:
        check_text(_texts(request))
    _count(request, limits)
    plan = _MediaPlan(limits, media_root)
    for i, message in enumerate(request.messages):
        if message.role == "user" and not isinstance(message.content, str):
            for j, part in enumerate(message.content):
                plan.add(part, f"messages[{i}].content[{j}]")
    media = _decode(plan, Deadline(limits.media_timeout_s), images)
    options = request.stream_options
    return ChatRequest(model=model, messages=_messages(request), media=media, generate_kwargs=generate_kwargs,
                       config=config, stop=stop, seed=request.seed, logit_bias=logit_bias, stream=request.stream,
                       include_usage=bool(options and options.include_usage), user=request.user)


def media_root_from(path: str | os.PathLike | None) -> Path | None:
    return None if path is None else Path(path).resolve()
