"""Handler tests of the Gradio app, without a browser.

Pure pieces (the race scheduler, rendering, diff, validation) use hand-made events; the
handlers run on a random 2-layer Llama written to a temp dir (tests/tiny_fixtures.py) and are
held against mars_core.generate, which no one in app/ wrote.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from app import explorer, finetune_ui, generate, inputs, learn, models, plots, race_settings  # noqa: E402
from app.race import SideRecord, compare, race  # noqa: E402
from app.render import render_chunks, render_ledger, render_stats, stop_reason  # noqa: E402
from app.runs import FinetuneRequest, JobManager, build_command  # noqa: E402


# ----------------------------------------------------------------------------- fake events
@dataclass
class Row:
    accepted_ids: list
    candidates: list
    confidences: list
    n_accepted: int
    done: bool = False
    active: bool = True
    text: str = ""
    finish_reason: str | None = None
    drafts: list = field(default_factory=list)   # verify-mode fields (tests/test_app_race.py)
    confirmed: int = 0
    rejected: int | None = None


@dataclass
class Event:
    step: int
    tau: float
    step_time: float
    rows: list = field(default_factory=list)


def fake_stream(costs, log, name, n_tokens=1, tau=0.9):
    """A decoder whose k-th forward costs costs[k] seconds; records when it is pulled."""
    for k, c in enumerate(costs):
        log.append(name)
        done = k == len(costs) - 1
        ids = list(range(10 * k, 10 * k + n_tokens))
        yield Event(k, tau, c, [Row(ids, ids + [99], [0.99] * n_tokens + [0.1], n_tokens, done,
                                    text=f"<{name}{k}>", finish_reason="eos" if done else None)])


def test_race_runs_the_side_with_less_compute_next():
    log = []
    # MARS forwards cost 3 s, AR forwards 1 s: after MARS's first pass AR catches up three times.
    order = [s for s, _ in race(fake_stream([3, 3, 3], log, "mars"), fake_stream([1] * 7, log, "ar"))]
    assert order == ["mars", "ar", "ar", "ar", "mars", "ar", "ar", "ar", "mars", "ar"]
    assert log == order  # a side's forward runs only when the scheduler picks it


def test_race_ties_go_to_mars_and_the_survivor_runs_alone():
    order = [s for s, _ in race(fake_stream([1], [], "mars"), fake_stream([1, 1, 1], [], "ar"))]
    assert order == ["mars", "ar", "ar", "ar"]


def test_race_orders_by_the_given_cost_not_the_measured_time():
    # slow motion's forwards run cold, so their measured times are uneven; the race then orders by each lane's
    # warm cost: here MARS forwards measured 1 s but cost 3, AR's measured 5 s but cost 1: the order of the
    # first test, not the measured one
    lanes = {"mars": fake_stream([1, 1, 1], [], "mars"), "ar": fake_stream([5] * 7, [], "ar")}
    order = [s for s, _ in race(lanes=lanes, cost=lambda lane, event: 3.0 if lane == "mars" else 1.0)]
    assert order == ["mars", "ar", "ar", "ar", "mars", "ar", "ar", "ar", "mars", "ar"]


def _record(events, mode="mars"):
    rec = SideRecord(mode.upper(), mode)
    for ev in events:
        rec.add(ev, lambda t: f"tok{t}")
    return rec


def test_side_record_measures_follow_the_spec_definitions():
    rec = _record(fake_stream([0.5, 0.5, 1.0], [], "mars", n_tokens=3))
    assert rec.forwards == 3 and rec.n_tokens == 9
    assert rec.tokens_per_forward == pytest.approx(3.0)
    assert rec.compute_time == pytest.approx(2.0)
    assert rec.tokens_per_s == pytest.approx(4.5)
    assert rec.finished
    ar = _record(fake_stream([0.25] * 9, [], "ar"), "ar")
    cmp = compare(rec.token_strings, ar.token_strings)   # MARS wrote 3 tokens a pass, AR 1: different answers
    assert not cmp.identical and cmp.first_diff == 1 and cmp.lane_token == "tok1" and cmp.ar_token == "tok10"


def test_chunks_one_span_per_forward_with_confidence_tooltips_and_tau_marks():
    events = list(fake_stream([0.1] * 4, [], "mars", n_tokens=2))
    events[2].tau = events[3].tau = 0.6   # τ moved before step 2
    rec = _record(events)
    html = render_chunks(rec)
    assert html.count('class="chunk n2"') == 4
    assert html.count("tau-mark") == 1 and "τ→0.60" in html
    assert "step 1 · 2 tokens" in html and "conf 0.990" in html
    assert "&lt;mars0&gt;" in html and "<mars0>" not in html   # model text is escaped


def test_ledger_names_the_candidate_that_stopped_the_pass():
    rec = _record(fake_stream([0.1, 0.1], [], "mars", n_tokens=2))
    text = render_ledger(rec, 0)
    assert text.count("<tr class='acc'>") == 2 and text.count("<tr class='stop'>") == 1
    assert "candidate t2 has confidence 0.100 &lt; τ = 0.90" in text
    full = rec.steps[0]
    full.n_accepted, full.confidences = 3, [0.99, 0.99, 0.99]
    assert "block is full" in stop_reason(full)


def test_stats_show_every_lane():
    m, a = _record(fake_stream([1], [], "mars", 2)), _record(fake_stream([1, 1], [], "ar"), "ar")
    html = render_stats({"ar": a, "mars": m}, ar_label="AR (same model)")
    assert "tokens/forward" in html and "<td class='stat-tokens-mars'>2</td>" in html
    assert "AR (same model)" in html
    # one race is only noise: without a measurement there is no headline number, only the race's own ratio
    assert '<b id="speedup-value">—</b>' in html and "this race, one run: 2.00×" in html



def test_token_diff_aligns_insertions_and_replacements():
    aligned = plots.token_diff(["a", "b", "c", "d"], ["a", "x", "c", "d", "e"])
    assert [k for k, _, _ in aligned] == ["equal", "replace", "equal", "equal", "only AR"]
    assert "2 of 2 aligned tokens equal" in plots.diff_html(["a", "b"], ["a", "b"])


def test_the_token_diff_counts_what_it_shows_one_cell_per_aligned_pair():
    """The title's "k of n" is recomputed from the cells it draws; tokens are escaped and whitespace shown."""
    import re

    mars, ar = ["Hi", " <b>", "\n", "x", "&"], ["Hi", " <i>", "\n", "&", "y"]
    out = plots.diff_html(mars, ar)
    cells = re.findall(r'<span class="dt (\w[\w-]*)" title="[^"]*"><i>(.*?)</i><i>(.*?)</i></span>', out)
    kinds = [k for k, _, _ in cells]
    assert len(cells) == len(plots.token_diff(mars, ar))
    assert f"{kinds.count('same')} of {len(cells)} aligned tokens equal" in out
    assert kinds.count("same") == 3 and set(kinds) - {"same"}   # Hi, ⏎ and & match; the rest differs
    assert ("changed", "·&lt;b&gt;", "·&lt;i&gt;") in cells and ("same", "⏎", "⏎") in cells
    assert "<b>" not in out.replace("<b>Token diff", "").replace("</b>", "")   # no token's markup reaches the page
    only = [c for c in cells if c[0] in ("only-mars", "only-ar")]
    assert all("&nbsp;" in (a, b) for _, a, b in only)   # the side without a token shows an empty cell


