"""Raincheck demo: a multi-turn image / video chat that shows what deferred prefill does.

    python -m demo.app [--model qwen3_vl | qwen3_5 | tiny | PATH_OR_HUB_ID] [--host 127.0.0.1] [--port 7860] [--share]

Each browser session gets its own `raincheck_hf.Conversation` (held in a `gr.State`, closed when
the session ends). An answer streams token by token from ``Conversation.ask(stream=True)``; the
conversation's background worker restores what is left after the answer, and a follow-up that
arrives early is handled by the conversation itself (docs/method.md §6). A second tab runs one
question through the four modes side by side (`compare_modes`); under the picture, a timeline
replays which patch came back at which generated token (`build_timeline`).

The picture beside the chat is the turn's image (a video: one frame per temporal slice) at the
size the processor resized it to, with every merged vision token (patch 16 px × merge 2 = one
32 px cell) shaded by what the cache holds for it: prefilled first, deferred, restored, or
dropped (``hard``). It is drawn from the cache while the answer streams and, through a
`gr.Timer`, while idle-time restoration finishes.

Without ``--model`` the demo runs offline on the bundled glyph Qwen3-VL
(`raincheck_hf.quality.load_bundled("qwen3_vl")`, ~3.3 M parameters trained on the project's
glyph-grid benchmark). It knows only that task and its word-level vocabulary, so the examples are
glyph grids with benchmark questions; when a turn's image is a glyph grid, the reference answer is
read off its pixels and shown after the model's. ``qwen3_5`` is the bundled glyph Qwen3.5;
``tiny`` is the tiny Qwen3-VL of `raincheck_hf.tiny` with random weights (gibberish answers; the
selection, timings and restoration are real). Models are loaded in functions (`load_model`),
never at import, so the app is testable.
"""

import argparse
import atexit
import math
import mimetypes
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field, fields, replace

import torch

from raincheck_hf.__main__ import plain, unknown_words
from raincheck_hf.loading import resolve_model
from raincheck_hf.quality.references import glyph_reference, judge, missing_from_grid, read_glyph_grid

TINY_MODEL = "tiny-random (built in code)"
DEFAULT_MODEL = "qwen3_vl"  # the bundled glyph Qwen3-VL
BUNDLED_LABELS = {"qwen3_vl": "qwen3_vl: glyph Qwen3-VL (bundled, trained)",
                  "qwen3_5": "qwen3_5: glyph Qwen3.5 (bundled, trained)"}
MODEL_LABELS = {**BUNDLED_LABELS, "tiny-random (built in code)": "tiny: Qwen3-VL with random weights (built in code)"}
MODES_SHOWN = ("raincheck", "post_answer", "hard", "full")
# the demo's tiny processor: up to 384×384 px per image (144 merged tokens), so patches are visible
TINY_MAX_PIXELS = 384 * 384
MAX_VIDEO_FRAMES = 16  # longer videos are sampled evenly down to this many frames
DECODE_MAX_SIDE = 896  # video frames are decoded at most this large (processors shrink them further)
OPEN_MAX_SIDE = 4096  # larger images are shrunk on open; the processor shrinks them further anyway
PICTURE_WIDTH = 640
# the page streams an answer's text at most this often, and redraws the picture, caption and figures at most this
# often: per token, that work would slow the answer it shows (Python on the page's thread competes with generation)
STREAM_TEXT_EVERY_S = 0.1
STREAM_PICTURE_EVERY_S = 0.5
REPLAY_FRAME_S = 0.06  # the timeline's replay: pause per frame
TIMELINE_WAITING = ("Timeline: when a turn's restoration is done, drag the slider (or press *Replay*) to see which "
                    "deferred patch came back at which generated token, and which after the answer.")

TINY_NOTE = (
    "**Note: this is `tiny`, a Qwen3-VL built in code with random weights.** Its answers are gibberish; "
    "the selection, the timings and the restoration you see are real. For answers that can be checked, pick "
    "the bundled glyph model `qwen3_vl` (the default) or `qwen3_5` under *Settings*, or a real checkpoint "
    "(a Hub id or a local folder)."
)
BUNDLED_NOTE = (
    "**Model: the bundled {title}** (`{cls}`, {params:.2f} M parameters, on `{device}`), trained in this project on "
    "its glyph-grid benchmark. **It knows only that task:** n×n grids of 32 px cells, each a glyph g0…g11 in one "
    "of 10 colours over a grey background (dark, dim, pale, light), and a word-level vocabulary of {words} tokens "
    "(special tokens included); any other word reads as `<unk>`. Ask like the examples: `what is the background of the red g3 ?` or `list the "
    "backgrounds of the red and blue glyphs .` When the image is a glyph grid, the reference answer (read off its "
    "pixels) follows the model's. It is not a general VLM: for photos, pick a real Qwen3-VL checkpoint under "
    "*Settings*."
)
LEGEND_LABELS = [("selected", "prefilled first"), ("deferred", "deferred"), ("during", "restored during answer"),
                 ("after", "restored after it"), ("dropped", "dropped"), ("waiting", "prefilling")]
STATES = tuple(state for state, _ in LEGEND_LABELS)
FIGURE_HEADERS = ["turn", "visual tokens", "prefilled first", "TTFT (ms)", "TPOT (ms)",
                  "restored during answer", "restored after answer", "pending", "dropped"]


# ---- models -------------------------------------------------------------------------------------

class ModelLoadError(RuntimeError):
    """A model could not be loaded (the message says why and what to do)."""


@dataclass
class LoadedModel:
    name: str
    model: object
    processor: object
    is_tiny: bool
    bundled: bool = False  # one of the bundled glyph models: lowercased questions, reference answers

    @property
    def note(self) -> str:
        if self.is_tiny:
            return TINY_NOTE
        if self.bundled:
            return BUNDLED_NOTE.format(
                title="glyph Qwen3.5" if self.name == "qwen3_5" else "glyph Qwen3-VL", cls=type(self.model).__name__,
                params=sum(p.numel() for p in self.model.parameters()) / 1e6, device=self.model.device,
                words=len(self.processor.tokenizer))
        return f"Model: **{self.name}** on `{self.model.device}`."


_MODELS: dict[str, LoadedModel] = {}
_MODELS_LOCK = threading.Lock()


def model_key(name: str | None) -> str:
    """The cache key of a model name: ``qwen3_vl`` / ``qwen3_5`` (bundled; the default), `TINY_MODEL`, or the name."""
    name = (name or "").strip()
    if not name:
        return DEFAULT_MODEL
    if name == TINY_MODEL:
        return TINY_MODEL
    if name in MODEL_LABELS.values():
        return next(k for k, v in MODEL_LABELS.items() if v == name)
    kind, resolved = resolve_model(name)
    return TINY_MODEL if kind == "tiny" else resolved


def model_choices(*first) -> list[tuple[str, str]]:
    """The model dropdown's ``(label, value)`` choices: ``first``, then the bundled and the tiny model."""
    keys = dict.fromkeys([*first, DEFAULT_MODEL, "qwen3_5", TINY_MODEL])
    return [(MODEL_LABELS.get(k, k), k) for k in keys]


def is_loaded(name: str | None) -> bool:
    """Whether `load_model` has ``name`` already (it returns at once)."""
    try:
        return model_key(name) in _MODELS
    except ValueError:
        return False


def load_model(name: str | None) -> LoadedModel:
    """The model and processor for ``name`` (a bundled model, the tiny one, a Hub id or a local folder), cached.

    Raises `ModelLoadError` with an actionable message when it cannot be loaded or is unsupported.
    """
    key = model_key(name)
    with _MODELS_LOCK:
        if key not in _MODELS:
            _MODELS[key] = _load_uncached(key)
        return _MODELS[key]


def _load_uncached(key: str) -> LoadedModel:
    import raincheck_hf

    if key == TINY_MODEL:
        from raincheck_hf.tiny import build_tiny_processor, build_tiny_qwen3_vl

        model = raincheck_hf.enable(build_tiny_qwen3_vl(seed=0))
        return LoadedModel(key, model, build_tiny_processor(max_pixels=TINY_MAX_PIXELS), is_tiny=True)
    from raincheck_hf.loading import LoadError, load_model as load_named

    device = "cuda" if torch.cuda.is_available() else "cpu"
    bundled = key in BUNDLED_LABELS
    try:  # a folder without a checkpoint, or a Hub id neither cached nor reachable: within seconds
        model, processor, _, _ = load_named(key, device, log=lambda text: None)
        raincheck_hf.enable(model)  # unsupported model classes fail here, naming the supported ones
    except LoadError as error:
        raise ModelLoadError(f"Could not load {'the bundled model' if bundled else 'model'} **{key}**: "
                             f"{' '.join(str(error).split())}") from error
    except Exception as error:  # ValueError (unsupported), ...
        detail = " ".join(str(error).split())
        detail = detail if len(detail) <= 400 else detail[:400] + " …"
        raise ModelLoadError(
            f"Could not load model **{key}**: {type(error).__name__}: {detail} — give a local folder with a "
            "Qwen3-VL or Qwen3.5 checkpoint (config.json, the *.safetensors weights and the processor's files; "
            "demo/README.md, *A real checkpoint*), or a bundled model: qwen3_vl, qwen3_5."
        ) from error
    if bundled:
        return LoadedModel(key, model, processor, is_tiny=False, bundled=True)
    return LoadedModel(key, model, processor, is_tiny=False)


# ---- inputs -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MediaLimits:
    """What an upload may be; checked before decoding (an image's size from its header, a video's from its
    container), so that nothing beyond them is decoded or sent to the model."""

    max_file_bytes: int = 200 * 2**20  # any file (also the server's upload limit: gradio's max_file_size)
    max_image_pixels: int = 64_000_000  # e.g. 8000 × 8000; Pillow itself warns above 89 M and refuses 179 M
    max_frame_pixels: int = 4096 * 2160  # a video frame (DCI 4K)
    max_video_seconds: float = 600.0
    max_video_frames: int = 36_000  # decoded at most (10 minutes at 60 fps), when the container does not say
    max_decode_seconds: float = 60.0  # decoding a message's videos stops here (all of them together)
    max_files: int = 16  # per message
    max_message_pixels: int = 256_000_000  # all of a message's images together (from their headers)


def _size_text(n: int) -> str:
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n / 2**10:.1f} KB" if n >= 2**10 else f"{n} bytes"


@dataclass
class SegmentView:
    """What one image, or one temporal slice of a video, looks like to the model.

    ``grid`` is ``(1, h, w)`` merged tokens, the trace's segment grid; ``picture`` is the frame at
    the processor's resized size (``w * merge * patch`` × ``h * merge * patch`` px).
    """

    modality: str
    grid: tuple
    picture: object
    label: str
    # the picture resized and washed out, per tile size: drawn once, not at every redraw of the map
    tiles: dict = field(default_factory=dict, repr=False, compare=False)

    def tile(self, width: int, height: int):
        """The picture at ``width`` × ``height``, washed out a little (RGBA), so that the shading reads on busy
        pictures."""
        from PIL import Image

        if (width, height) not in self.tiles:
            tile = self.picture.resize((width, height), Image.LANCZOS).convert("RGBA")
            self.tiles[(width, height)] = Image.blend(tile, Image.new("RGBA", tile.size, (255, 255, 255, 255)), 0.3)
        return self.tiles[(width, height)]


@dataclass
class PreparedTurn:
    images: list = field(default_factory=list)  # PIL RGB images
    videos: list = field(default_factory=list)  # uint8 [T, 3, H, W]
    video_fps: float = 2.0
    views: list = field(default_factory=list)  # SegmentView per image / video slice, in source order
    notes: list = field(default_factory=list)  # told to the visitor; the turn goes ahead
    problems: list = field(default_factory=list)  # the turn does not go ahead


