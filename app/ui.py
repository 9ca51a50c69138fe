"""The MARS Playground page: components and event wiring only (handlers live in sibling modules)."""
from __future__ import annotations

from functools import partial
from pathlib import Path
from types import SimpleNamespace

import gradio as gr

from app import explorer, finetune_ui, generate, learn, models, notices
from app.plots import diff_placeholder, empty_figure
from app.race import LANE_LABELS, LANES, SideRecord
from app.render import STAT_DEFINITIONS, glossary_html, legend_html, render_chunks, render_ledger, render_stats
from app.runs import JobManager

CSS = """
/* a short lane starts at the top beside a long one: its blocks do not grow, and the titles (one or two lines)
   take the same two lines */
.race-pane {border: 1px solid #e5e7eb; border-radius: 10px; padding: 10px 12px; background: #fff;
            justify-content: flex-start !important;}
.race-pane > * {flex-grow: 0 !important;}
.race-pane h3 {margin: 0 0 6px 0; min-height: 2.7em;}
.race-text {white-space: pre-wrap; font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 15px;
            line-height: 1.9; min-height: 150px; max-height: 460px; overflow-y: auto; color: #111827;}
.race-text .chunk {border-radius: 4px; padding: 2px 1px; margin: 0 1px; box-shadow: inset 0 -1px 0 #9ca3af;
                   cursor: help;}
.race-text .placeholder {color: #9ca3af;}
.race-text .cursor {color: #2563eb; animation: blink 1s step-start infinite;}
@keyframes blink {50% {opacity: 0;}}
.tau-mark {display: inline-block; background: #111827; color: #fff; font-size: 11px; border-radius: 3px;
           padding: 0 4px; margin: 0 3px; line-height: 1.5; font-family: ui-sans-serif, sans-serif;}
.legend {font-size: 13px; color: #374151; margin: 4px 0 6px 0;}
.legend .chunk {border-radius: 4px; padding: 1px 5px; box-shadow: inset 0 -1px 0 #9ca3af;}
table.stats {border-collapse: collapse; font-size: 14px; width: 100%;}
table.stats th, table.stats td {border-bottom: 1px solid #e5e7eb; padding: 4px 10px; text-align: right;}
table.stats th:first-child {text-align: left; color: #374151;}
table.stats thead th {background: #f9fafb;}
/* on a phone the three lanes' numbers fit beside their labels, so the MARS column is never off the screen */
@media (max-width: 480px) {table.stats {font-size: 12px;} table.stats th, table.stats td {padding: 3px 4px;}}
.speedup {margin-top: 8px; font-size: 20px;}
.speedup .how {font-size: 12px; color: #6b7280; margin-left: 8px;}
.defs {font-size: 12.5px; color: #4b5563;}
.ledger table, .learn-step table {border-collapse: collapse; width: 100%; font-size: 13.5px;}
.ledger th, .ledger td, .learn-step th, .learn-step td {border-bottom: 1px solid #e5e7eb; padding: 4px 8px;
                                                       text-align: left;}
/* the token diff: one cell per aligned pair, MARS's token over AR's, wrapping like words at any width */
.token-diff .diff-title {margin: 4px 0 8px 0; font-size: 14px;}
.token-diff .diff-empty {color: #6b7280;}
.token-diff .diff-cells {display: flex; flex-wrap: wrap; gap: 3px;}
.token-diff .dt {display: inline-flex; flex-direction: column; border-radius: 4px; padding: 1px 4px;
                 font-family: ui-monospace, monospace; font-size: 13px; line-height: 1.35; text-align: center;}
.token-diff .dt i {font-style: normal; white-space: pre;}
.token-diff .dt i + i {border-top: 1px solid rgba(0, 0, 0, 0.12);}
.token-diff .dt-key .dt {display: inline-block; font-family: inherit; font-size: 12px;}
.dt.same {background: #f3f4f6;} .dt.changed {background: #fca5a5;} .dt.only-mars {background: #93c5fd;}
.dt.only-ar {background: #fcd34d;}
.ledger tr.acc, .learn-step tr.acc {background: #f0fdf4;}
.ledger tr.stop, .learn-step tr.stop {background: #fef2f2;}
.ledger tr.skip, .learn-step tr.skip {color: #9ca3af;}
.ledger .tok {font-family: ui-monospace, monospace;}
.ledger-head {font-weight: 600; margin-bottom: 6px;}
.ledger .why {margin-top: 6px; font-style: italic; color: #374151;}
.confbar {position: relative; display: inline-block; width: 90px; height: 10px; background: #e5e7eb;
          border-radius: 3px; margin-right: 6px; vertical-align: middle;}
.confbar div {height: 100%; background: #60a5fa; border-radius: 3px;}
.confbar .tauline {position: absolute; top: -3px; width: 2px; height: 16px; background: #111827;}
.learn-step .lane {margin: 8px 0;}
.learn-step .lane-label {font-size: 12px; color: #6b7280; display: block; margin-bottom: 3px;}
.learn-step .cells {display: flex; flex-wrap: wrap; gap: 3px;}
.learn-step .cell {font-family: ui-monospace, monospace; padding: 4px 7px; border-radius: 5px; font-size: 14px;
                   border: 1px solid #d1d5db; text-align: center;}
.learn-step .cell small {display: block; font-size: 10px; color: #6b7280;}
.learn-step .committed {background: #f3f4f6;}
/* on a phone a ledger row wraps its cells onto a second line, so its verdict is on the screen, not in a fifth column */
@media (max-width: 480px) {
  .ledger table, .ledger tbody {display: block; width: auto;}
  .ledger thead {display: none;}
  .ledger tr {display: flex; flex-wrap: wrap; gap: 0 10px; border-bottom: 1px solid #e5e7eb; padding: 3px 0;}
  .ledger td {border: none; padding: 1px 4px;}
}
/* on a phone each output of the step is a block of lines, so its verdict is on the screen, not in a fifth column */
@media (max-width: 480px) {
  .learn-step table, .learn-step tbody, .learn-step tr, .learn-step td {display: block; width: auto;}
  .learn-step thead {display: none;}
  .learn-step tr {border-bottom: 1px solid #e5e7eb; padding: 4px 0;}
  .learn-step td {border: none; padding: 1px 8px;}
  .learn-step td[data-label]::before {content: attr(data-label); color: #6b7280;}
}
.learn-step .maskcell {background: #fef3c7; border-color: #f59e0b;}
.learn-step .accepted {background: #dcfce7; border-color: #22c55e;}
.race-text .verified {text-decoration: underline 2px #7c3aed; text-underline-offset: 3px;}
.race-text .verified.from-prompt, .lane-key .from-prompt, .ledger .from-prompt {
  text-decoration: underline 2px dashed #059669; text-underline-offset: 3px;}
.lane-key {font-size: 12px; color: #4b5563; margin-top: 4px;}
.verified {text-decoration: underline 2px #7c3aed; text-underline-offset: 3px;}
del.rejected {color: #b91c1c; text-decoration: line-through 2px #b91c1c; background: #fee2e2; border-radius: 3px;}
.replacement {color: #1d4ed8; font-weight: 600;}
.pending-drafts {color: #9ca3af; font-style: italic;}
.lane-note {font-style: italic;}
.speedups .speedup {margin-top: 8px; font-size: 17px;}
.speedup .bound-line, .speedup .equal-work, .speedup .exceeds {font-size: 12.5px; color: #374151; margin-left: 4px;}
.speedup .differs {color: #b45309; font-weight: 600;}
.speedup .same {color: #15803d;}
.speedup .exceeds {color: #92400e;}
.ledger-sub {font-weight: 600; margin: 8px 0 4px 0;}
#notice {background: #eff6ff; border-radius: 8px; padding: 0 10px;}
#teach-note {background: #f0fdf4; border-radius: 8px; padding: 0 10px; font-size: 14px;}
.job {font-size: 14px;}
.job .progress {height: 12px; background: #e5e7eb; border-radius: 6px; margin-top: 6px; overflow: hidden;}
.job .progress div {height: 100%;}
.job .ckpt {font-size: 12px; color: #4b5563; margin-top: 4px;}
"""