def test_the_tokens_per_forward_plot_states_each_lanes_mean_of_its_bars():
    """The dashed lines' values are in the title (labels on the lines collide on a phone); each is the mean of the
    bars drawn, which is tokens committed ÷ forwards of the lane's steps."""
    mars = _record(fake_stream([0.1] * 4, [], "mars", n_tokens=3))
    mars.steps[1].n_accepted = 1
    verify = _record(fake_stream([0.1] * 3, [], "verify", n_tokens=2), mode="verify")
    fig = plots.tokens_per_forward_figure(mars, verify)
    bars = {t.name: list(t.y) for t in fig.data}
    assert bars == {"MARS": [3, 1, 3, 3], "MARS lossless": [2, 2, 2]}
    assert fig.layout.title.text.endswith("dashed: the mean — MARS 2.50, MARS lossless 2.00</sup>")
    assert [round(shape.y0, 2) for shape in fig.layout.shapes] == [2.5, 2.0]
    assert not fig.layout.annotations
    alone = plots.tokens_per_forward_figure(mars)
    assert "MARS 2.50</sup>" in alone.layout.title.text and "lossless" not in alone.layout.title.text


def test_acceptance_rate_per_slot():
    rec = _record(fake_stream([0.1] * 4, [], "mars", n_tokens=2))
    rec.steps[0].n_accepted = 1
    rates = plots.acceptance_by_slot(rec)
    assert [round(r, 2) for _, r, _ in rates] == [1.0, 0.75, 0.0]


# ----------------------------------------------------------------------------- validation
def test_generate_inputs_refuse_only_what_cannot_run():
    for args, word in ((("", 0.9, False, 4, 32, 0.0), "empty"), (("hi", "abc", False, 4, 32, 0.0), "τ is 'abc'"),
                       (("hi", 0.9, False, None, 32, 0.0), "block size B is empty")):
        with pytest.raises(ValueError, match=word):
            inputs.check_inputs(*args)


@pytest.mark.parametrize("args, index, value, note", [
    (("hi", 0.0, False, 4, 32, 0.0), 1, 0.5, "τ 0.00 is below the range 0.50..1.00: ran with 0.50"),
    (("hi", 1.5, False, 4, 32, 0.0), 1, 1.0, "τ 1.50 is above the range 0.50..1.00: ran with 1.00 (one-token mode)"),
    (("hi", 0.9, False, 1, 32, 0.0), 2, 2, "block size B 1 is below the range 2..8: ran with 2"),
    (("hi", 0.9, False, 4, 100000, 0.0), 3, 512, "max new tokens 100000 is above the range 1..512: ran with 512"),
    (("hi", 0.9, False, 4, 32, -1.0), 4, 0.0, "temperature -1 is below the range 0..2: ran with 0"),
    (("x" * 20000, 0.9, False, 4, 32, 0.0), 0, "x" * 4000,
     "the prompt has 20,000 characters: cut to the first 4,000 (the limit)"),
])
def test_out_of_range_inputs_are_clamped_or_cut_with_a_note(args, index, value, note):
    out = inputs.check_inputs(*args)
    assert out[index] == value and out[-1] == [note]
    assert inputs.check_inputs("hi", 0.9, False, 4, 32, 0.0)[-1] == []   # in range: no note


@pytest.mark.parametrize("prompt, tau, tau_off", [("hi", 0.9, False), ("hi", 1.5, False), ("hi", 0.1, True),
                                                  ("x" * 20000, 0.0, False)])
def test_the_learn_tabs_prompt_and_tau_check_is_the_generate_tabs(prompt, tau, tau_off):
    full = inputs.check_inputs(prompt, tau, tau_off, 4, 32, 0.0)
    assert inputs.check_prompt_and_tau(prompt, tau, tau_off) == (full[0], full[1], full[-1])
    for bad in (("", 0.9, False), ("hi", "abc", False), ("hi", None, False)):
        with pytest.raises(ValueError) as learn_err:
            inputs.check_prompt_and_tau(*bad)
        with pytest.raises(ValueError) as generate_err:
            inputs.check_inputs(*bad, 4, 32, 0.0)
        assert str(learn_err.value) == str(generate_err.value)


@pytest.mark.parametrize("choice, free, word", [
    ("evil-model", "", "not in the list"),
    ("tiny-mars", "/no/such/dir", "does not exist"),
    ("tiny-mars", "not a hub id!", "not a local path"),
    ("run:../../etc", "", "not allowed"),
])
def test_model_names_are_confined(tmp_path, choice, free, word):
    jobs = JobManager(tmp_path / "runs")
    with pytest.raises(ValueError, match=word):
        models.Resolver(jobs).resolve(choice, free)


def test_hub_ids_and_existing_dirs_pass(tmp_path):
    assert models.resolve("tiny-mars", "owner/model-1") == "owner/model-1"
    (tmp_path / "config.json").write_text("{}")
    assert models.resolve("tiny-mars", str(tmp_path)) == str(tmp_path.resolve())


def test_run_names_cannot_leave_the_runs_dir(tmp_path):
    jobs = JobManager(tmp_path / "runs")
    for bad in ("../x", "a/b", "", ".hidden", "x" * 80):
        with pytest.raises(ValueError):
            jobs.run_dir(bad)
    assert jobs.run_dir("ok-1").parent == (tmp_path / "runs").resolve()


def test_finetune_request_is_validated():
    with pytest.raises(ValueError, match="stage"):
        FinetuneRequest(base_model="tiny-ar-sft", stage="rl")
    with pytest.raises(ValueError, match="learning rate"):
        FinetuneRequest(base_model="tiny-ar-sft", lr=0)
    cmd = build_command(FinetuneRequest(base_model="tiny-ar-sft", lora=True, max_steps=7), Path("/r/x"))
    assert cmd[1:4] == ["-m", "accelerate.commands.launch", "--num_processes"] and "--cpu" in cmd
    assert cmd[cmd.index("-m", 2) + 1] == "finetune.train"
    assert cmd[cmd.index("--max-steps") + 1] == "7" and "--lora" in cmd
    assert cmd[cmd.index("--output-dir") + 1] == "/r/x"
    assert "--random-block-offset" in cmd   # MARS trains on a shifted block grid; AR-SFT has no blocks
    assert "--random-block-offset" not in build_command(FinetuneRequest(base_model="tiny-ar-sft", stage="ar-sft"),
                                                        Path("/r/x"))


