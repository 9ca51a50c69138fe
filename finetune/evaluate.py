"""Evaluate models on the held-out task suite across confidence thresholds τ.

For each model and τ: exact-answer accuracy (overall and per family), tokens per
forward (mean over sequences, MARS_SPEC "What to measure") and the wall-clock
speedup over AR decoding with a KV cache (AR time ÷ MARS time on the same
prompts, batch size and max_new_tokens, both warmed up, measured alternately in
one process).

    python -m finetune.evaluate                       # tiny-ar-sft, tiny-mars (+ ablation if present)
    python -m finetune.evaluate --models tiny-mars runs/mars-arw0 --n 200 --json rows.json --html pareto.html
    python -m finetune.evaluate --models tiny-mars --criteria prob entropy margin   # one curve per criterion

The confidence criterion (MARS_SPEC step 3) decides what "confidence >= τ" means: prob = q(t), the paper's;
entropy = exp(-H(q)), so τ = 0.95 accepts when H <= 0.051 nats; margin = top-1 minus top-2 probability.

`sweep(...)` is the library API (the app's τ explorer calls it for the built-in tasks); `pareto_figure(...)`
draws the --html plot.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

from finetune.tasks import FAMILIES, check_answer, make_examples

TAUS = (1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5)
DEFAULT_MODELS = ("tiny-ar-sft", "tiny-mars")
ABLATION_DIR = "runs/tiny-mars-arw0"   # the ar_weight = 0 model the recipe trains; not committed
MAX_NEW_TOKENS = 112                   # the longest suite answer is 93 tokens plus eos


def _decode(lm, prompts: list[list[int]], cfg, batch_size: int):
    from mars_core import generate

    out = []
    for i in range(0, len(prompts), batch_size):
        out.extend(generate(lm, prompts[i: i + batch_size], cfg))
    return out


def score(examples: list[dict], texts: list[str]) -> tuple[float, dict[str, float]]:
    """Overall and per-family exact-answer accuracy of `texts` against `examples`."""
    hits: dict[str, list[bool]] = {}
    for ex, text in zip(examples, texts, strict=True):
        hits.setdefault(ex["family"], []).append(check_answer(ex, text))
    per_family = {f: sum(v) / len(v) for f, v in hits.items()}
    overall = sum(sum(v) for v in hits.values()) / max(1, len(examples))
    return overall, per_family


def time_against_ar(lm, prompts: list[list[int]], cfg, repeats: int = 3) -> tuple[float, float]:
    """Seconds for AR (KV cache) and for `cfg` on `prompts`, batch 1.

    Each prompt runs AR and `cfg` alternately `repeats` times (which goes first alternates too) and
    keeps each one's fastest time: on a CPU shared with other work the minimum is the run that was
    not interrupted, so the ratio reflects the decoders rather than the neighbours.
    """
    from mars_core import DecodeConfig, generate

    ar_cfg = DecodeConfig(mode="ar", max_new_tokens=cfg.max_new_tokens)
    generate(lm, prompts[:1], ar_cfg)            # warm-up both paths
    generate(lm, prompts[:1], cfg)
    ar_time = mars_time = 0.0
    for i, p in enumerate(prompts):
        best = {"ar": float("inf"), "mars": float("inf")}
        for r in range(repeats):
            order = [("ar", ar_cfg), ("mars", cfg)] if (i + r) % 2 == 0 else [("mars", cfg), ("ar", ar_cfg)]
            for kind, c in order:
                t0 = time.perf_counter()
                generate(lm, [p], c)
                best[kind] = min(best[kind], time.perf_counter() - t0)
        ar_time += best["ar"]
        mars_time += best["mars"]
    return ar_time, mars_time


def sweep(lm, examples: list[dict], taus=TAUS, block_size: int = 4, max_new_tokens: int = MAX_NEW_TOKENS,
          progress: Callable[[float, str], None] | None = None, batch_size: int = 16, timing_prompts: int = 8,
          model_name: str | None = None, criterion: str = "prob") -> list[dict]:
    """One row per τ for a loaded model (`mars_core.load_model`) on `examples`.

    Row keys: model, tau, criterion, block_size, n, accuracy, per_family ({family: accuracy}),
    tokens_per_forward, speedup, ar_time_s, mars_time_s, timing_prompts. Accuracy and tokens/forward come
    from all examples decoded in batches of `batch_size`; the speedup from the first `timing_prompts`
    examples at batch 1 (see `time_against_ar`). `criterion` is DecodeConfig's confidence criterion.
    `progress(fraction, message)` is called after each τ (a gradio.Progress fits).
    """
    from mars_core import DecodeConfig

    if not examples:
        raise ValueError("examples is empty: pass e.g. finetune.tasks.make_examples('heldout', 200)")
    taus = [float(t) for t in taus]
    if not taus or any(not t > 0 for t in taus):
        raise ValueError(f"taus={taus!r}: give one or more thresholds > 0 (1.0 = one-token mode)")
    prompts = [lm.encode(ex["messages"][0]["content"]) for ex in examples]
    name = model_name or lm.name
    rows = []
    for k, tau in enumerate(taus):
        cfg = DecodeConfig(mode="mars", tau=tau, block_size=block_size, max_new_tokens=max_new_tokens,
                           criterion=criterion)
        results = _decode(lm, prompts, cfg, batch_size)
        accuracy, per_family = score(examples, [r.text for r in results])
        tpf = sum(r.tokens_per_forward for r in results) / len(results)
        row = {
            "model": name, "tau": tau, "criterion": criterion, "block_size": block_size, "n": len(examples),
            "accuracy": accuracy, "per_family": per_family, "tokens_per_forward": tpf,
            "speedup": None, "ar_time_s": None, "mars_time_s": None, "timing_prompts": 0,
        }
        if timing_prompts > 0:
            ar_t, mars_t = time_against_ar(lm, prompts[:timing_prompts], cfg)
            row.update(speedup=ar_t / mars_t, ar_time_s=ar_t, mars_time_s=mars_t,
                       timing_prompts=min(timing_prompts, len(prompts)))
        rows.append(row)
        if progress is not None:
            progress((k + 1) / len(taus), f"{curve_label(row)}: τ={tau} accuracy {accuracy:.1%}, {tpf:.2f} tokens/forward")
    return rows


def block_phase_losses(lm, examples: list[dict], block_size: int = 4, batch_size: int = 32) -> list[float]:
    """Held-out noisy-stream (mask) cross-entropy with the training block grid shifted by r = 0 .. B-1.

    Teacher-forced, so no decoding: the MARS loss's noisy half on `examples`, once per grid offset r
    (block(i) = (i + r) // B). The decoder appends its masks after whatever it accepted last, so its mask
    runs start at every phase; a model trained on one grid that reads its phase from absolute positions
    shows a CE that rises for the offsets it never saw (README, "Block phase").
    """
    import torch

    from finetune.data import build_examples, collate, pad_id_of
    from finetune.losses import mars_loss

    pad = pad_id_of(lm.tokenizer, lm.eos_ids)   # as finetune.train pads
    exs = build_examples([ex["messages"] for ex in examples], lm.tokenizer, max_length=lm.context_length,
                         block_size=block_size, eos_ids=lm.eos_ids)
    batches = [collate(exs[i: i + batch_size], pad) for i in range(0, len(exs), batch_size)]
    out = []
    with torch.no_grad():
        for r in range(block_size):
            total = count = 0
            for b in batches:
                loss = mars_loss(lm.model, b["input_ids"].to(lm.device), b["labels"].to(lm.device),
                                 b["valid"].to(lm.device), block_size=block_size, mask_id=lm.mask_id,
                                 block_offset=r)
                total, count = total + float(loss.loss_mask) * loss.n_labels, count + loss.n_labels
            out.append(total / count)
    return out


def curve_label(row: dict) -> str:
    """The model's name, with the confidence criterion appended when it is not the paper's (prob)."""
    criterion = row.get("criterion", "prob")
    return row["model"] if criterion == "prob" else f"{row['model']} [{criterion}]"


def pareto_figure(rows: list[dict]):
    """Tokens/forward (x) against accuracy (y), one line per model and criterion, points labelled by τ (paper Fig. 5)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for model in dict.fromkeys(curve_label(r) for r in rows):
        pts = sorted((r for r in rows if curve_label(r) == model and r["tau"] != "ar"),
                     key=lambda r: r["tokens_per_forward"])
        if not pts:
            continue
        fig.add_trace(go.Scatter(
            x=[r["tokens_per_forward"] for r in pts], y=[100 * r["accuracy"] for r in pts],
            mode="lines+markers+text", name=model, text=[f"τ={r['tau']:g}" for r in pts],
            textposition="top center",
            hovertemplate="%{text}<br>%{x:.2f} tokens/forward<br>accuracy %{y:.1f}%<extra>" + model + "</extra>",
        ))
    fig.update_layout(
        title="Accuracy vs tokens per forward on the held-out suite (τ sweep)",
        xaxis_title="tokens per forward (mean over sequences)", yaxis_title="exact-answer accuracy (%)",
        template="plotly_white", legend_title="model",
    )
    return fig


def format_table(rows: list[dict]) -> str:
    """A Markdown table: one line per (model, τ), per-family accuracy in the last columns."""
    fams = [f for f in FAMILIES if any(f in r["per_family"] for r in rows)]
    head = ["model", "τ", "accuracy", "tokens/forward", "speedup"] + fams
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        tau = r["tau"] if isinstance(r["tau"], str) else f"{r['tau']:g}"
        speed = "–" if r["speedup"] is None else f"{r['speedup']:.2f}×"
        cells = [curve_label(r), tau, f"{100 * r['accuracy']:.1f}%", f"{r['tokens_per_forward']:.2f}", speed]
        cells += [f"{100 * r['per_family'][f]:.0f}%" if f in r["per_family"] else "–" for f in fams]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    from mars_core.decoding import CRITERIA

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=None,
                    help=f"model names or directories (default: {' '.join(DEFAULT_MODELS)} and {ABLATION_DIR} if it exists)")
    ap.add_argument("--n", type=int, default=400, help="held-out examples (families round-robin)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the held-out draw")
    ap.add_argument("--taus", type=float, nargs="+", default=list(TAUS))
    ap.add_argument("--criteria", nargs="+", default=["prob"], choices=CRITERIA, metavar="CRITERION",
                    help="confidence criteria, one sweep each: prob (default, the paper's), entropy, margin")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument("--batch-size", type=int, default=16, help="batch size of the accuracy runs")
    ap.add_argument("--timing-prompts", type=int, default=8, help="prompts timed at batch 1 for the speedup (0: skip)")
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                    help="write the rows as JSON to FILE (no FILE: print them to stdout instead of the table)")
    ap.add_argument("--html", default=None, metavar="FILE", help="write the Pareto plot as HTML")
    ap.add_argument("--names", nargs="+", default=None, help="labels for --models in the rows (default: their names)")
    ap.add_argument("--block-phase", action="store_true",
                    help="also print each model's held-out mask-loss CE with the block grid shifted by 0..B-1")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (1 is fastest for these tiny models on a busy machine)")
    args = ap.parse_args(argv)
    if args.n < 1:
        raise ValueError(f"--n {args.n}: use at least 1 held-out example")

    import torch

    from mars_core import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    models = args.models or list(DEFAULT_MODELS) + ([ABLATION_DIR] if Path(ABLATION_DIR).is_dir() else [])
    examples = make_examples("heldout", args.n, seed=args.seed)
    log = sys.stderr if args.json == "-" else sys.stdout
    rows: list[dict] = []
    if args.names and len(args.names) != len(models):
        raise ValueError(f"--names has {len(args.names)} labels for {len(models)} models: give one per model")
    for i, m in enumerate(models):
        lm = load_model(m, device="cpu")
        name = Path(m).name if Path(m).is_dir() else m
        if Path(m).resolve() == Path(ABLATION_DIR).resolve():
            name = "tiny-mars ar_weight=0"
        if args.names:
            name = args.names[i]
        if args.block_phase:
            ces = block_phase_losses(lm, examples, args.block_size)
            print(f"{name}: mask-loss CE by block offset r = 0..{args.block_size - 1}: "
                  + " ".join(f"{ce:.4f}" for ce in ces) + f" (max/min {max(ces) / min(ces):.2f})",
                  file=log, flush=True)
        for criterion in args.criteria:
            t0 = time.time()
            rows += sweep(lm, examples, args.taus, args.block_size, args.max_new_tokens, batch_size=args.batch_size,
                          timing_prompts=args.timing_prompts, model_name=name, criterion=criterion,
                          progress=lambda f, msg: print(f"  {msg}", file=log, flush=True))
            print(f"{curve_label(rows[-1])}: swept {len(args.taus)} τ values in {time.time() - t0:.0f}s", file=log,
                  flush=True)
    if args.json == "-":
        json.dump(rows, sys.stdout, indent=1)
        print()
    else:
        print(format_table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.html:
        pareto_figure(rows).write_html(args.html, include_plotlyjs=True)
        print(f"wrote {args.html}", file=log)
    return rows


if __name__ == "__main__":
    main()