def prepare_turn(paths, processor, max_video_frames: int = MAX_VIDEO_FRAMES,
                 limits: MediaLimits = MediaLimits()) -> PreparedTurn:
    """Open the message's files and work out what the model will see of them.

    Images come first, then videos (the order `Conversation` puts them in the prompt). A message over
    ``limits`` as a whole (too many files, too many image pixels from the headers) decodes nothing; its
    videos share one decoding budget (``limits.max_decode_seconds``).
    """
    turn = PreparedTurn()
    paths = [str(path) for path in paths or []]
    if len(paths) > limits.max_files:
        turn.problems.append(f"{len(paths)} files are attached: this demo takes up to {limits.max_files} per "
                             "message. Nothing was decoded; attach fewer.")
        return turn
    pixels = sum(_header_pixels(path) for path in paths)
    if pixels > limits.max_message_pixels:
        turn.problems.append(f"The attached images have {pixels:,} pixels together: this demo takes up to "
                             f"{limits.max_message_pixels:,} per message. Nothing was decoded; attach fewer or "
                             "smaller images.")
        return turn
    video_views = []
    started = time.monotonic()
    for path in paths:
        name = os.path.basename(path)
        left = limits.max_decode_seconds - (time.monotonic() - started)
        if left <= 0:
            turn.problems.append(f"**{name}** was not decoded: the message's files used up the "
                                 f"{limits.max_decode_seconds:.0f} s of decoding this demo gives a message.")
            continue
        kind, value, note = read_media(path, max_video_frames, limits, decode_seconds=left)
        if kind is None:
            turn.problems.append(value)
            continue
        if note:
            turn.notes.append(note)
        try:
            if kind == "image":
                image, original = value
                view, size_note = _image_view(image, original, processor, len(turn.images) + 1, name)
                turn.images.append(image)
                turn.views.append(view)
            else:
                frames, fps = value
                if turn.videos:  # Conversation.ask takes one fps for all of a turn's videos: the first's
                    fps = turn.video_fps
                views, size_note = _video_views(frames, fps, processor, len(turn.videos) + 1)
                turn.videos.append(frames)
                turn.video_fps = fps
                video_views.extend(views)
        except Exception as error:  # the processor refused it (e.g. an extreme aspect ratio)
            turn.problems.append(f"**{name}** could not be prepared for the model: {type(error).__name__}: {error}")
            continue
        if size_note:
            turn.notes.append(size_note)
    turn.views.extend(video_views)
    return turn


def read_media(path: str, max_video_frames: int = MAX_VIDEO_FRAMES, limits: MediaLimits = MediaLimits(),
               decode_seconds: float | None = None):
    """``(kind, value, note)``: ``("image", (PIL, original_size), note)``, ``("video", (frames, fps), note)``,
    or ``(None, problem, None)`` with a message for the visitor. The content decides, not the name.

    Nothing beyond ``limits`` is decoded: a file's size, an image's pixels (from its header) and a video's
    duration and frame size (from its container) are checked first. A video's decoding stops after
    ``decode_seconds`` (what is left of the message's budget; default ``limits.max_decode_seconds``)."""
    name = os.path.basename(path)
    if not os.path.isfile(path):
        return None, f"**{name}** could not be found on the server; attach it again.", None
    size = os.path.getsize(path)
    if size == 0:
        return None, f"**{name}** is empty (0 bytes). Attach an image or a video file.", None
    if size > limits.max_file_bytes:
        return None, (f"**{name}** is {_size_text(size)}: this demo takes files up to "
                      f"{_size_text(limits.max_file_bytes)}. Attach a smaller image or a shorter video."), None
    image, image_error, refused = _open_image(path, limits)
    if image is not None:
        return "image", image, None
    image_error = str(image_error).replace(path, name)  # PIL's messages name the server's path
    if refused:
        return None, f"**{name}** {image_error} Nothing was decoded; attach a smaller image.", None
    video, video_error, note = _open_video(path, max_video_frames, limits, decode_seconds)
    video_error = str(video_error).replace(path, name)
    if video is not None:
        return "video", video, note.replace("{name}", name) if note else None
    if video_error.startswith("!"):  # a video over a limit: the message says which
        return None, f"**{name}** {video_error[1:]}", None
    guess = mimetypes.guess_type(name)[0] or ""
    if guess.startswith("image/"):
        return None, (f"**{name}** could not be read as an image ({image_error}). The file may be damaged "
                      "or in a format this server cannot decode; try PNG or JPEG."), None
    if guess.startswith("video/"):
        return None, (f"**{name}** could not be read as a video ({video_error}). The file may be damaged "
                      "or in a format this server cannot decode; try MP4 (H.264) or WebM."), None
    kind = f" ({guess})" if guess else ""
    return None, (f"**{name}** is not an image or a video{kind}. Attach an image (PNG, JPEG, WebP, …) "
                  "or a video (MP4, WebM, MOV, …)."), None