def test_training_uses_bf16_autocast_only_on_a_cpu_with_native_bf16(tmp_path, monkeypatch):
    from app import runs
    from finetune.config import native_bf16_cpu

    (tmp_path / "zen4").write_text("processor : 0\nflags : fpu avx2 avx512f avx512_bf16 avx512_vnni\n")
    (tmp_path / "old").write_text("processor : 0\nflags : fpu avx2 avx512f\n")
    assert native_bf16_cpu(tmp_path / "zen4") and not native_bf16_cpu(tmp_path / "old")
    assert not native_bf16_cpu(tmp_path / "missing")
    monkeypatch.setattr(runs, "_gpu_visible", lambda: False)
    for native in (True, False):
        monkeypatch.setattr(runs, "native_bf16_cpu", lambda: native)
        cmd = build_command(FinetuneRequest(base_model="tiny-ar-sft"), Path("/r/x"))
        if native:
            assert cmd[cmd.index("--mixed-precision") + 1] == "bf16" and cmd[cmd.index("--attention") + 1] == "eager"
        else:
            assert "--mixed-precision" not in cmd and "--attention" not in cmd


def test_uploaded_jsonl_reports_every_bad_line(tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad_role = {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(good) + "\n{not json\n\n" + json.dumps(bad_role) + "\n")
    ok, report = finetune_ui.validate_jsonl(str(path))
    assert not ok
    assert "1 valid conversation(s), 2 bad line(s)" in report
    assert "line 2: not valid JSON" in report and "line 4" in report and "robot" in report
    path.write_text(json.dumps(good) + "\n")
    assert finetune_ui.validate_jsonl(str(path))[0]
    other = tmp_path / "data.csv"
    other.write_text("a,b\n")
    assert not finetune_ui.validate_jsonl(str(other))[0]


def test_taus_are_parsed_and_checked():
    assert explorer.parse_taus("1.0, 0.9 0.8;0.9") == [1.0, 0.9, 0.8]
    for bad in ("", "0.2", "abc", "1.5"):
        with pytest.raises(ValueError):
            explorer.parse_taus(bad)


def test_attention_mask_heatmap_is_the_training_mask():
    from tests.test_losses import EXPECTED_N8_B4   # the hand-written n = 8, B = 4 matrix
    fig = learn.mask_figure(8, 4)
    expected = [[int(c) for c in row] for row in EXPECTED_N8_B4.split()]
    assert [[int(v) for v in row] for row in fig.data[0].z] == expected
    names = {a.text for a in fig.layout.annotations}
    assert {"<b>noisy → noisy</b>", "<b>noisy → clean</b>", "<b>clean → clean</b>",
            "<b>clean → noisy (never)</b>"} <= names
    with pytest.raises(ValueError):
        learn.mask_figure(100, 4)


# ----------------------------------------------------------------------------- on a tiny model
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.tiny_fixtures import make_tiny_model_dir
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model"))


def _final(outputs):
    return outputs[-1]


def test_race_outputs_equal_mars_core_generate(tiny_dir):
    from mars_core import DecodeConfig, generate as core_generate
    outs = list(generate.run_race(generate.RaceInputs(model="tiny-mars", free_text=tiny_dir,
                                                      prompt="What is 12 + 30?", tau=0.6, block_size=4,
                                                      max_new_tokens=20, measure_after=False)))
    status, tau_line, ar_html, verify_html, mars_html, stats, *_rest, state = _final(outs)
    assert status.startswith("✓"), status
    mars, ar = state["mars"], state["ar"]
    lm = models.get_model(tiny_dir)
    want_mars = core_generate(lm, ["What is 12 + 30?"], DecodeConfig(mode="mars", tau=0.6, block_size=4,
                                                                     max_new_tokens=20))[0]
    want_ar = core_generate(lm, ["What is 12 + 30?"], DecodeConfig(mode="ar", max_new_tokens=20))[0]
    assert mars.token_ids == want_mars.token_ids and ar.token_ids == want_ar.token_ids
    assert mars.forwards == want_mars.forwards and ar.forwards == want_ar.forwards
    assert mars_html.count('class="chunk') == mars.forwards
    assert "forwards" in stats


def test_the_lossless_lane_races_in_the_chosen_draft_layout_and_marks_copied_drafts(tiny_dir):
    # quadratic layout + prompt lookup: the lane is still exactly AR's answer, the decoder's own run, and drafts
    # that came from the text so far are marked in the pane (with a key) and explained in the ledger
    from app.render import render_ledger
    from mars_core import DecodeConfig, generate as core_generate
    prompt = "Hello there, tell me a long story about cats."
    outs = list(generate.run_race(generate.RaceInputs(model="tiny-mars", free_text=tiny_dir, prompt=prompt, tau=0.9,
                                                      block_size=8, max_new_tokens=48, measure_after=False,
                                                      draft_layout="quadratic", copy_drafts=True)))
    status, _, _, verify_html, *_rest, state = _final(outs)
    assert status.startswith("✓"), status
    verify, ar = state["verify"], state["ar"]
    assert verify.token_ids == ar.token_ids and verify.layout == "quadratic"
    lm = models.get_model(tiny_dir)
    want = core_generate(lm, [prompt], DecodeConfig(mode="verify", tau=0.9, block_size=8, max_new_tokens=48,
                                                    draft_layout="quadratic", prompt_lookup=race_settings.LOOKUP_N))[0]
    assert verify.forwards == want.forwards < ar.forwards
    copied = [k for k, s in enumerate(verify.steps) if s.draft_source == "prompt"]
    assert copied and 'class="verified from-prompt"' in verify_html and "prompt lookup" in verify_html
    assert "Prompt lookup: the last tokens occurred earlier" in render_ledger(verify, copied[0])
    assert verify.positions_fed() == [s.positions for s in verify.steps[1:]]
    with pytest.raises(ValueError, match="draft layout 'star' is unknown"):
        generate.RaceSettings.from_inputs(generate.RaceInputs(prompt=prompt, tau=0.9, block_size=4,
                                                              max_new_tokens=8, draft_layout="star"))


def test_the_tree_layout_races_exactly_and_its_ledger_shows_the_alternatives(tiny_dir):
    from app.render import render_ledger
    # the embedded tiny-mars (its masks are trained, so some runner-up tokens are likely enough to be tried)
    prompt = "Sort these numbers: 42, 7, 19, 3"
    outs = list(generate.run_race(generate.RaceInputs(model="tiny-mars", prompt=prompt, tau=0.3, block_size=4,
                                                      max_new_tokens=60, measure_after=False, draft_layout="tree")))
    verify, ar = _final(outs)[-1]["verify"], _final(outs)[-1]["ar"]
    assert verify.token_ids == ar.token_ids and verify.layout == "tree"
    offered = [k for k, s in enumerate(verify.steps) if s.leaves]
    assert offered, "the tree layout offered no alternatives on this prompt"
    assert "runner-up tokens checked" in render_ledger(verify, offered[0] + 1)


@pytest.mark.parametrize("choice,layout,width", [("one-mask", "linear", 2), ("one-mask-tree", "tree", 3)])
def test_the_one_mask_choices_race_lossless_with_one_mask_a_group_while_mars_keeps_b(choice, layout, width):
    from mars_core import generate as core_generate
    prompt = "Sort these numbers: 42, 7, 19, 3"
    settings = generate.RaceSettings.from_inputs(generate.RaceInputs(prompt=prompt, tau=0.3, block_size=4,
                                                                     max_new_tokens=40, draft_layout=choice))
    verify_cfg, mars_cfg = settings.config("verify"), settings.config("mars")
    assert (verify_cfg.block_size, verify_cfg.draft_layout, verify_cfg.tree_width) == (2, layout, width)
    assert mars_cfg.block_size == 4
    outs = list(generate.run_race(generate.RaceInputs(model="tiny-mars", prompt=prompt, tau=0.3, block_size=4,
                                                      max_new_tokens=40, measure_after=False, draft_layout=choice)))
    state = _final(outs)[-1]
    verify, ar, mars = state["verify"], state["ar"], state["mars"]
    assert verify.token_ids == ar.token_ids and verify.layout == layout
    want = core_generate(models.get_model("tiny-mars"), [prompt], verify_cfg)[0]
    assert verify.forwards == want.forwards and max(len(s.candidates) for s in verify.steps) == 1
    assert max(len(s.candidates) for s in mars.steps) == 4


def test_the_fastest_choice_times_all_of_b_one_mask_and_runner_ups():
    assert generate.lossless_candidates(4) == [("linear", 4, 2), ("linear", 2, 2), ("tree", 2, 3)]
    assert generate.lossless_candidates(2) == [("linear", 2, 2), ("tree", 2, 3)]


@pytest.mark.parametrize("slow", [("linear", 4), ("linear", 2), ("tree", 2)])
def test_the_fastest_choice_picks_the_layout_that_decoded_fastest_and_times_it_once(tiny_dir, monkeypatch, slow):
    # a fake clock: every candidate's decode takes 1 s, except that `slow`'s takes 3 s and the first of the others
    # takes 2 s, so the pick is the last of the fast ones (the best of two runs decides)
    import mars_core.tools.fastest
    lm = models.get_model("tiny-mars")   # loaded (and warmed up) before the decoder is faked
    now, runs = [0.0], []

    def fake_generate(lm, prompts, cfg):
        runs.append((cfg.draft_layout, cfg.block_size, cfg.tree_width, cfg.tau, cfg.mode))
        fast = [c for c in generate.lossless_candidates(4) if c[:2] != slow]
        now[0] += 3.0 if (cfg.draft_layout, cfg.block_size) == slow else (
            2.0 if (cfg.draft_layout, cfg.block_size) == fast[0][:2] else 1.0)
        return []
    monkeypatch.setattr(mars_core.tools.fastest, "generate", fake_generate)
    monkeypatch.setattr(generate.timing, "clock_for", lambda lm: (lambda: now[0], "fake"))
    monkeypatch.setattr(race_settings, "_fastest", {})
    pick, why = generate.fastest_lossless(lm, "tiny-mars", 0.7, 4)
    fast = [c for c in generate.lossless_candidates(4) if c[:2] != slow]
    assert pick == fast[1]
    assert len(runs) == 6 and {r[:3] for r in runs} == set(generate.lossless_candidates(4))
    assert all(r[3:] == (0.7, "verify") for r in runs)
    assert generate.fastest_lossless(lm, "tiny-mars", 0.7, 4) == (pick, why) and len(runs) == 6   # cached
    assert "3000 ms" in why and "1000 ms" in why
    generate.fastest_lossless(lm, "tiny-mars", 0.8, 4)   # another τ is another setting: timed again
    assert len(runs) == 12


def test_a_fastest_race_is_lossless_and_says_which_layout_it_took(tiny_dir, monkeypatch):
    monkeypatch.setattr(race_settings, "_fastest", {})
    prompt = "Sort these numbers: 42, 7, 19, 3"
    outs = list(generate.run_race(generate.RaceInputs(model="tiny-mars", prompt=prompt, tau=0.7, block_size=4,
                                                      max_new_tokens=40, measure_after=False,
                                                      draft_layout=generate.FASTEST)))
    state = _final(outs)[-1]
    verify, ar = state["verify"], state["ar"]
    assert verify.token_ids == ar.token_ids
    assert any("Timing the lossless layouts" in o[0] for o in outs)
    (layout, block, width), why = generate.fastest_lossless(models.get_model("tiny-mars"), "tiny-mars", 0.7, 4)
    assert verify.layout == layout and why in outs[-1][0]
    settings = generate.RaceSettings.from_inputs(generate.RaceInputs(prompt=prompt, tau=0.7, block_size=4,
                                                                     max_new_tokens=40,
                                                                     draft_layout=generate.FASTEST))
    assert settings.pick_fastest(models.get_model("tiny-mars"), "tiny-mars") == why
    cfg = settings.config("verify")
    assert (cfg.draft_layout, cfg.block_size, cfg.tree_width) == (layout, block, width)
    assert max(len(s.candidates) for s in verify.steps) <= block


def test_the_page_opens_on_the_fastest_lossless_choice(tmp_path):
    from app.ui import build_ui
    picker = _dropdown(build_ui("tiny-mars", runs_dir=tmp_path / "runs"), "draft-layout")
    assert picker.value == generate.FASTEST == _values(picker.choices)[0]


def test_confidence_criterion_reaches_the_mars_decoder(tiny_dir):
    # A race, the Learn step and a sweep pass the page's choice on: the confidences shown are the decoder's
    # own for that criterion (they differ between criteria).
    from mars_core import DecodeConfig, generate_stream
    lm = models.get_model(tiny_dir)
    prompt = "What is 12 + 30?"
    first = {}
    for crit in ("prob", "entropy"):
        outs = list(generate.run_race(generate.RaceInputs(model="tiny-mars", free_text=tiny_dir, prompt=prompt,
                                                          tau=0.6, block_size=4, max_new_tokens=8, criterion=crit,
                                                          measure_after=False)))
        mars = _final(outs)[-1]["mars"]
        want = next(generate_stream(lm, [prompt], DecodeConfig(tau=0.6, max_new_tokens=8, criterion=crit)))
        assert mars.steps[0].confidences == pytest.approx(want.rows[0].confidences)
        assert learn.first_step(lm, prompt, 0.6, 4, crit).rows[0].confidences == pytest.approx(
            want.rows[0].confidences)
        first[crit] = want.rows[0].confidences
    assert first["prob"] != pytest.approx(first["entropy"])
    rows = explorer.sweep_free(lm, [prompt], [0.6], 4, 8, criterion="margin")
    assert rows[0]["criterion"] == "margin"
    outs = list(generate.run_race(generate.RaceInputs(model="tiny-mars", free_text=tiny_dir, prompt=prompt, tau=0.6,
                                                      block_size=4, max_new_tokens=8, criterion="nope",
                                                      measure_after=False)))
    assert outs[-1][0].startswith("⚠") and "'nope'" in outs[-1][0] and "entropy" in outs[-1][0]


def test_moving_tau_mid_race_changes_the_next_forward(tiny_dir, monkeypatch):
    monkeypatch.setattr(generate, "YIELD_EVERY_S", 0.0)

    class Req:
        session_hash = "test-session"
    gen = generate.run_race(generate.RaceInputs(model="tiny-mars", free_text=tiny_dir,
                                                prompt="Sort the list: 3, 1, 2.", tau=0.9, block_size=4,
                                                max_new_tokens=24, measure_after=False), request=Req())
    outs = [next(gen) for _ in range(4)]
    msg = generate.set_tau(0.55, False, Req())
    assert "next forward pass" in msg
    outs += list(gen)
    state = _final(outs)[-1]
    for lane in ("mars", "verify"):   # the slider steers both MARS lanes
        taus = [s.tau for s in state[lane].steps]
        assert taus[0] == pytest.approx(0.9) and taus[-1] == pytest.approx(0.55)
    assert "τ→0.55" in _final(outs)[4]
    assert _final(outs)[1] == "ran at MARS τ = 0.90 → 0.55 · MARS lossless τ = 0.90 → 0.55"   # the τ that ran
    assert "next run" in generate.set_tau(0.7, False, Req())   # the race ended: nothing to steer


def test_bad_inputs_give_a_message_not_an_exception(tiny_dir):
    outs = list(generate.run_race(generate.RaceInputs(model="tiny-mars", free_text=tiny_dir, prompt="", tau=0.9,
                                                      block_size=4, max_new_tokens=20)))
    assert outs[-1][0].startswith("⚠") and "the prompt is empty" in outs[-1][0]
    outs = list(generate.load_model_ui("tiny-mars", "/definitely/not/here"))
    assert outs[-1].startswith("⚠") and "does not exist" in outs[-1]


def test_learn_step_comes_from_the_first_decoder_event(tiny_dir):
    lm = models.get_model(tiny_dir)
    event = learn.first_step(lm, "What is 12 + 30?", 0.6, 4)
    html = learn.step_html(lm, "What is 12 + 30?", event)
    assert html.count("<tr class=") == 4 and "position" in html
    assert event.step == 0 and len(event.rows[0].candidates) == 4


def test_free_prompt_sweep_agrees_with_ar_at_tau_one(tiny_dir):
    lm = models.get_model(tiny_dir)
    rows = explorer.sweep_free(lm, ["What is 2 + 2?", "Reverse the word abc."], [1.0, 0.6], 4, 12)
    assert rows[0]["tau"] == 1.0 and rows[0]["quality"] == 1.0 and rows[0]["tokens_per_forward"] == 1.0
    fig = explorer.pareto_figure(rows)
    assert len(fig.data) == 2
    assert json.loads(Path(explorer.export_json(rows, {"m": 1})).read_text())["rows"][1]["tau"] == 0.6


def test_failed_finetune_run_shows_exit_code_and_log(tmp_path):
    jobs = JobManager(tmp_path / "runs", launcher="plain")
    name = jobs.start(FinetuneRequest(base_model=str(tmp_path / "missing-model"), max_steps=2))
    deadline = time.time() + 120
    while jobs.is_running(name) and time.time() < deadline:
        time.sleep(0.5)
    time.sleep(0.2)
    st = jobs.status(name)
    assert st["state"] == "failed" and st["exit_code"] not in (None, 0)
    html = finetune_ui.status_html(st)
    assert "exit code" in html
    _, _, tail, *_ = finetune_ui.poll(jobs, {})
    assert "missing-model" in tail
    assert jobs.finished_checkpoints() == []


def _finished_run(runs: Path, name: str) -> Path:
    """A run folder as finetune.train leaves it, enough for JobManager.finished_checkpoints."""
    (ckpt := runs / name / "checkpoint-5").mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    (runs / name / "status.json").write_text(json.dumps({"state": "finished", "step": 5, "max_steps": 5,
                                                         "last_checkpoint": str(ckpt)}))
    return ckpt.resolve()


def test_each_page_resolves_runs_in_its_own_runs_folder(tmp_path):
    """The model resolver belongs to the page build_ui made: a second page with another runs folder neither
    takes it over nor sees the first page's runs."""
    from app.ui import build_ui
    ckpt = _finished_run(tmp_path / "runs-a", "run-a")
    page_a = build_ui("tiny-mars", runs_dir=tmp_path / "runs-a")
    page_b = build_ui("tiny-mars", runs_dir=tmp_path / "runs-b")

    def first_load_line(demo) -> str:
        load = next(f.fn for f in demo.fns.values() if getattr(f.fn, "func", None) is generate.load_model_ui)
        return next(iter(load("run:run-a", "")))   # the first line only: nothing is loaded

    assert first_load_line(page_a).startswith(f"Loading **{ckpt}**")
    assert first_load_line(page_b).startswith("⚠ run 'run-a' has no finished checkpoint")
    assert "finetune runs are not available" in next(iter(generate.load_model_ui("run:run-a", "")))   # no page


def test_build_ui_has_the_four_tabs(tmp_path):
    from app.ui import build_ui
    demo = build_ui("tiny-mars", runs_dir=tmp_path / "runs")
    labels = {b.label for b in demo.blocks.values() if type(b).__name__ == "Tab"}
    assert labels == {"Generate", "τ explorer", "Learn", "Finetune"}
    # the race handler must receive the browser session (its τ control is per session)
    import gradio as gr
    from gradio.helpers import special_args
    race_fns = [f for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "race_fn"]
    assert race_fns
    n_inputs = len(race_fns[0].inputs)   # the page's components, wired in order
    args = special_args(race_fns[0].fn, inputs=list(range(n_inputs)), request=gr.Request())[0]
    assert args[:n_inputs] == list(range(n_inputs)) and isinstance(args[-1], gr.Request)


def test_stop_reaches_the_trainer_under_accelerate_and_a_new_server_reattaches(tmp_path, tiny_dir):
    """Start with one JobManager, observe and stop with a fresh one (as after an app restart)."""
    first = JobManager(tmp_path / "runs")
    name = first.start(FinetuneRequest(base_model=tiny_dir, stage="mars", max_steps=500, batch_size=2,
                                       extra={"builtin-examples": 64}))
    second = JobManager(tmp_path / "runs")
    deadline = time.time() + 180
    while (second.status(name).get("step") or 0) < 1 and time.time() < deadline:
        assert second.is_running(name), jobs_log(second, name)
        time.sleep(0.5)
    assert second.running_job() == name and second.latest_job() == name
    with pytest.raises(ValueError, match="one job at a time"):
        second.start(FinetuneRequest(base_model=tiny_dir))
    assert "SIGTERM" in second.stop(name)
    while first.is_running(name) and time.time() < deadline:
        time.sleep(0.5)
    time.sleep(0.3)
    st = first.status(name)
    assert st["state"] == "stopped" and st["exit_code"] == 0, jobs_log(first, name)
    assert Path(st["last_checkpoint"]).is_dir()
    assert first.finished_checkpoints() == [(name, str(Path(st["last_checkpoint"]).resolve()))]
    label, value = models.Resolver(first).choices()[-1]
    assert value == f"run:{name}" and label.startswith(f"run: {name} (your finetune)")
    assert ("barely trained" in label) == (st["step"] < models.BARELY_TRAINED_STEPS)


def jobs_log(jobs, name):
    from app.runs import log_tail
    return log_tail(jobs.run_dir(name))


def test_builtin_sweep_uses_the_task_evaluator(tiny_dir):
    lm = models.get_model(tiny_dir)
    rows = explorer.sweep_builtin(lm, 2, [1.0], 4, 8)
    assert len(rows) == 1 and rows[0]["n"] == 2 and rows[0]["quality_name"] == "accuracy"
    assert rows[0]["quality"] == rows[0]["accuracy"] and rows[0]["tokens_per_forward"] == 1.0
    assert explorer.table_rows(rows)[0][:2] == ["MARS", "off"]


# ----------------------------------------------------------------------------- smollm2-mars as the free-text default
def _fake_adapter(tmp_path, monkeypatch, files=models.ADAPTER_FILES):
    """Point models at an assets/smollm2-mars folder holding `files` (nothing is ever loaded from it)."""
    folder = tmp_path / "assets" / "smollm2-mars"
    folder.mkdir(parents=True)
    for f in files:
        (folder / f).write_text("{}")
    monkeypatch.setattr(models, "SMOLLM2_MARS_DIR", folder)
    return folder


def _values(choices):
    return [v for _, v in choices]


def _dropdown(demo, elem_id):
    return next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == elem_id)


