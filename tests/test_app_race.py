"""Handler tests for the honest race (issue 18) and its lossless lane (issue 22), without a browser.

The lanes are held against mars_core.generate (which no one in app/ wrote); the stale-state cases call
the handlers the page calls and read what the page would show.
"""
from __future__ import annotations

import os
import re

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from app import explorer, finetune_ui, generate, inputs, learn, models, notices, timing  # noqa: E402
from app.race import SideRecord, compare  # noqa: E402
from app.render import render_chunks, render_ledger, render_stats  # noqa: E402
from app.runs import JobManager  # noqa: E402
from tests.test_app import Event, Row  # noqa: E402  (the hand-made events both files feed the race)

SORT_PROMPT = "Sort in descending order: 91, 57, 59, 87"   # tiny-mars at τ 0.5: a rejected draft, MARS ≠ AR


def _race(*args, **kw):
    outs = list(generate.run_race(*args, **kw))
    return outs, outs[-1]


# ----------------------------------------------------------------------------- the lossless lane, hand-made

def _verify_record():
    """step 0: AR's token 1, drafts 2 3 4; step 1: 2 confirmed, 3 rejected (AR says 9), 4 dropped; step 2: end."""
    events = [Event(0, 0.9, 0.01, [Row([1], [2, 3, 4], [0.99, 0.95, 0.91], 1, text="a", drafts=[2, 3, 4])]),
              Event(1, 0.9, 0.01, [Row([2, 9], [5, 6, 7], [0.5, 0.4, 0.3], 2, text="bz", confirmed=1, rejected=3)]),
              Event(2, 0.9, 0.01, [Row([5], [], [], 1, done=True, text="e", finish_reason="eos")])]
    rec = SideRecord("MARS lossless", "verify")
    names = {1: "a", 2: "b", 3: "c", 4: "d", 5: "e", 6: "f", 7: "g", 9: "z"}
    for ev in events:
        rec.add(ev, names.get, lambda ids: "".join(names[i] for i in ids))
    return rec


def test_verify_chunks_mark_confirmed_drafts_and_strike_the_rejected_one():
    rec = _verify_record()
    html = render_chunks(rec)
    assert html.count('class="chunk') == 3
    assert '<span class="verified">b</span>' in html                    # the confirmed draft
    assert '<del class="rejected" title="rejected drafts">cd</del>' in html   # the rejected draft and the one after it
    assert '<span class="replacement">z</span>' in html                 # AR's replacement
    assert 'data-confirmed="1" data-rejected="1"' in html
    assert "draft c rejected: AR&#x27;s token there is z" in html
    ok, checked = rec.drafts_checked()
    assert (ok, checked) == (1, 3)
    assert rec.positions_fed() == [1 + 3 + 3, 1 + 0 + 0]   # AR's token + the drafts + the masks


def test_verify_ledger_lists_the_checked_drafts_and_the_new_proposals():
    rec = _verify_record()
    first = render_ledger(rec, 0)
    assert "No drafts to check" in first and first.count("kept as a draft") == 3
    second = render_ledger(rec, 1)
    assert "confirmed: equal to AR&#x27;s token" in second
    assert "rejected: AR&#x27;s token is z — it replaces the draft" in second
    assert "dropped: an earlier draft was rejected" in second
    assert second.count("not drafted: a draft was rejected") == 3   # the masks saw the wrong token


def test_running_verify_lane_shows_the_drafts_awaiting_their_check():
    rec = _verify_record()
    rec.steps, rec.finished = rec.steps[:1], False
    assert '<span class="pending-drafts"' in render_chunks(rec) and ">bcd</span>" in render_chunks(rec)


# ----------------------------------------------------------------------------- equal work
def test_compare_names_the_first_difference_and_the_share_that_agrees():
    same = compare(list("abcd"), list("abcd"))
    assert same.identical and same.share == 1.0
    diff = compare(list("abxd"), list("abcd"))
    assert not diff.identical and diff.first_diff == 2 and (diff.lane_token, diff.ar_token) == ("x", "c")
    assert diff.agree == 3 and diff.aligned == 4
    short = compare(list("ab"), list("abcd"))
    assert short.first_diff == 2 and short.lane_token == "" and short.ar_token == "c"


@pytest.fixture(scope="module")
def tiny_mars():
    return models.get_model("tiny-mars")


