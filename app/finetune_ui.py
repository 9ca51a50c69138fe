"""Finetune tab handlers: validate a dataset, show the exact command, start/stop/kill, poll the run.

The job itself is `app.runs.JobManager` (a detached process and its files); these functions
turn its state into page values. Polling is driven by a gr.Timer, so a refreshed page simply
picks the job up again from disk.
"""
from __future__ import annotations

import html
import json
from pathlib import Path

import gradio as gr
import plotly.graph_objects as go

from app import models
from app.inputs import check_flag
from app.plots import empty_figure
from app.runs import MAX_UPLOAD_BYTES, FinetuneRequest, build_command, log_tail, read_metrics, shell_quote
from mars_core.models import catalogue

# The catalogue's fine-tuning bases, each AR baseline first (the default base, tiny-ar-sft, leads the list).
BASE_MODELS = [(r.base_label, r.name) for r in catalogue.baselines_first(catalogue.models(finetune_base=True))]
# The default run's measured time and accuracy: docs/experiments/app-timing.md, "The app's default Finetune run".
DEFAULTS = dict(base="tiny-ar-sft", stage="mars", block_size=4, ar_weight=1.0, steps=600, lr=1e-3, lora=False,
                batch_size=16)


def base_choices(jobs) -> list[tuple[str, str]]:
    return BASE_MODELS + [(f"run: {n}", f"run:{n}") for n, _ in jobs.finished_checkpoints()]


def check_upload(path: str | None) -> tuple[list, list[str], str | None]:
    """(valid conversations, one error per bad line, or a refusal of the whole file) of an uploaded chat JSONL:
    every line checked as finetune.train checks it (finetune.data.validate_conversation, its row size limit)."""
    if not path:
        return [], [], "No file uploaded yet."
    p = Path(path)
    if p.suffix.lower() not in (".jsonl", ".json"):
        return [], [], f"`{p.name}` is not a .jsonl file; upload chat JSONL (one {{\"messages\": [...]}} per line)."
    size = p.stat().st_size
    if size > MAX_UPLOAD_BYTES:
        return [], [], f"the file is {size / 1e6:.1f} MB; the limit is {MAX_UPLOAD_BYTES / 1e6:.0f} MB."
    from finetune.data import MAX_ROW_BYTES, validate_conversation
    errors, good = [], []
    with open(p, "rb") as f:   # bytes, so a non-UTF-8 line is reported as the trainer would refuse it
        for lineno, raw in enumerate(f, start=1):
            where = f"line {lineno}"
            if len(raw.removesuffix(b"\n")) > MAX_ROW_BYTES:
                errors.append(f"{where}: the row is {len(raw):,} bytes, over the limit of {MAX_ROW_BYTES:,} that "
                              "training reads; split or shorten it")
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                errors.append(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                              "save the file as UTF-8")
                continue
            if lineno == 1:
                line = line.removeprefix("\ufeff")
            if not line.strip():
                continue
            try:
                good.append(validate_conversation(json.loads(line), where))
            except json.JSONDecodeError as e:
                errors.append(f"{where}: not valid JSON ({e.msg} at column {e.colno})")
            except ValueError as e:
                errors.append(str(e))
    return good, errors, None


def upload_refusal(path: str | None) -> str | None:
    """Why Start refuses the upload, in one line naming the first bad line and what is wrong with it; None if fine."""
    good, errors, refusal = check_upload(path)
    if refusal is not None:
        return refusal
    if errors:
        more = f" (and {len(errors) - 1} more bad line(s))" if len(errors) > 1 else ""
        return f"{errors[0]}{more}: fix the file and upload it again"
    return None if good else "the file has no conversations"


def validate_jsonl(path: str | None, max_errors: int = 20) -> tuple[bool, str]:
    """(ok, markdown): every line checked (``check_upload``); preview of the first rows."""
    good, errors, refusal = check_upload(path)
    if refusal is not None:
        return False, refusal if not path else f"⚠ {html.escape(refusal)}"
    p = Path(path)
    parts = [f"**{len(good)} valid conversation(s), {len(errors)} bad line(s)** in `{html.escape(p.name)}`."]
    if errors:
        parts.append("Errors (fix these lines; training starts only from a clean file):\n" +
                     "\n".join(f"- {html.escape(e)}" for e in errors[:max_errors]) +
                     (f"\n- … and {len(errors) - max_errors} more" if len(errors) > max_errors else ""))
    if good:
        parts.append("Preview:\n" + "\n".join(
            "- " + " · ".join(f"**{m['role']}**: {html.escape(m['content'][:80])}" for m in conv)
            for conv in good[:5]))
    ok = bool(good) and not errors
    if not good and not errors:
        parts.append("⚠ the file has no conversations.")
    return ok, "\n\n".join(parts)


def upload_report(path) -> str:
    """The report on a file just uploaded; nothing once it is removed."""
    return validate_jsonl(path)[1] if path else ""