def test_picker_lists_smollm2_mars_only_when_its_adapter_exists(tmp_path, monkeypatch):
    from app.ui import build_ui
    folder = _fake_adapter(tmp_path, monkeypatch, files=("adapter_config.json",))   # weights not written yet
    assert "smollm2-mars" not in _values(models.model_choices())
    with pytest.raises(ValueError, match="smollm2-mars is not available"):
        models.resolve("smollm2-mars")
    demo = build_ui("tiny-mars", runs_dir=tmp_path / "runs")
    assert "smollm2-mars" not in _values(_dropdown(demo, "model-picker").choices)
    assert "smollm2-mars" not in _values(_dropdown(demo, "ar-picker").choices)

    (folder / "adapter.safetensors").write_text("{}")
    choices = models.model_choices()
    assert choices[0] == ("smollm2-mars — SmolLM2-135M + MARS (real language)", "smollm2-mars")
    assert _values(choices)[1:] == _values(models.BUILTIN_MODELS)   # the others keep their order
    assert models.resolve("smollm2-mars") == "smollm2-mars"
    demo = build_ui("tiny-mars", runs_dir=tmp_path / "runs2")
    assert "smollm2-mars" in _values(_dropdown(demo, "model-picker").choices)
    assert _dropdown(demo, "model-picker").value == "tiny-mars"


