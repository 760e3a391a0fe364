"""The chat-completions request as pydantic models: types, ranges and OpenAPI (``/docs``) come from here.

OpenAI's fields this server implements, vLLM's ``min_tokens`` / ``top_k``, and Raincheck's own
``raincheck`` object. Validation is strict (JSON types as written: ``"0.5"`` is not a number, ``1.0``
is not an integer) and unknown fields are refused, so that nothing a client sends is silently
ignored. `validation_error` turns pydantic's errors into one `APIError` naming the parameter
(``messages[0].content[1].image_url.url``) and the value. Checks that need the server (the model's
id, its vocabulary, the media, the limits) are `protocol.parse_chat_request`'s.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator

from ..configuration import MODES

MAX_STOP = 4
MAX_VIDEO_FRAMES = 64  # per video: a video file is sampled down to this many frames, a frame list may have no more
MAX_LOGIT_BIAS = 1024
MAX_TOKENS = 1 << 20


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# ---- content parts --------------------------------------------------------------------------------

class ImageURL(_Strict):
    url: str = Field(description="`data:image/...;base64,...`, or `file://...` under the server's --media-root; "
                                 "http(s) URLs are refused (the server fetches nothing).")
    detail: Literal["auto", "high"] | None = Field(
        None, description="OpenAI's detail: `auto` or `high`, which are the same here (an image is read at its own "
                          "resolution, within the processor's and the server's pixel limits); `low` is refused.")


class VideoURL(_Strict):
    url: str = Field(description="A video file: `data:video/...;base64,...` or `file://...` under --media-root; "
                                 f"decoded with PyAV, at most {MAX_VIDEO_FRAMES} evenly spaced frames.")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL | str = Field(description="`{\"url\": ...}` (OpenAI) or the URL itself.")


class VideoURLPart(_Strict):
    type: Literal["video_url"]
    video_url: VideoURL | str = Field(description="`{\"url\": ...}` or the URL itself (vLLM's video part).")


class VideoFramesPart(_Strict):
    type: Literal["video"]
    video: list[ImageURL | str] = Field(min_length=1, max_length=MAX_VIDEO_FRAMES,
                                        description="The frames as image URLs (each as in `image_url`), "
                                                    "all of one size.")
    fps: float = Field(2.0, gt=0, le=240, description="Frames per second of the given frames.")


def _tag(key: str):
    def pick(value: Any):
        return f"{key}={value.get(key)}" if isinstance(value, dict) and isinstance(value.get(key), str) else None
    return pick


def _union(key: str, members: dict[str, type], what: str):
    """A union told apart by ``key``; tags are ``key=value``, never field names, so `_param` drops them."""
    allowed = ", ".join(repr(v) for v in members)
    return Annotated[
        Union[tuple(Annotated[cls, Tag(f"{key}={value}")] for value, cls in members.items())],
        Discriminator(_tag(key), custom_error_type=f"invalid_{key}",
                      custom_error_message=f"must be an object whose {key} is one of {allowed} ({what})"),
    ]


UserPart = _union("type", {"text": TextPart, "image_url": ImagePart, "video_url": VideoURLPart,
                           "video": VideoFramesPart}, "a user message's content part")


# ---- messages -------------------------------------------------------------------------------------

class SystemMessage(_Strict):
    role: Literal["system", "developer"] = Field(description="`developer` is read as `system`.")
    content: str | list[TextPart]
    name: str | None = Field(None, description="Passed to the chat template with the message.")


class UserMessage(_Strict):
    role: Literal["user"]
    content: str | list[UserPart] = Field(description="Text, or text, image and video parts.")
    name: str | None = Field(None, description="Passed to the chat template with the message.")


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] = Field(
        description="An earlier answer, as the server sent it (an edited one starts a new conversation).")
    name: str | None = Field(None, description="Passed to the chat template with the message.")
    # what a client gets back in `choices[0].message` and may send back as is: accepted when empty
    refusal: None = None
    tool_calls: Annotated[list, Field(max_length=0)] | None = None
    function_call: None = None
    audio: None = None
    annotations: Annotated[list, Field(max_length=0)] | None = None


Message = _union("role", {"system": SystemMessage, "developer": SystemMessage, "user": UserMessage,
                          "assistant": AssistantMessage}, "a message; the last one must be the user's")


# ---- the request ----------------------------------------------------------------------------------

class RaincheckSettings(_Strict):
    """Raincheck's settings for this request; each overrides the server's default (README, Settings)."""

    mode: Literal[MODES] | None = Field(None, description="full | hard | post_answer | raincheck | serial.")
    retention: float | None = Field(None, description="Fraction of each image / video slice prefilled first, "
                                                      "in [0, 1] (0: all deferred, 1: none).")
    chunk_size: int | Literal["auto"] | None = Field(
        None, description="Deferred tokens prefilled per decode step (>= 1), or `auto` (sized from measured step "
                          "costs within `tpot_slack`).")
    decode_guard: int | None = Field(None, description="No chunk before this many tokens are generated (>= 0).")
    chunk_every: int | None = Field(None, description="With a fixed `chunk_size`, a chunk on every k-th decode step "
                                                      "from the guard on (>= 1; 1: every step).")
    selector: str | None = Field(None, description="A registered selector's name (e.g. `mmtok`).")
    tpot_slack: float | None = Field(None, description="With `chunk_size: auto`, how much the mean time per token "
                                                       "may exceed plain decode steps' (>= 0).")


class StreamOptions(_Strict):
    include_usage: bool | None = Field(None, description="A last chunk with `usage` before `[DONE]`.")


class ResponseFormat(_Strict):
    type: Literal["text"] = Field(description="Only `text`: this server has no structured output.")


def _refused(what: str):
    def check(value):
        if value:
            raise ValueError(f"{what} not supported by this server")
        return value
    return check


class ChatCompletionRequest(_Strict):
    """OpenAI's chat completion request, as this server reads it."""

    model: str | None = Field(None, description="The served model's id (GET /v1/models); omitted: that one.")
    messages: list[Message] = Field(min_length=1, description="The whole dialogue so far (OpenAI's convention); a "
                                    "follow-up that resends it continues the held conversation.")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="Answer length limit (wins "
                                              "over `max_tokens`); the answer also ends at the model's context.")
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="Answer length limit (the older name).")
    min_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS, description="vLLM's extension: no end of answer "
                                   "before this many tokens (at most the answer's limit).")
    temperature: float | None = Field(None, ge=0, le=2, description="0: greedy. Omitted: the model's generation "
                                      "config decides.")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOKENS, description="vLLM's extension; -1 or 0: off.")
    stop: str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)] | None = Field(
        None, description=f"Up to {MAX_STOP} strings; the answer ends before the first one.")
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 63) - 1, description="Sampling with the request's own "
                             "generator: the same seed gives the same answer.")
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=MAX_LOGIT_BIAS)] | \
        None = Field(None, description="Token id (as a string) to a bias in [-100, 100].")
    stream: bool = Field(False, description="Server-sent events (`chat.completion.chunk`, then `[DONE]`).")
    stream_options: StreamOptions | None = None
    n: Literal[1] | None = Field(None, description="Only 1 (one answer per request).")
    frequency_penalty: Literal[0] | None = Field(None, description="Only 0 (not supported otherwise).")
    presence_penalty: Literal[0] | None = Field(None, description="Only 0 (not supported otherwise).")
    response_format: ResponseFormat | None = None
    logprobs: bool | None = Field(None, description="Only false (not supported).")
    top_logprobs: None = Field(None, description="Not supported.")
    tools: list | None = Field(None, description="Not supported (an empty list is accepted).")
    functions: list | None = Field(None, description="Not supported (an empty list is accepted).")
    tool_choice: Literal["none"] | None = Field(None, description="Only `none` (no tools).")
    parallel_tool_calls: bool | None = Field(None, description="Accepted; there are no tools.")
    user: str | None = Field(None, description="The end user's id; written in the server's request log.")
    raincheck: RaincheckSettings | None = Field(None, description="Raincheck's settings for this request "
                                                "(`extra_body={\"raincheck\": {...}}` in the openai client).")

    _tools = field_validator("tools", "functions")(_refused("tools / functions are"))
    _logprobs = field_validator("logprobs")(_refused("logprobs are"))


