"""Every number the race shows, recomputed from the recorded decoder events by small independent functions.

The page's numbers come from app.race.SideRecord and app.render; these tests keep the raw mars_core events of a
real decode (tiny-mars, several lossless layouts, prompt lookup, lossy MARS, AR) and derive forwards, tokens,
tokens/forward, drafts checked and confirmed, and each ledger header from the events alone, without the app's
code, then compare with what the rendered HTML says.
"""
from __future__ import annotations

import re

import pytest

pytest.importorskip("gradio")

from app import generate, models  # noqa: E402
from app.race import SideRecord  # noqa: E402
from app.render import render_ledger, render_stats  # noqa: E402
from mars_core import DecodeConfig, generate_stream  # noqa: E402

SORT = "Sort in descending order: 91, 57, 59, 87"
COPY = "Repeat: 12 34 56 12 34 56 12 34"


@pytest.fixture(scope="module")
def tiny_mars():
    return models.get_model("tiny-mars")


def _events(lm, prompt: str, cfg: DecodeConfig) -> list:
    return [ev for ev in generate_stream(lm, [prompt], cfg) if ev.rows[0].active]


def _record(lm, lane: str, events: list) -> SideRecord:
    side = SideRecord({"ar": "AR", "verify": "MARS lossless", "mars": "MARS"}[lane], lane)
    for ev in events:
        side.add(ev, generate.token_texts(lm), generate._decoder(lm))
    side.finished = True
    return side