def test_example_prompts_are_natural_for_smollm2_and_task_prompts_for_tiny():
    from finetune.evals.natural import natural_prompts
    from finetune.evals.structured import prompt_table
    from finetune.tasks import make_examples
    # held-out prompts of both catalogues: smollm2-mars's teaching prompts include structured ones
    natural = set(natural_prompts("heldout")) | {p for _, _, p in prompt_table("heldout")}
    tasks = [ex["messages"][0]["content"] for ex in make_examples("heldout", 6, seed=0)]
    for name in ("smollm2-mars", "smollm2"):
        ex = models.example_prompts(name)
        assert len(ex) == len(set(ex)) >= 6
        held = [p for p in ex if p in natural]
        assert len(held) >= 6, ex                                       # mostly natural held-out prompts
        assert all(p in natural or p in models.GENERAL_PROMPTS for p in ex)   # the rest: curated general ones
        assert not set(ex) & set(tasks)
    assert models.example_prompts("tiny-mars") == tasks
    assert not set(models.example_prompts("tiny-mars")) & natural
    update = generate.examples_for("smollm2-mars")
    assert update["choices"] == models.example_prompts("smollm2-mars") and update["value"] is None


@pytest.fixture()
def preparer(monkeypatch, tmp_path):
    """A fresh background preparer for smollm2-mars with fake prepare / is_prepared / get_model; the times it
    records go to a cache of its own (fake times in the real cache would be promised to the next real start)."""
    from mars_core.models import sources
    monkeypatch.setenv("MARS_CACHE_DIR", str(tmp_path / "cache"))
    calls = {"prepare": [], "get_model": []}
    gates = {"prepare": None, "get_model": None}
    state = {"prepared": False, "prepare_error": None}

    def fake_is_prepared(name):
        return state["prepared"]

    def fake_prepare(name):
        calls["prepare"].append(name)
        if gates["prepare"] is not None:
            assert gates["prepare"].wait(30)
        if state["prepare_error"] is not None:
            raise state["prepare_error"]
        return "/fake/merged"

    def fake_get_model(name):
        calls["get_model"].append(name)
        if gates["get_model"] is not None:
            assert gates["get_model"].wait(30)
        return object()

    monkeypatch.setattr(sources, "is_prepared", fake_is_prepared)
    monkeypatch.setattr(sources, "prepare", fake_prepare)
    monkeypatch.setattr(models, "get_model", fake_get_model)
    prep = models.BackgroundPreparer("smollm2-mars", available=lambda: True)
    monkeypatch.setattr(models, "PREPARER", prep)
    return prep, calls, gates, state


