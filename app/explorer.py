"""τ explorer: sweep τ over prompts, plot the speed/quality trade-off, export JSON.

Built-in held-out tasks go through F1's evaluator (`finetune.evaluate.sweep`: exact-answer
accuracy, tokens/forward, speedup). Free prompts have no answer key, so quality there is
agreement with the model's own AR output (MARS at τ → 1 must agree 100%).
"""
from __future__ import annotations

import difflib
import json
import tempfile
import time
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

MAX_FREE_PROMPTS = 20
MAX_BUILTIN = 200


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


def sweep_builtin(lm, n: int, taus, block_size: int, max_new_tokens: int, progress=None,
                  criterion: str = "prob") -> list[dict]:
    from finetune.evaluate import sweep
    from finetune.tasks import make_examples
    if not 1 <= int(n) <= MAX_BUILTIN:
        raise ValueError(f"{n} tasks is out of range; use 1..{MAX_BUILTIN}")
    examples = make_examples("heldout", int(n), seed=0)
    rows = sweep(lm, examples, taus, block_size=block_size, max_new_tokens=max_new_tokens, progress=progress,
                 timing_prompts=min(int(n), 8), criterion=criterion)
    for r in rows:
        r["quality"] = r["accuracy"]
        r["quality_name"] = "accuracy"
    return rows


def sweep_free(lm, prompts: list[str], taus, block_size: int, max_new_tokens: int, progress=None,
               criterion: str = "prob") -> list[dict]:
    """Agreement of MARS with the model's own AR output, tokens/forward and speedup, per τ."""
    from mars_core import DecodeConfig, generate
    from finetune.evaluate import time_against_ar
    ids = [lm.encode(p) for p in prompts]
    ar = generate(lm, ids, DecodeConfig(mode="ar", max_new_tokens=max_new_tokens))
    rows = []
    for k, tau in enumerate(taus):
        cfg = DecodeConfig(mode="mars", tau=tau, block_size=block_size, max_new_tokens=max_new_tokens,
                           criterion=criterion)
        out = generate(lm, ids, cfg)
        exact = sum(a.token_ids == m.token_ids for a, m in zip(ar, out)) / len(out)
        token_agree = sum(difflib.SequenceMatcher(a=a.token_ids, b=m.token_ids, autojunk=False).ratio()
                          for a, m in zip(ar, out)) / len(out)
        ar_t, mars_t = time_against_ar(lm, ids, cfg)
        rows.append({"model": lm.name, "tau": tau, "criterion": criterion, "block_size": block_size,
                     "n": len(prompts),
                     "quality": exact, "quality_name": "agreement with AR", "exact_agreement": exact,
                     "token_agreement": token_agree,
                     "tokens_per_forward": sum(m.tokens_per_forward for m in out) / len(out),
                     "speedup": ar_t / mars_t if mars_t > 0 else None, "ar_time_s": ar_t, "mars_time_s": mars_t,
                     "outputs": [m.text for m in out]})
        if progress is not None:
            progress((k + 1) / len(taus), f"τ={tau}: agreement {exact:.0%}")
    return rows


def pareto_figure(rows: list[dict]) -> go.Figure:
    """Two panels: tokens/forward vs quality and speedup vs quality, points labelled by τ."""
    qname = rows[0].get("quality_name", "accuracy") if rows else "accuracy"
    fig = make_subplots(rows=1, cols=2, subplot_titles=(f"tokens/forward vs {qname}", f"speedup vs {qname}"))
    pts = sorted(rows, key=lambda r: r["tau"])
    q = [100 * r["quality"] for r in pts]
    labels = [f"τ={r['tau']:g}" if r["tau"] < 1 else "τ=off" for r in pts]
    fig.add_trace(go.Scatter(x=q, y=[r["tokens_per_forward"] for r in pts], mode="lines+markers+text", text=labels,
                             textposition="top center", name="tokens/forward", marker=dict(size=10, color="#2563eb")),
                  row=1, col=1)
    fig.add_trace(go.Scatter(x=q, y=[r.get("speedup") for r in pts], mode="lines+markers+text", text=labels,
                             textposition="top center", name="speedup ×", marker=dict(size=10, color="#16a34a")),
                  row=1, col=2)
    for col in (1, 2):
        fig.update_xaxes(title_text=f"{qname} (%)", row=1, col=col)
    fig.update_yaxes(title_text="tokens per forward", row=1, col=1)
    fig.update_yaxes(title_text="wall-clock speedup × (AR time ÷ MARS time)", row=1, col=2)
    fig.update_layout(template="plotly_white", height=420, showlegend=False,
                      title=f"τ sweep on {rows[0]['n'] if rows else 0} prompts — up and to the right is better",
                      margin=dict(l=60, r=20, t=80, b=50))
    return fig


TABLE_HEADERS = ["τ", "quality", "tokens/forward", "speedup ×", "AR time (s)", "MARS time (s)", "prompts"]


def table_rows(rows: list[dict]) -> list[list]:
    return [["off" if r["tau"] >= 1 else r["tau"], f"{100 * r['quality']:.1f}% {r.get('quality_name', '')}",
             round(r["tokens_per_forward"], 3), None if r.get("speedup") is None else round(r["speedup"], 3),
             None if r.get("ar_time_s") is None else round(r["ar_time_s"], 3),
             None if r.get("mars_time_s") is None else round(r["mars_time_s"], 3), r["n"]] for r in rows]


def export_json(rows: list[dict], meta: dict) -> str:
    path = Path(tempfile.mkdtemp(prefix="mars-sweep-")) / f"tau-sweep-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    return str(path)
