"""The Gradio demo in a real browser: Playwright driving Debian's Chromium (``/usr/bin/chromium``).

The app runs its default, the bundled glyph Qwen3-VL. The test uploads a glyph grid of the
benchmark's dev split, asks its list question and its follow-up, watches the answer stream and
the restoration picture change, checks the answers against the references the page shows, and
saves a screenshot to ``artifacts/demo_browser.png``. Two more tests drive the *Compare modes* tab
(the four modes on the example grid: ``artifacts/demo_compare.png``) and the restoration timeline
(scrubbed to a step, replayed: ``artifacts/demo_timeline.png``), with a settings change during an
answer and a ``.txt`` attachment on the way.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from conftest import serve_demo

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[1]
ARTIFACT = ROOT / "artifacts" / "demo_browser.png"
STREAMING_ARTIFACT = ROOT / "artifacts" / "demo_browser_streaming.png"  # mid-answer, deferred tokens dark
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
pytest.importorskip("gradio")
sync_api = pytest.importorskip("playwright.sync_api")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)", allow_module_level=True)
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="module")
def app_url():
    # slow motion: a 30 ms pause per token, so that the picture has time to show each stage
    with serve_demo(slow_motion_ms=30) as url:
        yield url


@pytest.fixture
def page(tmp_path):
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            page = context.pages[0] if context.pages else context.new_page()
            page.set_default_timeout(60_000)
            yield page
        finally:
            context.close()


def watch_answer(page, index: int, timeout: float = 90.0, snapshot: Path | None = None) -> dict:
    """Poll the page while an answer streams (the ``index``-th bot message): the texts, picture
    sources and captions seen.

    With ``snapshot``, also take a screenshot the first time the caption shows deferred tokens
    waiting while the answer streams.
    """
    seen = {"answers": [], "pictures": [], "captions": [], "errors": []}
    toasts = page.locator("[data-testid='toast-body']")
    bots = page.locator("#rc-chat [data-testid='bot']")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = bots.nth(index).inner_text() if bots.count() > index else ""
        src = page.evaluate("() => document.querySelector('#rc-picture img')?.src || ''")
        caption = page.inner_text("#rc-caption")
        for key, value in (("answers", answer), ("pictures", src), ("captions", caption)):
            if value and (not seen[key] or seen[key][-1] != value):
                seen[key].append(value)
        if toasts.count():
            seen["errors"].extend(t for t in toasts.all_inner_texts() if t not in seen["errors"])
        if snapshot is not None and "answering" in caption and " 0 restored" in caption:
            page.screenshot(path=str(snapshot))
            snapshot = None
        if answer and answer != "…" and "ready" in caption and "answering" not in caption:
            break
        time.sleep(0.02)
    return seen


def ask(page, text: str, image: str | None = None) -> None:
    box = page.locator("#rc-input textarea")
    page.wait_for_function("() => !document.querySelector('#rc-input textarea').disabled")
    if image is not None:
        page.set_input_files("#rc-input input[data-testid='file-upload']", image)
        page.wait_for_selector("#rc-input img")  # the upload's thumbnail
    box.fill(text)
    box.press("Enter")


def test_upload_a_grid_ask_two_questions_stream_and_the_picture_changes(app_url, page, tmp_path):
    from raincheck_hf.quality.glyphs import benchmark_split, score_turn

    grid = benchmark_split("dev", limit=1)[0]  # dev-000: a 20-fact list question, then follow-ups
    first_turn, second_turn = grid.turns[:2]
    image = tmp_path / "grid.png"
    grid.image().save(image)
    page.goto(app_url)
    page.wait_for_selector("#rc-input textarea")
    note = page.inner_text("#rc-model-note")
    assert "glyph Qwen3-VL" in note and "knows only that task" in note and "random weights" not in note
    assert page.get_by_text("Grid 1 (10×10): list question").count() >= 1  # the glyph examples

    ARTIFACT.parent.mkdir(exist_ok=True)
    ask(page, first_turn.question, str(image))
    first = watch_answer(page, 0, snapshot=STREAMING_ARTIFACT)
    assert not first["errors"], f"Gradio showed an error: {first['errors']}"
    assert len(first["answers"]) >= 3, f"the answer did not stream: {first['answers']}"
    assert len(first["pictures"]) >= 2, "the restoration picture did not change"
    assert any("answering" in c and " 0 restored" in c for c in first["captions"]), first["captions"]
    assert "every deferred token is in the cache" in first["captions"][-1]
    assert " 0 deferred" in first["captions"][-1]
    bots = page.locator("#rc-chat [data-testid='bot']")
    assert score_turn(first_turn, bots.nth(0).inner_text())["correct"] >= 15, bots.nth(0).inner_text()
    page.wait_for_function("() => document.querySelectorAll(\"#rc-chat [data-testid='bot']\").length >= 2")
    assert "Reference" in bots.nth(1).inner_text() and "facts right" in bots.nth(1).inner_text()

    ask(page, second_turn.question)
    second = watch_answer(page, 2)
    assert not second["errors"], f"Gradio showed an error: {second['errors']}"
    assert second["answers"][-1].split()[0] == second_turn.answer, second["answers"]
    page.wait_for_function("() => document.querySelectorAll(\"#rc-chat [data-testid='bot']\").length >= 4")
    assert bots.count() == 4  # two answers, each followed by its reference
    assert "Reference" in bots.nth(3).inner_text() and "right" in bots.nth(3).inner_text()
    assert page.locator("#rc-chat [data-testid='user']").count() >= 2
    cells = page.inner_text("#rc-figures").split("dropped", 1)[1].split("\n")  # the table's cells, row by row
    cells = [c.strip() for c in cells if c.strip()]
    assert len(cells) == 2 * 9 and cells[0] == "1" and cells[9] == "2", cells
    assert cells[10] == "no new visual tokens", cells  # the follow-up has no image of its own
    page.wait_for_timeout(300)  # let the last image and table render
    page.screenshot(path=str(ARTIFACT), full_page=True)
    assert ARTIFACT.stat().st_size > 10_000
    toasts = page.locator("[data-testid='toast-body']")
    assert toasts.count() == 0, f"Gradio showed an error: {toasts.all_inner_texts()}"

    # closing the tab ends the session, and the session's conversation is closed (no longer restored)
    before = restore_workers()
    page.context.close()
    deadline = time.monotonic() + 20
    while restore_workers() >= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert restore_workers() == before - 1


def settled_picture(page, quiet: float = 0.6, timeout: float = 15.0) -> str:
    """The picture's source once it has not changed for ``quiet`` seconds (the browser swaps an
    image in only after it loaded, a moment after the text of the same update)."""
    source, since = None, time.monotonic()
    deadline = since + timeout
    while time.monotonic() < deadline:
        now = page.evaluate("() => document.querySelector('#rc-picture img')?.src || ''")
        if now != source:
            source, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
        time.sleep(0.05)
    return source


def restore_workers() -> int:
    """Conversations the models' restorer threads restore in the background (`restorer.IdleRestorer`)."""
    from raincheck_hf.restorer import _RESTORERS

    return sum(r.attached for r in list(_RESTORERS.values()))


