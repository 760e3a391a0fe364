"""What the page's events do: a chat turn, a settings change, a new conversation, the timer's refresh, the
timeline's slider and replay, and the comparison. Each returns (or yields) the updates of the page's components;
`demo.layout` builds the components and wires these to them.

Imported when the app is built (it needs Gradio), not with `demo.app`.
"""

import math
import time
from dataclasses import dataclass

import gradio as gr

from . import panels
from .compare import COMPARE_MODES, compare_frame, compare_modes, small_model_note
from .media import MAX_VIDEO_FRAMES, MediaLimits
from .models import ModelLoadError, is_loaded, load_model, model_choices
from .session import Session, Settings
from .streaming import Step, pace
from .timeline import TIMELINE_WAITING

REPLAY_FRAME_S = 0.06  # the timeline's replay: pause per frame


@dataclass
class Page:
    """The components the events read and update (built by `demo.layout`)."""

    state: gr.State  # a Session per browser session
    model_note: gr.Markdown
    # the chat tab
    chatbot: gr.Chatbot
    textbox: gr.MultimodalTextbox
    examples: gr.Examples
    picture: gr.Image
    caption: gr.Markdown
    scrub: gr.Slider
    strip: gr.Image
    scrub_text: gr.Markdown
    replay: gr.Button
    figures: gr.Dataframe
    # the compare tab
    compare_image: gr.Image
    compare_question: gr.Textbox
    compare_follow: gr.Textbox
    compare_button: gr.Button
    compare_note: gr.Markdown
    compare_table: gr.Dataframe
    compare_pictures: dict  # mode -> gr.Image
    compare_texts: dict  # mode -> gr.Markdown
    # the settings
    model_box: gr.Dropdown
    mode_box: gr.Radio
    selector_box: gr.Dropdown
    retention_box: gr.Slider
    chunk_box: gr.Slider
    guard_box: gr.Slider
    max_new_box: gr.Slider
    slow_box: gr.Slider
    new_button: gr.Button
    # the JSON panel, and the timer that follows idle-time restoration
    status: gr.JSON
    timer: gr.Timer

    @property
    def controls(self) -> list:
        """The settings that start a new conversation, in `Settings.from_controls`'s order."""
        return [self.model_box, self.mode_box, self.selector_box, self.retention_box, self.chunk_box, self.guard_box]

    @property
    def shown(self) -> list:
        """What a chat turn, a settings change, a new conversation and the timer update."""
        return [self.chatbot, self.picture, self.caption, self.figures, self.status, self.timer, self.model_box,
                self.model_note, self.state, self.scrub, self.strip, self.scrub_text]


