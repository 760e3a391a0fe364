"""Images and videos of a request: read, sized from their headers against the server's limits, decoded.

Nothing is decoded before the whole request's media are known to fit: `probe_image` reads only an
image's header (Pillow's ``Image.open`` reads no pixels; ``.size`` comes from the header), `probe_video`
only a video's container metadata. Decoding then runs under the request's `Deadline`, checked
between images and between video frames. Every failure is an `APIError` (400) naming the part.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import struct
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import unquote, urlparse

from .errors import APIError, bad
from .schema import MAX_VIDEO_FRAMES

# the formats clients send; Pillow reads many more (e.g. PSD, EPS through Ghostscript), none needed here
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG includes MPO (phones)


@dataclass(frozen=True)
class Limits:
    """What one request may cost; each is a ``serve`` option (in brackets). Checked before any compute.

    Attributes:
        max_body_bytes: the request body (413 above it, before it is read whole) [--max-body-mb].
        max_prompt_tokens: prompt tokens (None: the model's context) [--max-prompt-tokens].
        max_images: images per request [--max-images].
        max_video_frames: video frames per request, after a video file's sampling [--max-video-frames].
        max_image_pixels: pixels of one image or video frame, from its header [--max-image-pixels].
        max_request_pixels: pixels of all images and frames of a request [--max-request-pixels].
        max_video_seconds: duration of a video file [--max-video-seconds].
        media_timeout_s: decoding a request's media [--media-timeout].
    """

    max_body_bytes: int = 32 << 20
    max_prompt_tokens: int | None = None
    max_images: int = 32
    max_video_frames: int = 256
    max_image_pixels: int = 1 << 26  # 67,108,864: 8192 x 8192, or a 48 MP photo
    max_request_pixels: int = 1 << 28  # 268,435,456 (~800 MB as decoded RGB)
    max_video_seconds: float = 600.0
    media_timeout_s: float = 30.0

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "max_prompt_tokens":
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not number or value <= 0 or (f.type.startswith("int") and not isinstance(value, int)):
                kind = "an integer" if f.type.startswith("int") else "a number"
                raise ValueError(f"{f.name} must be {kind} > 0, got {value!r}")

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Deadline:
    """The request's time for media decoding, checked between images and between video frames (a single
    image's decode is bounded by the pixel limit)."""

    def __init__(self, seconds: float):
        self.seconds, self.end = seconds, time.monotonic() + seconds

    def check(self, param: str) -> None:
        if time.monotonic() > self.end:
            raise bad(f"{param}: decoding this request's images and videos took longer than the server's limit of "
                      f"{self.seconds:g} s (--media-timeout); send fewer, smaller or shorter ones.", param=param,
                      code="media_timeout")


# ---- reading a URL --------------------------------------------------------------------------------

def read_url(url: str, param: str, media_root: Path | None, expected: str) -> bytes:
    """The bytes of a ``data:`` or ``file://`` URL; ``expected``: "image" or "video" (a data URL's type must be it)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise bad(f"{param}: this server does not fetch remote URLs ({url[:80]!r}); send the {expected} inline as a "
                  f"data URL (data:{expected}/...;base64,...) or, for a file on the server's machine, a file:// URL.",
                  param=param, code="remote_url_not_allowed")
    if scheme == "data":
        header, _, payload = url.partition(",")
        media_type = header[5:].split(";", 1)[0].strip().lower()
        if not header.endswith(";base64"):
            raise bad(f"{param}: a data URL must be base64 encoded (data:{expected}/...;base64,...), got "
                      f"{header[:60]!r}.", param=param)
        if media_type and not media_type.startswith(expected + "/") and media_type != "application/octet-stream":
            raise bad(f"{param}: a data URL of type {media_type[:40]!r} where an {expected} is expected "
                      f"(data:{expected}/...;base64,...).", param=param, code=f"invalid_{expected}")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise bad(f"{param}: the data URL's base64 payload is invalid ({error}).", param=param) from None
    if scheme == "file":
        if media_root is None:
            raise bad(f"{param}: file URLs are off (start the server with --media-root DIR to allow files under DIR).",
                      param=param)
        try:
            path = Path(unquote(urlparse(url).path)).resolve()
        except (ValueError, OSError) as error:
            raise bad(f"{param}: not a usable file URL ({error}).", param=param) from None
        if not path.is_relative_to(media_root):
            raise bad(f"{param}: {str(path)!r} is outside the server's --media-root {str(media_root)!r}.", param=param)
        try:
            return path.read_bytes()
        except OSError as error:
            raise bad(f"{param}: cannot read {str(path)!r}: {error.strerror or error}.", param=param) from None
    raise bad(f"{param} must be a data URL (data:{expected}/...;base64,...) or a file:// URL, got {url[:80]!r}.",
              param=param)


# ---- images ---------------------------------------------------------------------------------------

def _unreadable(param: str, error: BaseException | None = None) -> APIError:
    why = "" if error is None else f" ({_reason(error)})"
    return bad(f"{param} is not an image this server reads ({', '.join(IMAGE_FORMATS)}){why}.", param=param,
               code="invalid_image")


def _reason(error: BaseException) -> str:
    """An error's own words without Python reprs (Pillow's 'cannot identify image file <_io.BytesIO ...>')."""
    text = str(error)
    if "<" in text and " at 0x" in text:
        text = text[:text.index("<")].rstrip(" :")
    return text[:200] or type(error).__name__


def _open(data: bytes):
    """The image, header read, no pixel decoded: each accepted format's class tried in turn, as ``Image.open``
    does, without Pillow's own decompression-bomb check (a warning from ~89 M pixels, an error from ~179 M):
    the server's limits, checked against ``.size`` before anything is decoded, are what the operator set."""
    from PIL import Image, UnidentifiedImageError

    Image.init()  # every format's plugin registered
    prefix = data[:16]
    for name in IMAGE_FORMATS:
        factory, accept = Image.OPEN.get(name, (None, None))
        accepted = factory is not None and (accept is None or accept(prefix))
        if not accepted or isinstance(accepted, str):  # a str: Pillow's "not this format after all"
            continue
        try:
            return factory(io.BytesIO(data), None)
        except (SyntaxError, IndexError, TypeError, struct.error):
            continue
    raise UnidentifiedImageError("the data has no header of an accepted format")