def test_verify_lane_writes_exactly_the_ar_lanes_tokens(tiny_mars):
    from mars_core import DecodeConfig, generate as core_generate
    for prompt, tau in ((SORT_PROMPT, 0.5), (models.example_prompts("tiny-mars")[0], 0.9)):
        outs, last = _race(generate.RaceInputs(model="tiny-mars", prompt=prompt, tau=tau, block_size=4,
                                               max_new_tokens=64, measure_after=False))
        state = last[-1]
        assert state["verify"].token_ids == state["ar"].token_ids
        want = core_generate(tiny_mars, [prompt], DecodeConfig(mode="verify", tau=tau, max_new_tokens=64))[0]
        assert state["verify"].token_ids == want.token_ids and state["verify"].forwards == want.forwards
        assert state["verify"].forwards < state["ar"].forwards
        assert last[3].count('class="chunk') == state["verify"].forwards
    # the sort prompt at τ 0.5: a draft is rejected, struck through in the lane, and still the answer is AR's
    outs, last = _race(generate.RaceInputs(model="tiny-mars", prompt=SORT_PROMPT, tau=0.5, block_size=4,
                                           max_new_tokens=64, measure_after=False))
    assert any(s.rejected is not None for s in last[-1]["verify"].steps)
    assert '<del class="rejected"' in last[3] and 'data-rejected="1"' in last[3]


def test_different_answers_are_never_called_a_speedup(tiny_mars):
    outs, last = _race(generate.RaceInputs(model="tiny-mars", prompt=SORT_PROMPT, tau=0.5, block_size=4,
                                           max_new_tokens=64, measure_after=False))
    state, stats = last[-1], last[5]
    assert state["mars"].token_ids != state["ar"].token_ids
    mars_line = re.search(r'data-lane="mars">(.*?)</div></div>', stats, re.S).group(0)
    assert "time ratio" in mars_line and "speedup" not in mars_line.split("<b")[0]
    assert "⚠ different answer: first difference at token" in mars_line and "of tokens agree" in mars_line
    assert "not timed again after the race" in mars_line and 'id="speedup-value">—<' in mars_line   # no number
    verify_line = re.search(r'data-lane="verify">(.*?)</div></div>', stats, re.S).group(0)
    assert "speedup" in verify_line and "✓ same answer as AR" in verify_line
    assert "<td class='stat-same-mars'>no</td>" in stats and "<td class='stat-same-verify'>yes</td>" in stats


def test_temperature_runs_without_the_lossless_lane_and_says_why(tiny_mars):
    outs, last = _race(generate.RaceInputs(model="tiny-mars", prompt=SORT_PROMPT, tau=0.9, block_size=4,
                                           max_new_tokens=16, temperature=1.0, measure_after=False, seed=3))
    assert last[0].startswith("✓") and not last[-1]["verify"].steps
    assert "temperature 0 only" in last[3] and "temperature 0 only" in last[5]
    again = _race(generate.RaceInputs(model="tiny-mars", prompt=SORT_PROMPT, tau=0.9, block_size=4,
                                      max_new_tokens=16, temperature=1.0, measure_after=False, seed=3))[1]
    assert again[-1]["mars"].token_ids == last[-1]["mars"].token_ids      # the seed decides the sample
    free = "Tell me a story about a cat."   # not a suite task: flat enough for samples to differ
    runs = {s: _race(generate.RaceInputs(model="tiny-mars", prompt=free, tau=0.9, block_size=4, max_new_tokens=16,
                                         temperature=2.0, measure_after=False, seed=s))[1][-1]
            for s in (1, 1, 2, 3)}
    first = _race(generate.RaceInputs(model="tiny-mars", prompt=free, tau=0.9, block_size=4, max_new_tokens=16,
                                      temperature=2.0, measure_after=False, seed=1))[1][-1]
    assert first["ar"].token_ids == runs[1]["ar"].token_ids
    assert any(runs[s]["ar"].token_ids != first["ar"].token_ids for s in (2, 3))


# ----------------------------------------------------------------------------- the measured speedup
def test_repeats_cover_about_a_second_or_five():
    assert timing.repeats_for(0.05) == 20 and timing.repeats_for(0.5) == 5 and timing.repeats_for(3.0) == 5
    assert timing.repeats_for(0.0001) == timing.MAX_REPEATS


def test_the_repeats_fit_in_the_timing_budget():
    assert timing.repeats_within(0.05) == 20                      # a tiny model: about a second, as before
    assert timing.repeats_within(3.0) == 3 and timing.repeats_within(4.0) == 2   # a real model: within 10 s
    assert timing.repeats_within(30.0) == 1                       # a long answer is still timed once
    assert timing.repeats_within(3.0, budget_s=100.0) == 5


def test_bound_is_tokens_per_forward_times_the_forward_cost_ratio():
    costs = {1: 1.0, 2: 1.0, 7: 1.5}
    # AR 13 forwards (12 after the prompt); the lane 3 more forwards, each feeding 7 positions at cost 1.5
    b, ratio, fed, mean_cost = timing.bound(13, [7, 7, 7], 1.0, costs)
    assert ratio == 4.0 and fed == 7 and mean_cost == 1.5 and b == pytest.approx(4.0 / 1.5)
    # per-step work outside the forward makes a wider step relatively cheaper
    b2, *_ = timing.bound(13, [7, 7, 7], 1.0, costs, overhead=1.0)
    assert b2 == pytest.approx(12 * 2.0 / (3 * 2.5))