def _header_pixels(path: str) -> int:
    """An image file's width × height from its header (nothing decoded); 0 for anything else, or an image
    that `_open_image` refuses on its own."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.size[0] * im.size[1]
    except Exception:  # not an image, damaged, or a decompression bomb: read_media says which
        return 0


def _open_image(path, limits: MediaLimits = MediaLimits()):
    """``((image, original_size), None, False)``, or ``(None, error, refused)``: ``refused`` when the image is
    over ``limits`` (the error then is the visitor's message), judged from its header before decoding."""
    from PIL import Image, UnidentifiedImageError

    limit = f"this demo takes images up to {limits.max_image_pixels:,} pixels"
    try:
        with Image.open(path) as im:  # reads the header only
            original = im.size
            if original[0] * original[1] > limits.max_image_pixels:
                return None, (f"is an image of {original[0]}×{original[1]} = {original[0] * original[1]:,} pixels: "
                              f"{limit}."), True
            im.draft("RGB", (OPEN_MAX_SIDE, OPEN_MAX_SIDE))  # JPEG: decode straight at a reduced scale
            image = im.convert("RGB")
    except Image.DecompressionBombError as error:  # Pillow refuses to even open it (over 2 × its own limit)
        return None, f"is an image too large to decode safely ({error}); {limit}.", True
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as error:
        return None, error, False
    except Exception as error:  # a damaged file can fail deep in a decoder (zlib, struct, ...)
        return None, f"{type(error).__name__}: {error}", False
    if max(image.size) > OPEN_MAX_SIDE:
        image.thumbnail((OPEN_MAX_SIDE, OPEN_MAX_SIDE))
    return (image, original), None, False


def _open_video(path, max_frames: int, limits: MediaLimits = MediaLimits(), decode_seconds: float | None = None):
    """Decode with PyAV, keeping at most ``max_frames`` evenly spaced frames; ``(value, error, note)``.

    An error that starts with ``!`` is a video over ``limits`` (the rest is the visitor's message): its
    duration and frame size are read from the container before decoding, and decoding stops at
    ``limits.max_video_frames`` frames or ``decode_seconds`` (default ``limits.max_decode_seconds``)."""
    try:
        import av
    except ImportError:
        return None, "PyAV is not installed: pip install av", None
    import numpy as np

    try:
        with av.open(path) as container:
            if not container.streams.video:
                return None, "it has no video stream", None
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else 2.0
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > limits.max_frame_pixels:
                return None, (f"!is a video of {width}×{height} pixels per frame: this demo takes videos up to "
                              f"{limits.max_frame_pixels:,} pixels per frame (e.g. 4096×2160). Nothing was "
                              "decoded."), None
            seconds = _video_seconds(container, stream)
            if seconds is not None and seconds > limits.max_video_seconds:
                return None, (f"!is a video of {seconds:.0f} s: this demo takes videos up to "
                              f"{limits.max_video_seconds:.0f} s. Nothing was decoded; attach a shorter clip."), None
            kept, stride, total = [], 1, 0
            started = time.monotonic()
            budget = limits.max_decode_seconds if decode_seconds is None else decode_seconds
            for frame in container.decode(stream):
                if total >= limits.max_video_frames or time.monotonic() - started > budget:
                    return None, (f"!is a video longer than this demo decodes (it stopped after {total} frames "
                                  f"and {time.monotonic() - started:.0f} s; the limits are "
                                  f"{limits.max_video_frames} frames per video and {limits.max_decode_seconds:.0f} s "
                                  "of decoding per message). Attach a shorter clip."), None
                if frame.width * frame.height > limits.max_frame_pixels:  # a stream whose size changes
                    return None, (f"!is a video with {frame.width}×{frame.height}-pixel frames: this demo takes "
                                  f"up to {limits.max_frame_pixels:,} pixels per frame."), None
                if total % stride == 0:
                    kept.append(_frame_array(frame))
                    if len(kept) >= 4 * max_frames:  # long video: keep every other frame from now on
                        kept, stride = kept[::2], stride * 2
                total += 1
    except Exception as error:  # PyAV raises its own error classes for bad data
        return None, f"{type(error).__name__}: {error}", None
    if total == 0:
        return None, "it has no frames", None
    note = None
    n = len(kept)
    if total > max_frames:
        take = np.linspace(0, n - 1, max_frames).round().astype(int)
        kept = [kept[i] for i in take]
        note = (f"*Note: the video **{{name}}** has {total} frames; this demo keeps at most {max_frames} per video, "
                f"so it sampled {max_frames} evenly ({total / fps:.1f} s at {fps:g} fps).*")
    frames = torch.from_numpy(np.stack(kept)).permute(0, 3, 1, 2).contiguous()
    effective_fps = fps * len(kept) / total  # the sampled frames still span the whole clip
    return (frames, effective_fps), None, note


def _video_seconds(container, stream) -> float | None:
    """The video's duration from its container or stream header (None when neither says)."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1e6  # av.time_base: microseconds
    return None


def _frame_array(frame):
    scale = min(1.0, DECODE_MAX_SIDE / max(frame.width, frame.height))
    width, height = max(2, round(frame.width * scale)), max(2, round(frame.height * scale))
    return frame.reformat(width=width, height=height, format="rgb24").to_ndarray()


def _max_pixels(image_processor):
    size = getattr(image_processor, "size", None) or {}
    for key in ("longest_edge", "max_pixels"):
        value = size.get(key) if hasattr(size, "get") else getattr(size, key, None)
        if value:
            return int(value)
    return getattr(image_processor, "max_pixels", None)


def _image_view(image, original, processor, index, name):
    from PIL import Image

    ip = processor.image_processor
    t, h, w = (int(x) for x in ip(images=[image], return_tensors="pt")["image_grid_thw"][0])
    patch, merge = int(ip.patch_size), int(ip.merge_size)
    size = (w * patch, h * patch)
    view = SegmentView("image", (1, h // merge, w // merge), image.resize(size, Image.LANCZOS), f"image {index}")
    limit = _max_pixels(ip)
    note = None
    if limit and original[0] * original[1] > limit:
        note = (f"*Note: your image **{name}** ({original[0]}×{original[1]}) is larger than this model's image "
                f"processor takes (at most {limit:,} pixels): the model sees it resized to {size[0]}×{size[1]}.*")
    return view, note


def _video_views(frames, fps, processor, index):
    from PIL import Image
    from transformers.video_utils import VideoMetadata

    vp = processor.video_processor
    metadata = VideoMetadata(total_num_frames=int(frames.shape[0]), fps=fps,
                             frames_indices=list(range(int(frames.shape[0]))))
    t, h, w = (int(x) for x in vp(videos=[frames], video_metadata=[metadata], return_tensors="pt")["video_grid_thw"][0])
    patch, merge = int(vp.patch_size), int(vp.merge_size)
    n = int(frames.shape[0])
    views = []
    for i in range(t):
        first = min(n - 1, i * n // t)
        last = min(n - 1, (i + 1) * n // t - 1)
        picture = Image.fromarray(frames[first].permute(1, 2, 0).numpy()).resize((w * patch, h * patch), Image.LANCZOS)
        frames_label = f"frame {first + 1}" if last <= first else f"frames {first + 1}-{last + 1}"
        views.append(SegmentView("video", (1, h // merge, w // merge), picture, f"video {index} · {frames_label}"))
    return views, None


# ---- the live picture ---------------------------------------------------------------------------

@dataclass
class LiveStatus:
    """Source positions by what the cache holds for them, read from a running conversation."""

    in_cache: set
    restored: set
    pending: set
    dropped: set


def live_status(cache) -> LiveStatus:
    """A consistent read of the cache's public attributes while another thread may be appending rows.

    `DeferredDynamicCache.add_rows` replaces ``row_sources`` and ``row_kinds`` one after the other,
    so a read can see them at different lengths for a moment; retry until they agree. (A
    ``Conversation.snapshot()`` taken under the conversation's lock would make this unnecessary.)
    """
    empty = torch.empty(0, dtype=torch.long)
    if cache is None:
        return LiveStatus(set(), set(), set(), set())
    for _ in range(100):
        rows = cache.row_sources
        try:
            restored = cache.restored_sources()
        except (IndexError, RuntimeError):
            time.sleep(0.001)
            continue
        pending = cache.pending_sources
        dropped = getattr(cache, "dropped", empty)
        return LiveStatus(set(rows.tolist()), set(restored.tolist()), set(pending.tolist()), set(dropped.tolist()))
    return LiveStatus(set(), set(), set(), set())


@dataclass
class VisualTurn:
    """The images / videos of one turn and where their tokens sit in the conversation."""

    number: int  # turn number in its conversation, from 1
    views: list  # SegmentView per trace segment, in source order
    start: int  # source position where the turn's new tokens begin (after the previous sequences)
    positions: list | None = None  # per view: source positions (from the trace once the turn ended)
    during: set | None = None  # positions restored during the answer (from the trace once the turn ended)
    result: object = None  # the turn's TurnResult once it ended

    def locate(self, cache, image_token_id: int, video_token_id: int) -> bool:
        """Find the views' source positions in the cache's token ids (once the turn is prefilled).

        The trace's ``segments`` give them exactly when `generate` returns; while the answer
        streams they are read off ``cache.source_ids``: each view takes the next ``h * w``
        image-pad (or video-pad) positions of the turn, in source order.
        """
        if self.positions is not None:
            return True
        if cache is None or cache.source_length <= self.start:
            return False
        ids = cache.source_ids[self.start:]
        queues = {"image": ((ids == image_token_id).nonzero().flatten() + self.start).tolist(),
                  "video": ((ids == video_token_id).nonzero().flatten() + self.start).tolist()}
        positions = []
        for view in self.views:
            n = view.grid[1] * view.grid[2]
            queue = queues[view.modality]
            if len(queue) < n:
                return False
            positions.append(queue[:n])
            del queue[:n]
        self.positions = positions
        return True

    def use_trace(self, trace) -> None:
        self.during = {int(p) for r in trace.restored_per_forward[1:] for p in r.tolist()}
        segments = list(trace.segments)
        if len(segments) == len(self.views) and all(
            tuple(grid) == tuple(view.grid) for (_, grid, _), view in zip(segments, self.views)
        ):
            self.positions = [list(map(int, pos)) for _, _, pos in segments]

    def states(self, live: LiveStatus) -> list[list[str]]:
        """Per view, per merged token (row-major): selected / deferred / during / after / dropped / waiting.

        ``during`` and ``after``: restored during the answer, or after it (idle time, or the next
        question's prefill). While the answer streams, everything restored so far is ``during``.
        """
        if self.positions is None:
            return [["waiting"] * (v.grid[1] * v.grid[2]) for v in self.views]
        out = []
        for positions in self.positions:
            row = []
            for p in positions:
                if p in live.dropped:
                    row.append("dropped")
                elif p in live.restored:
                    row.append("during" if self.during is None or p in self.during else "after")
                elif p in live.pending or p not in live.in_cache:  # pending, or a chunk in flight
                    row.append("deferred")
                else:
                    row.append("selected")
            out.append(row)
        return out


_FILL = {
    "selected": ((59, 130, 246, 70), (37, 99, 235, 255)),
    "deferred": ((15, 23, 42, 215), (51, 65, 85, 255)),
    "during": ((34, 197, 94, 120), (21, 128, 61, 255)),
    "after": ((168, 85, 247, 110), (126, 34, 206, 255)),
    "dropped": ((239, 68, 68, 150), (185, 28, 28, 255)),
    "waiting": ((148, 163, 184, 110), None),
}


def draw_picture(views, states, width: int = PICTURE_WIDTH, max_height: int = 480):
    """The views side by side (2 or 4 per row) with each merged token's cell shaded by its state."""
    from PIL import Image, ImageDraw, ImageFont

    n = len(views)
    cols = 1 if n == 1 else 2 if n <= 4 else 4
    gap = 6
    tile_w = (width - gap * (cols - 1)) // cols
    if n == 1:  # a tall image: narrower rather than taller than the chat beside it
        tile_w = min(tile_w, round(max_height * views[0].picture.width / views[0].picture.height))
    tiles = []
    for view, cell_states in zip(views, states):
        tile_h = max(1, round(view.picture.height * tile_w / view.picture.width))
        tile = view.tile(tile_w, tile_h)
        overlay = Image.new("RGBA", tile.size, (0, 0, 0, 0))
        draw = ImageDraw.Draw(overlay)
        gh, gw = view.grid[1], view.grid[2]
        line = 3 if tile_w / gw >= 40 else 2 if tile_w / gw >= 16 else 1
        for index, state in enumerate(cell_states):
            r, c = divmod(index, gw)
            box = (round(c * tile_w / gw), round(r * tile_h / gh),
                   round((c + 1) * tile_w / gw) - 1, round((r + 1) * tile_h / gh) - 1)
            fill, outline = _FILL[state]
            draw.rectangle(box, fill=fill, outline=outline, width=line if outline else 0)
            if state == "dropped":
                draw.line(box, fill=outline, width=line)
                draw.line((box[0], box[3], box[2], box[1]), fill=outline, width=line)
        tile = Image.alpha_composite(tile, overlay)
        if n > 1:
            label = ImageDraw.Draw(tile)
            font = ImageFont.load_default(size=12 if cols > 2 else 14)
            x0, y0, x1, y1 = label.textbbox((4, 3), view.label, font=font)
            label.rectangle((x0 - 3, y0 - 2, x1 + 3, y1 + 2), fill=(255, 255, 255, 230))
            label.text((4, 3), view.label, fill=(15, 23, 42, 255), font=font)
        tiles.append(tile.convert("RGB"))
    rows = [tiles[i:i + cols] for i in range(0, n, cols)]
    flat_states = [s for view in states for s in view]
    legend_h = 8 + 22 * len(_legend_lines(flat_states, width))
    height = sum(max(t.height for t in row) for row in rows) + gap * (len(rows) - 1) + legend_h
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    x0 = (width - tile_w) // 2 if n == 1 else 0
    y = 0
    for row in rows:
        for j, tile in enumerate(row):
            canvas.paste(tile, (x0 + j * (tile_w + gap), y))
        y += max(t.height for t in row) + gap
    _draw_legend(canvas, y + 4, flat_states)
    return canvas


def _legend_lines(flat_states, width: int) -> list[list[tuple[str, str, int]]]:
    """The legend's entries ``(state, text, x)``, wrapped into lines that fit ``width``."""
    from PIL import ImageFont

    font = ImageFont.load_default(size=14)
    lines, x = [[]], 2
    for state, label in LEGEND_LABELS:
        count = flat_states.count(state)
        if state == "waiting" and not count:  # a moment at the start of a turn; the others always show
            continue
        text = f"{label} {count}"
        size = 22 + int(font.getlength(text)) + 16
        if x > 2 and x + size - 16 > width:
            lines.append([])
            x = 2
        lines[-1].append((state, text, x))
        x += size
    return lines


def _draw_legend(canvas, y: int, flat_states) -> None:
    """Swatches with counts under the tiles (drawn, so it needs no emoji font in the browser)."""
    from PIL import ImageDraw, ImageFont

    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default(size=14)
    for line in _legend_lines(flat_states, canvas.width):
        for state, text, x in line:
            fill, outline = _FILL[state]
            draw.rectangle((x, y + 3, x + 16, y + 19), fill=fill[:3], outline=outline[:3] if outline else None,
                           width=2)
            draw.text((x + 22, y + 3), text, fill=(15, 23, 42), font=font)
        y += 22


# ---- the restoration timeline -------------------------------------------------------------------

@dataclass
class TimelineStep:
    """One step of a turn's restoration: the deferred positions that came back in it."""

    label: str  # "first token", "token 17", "idle chunk 2", "next question's prefill"
    phase: str  # "prefill" (nothing restored yet), "during" (fused into a decode step), "after"
    restored: list  # source positions restored at this step, in order


def build_timeline(turn: VisualTurn, cache, chunk_size: int, next_result=None) -> list[TimelineStep]:
    """Which of ``turn``'s deferred patches came back at which step, from its trace and the cache.

    Step 0 is the first token (nothing restored: what the answer starts from). Step ``i`` (from 1)
    is the decode step that consumed generated token ``i``, with the chunk fused into it (the trace's
    ``restored_per_forward[i]``); then the chunks restored after the answer: idle-time chunks (the
    cache stores them in restoration order, ``chunk_size`` at a time) and, when a follow-up came
    first, the rest at the next question's prefill (``next_result``'s forward 0).
    """
    result = turn.result
    if result is None or turn.positions is None:
        return []
    mine = {p for positions in turn.positions for p in positions}
    steps = [TimelineStep("first token", "prefill", [])]
    forwards = result.trace.restored_per_forward
    for i, rows in enumerate(forwards[1:], 1):
        steps.append(TimelineStep(f"token {i}", "during", [p for p in rows.tolist() if p in mine]))
    during = {p for step in steps for p in step.restored}
    at_next = []
    if next_result is not None and next_result.trace.restored_per_forward:
        at_next = [p for p in next_result.trace.restored_per_forward[0].tolist() if p in mine]
    later = set(at_next)
    after = [p for p in live_restored_order(cache) if p in mine and p not in during and p not in later]
    for j in range(0, len(after), max(1, chunk_size)):
        steps.append(TimelineStep(f"idle chunk {j // max(1, chunk_size) + 1}", "after", after[j:j + chunk_size]))
    if at_next:
        steps.append(TimelineStep("next question's prefill", "after", at_next))
    return steps


def live_restored_order(cache) -> list[int]:
    """The restored deferred positions in the order they entered the cache (a consistent read)."""
    for _ in range(100):
        try:
            return cache.restored_sources().tolist() if cache is not None else []
        except (IndexError, RuntimeError):  # read while a forward appends rows; read again
            time.sleep(0.001)
    return []


def timeline_states(turn: VisualTurn, steps: list[TimelineStep], upto: int, dropped=()) -> list[list[str]]:
    """Per view, per merged token: the state after step ``upto`` of ``steps``."""
    phase = {}
    for step in steps[:upto + 1]:
        for p in step.restored:
            phase[p] = step.phase
    deferred = {p for step in steps for p in step.restored}
    dropped = set(dropped)
    return [["dropped" if p in dropped else phase[p] if p in phase else "deferred" if p in deferred else "selected"
             for p in positions] for positions in turn.positions]


def describe_step(steps: list[TimelineStep], upto: int) -> str:
    """One line for the scrubber: where it is and how much has come back by then."""
    total = sum(len(s.restored) for s in steps)
    answer = sum(1 for s in steps if s.phase != "after")  # the first token and the decode steps
    step = steps[upto]
    done = sum(len(s.restored) for s in steps[:upto + 1])
    during = sum(len(s.restored) for s in steps[:upto + 1] if s.phase == "during")
    if step.phase == "after":
        where = f"**after the answer, {step.label}**"
    elif upto == 0:
        where = "**the first token** (the answer starts from the patches prefilled first)"
    else:  # step i is the decode step that read generated token i (and produced token i + 1)
        where = f"**decode step {upto} of {answer - 1}**, which read generated token {upto}"
    came = f"{len(step.restored)} came back in this step" if step.restored else "nothing came back in this step"
    return (f"Timeline: {where}: {came}; {done} of {total} deferred patches restored so far "
            f"({during} during the answer, {done - during} after it).")


def draw_timeline(steps: list[TimelineStep], upto: int, width: int = PICTURE_WIDTH, height: int = 86):
    """A strip: one bar per step (its height: patches restored then), green during the answer,
    violet after it; a marker at step ``upto``."""
    from PIL import Image, ImageDraw, ImageFont

    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default(size=12)
    left, right, top, bottom = 6, width - 6, 6, height - 22
    n = len(steps)
    most = max([len(s.restored) for s in steps] + [1])
    step_w = (right - left) / max(n, 1)
    answer_end = left + step_w * sum(1 for s in steps if s.phase != "after")
    draw.rectangle((left, top, answer_end, bottom), fill=(240, 253, 244))
    draw.rectangle((answer_end, top, right, bottom), fill=(250, 245, 255))
    for i, step in enumerate(steps):
        if not step.restored:
            continue
        fill, outline = _FILL[step.phase]
        h = max(2, round((bottom - top) * len(step.restored) / most))
        x0 = left + step_w * i
        draw.rectangle((x0 + (1 if step_w > 3 else 0), bottom - h, x0 + max(step_w - 1, 1), bottom),
                       fill=outline[:3])
    x = left + step_w * (upto + 0.5)
    draw.line((x, top - 4, x, bottom + 2), fill=(15, 23, 42), width=2)
    answer = sum(1 for s in steps if s.phase != "after")
    draw.text((left, bottom + 5), f"answer: {answer} tokens", fill=(21, 128, 61), font=font)
    if n > answer:
        text = f"after the answer: {n - answer} step{'s' if n - answer != 1 else ''}"
        draw.text((max(answer_end + 4, right - draw.textlength(text, font=font)), bottom + 5), text,
                  fill=(126, 34, 206), font=font)
    return canvas


# ---- a browser session --------------------------------------------------------------------------

@dataclass(frozen=True)
class Settings:
    """What starts a new conversation when it changes (everything but answer length and pacing)."""

    model: str = DEFAULT_MODEL
    mode: str = "raincheck"
    selector: str = "uniform"
    retention: float = 0.3
    chunk_size: int = 31
    decode_guard: int = 16

    @classmethod
    def from_controls(cls, model, mode, selector, retention, chunk_size, decode_guard) -> "Settings":
        return cls(model_key(model), str(mode), str(selector), float(retention), int(chunk_size), int(decode_guard))

    def config(self):
        """The `RaincheckConfig` (a ValueError naming the setting when one is out of range)."""
        from raincheck_hf import RaincheckConfig

        return RaincheckConfig(retention=self.retention, chunk_size=self.chunk_size, decode_guard=self.decode_guard,
                               selector=self.selector, mode=self.mode)

    def changes(self, other: "Settings") -> str:
        names = {"chunk_size": "chunk size", "decode_guard": "decode guard"}
        return ", ".join(f"{names.get(f.name, f.name)} → {getattr(other, f.name)}"
                         for f in fields(self) if getattr(self, f.name) != getattr(other, f.name))


class _Pause:
    """A logits processor that sleeps before each token is chosen: the demo's *slow motion*."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, input_ids, scores):
        time.sleep(self.seconds)
        return scores


@dataclass
class Step:
    """What one update of the page changes besides the chat, the caption and the figures."""

    picture: bool | str = True  # True: redraw if it changed; "force": redraw; False: leave it
    timer: bool | None = None  # start / stop the timer that follows idle-time restoration
    textbox: str | None = None  # "lock" (cleared, disabled while answering), "clear", "keep_files"
    files: tuple = ()
    model_choice: str | None = None  # what the model dropdown shows (after a change, or to undo a failed one)
    model_note: str | None = None
    token: bool = False  # one more piece of the answer: shown at most every STREAM_*_EVERY_S (see `pace`)


def pace(steps, text_every: float = STREAM_TEXT_EVERY_S, picture_every: float = STREAM_PICTURE_EVERY_S,
         clock=time.perf_counter):
    """``(what, step)`` for the steps worth showing: ``what`` is ``"all"`` (render everything) or ``"text"``
    (the chat only). Every step but a token's is shown at once; a token's at most every ``text_every``
    seconds, and with the picture, caption and figures at most every ``picture_every`` seconds, so that the
    page's work does not slow the answer it shows. The step after the last token (the turn's end) draws
    everything."""
    shown_text = shown_all = -math.inf
    for step in steps:
        if not step.token:
            yield "all", step
            continue
        now = clock()
        if now - shown_all >= picture_every:
            shown_all = shown_text = now
            yield "all", step
        elif now - shown_text >= text_every:
            shown_text = now
            yield "text", step


class Session:
    """One browser session: its settings, its `Conversation`, the chat as shown, the visual turns."""

    def __init__(self, settings: Settings, max_video_frames: int = MAX_VIDEO_FRAMES,
                 limits: MediaLimits = MediaLimits()):
        self.id = uuid.uuid4().hex[:8]
        self.settings = settings
        self.max_video_frames = max_video_frames
        self.limits = limits
        self.loaded: LoadedModel | None = None
        self.conversation = None
        self.number = 1  # conversations started in this session
        self.history: list[dict] = []  # the chat as shown (gr.Chatbot messages)
        self.visual_turns: list[VisualTurn] = []
        self.lock = threading.Lock()  # one turn at a time; settings changes wait for it
        self.answering = False
        self.live: dict | None = None  # the turn being answered: number, start time, first-token time
        self.slow_motion_ms = 0
        self._drawn = None  # signature of the picture last sent
        self._timeline_shown = None  # signature of the timeline last sent
        self._streamed: dict = {}  # what the page was last sent while an answer streams (component id -> value)
        self._live_caption = None  # the caption of the cache last sent (the timeline's may be shown instead)
        self.busy = None  # what holds the lock: "answering", or "loading model X"
        self.requested: Settings | None = None  # settings asked for while an answer runs (applied after it)
        self.grid_cells = None  # the cells of the conversation's latest glyph grid (for reference answers)

    # -- conversation lifecycle --
    def ensure_conversation(self):
        """The current conversation, created (and its model loaded) on first use."""
        if self.conversation is None:
            from raincheck_hf import Conversation, DeferredDynamicCache

            config = self.settings.config()  # a ValueError naming the setting, before any load
            self.loaded = load_model(self.settings.model)
            model = self.loaded.model
            conversation = Conversation(model, self.loaded.processor, config)
            # Created here rather than by the first generate, so that the picture can follow the
            # first turn while it streams (the conversation only exposes its cache afterwards).
            conversation.cache = DeferredDynamicCache(config=model.config.get_text_config(), device=model.device)
            self.conversation = conversation
        return self.conversation

    def restart(self, settings: Settings | None = None) -> None:
        """Close the conversation; the next question starts a new one (with ``settings``)."""
        self.close()
        self.visual_turns = []
        self.live = None
        self._drawn = None
        self.grid_cells = None
        self.number += 1
        if settings is not None:
            self.settings = settings

    def close(self) -> None:
        if self.conversation is not None:
            self.conversation.close()
            self.conversation = None

    @property
    def cache(self):
        return None if self.conversation is None else self.conversation.cache

    @property
    def pending(self) -> int:
        return 0 if self.conversation is None else int(self.conversation.pending)

    def note(self, text: str) -> None:
        self.history.append({"role": "assistant", "content": text})

    # -- a turn --
    def loading_step(self, wanted: Settings) -> Step | None:
        """A note, shown at once, when ``wanted`` needs a model that is not loaded yet (it may take a while)."""
        if wanted.model == self.settings.model and self.loaded is not None or is_loaded(wanted.model):
            return None
        self.busy = f"loading model {wanted.model}"
        self.note(f"*Loading model **{wanted.model}**… A Hub id that is not on this machine is downloaded first "
                  "(minutes for a large checkpoint); one that cannot be found fails within seconds.*")
        return Step(picture=False, model_note=f"Loading model **{wanted.model}**…")

    def apply(self, wanted: Settings) -> Step | None:
        """Start a new conversation for changed settings; a model that cannot be loaded keeps the old one."""
        if wanted == self.settings:
            return None
        try:
            wanted.config()
            loaded = load_model(wanted.model)
        except (ValueError, ModelLoadError) as error:
            self.note(f"**Problem:** {error}\n\nThe conversation goes on with **{self.settings.model}** "
                      f"(mode `{self.settings.mode}`).")
            return Step(picture=False, model_choice=self.settings.model)
        change = self.settings.changes(wanted)
        self.restart(wanted)
        self.loaded = loaded
        self.note(f"*New conversation ({change}): the model no longer sees the earlier turns.*")
        return Step(picture="force", model_choice=loaded.name, model_note=loaded.note)

    def turn(self, message, wanted: Settings, max_new_tokens: int = 64, slow_motion_ms: int = 0):
        """Answer one message ({"text", "files"}); yields a `Step` after every change worth showing.

        Bad input gets a message in the chat and leaves the conversation as it was.
        """
        loading = self.loading_step(wanted)
        if loading is not None:
            yield loading
        setup = self.apply(wanted)
        self.busy = "answering the previous question"
        if setup is not None:
            yield setup
        text = str((message or {}).get("text") or "").strip()
        files = list((message or {}).get("files") or [])
        if not text and not files:
            self.note("The message is empty: type a question (and attach an image or a video if you like).")
            yield Step(picture=False)
            return
        if not text:
            self.note("Add a question to go with your file(s): they are still in the box below.")
            yield Step(picture=False, textbox="keep_files", files=tuple(files))
            return
        try:
            conversation = self.ensure_conversation()
        except (ModelLoadError, ValueError) as error:
            self.history.append({"role": "user", "content": text})
            self.note(f"**Problem:** {error}\n\nChoose another model under *Settings*.")
            yield Step(picture=False, textbox="clear")
            return
        prepared = prepare_turn(files, self.loaded.processor, self.max_video_frames, self.limits)
        for path in files:
            self.history.append({"role": "user", "content": {"path": path}})
        self.history.append({"role": "user", "content": text})
        if prepared.problems:
            self.note("**Problem:** " + "\n\n**Problem:** ".join(prepared.problems)
                      + "\n\nNothing was sent to the model; the conversation is unchanged. Attach a readable "
                        "image or video, or ask without a file.")
            yield Step(picture=False, textbox="clear")
            return
        for note in prepared.notes:
            self.note(note)
        asked = text
        if self.loaded.bundled:  # the glyph models' word-level vocabulary is lowercase
            asked = text.lower()
            unknown = unknown_words(self.loaded.processor.tokenizer, asked)
            if unknown:
                self.note(f"*Note: the bundled glyph model does not know {', '.join(f'**{w}**' for w in unknown)} "
                          "(it reads them as `<unk>`): it knows only the glyph task's words, e.g. `what is the "
                          "background of the red g3 ?` or `list the backgrounds of the red and blue glyphs .` "
                          "(see the examples).*")
        if prepared.images or prepared.videos:  # a new picture: references follow its grid, if it is one
            single = len(prepared.images) == 1 and not prepared.videos
            self.grid_cells = read_glyph_grid(prepared.images[0]) if single else None

        number = len(conversation.turns) + 1
        # the new turn's tokens follow the previous sequences (then the glue and the new prompt)
        start = 0 if conversation.sequences is None else int(conversation.sequences.shape[1])
        visual = VisualTurn(number, prepared.views, start) if prepared.views else None
        if visual is not None:
            self.visual_turns.append(visual)
        config = self.loaded.model.config
        # A placeholder or vision marker in an answer would be read as an image slot by the next
        # turn's prompt; a random-weight model does produce them now and then.
        vision_ids = [getattr(config, name, None) for name in
                      ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")]
        kwargs = {"max_new_tokens": int(max_new_tokens), "suppress_tokens": [i for i in vision_ids if i is not None]}
        self.slow_motion_ms = int(slow_motion_ms or 0)
        if self.slow_motion_ms:
            from transformers import LogitsProcessorList

            kwargs["logits_processor"] = LogitsProcessorList([_Pause(self.slow_motion_ms / 1e3)])
        self.answering = True
        self.live = {"number": number, "start": time.perf_counter(), "first": None}
        # the answer's own message: a note added meanwhile (a settings change) goes after it
        answer = {"role": "assistant", "content": "…"}
        self.history.append(answer)
        yield Step(timer=False, textbox="lock")
        reply, streaming, streamed = "", False, None
        try:
            streamed = conversation.ask(asked, images=prepared.images, videos=prepared.videos, stream=True,
                                        video_fps=prepared.video_fps, **kwargs)
            streaming = True
            for piece in streamed:
                if self.live["first"] is None:
                    self.live["first"] = time.perf_counter()
                reply += piece
                answer["content"] = reply or "…"
                yield Step(token=True)
            result = streamed.result
        except GeneratorExit:  # the page or an API client stopped this answer (Gradio closes the handler)
            self._stopped(streamed, visual, reply)
            raise
        except Exception as error:  # the processor refused the input, or the model failed
            self.answering = False
            if visual is not None:
                self.visual_turns.remove(visual)
            if not streaming:  # nothing reached the model: the conversation is as it was
                answer["content"] = (f"**Problem:** the processor could not prepare this turn "
                                     f"({type(error).__name__}: {error}). The conversation is unchanged.")
            else:
                answer["content"] = reply or "…"
                self.note(f"**Problem:** the model failed on this turn ({type(error).__name__}: {error}). "
                          "A new conversation starts with your next question.")
                self.restart()
            yield Step(picture="force", timer=False, textbox="clear")
            return
        if not result.text.strip():
            answer["content"] = "*(empty answer)*"
        reference = glyph_reference(self.grid_cells, asked)
        if reference is not None:
            self.note(f"*Reference (read off the grid's pixels): {reference.answer} — "
                      f"**{judge(reference, result.text)}**.*")
        elif missing_from_grid(self.grid_cells, asked):
            self.note(f"*No reference: {missing_from_grid(self.grid_cells, asked)}.*")
        if visual is not None:
            visual.use_trace(result.trace)
            visual.result = result
        self.answering = False
        self.live = None
        yield Step(picture="force", timer=True, textbox="clear")

    def _stopped(self, streamed, visual, reply: str) -> None:
        """Settle a turn whose answer was stopped: generation stops at its next step, the conversation keeps
        what was generated until then (the next question goes on from it), the chat shows it."""
        self.answering = False
        self.live = None
        if streamed is None:  # stopped before the question reached the model
            if visual in self.visual_turns:
                self.visual_turns.remove(visual)
            self.history[-1]["content"] = "*(stopped before the model started)*"
            return
        streamed.close()
        try:
            result = streamed.result
        except Exception as error:  # the model failed before it could stop
            self.history[-1]["content"] = reply or "…"
            self.note(f"**Problem:** the model failed on this turn ({type(error).__name__}: {error}). "
                      "A new conversation starts with your next question.")
            self.restart()
            return
        self.history[-1]["content"] = result.text.strip() or "…"
        if result.cancelled:
            self.note(f"*Stopped after {int(result.token_ids.numel())} tokens: the conversation keeps them, and "
                      "the next question goes on from there.*")
        if visual is not None:
            visual.use_trace(result.trace)

    # -- what the page shows --
    def picture_and_counts(self, draw: bool = True, force: bool = False):
        """``(picture or None, counts or None, changed)`` for the latest turn with images or videos."""
        if not self.visual_turns:
            changed = force or self._drawn is not None
            if draw:
                self._drawn = None
            return None, None, changed
        turn = self.visual_turns[-1]
        if self.loaded is not None:
            config = self.loaded.model.config
            turn.locate(self.cache, config.image_token_id, config.video_token_id)
        states = turn.states(live_status(self.cache))
        flat = [s for view in states for s in view]
        counts = {name: flat.count(name) for name in STATES}
        signature = (id(turn), tuple(flat))
        changed = force or signature != self._drawn
        if not (draw and changed):
            return None, counts, changed
        self._drawn = signature
        return draw_picture(turn.views, states), counts, True

    def timeline(self):
        """``(turn, steps)``: the latest visual turn and its `build_timeline` once its restoration is
        over (``steps`` is None while it answers or restores)."""
        if not self.visual_turns:
            return None, None
        turn = self.visual_turns[-1]
        if self.answering or turn.result is None or self.pending:
            return turn, None
        turns = self.conversation.turns if self.conversation is not None else []
        following = turns[turn.number] if len(turns) > turn.number else None
        return turn, build_timeline(turn, self.cache, self.settings.chunk_size, following)

    def timeline_view(self, upto: int | None = None):
        """``(picture, strip, text, upto, steps)`` for the timeline at step ``upto`` (default: the last)."""
        turn, steps = self.timeline()
        if not steps:
            return None, None, None, 0, steps
        upto = len(steps) - 1 if upto is None else max(0, min(int(upto), len(steps) - 1))
        dropped = turn.result.trace.dropped.tolist()
        picture = draw_picture(turn.views, timeline_states(turn, steps, upto, dropped))
        if dropped:
            text = (f"Timeline: mode `hard` dropped the {len(dropped)} deferred patches for good: nothing comes "
                    "back, at any token.")
        elif len(steps) == 1 or not any(step.restored for step in steps):
            text = "Timeline: nothing was deferred in this turn, so nothing had to come back."
        else:
            text = describe_step(steps, upto)
        return picture, draw_timeline(steps, upto), text, upto, steps

    def caption(self, counts) -> str:
        s = self.settings
        head = f"Conversation {self.number} · mode `{s.mode}` · selector `{s.selector}` · retention {s.retention:g}"
        if self.slow_motion_ms:
            head += f" · slow motion {self.slow_motion_ms} ms/token (in the timings too)"
        if counts is None:
            return (f"{head}\n\nAttach an image or a video and ask about it: this panel shows which of its patches "
                    "the model read first (blue), which it deferred (dark), which were restored while it answered "
                    "(green) and which after the answer (violet); `hard` drops them for good (red). The timeline "
                    "under it replays the restoration token by token.")
        if self.answering:
            state = "answering…"
        elif self.busy and self.busy.startswith("loading"):
            state = self.busy + "…"
        elif self.pending:
            state = f"answer done · restoring in idle time ({self.pending} pending)"
        elif counts["dropped"]:
            state = "ready · the dropped tokens are gone for good"
        else:
            state = "ready · every deferred token is in the cache"
        total = sum(counts.values())
        shown = self.visual_turns[-1].number
        if self.answering and self.live is not None and self.live["number"] != shown:
            state = f"the picture is turn {shown}'s; turn {self.live['number']} (no new image) is being answered…"
        if counts["waiting"]:
            numbers = "prefilling the first tokens…"
        else:
            numbers = (f"{counts['selected']} prefilled first · {counts['deferred']} deferred · "
                       f"{counts['during']} restored during the answer · {counts['after']} after it · "
                       f"{counts['dropped']} dropped")
        return f"{head}\n\n**Turn {shown}** ({total} visual tokens): **{state}** — {numbers}"

    def timeline_caption(self, upto: int) -> str | None:
        """The caption while the picture shows step ``upto`` of the latest turn's timeline (not the live cache)."""
        turn, steps = self.timeline()
        if not steps:
            return None
        upto = max(0, min(int(upto), len(steps) - 1))
        states = timeline_states(turn, steps, upto, turn.result.trace.dropped.tolist())
        s = self.settings
        head = f"Conversation {self.number} · mode `{s.mode}` · selector `{s.selector}` · retention {s.retention:g}"
        flat = [state for view in states for state in view]
        step = steps[upto]
        when = ("the first token" if upto == 0 else f"after the answer, {step.label}" if step.phase == "after"
                else f"decode step {upto}")
        return (f"{head}\n\n**Turn {self.visual_turns[-1].number}** ({len(flat)} visual tokens): **the timeline at "
                f"{when}** — {flat.count('selected')} prefilled first · {flat.count('deferred')} still deferred then · "
                f"{flat.count('during')} restored during the answer · {flat.count('after')} after it · "
                f"{flat.count('dropped')} dropped. "
                + ("(The end of the timeline: where the turn's restoration ended.)" if upto == len(steps) - 1 else
                   "(The picture shows the cache as it was then; drag to the end for where the turn ended.)"))

    def figures(self):
        import pandas as pd

        rows = []
        for i, r in enumerate(self.conversation.turns if self.conversation is not None else [], 1):
            tpot = r.time_per_output_token
            ttft, tpot = (("–" if math.isnan(t) else f"{t * 1e3:.1f}") for t in (r.time_to_first_token, tpot))
            visual = len(r.trace.selected) + len(r.trace.deferred)
            if visual == 0:  # a follow-up without a new image: nothing of its own to defer or restore
                rows.append([i, "no new visual tokens", "–", ttft, tpot, "–", "–", "–", "–"])
                continue
            rows.append([i, visual, len(r.trace.selected), ttft, tpot, r.restored_during_answer,
                         r.restored_after_answer, r.pending, len(r.trace.dropped)])
        if self.live is not None:  # the turn being answered, from the live picture
            first = self.live["first"]
            ttft = "…" if first is None else f"{(first - self.live['start']) * 1e3:.1f}"
            row = [self.live["number"], "…", "…", ttft, "…", "…", "…", "…", "…"]
            if self.visual_turns and self.visual_turns[-1].number == self.live["number"]:
                _, counts, _ = self.picture_and_counts(draw=False)
                if not counts["waiting"]:
                    row[1:3] = [sum(counts.values()), counts["selected"]]
                    row[5], row[7], row[8] = counts["during"], counts["deferred"], counts["dropped"]
            rows.append(row)
        return pd.DataFrame(rows, columns=FIGURE_HEADERS).astype(str)

    def status(self) -> dict:
        """Machine-readable state, for the API and the *Live trace* panel."""
        live = live_status(self.cache)
        turns = self.conversation.turns if self.conversation is not None else []
        out = {
            "session": self.id, "conversation": self.number,
            "settings": {f.name: getattr(self.settings, f.name) for f in fields(self.settings)},
            "answering": self.answering, "turns": len(turns), "pending": self.pending,
            "restored": len(live.restored), "restored_once": _restored_once(self.cache), "dropped": len(live.dropped),
            "turn_figures": [
                {"turn": i, "visual_tokens": len(r.trace.selected) + len(r.trace.deferred),
                 "selected": len(r.trace.selected), "deferred": len(r.trace.deferred),
                 "ttft_ms": round(r.time_to_first_token * 1e3, 2),
                 "tpot_ms": None if math.isnan(r.time_per_output_token) else round(r.time_per_output_token * 1e3, 2),
                 "restored_during_answer": r.restored_during_answer, "restored_after_answer": r.restored_after_answer,
                 "restored_at_prefill": int(r.trace.restored_per_forward[0].numel()) if r.trace.restored_per_forward
                 else 0,
                 "pending": r.pending, "dropped": len(r.trace.dropped), "answer_tokens": int(r.token_ids.numel())}
                for i, r in enumerate(turns, 1)
            ],
        }
        _, steps = self.timeline()
        if steps:  # the latest visual turn's restoration, step by step (steps where something came back)
            out["timeline"] = {"steps": len(steps), "restored": [
                {"step": i, "label": step.label, "phase": step.phase, "count": len(step.restored)}
                for i, step in enumerate(steps) if step.restored]}
        if self.visual_turns:
            turn = self.visual_turns[-1]
            out["picture"] = {"turn": turn.number, "located": turn.positions is not None, "segments": [
                {"modality": v.modality, "grid": list(v.grid), "size": list(v.picture.size), "label": v.label}
                for v in turn.views]}
        return out


def _restored_once(cache) -> bool:
    """Every restored deferred row is in the cache exactly once (what the completion barrier promises)."""
    for _ in range(100):
        try:
            restored = cache.restored_sources().tolist() if cache is not None else []
        except (IndexError, RuntimeError):  # read while a forward appends rows; read again
            time.sleep(0.001)
            continue
        return len(restored) == len(set(restored))
    return True


def _compare_frame(rows):
    import pandas as pd

    return pd.DataFrame(rows, columns=COMPARE_HEADERS)


def _close_session(session) -> None:
    if isinstance(session, Session):
        session.close()


# ---- the four modes side by side ----------------------------------------------------------------

COMPARE_MODES = ("full", "hard", "post_answer", "raincheck")
COMPARE_HEADERS = ["mode", "answer", "follow-up", "T1 (ms)", "TPOT (ms)", "restored during answer",
                   "restored after it", "dropped"]
COMPARE_PICTURE_WIDTH = 320
_WARM: set = set()  # (model, settings) pairs whose one-time costs (CUDA graph capture, ...) are paid
_WARM_LOCK = threading.Lock()


@dataclass
class ModeRun:
    """One mode's run of the comparison: its map, answer(s), scores and timings."""

    mode: str
    answer: str
    score: str  # against the reference read off the grid ("18/20 facts right", "right"), or why there is none
    reference: str | None
    ttft: float
    tpot: float
    during: int
    after: int
    dropped: int
    picture: object
    follow_up: str | None = None
    follow_up_score: str | None = None
    follow_up_reference: str | None = None

    def row(self) -> list[str]:
        ms = ["–" if math.isnan(t) else f"{t * 1e3:.1f}" for t in (self.ttft, self.tpot)]
        return [self.mode, self.score, self.follow_up_score or "–", *ms, str(self.during), str(self.after),
                str(self.dropped)]

    def markdown(self) -> str:
        ms = ["–" if math.isnan(t) else f"{t * 1e3:.1f} ms" for t in (self.ttft, self.tpot)]
        def said(answer, score, reference):
            return (f"> {answer or '*(empty answer)*'}\n\n**{score}**"
                    + (f" · reference: {reference}" if reference is not None else ""))

        text = f"**{self.mode}** · T1 {ms[0]} · TPOT {ms[1]}\n\n{said(self.answer, self.score, self.reference)}"
        if self.follow_up is not None:
            text += "\n\nFollow-up:\n\n" + said(self.follow_up, self.follow_up_score, self.follow_up_reference)
        return text


def _score(cells, question: str, answer: str) -> tuple[str, str | None]:
    """``(score, reference answer or None)`` for an answer to ``question`` about the grid ``cells``."""
    reference = glyph_reference(cells, question)
    if reference is not None:
        return judge(reference, answer), reference.answer
    missing = missing_from_grid(cells, question)
    return (f"no reference: {missing}" if missing else "no reference (not a glyph-grid question)"), None


def compare_modes(loaded: LoadedModel, path: str, question: str, follow_up: str, settings: Settings,
                  max_new_tokens: int = 64, limits: MediaLimits = MediaLimits()):
    """Run ``question`` (then ``follow_up``, if any) on the image or video at ``path`` in each of
    `COMPARE_MODES`, one fresh `Conversation` each; yields a `ModeRun` per mode, in order.

    Every mode gets the same settings, so ``hard``, ``post_answer`` and ``raincheck`` select the
    same tokens. A mode's map shows where each patch ended up once its restoration was done:
    prefilled first, restored during the answer, restored after it, or dropped. Before the first
    comparison of a model and settings, a short unshown pass of each mode pays the one-time costs
    (the CUDA fast path captures its graphs on first use), so that T1 and TPOT compare the modes.
    Raises ValueError (a message for the visitor) for a file the model cannot take.
    """
    from raincheck_hf import Conversation

    if not str(question or "").strip():
        raise ValueError("Type a question to compare the modes on.")
    if not path:
        raise ValueError("Choose an image (or click the example) to compare the modes on.")
    prepared = prepare_turn([path], loaded.processor, limits=limits)
    if prepared.problems:
        raise ValueError(" ".join(prepared.problems))
    asked, follow = question.strip(), str(follow_up or "").strip() or None
    if loaded.bundled:
        asked, follow = asked.lower(), follow.lower() if follow else None
    single = len(prepared.images) == 1 and not prepared.videos
    cells = read_glyph_grid(prepared.images[0]) if single else None
    config = loaded.model.config
    vision_ids = [getattr(config, name, None) for name in
                  ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")]
    kwargs = {"suppress_tokens": [i for i in vision_ids if i is not None]}
    media = {"images": prepared.images, "videos": prepared.videos, "video_fps": prepared.video_fps}
    with _WARM_LOCK:
        warm = (loaded.name, replace(settings, mode="raincheck")) in _WARM
        _WARM.add((loaded.name, replace(settings, mode="raincheck")))
    if not warm:
        for mode in COMPARE_MODES:
            with Conversation(loaded.model, loaded.processor, replace(settings, mode=mode).config(),
                              background=False) as conversation:
                conversation.ask(asked, max_new_tokens=settings.decode_guard + 2, **media, **kwargs)
                conversation.complete()
    for mode in COMPARE_MODES:
        with Conversation(loaded.model, loaded.processor, replace(settings, mode=mode).config(),
                          background=False) as conversation:
            result = conversation.ask(asked, max_new_tokens=int(max_new_tokens), **media, **kwargs)
            conversation.complete()  # what post_answer and raincheck restore after the answer
            turn = VisualTurn(1, prepared.views, 0)
            turn.use_trace(result.trace)
            turn.locate(conversation.cache, config.image_token_id, config.video_token_id)
            states = turn.states(live_status(conversation.cache))
            picture = draw_picture(turn.views, states, width=COMPARE_PICTURE_WIDTH, max_height=260)
            run = ModeRun(mode, result.text, *_score(cells, asked, result.text), result.time_to_first_token,
                          result.time_per_output_token, result.restored_during_answer, result.restored_after_answer,
                          len(result.trace.dropped), picture)
            if follow:
                second = conversation.ask(follow, max_new_tokens=int(max_new_tokens), **kwargs)
                run.follow_up = second.text
                run.follow_up_score, run.follow_up_reference = _score(cells, follow, second.text)
        yield run


def small_model_note(loaded: LoadedModel) -> str:
    """Why T1 need not favour the pruned modes with a small model on a CPU (said under the comparison)."""
    if not (loaded.bundled or loaded.is_tiny) or getattr(loaded.model.device, "type", "cpu") != "cpu":
        return ""
    return ("\n\n*Why `full` can have the fastest first token here: with a model this small on a CPU, the first "
            "token takes about as long in every mode. Most of it is work every mode does; prefilling 30% of the "
            "image instead of all of it saves a few milliseconds, and selecting that 30% costs about as much, so "
            "one run's T1 can put any mode first. The time saved grows with the model and the image: for "
            "Qwen3-VL-8B on a GPU, `raincheck`'s first token comes 18% sooner than `full`'s (README.md, "
            "Benchmarks).*")


# ---- examples -----------------------------------------------------------------------------------

GLYPH_EXAMPLE_DIALOGUES = (0, 1)  # dev-split dialogues: a list question first, then a fact question first


def make_glyph_examples(folder: str) -> list[tuple[str, str, str | None]]:
    """``(label, question, file or None)``: dev-split glyph grids with their benchmark questions, each
    grid's first question (with the file) followed by its first follow-up (without)."""
    from raincheck_hf.quality.glyphs import benchmark_split

    dialogues = benchmark_split("dev", limit=max(GLYPH_EXAMPLE_DIALOGUES) + 1)
    samples = []
    for number, index in enumerate(GLYPH_EXAMPLE_DIALOGUES, 1):
        d = dialogues[index]
        path = os.path.join(folder, f"glyphs-{d.uid}.png")
        d.image().save(path)
        first = "list question" if d.turns[0].kind == "list" else "one fact"
        samples.append((f"Grid {number} ({d.grid}×{d.grid}): {first}", d.turns[0].question, path))
        samples.append((f"Grid {number}: follow-up", d.turns[1].question, None))
    return samples


def make_examples(folder: str) -> dict:
    """Example files drawn with `raincheck_hf.tiny`'s drawers: two images and a short H.264 video."""
    import numpy as np

    from raincheck_hf.tiny import draw_test_image, draw_test_video

    paths = {"blocks": os.path.join(folder, "blocks.png"), "tall": os.path.join(folder, "tall.png")}
    draw_test_image(384, 288, seed=0).save(paths["blocks"])
    draw_test_image(224, 320, seed=3).save(paths["tall"])
    try:
        import av
    except ImportError:  # no video example (and no video decoding) without PyAV: pip install av
        return paths
    paths["video"] = os.path.join(folder, "clip.mp4")
    frames = draw_test_video(num_frames=8, width=256, height=192, seed=4).permute(0, 2, 3, 1).numpy()
    with av.open(paths["video"], mode="w") as container:
        stream = container.add_stream("libx264", rate=2)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for array in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(array), format="rgb24")))
        container.mux(stream.encode())
    return paths