def probe_image(data: bytes, param: str) -> tuple[int, int]:
    """``(width, height)`` from the image's header; no pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    try:
        with _open(data) as image:
            width, height = image.size
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, TypeError, IndexError,
            Image.DecompressionBombError, struct.error) as error:
        raise _unreadable(param, error) from None
    if width <= 0 or height <= 0:
        raise _unreadable(param, ValueError(f"its header says {width} x {height} pixels"))
    return width, height


def check_pixels(width: int, height: int, param: str, limits: Limits, what: str = "image") -> int:
    pixels = width * height
    if pixels > limits.max_image_pixels:
        raise bad(f"{param}: the {what} is {width} x {height} = {pixels:,} pixels; the server's limit is "
                  f"{limits.max_image_pixels:,} pixels per image (--max-image-pixels). Send it smaller.",
                  param=param, code="image_too_large")
    return pixels


def decode_pixels(data: bytes, param: str):
    """The RGB PIL image, every pixel decoded (an RGB picture as decoded, without a copy). Call it after
    `probe_image` and the limits."""
    from PIL import Image, UnidentifiedImageError

    try:
        with _open(data) as opened:
            opened.load()  # decodes
            image = opened if opened.mode == "RGB" else opened.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, TypeError, IndexError,
            Image.DecompressionBombError, struct.error) as error:
        raise _unreadable(param, error) from None
    return image


def pixel_digest(image) -> str:
    """The content hash of a decoded picture's pixels and size: two encodings of one picture share it."""
    return digest(f"{image.size}".encode(), image.tobytes())


def decode_image(data: bytes, param: str):
    """``(RGB PIL image, content hash of its pixels)`` (`decode_pixels`, `pixel_digest`). Call it after
    `probe_image` and the limits: it decodes every pixel."""
    image = decode_pixels(data, param)
    return image, pixel_digest(image)


def digest(*parts: bytes) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()


# ---- videos ---------------------------------------------------------------------------------------

def _av(param: str):
    try:
        import av
    except ImportError:
        raise bad(f"{param}: video files need PyAV on the server (pip install av); or send the video as a list of "
                  "frames ({'type': 'video', 'video': [image URLs], 'fps': 2}).", param=param) from None
    return av


def _unreadable_video(param: str, error: BaseException) -> APIError:
    return bad(f"{param} is not a readable video ({_reason(error)}).", param=param, code="invalid_video")


@dataclass
class VideoInfo:
    """A video file's metadata: frame size, duration (None: the container does not say), frame count (0: unknown)."""

    width: int
    height: int
    seconds: float | None
    frames: int
    fps: float

    @property
    def sampled(self) -> int:
        """Frames it will give (at most `MAX_VIDEO_FRAMES`; unknown count: that many at most)."""
        return min(self.frames, MAX_VIDEO_FRAMES) if self.frames > 0 else MAX_VIDEO_FRAMES