CSS += """
/* the projector layout: prompt, Race and τ on top, the three lanes side by side from 1024 px, stacked on a phone */
#race-controls {gap: 8px;}
#intro p {margin: 0; font-size: 14px;}
#model-status p, #prep-status p {margin: 0; font-size: 13px;}
#model-status, #prep-status {min-height: 0 !important; padding: 0 !important;}
#tau-row {align-items: center;}
#tau-label {flex-grow: 0 !important; min-width: 28px !important;}
.tau-label {font-size: 26px; font-weight: 700; color: #4338ca; cursor: help; padding: 0 4px;}
#status-block, #status-after, #status-top {gap: 0 !important;}
#stats {overflow-x: auto;}   /* a phone scrolls the three lanes' numbers instead of cutting the last column */
#status-block > div:not(:has(*:not(:empty))) {display: none;}
#status-block p {margin: 2px 0;}
#race-controls textarea {font-size: 16px;}
#generate-btn {min-height: 44px; font-size: 18px;}
#lanes {flex-wrap: nowrap; gap: 8px;}
#lanes > .race-pane {min-width: 0 !important;}
@media (max-width: 760px) {#lanes {flex-wrap: wrap;} #lanes > .race-pane {min-width: 100% !important;}}
.race-pane h3 {font-size: 16px; min-height: 0; margin: 0; white-space: nowrap; overflow: hidden;
               text-overflow: ellipsis;}
.race-pane h3 small {font-weight: 400; color: #6b7280; font-size: 12px;}
.race-pane {padding: 6px 10px !important; gap: 4px !important;}
.lane-score {display: flex; gap: 14px; align-items: baseline; margin: 0; flex-wrap: wrap; line-height: 1.2;}
#switch-default {min-height: 0; padding: 0 8px; font-size: 12px;}
.lane-score .score b {font-size: 20px; color: #111827;}
.lane-score .score small {font-size: 12px; color: #4b5563;}
.race-text {min-height: 90px;}
#replay-bar {display: flex; gap: 6px; align-items: center; flex-wrap: wrap; font-size: 14px; margin: 2px 0;}
#replay-bar button {padding: 2px 10px; border: 1px solid #d1d5db; border-radius: 6px; background: #f9fafb;
                    cursor: pointer; font-size: 14px;}
#replay-bar button:disabled {opacity: 0.45; cursor: default;}
#replay-bar input[type=range] {width: 110px;}
#replay-where {color: #374151; margin-left: 6px;}
.gloss {border-bottom: 1px dotted #6b7280; cursor: help;}
.glossary dt {font-weight: 700; margin-top: 6px;} .glossary dd {margin: 0 0 0 16px; font-size: 15px;}
"""

