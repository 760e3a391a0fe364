"""The page: the Gradio Blocks (the chat tab, the *Compare modes* tab, the settings, the JSON panel) and its
wiring to `demo.events`. `build_demo` builds it without launching it; the model is loaded then, not at import.

Gradio is imported when the app is built (here, `demo.events` and `demo.textbox`), so that `import demo.app`
stays light.
"""

import atexit
import shutil
import sys
import tempfile
from dataclasses import replace

from .compare import COMPARE_HEADERS, COMPARE_MODES
from .examples import page_samples
from .media import MAX_VIDEO_FRAMES, MediaLimits
from .models import (BUNDLED_LABELS, DEFAULT_MODEL, TINY_MODEL, TINY_NOTE, ModelLoadError, load_model, model_choices,
                     model_key)
from .panels import FIGURE_HEADERS, caption
from .session import MODES_SHOWN, Session, Settings, close_session
from .timeline import TIMELINE_WAITING


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

    from .events import Events, Page

    start = Settings(model_key(model_id), mode, selector or raincheck_hf.RaincheckConfig().selector, retention,
                     chunk_size, decode_guard)
    start.config()  # bad settings fail here, naming the setting
    start, model_text = _starting_model(start, preload)
    folder = tempfile.mkdtemp(prefix="raincheck-demo-")
    atexit.register(shutil.rmtree, folder, True)
    glyph_examples = start.model in BUNDLED_LABELS
    samples = page_samples(glyph_examples, folder)

    with gr.Blocks(title="Raincheck demo", analytics_enabled=False) as demo:
        state = gr.State(None, delete_callback=close_session)  # a Session per browser session
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
                chat_tab = _chat_tab(start, samples, glyph_examples)
            with gr.Tab("Compare modes", id="compare", elem_id="rc-tab-compare"):
                # the comparison's starting image and questions: the first example and its follow-up
                compare_tab = _compare_tab(samples[0][2], samples[0][1], samples[1][1])
        with gr.Accordion("Settings (changing one starts a new conversation)", open=True):
            settings = _settings_panel(start, max_new_tokens, slow_motion_ms)
        with gr.Accordion("Live trace (JSON)", open=False):
            status = gr.JSON(label="Session state", elem_id="rc-status")
        timer = gr.Timer(refresh_every, active=False)
        page = Page(state=state, model_note=model_note, status=status, timer=timer, **chat_tab, **compare_tab,
                    **settings)
        events = Events(page, start, max_video_frames=max_video_frames, media_limits=media_limits)
        _wire(demo, page, events, concurrency)
    return demo


def _starting_model(start: Settings, preload: bool) -> tuple[Settings, str]:
    """The starting settings with the model that was loaded, and the page's note about the model.

    With ``preload``: the model asked for; failing that, the bundled default; failing that, the tiny one (the
    first failure is said on stderr and on the page)."""
    first_note = None
    loaded = None
    if preload:
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
    return start, model_text


def _chat_tab(start: Settings, samples: list, glyph_examples: bool) -> dict:
    """The chat, its examples, the map with its caption and timeline, the per-turn figures (`Page` fields)."""
    import gradio as gr

    from .textbox import ChatTextbox

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
            caption_box = gr.Markdown(caption(Session(start), None), elem_id="rc-caption")
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
    return dict(chatbot=chatbot, textbox=textbox, examples=examples, picture=picture, caption=caption_box,
                scrub=scrub, strip=strip, scrub_text=scrub_text, replay=replay, figures=figures)


