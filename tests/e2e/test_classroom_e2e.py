"""The classroom in headless Chromium: the race on a projector's first screen, the lanes side by side (stacked on a
phone), the replay's play / pause / step / delay acting within one forward pass, and presentation mode."""
from __future__ import annotations

import time

import pytest

from tests.e2e.conftest import ARTIFACTS, open_page
from tests.e2e.test_app_e2e import click_and_wait_done, prompt_for_model

LANES = ("ar", "verify", "mars")


def _first_lines(page) -> dict:
    """Per lane: the box of its first chunk (its first line of text)."""
    return page.evaluate("""(lanes) => Object.fromEntries(lanes.map(l => {
        const c = document.querySelector('#' + l + '-pane .race-text .chunk');
        const r = c ? c.getBoundingClientRect() : null;
        return [l, r ? {x: r.x, y: r.y, bottom: r.bottom} : null]; }))""", list(LANES))


def _box(page, sel: str) -> dict:
    b = page.locator(sel).first.bounding_box()
    assert b is not None, f"{sel} is not on the page"
    return b


@pytest.mark.parametrize("size", [(1024, 768), (1280, 800)], ids=["projector-1024x768", "laptop-1280x800"])
def test_race_button_tau_and_every_lanes_first_line_fit_the_first_screen(browser, app_server, size):
    url, _, _ = app_server
    page = open_page(browser, url, viewport=size, advanced=False)
    try:
        # the background model's last word (ready, failed, not available) and its Switch button are on the page
        page.wait_for_function("/[✓⚠]|not available/.test(document.querySelector('#prep-status')?.innerText ?? '')",
                               timeout=300_000, polling=500)
        page.fill("#prompt textarea", prompt_for_model())
        click_and_wait_done(page, "#generate-btn", 120_000)
        page.evaluate("window.scrollTo(0, 0)")
        page.screenshot(path=str(ARTIFACTS / f"classroom-{size[0]}x{size[1]}.png"))
        w, h = size
        for sel in ("#generate-btn", "#tau"):
            b = _box(page, sel)
            assert b["y"] >= 0 and b["y"] + b["height"] <= h and b["x"] + b["width"] <= w, (sel, b)
        lines = _first_lines(page)
        for lane, r in lines.items():
            assert r is not None and r["bottom"] <= h, (lane, r, size)
        xs = [lines[lane]["x"] for lane in LANES]
        assert xs == sorted(xs) and xs[0] < xs[1] < xs[2], xs        # side by side, AR first
        tops = [_box(page, f"#{lane}-pane")["y"] for lane in LANES]
        assert max(tops) - min(tops) <= 2, tops
    finally:
        page.context.close()


def test_on_a_phone_the_lanes_stack_in_order(browser, app_server):
    url, _, _ = app_server
    page = open_page(browser, url, viewport=(390, 844), advanced=False)
    try:
        boxes = [_box(page, f"#{lane}-pane") for lane in LANES]
        assert boxes[0]["y"] + boxes[0]["height"] <= boxes[1]["y"] + 1
        assert boxes[1]["y"] + boxes[1]["height"] <= boxes[2]["y"] + 1
        assert all(b["x"] + b["width"] <= 390 for b in boxes), boxes
        page.fill("#prompt textarea", prompt_for_model())
        click_and_wait_done(page, "#generate-btn", 180_000)
        # every lane's column of the stats table, numbers filled in, is readable without scrolling sideways
        widths = page.evaluate("""() => { const t = document.querySelector('#stats table.stats');
            return [t.getBoundingClientRect().right, t.scrollWidth, t.parentElement.clientWidth]; }""")
        assert widths[0] <= 390 and widths[1] <= widths[2], widths
        # and the ledger of a step (step 0 after a race): every cell on the screen
        rights = page.evaluate("() => Array.from(document.querySelectorAll('#ledger td'))"
                               ".map(td => td.getBoundingClientRect().right)")
        assert rights and max(rights) <= 390, rights
        # the token diff wraps: each cell (MARS's token over AR's) and its title on the screen, the cells legible
        cells = page.evaluate("""() => Array.from(document.querySelectorAll('#token-diff .diff-cells .dt'))
            .map(c => { const r = c.getBoundingClientRect();
                        return [r.right, parseFloat(getComputedStyle(c).fontSize)]; })""")
        assert cells and max(r for r, _ in cells) <= 390 and min(f for _, f in cells) >= 12, cells[:3]
        assert _box(page, "#token-diff .diff-title")["x"] + _box(page, "#token-diff .diff-title")["width"] <= 390
        # the plots' titles are inside their panels (the means are a second title line, not labels on the lines)
        titles = page.evaluate("() => Array.from(document.querySelectorAll('.js-plotly-plot .gtitle'))"
                               ".map(t => t.getBoundingClientRect().right)")
        assert titles and max(titles) <= 390, titles
        page.screenshot(path=str(ARTIFACTS / "classroom-390.png"), full_page=True)
    finally:
        page.context.close()