# The replay's controls (app/replay.js runs them in the browser; a race must have finished first).
REPLAY_BAR = """<div id="replay-bar"
title="Replays the finished race without the model: k forward passes in every lane">
<b>Replay</b><button id="replay-start" disabled>|◀ start</button><button id="replay-back" disabled>◀ back</button>
<button id="replay-play" disabled>▶ play</button><button id="replay-step" disabled>step ▶</button>
<button id="replay-end" disabled>all ▶|</button>
<input id="replay-delay" type="range" min="50" max="2000" step="50" value="400" aria-label="delay per forward pass">
<span id="replay-delay-value">400 ms/forward</span><span id="replay-where">after a race</span></div>"""

# Presentation mode keys on the page's <body>, which Gradio's scoped `css` cannot reach: it goes in the head.
PRESENT_CSS = """/* presentation mode (the toggle, or ?present=1): big lane text and numbers, the rest out of the way */
body.present .race-text {font-size: 22px !important; line-height: 1.7 !important; max-height: 60vh !important;}
body.present .lane-score .score b {font-size: 34px !important;}
body.present .lane-score .score small {font-size: 15px !important;}
body.present #intro, body.present #status-top, body.present #advanced, body.present .defs,
body.present #teach-note, body.present #glossary {display: none !important;}
body.present .race-pane h3 {font-size: 18px !important;}
"""
HEAD = ("<style>" + PRESENT_CSS + "</style><script>"
        + (Path(__file__).resolve().parent / "replay.js").read_text(encoding="utf-8") + "</script>")

RUNS_DIR = Path(__file__).resolve().parent.parent / "runs"

INTRO = """**MARS Playground** · several tokens per forward pass: the guesses behind
<span class="gloss" title="mask: a placeholder token after the text; the model guesses the token behind it">masks</span>
are kept while their confidence ≥
<span class="gloss"
title="τ: the confidence a guess needs to be kept; τ off (1) is exactly ordinary greedy decoding">τ</span>
(glossary below)"""

PANE_TITLES = {"ar": "AR baseline", "verify": "MARS lossless", "mars": "MARS"}
# each lane's title says what it is on hover (the glossary panel says it at length)
PANE_TIPS = {"ar": "ordinary greedy decoding: one token per forward pass",
             "verify": "the masks' guesses become drafts that the next forward pass checks: exactly AR's answer",
             "mars": "guesses kept while their confidence is at least τ: several tokens per pass, lossy below τ = 1"}

# The API names what a user does (API_NAMES); every other event only keeps the page in step, so it stays out of
# the API (private: not listed, not callable by gradio_client), else Gradio lists it as /partial_7, /lambda, …
API_NAMES = ("load_model", "race", "sweep", "one_step", "mask", "finetune_start", "finetune_stop", "finetune_kill")
PRIVATE = dict(api_visibility="private")
# Events that only move page state run outside the model's queue, at once and without a spinner.
QUICK = dict(show_progress="hidden", concurrency_limit=None, **PRIVATE)


def build_ui(default_model: str | None = None, runs_dir: str | Path = RUNS_DIR,
             launcher: str = "accelerate") -> gr.Blocks:
    """default_model None = automatic: start on tiny-mars and move free text to smollm2-mars once the
    background preparer (models.PREPARER, started by app.py) has it ready; a named model is the user's
    choice and stays."""
    jobs = JobManager(runs_dir, launcher=launcher)
    resolver = models.Resolver(jobs)   # the page's one way from a model choice ("run:<name>" too) to a model
    start_model = models.DEFAULT_MODEL if default_model is None else default_model
    with gr.Blocks(title="MARS Playground", analytics_enabled=False) as demo:
        gr.Markdown(INTRO, elem_id="intro")
        bar = _model_bar(jobs, start_model, picked=default_model is not None)
        with gr.Tabs():
            gen = _generate_tab(start_model)
            sweep = _explorer_tab(start_model)
            lesson = _learn_tab(start_model)
            ft = _finetune_tab(jobs)
        _wire_model_bar(demo, bar, gen, sweep, lesson, resolver)
        _wire_notices(bar, gen, resolver)
        _wire_race(bar, gen, resolver)
        _wire_explorer(bar, sweep, resolver)
        _wire_learn(demo, bar, gen, lesson, resolver)
        _clear_warnings_on_change(bar, gen, sweep, lesson, ft)
        _wire_finetune(demo, bar, ft, jobs)
    _lenient_api_inputs(demo)
    demo.jobs = jobs  # for tests and app.py
    return demo


def _lenient_api_inputs(demo: gr.Blocks) -> None:
    """Every input of the named API reaches its handler as sent, so a bad value (a word in a number field, a name
    not in a list) gets the handler's own message in the page, never Gradio's generic exception (inputs.lenient)."""
    for fn in demo.fns.values():
        if fn.api_name in API_NAMES:
            for comp in fn.inputs:
                if not isinstance(comp, (gr.State, gr.File)) and not getattr(comp, "lenient", False):
                    generate.lenient(comp).lenient = True