# ---- the app ------------------------------------------------------------------------------------

def _chat_textbox_class():
    import gradio as gr

    class ChatTextbox(gr.MultimodalTextbox):
        """The file picker offers images and videos; the server reads every file itself, so that a
        wrong one gets an explanation in the chat rather than a bare "invalid file type" toast."""

        def get_block_name(self) -> str:
            return "multimodaltextbox"

        def preprocess(self, payload):
            if payload is None:
                return None
            return {"text": payload.text, "files": [f.path for f in payload.files]}

    return ChatTextbox


def build_demo(model_id: str | None = None, *, mode: str = "raincheck", selector: str | None = None,
               retention: float = 0.3, chunk_size: int = 31, decode_guard: int = 16, max_new_tokens: int = 64,
               slow_motion_ms: int = 0, max_video_frames: int = MAX_VIDEO_FRAMES, concurrency: int = 4,
               preload: bool = True, refresh_every: float = 0.25, media_limits: MediaLimits = MediaLimits()):
    """The Gradio app, not launched. ``model_id=None`` is the bundled glyph Qwen3-VL (``qwen3_vl``).

    The keyword arguments are the controls' starting values. With ``preload`` the model is loaded
    now; one that cannot be loaded falls back to the bundled default (the tiny model if even that
    is missing), with the error shown on the page. With a bundled model first, the examples are
    glyph grids with benchmark questions; otherwise generated pictures and a clip.
    """
    import gradio as gr

    import raincheck_hf

    start = Settings(model_key(model_id), mode, selector or raincheck_hf.RaincheckConfig().selector, retention,
                     chunk_size, decode_guard)
    start.config()  # bad settings fail here, naming the setting
    first_note = None
    loaded = None
    if preload:  # the model asked for; failing that, the bundled default; failing that, the tiny one
        problems = []
        for candidate in dict.fromkeys([start.model, DEFAULT_MODEL, TINY_MODEL]):
            try:
                loaded = load_model(candidate)
                break
            except ModelLoadError as error:
                problems.append(error)
        if problems:
            fallback = "the tiny model (random weights)" if loaded.is_tiny else f"the bundled model {loaded.name}"
            print(f"[raincheck demo] {str(problems[0]).replace('**', '')} Falling back to {fallback}.",
                  file=sys.stderr)
            first_note = f"**Problem:** {problems[0]}"
        start = replace(start, model=loaded.name)
    if loaded is not None:
        model_text = loaded.note
    elif start.model == TINY_MODEL:
        model_text = TINY_NOTE
    else:
        model_text = f"Model: **{BUNDLED_LABELS.get(start.model, start.model)}**."
    if first_note:
        model_text = f"{first_note}\n\n{model_text}"

    folder = tempfile.mkdtemp(prefix="raincheck-demo-")
    atexit.register(shutil.rmtree, folder, True)
    glyph_examples = start.model in BUNDLED_LABELS
    if glyph_examples:
        samples = make_glyph_examples(folder)
    else:
        examples = make_examples(folder)
        samples = [("Image: first question", "What is in this image?", examples["blocks"]),
                   ("Image: follow-up", "Which colour is the block in the top-left corner?", None),
                   ("Video: first question", "What happens in the video?", examples.get("video")),
                   ("Video: follow-up", "What changes between the first and the last frame?", None),
                   ("Tall image: one sentence", "Describe the picture in one sentence.", examples["tall"])]
        samples = [s for s in samples if not s[0].startswith("Video") or "video" in examples]
    # the comparison's starting image and questions: the first example and its follow-up
    compare_default = (samples[0][2], samples[0][1], samples[1][1])
    ChatTextbox = _chat_textbox_class()

    # sessions by Gradio's session hash, so that closing the tab closes its conversation right away
    # (the gr.State's delete_callback is the backstop: Gradio drops a closed tab's state only later)
    sessions: dict[str, Session] = {}

    def new_session(request=None):
        session = Session(start, max_video_frames=max_video_frames, limits=media_limits)
        if request is not None and getattr(request, "session_hash", None):
            sessions[request.session_hash] = session
        return session

    def end_session(request: gr.Request):
        session = sessions.pop(getattr(request, "session_hash", None), None)
        if session is not None:
            session.close()

    with gr.Blocks(title="Raincheck demo", analytics_enabled=False) as demo:
        state = gr.State(None, delete_callback=_close_session)  # a Session per browser session
        gr.Markdown(
            "# Raincheck: deferred multimodal prefill\n"
            "The model reads only some of an image's tokens before it starts to answer (*prefilled first*). "
            "The rest are **deferred**: restored into the cache while it answers and in idle time afterwards, "
            "so a follow-up question sees the whole image. Ask about an image or a video, then ask a follow-up; "
            "or open *Compare modes* to run one question through `full`, `hard`, `post_answer` and `raincheck` "
            "side by side. How it works: `docs/method.md`."
            + (" With the bundled glyph model, click a grid's first question below, then its follow-up."
               if glyph_examples else "")
        )
        model_note = gr.Markdown(model_text, elem_id="rc-model-note")
        with gr.Tabs(elem_id="rc-tabs"):
            with gr.Tab("Chat", id="chat", elem_id="rc-tab-chat"):
                with gr.Row(equal_height=False):
                    with gr.Column(scale=5, min_width=360):
                        chatbot = gr.Chatbot(label="Chat", elem_id="rc-chat", height=500, buttons=["copy"],
                                             group_consecutive_messages=False,
                                             placeholder=("Click an example below (a glyph grid and a benchmark "
                                                          "question), or attach a grid and ask about it."
                                                          if glyph_examples else
                                                          "Attach an image or a video (or click an example below) "
                                                          "and ask about it."))
                        # any file type: the server reads each file itself and explains in the chat why one
                        # that is not an image or a video cannot be used (the browser would only show a toast)
                        textbox = ChatTextbox(file_types=None, file_count="multiple", sources=["upload"],
                                              placeholder=("e.g. what is the background of the red g3 ?"
                                                           if glyph_examples else "Ask about an image or a video…"),
                                              show_label=False, elem_id="rc-input", autofocus=True)
                        examples = gr.Examples(examples=[[{"text": text, "files": [path] if path else []}]
                                              for _, text, path in samples],
                                    inputs=[textbox], example_labels=[label for label, _, _ in samples],
                                    label="Examples (a click sends one): a first question, then its follow-up")
                    with gr.Column(scale=4, min_width=320):
                        gr.Markdown("**What the model has in its cache**, patch by patch")
                        picture = gr.Image(label="What the model has in its cache", show_label=False, type="pil",
                                           format="png", interactive=False, elem_id="rc-picture",
                                           buttons=["fullscreen"], placeholder="The patches of your image appear here.")
                        caption = gr.Markdown(Session(start).caption(None), elem_id="rc-caption")
                        scrub = gr.Slider(0, 1, value=0, step=1, label="Timeline", interactive=False,
                                          elem_id="rc-scrub",
                                          info="drag to see which patch came back at which generated token")
                        strip = gr.Image(show_label=False, type="pil", format="png", interactive=False,
                                         elem_id="rc-timeline", buttons=[], height=96,
                                         placeholder="The restoration timeline appears when a turn's is done.")
                        with gr.Row():
                            scrub_text = gr.Markdown(TIMELINE_WAITING, elem_id="rc-scrub-text")
                            replay = gr.Button("▶ Replay", elem_id="rc-replay", scale=0, min_width=110, size="sm")
                figures = gr.Dataframe(headers=FIGURE_HEADERS, label="Per turn: timings and restoration",
                                       interactive=False, elem_id="rc-figures")
            with gr.Tab("Compare modes", id="compare", elem_id="rc-tab-compare"):
                gr.Markdown(
                    "One question on one image through each mode, with the settings below (model, selector, "
                    "retention, chunk size, decode guard, answer length; the *Mode* setting is what this varies). "
                    "`hard`, `post_answer` and `raincheck` prefill the same selected patches first. Each map shows "
                    "where every patch ended up: prefilled first (blue), restored during the answer (green), after "
                    "it (violet), dropped (red). T1 is the time to the first token, TPOT the time per output token "
                    "after it, measured here, one run each.")
                with gr.Row(equal_height=False):
                    compare_image = gr.Image(value=compare_default[0], type="filepath", label="Image",
                                             sources=["upload"], height=260, elem_id="rc-cmp-image")
                    with gr.Column():
                        compare_question = gr.Textbox(compare_default[1], label="Question", elem_id="rc-cmp-question")
                        compare_follow = gr.Textbox(compare_default[2], label="Follow-up (optional)",
                                                    elem_id="rc-cmp-follow-up",
                                                    info="asked next in each mode, after its restoration")
                        compare_button = gr.Button("Compare the four modes", variant="primary", elem_id="rc-cmp-run")
                        compare_note = gr.Markdown(elem_id="rc-cmp-note")
                compare_table = gr.Dataframe(headers=COMPARE_HEADERS, label="Side by side", interactive=False,
                                             elem_id="rc-cmp-table", wrap=True)
                compare_pictures, compare_texts = {}, {}
                with gr.Row(equal_height=False):
                    for name in COMPARE_MODES:
                        with gr.Column(min_width=220):
                            compare_pictures[name] = gr.Image(label=name, type="pil", format="png",
                                                              interactive=False, elem_id=f"rc-cmp-map-{name}",
                                                              buttons=["fullscreen"])
                            compare_texts[name] = gr.Markdown(f"**{name}**", elem_id=f"rc-cmp-text-{name}")
        with gr.Accordion("Settings (changing one starts a new conversation)", open=True):
            with gr.Row():
                model_box = gr.Dropdown(model_choices(start.model), value=start.model, allow_custom_value=True,
                                        label="Model", elem_id="rc-model",
                                        info="a bundled glyph model (trained on the glyph task only), the tiny "
                                             "random one, a local checkpoint folder or a Hub id")
                mode_box = gr.Radio(list(MODES_SHOWN), value=start.mode, label="Mode", elem_id="rc-mode",
                                    info="raincheck: restore during and after the answer · post_answer: after it · "
                                         "hard: drop the deferred tokens · full: no pruning")
                selector_box = gr.Dropdown(raincheck_hf.available_selectors(), value=start.selector, label="Selector",
                                           info="which tokens are prefilled first", elem_id="rc-selector")
            with gr.Row():
                retention_box = gr.Slider(0, 1, value=start.retention, step=0.05, label="Retention",
                                          info="fraction prefilled first", elem_id="rc-retention")
                chunk_box = gr.Slider(1, 128, value=start.chunk_size, step=1, label="Chunk size",
                                      info="deferred tokens restored per step", elem_id="rc-chunk")
                guard_box = gr.Slider(0, 64, value=start.decode_guard, step=1, label="Decode guard",
                                      info="tokens answered before restoration starts", elem_id="rc-guard")
            with gr.Row():
                max_new_box = gr.Slider(1, 512, value=max_new_tokens, step=1, label="Answer length",
                                        info="max new tokens (does not restart)", elem_id="rc-max-new")
                slow_box = gr.Slider(0, 200, value=slow_motion_ms, step=5, label="Slow motion (ms per token)",
                                     info="a pause per generated token, to watch the picture (does not restart)",
                                     elem_id="rc-slow")
                new_button = gr.Button("New conversation", elem_id="rc-new", scale=0, min_width=180)
        with gr.Accordion("Live trace (JSON)", open=False):
            status = gr.JSON(label="Session state", elem_id="rc-status")
        timer = gr.Timer(refresh_every, active=False)

        def render(session: Session, step: Step, tick: bool = False) -> dict:
            """The updates for one `Step` (the picture only when it changed; on a timer ``tick``, the caption
            only when it changed too, so that a tick does not undo the timeline's caption while scrubbing)."""
            image, counts, changed = session.picture_and_counts(draw=bool(step.picture), force=step.picture == "force")
            out = {chatbot: list(session.history), state: session}
            if step.token:  # while an answer streams: what changed, and the JSON panel only when the turn ends
                for component, value in ((caption, session.caption(counts)), (figures, session.figures())):
                    key = value.to_csv() if hasattr(value, "to_csv") else value
                    if session._streamed.get(component._id) != key:
                        session._streamed[component._id] = key
                        out[component] = value
            else:
                session._streamed = {}
                live = session.caption(counts)
                if not (tick and live == session._live_caption):
                    out[caption] = live
                session._live_caption = live
                out.update({figures: session.figures(), status: session.status()})
            if step.picture and changed:
                out[picture] = image
            if step.timer is not None:
                out[timer] = gr.Timer(active=step.timer)
            if step.textbox == "lock":
                out[textbox] = gr.update(value=None, interactive=False)
            elif step.textbox == "clear":
                out[textbox] = gr.update(value=None, interactive=True)
            elif step.textbox == "keep_files":
                out[textbox] = gr.update(value={"text": "", "files": list(step.files)}, interactive=True)
            if step.model_choice is not None:
                out[model_box] = gr.update(value=step.model_choice, choices=model_choices(step.model_choice,
                                                                                           start.model))
            if step.model_note is not None:
                out[model_note] = step.model_note
            out.update(render_timeline(session))
            return out

        def render_text(session: Session) -> dict:
            """A streamed answer's text only (between the full updates that `pace` spaces out)."""
            return {chatbot: list(session.history), state: session}

        def render_timeline(session: Session) -> dict:
            """The timeline's controls, when the latest turn's timeline appeared or went away."""
            turn, steps = session.timeline()
            signature = (id(turn), len(steps)) if steps else None
            if signature == session._timeline_shown:
                return {}
            session._timeline_shown = signature
            if not steps:
                return {scrub: gr.update(value=0, maximum=1, interactive=False), strip: None,
                        scrub_text: TIMELINE_WAITING}
            _, strip_image, text, upto, _ = session.timeline_view()
            return {scrub: gr.update(value=upto, maximum=max(1, upto), interactive=upto > 0), strip: strip_image,
                    scrub_text: text}

        def chat(message, model, mode, selector, retention, chunk_size, decode_guard, max_new_tokens,
                 slow_motion_ms, session, request: gr.Request):
            session = session or new_session(request)
            if not session.lock.acquire(blocking=False):
                session.note(f"Still {session.busy or 'answering the previous question'}; send this one when it "
                             "is done.")
                yield render(session, Step(picture=False))
                return
            turn = None
            try:
                session.busy = "answering the previous question"
                wanted = Settings.from_controls(model, mode, selector, retention, chunk_size, decode_guard)
                turn = session.turn(message, wanted, max_new_tokens, slow_motion_ms)
                for what, step in pace(turn):
                    yield render(session, step) if what == "all" else render_text(session)
            finally:
                if turn is not None:
                    turn.close()  # a stopped answer is settled before the session takes the next question
                session.answering = False
                session.live = None
                session.busy = None
                session.lock.release()

        def change_settings(model, mode, selector, retention, chunk_size, decode_guard, session,
                            request: gr.Request):
            session = session or new_session(request)
            wanted = Settings.from_controls(model, mode, selector, retention, chunk_size, decode_guard)
            session.requested = wanted  # several changes while waiting: the latest wins
            if not session.lock.acquire(blocking=False):
                if session.answering:
                    session.note(f"*Settings changed ({session.settings.changes(wanted) or 'back as they were'}) "
                                 "while the model answers: they apply when this answer is done, with a new "
                                 "conversation.*")
                    yield render(session, Step(picture=False))
                session.lock.acquire()  # waits for the answer (or a model load) in progress
            try:
                wanted = session.requested or wanted
                session.requested = None
                loading = session.loading_step(wanted)
                if loading is not None:
                    yield render(session, loading)
                step = session.apply(wanted)
                yield render(session, step or Step(picture=False))
            finally:
                session.busy = None
                session.lock.release()

        def new_conversation(session, request: gr.Request):
            session = session or new_session(request)
            with session.lock:
                session.restart()
                session.note(f"*New conversation {session.number}.*")
            return render(session, Step(picture="force", timer=False))

        def refresh(session):
            if session is None:
                return {timer: gr.Timer(active=False)}
            if session.answering:  # the answer's stream draws the picture meanwhile
                return {state: session}  # (an empty dict would read as one output value)
            return render(session, Step(timer=session.pending > 0), tick=True)

        def scrub_to(value, session):
            """The picture and the strip at one step of the latest turn's timeline."""
            if session is None:
                return {scrub_text: TIMELINE_WAITING}
            image, strip_image, text, upto, steps = session.timeline_view(value)
            if not steps:
                return {scrub_text: TIMELINE_WAITING}
            # the live picture is left as drawn (``session._drawn``): a timer tick redraws it only when
            # the cache changes, so that it does not undo the scrubbing; the caption says which step it shows
            return {picture: image, strip: strip_image, scrub_text: text, caption: session.timeline_caption(upto)}

        def replay_timeline(session):
            """Step through the latest turn's timeline (at most ~120 frames), then stay at its end."""
            _, steps = session.timeline() if session is not None else (None, None)
            if not steps:
                yield {scrub_text: TIMELINE_WAITING}
                return
            stride = max(1, math.ceil(len(steps) / 120))
            frames = list(range(0, len(steps), stride))
            if frames[-1] != len(steps) - 1:
                frames.append(len(steps) - 1)
            for k in frames:
                update = scrub_to(k, session)
                update[scrub] = gr.update(value=k)
                yield update
                time.sleep(REPLAY_FRAME_S)

        def compare(path, question, follow_up, model, mode, selector, retention, chunk_size, decode_guard,
                    max_new_tokens, session, request: gr.Request):
            session = session or new_session(request)
            blank = {compare_table: None, **{p: None for p in compare_pictures.values()},
                     **{t: f"**{name}**" for name, t in compare_texts.items()}, state: session}
            if not session.lock.acquire(blocking=False):
                yield {**blank, compare_note: f"*Still {session.busy or 'busy'}: compare when it is done.*"}
                return
            try:
                wanted = Settings.from_controls(model, mode, selector, retention, chunk_size, decode_guard)
                try:
                    wanted.config()
                    if not is_loaded(wanted.model):
                        session.busy = f"loading model {wanted.model}"
                        yield {**blank, compare_note: f"*Loading model **{wanted.model}**…*"}
                    loaded = load_model(wanted.model)
                except (ValueError, ModelLoadError) as error:
                    yield {**blank, compare_note: f"**Problem:** {error}"}
                    return
                session.busy = "comparing the modes"
                rows, shown_so_far = [], dict(blank)
                yield {**blank, compare_note: f"*Running `{COMPARE_MODES[0]}` (1 of {len(COMPARE_MODES)})…*"}
                try:
                    for i, run in enumerate(compare_modes(loaded, path, question, follow_up, wanted, max_new_tokens,
                                                                       media_limits)):
                        rows.append(run.row())
                        following = (f"*Running `{COMPARE_MODES[i + 1]}` ({i + 2} of {len(COMPARE_MODES)})…*"
                                     if i + 1 < len(COMPARE_MODES) else
                                     f"*Done: {loaded.name}, selector `{wanted.selector}`, retention "
                                     f"{wanted.retention:g}, chunk size {wanted.chunk_size}, decode guard "
                                     f"{wanted.decode_guard}.*" + small_model_note(loaded))
                        shown_so_far.update({compare_pictures[run.mode]: run.picture,
                                             compare_texts[run.mode]: run.markdown()})
                        yield {**shown_so_far, compare_table: _compare_frame(rows), compare_note: following}
                except ValueError as error:
                    yield {**blank, compare_note: f"**Problem:** {error}"}
            finally:
                session.busy = None
                session.lock.release()

        controls = [model_box, mode_box, selector_box, retention_box, chunk_box, guard_box]
        shown = [chatbot, picture, caption, figures, status, timer, model_box, model_note, state, scrub, strip,
                 scrub_text]
        textbox.submit(chat, [textbox, *controls, max_new_box, slow_box, state], shown + [textbox], api_name="chat",
                       concurrency_limit=concurrency, show_progress="hidden")
        # clicking an example sends it, as the page says (Gradio's examples only fill the box)
        examples.load_input_event.then(chat, [textbox, *controls, max_new_box, slow_box, state], shown + [textbox],
                                       api_visibility="private", concurrency_limit=concurrency,
                                       show_progress="hidden")
        for control in (model_box, mode_box, selector_box):
            control.input(change_settings, controls + [state], shown, api_visibility="private", show_progress="hidden",
                          concurrency_limit=concurrency, trigger_mode="always_last")
        for slider in (retention_box, chunk_box, guard_box):
            slider.release(change_settings, controls + [state], shown, api_visibility="private",
                           show_progress="hidden", concurrency_limit=concurrency, trigger_mode="always_last")
        new_button.click(new_conversation, [state], shown, api_name="new_conversation", show_progress="hidden")
        timer.tick(refresh, [state], shown, api_name="status", concurrency_limit=None, show_progress="hidden")
        scrub.input(scrub_to, [scrub, state], [picture, strip, scrub_text, caption], api_name="timeline",
                    trigger_mode="always_last", concurrency_limit=None, show_progress="hidden")
        replay.click(replay_timeline, [state], [picture, strip, scrub_text, caption, scrub], api_visibility="private",
                     concurrency_limit=None, show_progress="hidden")
        compare_button.click(
            compare, [compare_image, compare_question, compare_follow, *controls, max_new_box, state],
            [compare_table, *compare_pictures.values(), *compare_texts.values(), compare_note, state],
            api_name="compare", concurrency_limit=concurrency, show_progress="hidden")
        demo.unload(end_session)
    return demo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo.app", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, metavar="NAME_OR_PATH",
                        help="qwen3_vl (default: the bundled glyph Qwen3-VL) | qwen3_5 (the bundled glyph Qwen3.5) | "
                             "tiny (random weights) | a local checkpoint folder or Hub id (demo/README.md, "
                             "\"A real checkpoint\")")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=None, help="port (default 7860, or the next free one)")
    parser.add_argument("--share", action="store_true", help="also open a public gradio.live link (off by default)")
    parser.add_argument("--mode", default="raincheck", choices=MODES_SHOWN,
                        help="the chat's starting mode (default raincheck; the page can change it)")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                        help="the starting answer length (default 64; the page can change it)")
    parser.add_argument("--slow-motion-ms", type=int, default=0, metavar="MS",
                        help="the starting pause per generated token, to watch the picture fill in (default 0)")
    args = parser.parse_args(argv)
    # checked before the model loads
    if not 1 <= args.max_new_tokens <= 512:
        parser.error(f"--max-new-tokens must be in [1, 512] (the page's slider), got {args.max_new_tokens}")
    if not 0 <= args.slow_motion_ms <= 200:
        parser.error(f"--slow-motion-ms must be in [0, 200] (the page's slider), got {args.slow_motion_ms}")
    if args.port is not None and not 0 < args.port < 65536:
        parser.error(f"--port must be in [1, 65535], got {args.port}")
    demo = build_demo(args.model, mode=args.mode, max_new_tokens=args.max_new_tokens,
                      slow_motion_ms=args.slow_motion_ms)
    # quiet: Gradio's own banner would say "set `share=True` in `launch()`", where this command's flag is --share
    demo.launch(server_name=args.host, server_port=args.port, share=bool(args.share), quiet=True,
                prevent_thread_lock=True, max_file_size=MediaLimits().max_file_bytes)
    where = f"[raincheck demo] running at {demo.local_url}"
    if demo.share_url:
        where += f" and at the public link {demo.share_url}"
    elif args.share:
        where += " (no public link could be made: see the message above)"
    else:
        where += (" (this machine only)" if args.host in ("127.0.0.1", "localhost", "::1") else "") + \
            "; --share adds a public gradio.live link"
    print(where, file=sys.stderr, flush=True)
    demo.block_thread()
    return 0


if __name__ == "__main__":
    sys.exit(main())