def _leading_equal(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def truth(events: list) -> dict:
    """The numbers, from the events only: a pass confirms the leading drafts of the pass before it that equal the
    tokens it committed (the first committed token that differs is AR's replacement)."""
    rows = [ev.rows[0] for ev in events]
    tokens = sum(len(r.accepted_ids) for r in rows)
    per_step = [(len(prev.drafts), _leading_equal(list(prev.drafts), list(r.accepted_ids)))
                for prev, r in zip(rows, rows[1:])]
    return {"forwards": len(rows), "tokens": tokens, "tpf": tokens / len(rows),
            "checked": sum(c for c, _ in per_step), "confirmed": sum(k for _, k in per_step), "per_step": per_step}


def _cell(html: str, key: str, lane: str) -> str:
    m = re.search(rf"<td class='stat-{key}-{lane}'>([^<]*)</td>", html)
    assert m, f"no {key} cell for {lane}"
    return m.group(1)


CONFIGS = [
    ("verify", SORT, dict(mode="verify", tau=0.5)),
    ("verify", SORT, dict(mode="verify", tau=0.3, draft_layout="tree")),
    ("verify", SORT, dict(mode="verify", tau=0.9, draft_layout="tree", tree_width=3)),
    ("verify", SORT, dict(mode="verify", tau=0.5, draft_layout="quadratic")),
    ("verify", COPY, dict(mode="verify", tau=0.9, prompt_lookup=3)),
    ("mars", SORT, dict(mode="mars", tau=0.5)),
    ("ar", SORT, dict(mode="mars", tau=1.0, block_size=1)),
]


@pytest.mark.parametrize("lane,prompt,kw", CONFIGS,
                         ids=[f"{c[0]}-{'-'.join(map(str, c[2].values()))}" for c in CONFIGS])
def test_the_stats_table_and_ledgers_say_what_the_events_say(tiny_mars, lane, prompt, kw):
    events = _events(tiny_mars, prompt, DecodeConfig(max_new_tokens=48, **kw))
    side = _record(tiny_mars, lane, events)
    want = truth(events)
    html = render_stats({lane: side})
    assert _cell(html, "forwards", lane) == str(want["forwards"])
    assert _cell(html, "tokens", lane) == str(want["tokens"])
    assert _cell(html, "tpf", lane) == f"{want['tpf']:.2f}"
    if lane != "verify":
        assert _cell(html, "drafts", lane) == "—"
        return
    drafts = _cell(html, "drafts", lane)
    ok, checked = (int(x) for x in re.match(r"(\d+) of (\d+)", drafts).groups())
    assert (ok, checked) == (want["confirmed"], want["checked"]) and ok <= checked
    alt = re.search(r"alternatives (\d+) of (\d+)", drafts)
    if alt:
        assert int(alt.group(1)) <= int(alt.group(2))
    for k, (n_checked, n_ok) in enumerate(want["per_step"], start=1):
        head = re.search(r"confirmed (\d+) of (\d+) drafts", render_ledger(side, k))
        assert (int(head.group(1)), int(head.group(2))) == (n_ok, n_checked), f"step {k}"


def test_a_tree_alternative_is_never_counted_as_a_draft(tiny_mars):
    """The case that once read "drafts confirmed 9 of 2 (450%)": passes that commit a runner-up (a leaf) where no
    draft was kept. The events' own `confirmed` counts the leaf; the page must not call it a draft."""
    seen_leaf = False
    for tau in (0.3, 0.6, 0.9, 0.99):
        events = _events(tiny_mars, SORT, DecodeConfig(mode="verify", tau=tau, draft_layout="tree", tree_width=3,
                                                       max_new_tokens=48))
        side = _record(tiny_mars, "verify", events)
        seen_leaf |= any(s.leaf_confirmed for s in side.steps)
        ok, checked = side.drafts_checked()
        assert ok <= checked and ok == truth(events)["confirmed"]
        alt_ok, alt_checked = side.alternatives_checked()
        assert alt_ok <= alt_checked
    assert seen_leaf, "no pass confirmed an alternative: pick settings that exercise the tree's leaves"


def test_a_sweeps_tau_off_row_is_ar_itself_not_a_measured_speedup():
    from app.explorer import same_as_ar, table_rows

    timed = {"mode": "mars", "tau": 1.0, "speedup": 1.263, "ar_time_s": 0.5, "mars_time_s": 0.396,
             "tokens_per_forward": 1.0, "quality": 1.0, "n": 4}
    row = same_as_ar(timed)
    assert row["speedup"] == 1.0 and row["mars_time_s"] == row["ar_time_s"] == 0.5
    assert table_rows([row])[0][0] == "AR (τ off)" and table_rows([row])[0][4] == 1.0
    lossy = dict(timed, tau=0.9)
    assert same_as_ar(lossy) == lossy


def test_the_biggest_chunk_named_after_the_race_is_the_pass_that_committed_most(tiny_mars):
    from app.generate import biggest_chunk

    events = _events(tiny_mars, SORT, DecodeConfig(mode="mars", tau=0.5, max_new_tokens=48))
    side = _record(tiny_mars, "mars", events)
    sizes = [len(ev.rows[0].accepted_ids) for ev in events]
    k = sizes.index(max(sizes))
    text, n, step = biggest_chunk(side)
    assert (n, step) == (max(sizes), events[k].step) and text == events[k].rows[0].text


def test_learn_steps_through_every_forward_pass_with_what_was_committed_before(tiny_mars):
    from app import learn

    events = learn.decode_steps(tiny_mars, SORT, 0.5, 4)
    assert len(events) > 2
    state = {"lm": tiny_mars, "prompt": SORT, "events": events}
    for k in (0, 1, len(events) - 1):
        view, _fig = learn.step_view(state, k)
        assert f"forward pass {k + 1} of {len(events)}" in view
        so_far = "".join(ev.rows[0].text for ev in events[: k + 1])
        assert re.search(r"answer so far: <b>(.*?)</b>", view, re.S).group(1) == __import__("html").escape(so_far)
        # the pass's committed tokens, as the table's "accepted" rows say
        assert view.count("class='acc'") == events[k].rows[0].n_accepted
    runs = list(learn.all_steps("tiny-mars", "", SORT, 0.5, False, 4, "prob"))
    view, _fig, slider, rec = runs[-1]
    assert len(rec["events"]) == len(events) and slider["maximum"] == len(events) - 1


def test_every_learn_step_keeps_the_note_of_what_was_cut(tiny_mars):
    from app import learn
    rec = list(learn.all_steps("tiny-mars", "", SORT, 0.3, False, 4, "prob"))[-1][-1]   # τ below 0.5: clamped
    assert rec["notes"] and len(rec["events"]) > 1
    for k in (0, len(rec["events"]) - 1):
        view, _fig = learn.step_view(rec, k)
        assert "✂ τ 0.3" in view and "model: <b>tiny-mars</b>" in view


def test_a_sweeps_time_left_is_the_pace_of_its_rows_so_far():
    from app.explorer import time_left
    assert time_left(10.0, 2, 5) == " · 10 s so far, about 15 s left at this pace"
    assert time_left(120.0, 1, 2) == " · 2.0 min so far, about 2.0 min left at this pace"
    assert time_left(7.4, 3, 3) == " · 7 s"


def test_a_sweep_promises_a_time_only_from_one_measured_here_and_shows_each_speedups_spread():
    import json
    import re

    from app import explorer
    from app.machine import Machine
    explorer._PACE.clear()
    args = ("tiny-mars", "", "free", 2, "1.0, 0.8, 0.7", "What is 12 + 30?\nSort in descending order: 3, 1, 2",
            4, 8, "prob", False)
    outs = list(explorer.run_sweep(*args, machine=Machine()))
    statuses = [o[0] for o in outs if isinstance(o[0], str)]   # the rest: "no change" while a row computes
    first = next(s for s in statuses if "sweeping: row 1 of 3" in s)
    assert "a time estimate follows the first row" in first and "about" not in first   # nothing measured yet
    assert any(re.search(r"1 of 3 rows done · row 2 of 3 … · \d+ s so far, about \d+ s left at this pace", s)
               for s in statuses), statuses
    rows = json.loads(open(outs[-1][3]).read())["rows"]
    table = outs[-1][2]
    for row, shown in zip(rows, table):
        if row.get("same_as_ar"):
            assert shown[5] == "same computation as AR"
            continue
        # the speedup is AR ÷ MARS of the median runs, inside the range of the per-repeat ratios it shows
        assert row["speedup"] == row["ar_time_s"] / row["mars_time_s"]
        assert shown[5] == f"{row['speedup_min']:.2f}–{row['speedup_max']:.2f} ({row['timing_repeats']})"
        assert row["speedup_min"] <= row["speedup"] <= row["speedup_max"] and row["timing_repeats"] == 2
    again = next(o[0] for o in explorer.run_sweep(*args, machine=Machine())
                 if isinstance(o[0], str) and "sweeping: row 1 of 3" in o[0])
    pace = re.search(r"about (\d+) s in all: the last sweep like this one here took (\d+) s a row", again)
    assert pace, again