# ---------------------------------------------------------------------------------------------------- layout
def _model_bar(jobs, start_model: str, picked: bool) -> SimpleNamespace:
    """The model choice above the tabs: every tab runs on it."""
    bar = SimpleNamespace()
    listed = start_model in models.builtin_names()   # else a path or hub id: it goes in the free field
    with gr.Row(equal_height=True):
        # wide enough for the longest label in full (a cut "SmolLM2-135M taught MA…" hid what the model is)
        bar.model = gr.Dropdown(models.Resolver(jobs).choices(), value=start_model if listed else models.DEFAULT_MODEL,
                                label="Model", scale=5, min_width=330, elem_id="model-picker")
        bar.free = gr.Textbox(value="" if listed else start_model, label="…or a local path / hub id", scale=2,
                              min_width=160, max_length=300, max_lines=1,
                              placeholder="path or owner/model (overrides the list)")
        # names only: the model picker beside it describes them, and a narrow field cuts a description
        bar.ar_choice = gr.Dropdown([("same model, τ off", models.SAME_MODEL)]
                                    + [(n, n) for n in models.builtin_names()],
                                    value=models.SAME_MODEL, label="AR baseline", scale=2, min_width=160,
                                    elem_id="ar-picker")
        bar.load_btn = gr.Button("Load model", scale=1, min_width=100)
    with gr.Column(elem_id="status-top"):   # two short lines, no gap: the race stays on a projector's screen
        bar.model_status = gr.Markdown("", elem_id="model-status")
        # the background model (smollm2-mars): "preparing … s so far" until ready, polled by prep_timer
        with gr.Row(equal_height=True):
            bar.prep_status = gr.Markdown("", elem_id="prep-status")
            # shown when the background model is ready but the user has touched the page: the switch is theirs
            bar.switch_btn = gr.Button("Switch", size="sm", visible=False, scale=0, min_width=200,
                                       elem_id="switch-default")
    bar.prep_timer = gr.Timer(generate.PREPARE_POLL_S)
    bar.picked = gr.State(picked)  # True once the user chose a model: the page then never switches it
    return bar


def _generate_tab(start_model: str) -> SimpleNamespace:
    """The race: prompt, examples, Race and τ first (they and the lanes' first lines fit a 1024×768 projector),
    then the lanes, the replay bar and the numbers; everything else folds into "Advanced settings" below."""
    gen = SimpleNamespace()
    first_examples = models.example_prompts(start_model)
    first_prompt = first_examples[0] if first_examples else ""
    first_notice = notices.notice(start_model, first_prompt, models.default_tau(start_model))[0]
    with gr.Tab("Generate", id="generate"):
        with gr.Row(equal_height=True, elem_id="race-controls"):
            # no max_length: the browser would cut a long prompt silently; the handler cuts it with a note
            gen.prompt = gr.Textbox(value=first_prompt, label="Prompt", lines=2, max_lines=4, scale=5,
                                    elem_id="prompt",
                                    placeholder=f"at most {generate.MAX_PROMPT_CHARS:,} characters are used")
            # it shows the example the prompt holds (an empty list looked like no examples at all)
            gen.examples = gr.Dropdown(first_examples, value=first_prompt or None, elem_id="examples", scale=3,
                                       min_width=240, label="Example prompts for this model")
        with gr.Row(equal_height=True, elem_id="tau-row"):
            gr.HTML('<span class="tau-label" title="τ: the confidence a guess needs to be kept; lower = more '
                    'tokens per forward, less fidelity; τ off = exactly greedy AR">τ</span>', min_height=0,
                    padding=False, elem_id="tau-label")
            gen.tau = generate.lenient(gr.Slider(generate.TAU_MIN, generate.TAU_MAX,
                                                 value=models.default_tau(start_model), step=0.01,
                                                 label="τ, the confidence threshold (lower: more tokens per "
                                                       "forward, less fidelity)", scale=5, elem_id="tau",
                                                 container=False))
            gen.tau_off = gr.Checkbox(False, label="τ off (one-token mode)", scale=1, min_width=150,
                                      elem_id="tau-off")
            gen.present = gr.Checkbox(False, label="presentation mode", scale=1, min_width=150,
                                      elem_id="present-toggle")
            gen.go_btn = gr.Button("▶ Race", variant="primary", elem_id="generate-btn", size="lg", scale=2,
                                   min_width=160)
        with gr.Column(elem_id="status-block"):   # empty lines take no room (CSS): the lanes stay on screen
            first_note = notices.teaching_note(start_model)
            gen.teach_note = gr.Markdown(first_note, elem_id="teach-note", visible=bool(first_note))
            gen.notice = gr.Markdown(first_notice, elem_id="notice", visible=bool(first_notice))
            with gr.Row():
                gen.notice_model_btn = gr.Button("Switch model", size="sm", visible=False, elem_id="notice-model")
                gen.notice_off_btn = gr.Button("Use one-token mode (τ off)", size="sm", visible=False,
                                               elem_id="notice-off")
        _race_view(gen)
        with gr.Accordion("Glossary: the words of this page", open=False, elem_id="glossary"):
            gr.HTML(glossary_html())
        with gr.Accordion("Advanced settings: block size, tokens, sampling, confidence, lossless drafts, timing",
                          open=False, elem_id="advanced"):
            with gr.Row(equal_height=True):
                gen.block_size = generate.lenient(gr.Slider(2, 8, value=models.default_block_size(start_model), step=1,
                                                            label="block size B", scale=2))
                gen.max_new = generate.lenient(gr.Slider(8, generate.MAX_NEW_TOKENS, value=112, step=8,
                                                         label="max new tokens", scale=2, elem_id="max-new"))
                gen.temperature = generate.lenient(gr.Slider(0.0, 2.0, value=0.0, step=0.05,
                                                             label="temperature (0 = greedy)", scale=2,
                                                             elem_id="temperature"))
                gen.seed = gr.Number(0, label="seed (sampling)", precision=0, scale=1, visible=False,
                                     elem_id="seed", info="same seed, same sample")
                gen.criterion = gr.Dropdown(generate.CRITERION_CHOICES, value="prob", label="confidence", scale=2,
                                            elem_id="criterion", info="what must reach τ (the paper: probability)")
            with gr.Row():
                gen.draft_layout = gr.Dropdown(generate.LAYOUT_CHOICES, value=generate.FASTEST,
                                               label="lossless drafts", scale=3, min_width=330,
                                               elem_id="draft-layout",
                                               info="fastest: all of B's masks, one mask, or one mask + runner-ups, "
                                                    "whichever a short timed decode of this model finds fastest "
                                                    "here; after every draft: a rejection no longer leaves the "
                                                    "next pass without drafts, at more positions per pass")
                gen.copy_drafts = gr.Checkbox(False, label="copy drafts from the prompt", scale=1,
                                              elem_id="copy-drafts",
                                              info="prompt lookup: draft what followed the same tokens earlier")
                # string values: the API documents a dropdown's values as strings, and inputs.check_slow_motion
                # turns them back into the factor
                gen.slow_motion = gr.Dropdown([(label, str(v)) for label, v in generate.SLOW_MOTION], value="1",
                                              label="live slow motion (slows the decoding itself; the replay "
                                                    "above slows nothing)", scale=2, elem_id="slow-motion")
                gen.measure_after = gr.Checkbox(True, label="then time again (the quotable speedup)", scale=1,
                                                elem_id="measure-after")
    return gen


