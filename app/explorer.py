"""τ explorer: sweep τ over prompts, plot the speed/quality trade-off, export JSON.

Built-in held-out tasks go through the task-suite evaluator (`finetune.evals.evaluate.sweep`: exact-answer
accuracy, tokens/forward, speedup). Free prompts have no answer key, so quality there is
agreement with the model's own AR output (MARS at τ → 1 must agree 100%).
"""
from __future__ import annotations

import difflib
import json
import tempfile
import time
from pathlib import Path

import gradio as gr
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app import inputs, models
from app.machine import MACHINE, Turn, stop_at_forward, take_turn

MAX_FREE_PROMPTS = 20
MAX_BUILTIN = 200
BATCH = 16               # prompts decoded together in a lossless sweep
# A pasted-prompt row times MARS against AR on the first few prompts, each twice (the median of the two, and both
# as the spread): a row then takes seconds on a real-language model instead of minutes, so the rows arrive while a
# class watches.
TIMING_PROMPTS, TIMING_REPEATS = 4, 2


def parse_taus(text: str) -> list[float]:
    """'1.0, 0.9, 0.8' -> [1.0, 0.9, 0.8]; every τ must lie in [0.5, 1.0]."""
    parts = [p for p in str(text).replace(";", ",").replace(" ", ",").split(",") if p.strip()]
    if not parts:
        raise ValueError("no τ values given; type e.g. 1.0, 0.95, 0.9, 0.8, 0.7")
    taus = []
    for p in parts:
        try:
            t = float(p)
        except ValueError:
            raise ValueError(f"τ value {p!r} is not a number; type numbers separated by commas") from None
        if not 0.5 <= t <= 1.0:
            raise ValueError(f"τ value {t} is out of range; use 0.5..1.0 (1.0 = one-token mode)")
        taus.append(t)
    if len(taus) > 12:
        raise ValueError(f"{len(taus)} τ values is too many; use at most 12")
    return list(dict.fromkeys(taus))


def parse_prompts(text: str) -> list[str]:
    prompts = [line.strip() for line in str(text or "").splitlines() if line.strip()]
    if not prompts:
        raise ValueError("no prompts: paste one prompt per line, or choose the built-in held-out tasks")
    if len(prompts) > MAX_FREE_PROMPTS:
        raise ValueError(f"{len(prompts)} prompts is too many; use at most {MAX_FREE_PROMPTS}")
    for p in prompts:
        if len(p) > 2000:
            raise ValueError(f"a prompt has {len(p)} characters; the limit is 2000 per prompt")
    return prompts


def _verify_cfg(tau, block_size, max_new_tokens, criterion):
    from mars_core import DecodeConfig
    return DecodeConfig(mode="verify", tau=tau, block_size=block_size, max_new_tokens=max_new_tokens,
                        criterion=criterion)


def builtin_rows(lm, n: int, taus, block_size: int, max_new_tokens: int, criterion: str = "prob",
                 lossless: bool = False):
    """A generator of sweep rows, one per τ as each finishes: lossy MARS through the task-suite evaluator
    (`finetune.evals.evaluate.sweep`); with `lossless`, verify mode per τ < 1 too, scored the same way (its accuracy is
    AR's by construction, and is measured, not assumed)."""
    from finetune.evals.evaluate import SweepSettings, score, speedup_fields, sweep, timed_against_ar
    from finetune.evals.evaluate_common import decode_batches
    from finetune.tasks import make_examples
    if not 1 <= int(n) <= MAX_BUILTIN:
        raise ValueError(f"{n} tasks is out of range; use 1..{MAX_BUILTIN}")
    examples = make_examples("heldout", int(n), seed=0)
    for tau in taus:
        for r in sweep(lm, examples, [tau], SweepSettings(block_size=block_size, max_new_tokens=max_new_tokens,
                                                          timing_prompts=min(int(n), 8), criterion=criterion)):
            r.update(quality=r["accuracy"], quality_name="accuracy", mode="mars")
            yield r
    if not lossless:
        return
    ids = [lm.encode(ex["messages"][0]["content"]) for ex in examples]
    for tau in [t for t in taus if t < 1.0]:
        cfg = _verify_cfg(tau, block_size, max_new_tokens, criterion)
        out = decode_batches(lm, ids, cfg, BATCH)
        accuracy, per_family = score(examples, [r.text for r in out])
        timed = speedup_fields(timed_against_ar(lm, ids[:min(int(n), 8)], cfg))
        yield {"model": lm.name, "tau": tau, "criterion": criterion, "block_size": block_size,
               "n": len(examples), "mode": "verify", "accuracy": accuracy, "per_family": per_family,
               "quality": accuracy, "quality_name": "accuracy",
               "tokens_per_forward": sum(r.tokens_per_forward for r in out) / len(out),
               **timed, "timing_prompts": min(int(n), 8)}


