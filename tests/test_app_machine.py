"""Jobs follow their page (issue 32, items 2 and 4): one job at a time on the machine, in order, each waiting job
showing its place; a newer race of the same page stops the older one; a waiting job cuts the timing short; a
job whose page closed (its generator closed by Gradio) leaves the line, and a running sweep row or timing
repeat stops at its next forward pass; τ moved while waiting applies.
"""
from __future__ import annotations

import os
import re
import time
from contextlib import contextmanager
from types import SimpleNamespace

import gradio as gr
import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from app import explorer, generate, learn, models  # noqa: E402
from app.machine import Machine, take_turn, waiting_line  # noqa: E402

PROMPT = "What is 12 + 30?"


@pytest.fixture(scope="module")
def tiny_mars():
    return models.get_model("tiny-mars")


def _settings(tau=0.9, max_new=16, measure_after=False):
    return generate.RaceSettings.from_inputs(generate.RaceInputs(prompt=PROMPT, tau=tau, block_size=4,
                                                                 max_new_tokens=max_new,
                                                                 measure_after=measure_after))


def test_the_line_runs_jobs_in_order_and_tells_each_its_place():
    m = Machine()
    a, b, c = m.join("a race"), m.join("a τ sweep"), m.join("a race")
    assert m.wait_turn(a, 0) and not m.wait_turn(b, 0)
    assert m.ahead(b) == ["a race"] and m.ahead(c) == ["a race", "a τ sweep"] and m.others_waiting(a) == 2
    line = waiting_line(m.ahead(c))
    assert "position 2" in line and "a race is running" in line and "1 more job" in line
    m.leave(a)
    assert m.wait_turn(b, 0) and m.others_waiting(b) == 1
    m.leave(a)   # twice is harmless
    m.leave(b), m.leave(c)
    assert not m.busy()


def test_a_job_closed_while_it_waits_leaves_the_line():
    m = Machine()
    held = m.join("a race")
    gen = take_turn(m, "a τ sweep", lambda line: line)
    assert next(gen).startswith("◷ Waiting for the machine: position 1")
    gen.close()   # what Gradio does with the generator of a page that went away
    assert m.others_waiting(held) == 0
    m.leave(held)
    assert not m.busy()


@contextmanager
def slowed(lm, seconds: float):
    """Every forward of `lm` `seconds` slower while inside, as on a real model: tiny-mars alone is too fast on some
    CPUs for a test to close a page in the middle of its work."""
    from mars_core.decode.backend import net
    hook = net(lm).register_forward_pre_hook(lambda *_: time.sleep(seconds))
    try:
        yield
    finally:
        hook.remove()


def seconds_until_free(m: Machine, job) -> float:
    """Close `job` (what Gradio does when its page goes away) and wait, up to a minute, until `m` is free."""
    t0 = time.perf_counter()
    job.close()
    while m.busy() and time.perf_counter() - t0 < 60:
        time.sleep(0.01)
    return time.perf_counter() - t0


def test_a_sweep_whose_page_closed_frees_the_machine_within_its_row(tiny_mars):
    m = Machine()
    held = m.join("a race")
    args = ("tiny-mars", "", "free", 2, "1.0, 0.8", PROMPT, 4, 8, "prob", False)
    waiting = explorer.run_sweep(*args, machine=m)
    status, *_ = next(waiting)
    assert "position 1" in status and "a race is running" in status
    waiting.close()
    m.leave(held)
    # one row of 32 tasks decoded and timed, every forward 20 ms slower as on a real model (tiny-mars alone
    # finished such a row in about a second on a fast CPU): a minute of work, closed a second into it
    with slowed(tiny_mars, 0.02):
        long_row = ("tiny-mars", "", "builtin", 32, "0.9", "", 4, 64, "prob", False)
        running = explorer.run_sweep(*long_row, machine=m)
        while not next(running)[0].startswith("◔ sweeping: row 1 of 1"):
            pass                    # its turn came at once and the model is loaded: row 1 runs
        time.sleep(1.0)
        assert m.busy()
        shown = [next(running)[0] for _ in range(2)]   # what the page got meanwhile: no row finished
        assert not any("rows done" in s or s.startswith("✓") for s in shown if isinstance(s, str)), shown
        freed_after = seconds_until_free(m, running)   # the page closed mid-row
    assert freed_after <= 2.0, f"the machine was free {freed_after:.1f} s after the page closed"
    outs = list(explorer.run_sweep(*args, machine=m))   # the next sweep runs, a row at a time
    statuses = [o[0] for o in outs]
    assert any("1 of 2 rows done" in s for s in statuses) and statuses[-1].startswith("✓ 2 τ values")
    assert not m.busy()


def test_a_newer_race_of_the_same_page_stops_the_older_one(tiny_mars):
    m = Machine()
    old = generate.race_models(_settings(max_new=64), "tiny-mars", "tiny-mars", "page-1", machine=m)
    while not next(old)[0].startswith("▶ Racing"):
        pass
    new = generate.race_models(_settings(max_new=16), "tiny-mars", "tiny-mars", "page-1", machine=m)
    assert "position 1" in next(new)[0]          # the new race waits for the old one's next forward
    rest = list(old)
    assert not any(o[0].startswith("✓") for o in rest)   # it does not finish: its panes are the new race's now
    # its last word says why it stopped (an API client reads it), and touches the status line only
    assert rest[-1][0] == generate.REPLACED and all(v == gr.skip() for v in rest[-1][1:])
    last = list(new)[-1]
    assert last[0].startswith("✓ Done") and last[-1]["ar"].forwards == 16
    assert not m.busy()