def _race_view(gen: SimpleNamespace) -> None:
    """The replay bar, the three lanes side by side, then the legend, the stats, the plots and the step ledger
    (added to `gen`)."""
    gr.HTML(REPLAY_BAR, elem_id="replay")
    gen.panes = {}
    with gr.Row(equal_height=True, elem_id="lanes"):
        for lane in LANES:
            with gr.Column(elem_classes="race-pane", min_width=200):
                gr.HTML(f'<h3 class="pane-title" title="{PANE_TIPS[lane]}">{PANE_TITLES[lane]} '
                        f'<small>{PANE_TIPS[lane].split(":")[0]}</small></h3>', padding=False)
                gen.panes[lane] = gr.HTML(render_chunks(SideRecord(LANE_LABELS[lane], lane),
                                                        generate.PLACEHOLDERS[lane]), elem_id=f"{lane}-pane")
    # below the lanes: a race's notes and the timing's progress must not push the lanes off a projector
    with gr.Column(elem_id="status-after"):
        gen.race_status = gr.Markdown("", elem_id="race-status")
        gen.tau_status = gr.Markdown("", elem_id="tau-status")
    gr.HTML(legend_html(8))
    with gr.Row():
        with gr.Column(scale=3):
            gen.stats = gr.HTML(render_stats(generate.empty_sides()), elem_id="stats")
        with gr.Column(scale=2):
            gr.Markdown(STAT_DEFINITIONS, elem_classes="defs")
    with gr.Row():
        gen.tpf_plot = gr.Plot(empty_figure("tokens per forward appear after a run"), label="tokens per forward")
        gen.acc_plot = gr.Plot(empty_figure("acceptance per slot appears after a run"), label="acceptance per slot")
    gen.diff_view = gr.HTML(diff_placeholder(), elem_id="token-diff")
    with gr.Accordion("Step ledger: the candidates (or the checked drafts) of any forward pass", open=True):
        with gr.Row():
            gen.ledger_side = gr.Radio(list(generate.LEDGER_LANES), value="MARS", label="lane", scale=1)
            gen.ledger_step = gr.Slider(0, 1, value=0, step=1, label="forward pass (step)", scale=4,
                                        interactive=False)
        gen.ledger = gr.HTML(render_ledger(SideRecord("MARS", "mars"), 0), elem_id="ledger")
    gen.race_state = gr.State(None)


def _explorer_tab(start_model: str) -> SimpleNamespace:
    sweep = SimpleNamespace()
    with gr.Tab("τ explorer", id="explorer"):
        gr.Markdown("Sweep τ over a set of prompts with the model chosen above. Built-in tasks are scored "
                    "by exact answer; pasted prompts by **agreement with the model's own AR output** "
                    "(identical tokens). Speedup = AR time ÷ MARS time, measured alternately, batch 1. "
                    f"Built-in tasks need a model trained on them (**{models.TASK_MODEL}** or a Finetune run on "
                    f"the built-in suite); with {models.FREE_TEXT_DEFAULT}, sweep your own prompts.")
        with gr.Row():
            sweep.source = gr.Radio([("built-in held-out tasks", "builtin"), ("my prompts (one per line)", "free")],
                                    value="builtin", label="prompts", scale=2)
            sweep.n_tasks = gr.Slider(2, 100, value=16, step=1, label="number of built-in tasks", scale=2,
                                     elem_id="n-tasks")
            sweep.taus_text = gr.Textbox("1.0, 0.95, 0.9, 0.8, 0.7, 0.6", label="τ values", scale=2, elem_id="taus")
        sweep.free_prompts = gr.Textbox(label="my prompts (one per line, at most 20)", lines=3,
                                        elem_id="free-prompts")
        with gr.Row():
            # the race's B for the model, so a sweep's τ = 0.97 row is the race's τ = 0.97 (follows a model change)
            sweep.block_size = gr.Slider(2, 8, value=models.default_block_size(start_model), step=1,
                                         label="block size B")
            # 128: the suite's longest answers fit (at 64 every row, AR's included, scored lower on tiny-mars:
            # docs/experiments/app-timing.md, "The app's race and sweep at class speed")
            sweep.max_new = gr.Slider(8, 256, value=128, step=8, label="max new tokens")
            sweep.criterion = gr.Dropdown(generate.CRITERION_CHOICES, value="prob", label="confidence",
                                          elem_id="ex-criterion")
            sweep.lossless = gr.Checkbox(True, label="add the lossless curve (verify mode)", elem_id="ex-lossless")
            sweep.sweep_btn = gr.Button("Run sweep", variant="primary", elem_id="sweep-btn")
        sweep.status = gr.Markdown("", elem_id="sweep-status")
        sweep.pareto = gr.Plot(empty_figure("the Pareto plot appears after a sweep"), label="Pareto",
                               elem_id="pareto")
        sweep.table = gr.Dataframe(headers=explorer.TABLE_HEADERS, label="sweep results", interactive=False)
        sweep.export = gr.File(label="JSON export", interactive=False)
    return sweep