def _is_skip(update):
    return isinstance(update, dict) and update == {"__type__": "update"}


def _stops(timer_update):
    import gradio as gr
    return isinstance(timer_update, gr.Timer) and timer_update.active is False


def test_preparer_goes_from_preparing_to_ready(preparer):
    import threading
    prep, calls, gates, _ = preparer
    assert models.prepare_status()["state"] == "idle" and calls == {"prepare": [], "get_model": []}
    gates["prepare"] = threading.Event()
    waited = threading.Event()
    assert models.start_background_prepare(wait_for=waited)
    st = models.prepare_status()
    assert st["state"] == "preparing"
    assert "waiting for the start-up model" in st["text"] and "s so far" in st["text"]
    time.sleep(0.2)
    assert calls["prepare"] == []                    # it waits for the start-up model first
    waited.set()
    deadline = time.time() + 10
    while not calls["prepare"] and time.time() < deadline:
        time.sleep(0.01)
    assert calls["prepare"] == ["smollm2-mars"] and calls["get_model"] == []
    text, picker, examples, timer, switch = generate.poll_default_model("tiny-mars", "", False)
    assert "preparing once" in text and _is_skip(picker) and _is_skip(examples) and _is_skip(timer)
    assert "preparing once" in models.loading_note("smollm2-mars") and models.loading_note("tiny-mars") == ""
    gates["prepare"].set()
    assert prep.wait(10)
    assert calls["get_model"] == ["smollm2-mars"]    # loaded (and warmed) right after the build
    st = models.prepare_status()
    assert st["state"] == "ready" and "preparing" not in st["text"] and "ready" in st["text"]
    assert models.start_background_prepare() and calls["prepare"] == ["smollm2-mars"]   # once only


def test_preparer_loads_a_model_built_on_an_earlier_start_in_the_background(preparer):
    import threading
    prep, calls, gates, state = preparer
    state["prepared"] = True
    gates["get_model"] = threading.Event()
    assert prep.start()
    deadline = time.time() + 10
    while not calls["get_model"] and time.time() < deadline:
        time.sleep(0.01)
    st = prep.status()
    assert st["state"] == "preparing" and "loading and warming up" in st["text"] and "preparing once" not in st["text"]
    gates["get_model"].set()
    assert prep.wait(10) and prep.status()["state"] == "ready"
    assert calls["prepare"] == []                    # nothing to build