def test_the_race_ends_with_a_measured_median_and_spread_next_to_its_bound(tiny_mars):
    outs, last = _race(generate.RaceInputs(model="tiny-mars", prompt=models.example_prompts("tiny-mars")[0],
                                           tau=0.9, block_size=4, max_new_tokens=64))
    assert any("timing again: repeat 1 of" in o[0] for o in outs)
    # the answers and tokens/forward went out when the race ended, before the first repeat
    ended = next(k for k, o in enumerate(outs) if o[0].startswith("✓ Race finished"))
    assert "timing again: repeat" not in outs[ended][0] and "MARS" in outs[ended][0]
    assert isinstance(outs[ended][-1], dict) and outs[ended][-1]["mars"].finished
    assert last[0].startswith("✓ Done") and "Measured speedups below the table" in last[0]
    stats = last[5]
    for vid in ("speedup-value", "speedup-verify"):
        tag = re.search(rf'<b id="{vid}"([^>]*)>([\d.]+)×</b>', stats)
        assert tag, stats
        d = dict(re.findall(r'data-([\w-]+)="([\d.]+)"', tag.group(1)))
        assert float(d["min"]) <= float(d["median"]) <= float(d["max"]) and int(d["repeats"]) >= 1
        assert float(d["bound"]) > 1.0
    assert "measured: median of" in stats and "expected bound" in stats and "min " in stats


# ----------------------------------------------------------------------------- notices and examples
def test_tiny_models_on_free_text_get_a_notice_and_suite_tasks_do_not():
    task = models.example_prompts("tiny-mars")[0]
    assert notices.is_suite_task(task) and not notices.is_suite_task("What is the capital of France?")
    text, offer, off = notices.notice("tiny-mars", "Tell me a story about a cat.", 0.9)
    assert "trained only on the built-in task suite" in text and not off
    assert offer == ("smollm2-mars" if models.smollm2_mars_available() else None)
    assert notices.notice("tiny-mars", task, 0.9)[0] == ""
    md, model_btn, off_btn, offered = generate.notice_update("tiny-mars", "", "Tell me a story.", 0.9, False)
    assert md["visible"] and "task suite" in md["value"] and off_btn["visible"] is False
    md, *_ = generate.notice_update("tiny-mars", "", task, 0.9, False)   # the cause went away: so does the notice
    assert md["visible"] is False and md["value"] == ""


def test_a_never_mars_trained_model_in_mars_mode_is_offered_one_token_mode():
    text, offer, off = notices.notice("smollm2", "What is the capital of France?", 0.9)
    assert "never MARS-trained" in text and off
    assert notices.notice("smollm2", "What is the capital of France?", 1.0)[0] == ""   # τ off: nothing to say
    text, offer, off = notices.notice("tiny-ar-sft", models.example_prompts("tiny-mars")[0], 0.9)
    assert "never MARS-trained" in text and offer == "tiny-mars" and off
    assert notices.notice("smollm2-mars", "What is the capital of France?", 0.9)[0] == ""
    outs, last = _race(generate.RaceInputs(model="tiny-mars", prompt="Tell me a story about a cat.", tau=0.9,
                                           block_size=4, max_new_tokens=8, measure_after=False))
    assert "ℹ" in last[0] and "task suite" in last[0]


def test_examples_and_the_example_prompt_follow_the_model():
    tiny = models.example_prompts("tiny-mars")
    natural = models.example_prompts("smollm2")
    ex, prompt = generate.examples_and_prompt("smollm2", "", tiny[0])
    assert ex["choices"] == natural and prompt["value"] == natural[0]
    assert ex["value"] == natural[0]          # the list shows the example the prompt now holds, not an empty field
    ex, prompt = generate.examples_and_prompt("smollm2", "", "my own question")   # the user's text stays
    assert prompt == {"__type__": "update"} and ex["value"] is None


# ----------------------------------------------------------------------------- state that is always current
def test_the_teaching_examples_are_development_prompts_and_a_real_language_model_gets_a_note():
    from finetune.evals.natural import natural_prompts
    from finetune.evals.structured import structured_prompts
    from app import pick_examples
    dev = (natural_prompts("heldout", 200, seed=pick_examples.DEV_SEED)
           + structured_prompts("heldout", 200, seed=pick_examples.DEV_SEED))
    report = (natural_prompts("heldout", 64, seed=pick_examples.REPORT_SEED)
              + structured_prompts("heldout", 64, seed=pick_examples.REPORT_SEED))
    assert all(p in dev and p not in report for p in models.TEACHING_PROMPTS)
    assert set(pick_examples.candidates(32)) <= set(dev) - set(report)
    assert models.example_prompts("smollm2-mars")[:len(models.TEACHING_PROMPTS)] == models.TEACHING_PROMPTS
    assert not set(models.example_prompts("smollm2")) & set(models.TEACHING_PROMPTS)
    note = notices.teaching_note("smollm2-mars")
    assert "What you are seeing" in note and "AR's exactly" in note
    assert notices.teaching_note("smollm2") == "" and notices.PREDICT in note
    assert notices.teaching_note("tiny-mars") == notices.PREDICT   # every MARS model asks before the race
    # on a projector the note must leave the lanes on the first screen: what shows unfolded is one short line
    # (the question) and a summary; the explanation is folded (1024x768 looked at: lanes' first lines at y 733)
    shown, folded = note.split("<details>")
    assert len(re.sub(r"\*\*", "", shown).strip()) <= 120 and "AR's exactly" in folded
    assert generate.teaching_note_update("nope")["visible"] is False