def same_as_ar(row: dict) -> dict:
    """A lossy row at τ off is AR itself: its "speedup" would be two timings of one computation, noise shown as a
    speedup (docs/experiments/app-timing.md, "The app's race and sweep at class speed"). It is 1 by definition, with
    AR's time on both sides, and says so."""
    if row.get("mode") == "mars" and row["tau"] >= 1.0:
        row = dict(row, speedup=1.0, speedup_min=None, speedup_max=None, mars_time_s=row.get("ar_time_s"),
                   same_as_ar=True)
    return row


def sweep_builtin(lm, n: int, taus, block_size: int, max_new_tokens: int, criterion: str = "prob",
                  lossless: bool = False) -> list[dict]:
    """builtin_rows as a list."""
    return list(builtin_rows(lm, n, taus, block_size, max_new_tokens, criterion, lossless))


def free_rows(lm, prompts: list[str], taus, block_size: int, max_new_tokens: int, criterion: str = "prob",
              lossless: bool = False):
    """A generator of sweep rows, one per τ as each finishes: agreement of MARS with the model's own AR output,
    tokens/forward and speedup; with `lossless`, the same for verify mode at each τ < 1 (its agreement is 100% by
    construction, and is measured)."""
    from mars_core import DecodeConfig, generate
    from finetune.evals.evaluate import speedup_fields, timed_against_ar
    ids = [lm.encode(p) for p in prompts]
    ar = generate(lm, ids, DecodeConfig(mode="ar", max_new_tokens=max_new_tokens))
    timed = ids[:TIMING_PROMPTS]
    for mode, tau in [("mars", t) for t in taus] + ([("verify", t) for t in taus if t < 1.0] if lossless else []):
        cfg = (_verify_cfg(tau, block_size, max_new_tokens, criterion) if mode == "verify" else
               DecodeConfig(mode="mars", tau=tau, block_size=block_size, max_new_tokens=max_new_tokens,
                            criterion=criterion))
        out = generate(lm, ids, cfg)
        exact = sum(a.token_ids == m.token_ids for a, m in zip(ar, out)) / len(out)
        token_agree = sum(difflib.SequenceMatcher(a=a.token_ids, b=m.token_ids, autojunk=False).ratio()
                          for a, m in zip(ar, out)) / len(out)
        timing = speedup_fields(timed_against_ar(lm, timed, cfg, repeats=TIMING_REPEATS))
        yield {"model": lm.name, "tau": tau, "criterion": criterion, "block_size": block_size,
               "n": len(prompts), "mode": mode,
               "quality": exact, "quality_name": "agreement with AR", "exact_agreement": exact,
               "token_agreement": token_agree,
               "tokens_per_forward": sum(m.tokens_per_forward for m in out) / len(out),
               **timing, "timing_prompts": len(timed), "outputs": [m.text for m in out]}


def sweep_free(lm, prompts: list[str], taus, block_size: int, max_new_tokens: int, criterion: str = "prob",
               lossless: bool = False) -> list[dict]:
    """free_rows as a list."""
    return list(free_rows(lm, prompts, taus, block_size, max_new_tokens, criterion, lossless))


def knows_the_tasks(name: str) -> bool:
    """Whether `name` (resolved) was trained on the built-in task suite: a catalogue model for task prompts, or a
    checkpoint whose train_config.json says data = builtin (a finetune run on the suite)."""
    from mars_core.models import catalogue
    return name in catalogue.names(prompts=catalogue.TASKS) or models._trained_on_builtin(name)


def not_a_task_model(choice, free_text, name: str) -> str:
    from mars_core.models import catalogue
    label = name if (free_text or "").strip() else str(choice)
    suite = ", ".join(catalogue.names(prompts=catalogue.TASKS))
    return (f"the built-in tasks need a model trained on them ({suite}, or a Finetune run on the built-in "
            f"suite); {label} was not, so its accuracy there would say nothing. Pick {models.TASK_MODEL} above "
            f"to sweep the tasks, or choose \"my prompts\" to sweep {label}")


