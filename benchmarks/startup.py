"""How soon `python app.py` gives a usable page: N starts of the real app, each on a free port, timed from the
moment the process is started.

    python benchmarks/startup.py --runs 5                 # the default start (tiny-mars, then smollm2-mars)
    python benchmarks/startup.py --runs 5 --no-browser    # HTTP only
    python benchmarks/startup.py --runs 3 --app-args "--model tiny-mars"
    python benchmarks/startup.py --runs 5 --repo /tmp/old      # another commit's app.py (`git archive` it there)

Per start it records, in seconds after the process started:
  served       GET / answers 200 (the page's HTML with its config)
  interactive  headless Chromium opened the page and its Race button is there and enabled (the page's
               JavaScript ran and built the UI): what a user sees as "the page is up". Chromium is started
               before the app, so its own start is not counted; without --no-browser it needs /usr/bin/chromium
               (or $MARS_CHROMIUM) and the python package playwright.
  model        the app printed "[app] model ... ready": the start-up model is loaded and warmed up
  smollm2      the app printed "[app] smollm2-mars ready" (only with --until smollm2)
and the app's own CPU seconds (user + system, all its threads) when the page was served. It prints every start
and then the median and the min-max of each, with the load average before the first start (a loaded machine
gives later numbers; run it on a quiet one to compare). The app is killed after each start.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("MARS_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process, all its threads (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def served(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def one_start(repo: Path, app_args: list[str], until: str, browser, timeout_s: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    cmd = [sys.executable, "-u", "app.py", "--port", str(port), *app_args]
    out: dict = {}
    lines: list[tuple[float, str]] = []   # (seconds after start, line) as the app prints them

    def read(stream) -> None:
        for line in stream:
            lines.append((time.perf_counter() - t0, line))

    def first(pattern: str) -> float | None:
        return next((t for t, line in list(lines) if re.search(pattern, line)), None)

    def log_tail() -> str:
        return "".join(line for _, line in lines)[-2000:]

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    threading.Thread(target=read, args=(proc.stdout,), daemon=True).start()
    try:
        while time.perf_counter() - t0 < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"app.py exited with {proc.returncode}:\n{log_tail()}")
            if "served" not in out and served(url):
                out["served"] = time.perf_counter() - t0
                out["cpu_at_served"] = cpu_seconds(proc.pid)
                if browser is not None:
                    page = browser.new_page()
                    page.goto(url, timeout=60_000)
                    page.wait_for_selector("#generate-btn:not([disabled])", timeout=60_000)
                    out["interactive"] = time.perf_counter() - t0
                    page.close()
                continue
            for key, pattern in (("model", r"\[app\] model '.*' ready"),
                                 ("smollm2", r"\[app\] smollm2-mars (ready|unavailable)")):
                if key not in out and first(pattern) is not None:
                    out[key] = first(pattern)
            if first(r"\[app\] warning") is not None:
                raise RuntimeError(f"the start-up model failed:\n{log_tail()}")
            if "served" in out and "model" in out and (until != "smollm2" or "smollm2" in out):
                return out
            time.sleep(0.05)
        raise RuntimeError(f"not done within {timeout_s:.0f} s: {out}\n{log_tail()}")
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """The app and anything it started (its own process group)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--app-args", default="", help="extra arguments for app.py, one shell-quoted string")
    parser.add_argument("--until", choices=["model", "smollm2"], default="model",
                        help="stop each start once the start-up model is ready (default) or smollm2-mars too")
    parser.add_argument("--no-browser", action="store_true", help="time the HTTP answer only")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one start may take")
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose app.py starts (default: this one)")
    args = parser.parse_args(argv)
    app_args = shlex.split(args.app_args)
    print(f"load average before: {Path('/proc/loadavg').read_text().split()[:3]}; "
          f"{os.cpu_count()} CPUs; {args.repo}/app.py {' '.join(app_args)}", flush=True)
    rows = []
    pw = browser = None
    try:
        if not args.no_browser:
            from playwright.sync_api import sync_playwright
            pw = sync_playwright().start()
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        for i in range(args.runs):
            row = one_start(args.repo, app_args, args.until, browser, args.timeout)
            rows.append(row)
            print(f"start {i + 1}: " + ", ".join(f"{k} {v:.1f} s" for k, v in row.items()), flush=True)
            time.sleep(2)   # the killed app's memory and sockets go before the next start
    finally:
        if browser is not None:
            browser.close()
        if pw is not None:
            pw.stop()
    print(f"load average after: {Path('/proc/loadavg').read_text().split()[:3]}")
    for key in rows[0]:
        vals = [r[key] for r in rows if key in r]
        print(f"{key:>14}: median {statistics.median(vals):.1f} s (min {min(vals):.1f}, max {max(vals):.1f}, "
              f"n={len(vals)})")


if __name__ == "__main__":
    main()