def test_tau_typed_out_of_range_is_clamped_with_a_note_and_the_race_repeats_it(tiny_mars):
    class Req:
        session_hash = "clamp-session"
    line = generate.set_tau(1.5, False, Req())
    assert line.startswith("τ = off (applies to the next run") and "τ 1.50 is above the range" in line
    assert "None" not in line
    # the page may hand the race the clamped value: the race still says what happened, and what ran
    outs, last = _race(generate.RaceInputs(model="tiny-mars", prompt=SORT_PROMPT, tau=1.0, block_size=4,
                                           max_new_tokens=8, measure_after=False), request=Req())
    assert "✂ τ 1.50 is above the range" in last[0] and last[1] == "ran at MARS τ = off · MARS lossless τ = off"
    outs, last = _race(generate.RaceInputs(model="tiny-mars", prompt=SORT_PROMPT, tau=0.0, block_size=4,
                                           max_new_tokens=8, measure_after=False))
    assert "✂ τ 0.00 is below the range 0.50..1.00: ran with 0.50" in last[0]
    assert last[1] == "ran at MARS τ = 0.50 · MARS lossless τ = 0.50"


def test_a_long_prompt_is_cut_with_a_note(tiny_mars):
    outs, last = _race(generate.RaceInputs(model="tiny-mars", prompt="Sort in descending order: 1, 2" + " " * 19970,
                                           tau=0.9, block_size=4, max_new_tokens=8, measure_after=False))
    assert "✂ the prompt has 20,000 characters: cut to the first 4,000 (the limit)" in last[0]


def test_a_slider_value_out_of_range_raises_no_toast():
    import gradio as gr
    slider = inputs.lenient(gr.Slider(0.5, 1.0, value=0.9))
    assert slider.preprocess(1.5) == 1.5 and slider.preprocess(0) == 0.0   # the handler clamps, with a note
    with pytest.raises(gr.Error):
        gr.Slider(0.5, 1.0, value=0.9).preprocess(1.5)   # what a plain slider does: a toast per event


def test_the_race_and_sweep_wait_for_the_machine_outside_gradios_queue(tmp_path):
    from app.ui import build_ui
    demo = build_ui("tiny-mars", runs_dir=tmp_path / "runs")
    fns = list(demo.fns.values())
    race = [f for f in fns if getattr(f.fn, "__name__", "") == "race_fn"]
    assert len(race) == 2   # the button and Enter in the prompt
    status = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "race-status")
    for f in race:   # no Gradio progress text in the status line; Race pressed again reaches the server
        assert f.show_progress == "hidden" and f.concurrency_limit is None and f.trigger_mode == "multiple"
        assert f.outputs[0] is status and f.outputs[1].elem_id == "tau-status"
    sweep = next(f for f in fns if getattr(f.fn, "func", None) is explorer.run_sweep)
    assert sweep.show_progress == "hidden" and sweep.concurrency_limit is None
    seed = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "seed")
    assert seed.visible is False   # shown only when temperature > 0
    temp = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "temperature")
    show = next(f for f in fns if (temp._id, "change") in f.targets and f.outputs == [seed])
    assert show.fn(0.7)["visible"] is True and show.fn(0)["visible"] is False


