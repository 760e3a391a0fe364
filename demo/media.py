"""Uploads: the limits a message's files must keep, and what the model will see of them.

Every check that can be made before decoding is (a file's size, an image's pixels from its header, a video's
duration and frame size from its container), so that nothing beyond `MediaLimits` is decoded or sent to the model;
a problem becomes a message for the visitor that names the file and the limit. What passes becomes a
`PreparedTurn`: the images and videos for `Conversation.ask` and a `SegmentView` per image or temporal slice, for
the map (`demo.cache_map`).
"""

import mimetypes
import os
import time
from dataclasses import dataclass, field

import torch

MAX_VIDEO_FRAMES = 16  # longer videos are sampled evenly down to this many frames
DECODE_MAX_SIDE = 896  # video frames are decoded at most this large (processors shrink them further)
OPEN_MAX_SIDE = 4096  # larger images are shrunk on open; the processor shrinks them further anyway


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

