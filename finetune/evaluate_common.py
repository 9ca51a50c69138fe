"""What both suites of finetune.evaluate share: batched decoding, the model labels and the τ curves.

A module of its own so that the natural suite (finetune.evaluate_natural) and the task suite with the CLI
(finetune.evaluate) can both use them without importing each other.
"""

from __future__ import annotations

from pathlib import Path

ABLATION_DIR = "runs/tiny-mars-arw0"   # the ar_weight = 0 model the recipe trains; not committed


def decode_batches(lm, prompts: list[list[int]], cfg, batch_size: int):
    """`generate` over `prompts` in batches of `batch_size`: one result per prompt, in order."""
    from mars_core import generate

    out = []
    for i in range(0, len(prompts), batch_size):
        out.extend(generate(lm, prompts[i: i + batch_size], cfg))
    return out


def mean_positions_per_forward(results) -> float | None:
    """Columns fed per forward after the prompt's, mean over sequences (at batch > 1 a forward's columns are the
    widest row's); None when no sequence took a second forward."""
    values = [r.positions_per_forward for r in results if r.positions_per_forward is not None]
    return sum(values) / len(values) if values else None


def curve_label(row: dict) -> str:
    """The model's name, with the confidence criterion appended when it is not the paper's (prob) and
    "lossless" for verify-mode rows."""
    criterion = row.get("criterion", "prob")
    label = row["model"] if criterion == "prob" else f"{row['model']} [{criterion}]"
    if row.get("mode") != "verify":
        return label
    extra = [row["draft_layout"]] if row.get("draft_layout", "linear") not in ("linear", None) else []
    extra += [f"lookup {row['prompt_lookup']}"] if row.get("prompt_lookup") else []
    return label + f" (lossless{', ' + ', '.join(extra) if extra else ''})"


def tau_curve(rows: list[dict], x_key: str, y_key: str, name: str, y_label: str, **style):
    """One τ curve: `rows` sorted by x, y in percent, points labelled by τ; rows without a y are left out."""
    import plotly.graph_objects as go

    pts = sorted((r for r in rows if r["tau"] != "ar" and r.get(y_key) is not None and r.get(x_key) is not None),
                 key=lambda r: r[x_key])
    if not pts:
        return None
    return go.Scatter(
        x=[r[x_key] for r in pts], y=[100 * r[y_key] for r in pts],
        mode="lines+markers+text", name=name, text=[f"τ={r['tau']:g}" for r in pts],
        textposition="top center",
        hovertemplate="%{text}<br>%{x:.2f} tokens/forward<br>" + y_label + " %{y:.1f}%<extra>" + name + "</extra>",
        **style,
    )


def model_label(args, i: int, m: str) -> str:
    """The rows' name of `args.models[i]` (`m`): its --names label, else the ablation's or the model's own name."""
    if args.names:
        return args.names[i]
    if Path(m).is_dir() and Path(m).resolve() == Path(ABLATION_DIR).resolve():
        return "tiny-mars ar_weight=0"
    return Path(m).name if Path(m).is_dir() else m