def test_switching_the_dataset_replaces_the_upload_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{broken\n")
    upload, report, msg = finetune_ui.data_source_changed("builtin", str(bad))
    assert report == "" and msg == "" and upload["visible"] is False
    upload, report, msg = finetune_ui.data_source_changed("upload", str(bad))
    assert "bad line" in report and upload["visible"] is True


def test_finetune_messages_never_show_none_and_long_runs_are_warned_not_refused(tmp_path):
    jobs = JobManager(tmp_path / "runs")
    args = ["tiny-ar-sft", "builtin", None, "mars", 4, 1.0]
    msg = finetune_ui.command_preview(jobs, *args, None, 1e-3, False)
    assert "None" not in msg and "steps is empty: type a whole number in 1..100000" in msg
    msg = finetune_ui.command_preview(jobs, *args, 600, None, False)
    assert "None" not in msg and "learning rate is empty" in msg
    preview = finetune_ui.command_preview(jobs, *args, 100000, 1e-3, False)
    assert "⚠ this run would take about" in preview and "--max-steps 100000" in preview   # warned, still runnable
    assert "⚠" not in finetune_ui.command_preview(jobs, *args, 600, 1e-3, False)
    html = finetune_ui.status_html({"name": "x", "state": "running", "step": 5, "max_steps": 100000,
                                    "eta_s": 63780})
    assert "over an hour" in html and "1063 min" in html


def test_zero_finetune_steps_get_a_message_in_the_tab_not_a_silent_pass(tmp_path):
    import json
    jobs = JobManager(tmp_path / "runs")
    args = ["tiny-ar-sft", "builtin", None, "mars", 4, 1.0]
    for zero in (0, 0.0):
        preview = finetune_ui.command_preview(jobs, *args, zero, 1e-3, False)
        assert preview.startswith("⚠ steps 0 would train nothing") and "--max-steps" not in preview
        msg = finetune_ui.start(jobs, *args, zero, 1e-3, False)
        assert msg.startswith("⚠ steps 0 would train nothing") and "1..100000" in msg
    assert jobs.list_runs() == []                         # nothing was started
    assert "steps -3 is out of range" in finetune_ui.command_preview(jobs, *args, -3, 1e-3, False)
    # the field hands a 0 to those handlers: no Gradio bound refuses it first with a toast the tab never shows
    from app.ui import build_ui
    demo = build_ui("tiny-mars", runs_dir=tmp_path / "runs")
    steps = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "ft-steps")
    assert steps.preprocess(0) == 0
    (run := jobs.runs_dir / "20261202-000000-mars").mkdir()   # a 1-step run joins the picker marked as such
    (ckpt := run / "checkpoint-1").mkdir()
    (ckpt / "config.json").write_text("{}")
    (run / "status.json").write_text(json.dumps({"state": "finished", "step": 1, "max_steps": 1,
                                                 "last_checkpoint": str(ckpt)}))
    labels = dict((v, lab) for lab, v in models.Resolver(jobs).choices())
    assert labels["run:20261202-000000-mars"] == "run: 20261202-000000-mars (your finetune) ⚠ barely trained: 1 step"
    assert labels["tiny-mars"] == dict((v, lab) for lab, v in models.builtin_models())["tiny-mars"]
    (run / "status.json").write_text(json.dumps({"state": "stopped", "step": models.BARELY_TRAINED_STEPS,
                                                 "max_steps": 600, "last_checkpoint": str(ckpt)}))
    assert "barely" not in dict((v, lab) for lab, v in models.Resolver(jobs).choices())["run:20261202-000000-mars"]
    (run / "job.json").write_text(json.dumps({"pid": -1}))   # as the tab's own runs have (no live process)
    picker = finetune_ui.poll(jobs, {})[3]                 # the poll that adds runs to the picker labels them too
    assert picker["choices"] == models.Resolver(jobs).choices()


def test_load_estimates_are_honest(monkeypatch):
    from mars_core.models import sources
    monkeypatch.setattr(models, "_cache", {})   # the first load of a fresh server also imports the libraries
    assert models.load_estimate("tiny-mars") == f"(about 2 s; {models.LIBRARIES_ESTIMATE})"
    monkeypatch.setattr(models, "_cache", {"a model": object()})
    assert models.load_estimate("tiny-mars") == "(about 2 s)"
    monkeypatch.setattr(sources, "is_prepared", lambda name: False)
    assert "30-40 s" in models.load_estimate("smollm2")
    monkeypatch.setattr(sources, "is_prepared", lambda name: True)
    assert "10-15 s" in models.load_estimate("smollm2-mars")
    monkeypatch.setattr(models, "is_loaded", lambda name: False)
    monkeypatch.setattr(models, "load_with_timing", lambda name: (_ for _ in ()).throw(ValueError("stop")))
    first = next(iter(generate.load_model_ui("smollm2", "")))
    assert "10-15 s" in first and "a few seconds" not in first


# ----------------------------------------------------------------------------- Learn and the explorer
def test_learn_step_text_and_readable_mask_labels(tiny_mars):
    event = learn.first_step(tiny_mars, models.example_prompts("tiny-mars")[0], 0.5, 8)
    html = learn.step_html(tiny_mars, "x", event)
    assert len(event.rows[0].candidates) == 8          # the Learn tab's own B reaches the decoder
    assert "t₀..t0" not in html and "t₀ was accepted" in html
    fig = learn.mask_figure(32, 4)
    assert len(fig.layout.xaxis.tickvals) <= 16 and fig.layout.xaxis.tickfont.size >= 11
    assert len(learn.mask_figure(8, 4).layout.xaxis.tickvals) == 16   # small n: every position