def test_tau_moved_while_the_race_waits_is_the_tau_it_runs_at(tiny_mars):
    m = Machine()
    held = m.join("a τ sweep")
    race = generate.race_models(_settings(tau=0.9), "tiny-mars", "tiny-mars", "page-2", machine=m)
    first = next(race)
    assert "position 1" in first[0] and "a τ sweep is running" in first[0]
    assert all(v == gr.skip() for v in first[1:])   # the panes of the page's last race stay while it waits
    line = generate.set_tau(0.5, False, SimpleNamespace(session_hash="page-2"))
    assert "waiting for the machine" in line
    m.leave(held)
    last = list(race)[-1]
    assert "ran at MARS τ = 0.50" in last[1]
    assert "τ moved from 0.90 to 0.50 while the race waited" in last[0]
    assert {s.tau for s in last[-1]["mars"].steps} == {0.5}


class _OneWaiterAfter(Machine):
    """A machine on which another job joins the line after the race's first timing repeat."""

    def __init__(self):
        super().__init__()
        self.asked = 0

    def others_waiting(self, ticket):
        self.asked += 1
        return int(self.asked > 1)


def test_a_job_waiting_cuts_the_timing_short_and_the_race_says_so(tiny_mars):
    outs = list(generate.race_models(_settings(max_new=32, measure_after=True), "tiny-mars", "tiny-mars", "page-3",
                                     machine=_OneWaiterAfter()))
    last = outs[-1]
    assert last[0].startswith("✓ Done") and "Measured speedups" in last[0]
    stats = last[5]
    assert 'data-repeats="1"' in stats and 'data-bound="' not in stats
    # timed once out of the 2 or more repeats planned (how many fit the budget depends on the machine's speed)
    assert re.search(r"timed 1 of ([2-9]|[1-9]\d+) times|the bound was not measured", stats), stats[-300:]
    assert "a new job was waiting" in stats
    assert last[-1]["mars"].finished


def test_a_job_already_waiting_skips_the_timing(tiny_mars):
    class Busy(Machine):
        def others_waiting(self, ticket):
            return 1
    last = list(generate.race_models(_settings(max_new=16, measure_after=True), "tiny-mars", "tiny-mars", "page-4",
                                     machine=Busy()))[-1]
    assert last[0].startswith("✓ Done") and "Measured" not in last[0] and "data-repeats" not in last[5]
    # the true reason, not advice to tick the box that is ticked
    assert "another job was waiting" in last[0] and "gave way" in last[5] and "tick" not in last[5]


def test_a_race_whose_page_closed_during_the_timing_frees_the_machine_within_its_repeat(tiny_mars):
    # every forward 40 ms slower, as on a real model: one timing repeat (three decodes of 32 tokens) takes seconds
    with slowed(tiny_mars, 0.04):
        m = Machine()
        race = generate.race_models(_settings(max_new=32, measure_after=True), "tiny-mars", "tiny-mars", "page-5",
                                    machine=m)
        while "timing the decoders again" not in next(race)[0]:
            pass                # the answers are out: the timing starts
        started = time.perf_counter()
        while "timing again: repeat 1 of" not in next(race)[0]:
            pass                # the first repeat is done, the second one runs
        repeat_s = time.perf_counter() - started
        assert m.busy()
        freed_after = seconds_until_free(m, race)   # the page closed mid-repeat
    assert repeat_s > 1.5, f"a repeat took {repeat_s:.1f} s: too short to tell a cancelled repeat from a finished one"
    assert freed_after <= 1.0, (f"the machine was free {freed_after:.1f} s after the page closed "
                                f"(a repeat: {repeat_s:.1f} s)")


def test_a_learn_step_says_where_it_waits_and_then_lays_out_the_step(tiny_mars):
    m = Machine()
    held = m.join("a τ sweep")
    step = learn.one_step("tiny-mars", "", PROMPT, 0.9, False, 4, "prob", machine=m)
    waiting, fig = next(step)
    assert "position 1 in line (a τ sweep is running)" in waiting and fig == gr.skip()
    m.leave(held)
    html, fig = list(step)[-1]
    assert "model: <b>tiny-mars</b>" in html and html.count("<tr class=") == 4 and not m.busy()


def test_the_status_says_the_timing_runs_until_its_first_repeat_ends(tiny_mars):
    # a page that renders only some updates (a loaded CPU) must still read that the timing runs: the status the
    # handler repeats while the first repeat computes is the line that announced it, not the bare race summary
    with slowed(tiny_mars, 0.04):
        race = generate.race_models(_settings(max_new=32, measure_after=True), "tiny-mars", "tiny-mars", "page-6",
                                    machine=Machine())
        while "timing the decoders again" not in next(race)[0]:
            pass
        between = []
        for out in race:
            if "timing again: repeat" in out[0] or out[0].startswith("✓ Done"):
                break
            between.append(out[0])
        race.close()
    assert between, "no status came while the first repeat ran (it is seconds long here)"
    assert all("timing the decoders again" in line for line in between), between