@pytest.mark.parametrize("error, line", [
    (ValueError("the adapter 'smollm2-mars' is missing at /x/assets/smollm2-mars\nrebuild it"),
     "the adapter 'smollm2-mars' is missing at /x/assets/smollm2-mars"),
    (RuntimeError("boom\n  File 'x.py', line 3"), "RuntimeError: boom"),
])
def test_a_failing_prepare_says_why_in_one_line_and_the_app_stays_on_tiny_mars(preparer, capfd, error, line):
    prep, calls, gates, state = preparer
    state["prepare_error"] = error
    logged = []
    assert prep.start(log=logged.append)
    assert prep.wait(10)
    st = models.prepare_status()
    assert st["state"] == "failed" and st["error"] == line
    assert st["text"] == f"⚠ smollm2-mars failed: {line} — free text stays on tiny-mars"
    assert "\n" not in st["text"] and "Traceback" not in st["text"]
    assert calls["get_model"] == []
    assert logged == [f"smollm2-mars unavailable: {line} (free text stays on tiny-mars)"]
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err
    text, picker, examples, timer, switch = generate.poll_default_model("tiny-mars", "", False)
    assert text == st["text"] and _is_skip(picker) and _is_skip(examples) and _stops(timer)
    assert models.task_model("tiny-mars", "", False) == "tiny-mars"
    assert models.resolve("tiny-mars") == "tiny-mars"


def test_the_app_still_loads_tiny_mars_after_a_failed_prepare(preparer, monkeypatch):
    prep, calls, gates, state = preparer
    state["prepare_error"] = ValueError("no base model")
    assert prep.start() and prep.wait(10) and prep.status()["state"] == "failed"
    monkeypatch.undo()   # the real get_model again
    monkeypatch.setattr(models, "PREPARER", prep)
    outs = list(generate.load_model_ui("tiny-mars", ""))
    assert outs[-1].startswith("✓") and "tiny-mars" in outs[-1], outs


def _ready_preparer(monkeypatch, tmp_path):
    _fake_adapter(tmp_path, monkeypatch)
    prep = models.BackgroundPreparer("smollm2-mars")
    prep.state, prep.first_start, prep.started_at, prep.finished_at = "ready", True, 1.0, 39.0
    monkeypatch.setattr(models, "PREPARER", prep)
    return prep


def test_poll_switches_the_default_to_smollm2_mars_only_when_the_user_has_not_picked(monkeypatch, tmp_path):
    _ready_preparer(monkeypatch, tmp_path)
    text, picker, examples, timer, switch = generate.poll_default_model("tiny-mars", "", False)
    assert text == "✓ smollm2-mars ready (took 38 s): the default model for free text"
    assert picker["value"] == "smollm2-mars" and "smollm2-mars" in _values(picker["choices"])
    assert examples["choices"] == models.example_prompts("smollm2-mars") and examples["value"] is None
    assert _stops(timer)
    for choice, free, picked in (("tiny-mars", "", True),                # the user chose tiny-mars
                                 ("tiny-ar-sft", "", True),
                                 ("tiny-mars", "owner/model", False),   # a typed model overrides the list
                                 ("smollm2-mars", "", False)):          # already there
        text, picker, examples, timer, switch = generate.poll_default_model(choice, free, picked)
        assert "ready" in text and _is_skip(picker) and _is_skip(examples) and _stops(timer), (choice, free)
        # touched (picked a model, typed a prompt): the switch is offered as a button, never made
        assert switch["visible"] is (picked and choice != "smollm2-mars"), (choice, free, picked)
    # while it is still preparing nothing switches, and the timer keeps running
    models.PREPARER.state, models.PREPARER.finished_at = "preparing", None
    text, picker, examples, timer, switch = generate.poll_default_model("tiny-mars", "", False)
    assert text.startswith("◷ smollm2-mars") and _is_skip(picker) and _is_skip(examples) and _is_skip(timer)


def test_the_switch_to_smollm2_mars_keeps_the_pickers_labels(monkeypatch, tmp_path):
    _ready_preparer(monkeypatch, tmp_path)
    jobs = JobManager(tmp_path / "runs")
    (run := jobs.runs_dir / "20261202-000000-mars").mkdir(parents=True)   # a finished 3-step run
    (ckpt := run / "checkpoint-3").mkdir()
    (ckpt / "config.json").write_text("{}")
    (run / "status.json").write_text(json.dumps({"state": "finished", "step": 3, "max_steps": 3,
                                                 "last_checkpoint": str(ckpt)}))
    from app.ui import build_ui
    demo = build_ui("tiny-mars", runs_dir=tmp_path / "runs")
    first = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "model-picker").choices
    poll = next(f for f in demo.fns.values() if getattr(f.fn, "func", None) is generate.poll_default_model)
    text, picker, examples, timer, switch = poll.fn("tiny-mars", "", False)   # the page's own poll, with its resolver
    assert picker["value"] == "smollm2-mars"
    run_label = ("run: 20261202-000000-mars (your finetune) ⚠ barely trained: 3 steps", "run:20261202-000000-mars")
    assert run_label in [tuple(c) for c in first]
    assert [tuple(c) for c in picker["choices"]] == [tuple(c) for c in first]   # same labels after the switch


def test_task_suite_parts_stay_on_tiny_mars_unless_the_user_picked(monkeypatch, tmp_path):
    _fake_adapter(tmp_path, monkeypatch)
    assert models.task_model("smollm2-mars", "", picked=False) == "tiny-mars"
    assert models.task_model("smollm2-mars", "", picked=True) == "smollm2-mars"
    assert models.task_model("tiny-ar-sft", "", picked=True) == "tiny-ar-sft"
    assert models.task_model("smollm2-mars", "owner/model", picked=False) == "owner/model"


def test_page_wires_the_poll_and_the_users_own_pick(monkeypatch, tmp_path):
    import gradio as gr
    from app.ui import build_ui
    _ready_preparer(monkeypatch, tmp_path)
    for default, picked in ((None, False), ("tiny-mars", True)):
        demo = build_ui(default, runs_dir=tmp_path / f"runs-{picked}")
        picker = _dropdown(demo, "model-picker")
        assert picker.value == "tiny-mars"
        fns = list(demo.fns.values())
        polls = [f for f in fns if getattr(f.fn, "func", None) is generate.poll_default_model]
        kinds = {ev for f in polls for _, ev in f.targets}
        assert kinds == {"tick", "load"}
        timer = next(demo.blocks[t] for f in polls for t, ev in f.targets if ev == "tick")
        assert isinstance(timer, gr.Timer) and timer.value == generate.PREPARE_POLL_S
        state = polls[0].inputs[2]
        assert isinstance(state, gr.State) and state.value is picked
        assert polls[0].outputs[1] is picker
        pick = [f for f in fns if (picker._id, "input") in f.targets]
        assert len(pick) == 1 and pick[0].outputs == [state] and pick[0].fn() is True
    # the task-suite handlers receive the pick too
    for handler in (explorer.run_sweep, learn.one_step):
        f = next(f for f in fns if getattr(f.fn, "func", None) is handler)
        assert f.inputs[-1] is state


def _record_loads(monkeypatch, lm):
    """models.get_model answers `lm` for every name and records the names asked for (nothing big is loaded)."""
    loaded = []
    monkeypatch.setattr(models, "get_model", lambda name: loaded.append(name) or lm)
    return loaded