def test_coincident_pareto_points_share_one_label():
    # every τ at 100% agreement and nearly the same tokens/forward: the plot used to be a stack of τ labels
    rows = [{"tau": t, "quality": 1.0, "tokens_per_forward": 1.02 + 0.0001 * k, "speedup": 0.95, "n": 5,
             "mode": "mars", "quality_name": "agreement with AR"} for k, t in enumerate([1.0, 0.95, 0.9, 0.8])]
    rows.append({**rows[0], "tau": 0.6, "tokens_per_forward": 1.4})
    fig = explorer.pareto_figure(rows)
    texts = sorted(a.text for a in fig.layout.annotations if a.text.startswith("τ"))
    # tokens/forward: 0.6 stands apart; speedup: all five coincide
    assert texts == ["τ=0.6", "τ=0.6, 0.8, 0.9, 0.95, off", "τ=0.8, 0.9, 0.95, off"], texts
    assert len(fig.data[0].x) == 5   # the markers stay, one per τ


def test_explorer_labels_do_not_overlap():
    pts = [(90.0, 3.0 + 0.01 * k, f"τ={0.9 - 0.05 * k:g}") for k in range(6)] + [(95.0, 1.0, "τ=off")]
    xr, yr = explorer._range([p[0] for p in pts]), explorer._range([p[1] for p in pts], floor=0.0)
    shifts = explorer.place_labels(pts, xr, yr)
    W, H = explorer.PANEL_PX
    boxes = []
    for (x, y, t), (dx, dy, collided) in zip(pts, shifts):
        cx = (x - xr[0]) / (xr[1] - xr[0]) * W + dx
        cy = (y - yr[0]) / (yr[1] - yr[0]) * H + dy
        w = explorer.CHAR_PX * len(t) + 4
        boxes.append((cx - w / 2, cy - 7, cx + w / 2, cy + 7))
        assert not collided
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not (a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]), (a, b)


def test_explorer_lossless_curve_keeps_ars_answers(tiny_mars):
    prompts = models.example_prompts("tiny-mars")[:2]
    rows = explorer.sweep_free(tiny_mars, prompts, [1.0, 0.6], 4, 32, lossless=True)
    lossless = [r for r in rows if r["mode"] == "verify"]
    assert [r["tau"] for r in lossless] == [0.6]
    assert lossless[0]["quality"] == 1.0 and lossless[0]["tokens_per_forward"] > 1.0   # AR's answers, faster
    fig = explorer.pareto_figure(rows)
    assert {t.name for t in fig.data} == {"MARS (lossy)", "MARS lossless (verify)"} and len(fig.data) == 4
    assert sorted(a.text for a in fig.layout.annotations if a.text.startswith("τ")) == sorted(
        ["τ=off", "τ=0.6", "τ=0.6"] * 2)
    assert explorer.table_rows(rows)[-1][:2] == ["lossless", 0.6]


def test_a_warning_goes_when_an_input_it_was_about_changes(tmp_path):
    assert generate.clear_warning("⚠ the prompt is empty: type a question") == ""
    assert generate.clear_warning("<p>⚠ n = 40 is out of range</p>") == ""
    assert generate.clear_warning("✓ Done: MARS 3.81 tokens/forward") == {"__type__": "update"}   # stays
    from app.ui import build_ui
    demo = build_ui("tiny-mars", runs_dir=tmp_path / "runs")
    by_id = {getattr(b, "elem_id", None): b for b in demo.blocks.values()}
    clears = [f for f in demo.fns.values() if f.fn is generate.clear_warning]
    cleared = {f.outputs[0].elem_id for f in clears}
    assert cleared == {"race-status", "sweep-status", "learn-step", "ft-msg"}
    prompt_events = {f.outputs[0].elem_id for f in clears if (by_id["prompt"]._id, "change") in f.targets}
    assert prompt_events == {"race-status", "learn-step"}


def test_a_race_whose_tau_moved_is_timed_again_with_the_same_tau_schedule(tiny_mars, monkeypatch):
    monkeypatch.setattr(generate, "YIELD_EVERY_S", 0.0)

    class Req:
        session_hash = "replay-session"
    gen = generate.run_race(generate.RaceInputs(model="tiny-mars", prompt=SORT_PROMPT, tau=0.95, block_size=4,
                                                max_new_tokens=64), request=Req())
    outs = [next(gen) for _ in range(4)]
    assert "next forward pass" in generate.set_tau(0.5, False, Req())
    outs += list(gen)
    last = outs[-1]
    state = last[-1]
    assert len(set(state["mars"].taus)) == 2 and "→" in last[1]
    assert re.search(r'<b id="speedup-value" data-median', last[5])
    assert "another answer than the race" not in last[5]   # the replayed τ schedule wrote the race's answer
    # and the replay itself: the decoder reads τ once a step
    from mars_core import DecodeConfig, generate as core_generate
    again = core_generate(tiny_mars, [SORT_PROMPT], DecodeConfig(mode="mars", max_new_tokens=64),
                          tau_control=timing.ReplayTau(state["mars"].taus))[0]
    assert again.token_ids == state["mars"].token_ids