COMPARE_ARTIFACT = ROOT / "artifacts" / "demo_compare.png"
TIMELINE_ARTIFACT = ROOT / "artifacts" / "demo_timeline.png"


def test_compare_the_four_modes_side_by_side(app_url, page):
    page.goto(app_url)
    page.get_by_role("tab", name="Compare modes").click()
    page.wait_for_selector("#rc-cmp-image img")  # the example grid is there to start with
    assert "list the" in page.input_value("#rc-cmp-question textarea")
    page.click("#rc-cmp-run")
    page.wait_for_function("() => document.querySelector('#rc-cmp-note')?.innerText.includes('Done')",
                           timeout=240_000)
    table = page.inner_text("#rc-cmp-table")
    for mode in ("full", "hard", "post_answer", "raincheck"):
        assert mode in table
        page.wait_for_selector(f"#rc-cmp-map-{mode} img")
        assert f"**{mode}**" not in page.inner_text(f"#rc-cmp-text-{mode}")  # rendered, not raw markdown
        assert "T1 " in page.inner_text(f"#rc-cmp-text-{mode}")
    assert "facts right" in table and "wrong" in table  # hard loses the follow-up's cell
    assert "Why full can have the fastest first token here" in page.inner_text("#rc-cmp-note")  # on a CPU
    page.wait_for_timeout(300)
    COMPARE_ARTIFACT.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(COMPARE_ARTIFACT), full_page=True)
    toasts = page.locator("[data-testid='toast-body']")
    assert toasts.count() == 0, f"Gradio showed an error: {toasts.all_inner_texts()}"