def _learn_tab(start_model: str) -> SimpleNamespace:
    lesson = SimpleNamespace()
    with gr.Tab("Learn", id="learn"):
        with gr.Row():
            with gr.Column(scale=3):
                with gr.Row():
                    lesson.mask_n = gr.Slider(2, 32, value=12, step=1, label="sequence length n")
                    # the model's B, as the race starts with: Learn's steps then match the race's
                    lesson.mask_b = gr.Slider(1, 8, value=models.default_block_size(start_model), step=1,
                                              label="block size B")
                lesson.mask_plot = gr.Plot(label="training attention mask", elem_id="learn-mask")
            with gr.Column(scale=2):
                gr.Markdown(learn.MASK_TEXT)
        gr.Markdown("### One inference step of the current prompt")
        with gr.Row():
            with gr.Column(scale=2):
                gr.Markdown(learn.STEP_TEXT)
                gr.Markdown("Runs on the model chosen above.", elem_classes="defs")
                lesson.step_btn = gr.Button("Lay out the first step of the Generate tab's prompt with this B",
                                            variant="primary", elem_id="learn-step-btn")
                lesson.all_btn = gr.Button("Step through every forward pass of its decode", elem_id="learn-all-btn")
                lesson.step_k = gr.Slider(0, 1, value=0, step=1, label="forward pass (0 = the first)",
                                          interactive=False, elem_id="learn-step-k")
                lesson.steps_state = gr.State(None)
            with gr.Column(scale=3):
                lesson.step_view = gr.HTML("", elem_id="learn-step")
                lesson.conf_plot = gr.Plot(empty_figure("candidate confidences appear here"),
                                           label="confidence vs τ")
    return lesson


def _finetune_tab(jobs) -> SimpleNamespace:
    ft = SimpleNamespace()
    with gr.Tab("Finetune", id="finetune"):
        gr.Markdown("Train your own MARS model. The job runs as its own process; this page only reads "
                    "its files (`runs/<name>/status.json`, `metrics.jsonl`, `log.txt`), so you can "
                    "refresh or close the page and come back. One job at a time.")
        with gr.Row():
            ft.base = gr.Dropdown(finetune_ui.base_choices(jobs), value=finetune_ui.DEFAULTS["base"],
                                  label="base model", scale=2, elem_id="ft-base")
            ft.data_source = gr.Radio([("built-in task suite", "builtin"), ("upload chat JSONL", "upload")],
                                      value="builtin", label="dataset", scale=2)
            ft.upload = gr.File(label="chat JSONL (≤ 20 MB)", file_types=[".jsonl", ".json"], type="filepath",
                                scale=2, visible=False, elem_id="ft-upload")
        ft.data_report = gr.Markdown("", elem_id="ft-data-report")
        with gr.Row():
            ft.stage = gr.Radio([("AR-SFT (stage 1)", "ar-sft"), ("MARS (stage 2)", "mars")],
                                value=finetune_ui.DEFAULTS["stage"], label="stage")
            ft.block_size = gr.Slider(1, 8, value=4, step=1, label="block size B")
            ft.ar_weight = gr.Slider(0.0, 2.0, value=1.0, step=0.1, label="ar_weight (1 = MARS, 0 = ablation)")
            # no minimum/maximum here: Gradio would refuse an out-of-range number before the handler, as a
            # passing toast while the command shown stayed the old one; finetune_ui says what is wrong in the tab
            ft.steps = gr.Number(finetune_ui.DEFAULTS["steps"], label="steps", precision=0, elem_id="ft-steps")
            ft.lr = gr.Number(finetune_ui.DEFAULTS["lr"], label="learning rate")
            ft.lora = gr.Checkbox(False, label="LoRA")
        ft.inputs = [ft.base, ft.data_source, ft.upload, ft.stage, ft.block_size, ft.ar_weight, ft.steps, ft.lr,
                     ft.lora]
        ft.command = gr.Markdown("", elem_id="ft-command")
        with gr.Row():
            ft.start_btn = gr.Button("Start", variant="primary", elem_id="ft-start")
            ft.stop_btn = gr.Button("Stop (save, then exit)", elem_id="ft-stop")
            ft.kill_btn = gr.Button("Kill", variant="stop", elem_id="ft-kill")
        ft.msg = gr.Markdown("", elem_id="ft-msg")
        ft.job_status = gr.HTML(finetune_ui.status_html(None), elem_id="ft-status")
        ft.loss_plot = gr.Plot(empty_figure("loss curves appear while a run trains"), label="loss",
                               elem_id="ft-loss")
        ft.log_box = gr.Textbox(label="log (last lines)", lines=8, max_lines=12, interactive=False,
                                elem_id="ft-log", autoscroll=True)
        ft.seen = gr.State({})
        ft.timer = gr.Timer(1.0)
    return ft


