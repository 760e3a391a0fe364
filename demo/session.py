"""A browser session: its settings, its `Conversation`, the chat as shown, and one turn from question to answer.

`Session.turn` answers one message and yields a `Step` (demo.streaming) after every change worth showing; what the
page shows of a session (the map, the caption, the figures, the JSON state) is `demo.panels`. Bad input gets a
message in the chat and leaves the conversation as it was.
"""

import threading
import time
import uuid
from dataclasses import dataclass, fields

from raincheck_hf.__main__ import unknown_words
from raincheck_hf.quality.references import glyph_reference, judge, missing_from_grid, read_glyph_grid

from .cache_map import VisualTurn
from .media import MAX_VIDEO_FRAMES, MediaLimits, prepare_turn
from .models import DEFAULT_MODEL, LoadedModel, ModelLoadError, is_loaded, load_model, model_key, vision_token_ids
from .streaming import Pause, Step

MODES_SHOWN = ("raincheck", "post_answer", "hard", "full")


@dataclass(frozen=True)
class Settings:
    """What starts a new conversation when it changes (everything but answer length and pacing)."""

    model: str = DEFAULT_MODEL
    mode: str = "raincheck"
    selector: str = "uniform"
    retention: float = 0.3
    chunk_size: int = 31
    decode_guard: int = 16  # the library's default is 1; the demo starts later so the map shows each phase

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
        # what the page was last sent (demo.panels and demo.events compare against it, to send only what changed)
        self.drawn = None  # signature of the picture last sent
        self.timeline_shown = None  # signature of the timeline last sent
        self.sent_streaming: dict = {}  # what the page was last sent while an answer streams (component id -> value)
        self.live_caption = None  # the caption of the cache last sent (the timeline's may be shown instead)
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
        self.drawn = None
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
        conversation, prepared = yield from self._prepare(text, files)
        if prepared is None:  # told in the chat; nothing reached the model
            return
        asked = self._asked(text, prepared)
        visual, kwargs, answer = self._begin(conversation, prepared, max_new_tokens, slow_motion_ms)
        yield Step(timer=False, textbox="lock")
        result = yield from self._stream(conversation, asked, prepared, kwargs, visual, answer)
        if result is None:  # the turn failed (told in the chat)
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

    def _prepare(self, text: str, files: list):
        """Check the message and open its files; yields the `Step` that shows a problem. Returns ``(conversation,
        prepared turn)``, or ``(None, None)`` when the message does not go to the model."""
        if not text and not files:
            self.note("The message is empty: type a question (and attach an image or a video if you like).")
            yield Step(picture=False)
            return None, None
        if not text:
            self.note("Add a question to go with your file(s): they are still in the box below.")
            yield Step(picture=False, textbox="keep_files", files=tuple(files))
            return None, None
        try:
            conversation = self.ensure_conversation()
        except (ModelLoadError, ValueError) as error:
            self.history.append({"role": "user", "content": text})
            self.note(f"**Problem:** {error}\n\nChoose another model under *Settings*.")
            yield Step(picture=False, textbox="clear")
            return None, None
        prepared = prepare_turn(files, self.loaded.processor, self.max_video_frames, self.limits)
        for path in files:
            self.history.append({"role": "user", "content": {"path": path}})
        self.history.append({"role": "user", "content": text})
        if prepared.problems:
            self.note("**Problem:** " + "\n\n**Problem:** ".join(prepared.problems)
                      + "\n\nNothing was sent to the model; the conversation is unchanged. Attach a readable "
                        "image or video, or ask without a file.")
            yield Step(picture=False, textbox="clear")
            return None, None
        for note in prepared.notes:
            self.note(note)
        return conversation, prepared

    def _asked(self, text: str, prepared) -> str:
        """The question as the model gets it (the bundled glyph models' vocabulary is lowercase; words they do not
        know are pointed out); a new picture also sets the grid that reference answers are read from."""
        asked = text
        if self.loaded.bundled:
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
        return asked

    def _begin(self, conversation, prepared, max_new_tokens: int, slow_motion_ms: int):
        """Set the turn up: its `VisualTurn` (None without images or videos), ``generate``'s keyword arguments,
        and the answer's own message in the chat (a note added meanwhile, e.g. a settings change, goes after it)."""
        number = len(conversation.turns) + 1
        # the new turn's tokens follow the previous sequences (then the glue and the new prompt)
        start = 0 if conversation.sequences is None else int(conversation.sequences.shape[1])
        visual = VisualTurn(number, prepared.views, start) if prepared.views else None
        if visual is not None:
            self.visual_turns.append(visual)
        kwargs = {"max_new_tokens": int(max_new_tokens),
                  "suppress_tokens": vision_token_ids(self.loaded.model.config)}
        self.slow_motion_ms = int(slow_motion_ms or 0)
        if self.slow_motion_ms:
            from transformers import LogitsProcessorList

            kwargs["logits_processor"] = LogitsProcessorList([Pause(self.slow_motion_ms / 1e3)])
        self.answering = True
        self.live = {"number": number, "start": time.perf_counter(), "first": None}
        answer = {"role": "assistant", "content": "…"}
        self.history.append(answer)
        return visual, kwargs, answer

    def _stream(self, conversation, asked: str, prepared, kwargs: dict, visual, answer: dict):
        """Stream the answer into ``answer`` (a `Step` per piece); returns the turn's result, or None when the
        processor or the model failed (told in the chat)."""
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
            return streamed.result
        except GeneratorExit:  # the page or an API client stopped this answer (Gradio closes the handler)
            self._stopped(streamed, visual, reply)
            raise
        except Exception as error:  # the processor refused the input, or the model failed
            self._failed(error, streaming, visual, answer, reply)
            yield Step(picture="force", timer=False, textbox="clear")
            return None

    def _failed(self, error: Exception, streaming: bool, visual, answer: dict, reply: str) -> None:
        """Settle a turn that failed: before the model (the conversation is as it was) or during the answer (the
        next question starts a new conversation)."""
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


def close_session(session) -> None:
    """The `gr.State`'s delete callback: a session's conversation ends with it."""
    if isinstance(session, Session):
        session.close()