def test_timeline_scrubs_and_replays_settings_wait_and_a_text_file_is_explained(app_url, page, tmp_path):
    from raincheck_hf.quality.glyphs import benchmark_split

    grid = benchmark_split("dev", limit=1)[0]
    image, notes = tmp_path / "grid.png", tmp_path / "notes.txt"
    grid.image().save(image)
    notes.write_text("not a picture")
    page.goto(app_url)
    page.wait_for_selector("#rc-input textarea")

    # a text file reaches the server, which explains in the chat (not only a toast), and nothing is sent
    page.set_input_files("#rc-input input[data-testid='file-upload']", str(notes))
    page.wait_for_selector("#rc-input .thumbnail-item")  # uploaded (a file icon): no toast, no refusal
    page.locator("#rc-input textarea").fill("what is this ?")
    page.locator("#rc-input textarea").press("Enter")
    page.wait_for_function("() => document.querySelector('#rc-chat')?.innerText.includes('is not an image or a video')")

    # slower motion for this answer (read when a question is sent), so that it is still running when the
    # settings change below arrives: at the fixture's 30 ms per token a loaded machine could finish it first
    slow = page.locator("#rc-slow input[type='number']")
    slow.fill("150")
    slow.press("Tab")
    page.wait_for_timeout(300)
    ask(page, grid.turns[0].question, str(image))
    page.wait_for_function("() => document.querySelector('#rc-caption')?.innerText.includes('answering')")
    # a settings change while the model answers: said at once, applied after the answer
    page.locator("#rc-mode").get_by_text("hard", exact=True).click()
    page.wait_for_function("() => document.querySelector('#rc-chat')?.innerText.includes('apply when this answer')")
    assert "answering" in page.inner_text("#rc-caption")
    page.wait_for_function("() => document.querySelector('#rc-chat')?.innerText.includes("
                           "'New conversation (mode → hard)')", timeout=120_000)
    page.locator("#rc-mode").get_by_text("raincheck", exact=True).click()
    page.wait_for_function("() => document.querySelector('#rc-chat')?.innerText.includes("
                           "'New conversation (mode → raincheck)')")

    again = tmp_path / "grid-again.png"  # another name: the browser ignores the same file chosen twice
    grid.image().save(again)
    ask(page, grid.turns[0].question, str(again))
    # this answer's figures, not the first answer's still on the page (its timeline also ended at 70 of 70): the
    # third conversation's caption once its answer is done ("ready": not "answering…", whose counts also read
    # "restored during the answer"; while the answer streams, each render moves the timeline's slider to its live end
    # and the caption back to the live cache, so a scrub then could lose its caption: seen under a full CI run)
    page.wait_for_function(
        "() => { const caption = document.querySelector('#rc-caption')?.innerText || '';"
        " return caption.includes('Conversation 3') && caption.includes('restored during the answer')"
        " && caption.includes('ready ·')"
        " && (document.querySelector('#rc-scrub-text')?.innerText || '').includes('70 of 70'); }", timeout=120_000)
    slider = page.locator("#rc-scrub input[type='range']")
    assert slider.is_enabled()
    last = int(slider.get_attribute("max"))
    pictures = []
    for step, expected in ((0, "0 of 70"), (16, "31 came back in this step"), (last, "70 of 70")):
        slider.fill(str(step))
        page.wait_for_function("(t) => document.querySelector('#rc-scrub-text')?.innerText.includes(t)", arg=expected)
        pictures.append(settled_picture(page))
        # the caption describes the step shown, not the live cache
        page.wait_for_function("() => document.querySelector('#rc-caption')?.innerText.includes('the timeline at')")
        if step == 16:
            assert "the timeline at decode step 16" in page.inner_text("#rc-caption")
            TIMELINE_ARTIFACT.parent.mkdir(exist_ok=True)
            page.locator("#rc-picture").scroll_into_view_if_needed()
            page.screenshot(path=str(TIMELINE_ARTIFACT), full_page=True)
    assert len(set(pictures)) == 3, f"the picture did not follow the scrubber: {pictures}"
    seen = set()
    page.click("#rc-replay")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        seen.add(page.inner_text("#rc-scrub-text"))
        if len(seen) > 5 and "70 of 70" in page.inner_text("#rc-scrub-text"):
            break
        time.sleep(0.02)
    assert len(seen) > 5, f"the replay did not step through the timeline: {seen}"
    toasts = page.locator("[data-testid='toast-body']")
    assert toasts.count() == 0, f"Gradio showed an error: {toasts.all_inner_texts()}"


def test_clicking_an_example_sends_it(app_url, page):
    """The page says a click on an example is enough: it fills the box and sends the question."""
    page.goto(app_url)
    page.wait_for_selector("#rc-input textarea")
    page.get_by_text("Grid 1 (10×10): list question").first.click()
    page.wait_for_function("() => document.querySelectorAll(\"#rc-chat [data-testid='bot']\").length >= 2",
                           timeout=120_000)  # the answer and its reference, without pressing Enter
    assert "facts right" in page.locator("#rc-chat [data-testid='bot']").nth(1).inner_text()
    page.get_by_text("Grid 1: follow-up").first.click()
    page.wait_for_function("() => document.querySelectorAll(\"#rc-chat [data-testid='bot']\").length >= 4",
                           timeout=120_000)
    assert page.locator("#rc-chat [data-testid='user']").count() >= 3  # the grid, its question, the follow-up
    toasts = page.locator("[data-testid='toast-body']")
    assert toasts.count() == 0, f"Gradio showed an error: {toasts.all_inner_texts()}"