def _shown(page) -> list[int]:
    return page.evaluate("""(lanes) => lanes.map(l => Number(document.querySelector('#' + l +
        '-pane .race-text').dataset.shown))""", list(LANES))


def _visible_chunks(page) -> list[int]:
    return page.evaluate("""(lanes) => lanes.map(l => Array.from(document.querySelectorAll('#' + l +
        '-pane .race-text .chunk')).filter(c => c.style.display !== 'none').length)""", list(LANES))


def test_replay_steps_pauses_and_takes_a_new_delay_within_one_forward(page):
    page.fill("#prompt textarea", prompt_for_model())
    click_and_wait_done(page, "#generate-btn", 120_000)
    forwards = page.evaluate("""(lanes) => lanes.map(l => document.querySelectorAll('#' + l +
        '-pane .race-text .chunk').length)""", list(LANES))
    assert min(forwards) >= 3, forwards
    page.click("#replay-start")
    assert _visible_chunks(page) == [0, 0, 0]
    page.click("#replay-step")
    page.click("#replay-step")
    assert _visible_chunks(page) == [2, 2, 2] == _shown(page)
    page.click("#replay-back")
    assert _visible_chunks(page) == [1, 1, 1]
    # the lane's big tokens/forward follows the chunks shown: the first forward's tokens
    first = page.evaluate("Number(document.querySelector('#mars-pane .race-text .chunk').dataset.n)")
    assert page.inner_text("#mars-pane .score-tpf") == f"{first:.2f}"
    # play fast, then pause: nothing moves after the pause
    page.fill("#replay-delay", "50")
    page.dispatch_event("#replay-delay", "input")
    page.click("#replay-play")
    time.sleep(0.4)
    page.click("#replay-play")   # pause
    paused = _shown(page)
    time.sleep(0.5)
    assert _shown(page) == paused and paused[0] > 1
    # a long delay set while playing acts from the next forward: at most one more pass in 0.6 s
    page.click("#replay-play")
    page.fill("#replay-delay", "2000")
    page.dispatch_event("#replay-delay", "input")
    before = _shown(page)
    time.sleep(0.6)
    after = _shown(page)
    assert after[0] - before[0] <= 1, (before, after)
    assert page.inner_text("#replay-delay-value") == "2000 ms/forward"
    page.click("#replay-end")
    assert _visible_chunks(page) == forwards


def test_presentation_mode_from_the_link_makes_the_lanes_large(browser, app_server):
    url, _, _ = app_server
    page = open_page(browser, url + "?present=1", viewport=(1024, 768), advanced=False)
    try:
        page.wait_for_function("document.body.classList.contains('present')")
        size = page.evaluate("parseFloat(getComputedStyle(document.querySelector('#mars-pane .race-text')).fontSize)")
        assert size >= 20, size
        assert not page.locator("#advanced").is_visible()
        assert page.locator("#present-toggle input").is_checked()
        page.uncheck("#present-toggle input")
        page.wait_for_function("!document.body.classList.contains('present')")
    finally:
        page.context.close()