def check_sweep(choice, free_text, source, n, taus_text, prompts_text, block_size, max_new_tokens, criterion,
                resolver: models.Resolver = models.BUILTINS) -> dict:
    """The explorer's values, checked before the sweep waits for the machine; ValueError naming the fix."""
    if not isinstance(source, str) or source not in ("builtin", "free"):
        raise ValueError(f"prompts {source!r} is unknown: use 'builtin' (the held-out tasks) or 'free' (your own)")
    spec = dict(taus=parse_taus(taus_text), criterion=inputs.check_criterion(criterion),
                block_size=inputs.whole(block_size, "block size B", 2, 8),
                max_new=inputs.whole(max_new_tokens, "max new tokens", 8, 256))
    # the model the picker shows, for both sources: the page never switches models behind the user's back
    spec["name"] = name = resolver.resolve(choice, free_text)
    if source == "free":
        spec["prompts"] = parse_prompts(prompts_text)
    elif not knows_the_tasks(name):
        raise ValueError(not_a_task_model(choice, free_text, name))
    else:
        spec["n"] = inputs.whole(n, "number of built-in tasks", 1, MAX_BUILTIN)
    return spec


def run_sweep(choice, free_text, source, n, taus_text, prompts_text, block_size, max_new_tokens, criterion,
              lossless, picked=True, resolver: models.Resolver = models.BUILTINS, machine=MACHINE):
    """The Run sweep button: a generator of (status line, Pareto figure, table rows, JSON export); it waits for
    the machine saying where it stands, then a row per τ as each finishes; a ⚠ line for bad input.
    (`picked` stays in the signature for the page's wiring and API only.)"""
    try:
        spec = check_sweep(choice, free_text, source, n, taus_text, prompts_text, block_size, max_new_tokens,
                           criterion, resolver)
        lossless = inputs.check_flag(lossless, "add the lossless curve")
    except Exception as exc:
        yield f"⚠ {models.friendly_error(exc)}", gr.skip(), gr.skip(), gr.skip()
        return
    turn = Turn(machine, (yield from take_turn(machine, "a τ sweep", lambda line: (line,) + (gr.skip(),) * 3)))
    # the rows run in a thread: one row (100 tasks at one τ) computes for minutes without a yield
    work = turn.in_thread(lambda stop: _sweep_values(spec, source, bool(lossless), stop), "tau-sweep")
    try:
        yield from work.relay(idle=(gr.skip(),) * 4)
    finally:   # also when Gradio closes this generator because its page went away
        turn.end()


def _sweep_rows(lm, spec: dict, source: str, lossless: bool):
    kw = dict(criterion=spec["criterion"], lossless=lossless)
    if source == "free":
        return free_rows(lm, spec["prompts"], spec["taus"], spec["block_size"], spec["max_new"], **kw)
    return builtin_rows(lm, spec["n"], spec["taus"], spec["block_size"], spec["max_new"], **kw)


# Seconds per row of the last sweep of each kind (model, source, prompts, B, max tokens) in this process: the
# only basis for a time before a sweep's first row ends. Nothing is promised for a kind never swept here.
_PACE: dict[tuple, float] = {}


def first_row_estimate(pace_key: tuple, total: int) -> str:
    pace = _PACE.get(pace_key)
    if pace is None:
        return " (a time estimate follows the first row)"
    return f" (about {_duration(pace * total)} in all: the last sweep like this one here took {_duration(pace)} a row)"


def time_left(spent: float, done: int, total: int) -> str:
    """' · 12 s so far, about 30 s left at this pace' after `done` of `total` rows took `spent` seconds."""
    if done >= total:
        return f" · {_duration(spent)}"
    return f" · {_duration(spent)} so far, about {_duration(spent / done * (total - done))} left at this pace"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def _sweep_values(spec: dict, source: str, lossless: bool, stop):
    """The page's values as the rows arrive (in the sweep's thread; `stop` ends the row at its next forward)."""
    name, taus, criterion = spec["name"], spec["taus"], spec["criterion"]
    total = len(taus) + (sum(t < 1.0 for t in taus) if lossless else 0)
    rows: list[dict] = []
    pace_key = (name, source, spec.get("n"), len(spec.get("prompts") or ()), spec["block_size"], spec["max_new"])
    try:
        yield f"◔ loading **{name}** …", gr.skip(), gr.skip(), gr.skip()
        lm = models.get_model(name)   # a load is not cut short: it is cached for the next job
        with stop_at_forward([lm], stop):
            yield (f"◔ sweeping: row 1 of {total} …{first_row_estimate(pace_key, total)}",
                   gr.skip(), gr.skip(), gr.skip())
            started = time.perf_counter()
            for row in _sweep_rows(lm, spec, source, lossless):
                rows.append(same_as_ar(row))
                spent = time.perf_counter() - started
                _PACE[pace_key] = spent / len(rows)
                more = f" · row {len(rows) + 1} of {total} …" if len(rows) < total else ""
                yield (f"◔ {len(rows)} of {total} rows done{more}{time_left(spent, len(rows), total)}",
                       pareto_figure(rows), table_rows(rows), gr.skip())
    except Exception as exc:
        yield f"⚠ {models.friendly_error(exc)}", gr.skip(), gr.skip(), gr.skip()
        return
    path = export_json(rows, {"model": name, "source": source, "block_size": spec["block_size"],
                              "max_new_tokens": spec["max_new"], "criterion": criterion})
    both = ", lossy and lossless MARS" if any(r.get("mode") == "verify" for r in rows) else ""
    yield (f"✓ {len(taus)} τ values on {rows[0]['n']} prompts with **{name}** (confidence: {criterion}){both}.",
           pareto_figure(rows), table_rows(rows), path)


