"""The MARS Playground page: components and event wiring only (handlers live in sibling modules)."""
from __future__ import annotations

import html
from functools import partial
from pathlib import Path

import gradio as gr

from app import explorer, finetune_ui, generate, learn, models, notices
from app.plots import empty_figure
from app.race import (LANE_LABELS, LANES, STAT_DEFINITIONS, SideRecord, legend_html, render_chunks,
                      render_ledger, render_stats)
from app.runs import JobManager

CSS = """
.race-pane {border: 1px solid #e5e7eb; border-radius: 10px; padding: 10px 12px; background: #fff;}
.race-pane h3 {margin: 0 0 6px 0;}
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
.speedup {margin-top: 8px; font-size: 20px;}
.speedup .how {font-size: 12px; color: #6b7280; margin-left: 8px;}
.defs {font-size: 12.5px; color: #4b5563;}
.ledger table, .learn-step table {border-collapse: collapse; width: 100%; font-size: 13.5px;}
.ledger th, .ledger td, .learn-step th, .learn-step td {border-bottom: 1px solid #e5e7eb; padding: 4px 8px;
                                                       text-align: left;}
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
.learn-step .maskcell {background: #fef3c7; border-color: #f59e0b;}
.learn-step .accepted {background: #dcfce7; border-color: #22c55e;}
.race-text .verified {text-decoration: underline 2px #7c3aed; text-underline-offset: 3px;}
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
.job {font-size: 14px;}
.job .progress {height: 12px; background: #e5e7eb; border-radius: 6px; margin-top: 6px; overflow: hidden;}
.job .progress div {height: 100%;}
.job .ckpt {font-size: 12px; color: #4b5563; margin-top: 4px;}
"""

def _empty_sides():
    return {n: SideRecord(LANE_LABELS[n], n) for n in LANES}


def _positive(value) -> bool:
    try:
        return float(value) > 0
    except (TypeError, ValueError):
        return False


RUNS_DIR = Path(__file__).resolve().parent.parent / "runs"

INTRO = """# MARS Playground
**MARS** (Mask AutoRegression, arXiv 2604.07023) fine-tunes an ordinary causal LM so that one forward pass can
emit several tokens: after the committed text come `B` mask tokens; the model predicts a candidate for each and
keeps them left to right while their confidence is at least **τ**. Easy spans arrive several tokens at a time,
hard tokens one by one — and with τ off it is exactly greedy AR decoding."""