def test_learn_step_runs_the_model_the_picker_shows(monkeypatch, tmp_path, tiny_dir):
    _fake_adapter(tmp_path, monkeypatch)
    lm = models.get_model(tiny_dir)          # stands in for smollm2-mars: only the name asked for matters
    loaded = _record_loads(monkeypatch, lm)
    for picked in (False, True):             # the page's own switch to smollm2-mars counts as much as a pick
        *_, (html, fig) = learn.one_step("smollm2-mars", "", "What is 2 + 2?", 0.9, False, 4, "prob", picked)
        assert loaded[-1] == "smollm2-mars", loaded
        assert "model: <b>smollm2-mars</b>" in html and html.count("<tr class=") == 4
    assert loaded == ["smollm2-mars", "smollm2-mars"]
    list(learn.one_step("tiny-mars", tiny_dir, "What is 2 + 2?", 0.9, False, 4, "prob", False))
    assert loaded[-1] == str(Path(tiny_dir).resolve())   # a typed path overrides the list, as on other tabs


def test_explorer_runs_the_picked_model_or_says_plainly_why_not(monkeypatch, tmp_path, tiny_dir):
    _fake_adapter(tmp_path, monkeypatch)
    lm = models.get_model(tiny_dir)
    loaded = _record_loads(monkeypatch, lm)
    sweep = dict(n=2, taus_text="1.0", block_size=4, max_new_tokens=8, criterion="prob", lossless=False,
                 picked=False)
    *_, (status, *rest) = explorer.run_sweep("smollm2-mars", "", "builtin", prompts_text="", **sweep)
    assert status.startswith("⚠") and "smollm2-mars was not" in status and "my prompts" in status
    assert "tiny-mars" in status and loaded == []          # nothing ran, and nothing switched models
    *_, (status, *rest) = explorer.run_sweep("smollm2-mars", "", "free", prompts_text="What is 2 + 2?", **sweep)
    assert status.startswith("✓") and "**smollm2-mars**" in status and loaded == ["smollm2-mars"]
    # a finetune checkpoint trained on the built-in suite knows the tasks; one trained on uploads does not
    for data, knows in (("builtin", True), ("<run dir>/data.jsonl", False)):
        ckpt = tmp_path / f"ckpt-{knows}"
        ckpt.mkdir()
        (ckpt / "train_config.json").write_text(json.dumps({"data": data}))
        assert explorer.knows_the_tasks(str(ckpt)) is knows
    assert explorer.knows_the_tasks("tiny-mars") and explorer.knows_the_tasks("tiny-ar-sft")


def test_get_model_loads_different_models_independently(monkeypatch):
    import threading
    import mars_core
    gate, started = threading.Event(), threading.Event()

    def fake_load(name):
        if name == "slow":
            started.set()
            assert gate.wait(30)
        return f"lm:{name}"

    monkeypatch.setattr(mars_core, "load_model", fake_load)
    monkeypatch.setattr(models, "warm_up", lambda lm: None)
    monkeypatch.setattr(models, "_cache", {})
    t = threading.Thread(target=models.get_model, args=("slow",), daemon=True)
    t.start()
    assert started.wait(10)
    t0 = time.perf_counter()
    assert models.get_model("fast") == "lm:fast"    # not stuck behind the slow load
    assert time.perf_counter() - t0 < 5
    gate.set()
    t.join(10)
    assert models.get_model("slow") == "lm:slow" and models.is_loaded("slow")


def test_app_start_preloads_tiny_mars_then_prepares_smollm2_mars_in_the_background(monkeypatch, tmp_path):
    import importlib.util
    import threading
    import gradio as gr
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    monkeypatch.setenv("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "0"))
    spec = importlib.util.spec_from_file_location("app_main", Path(__file__).resolve().parent.parent / "app.py")
    app_main = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app_main)
    loaded, started, launched = [], {}, {}

    def fake_start(wait_for=None, log=None):
        started.update(wait_for=wait_for, log=log)
        return True

    def fake_launch(self, **kw):
        launched.update(kw, demo=self, loaded_before=list(loaded))
        return self

    monkeypatch.setattr(models, "get_model", lambda name: loaded.append(name))
    monkeypatch.setattr(models, "start_background_prepare", fake_start)
    monkeypatch.setattr(gr.Blocks, "launch", fake_launch)
    app_main.main(["--runs-dir", str(tmp_path / "runs")])
    assert isinstance(started["wait_for"], threading.Event) and started["wait_for"].wait(10)
    assert loaded == ["tiny-mars"]                   # the page's model first; smollm2-mars waits for it
    assert launched["loaded_before"] == []           # and only once the page answers: it never waits for a model
    assert launched["server_name"] == "127.0.0.1" and launched["share"] is False
    assert launched["prevent_thread_lock"] is True     # launch returns once the server answers; then smollm2-mars loads
    poll = next(f for f in launched["demo"].fns.values() if getattr(f.fn, "func", None) is generate.poll_default_model)
    assert poll.inputs[2].value is False              # automatic mode: the page may switch free text


# ----------------------------------------------------------------------------- a quick start
def test_the_page_is_built_without_importing_torch_or_transformers(tmp_path):
    """They cost 4-5 s of CPU on the project's 2-core CPU; the page answers first and they load after it
    (app.launch). A fresh interpreter, as `python app.py` starts."""
    import subprocess
    import sys
    code = ("import sys; from app import ui; ui.build_ui(None, runs_dir=sys.argv[1]); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "runs")], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=300,
                          env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-500:]


@pytest.mark.parametrize("assets", [None, "", "  ", "elsewhere"])
def test_the_app_finds_the_assets_where_mars_core_does(monkeypatch, tmp_path, assets):
    from mars_core.models import sources
    if assets is None:
        monkeypatch.delenv("MARS_ASSETS", raising=False)
    else:
        monkeypatch.setenv("MARS_ASSETS", str(tmp_path / assets) if assets.strip() else assets)
    assert models.find_assets() == sources.find_assets()


def test_the_criteria_the_page_offers_are_the_decoder_s_in_its_order():
    from mars_core.decode.config import CRITERIA
    assert [c for _, c in generate.CRITERION_CHOICES] == list(CRITERIA)


def test_start_up_promises_only_times_measured_on_this_machine(monkeypatch, tmp_path):
    """The background model's line names its stage and gives a time only when this machine measured one before;
    the times file sits where mars_core puts its cache."""
    from mars_core.engine.cache import cache_dir

    monkeypatch.setenv("MARS_CACHE_DIR", str(tmp_path / "cache"))
    assert models._times_path().parent == cache_dir()
    prep = models.BackgroundPreparer("smollm2-mars", available=lambda: True)
    prep.state, prep.first_start, prep.started_at, prep.stage = "preparing", True, time.monotonic(), "building"
    assert "not measured" not in prep.status()["text"] and "measured now" in prep.status()["text"]
    assert "took" not in prep.status()["text"]
    models._record_time("build_s", 37.4)
    models._record_time("load_s", 12.0)
    assert models.measured_times() == {"build_s": 37.4, "load_s": 12.0}
    assert "took 37 s here last time" in prep.status()["text"]
    prep.first_start, prep.stage = False, "loading"
    assert "loading and warming up (took 12 s here last time)" in prep.status()["text"]