# Label placement: plotly does not avoid overlaps, so each τ label gets the first nearby offset whose box
# (estimated in pixels for the panel size below) meets no label or marker placed before it.
PANEL_PX = (520, 300)    # plot area of one panel (width, height) at the page's usual width
LABEL_H_PX, CHAR_PX, MARKER_PX = 14, 7, 12
_OFFSETS = [(0, 16), (0, -16), (34, 0), (-34, 0), (30, 16), (-30, 16), (30, -16), (-30, -16), (0, 32), (0, -32),
            (60, 0), (-60, 0), (56, 30), (-56, 30), (56, -30), (-56, -30), (0, 48), (0, -48)]


def _range(values: list[float], pad: float = 0.12, floor: float | None = None) -> list[float]:
    lo, hi = min(values), max(values)
    span = hi - lo or max(abs(hi), 1.0) * 0.2
    lo, hi = lo - pad * span, hi + pad * span
    if floor is not None:
        lo = max(floor, lo)
    return [lo, hi]


def place_labels(points: list[tuple[float, float, str]], xr: list[float], yr: list[float],
                 size=PANEL_PX) -> list[tuple[int, int, bool]]:
    """(x shift, y shift, collided) in pixels for each label, avoiding earlier labels and all markers."""
    W, H = size

    def px(x, y):
        return ((x - xr[0]) / (xr[1] - xr[0]) * W, (y - yr[0]) / (yr[1] - yr[0]) * H)

    def overlap(a, b):
        return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]

    markers = [px(x, y) for x, y, _ in points]
    boxes = [(mx - MARKER_PX / 2, my - MARKER_PX / 2, mx + MARKER_PX / 2, my + MARKER_PX / 2) for mx, my in markers]
    placed = []
    for (x, y, text), (mx, my) in zip(points, markers):
        w = CHAR_PX * len(text) + 4
        choice = None
        for dx, dy in _OFFSETS:
            cx, cy = mx + dx, my + dy
            box = (cx - w / 2, cy - LABEL_H_PX / 2, cx + w / 2, cy + LABEL_H_PX / 2)
            if not any(overlap(box, b) for b in boxes):
                choice = (dx, dy, box)
                break
        if choice is None:
            dx, dy = _OFFSETS[0]
            choice = (dx, dy, (mx + dx - w / 2, my + dy - LABEL_H_PX / 2, mx + dx + w / 2, my + dy + LABEL_H_PX / 2))
            placed.append((dx, dy, True))
        else:
            placed.append((choice[0], choice[1], False))
        boxes.append(choice[2])
    return placed


def merge_coincident(points: list[tuple], xr: list[float], yr: list[float], size=PANEL_PX) -> list[tuple]:
    """One label per spot: points of a curve that fall within a marker of each other (τ values that decode alike
    often give the same accuracy and tokens/forward) share one label, "τ=0.9, 0.8", instead of a stack of them."""
    W, H = size
    out: list[list] = []
    for x, y, text, colour in points:
        px, py = (x - xr[0]) / (xr[1] - xr[0]) * W, (y - yr[0]) / (yr[1] - yr[0]) * H
        near = next((g for g in out if g[3] == colour and abs(g[4] - px) < MARKER_PX / 2
                     and abs(g[5] - py) < MARKER_PX / 2), None)
        if near is None:
            out.append([x, y, text, colour, px, py])
        else:
            near[2] += ", " + text.removeprefix("τ=")
    return [(x, y, text, colour) for x, y, text, colour, _, _ in out]


def _tau_label(r: dict) -> str:
    return "τ=off" if r["tau"] >= 1 else f"τ={r['tau']:g}"