def _record_slow_motion(monkeypatch) -> tuple[dict, list, list]:
    """(the lanes' warm costs as measured, every pause, every forward as (lane, step, positions, time)), filled in
    as a race runs; the pauses are recorded, not slept."""
    paces, slept, ran = {}, [], []
    real_warm, real_race = generate.warm_costs, generate.race

    def warm(prompt, lanes, forwards=6):
        paces.update(real_warm(prompt, lanes, forwards))
        return paces

    def race(**kw):
        for n, event in real_race(**kw):
            ran.append((n, event.step, event.positions, event.step_time))
            yield n, event
    monkeypatch.setattr(generate, "warm_costs", warm)
    monkeypatch.setattr(generate, "race", race)
    monkeypatch.setattr(generate.time, "sleep", slept.append)
    return paces, slept, ran


def _warm(pace, step: int, fed: int) -> float:
    """A forward's warm cost by hand: the prompt pass, a one-position pass (τ off: no masks), or a later pass."""
    if step == 0:
        return pace.prompt_s
    return pace.one_s if fed == 1 and pace.one_s is not None else pace.step_s


def test_slow_motion_paces_by_each_lanes_warm_cost_and_quotes_no_cold_times(tiny_mars, monkeypatch):
    # Forwards that follow a pause run cold and unevenly (tiny-mars's up to 70× their time after ×50 pauses, and
    # a pause proportional to that time fed back on itself), so slow motion pauses by each lane's warm time.
    paces, slept, ran = _record_slow_motion(monkeypatch)
    outs, last = _race(generate.RaceInputs(model="tiny-mars", prompt=SORT_PROMPT, tau=0.9, block_size=4,
                                           max_new_tokens=24, slow_motion="50", measure_after=False))
    state, stats = last[-1], last[5]
    assert set(paces) == {"ar", "verify", "mars"}
    for n, pace in paces.items():   # timed back to back: each a small fraction of a second
        assert 0 < pace.prompt_s < 1 and 0 < pace.step_s < 1, (n, pace)
    # every forward is followed by its pause: 50 × its lane's warm cost, less the time the forward itself took
    cost = {n: [_warm(paces[n], step, fed) for m, step, fed, _ in ran if m == n] for n in paces}
    want = [max(0.0, 50 * _warm(paces[n], step, fed) - took) for n, step, fed, took in ran]
    assert slept == pytest.approx(want) and len(slept) == sum(state[n].forwards for n in paces)
    for n in paces:   # what one decode of the lane takes warm: the repeats after a slowed race are sized by it
        assert state[n].pace == paces[n] and state[n].round_time == pytest.approx(sum(cost[n]))
    # and the lanes ran in the order of their warm costs (the lane with the least so far next; ties by lane order)
    spent, order = {n: 0.0 for n in generate.LANES}, []
    left = {n: list(c) for n, c in cost.items()}
    while any(left.values()):
        n = min((m for m in generate.LANES if left[m]), key=lambda m: (spent[m], generate.LANES.index(m)))
        spent[n] += left[n].pop(0)
        order.append(n)
    assert order == [n for n, *_ in ran]
    # the lanes' times are cold, so the page shows no tokens/s, time or one-run ratio for them, and says why
    for n in ("ar", "verify", "mars"):
        assert state[n].slowed == 50
        assert f"<td class='stat-tps-{n}'><span title" in stats and f"<td class='stat-time-{n}'><span title" in stats
        assert 'class="score-tps">–<' in last[{"ar": 2, "verify": 3, "mars": 4}[n]]
        assert 'data-slowed="50"' in last[{"ar": 2, "verify": 3, "mars": 4}[n]]
    assert "this race, one run" not in stats and "slow motion ×50: each forward ran after a pause" in stats
    # timed again after a slowed race: as many repeats as its warm round fits, and the estimate says so (warm
    # costs set here far from the measured times, so the two cannot agree by chance)
    monkeypatch.setattr(generate, "warm_costs", lambda prompt, lanes, forwards=6:
                        {n: generate.WarmCost(0.5, 0.2) for n in lanes})
    outs, last = _race(generate.RaceInputs(model="tiny-mars", prompt=SORT_PROMPT, tau=0.9, block_size=4,
                                           max_new_tokens=24, slow_motion="50"))
    state = last[-1]
    warm = sum(0.5 + 0.2 * (state[n].forwards - 1) for n in ("ar", "verify", "mars"))
    assert sum(state[n].round_time for n in ("ar", "verify", "mars")) == pytest.approx(warm)
    repeats = timing.repeats_within(warm)
    line = next(o[0] for o in outs if isinstance(o[0], str) and "timing again: repeat" in o[0])
    assert f"of {repeats} (the decoders alternating; about {warm * repeats:.0f} s in all)" in line, line
    # and a real-time race quotes them as before
    outs, last = _race(generate.RaceInputs(model="tiny-mars", prompt=SORT_PROMPT, tau=0.9, block_size=4,
                                           max_new_tokens=24, measure_after=False))
    assert "this race, one run" in last[5] and "slowed" not in last[5] and 'data-slowed="1"' in last[4]