@dataclass
class _TempFile:
    data: bytes
    handle: object = field(default=None)

    def __enter__(self) -> str:  # PyAV reads a path more reliably than a file object for every container
        self.handle = tempfile.NamedTemporaryFile(suffix=".video")
        self.handle.write(self.data)
        self.handle.flush()
        return self.handle.name

    def __exit__(self, *exc):
        self.handle.close()


def probe_video(data: bytes, param: str) -> VideoInfo:
    """A video file's `VideoInfo` from its container, no frame decoded."""
    av = _av(param)
    with _TempFile(data) as path:
        try:
            with av.open(path) as container:
                if not container.streams.video:
                    raise ValueError("it has no video stream")
                stream = container.streams.video[0]
                rate = stream.average_rate or stream.guessed_rate
                fps = float(rate) if rate else 2.0
                seconds = None
                if stream.duration and stream.time_base:
                    seconds = float(stream.duration * stream.time_base)
                elif container.duration:
                    seconds = container.duration / av.time_base
                width, height = stream.codec_context.width, stream.codec_context.height
                return VideoInfo(int(width), int(height), seconds, int(stream.frames or 0), fps)
        except Exception as error:  # PyAV raises its own error classes for bad data
            raise _unreadable_video(param, error) from None


def decode_video(data: bytes, param: str, limits: Limits | None = None, deadline: Deadline | None = None):
    """``([frames, 3, H, W] uint8, fps)`` by PyAV: at most `MAX_VIDEO_FRAMES` evenly spaced frames, only those
    converted to RGB. Stops with a 400 past ``limits.max_video_seconds`` or the ``deadline``."""
    import numpy as np
    import torch

    av = _av(param)
    limits = limits or Limits()
    info = probe_video(data, param)
    keep = None  # frame indices to keep when the count is known; else every `stride`-th, halved as they pile up
    if info.frames > MAX_VIDEO_FRAMES:
        keep = set(np.linspace(0, info.frames - 1, MAX_VIDEO_FRAMES).round().astype(int).tolist())
    stride, kept, total = 1, [], 0
    with _TempFile(data) as path:
        try:
            with av.open(path) as container:
                stream = container.streams.video[0]
                for frame in container.decode(stream):
                    if deadline is not None:
                        deadline.check(param)
                    if frame.time is not None and frame.time > limits.max_video_seconds:
                        raise _too_long(param, limits, f"longer than {frame.time:.1f} s")
                    check_pixels(frame.width, frame.height, param, limits, what="video's frame")
                    index, total = total, total + 1
                    if keep is not None:
                        if index in keep:
                            kept.append(frame.to_ndarray(format="rgb24"))
                    elif index % stride == 0:
                        kept.append((index, frame.to_ndarray(format="rgb24")))
                        if len(kept) >= 2 * MAX_VIDEO_FRAMES:
                            stride *= 2
                            kept = [(i, f) for i, f in kept if i % stride == 0]
        except APIError:
            raise
        except Exception as error:
            raise _unreadable_video(param, error) from None
    if keep is None:
        frames = [f for _, f in kept]
        if len(frames) > MAX_VIDEO_FRAMES:
            frames = [frames[i] for i in np.linspace(0, len(frames) - 1, MAX_VIDEO_FRAMES).round().astype(int)]
    else:
        frames = kept
    if not frames:
        raise bad(f"{param} is not a readable video (it has no frames).", param=param, code="invalid_video")
    if len({f.shape for f in frames}) != 1:
        raise bad(f"{param}: the video's frames change size; this server reads videos of one frame size.",
                  param=param, code="invalid_video")
    fps = info.fps * len(frames) / total if total > len(frames) else info.fps
    return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous(), fps


def _too_long(param: str, limits: Limits, what: str) -> APIError:
    return bad(f"{param}: the video is {what}; the server's limit is {limits.max_video_seconds:g} s per video "
               "(--max-video-seconds).", param=param, code="video_too_long")


def check_video(info: VideoInfo, param: str, limits: Limits) -> None:
    """A video file's metadata against the limits (its duration, its frame size), before decoding."""
    if info.seconds is not None and info.seconds > limits.max_video_seconds:
        raise _too_long(param, limits, f"{info.seconds:.1f} s long")
    check_pixels(info.width, info.height, param, limits, what="video's frame")