# ---------------------------------------------------------------------------------------------------- wiring
def _wire_model_bar(demo, bar, gen, sweep, lesson, resolver: models.Resolver) -> None:
    model_inputs = [bar.model, bar.free]
    load = partial(generate.load_model_ui, resolver=resolver)
    # the handler's own "Loading …" line stands in for Gradio's timer text (show_progress hidden)
    bar.load_btn.click(load, model_inputs, bar.model_status, show_progress="hidden", api_name="load_model")
    # the examples (and the prompt, while it is an example of another model) follow the model
    # τ and B (the race's, the sweep's and Learn's) start at the model's measured defaults (models.DEFAULT_TAUS,
    # DEFAULT_BLOCK_SIZES) whenever it changes
    for event in (bar.model.change, bar.free.submit):
        event(lambda choice, free: gr.update(value=models.default_tau(resolver.resolve_or_typed(choice, free))),
              model_inputs, gen.tau, **QUICK)
        for slider in (gen.block_size, sweep.block_size, lesson.mask_b):
            event(lambda choice, free: gr.update(value=models.default_block_size(resolver.resolve_or_typed(choice,
                                                                                                          free))),
                  model_inputs, slider, **QUICK)
    for event in (bar.model.change, bar.free.submit):
        event(partial(generate.examples_and_prompt, resolver=resolver), model_inputs + [gen.prompt],
              [gen.examples, gen.prompt], show_progress="hidden", **PRIVATE).then(
            load, model_inputs, bar.model_status, show_progress="hidden", **PRIVATE)
    gen.examples.change(generate.use_example, [gen.examples, gen.prompt], gen.prompt, **PRIVATE)
    demo.load(load, model_inputs, bar.model_status, show_progress="hidden", **PRIVATE)
    # ?present=1 opens the page in presentation mode (app/replay.js sets the look; this ticks the box to match)
    demo.load(None, None, gen.present, js="() => new URLSearchParams(location.search).get('present') === '1'",
              **QUICK)
    # A user's own choice (a picker event from the browser, not the poll's update) pins the model.
    bar.model.input(lambda: True, None, bar.picked, **QUICK)
    # so does the user's own prompt (typed, or an example picked): the page then never replaces it by itself
    for event in (gen.prompt.input, gen.examples.input):
        event(lambda: True, None, bar.picked, **QUICK)
    bar.switch_btn.click(lambda: (gr.update(value=models.PREPARER.name), gr.update(visible=False)), None,
                         [bar.model, bar.switch_btn], **QUICK)
    poll = partial(generate.poll_default_model, resolver=resolver)
    prep_inputs = [bar.model, bar.free, bar.picked]
    prep_outputs = [bar.prep_status, bar.model, gen.examples, bar.prep_timer, bar.switch_btn]
    bar.prep_timer.tick(poll, prep_inputs, prep_outputs, **QUICK)
    demo.load(poll, prep_inputs, prep_outputs, show_progress="hidden", **PRIVATE)


def _wire_notices(bar, gen, resolver: models.Resolver) -> None:
    """A model meeting prompts it was not trained for gets a notice, replaced whenever model, prompt or τ change."""
    offer = gr.State(None)
    inputs = [bar.model, bar.free, gen.prompt, gen.tau, gen.tau_off]
    outputs = [gen.notice, gen.notice_model_btn, gen.notice_off_btn, offer]
    for event in (bar.model.change, bar.free.submit, gen.prompt.change, gen.tau.change, gen.tau_off.change):
        event(partial(generate.notice_update, resolver=resolver), inputs, outputs, trigger_mode="always_last", **QUICK)
    gen.notice_model_btn.click(generate.take_offer, offer, [bar.model, bar.picked], **QUICK)
    for event in (bar.model.change, bar.free.submit):
        event(partial(generate.teaching_note_update, resolver=resolver), [bar.model, bar.free], gen.teach_note,
              trigger_mode="always_last", **QUICK)
    gen.notice_off_btn.click(lambda: True, None, gen.tau_off, **QUICK)


def _wire_race(bar, gen, resolver: models.Resolver) -> None:
    # presentation mode is the page's look only: a body class, no server round trip
    gen.present.change(None, gen.present, None, js="(on) => { document.body.classList.toggle('present', on); }",
                       **QUICK)
    gen.temperature.change(generate.show_seed, gen.temperature, gen.seed, **QUICK)
    outputs = [gen.race_status, gen.tau_status, *(gen.panes[n] for n in LANES), gen.stats,
               gen.tpf_plot, gen.acc_plot, gen.diff_view, gen.ledger_step, gen.ledger, gen.race_state]
    assert len(outputs) == generate.N_OUTPUTS

    def race_fn(choice, free_text, ar_choice, prompt, tau, tau_off, block_size, max_new_tokens, temperature,
                slow_motion, criterion, seed, measure_after, draft_layout, copy_drafts, request: gr.Request):
        # The one place the race's inputs are spelled out one by one: Gradio hands them over positionally (and
        # names the API's parameters after these); below this they travel as one named RaceInputs. A plain
        # function, not functools.partial: Gradio passes the session (τ is steered per session) only to a
        # parameter it can see typed as gr.Request.
        given = generate.RaceInputs(choice, free_text, ar_choice, prompt, tau, tau_off, block_size, max_new_tokens,
                                    temperature, slow_motion, criterion, seed, measure_after, draft_layout,
                                    copy_drafts)
        yield from generate.run_race(given, request, resolver)

    inputs = [bar.model, bar.free, bar.ar_choice, gen.prompt, gen.tau, gen.tau_off, gen.block_size, gen.max_new,
              gen.temperature, gen.slow_motion, gen.criterion, gen.seed, gen.measure_after, gen.draft_layout,
              gen.copy_drafts]
    for trigger, api in ((gen.go_btn.click, dict(api_name="race")), (gen.prompt.submit, PRIVATE)):
        # Outside Gradio's queue: the race waits for the machine itself (app.machine), saying where it stands,
        # without Gradio's timer text. "multiple": Race pressed again reaches the server, whose newer race stops
        # this page's older one. Enter in the prompt is the same race, so the API lists it once.
        trigger(race_fn, inputs, outputs, concurrency_limit=None, show_progress="hidden", trigger_mode="multiple",
                **api)
    for comp in (gen.tau, gen.tau_off):
        comp.change(generate.set_tau, [gen.tau, gen.tau_off], gen.tau_status, trigger_mode="always_last", **QUICK)
    gen.ledger_step.change(generate.show_ledger, [gen.race_state, gen.ledger_side, gen.ledger_step], gen.ledger,
                           show_progress="hidden", **PRIVATE)
    gen.ledger_side.change(generate.ledger_side_changed, [gen.race_state, gen.ledger_side],
                           [gen.ledger_step, gen.ledger], show_progress="hidden", **PRIVATE)