# ---- pydantic's errors as one OpenAI error ----------------------------------------------------------

FIELD_NAMES = {name for cls in _Strict.__subclasses__() for name in cls.model_fields}


def _param(loc: tuple) -> str:
    """``('messages', 0, 'role=user', 'content', 'list[...]', 1, 'type=image_url', 'image_url', 'ImageURL',
    'url')`` -> ``messages[0].content[1].image_url.url``: union members and tags dropped."""
    out, last = "", None
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        elif last == "logit_bias":  # a key of the object
            out += f"[{item!r}]"
        elif item in FIELD_NAMES:
            out += f".{item}" if out else item
        else:
            continue
        last = item
    return out


def shown(value, limit: int = 80) -> str:
    """A client's value for a message: JSON-like, cut at ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def validation_error(error: ValidationError, status_error):
    """The most specific of pydantic's errors (the deepest parameter; a union's branches at the same depth
    joined with "or"), as ``status_error(message, param)``."""
    errors = error.errors(include_url=False)
    best = max(len(_param(e["loc"])) for e in errors)
    chosen = [e for e in errors if len(_param(e["loc"])) == best]
    param = _param(chosen[0]["loc"])
    chosen = [e for e in chosen if _param(e["loc"]) == param]
    first = chosen[0]
    kind = first["type"]
    if kind in ("invalid_role", "invalid_type"):
        param += "." + kind.split("_", 1)[1]
        value = first["input"].get(kind.split("_", 1)[1]) if isinstance(first["input"], dict) else first["input"]
        return status_error(f"{param}: {first['msg']}; got {shown(value)}.", param)
    if not param and kind in ("model_type", "dict_type"):
        return status_error(f"the request body must be a JSON object, got {shown(first['input'])}.", None)
    if kind == "extra_forbidden":
        name, parent = str(first["loc"][-1]), _param(first["loc"][:-1])
        param = f"{parent}.{name}".lstrip(".") if name.isidentifier() else f"{parent}[{shown(name, 40)}]"
        return status_error(f"{param}: unknown field (this server does not read it; see POST /v1/chat/completions "
                            "at /docs for the fields it does).", param)
    if kind == "missing":
        return status_error(f"{param} is required.", param)
    messages = []
    for e in chosen:
        msg = e["msg"].removeprefix("Value error, ")
        if messages:
            msg = msg.removeprefix("Input should be ")
        if msg not in messages:
            messages.append(msg)
    message = " or ".join(messages)
    return status_error(f"{param or 'the request body'}: {message}; got {shown(first['input'])}.", param or None)