def build_ui(default_model: str | None = None, runs_dir: str | Path = RUNS_DIR,
             launcher: str = "accelerate") -> gr.Blocks:
    """default_model None = automatic: start on tiny-mars and move free text to smollm2-mars once the
    background preparer (models.PREPARER, started by app.py) has it ready; a named model is the user's
    choice and stays."""
    jobs = JobManager(runs_dir, launcher=launcher)
    auto = default_model is None
    start_model = models.DEFAULT_MODEL if auto else default_model
    builtin = models.builtin_names()
    picker_value = start_model if start_model in builtin else models.DEFAULT_MODEL
    free_value = "" if start_model in builtin else start_model
    first_examples = models.example_prompts(start_model)
    first_notice = notices.notice(start_model, first_examples[0] if first_examples else "", 0.9)[0]

    with gr.Blocks(title="MARS Playground", analytics_enabled=False) as demo:
        gr.Markdown(INTRO)
        with gr.Row(equal_height=True):
            model = gr.Dropdown(models.model_choices(jobs), value=picker_value, label="Model", scale=3,
                                elem_id="model-picker")
            free = gr.Textbox(value=free_value, label="…or a local path / hub id", scale=3, max_length=300,
                              placeholder="/path/to/checkpoint or owner/model (overrides the list)")
            ar_choice = gr.Dropdown([("same model, τ off", models.SAME_MODEL)] + models.builtin_models(),
                                    value=models.SAME_MODEL, label="AR baseline", scale=2, elem_id="ar-picker")
            load_btn = gr.Button("Load model", scale=1)
        model_status = gr.Markdown("", elem_id="model-status")
        # the background model (smollm2-mars): "preparing … s so far" until ready, polled by prep_timer
        prep_status = gr.Markdown("", elem_id="prep-status")
        prep_timer = gr.Timer(generate.PREPARE_POLL_S)
        picked = gr.State(not auto)  # True once the user chose a model: the page then never switches it

        with gr.Tabs():
            # ---------------------------------------------------------------- Generate
            with gr.Tab("Generate", id="generate"):
                with gr.Row():
                    # no max_length: the browser would cut a long prompt silently; the handler cuts it with a note
                    prompt = gr.Textbox(value=first_examples[0] if first_examples else "", label="Prompt", lines=2,
                                        scale=4, elem_id="prompt",
                                        info=f"at most {generate.MAX_PROMPT_CHARS:,} characters are used")
                    examples = gr.Dropdown(first_examples, value=None, label="Example prompts for this model",
                                           scale=2, elem_id="examples")
                with gr.Row(equal_height=True):
                    tau = generate.lenient(gr.Slider(generate.TAU_MIN, generate.TAU_MAX, value=0.9, step=0.01,
                                                     label="τ (confidence threshold)", scale=3, elem_id="tau",
                                                     info="lower = more tokens per forward, less fidelity (lossy MARS)"))
                    tau_off = gr.Checkbox(False, label="τ off (one-token mode)", scale=1, elem_id="tau-off")
                    block_size = generate.lenient(gr.Slider(2, 8, value=4, step=1, label="block size B", scale=2))
                    max_new = generate.lenient(gr.Slider(8, generate.MAX_NEW_TOKENS, value=112, step=8,
                                                         label="max new tokens", scale=2))
                    temperature = generate.lenient(gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature (0 = greedy)",
                                                             scale=2, elem_id="temperature"))
                    seed = gr.Number(0, label="seed (sampling)", precision=0, scale=1, visible=False, elem_id="seed",
                                     info="same seed, same sample")
                    criterion = gr.Dropdown(generate.CRITERION_CHOICES, value="prob", label="confidence", scale=2,
                                            elem_id="criterion", info="what must reach τ (the paper: probability)")
                with gr.Row():
                    go_btn = gr.Button("▶ Race AR vs lossless MARS vs MARS", variant="primary", scale=3,
                                       elem_id="generate-btn")
                    slow_motion = gr.Dropdown(generate.SLOW_MOTION, value=1, show_label=False, scale=1,
                                              elem_id="slow-motion", container=False)
                    measure_after = gr.Checkbox(True, label="then time again (the quotable speedup)", scale=1,
                                                elem_id="measure-after", container=False)
                    tau_status = gr.Markdown("", elem_id="tau-status")
                notice = gr.Markdown(first_notice, elem_id="notice", visible=bool(first_notice))
                with gr.Row():
                    notice_model_btn = gr.Button("Switch model", size="sm", visible=False, elem_id="notice-model")
                    notice_off_btn = gr.Button("Use one-token mode (τ off)", size="sm", visible=False,
                                               elem_id="notice-off")
                race_status = gr.Markdown("", elem_id="race-status")
                gr.HTML(legend_html(8))
                with gr.Row(equal_height=True):
                    with gr.Column(elem_classes="race-pane"):
                        gr.Markdown("### AR baseline (one token per forward)")
                        ar_html = gr.HTML(render_chunks(SideRecord("AR", "ar"), generate.PLACEHOLDERS["ar"]),
                                          elem_id="ar-pane")
                    with gr.Column(elem_classes="race-pane"):
                        gr.Markdown("### MARS lossless (drafts checked: exactly AR's answer)")
                        verify_html = gr.HTML(render_chunks(SideRecord("MARS lossless", "verify"),
                                                            generate.PLACEHOLDERS["verify"]), elem_id="verify-pane")
                    with gr.Column(elem_classes="race-pane"):
                        gr.Markdown("### MARS (multi-token, lossy below τ = 1)")
                        mars_html = gr.HTML(render_chunks(SideRecord("MARS", "mars"), generate.PLACEHOLDERS["mars"]),
                                            elem_id="mars-pane")
                with gr.Row():
                    with gr.Column(scale=3):
                        stats = gr.HTML(render_stats(_empty_sides()), elem_id="stats")
                    with gr.Column(scale=2):
                        gr.Markdown(STAT_DEFINITIONS, elem_classes="defs")
                with gr.Row():
                    tpf_plot = gr.Plot(empty_figure("tokens per forward appear after a run"), label="tokens per forward")
                    acc_plot = gr.Plot(empty_figure("acceptance per slot appears after a run"), label="acceptance per slot")
                diff_plot = gr.Plot(empty_figure("the token diff appears after a run"), label="token diff")
                with gr.Accordion("Step ledger: the candidates (or the checked drafts) of any forward pass", open=True):
                    with gr.Row():
                        ledger_side = gr.Radio(["MARS", "MARS lossless", "AR"], value="MARS", label="lane", scale=1)
                        ledger_step = gr.Slider(0, 1, value=0, step=1, label="forward pass (step)", scale=4,
                                                interactive=False)
                    ledger = gr.HTML(render_ledger(SideRecord("MARS", "mars"), 0), elem_id="ledger")
                race_state = gr.State(None)

            # ---------------------------------------------------------------- τ explorer
            with gr.Tab("τ explorer", id="explorer"):
                gr.Markdown("Sweep τ over a set of prompts with the model chosen above. Built-in tasks are scored "
                            "by exact answer; pasted prompts by **agreement with the model's own AR output** "
                            "(identical tokens). Speedup = AR time ÷ MARS time, measured alternately, batch 1. "
                            f"Until you pick a model yourself, built-in tasks run on **{models.TASK_MODEL}** (trained "
                            f"on them) even when free text has moved to {models.FREE_TEXT_DEFAULT}.")
                with gr.Row():
                    source = gr.Radio([("built-in held-out tasks", "builtin"), ("my prompts (one per line)", "free")],
                                      value="builtin", label="prompts", scale=2)
                    n_tasks = gr.Slider(2, 100, value=16, step=1, label="number of built-in tasks", scale=2)
                    taus_text = gr.Textbox("1.0, 0.95, 0.9, 0.8, 0.7, 0.6", label="τ values", scale=2,
                                           elem_id="taus")
                free_prompts = gr.Textbox(label="my prompts (one per line, at most 20)", lines=3,
                                          elem_id="free-prompts")
                with gr.Row():
                    ex_block = gr.Slider(2, 8, value=4, step=1, label="block size B")
                    ex_max_new = gr.Slider(8, 256, value=64, step=8, label="max new tokens")
                    ex_criterion = gr.Dropdown(generate.CRITERION_CHOICES, value="prob", label="confidence",
                                               elem_id="ex-criterion")
                    lossless = gr.Checkbox(True, label="add the lossless curve (verify mode)", elem_id="ex-lossless")
                    sweep_btn = gr.Button("Run sweep", variant="primary", elem_id="sweep-btn")
                sweep_status = gr.Markdown("", elem_id="sweep-status")
                pareto = gr.Plot(empty_figure("the Pareto plot appears after a sweep"), label="Pareto",
                                 elem_id="pareto")
                table = gr.Dataframe(headers=explorer.TABLE_HEADERS, label="sweep results", interactive=False)
                export = gr.File(label="JSON export", interactive=False)

            # ---------------------------------------------------------------- Learn
            with gr.Tab("Learn", id="learn"):
                with gr.Row():
                    with gr.Column(scale=3):
                        with gr.Row():
                            mask_n = gr.Slider(2, 32, value=12, step=1, label="sequence length n")
                            mask_b = gr.Slider(1, 8, value=4, step=1, label="block size B")
                        mask_plot = gr.Plot(label="training attention mask", elem_id="learn-mask")
                    with gr.Column(scale=2):
                        gr.Markdown(learn.MASK_TEXT)
                gr.Markdown("### One inference step of the current prompt")
                with gr.Row():
                    with gr.Column(scale=2):
                        gr.Markdown(learn.STEP_TEXT)
                        gr.Markdown(f"Runs on **{models.TASK_MODEL}** until you pick a model above.",
                                    elem_classes="defs")
                        step_btn = gr.Button("Lay out the first step of the Generate tab's prompt with this B",
                                             variant="primary",
                                             elem_id="learn-step-btn")
                    with gr.Column(scale=3):
                        step_view = gr.HTML("", elem_id="learn-step")
                        conf_plot = gr.Plot(empty_figure("candidate confidences appear here"), label="confidence vs τ")

            # ---------------------------------------------------------------- Finetune
            with gr.Tab("Finetune", id="finetune"):
                gr.Markdown("Train your own MARS model. The job runs as its own process; this page only reads "
                            "its files (`runs/<name>/status.json`, `metrics.jsonl`, `log.txt`), so you can "
                            "refresh or close the page and come back. One job at a time.")
                with gr.Row():
                    base = gr.Dropdown(finetune_ui.base_choices(jobs), value=finetune_ui.DEFAULTS["base"],
                                       label="base model", scale=2, elem_id="ft-base")
                    data_source = gr.Radio([("built-in task suite", "builtin"), ("upload chat JSONL", "upload")],
                                           value="builtin", label="dataset", scale=2)
                    upload = gr.File(label="chat JSONL (≤ 20 MB)", file_types=[".jsonl", ".json"],
                                     type="filepath", scale=2, visible=False, elem_id="ft-upload")
                data_report = gr.Markdown("", elem_id="ft-data-report")
                with gr.Row():
                    stage = gr.Radio([("AR-SFT (stage 1)", "ar-sft"), ("MARS (stage 2)", "mars")],
                                     value=finetune_ui.DEFAULTS["stage"], label="stage")
                    ft_block = gr.Slider(1, 8, value=4, step=1, label="block size B")
                    ar_weight = gr.Slider(0.0, 2.0, value=1.0, step=0.1, label="ar_weight (1 = MARS, 0 = ablation)")
                    steps = gr.Number(finetune_ui.DEFAULTS["steps"], label="steps", precision=0, minimum=1,
                                      maximum=100000, elem_id="ft-steps")
                    lr = gr.Number(finetune_ui.DEFAULTS["lr"], label="learning rate", minimum=1e-7, maximum=1.0)
                    lora = gr.Checkbox(False, label="LoRA")
                command = gr.Markdown("", elem_id="ft-command")
                with gr.Row():
                    start_btn = gr.Button("Start", variant="primary", elem_id="ft-start")
                    stop_btn = gr.Button("Stop (save, then exit)", elem_id="ft-stop")
                    kill_btn = gr.Button("Kill", variant="stop", elem_id="ft-kill")
                ft_msg = gr.Markdown("", elem_id="ft-msg")
                job_status = gr.HTML(finetune_ui.status_html(None), elem_id="ft-status")
                loss_plot = gr.Plot(empty_figure("loss curves appear while a run trains"), label="loss",
                                    elem_id="ft-loss")
                log_box = gr.Textbox(label="log (last lines)", lines=8, max_lines=12, interactive=False,
                                     elem_id="ft-log", autoscroll=True)
                seen = gr.State({})
                timer = gr.Timer(1.0)

        # ---------------------------------------------------------------- wiring
        model_inputs = [model, free]
        load_btn.click(partial(generate.load_model_ui, jobs=jobs), model_inputs, model_status)
        # the examples (and the prompt, while it is an example of another model) follow the model
        for comp, ev in ((model, "change"), (free, "submit")):
            getattr(comp, ev)(partial(generate.examples_and_prompt, jobs=jobs), model_inputs + [prompt],
                              [examples, prompt], show_progress="hidden").then(
                partial(generate.load_model_ui, jobs=jobs), model_inputs, model_status)
        examples.change(lambda p, cur: p or cur, [examples, prompt], prompt)
        demo.load(partial(generate.load_model_ui, jobs=jobs), model_inputs, model_status)
        # A user's own choice (a picker event from the browser, not the poll's update) pins the model.
        model.input(lambda: True, None, picked, show_progress="hidden", concurrency_limit=None)
        prep_inputs, prep_outputs = [model, free, picked], [prep_status, model, examples, prep_timer]
        prep_timer.tick(partial(generate.poll_default_model, jobs=jobs), prep_inputs, prep_outputs,
                        show_progress="hidden", concurrency_limit=None)
        demo.load(partial(generate.poll_default_model, jobs=jobs), prep_inputs, prep_outputs,
                  show_progress="hidden")

        # notices: a model meeting prompts it was not trained for; replaced whenever model, prompt or τ change
        offer = gr.State(None)
        notice_inputs = [model, free, prompt, tau, tau_off]
        notice_outputs = [notice, notice_model_btn, notice_off_btn, offer]
        for comp, ev in ((model, "change"), (free, "submit"), (prompt, "change"), (tau, "change"),
                         (tau_off, "change")):
            getattr(comp, ev)(partial(generate.notice_update, jobs=jobs), notice_inputs, notice_outputs,
                              show_progress="hidden", concurrency_limit=None, trigger_mode="always_last")
        notice_model_btn.click(lambda name: (gr.update(value=name), True), offer, [model, picked],
                               show_progress="hidden", concurrency_limit=None)
        notice_off_btn.click(lambda: True, None, tau_off, show_progress="hidden", concurrency_limit=None)
        temperature.change(lambda t: gr.update(visible=_positive(t)), temperature, seed, show_progress="hidden",
                           concurrency_limit=None)

        race_outputs = [race_status, tau_status, ar_html, verify_html, mars_html, stats, tpf_plot, acc_plot,
                        diff_plot, ledger_step, ledger, race_state]
        assert len(race_outputs) == generate.N_OUTPUTS

        def race_fn(choice, free_text, ar, p, t, off, b, mx, temp, slow, crit, sd, again, request: gr.Request):
            # a plain function (not functools.partial) so that Gradio injects the request (τ is per session)
            yield from generate.run_race(choice, free_text, ar, p, t, off, b, mx, temp, slow, jobs=jobs,
                                         request=request, criterion=crit, seed=sd, measure_after=bool(again))

        race_inputs = [model, free, ar_choice, prompt, tau, tau_off, block_size, max_new, temperature, slow_motion,
                       criterion, seed, measure_after]
        for trigger in (go_btn.click, prompt.submit):
            # at once: the waiting line (replaced by the race's first message when the machine is free), then
            # the race in the shared queue, its queue position shown on the status line
            trigger(generate.waiting_status, None, race_status, show_progress="hidden", concurrency_limit=None).then(
                race_fn, race_inputs, race_outputs, concurrency_id="model", show_progress="minimal",
                show_progress_on=[race_status])
        for comp in (tau, tau_off):
            comp.change(generate.set_tau, [tau, tau_off], tau_status, trigger_mode="always_last",
                        show_progress="hidden", concurrency_limit=None)
        ledger_step.change(generate.show_ledger, [race_state, ledger_side, ledger_step], ledger, show_progress="hidden")
        ledger_side.change(generate.ledger_side_changed, [race_state, ledger_side], [ledger_step, ledger],
                           show_progress="hidden")

        def run_sweep(choice, free_text, src, n, taus_s, prompts_s, b, mx, crit, with_lossless, user_picked,
                      progress=gr.Progress()):
            try:
                taus = explorer.parse_taus(taus_s)
                crit = generate.check_criterion(crit)
                name = (models.resolve(choice, free_text, jobs) if src == "free"
                        else models.task_model(choice, free_text, user_picked, jobs))  # tasks: tiny-mars by default
                lm = models.get_model(name)
                if src == "free":
                    rows = explorer.sweep_free(lm, explorer.parse_prompts(prompts_s), taus, int(b), int(mx), progress,
                                               criterion=crit, lossless=bool(with_lossless))
                else:
                    rows = explorer.sweep_builtin(lm, int(n), taus, int(b), int(mx), progress, criterion=crit,
                                                  lossless=bool(with_lossless))
            except Exception as exc:
                return f"⚠ {models.friendly_error(exc)}", gr.skip(), gr.skip(), gr.skip()
            path = explorer.export_json(rows, {"model": name, "source": src, "block_size": int(b),
                                               "max_new_tokens": int(mx), "criterion": crit})
            n_tau = len({r["tau"] for r in rows})
            return (f"✓ {n_tau} τ values on {rows[0]['n']} prompts with **{name}** (confidence: {crit})"
                    + (", lossy and lossless MARS" if any(r.get("mode") == "verify" for r in rows) else "") + ".",
                    explorer.pareto_figure(rows), explorer.table_rows(rows), path)

        sweep_btn.click(generate.waiting_status, None, sweep_status, show_progress="hidden",
                        concurrency_limit=None).then(
            run_sweep, [model, free, source, n_tasks, taus_text, free_prompts, ex_block, ex_max_new, ex_criterion,
                        lossless, picked],
            [sweep_status, pareto, table, export], concurrency_id="model")

        def show_mask(n, b):
            try:
                return learn.mask_figure(int(n), int(b))
            except Exception as exc:
                return empty_figure(models.friendly_error(exc))

        for comp in (mask_n, mask_b):
            comp.change(show_mask, [mask_n, mask_b], mask_plot, show_progress="hidden")
        demo.load(show_mask, [mask_n, mask_b], mask_plot)

        def one_step(choice, free_text, p, t, off, b, crit, user_picked):
            # B is the Learn tab's own slider (the mask above shows the same B), not the Generate tab's
            try:
                p, t, _, _, _, notes = generate.check_inputs(p, t, off, 4, 8, 0.0)
                b = int(b)
                crit = generate.check_criterion(crit)
                lm = models.get_model(models.task_model(choice, free_text, user_picked, jobs))
                event = learn.first_step(lm, p, t, b, crit)
                note = "".join(f"<p class='defs'>✂ {html.escape(n)}</p>" for n in notes)
                return note + learn.step_html(lm, p, event), learn.confidence_figure(lm, event)
            except Exception as exc:
                return f"<p>⚠ {html.escape(models.friendly_error(exc))}</p>", gr.skip()

        step_btn.click(one_step, [model, free, prompt, tau, tau_off, mask_b, criterion, picked],
                       [step_view, conf_plot],
                       concurrency_id="model")

        # a warning is replaced as soon as its cause may have gone: any of the inputs it was about changes
        for target, causes in ((race_status, [model, free, ar_choice, prompt, tau, tau_off, block_size, max_new,
                                              temperature, criterion, seed]),
                               (sweep_status, [model, free, source, n_tasks, taus_text, free_prompts, ex_block,
                                               ex_max_new, ex_criterion]),
                               (step_view, [model, free, prompt, tau, tau_off, mask_b, criterion]),
                               (ft_msg, [base, data_source, upload, stage, ft_block, ar_weight, steps, lr, lora])):
            for comp in causes:
                comp.change(generate.clear_warning, target, target, show_progress="hidden", concurrency_limit=None)

        ft_inputs = [base, data_source, upload, stage, ft_block, ar_weight, steps, lr, lora]
        for comp in ft_inputs:
            comp.change(partial(finetune_ui.command_preview, jobs), ft_inputs, command, show_progress="hidden")
        upload.change(lambda f: finetune_ui.validate_jsonl(f)[1] if f else "", upload, data_report)
        # switching the dataset replaces what was said about the other one (report, start error)
        data_source.change(finetune_ui.data_source_changed, [data_source, upload], [upload, data_report, ft_msg],
                           show_progress="hidden")
        demo.load(partial(finetune_ui.command_preview, jobs), ft_inputs, command)
        start_btn.click(partial(finetune_ui.start, jobs), ft_inputs, ft_msg)
        stop_btn.click(partial(finetune_ui.stop, jobs), None, ft_msg)
        kill_btn.click(partial(finetune_ui.kill, jobs), None, ft_msg)
        poll_outputs = [job_status, loss_plot, log_box, model, base, seen]
        timer.tick(partial(finetune_ui.poll, jobs), seen, poll_outputs, show_progress="hidden",
                   concurrency_limit=None)
        demo.load(partial(finetune_ui.poll, jobs), seen, poll_outputs)
    demo.jobs = jobs  # for tests and app.py
    return demo