def pareto_figure(rows: list[dict]) -> go.Figure:
    """Two panels: tokens/forward vs quality and speedup vs quality; lossy MARS and (when swept) lossless MARS,
    whose quality is AR's, each point labelled by τ with labels that do not overlap."""
    qname = rows[0].get("quality_name", "accuracy") if rows else "accuracy"
    fig = make_subplots(rows=1, cols=2, subplot_titles=(f"tokens/forward vs {qname}", f"speedup vs {qname}"))
    curves = [("mars", "MARS (lossy)", "#2563eb", "solid"), ("verify", "MARS lossless (verify)", "#7c3aed", "dash")]
    for col, key, ytitle in ((1, "tokens_per_forward", "tokens per forward"),
                             (2, "speedup", "wall-clock speedup × (AR time ÷ MARS time)")):
        pts_all = []
        for mode, name, colour, dash in curves:
            pts = sorted([r for r in rows if r.get("mode", "mars") == mode and r.get(key) is not None],
                         key=lambda r: r["tau"])
            if not pts:
                continue
            fig.add_trace(go.Scatter(x=[100 * r["quality"] for r in pts], y=[r[key] for r in pts],
                                     mode="lines+markers", name=name, legendgroup=mode, showlegend=col == 1,
                                     line=dict(color=colour, dash=dash),
                                     marker=dict(size=10, color=colour,
                                                 symbol="circle" if mode == "mars" else "diamond"),
                                     hovertext=[f"{name} {_tau_label(r)}: {qname} {100 * r['quality']:.1f}%, "
                                                f"{r[key]:.2f}" for r in pts], hoverinfo="text"),
                          row=1, col=col)
            pts_all += [(100 * r["quality"], r[key], _tau_label(r), colour) for r in pts]
        if not pts_all:
            continue
        xr = _range([p[0] for p in pts_all], floor=None)
        yr = _range([p[1] for p in pts_all], floor=0.0)
        labels = merge_coincident(pts_all, xr, yr)
        shifts = place_labels([(x, y, t) for x, y, t, _ in labels], xr, yr)
        for (x, y, text, colour), (dx, dy, _) in zip(labels, shifts):
            far = abs(dx) > 34 or abs(dy) > 16   # a label moved away from its point gets a thin leader line
            fig.add_annotation(x=x, y=y, text=text, font=dict(size=11, color=colour), row=1, col=col,
                               **(dict(showarrow=True, ax=dx, ay=-dy, arrowhead=0, arrowwidth=0.7,
                                       arrowcolor=colour, standoff=5) if far
                                  else dict(showarrow=False, xshift=dx, yshift=dy)))
        fig.update_xaxes(range=xr, title_text=f"{qname} (%)", row=1, col=col)
        fig.update_yaxes(range=yr, title_text=ytitle, row=1, col=col)
    fig.update_layout(template="plotly_white", height=460, showlegend=True,
                      legend=dict(orientation="h", y=-0.18),
                      title=f"τ sweep on {rows[0]['n'] if rows else 0} prompts — up and to the right is better",
                      margin=dict(l=60, r=20, t=80, b=80))
    return fig


TABLE_HEADERS = ["mode", "τ", "quality", "tokens/forward", "speedup ×", "min–max (runs)", "AR time (s)",
                 "MARS time (s)", "prompts"]


def _spread_text(r: dict) -> str:
    """The per-repeat speedups' range: the same computation twice (τ off) has none to show."""
    if r.get("same_as_ar"):
        return "same computation as AR"
    if r.get("speedup_min") is None:
        return ""
    return f"{r['speedup_min']:.2f}–{r['speedup_max']:.2f} ({r.get('timing_repeats', '?')})"


def table_rows(rows: list[dict]) -> list[list]:
    return [["lossless" if r.get("mode") == "verify" else ("AR (τ off)" if r.get("same_as_ar") else "MARS"),
             "off" if r["tau"] >= 1 else r["tau"],
             f"{100 * r['quality']:.1f}% {r.get('quality_name', '')}",
             round(r["tokens_per_forward"], 3), None if r.get("speedup") is None else round(r["speedup"], 3),
             _spread_text(r),
             None if r.get("ar_time_s") is None else round(r["ar_time_s"], 3),
             None if r.get("mars_time_s") is None else round(r["mars_time_s"], 3), r["n"]] for r in rows]


def export_json(rows: list[dict], meta: dict) -> str:
    path = Path(tempfile.mkdtemp(prefix="mars-sweep-")) / f"tau-sweep-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    return str(path)