def _wire_explorer(bar, sweep, resolver: models.Resolver) -> None:
    inputs = [bar.model, bar.free, sweep.source, sweep.n_tasks, sweep.taus_text, sweep.free_prompts,
              sweep.block_size, sweep.max_new, sweep.criterion, sweep.lossless, bar.picked]
    # outside Gradio's queue, like the race: the sweep waits for the machine itself and streams its rows
    sweep.sweep_btn.click(partial(explorer.run_sweep, resolver=resolver), inputs,
                          [sweep.status, sweep.pareto, sweep.table, sweep.export], concurrency_limit=None,
                          show_progress="hidden", api_name="sweep")


def _wire_learn(demo, bar, gen, lesson, resolver: models.Resolver) -> None:
    mask_inputs = [lesson.mask_n, lesson.mask_b]
    for comp, api in ((lesson.mask_n, dict(api_name="mask")), (lesson.mask_b, PRIVATE)):   # one entry for both
        comp.change(learn.show_mask, mask_inputs, lesson.mask_plot, show_progress="hidden", **api)
    demo.load(learn.show_mask, mask_inputs, lesson.mask_plot, **PRIVATE)
    # the Generate tab's prompt, τ and confidence criterion, with the Learn tab's own B
    step_inputs = [bar.model, bar.free, gen.prompt, gen.tau, gen.tau_off, lesson.mask_b, gen.criterion, bar.picked]
    lesson.step_btn.click(partial(learn.one_step, resolver=resolver), step_inputs, [lesson.step_view, lesson.conf_plot],
                          concurrency_limit=None, show_progress="hidden", api_name="one_step")   # app.machine
    lesson.all_btn.click(partial(learn.all_steps, resolver=resolver), step_inputs[:-1],
                         [lesson.step_view, lesson.conf_plot, lesson.step_k, lesson.steps_state],
                         concurrency_limit=None, show_progress="hidden", **PRIVATE)
    lesson.step_k.change(learn.step_view, [lesson.steps_state, lesson.step_k], [lesson.step_view, lesson.conf_plot],
                         **QUICK)


def _clear_warnings_on_change(bar, gen, sweep, lesson, ft) -> None:
    """A warning is replaced as soon as its cause may have gone: any of the inputs it was about changes."""
    race_causes = [bar.model, bar.free, bar.ar_choice, gen.prompt, gen.tau, gen.tau_off, gen.block_size,
                   gen.max_new, gen.temperature, gen.criterion, gen.seed]
    sweep_causes = [bar.model, bar.free, sweep.source, sweep.n_tasks, sweep.taus_text, sweep.free_prompts,
                    sweep.block_size, sweep.max_new, sweep.criterion]
    step_causes = [bar.model, bar.free, gen.prompt, gen.tau, gen.tau_off, lesson.mask_b, gen.criterion]
    for target, causes in ((gen.race_status, race_causes), (sweep.status, sweep_causes),
                           (lesson.step_view, step_causes), (ft.msg, ft.inputs)):
        for comp in causes:
            comp.change(generate.clear_warning, target, target, **QUICK)


def _wire_finetune(demo, bar, ft, jobs) -> None:
    preview = partial(finetune_ui.command_preview, jobs)
    for comp in ft.inputs:
        comp.change(preview, ft.inputs, ft.command, show_progress="hidden", **PRIVATE)
    ft.upload.change(finetune_ui.upload_report, ft.upload, ft.data_report, **PRIVATE)
    # switching the dataset replaces what was said about the other one (report, start error)
    ft.data_source.change(finetune_ui.data_source_changed, [ft.data_source, ft.upload],
                          [ft.upload, ft.data_report, ft.msg], show_progress="hidden", **PRIVATE)
    demo.load(preview, ft.inputs, ft.command, **PRIVATE)
    ft.start_btn.click(partial(finetune_ui.start, jobs), ft.inputs, ft.msg, show_progress="hidden",
                       api_name="finetune_start")
    ft.stop_btn.click(partial(finetune_ui.stop, jobs), None, ft.msg, show_progress="hidden", api_name="finetune_stop")
    ft.kill_btn.click(partial(finetune_ui.kill, jobs), None, ft.msg, show_progress="hidden", api_name="finetune_kill")
    # a finished run joins both model lists: the picker above and the base models here
    poll = partial(finetune_ui.poll, jobs)
    poll_outputs = [ft.job_status, ft.loss_plot, ft.log_box, bar.model, ft.base, ft.seen]
    ft.timer.tick(poll, ft.seen, poll_outputs, **QUICK)
    demo.load(poll, ft.seen, poll_outputs, **PRIVATE)