def data_source_changed(source, upload):
    """(upload field, data report, start message): the other dataset's report and start error are replaced."""
    report = (validate_jsonl(upload)[1] if upload else "Upload a chat JSONL file.") if source == "upload" else ""
    return gr.update(visible=source == "upload"), report, ""


def _number(value, name: str, lo, hi, integer: bool):
    """A Finetune number field as int/float, or ValueError saying what to type (never Python's None)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ValueError(f"{name} is empty: type {'a whole number' if integer else 'a number'} in {lo:g}..{hi:g}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} {value!r} is not a number: type one in {lo:g}..{hi:g}") from None
    if integer:
        if v != int(v):
            raise ValueError(f"{name} {v:g} is not a whole number: type one in {lo:g}..{hi:g}")
        v = int(v)
    if not lo <= v <= hi:
        raise ValueError(f"{name} {v:g} is out of range: use {lo:g}..{hi:g}")
    return v


# Seconds per optimizer step behind the page's time estimate (a 2-core CPU, batch 16; the measurements:
# docs/experiments/app-timing.md, "The app's default Finetune run", and docs/smollm2-mars.md). Full SmolLM2
# training is slower.
SECONDS_PER_STEP = {catalogue.TINY: 0.35, catalogue.SMOLLM2: 4.4}   # by catalogue kind
ETA_WARN_S = 3600


def estimate_seconds(base: str, steps: int) -> float | None:
    # a substring guess, not catalogue.find: it also has to guess for finished runs ("run:<name>")
    family = catalogue.TINY if "tiny" in str(base) else catalogue.SMOLLM2 if "smollm2" in str(base).lower() else None
    return None if family is None else steps * SECONDS_PER_STEP[family]


def eta_warning(seconds) -> str:
    """A warning (not a refusal) for a run expected to take more than an hour."""
    if seconds is None or seconds <= ETA_WARN_S:
        return ""
    return (f"⚠ this run would take about {_fmt_eta(seconds)} ({seconds / 3600:.1f} h) here — it still starts if you "
            f"press Start; Stop saves a checkpoint at any time, or lower the steps")


def make_request(jobs, base, data_source, upload, stage, block_size, ar_weight, steps, lr, lora) -> FinetuneRequest:
    base_model = jobs.checkpoint_for(base[4:]) if str(base).startswith("run:") else base
    if not str(base).startswith("run:") and base not in [v for _, v in BASE_MODELS]:
        raise ValueError("no base model is chosen: pick one from the list" if base in (None, "") else
                         f"base model {base!r} is not in the list")
    if data_source not in ("builtin", "upload"):
        raise ValueError(f"dataset {data_source!r} is unknown: use 'builtin' (the task suite) or 'upload'")
    if stage not in ("ar-sft", "mars"):
        raise ValueError(f"stage {stage!r} is unknown: use 'ar-sft' (stage 1) or 'mars' (stage 2)")
    if data_source == "upload":
        refusal = upload_refusal(upload)
        if refusal is not None:
            raise ValueError("the uploaded dataset is not valid: " + refusal)
        data = "<run dir>/data.jsonl"
    else:
        data = "builtin"
    if steps is not None and not isinstance(steps, str) and steps == 0:   # the likeliest slip: say what it means
        raise ValueError("steps 0 would train nothing: type a whole number in 1..100000 (the default is "
                         f"{DEFAULTS['steps']})")
    steps = _number(steps, "steps", 1, 100000, integer=True)
    lr = _number(lr, "learning rate", 1e-7, 1.0, integer=False)
    block_size = _number(block_size, "block size B", 1, 8, integer=True)
    ar_weight = _number(ar_weight, "ar_weight", 0.0, 2.0, integer=False)
    return FinetuneRequest(base_model=base_model, data=data, stage=stage, block_size=block_size,
                           ar_weight=ar_weight, max_steps=steps, lr=lr, lora=check_flag(lora, "LoRA"),
                           batch_size=DEFAULTS["batch_size"])


def command_preview(jobs, base, data_source, upload, stage, block_size, ar_weight, steps, lr, lora) -> str:
    try:
        req = make_request(jobs, base, data_source, upload, stage, block_size, ar_weight, steps, lr, lora)
    except Exception as exc:
        return f"⚠ {models.friendly_error(exc)}"
    run_dir = jobs.runs_dir / "<name>"
    if data_source == "upload":
        req.data = str(run_dir / "data.jsonl")
    warn = eta_warning(estimate_seconds(base, req.max_steps))
    return (("" if not warn else warn + "\n\n") +
            "The exact command Start runs (in its own process group):\n```bash\n" +
            shell_quote(build_command(req, run_dir, jobs.launcher), wrap=True) +
            f" \\\n    > {run_dir / 'log.txt'} 2>&1\n```")


def start(jobs, base, data_source, upload, stage, block_size, ar_weight, steps, lr, lora) -> str:
    try:
        req = make_request(jobs, base, data_source, upload, stage, block_size, ar_weight, steps, lr, lora)
        name = jobs.start(req, data_file=upload if data_source == "upload" else None)
    except Exception as exc:
        return f"⚠ {models.friendly_error(exc)}"
    warn = eta_warning(estimate_seconds(base, req.max_steps))
    return f"▶ started run **{name}** in `{jobs.run_dir(name)}`" + (f"\n\n{warn}" if warn else "")


def _control(jobs, verb: str, mark: str) -> str:
    """Stop (SIGTERM: save, then exit) or kill (SIGKILL) the running job, as one readable line."""
    name = jobs.running_job()
    if not name:
        return "Nothing is running."
    try:
        return f"{mark} " + getattr(jobs, verb)(name)
    except Exception as exc:
        return f"⚠ {models.friendly_error(exc)}"


def stop(jobs) -> str:
    return _control(jobs, "stop", "■")


def kill(jobs) -> str:
    return _control(jobs, "kill", "✕")


def loss_figure(metrics: list[dict], name: str) -> go.Figure:
    if not metrics:
        return empty_figure("waiting for the first logged step …")
    fig = go.Figure()
    steps = [m.get("step") for m in metrics]
    for key, label, colour in (("loss_mask", "mask stream (noisy half)", "#2563eb"),
                               ("loss_ar", "AR stream (clean half)", "#16a34a"),
                               ("loss", "total", "#9ca3af")):
        ys = [m.get(key) for m in metrics]
        if any(y is not None for y in ys):
            fig.add_trace(go.Scatter(x=steps, y=ys, mode="lines", name=label, line=dict(color=colour)))
    fig.update_layout(title=f"Training loss — {name}", xaxis_title="optimizer step", yaxis_title="cross-entropy",
                      template="plotly_white", height=320, margin=dict(l=50, r=20, t=50, b=40),
                      legend=dict(orientation="h", y=-0.25))
    return fig


def _fmt_eta(s) -> str:
    if s is None:
        return "—"
    s = int(s)
    return f"{s // 60} min {s % 60:02d} s" if s >= 60 else f"{s} s"


def status_html(st: dict | None) -> str:
    if not st:
        return "<div class='job idle'>No finetune run yet. Pick the settings and press <b>Start</b>.</div>"
    step, total = st.get("step") or 0, st.get("max_steps") or 0
    frac = min(1.0, step / total) if total else 0.0
    state = st["state"]
    colour = {"running": "#2563eb", "finished": "#16a34a", "stopped": "#d97706",
              "interrupted": "#d97706"}.get(state, "#dc2626")
    extra = ""
    if state == "running":
        extra = f" · ETA {_fmt_eta(st.get('eta_s'))}"
        if (st.get("eta_s") or 0) > ETA_WARN_S:
            extra += " · <span class='eta-warn'>⚠ over an hour: Stop saves a checkpoint</span>"
    elif st.get("exit_code") is not None:
        extra = f" · exit code {st['exit_code']}"
    if st.get("error"):
        extra += f" · error: {html.escape(str(st['error'])[:200])}"
    ckpt = st.get("last_checkpoint")
    ck = f"<div class='ckpt'>checkpoint: <code>{html.escape(ckpt)}</code></div>" if ckpt else ""
    return (f"<div class='job' data-state='{state}'><div class='job-head'><b>{html.escape(st['name'])}</b> · "
            f"<span style='color:{colour}' class='job-state'>{state}</span> · step {step} / {total}{extra}</div>"
            f"<div class='progress'><div style='width:{frac * 100:.1f}%;background:{colour}'></div></div>{ck}</div>")


def poll(jobs, seen: dict | None):
    """Timer tick: (status html, loss figure or skip, log tail or skip, picker choices or skip, seen)."""
    seen = dict(seen or {})
    name = jobs.latest_job()
    if name is None:
        return status_html(None), gr.skip(), gr.skip(), gr.skip(), gr.skip(), seen
    st = jobs.status(name)
    metrics = read_metrics(Path(st["run_dir"]))
    key = (name, len(metrics), st["state"])
    fig = loss_figure(metrics, name) if seen.get("key") != list(key) else gr.skip()
    show_log = st["state"] not in ("running", "finished") or seen.get("key") != list(key)
    tail = log_tail(Path(st["run_dir"])) if show_log else gr.skip()
    finished = [n for n, _ in jobs.finished_checkpoints()]
    picker = gr.skip()
    base = gr.skip()
    if finished != seen.get("finished"):
        picker = gr.update(choices=models.Resolver(jobs).choices())
        base = gr.update(choices=base_choices(jobs))
    seen.update(key=list(key), finished=finished)
    return status_html(st), fig, tail, picker, base, seen