def test_tau_off_in_a_slowed_race_paces_the_mars_lanes_by_a_one_position_forward(tiny_mars, monkeypatch):
    # τ off mid-race: the MARS lanes append no masks, so their forwards cost AR's one-position forward. Paced by
    # the masked cost they would crawl beside AR while doing AR's work, and the race would schedule them so.
    monkeypatch.setattr(generate, "YIELD_EVERY_S", 0.0)
    paces, slept, ran = _record_slow_motion(monkeypatch)

    class Req:
        session_hash = "tau-off-slowed"
    gen = generate.run_race(generate.RaceInputs(model="tiny-mars", prompt=SORT_PROMPT, tau=0.9, block_size=4,
                                                max_new_tokens=64, slow_motion="50", measure_after=False),
                            request=Req())
    while len(ran) < 9:   # a few forwards of each lane at τ 0.9
        next(gen)
    generate.set_tau(0.9, True, Req())
    last = list(gen)[-1]
    state = last[-1]
    assert paces["ar"].one_s is None and paces["mars"].one_s is not None and paces["verify"].one_s is not None
    assert 0 < paces["mars"].one_s < 1
    off = [(step, fed) for n, step, fed, _ in ran if n == "mars" and fed == 1 and step > 0]
    assert 1.0 in state["mars"].taus and 0.9 in state["mars"].taus and len(off) >= 3, (state["mars"].taus, off)
    # every pause by hand: a τ-off forward of a MARS lane by its one-position warm cost
    assert slept == pytest.approx([max(0.0, 50 * _warm(paces[n], step, fed) - took) for n, step, fed, took in ran])
    assert state["mars"].round_time == pytest.approx(sum(_warm(paces["mars"], s.step, s.positions)
                                                         for s in state["mars"].steps))
    # the ledger of such a step gives the warm time it was shown for, not the cold time the forward took
    k = next(k for k, s in enumerate(state["mars"].steps) if s.positions == 1 and s.step > 0)
    head = render_ledger(state["mars"], k)
    assert f"{paces['mars'].one_s * 1000:.1f} ms warm, shown ×50 slower" in head
    assert f"{state['mars'].steps[k].step_time * 1000:.1f} ms<" not in head
    head = render_ledger(state["mars"], 1)
    assert f"{paces['mars'].step_s * 1000:.1f} ms warm, shown ×50 slower" in head


def test_empty_fields_are_named_not_shown_as_none(tmp_path):
    messages = []
    for args in ((SORT_PROMPT, None, False, 4, 32, 0.0), (SORT_PROMPT, 0.9, False, 4, None, 0.0)):
        with pytest.raises(ValueError) as err:
            inputs.check_inputs(*args)
        messages.append(str(err.value))
    for crit in (None, ""):
        with pytest.raises(ValueError) as err:
            inputs.check_criterion(crit)
        messages.append(str(err.value))
    outs = list(generate.run_race(generate.RaceInputs(model="tiny-mars", prompt=SORT_PROMPT, tau=0.9, block_size=4,
                                                      max_new_tokens=8, slow_motion=None, measure_after=False)))
    messages.append(outs[-1][0])
    jobs = JobManager(tmp_path / "runs")
    messages.append(finetune_ui.command_preview(jobs, None, "builtin", None, "mars", 4, 1.0, 600, 1e-3, False))
    assert all("None" not in m and m for m in messages), messages
    assert "τ is empty" in messages[0] and "max new tokens is empty" in messages[1]
    assert "no confidence criterion is chosen" in messages[2] and "slow motion is empty" in messages[4]
    assert "no base model is chosen" in messages[5]


def test_learn_step_says_the_answer_ended_not_that_a_token_was_rejected(tiny_mars):
    """A pass whose second token is end-of-turn: the masks after it were not used because the answer ended; none was
    rejected, so no row may say so, whatever their confidences."""
    from types import SimpleNamespace

    from mars_core.decode.events import RowStep
    eos = tiny_mars.tokenizer.eos_token_id
    row = RowStep(accepted_ids=[5, eos], candidates=[5, eos, 7, 8], confidences=[0.9, 0.99, 0.98, 0.2], n_accepted=2,
                  done=True, active=False, finish_reason="eos")
    html = learn.step_html(tiny_mars, "x", SimpleNamespace(rows=[row], tau=0.9))
    assert html.count("not used — the answer ended (end of turn) before it") == 2
    assert "rejected" not in html and html.count("accepted —") == 2
    # the answer going on and t2 below τ: t2 is rejected and t3 dropped behind it
    row.finish_reason, row.done, row.candidates[1], row.confidences[2] = None, False, 6, 0.5
    html = learn.step_html(tiny_mars, "x", SimpleNamespace(rows=[row], tau=0.9))
    assert "rejected — c = 0.500 &lt; τ = 0.90; stops the pass" in html
    assert "dropped — t2 was rejected before it" in html and "not used" not in html