def _compare_tab(image: str | None, question: str, follow_up: str) -> dict:
    """One image and question (and a follow-up) through the four modes: a table and a map and text per mode."""
    import gradio as gr

    gr.Markdown(
        "One question on one image through each mode, with the settings below (model, selector, "
        "retention, chunk size, decode guard, answer length; the *Mode* setting is what this varies). "
        "`hard`, `post_answer` and `raincheck` prefill the same selected patches first. Each map shows "
        "where every patch ended up: prefilled first (blue), restored during the answer (green), after "
        "it (violet), dropped (red). T1 is the time to the first token, TPOT the time per output token "
        "after it, measured here, one run each.")
    with gr.Row(equal_height=False):
        compare_image = gr.Image(value=image, type="filepath", label="Image",
                                 sources=["upload"], height=260, elem_id="rc-cmp-image")
        with gr.Column():
            compare_question = gr.Textbox(question, label="Question", elem_id="rc-cmp-question")
            compare_follow = gr.Textbox(follow_up, label="Follow-up (optional)",
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
    return dict(compare_image=compare_image, compare_question=compare_question, compare_follow=compare_follow,
                compare_button=compare_button, compare_note=compare_note, compare_table=compare_table,
                compare_pictures=compare_pictures, compare_texts=compare_texts)


def _settings_panel(start: Settings, max_new_tokens: int, slow_motion_ms: int) -> dict:
    """The controls: those that start a new conversation, and those that apply to the next question."""
    import gradio as gr

    import raincheck_hf

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
                              info="tokens answered before restoration starts (the library's default: 1)",
                              elem_id="rc-guard")
    with gr.Row():
        max_new_box = gr.Slider(1, 512, value=max_new_tokens, step=1, label="Answer length",
                                info="max new tokens (does not restart)", elem_id="rc-max-new")
        slow_box = gr.Slider(0, 200, value=slow_motion_ms, step=5, label="Slow motion (ms per token)",
                             info="a pause per generated token, to watch the picture (does not restart)",
                             elem_id="rc-slow")
        new_button = gr.Button("New conversation", elem_id="rc-new", scale=0, min_width=180)
    return dict(model_box=model_box, mode_box=mode_box, selector_box=selector_box, retention_box=retention_box,
                chunk_box=chunk_box, guard_box=guard_box, max_new_box=max_new_box, slow_box=slow_box,
                new_button=new_button)


def _wire(demo, page, events, concurrency: int) -> None:
    """Connect the components' events to `demo.events.Events` (the API names are the public endpoints)."""
    p, controls, shown = page, page.controls, page.shown
    chat_inputs = [p.textbox, *controls, p.max_new_box, p.slow_box, p.state]
    p.textbox.submit(events.chat, chat_inputs, shown + [p.textbox], api_name="chat",
                     concurrency_limit=concurrency, show_progress="hidden")
    # clicking an example sends it, as the page says (Gradio's examples only fill the box)
    p.examples.load_input_event.then(events.chat, chat_inputs, shown + [p.textbox], api_visibility="private",
                                     concurrency_limit=concurrency, show_progress="hidden")
    for control in (p.model_box, p.mode_box, p.selector_box):
        control.input(events.change_settings, controls + [p.state], shown, api_visibility="private",
                      show_progress="hidden", concurrency_limit=concurrency, trigger_mode="always_last")
    for slider in (p.retention_box, p.chunk_box, p.guard_box):
        slider.release(events.change_settings, controls + [p.state], shown, api_visibility="private",
                       show_progress="hidden", concurrency_limit=concurrency, trigger_mode="always_last")
    p.new_button.click(events.new_conversation, [p.state], shown, api_name="new_conversation",
                       show_progress="hidden")
    p.timer.tick(events.refresh, [p.state], shown, api_name="status", concurrency_limit=None, show_progress="hidden")
    p.scrub.input(events.scrub_to, [p.scrub, p.state], [p.picture, p.strip, p.scrub_text, p.caption],
                  api_name="timeline", trigger_mode="always_last", concurrency_limit=None, show_progress="hidden")
    p.replay.click(events.replay_timeline, [p.state], [p.picture, p.strip, p.scrub_text, p.caption, p.scrub],
                   api_visibility="private", concurrency_limit=None, show_progress="hidden")
    p.compare_button.click(
        events.compare, [p.compare_image, p.compare_question, p.compare_follow, *controls, p.max_new_box, p.state],
        [p.compare_table, *p.compare_pictures.values(), *p.compare_texts.values(), p.compare_note, p.state],
        api_name="compare", concurrency_limit=concurrency, show_progress="hidden")
    demo.unload(events.end_session)