class Events:
    """The page's event handlers, over the browser sessions they create (one `Session` per browser session)."""

    def __init__(self, page: Page, start: Settings, max_video_frames: int = MAX_VIDEO_FRAMES,
                 media_limits: MediaLimits = MediaLimits()):
        self.page = page
        self.start = start
        self.max_video_frames = max_video_frames
        self.media_limits = media_limits
        # sessions by Gradio's session hash, so that closing the tab closes its conversation right away
        # (the gr.State's delete_callback is the backstop: Gradio drops a closed tab's state only later)
        self.sessions: dict[str, Session] = {}

    def new_session(self, request=None) -> Session:
        session = Session(self.start, max_video_frames=self.max_video_frames, limits=self.media_limits)
        if request is not None and getattr(request, "session_hash", None):
            self.sessions[request.session_hash] = session
        return session

    def end_session(self, request: gr.Request):
        session = self.sessions.pop(getattr(request, "session_hash", None), None)
        if session is not None:
            session.close()

    # -- the updates --
    def render(self, session: Session, step: Step, tick: bool = False) -> dict:
        """The updates for one `Step` (the picture only when it changed; on a timer ``tick``, the caption
        only when it changed too, so that a tick does not undo the timeline's caption while scrubbing)."""
        p = self.page
        image, counts, changed = panels.picture_and_counts(session, draw=bool(step.picture),
                                                           force=step.picture == "force")
        out = {p.chatbot: list(session.history), p.state: session}
        if step.token:  # while an answer streams: what changed, and the JSON panel only when the turn ends
            for component, value in ((p.caption, panels.caption(session, counts)),
                                     (p.figures, panels.figures(session))):
                key = value.to_csv() if hasattr(value, "to_csv") else value
                if session.sent_streaming.get(component._id) != key:
                    session.sent_streaming[component._id] = key
                    out[component] = value
        else:
            session.sent_streaming = {}
            live = panels.caption(session, counts)
            if not (tick and live == session.live_caption):
                out[p.caption] = live
            session.live_caption = live
            out.update({p.figures: panels.figures(session), p.status: panels.status(session)})
        if step.picture and changed:
            out[p.picture] = image
        out.update(self.step_updates(step))
        out.update(self.render_timeline(session))
        return out

    def step_updates(self, step: Step) -> dict:
        """What a `Step` asks of the timer, the textbox and the model's dropdown and note."""
        p = self.page
        out = {}
        if step.timer is not None:
            out[p.timer] = gr.Timer(active=step.timer)
        if step.textbox == "lock":
            out[p.textbox] = gr.update(value=None, interactive=False)
        elif step.textbox == "clear":
            out[p.textbox] = gr.update(value=None, interactive=True)
        elif step.textbox == "keep_files":
            out[p.textbox] = gr.update(value={"text": "", "files": list(step.files)}, interactive=True)
        if step.model_choice is not None:
            out[p.model_box] = gr.update(value=step.model_choice, choices=model_choices(step.model_choice,
                                                                                         self.start.model))
        if step.model_note is not None:
            out[p.model_note] = step.model_note
        return out

    def render_text(self, session: Session) -> dict:
        """A streamed answer's text only (between the full updates that `pace` spaces out)."""
        return {self.page.chatbot: list(session.history), self.page.state: session}

    def render_timeline(self, session: Session) -> dict:
        """The timeline's controls, when the latest turn's timeline appeared or went away."""
        p = self.page
        turn, steps = panels.timeline(session)
        signature = (id(turn), len(steps)) if steps else None
        if signature == session.timeline_shown:
            return {}
        session.timeline_shown = signature
        if not steps:
            return {p.scrub: gr.update(value=0, maximum=1, interactive=False), p.strip: None,
                    p.scrub_text: TIMELINE_WAITING}
        _, strip_image, text, upto, _ = panels.timeline_view(session)
        return {p.scrub: gr.update(value=upto, maximum=max(1, upto), interactive=upto > 0), p.strip: strip_image,
                p.scrub_text: text}

    # -- the chat --
    def chat(self, message, model, mode, selector, retention, chunk_size, decode_guard, max_new_tokens,
             slow_motion_ms, session, request: gr.Request):
        session = session or self.new_session(request)
        if not session.lock.acquire(blocking=False):
            session.note(f"Still {session.busy or 'answering the previous question'}; send this one when it "
                         "is done.")
            yield self.render(session, Step(picture=False))
            return
        turn = None
        try:
            session.busy = "answering the previous question"
            wanted = Settings.from_controls(model, mode, selector, retention, chunk_size, decode_guard)
            turn = session.turn(message, wanted, max_new_tokens, slow_motion_ms)
            for what, step in pace(turn):
                yield self.render(session, step) if what == "all" else self.render_text(session)
        finally:
            if turn is not None:
                turn.close()  # a stopped answer is settled before the session takes the next question
            session.answering = False
            session.live = None
            session.busy = None
            session.lock.release()

    def change_settings(self, model, mode, selector, retention, chunk_size, decode_guard, session,
                        request: gr.Request):
        session = session or self.new_session(request)
        wanted = Settings.from_controls(model, mode, selector, retention, chunk_size, decode_guard)
        session.requested = wanted  # several changes while waiting: the latest wins
        if not session.lock.acquire(blocking=False):
            if session.answering:
                session.note(f"*Settings changed ({session.settings.changes(wanted) or 'back as they were'}) "
                             "while the model answers: they apply when this answer is done, with a new "
                             "conversation.*")
                yield self.render(session, Step(picture=False))
            session.lock.acquire()  # waits for the answer (or a model load) in progress
        try:
            wanted = session.requested or wanted
            session.requested = None
            loading = session.loading_step(wanted)
            if loading is not None:
                yield self.render(session, loading)
            step = session.apply(wanted)
            yield self.render(session, step or Step(picture=False))
        finally:
            session.busy = None
            session.lock.release()

    def new_conversation(self, session, request: gr.Request):
        session = session or self.new_session(request)
        with session.lock:
            session.restart()
            session.note(f"*New conversation {session.number}.*")
        return self.render(session, Step(picture="force", timer=False))

    def refresh(self, session):
        if session is None:
            return {self.page.timer: gr.Timer(active=False)}
        if session.answering:  # the answer's stream draws the picture meanwhile
            return {self.page.state: session}  # (an empty dict would read as one output value)
        return self.render(session, Step(timer=session.pending > 0), tick=True)

    # -- the timeline --
    def scrub_to(self, value, session):
        """The picture and the strip at one step of the latest turn's timeline."""
        p = self.page
        if session is None:
            return {p.scrub_text: TIMELINE_WAITING}
        image, strip_image, text, upto, steps = panels.timeline_view(session, value)
        if not steps:
            return {p.scrub_text: TIMELINE_WAITING}
        # the live picture is left as drawn (``session.drawn``): a timer tick redraws it only when
        # the cache changes, so that it does not undo the scrubbing; the caption says which step it shows
        return {p.picture: image, p.strip: strip_image, p.scrub_text: text,
                p.caption: panels.timeline_caption(session, upto)}

    def replay_timeline(self, session):
        """Step through the latest turn's timeline (at most ~120 frames), then stay at its end."""
        _, steps = panels.timeline(session) if session is not None else (None, None)
        if not steps:
            yield {self.page.scrub_text: TIMELINE_WAITING}
            return
        stride = max(1, math.ceil(len(steps) / 120))
        frames = list(range(0, len(steps), stride))
        if frames[-1] != len(steps) - 1:
            frames.append(len(steps) - 1)
        for k in frames:
            update = self.scrub_to(k, session)
            update[self.page.scrub] = gr.update(value=k)
            yield update
            time.sleep(REPLAY_FRAME_S)

    # -- the comparison --
    def compare(self, path, question, follow_up, model, mode, selector, retention, chunk_size, decode_guard,
                max_new_tokens, session, request: gr.Request):
        p = self.page
        session = session or self.new_session(request)
        blank = {p.compare_table: None, **{picture: None for picture in p.compare_pictures.values()},
                 **{text: f"**{name}**" for name, text in p.compare_texts.items()}, p.state: session}
        if not session.lock.acquire(blocking=False):
            yield {**blank, p.compare_note: f"*Still {session.busy or 'busy'}: compare when it is done.*"}
            return
        try:
            wanted = Settings.from_controls(model, mode, selector, retention, chunk_size, decode_guard)
            try:
                wanted.config()
                if not is_loaded(wanted.model):
                    session.busy = f"loading model {wanted.model}"
                    yield {**blank, p.compare_note: f"*Loading model **{wanted.model}**…*"}
                loaded = load_model(wanted.model)
            except (ValueError, ModelLoadError) as error:
                yield {**blank, p.compare_note: f"**Problem:** {error}"}
                return
            session.busy = "comparing the modes"
            yield from self.compare_runs(loaded, path, question, follow_up, wanted, max_new_tokens, blank)
        finally:
            session.busy = None
            session.lock.release()

    def compare_runs(self, loaded, path, question, follow_up, wanted: Settings, max_new_tokens, blank: dict):
        """The comparison's updates as each mode's run comes in (``blank``: the tab before the first)."""
        p = self.page
        rows, shown_so_far = [], dict(blank)
        yield {**blank, p.compare_note: f"*Running `{COMPARE_MODES[0]}` (1 of {len(COMPARE_MODES)})…*"}
        try:
            for i, run in enumerate(compare_modes(loaded, path, question, follow_up, wanted, max_new_tokens,
                                                  self.media_limits)):
                rows.append(run.row())
                following = (f"*Running `{COMPARE_MODES[i + 1]}` ({i + 2} of {len(COMPARE_MODES)})…*"
                             if i + 1 < len(COMPARE_MODES) else
                             f"*Done: {loaded.name}, selector `{wanted.selector}`, retention "
                             f"{wanted.retention:g}, chunk size {wanted.chunk_size}, decode guard "
                             f"{wanted.decode_guard}.*" + small_model_note(loaded))
                shown_so_far.update({p.compare_pictures[run.mode]: run.picture,
                                     p.compare_texts[run.mode]: run.markdown()})
                yield {**shown_so_far, p.compare_table: compare_frame(rows), p.compare_note: following}
        except ValueError as error:
            yield {**blank, p.compare_note: f"**Problem:** {error}"}
