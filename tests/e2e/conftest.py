"""Fixtures for the browser tests: the app in a subprocess on a free local port, and headless Chromium.

Chromium is Debian's (/usr/bin/chromium), driven by the python `playwright` package. Without it
the tests skip, naming how to install it — unless MARS_REQUIRE_BROWSER=1 (CI), where they fail.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = os.environ.get("MARS_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
# The model the suite drives; the default is the app's own default (the embedded MARS model).
MODEL = os.environ.get("MARS_E2E_MODEL", "tiny-mars")
STARTUP_LIMIT_S = 15.0


def _browser_missing_reason() -> str | None:
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        return (f"Chromium not found at {CHROMIUM}: install it with `apt-get install chromium` "
                f"(or set MARS_CHROMIUM to its path)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the python package playwright is missing: `pip install playwright`"
    return None


@pytest.fixture(scope="session")
def browser():
    reason = _browser_missing_reason()
    if reason:
        if os.environ.get("MARS_REQUIRE_BROWSER") == "1":
            pytest.fail(f"MARS_REQUIRE_BROWSER=1 but {reason}")
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def app_server(tmp_path_factory):
    """`python app.py` on 127.0.0.1:<free port>; yields (url, seconds until the page answered, runs dir)."""
    ARTIFACTS.mkdir(exist_ok=True)
    runs = tmp_path_factory.mktemp("e2e") / "runs"
    port = _free_port()
    log = open(ARTIFACTS / "app-server.log", "w")
    # --model pins the page to MODEL: without it the app moves free text to smollm2-mars once that is ready
    cmd = [sys.executable, "app.py", "--host", "127.0.0.1", "--port", str(port), "--runs-dir", str(runs),
           "--model", MODEL]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    startup = None
    served = None
    while time.perf_counter() - t0 < 120:
        if proc.poll() is not None:
            log.close()
            pytest.fail(f"app.py exited with {proc.returncode}:\n{(ARTIFACTS / 'app-server.log').read_text()[-3000:]}")
        if served is None:
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        served = time.perf_counter() - t0
            except OSError:
                pass
        log_text = (ARTIFACTS / "app-server.log").read_text()
        if "[app] warning" in log_text:
            proc.kill()
            pytest.fail(f"app.py could not load its start-up model:\n{log_text[-3000:]}")
        # usable = the page is served and the start-up model is loaded (app.py prints when it is)
        if served is not None and "[app] model" in log_text:
            startup = time.perf_counter() - t0
            break
        time.sleep(0.1)
    if startup is None:
        proc.kill()
        pytest.fail("app.py did not answer within 120 s")
    (ARTIFACTS / "startup.txt").write_text(f"{' '.join(cmd[1:])}\npage served after {served:.1f} s, "
                                           f"usable (model loaded) after {startup:.1f} s\n")
    yield url, startup, runs
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def open_page(browser, url: str, viewport: tuple[int, int] = (1440, 1000), advanced: bool = True):
    """A page of the app in a context of its own (its own Gradio session), loaded; close with page.context.close().
    `advanced`: the Generate tab's "Advanced settings" opened, so the tests can reach every control."""
    pg = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]}).new_page()
    pg.set_default_timeout(60_000)
    pg.goto(url)
    pg.wait_for_selector("#generate-btn")
    if advanced:
        pg.locator("#advanced").get_by_text("Advanced settings").first.click()
        pg.wait_for_selector("#max-new", state="visible")
    return pg


@pytest.fixture()
def page(browser, app_server):
    url, _, _ = app_server
    pg = open_page(browser, url)
    yield pg
    pg.context.close()