@pytest.fixture()
def auto_server(tmp_path):
    """`python app.py` without --model: tiny-mars first, smollm2-mars prepared in the background."""
    import subprocess
    import sys
    import urllib.request

    from tests.e2e.conftest import REPO, _free_port

    port = _free_port()
    log = open(tmp_path / "app.log", "w")
    proc = subprocess.Popen([sys.executable, "app.py", "--port", str(port), "--runs-dir", str(tmp_path / "runs")],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                break
        except OSError:
            time.sleep(0.2)
    yield url, tmp_path / "app.log"
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def test_a_prompt_typed_during_start_up_is_never_replaced(browser, auto_server):
    from app import models

    if not models.smollm2_mars_available():
        pytest.skip("assets/smollm2-mars is missing: nothing is prepared in the background")
    url, log = auto_server
    page = open_page(browser, url, viewport=(1280, 800), advanced=False)
    try:
        mine = "My own question for the class: why is the sea salty?"
        page.fill("#prompt textarea", "")
        page.locator("#prompt textarea").press_sequentially(mine)   # typed, as a teacher would
        page.wait_for_function("(document.querySelector('#prep-status')?.innerText ?? '').includes('ready')",
                               timeout=300_000, polling=500)
        time.sleep(1.5)   # a poll after the ready one must not switch either
        assert page.input_value("#prompt textarea") == mine
        assert "tiny-mars" in page.input_value("#model-picker input")
        page.click("#switch-default")   # the offered switch: the model moves, the prompt stays
        page.wait_for_function("document.querySelector('#model-picker input').value.includes('smollm2-mars')")
        time.sleep(1.0)
        assert page.input_value("#prompt textarea") == mine
    finally:
        page.context.close()


def _open_tab(page, name: str) -> None:
    """Click a tab, on a phone too, where Gradio folds the tabs that do not fit into a "…" menu."""
    tab = page.get_by_role("tab", name=name)
    if tab.count() and tab.first.is_visible():
        tab.first.click()
        return
    page.evaluate("""() => Array.from(document.querySelectorAll('button')).find(b => b.innerText.trim() === '' &&
        b.closest('[class*=tab]'))?.click()""")
    page.locator("button:not([role=tab])", has_text=name).last.click()


@pytest.mark.parametrize("size", [(1024, 768), (390, 844)], ids=["projector-1024x768", "phone-390"])
def test_learn_steps_through_every_forward_pass_of_the_decode(browser, app_server, size):
    import re
    url, _, _ = app_server
    page = open_page(browser, url, viewport=size, advanced=False)
    try:
        page.fill("#prompt textarea", prompt_for_model())
        _open_tab(page, "Learn")
        page.click("#learn-all-btn")
        page.wait_for_function("/forward pass 1 of \\d+/.test(document.querySelector('#learn-step')?.innerText ?? '')",
                               timeout=120_000, polling=100)
        first = page.inner_text("#learn-step")
        n = int(re.search(r"forward pass 1 of (\d+)", first).group(1))
        assert n > 1 and page.query_selector_all("#learn-step tbody tr"), first[:300]
        box = page.locator("#learn-step-k input[type=number]")
        box.fill(str(n - 1))
        box.press("Enter")
        page.wait_for_function(f"document.querySelector('#learn-step')?.innerText.includes('forward pass {n} of {n}')",
                               timeout=30_000, polling=100)
        last = page.inner_text("#learn-step")
        so_far = [re.search(r"answer so far: (.*)", t).group(1) for t in (first, last)]
        assert len(so_far[1]) > len(so_far[0]) and so_far[1].startswith(so_far[0].strip()), so_far
        # every cell of the step's table, the verdicts included, is on the screen without scrolling sideways
        rights = page.evaluate("() => Array.from(document.querySelectorAll('#learn-step td'))"
                               ".map(td => td.getBoundingClientRect().right)")
        assert rights and max(rights) <= size[0], rights
        page.screenshot(path=str(ARTIFACTS / f"learn-every-step-{size[0]}.png"), full_page=True)
    finally:
        page.context.close()
