"""Evaluate models on the held-out task suite across confidence thresholds τ.

For each model and τ: exact-answer accuracy (overall and per family), tokens per
forward (mean over sequences, docs/algorithm.md "Metrics") and the wall-clock
speedup over AR decoding with a KV cache (AR time ÷ MARS time on the same
prompts, batch size and max_new_tokens, both warmed up, measured alternately in
one process).

    python -m finetune.evals.evaluate                       # tiny-ar-sft, tiny-mars (+ ablation if present)
    python -m finetune.evals.evaluate --models tiny-mars runs/mars-arw0 --n 200 --json rows.json --html pareto.html
    python -m finetune.evals.evaluate --models tiny-mars --criteria prob entropy margin   # one curve per criterion

The confidence criterion (docs/algorithm.md) decides what "confidence >= τ" means: prob = q(t), the paper's;
entropy = exp(-H(q)), so τ = 0.95 accepts when H <= 0.051 nats; margin = top-1 minus top-2 probability.

`sweep(...)` is the library API (the app's τ explorer calls it for the built-in tasks); `pareto_figure(...)`
draws the --html plot.

Natural suite (`--suite natural`): real-language models, by default SmolLM2-135M-Instruct taught MARS
(smollm2-mars) and its base (smollm2), at τ in {1.0, 0.95, 0.9, 0.8, 0.7}:

    python -m finetune.evals.evaluate --suite natural                         # smollm2 (AR) + smollm2-mars, all sets
    python -m finetune.evals.evaluate --suite natural --models smollm2-mars runs/smol-mars --seed 1 --json nat.json
    python -m finetune.evals.evaluate --suite natural --html natural.html --dtype bfloat16 --batch-size 32
    python -m finetune.evals.evaluate --suite natural --humaneval 0 --n-natural 16 --n-checkable 40   # quick look

Per (model, τ): tokens/forward (mean over sequences) on held-out natural prompts (finetune.evals.natural, split
"heldout") and on HumanEval's prompts; HumanEval pass@1 (greedy, one sample per problem); accuracy on the
checkable question set (finetune.evals.checkable.check); and agreement with the same model's τ = 1 answers on the
natural prompts and checkable questions: the share of identical answers, and the mean share of tokens before
the first difference (÷ the longer answer, so 1.0 only for identical answers). τ = 1.0 is added when --taus
lacks it, since agreement needs it. --seed draws the natural prompts and the checkable questions (it is printed
and stored in every row: tell a development seed from a fresh report seed); HumanEval takes the first --humaneval
problems in file order. Models not trained for MARS (smollm2 by default, see --ar-only) get one AR row; with
`--ar-only` and no names every model gets every τ, and base-model rows at τ < 1 then only show what an untrained
model does with masks.

WARNING: --humaneval EXECUTES MODEL-WRITTEN CODE on this machine, each program in a `python -I` subprocess in a
temporary directory with a timeout (finetune.evals.humaneval). That is not a sandbox; use --humaneval 0 to skip it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from finetune.evals.evaluate_common import (
    ABLATION_DIR, RowLog, curve_label, decode_batches, mean_positions_per_forward, model_label, tau_curve,
)
from finetune.evals.evaluate_natural import (
    NATURAL_MAX_NEW_TOKENS, NATURAL_MODELS, NATURAL_TAUS, add_natural_args, format_natural_table, main_natural,
    natural_pareto_figure,
)
# Re-exported: callers and tests import the natural suite's pieces from here, where they lived before.
from finetune.evals.evaluate_natural import (  # noqa: F401
    BASE_MODELS, CHECKABLE_MAX_NEW_TOKENS, N_NATURAL, NATURAL_ROW_KEYS, agreement, natural_sweep, natural_taus,
    prefix_share, score_checkable,
)
from finetune.tasks import FAMILIES, check_answer, make_examples
from mars_core.models import catalogue
from mars_core.models.storage import atomic_write_text

TAUS = (1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5)
# The task suite's default sweep: tiny-ar-sft, tiny-mars (the ablation joins it in _main_tasks when present).
DEFAULT_MODELS = catalogue.sweep(catalogue.TASKS)
MAX_NEW_TOKENS = 112                   # the longest suite answer is 93 tokens plus eos

SUITES = ("tasks", "natural")


def score(examples: list[dict], texts: list[str]) -> tuple[float, dict[str, float]]:
    """Overall and per-family exact-answer accuracy of `texts` against `examples`."""
    hits: dict[str, list[bool]] = {}
    for ex, text in zip(examples, texts, strict=True):
        hits.setdefault(ex["family"], []).append(check_answer(ex, text))
    per_family = {f: sum(v) / len(v) for f, v in hits.items()}
    overall = sum(sum(v) for v in hits.values()) / max(1, len(examples))
    return overall, per_family


def timed_against_ar(lm, prompts: list[list[int]], cfg, repeats: int = 3) -> dict:
    """AR (KV cache) against `cfg` on `prompts`, batch 1, through mars_core.tools.timing (both warmed up, alternating,
    the order rotating; the decoding thread's CPU time where the model runs on one CPU thread, else the wall
    clock). Returns {"ar_s", "mars_s": each the sum over the prompts of its median run, "ratios": AR ÷ `cfg` for
    each repeat, summed over the prompts, whose min and max are the spread}."""
    from mars_core import DecodeConfig, generate
    from mars_core.tools.timing import Spread, clock_for, time_all

    ar_cfg = DecodeConfig(mode="ar", max_new_tokens=cfg.max_new_tokens)
    clock = clock_for(lm)[0]
    ar_s = mars_s = 0.0
    per_repeat = [[0.0, 0.0] for _ in range(repeats)]
    for i, p in enumerate(prompts):
        runs = {"ar": lambda p=p: generate(lm, [p], ar_cfg), "mars": lambda p=p: generate(lm, [p], cfg)}
        times, _ = time_all(runs, repeats, clock, warmup=i == 0)
        ar_s += Spread.of(times["ar"]).median
        mars_s += Spread.of(times["mars"]).median
        for r in range(repeats):
            per_repeat[r][0] += times["ar"][r]
            per_repeat[r][1] += times["mars"][r]
    return {"ar_s": ar_s, "mars_s": mars_s, "ratios": [a / m for a, m in per_repeat if m > 0]}


def speedup_fields(t: dict) -> dict:
    """A sweep row's timing fields from timed_against_ar: the speedup (AR ÷ MARS of the median runs) with the
    min–max of the per-repeat ratios."""
    ratios = t["ratios"]
    return {"speedup": t["ar_s"] / t["mars_s"] if t["mars_s"] > 0 else None, "ar_time_s": t["ar_s"],
            "mars_time_s": t["mars_s"], "speedup_min": min(ratios) if ratios else None,
            "speedup_max": max(ratios) if ratios else None, "timing_repeats": len(ratios)}


@dataclass(frozen=True)
class SweepSettings:
    """How `sweep` decodes and times one model: accuracy and tokens/forward come from all examples decoded in
    batches of `batch_size`; the speedup from the first `timing_prompts` examples at batch 1 (see
    `timed_against_ar`). `model_name` labels the rows (default: the model's own name). `criterion` is
    DecodeConfig's confidence criterion; `draft_layout` and `prompt_lookup` its lossless-draft options
    (mode "verify")."""

    block_size: int = 4
    max_new_tokens: int = MAX_NEW_TOKENS
    batch_size: int = 16
    timing_prompts: int = 8
    model_name: str | None = None
    criterion: str = "prob"
    mode: str = "mars"
    draft_layout: str = "linear"
    prompt_lookup: int = 0


def sweep(lm, examples: list[dict], taus=TAUS, settings: SweepSettings | None = None,
          progress: Callable[[float, str], None] | None = None) -> list[dict]:
    """One row per τ for a loaded model (`mars_core.load_model`) on `examples`, decoded as `settings` says.

    Row keys: model, mode, tau, criterion, block_size, n, accuracy, per_family ({family: accuracy}),
    tokens_per_forward, speedup, ar_time_s, mars_time_s, timing_prompts; verify rows (mode "verify", lossless
    MARS) add draft_acceptance (share of drafts confirmed per mask slot).
    `progress(fraction, message)` is called after each τ (a gradio.Progress fits).
    """
    from mars_core import DecodeConfig, draft_acceptance

    s = settings or SweepSettings()
    block_size, mode, criterion, timing_prompts = s.block_size, s.mode, s.criterion, s.timing_prompts

    if not examples:
        raise ValueError("examples is empty: pass e.g. finetune.tasks.make_examples('heldout', 200)")
    taus = [float(t) for t in taus]
    if not taus or any(not t > 0 for t in taus):
        raise ValueError(f"taus={taus!r}: give one or more thresholds > 0 (1.0 = one-token mode)")
    prompts = [lm.encode(ex["messages"][0]["content"]) for ex in examples]
    name = s.model_name or lm.name
    rows = []
    for k, tau in enumerate(taus):
        drafts = dict(draft_layout=s.draft_layout, prompt_lookup=s.prompt_lookup) if mode == "verify" else {}
        cfg = DecodeConfig(mode=mode, tau=tau, block_size=block_size, max_new_tokens=s.max_new_tokens,
                           criterion=criterion, **drafts)
        results = decode_batches(lm, prompts, cfg, s.batch_size)
        accuracy, per_family = score(examples, [r.text for r in results])
        tpf = sum(r.tokens_per_forward for r in results) / len(results)
        row = {
            "model": name, "mode": mode, "tau": tau, "criterion": criterion, "block_size": block_size,
            "draft_layout": drafts.get("draft_layout"), "prompt_lookup": drafts.get("prompt_lookup"),
            "positions_per_forward": mean_positions_per_forward(results),
            "n": len(examples), "accuracy": accuracy, "per_family": per_family, "tokens_per_forward": tpf,
            "speedup": None, "ar_time_s": None, "mars_time_s": None, "timing_prompts": 0,
        }
        if mode == "verify":
            row["draft_acceptance"] = draft_acceptance(results, block_size)
        if timing_prompts > 0:
            row.update(speedup_fields(timed_against_ar(lm, prompts[:timing_prompts], cfg)),
                       timing_prompts=min(timing_prompts, len(prompts)))
        rows.append(row)
        if progress is not None:
            progress((k + 1) / len(taus),
                     f"{curve_label(row)}: τ={tau} accuracy {accuracy:.1%}, {tpf:.2f} tokens/forward")
    return rows


def block_phase_losses(lm, examples: list[dict], block_size: int = 4, batch_size: int = 32) -> list[float]:
    """Held-out noisy-stream (mask) cross-entropy with the training block grid shifted by r = 0 .. B-1.

    Teacher-forced, so no decoding: the MARS loss's noisy half on `examples`, once per grid offset r
    (block(i) = (i + r) // B). The decoder appends its masks after whatever it accepted last, so its mask
    runs start at every phase; a model trained on one grid that reads its phase from absolute positions
    shows a CE that rises for the offsets it never saw (docs/experiments.md, "Block phase").
    """
    import torch

    from finetune.data import build_examples, collate, pad_id_of
    from finetune.losses import MarsLossSettings, mars_loss

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
                                 b["valid"].to(lm.device),
                                 MarsLossSettings(block_size=block_size, mask_id=lm.mask_id, block_offset=r))
                total, count = total + float(loss.loss_mask) * loss.n_labels, count + loss.n_labels
            out.append(total / count)
    return out


def pareto_figure(rows: list[dict]):
    """Tokens/forward (x) against accuracy (y), one line per model and criterion, points labelled by τ
    (paper Fig. 5)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for model in dict.fromkeys(curve_label(r) for r in rows):
        trace = tau_curve([r for r in rows if curve_label(r) == model], "tokens_per_forward", "accuracy", model,
                          "accuracy")
        if trace is not None:
            fig.add_trace(trace)
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


# ----------------------------------------------------------------------------- the CLI (both suites)


def _parser() -> argparse.ArgumentParser:
    from mars_core.decode.config import CRITERIA
    from mars_core.decode.drafts import LAYOUTS

    ap = argparse.ArgumentParser(prog="python -m finetune.evals.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=SUITES, default="tasks",
                    help="tasks (default): the built-in held-out task suite; natural: real-language models on "
                         "held-out natural prompts, the checkable set and HumanEval")
    ap.add_argument("--models", nargs="+", default=None,
                    help=f"model names or directories (default: tasks suite {' '.join(DEFAULT_MODELS)} and "
                         f"{ABLATION_DIR} if it exists; natural suite {' '.join(NATURAL_MODELS)})")
    ap.add_argument("--n", type=int, default=400, help="tasks suite: held-out examples (families round-robin)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the held-out draw (natural suite: of the natural prompts and checkable questions; "
                         "it is printed and stored in each row)")
    ap.add_argument("--taus", type=float, nargs="+", default=None,
                    help=f"thresholds (default: tasks suite {' '.join(f'{t:g}' for t in TAUS)}; natural suite "
                         f"{' '.join(f'{t:g}' for t in NATURAL_TAUS)}, with 1.0 added when missing)")
    ap.add_argument("--criteria", nargs="+", default=["prob"], choices=CRITERIA, metavar="CRITERION",
                    help="confidence criteria, one sweep each: prob (default, the paper's), entropy, margin")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--lossless", action="store_true",
                    help="also sweep lossless MARS (mode verify: drafts checked by the next forward, the answer is "
                         "exactly AR's in fp32) beside lossy MARS")
    ap.add_argument("--draft-layouts", nargs="+", default=["linear"], choices=LAYOUTS, metavar="LAYOUT",
                    help="--lossless: one lossless sweep per draft layout (linear: masks after the last draft; "
                         "quadratic: after every draft; tree: also runner-up tokens)")
    ap.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                    help="--lossless: also draft what followed the last 1..N tokens earlier in the text (0: off)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help=f"new-token cap (default: tasks suite {MAX_NEW_TOKENS}; natural suite "
                         f"{NATURAL_MAX_NEW_TOKENS}, for natural prompts and HumanEval)")
    ap.add_argument("--batch-size", type=int, default=16, help="batch size of the decoding runs")
    ap.add_argument("--timing-prompts", type=int, default=8,
                    help="tasks suite: prompts timed at batch 1 for the speedup (0: skip)")
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                    help="write the rows as JSON to FILE (no FILE: print them to stdout instead of the table)")
    ap.add_argument("--resume", action="store_true",
                    help="finish the interrupted run saved in --json FILE: its finished rows are kept, not redone")
    ap.add_argument("--html", default=None, metavar="FILE", help="write the Pareto plot as HTML")
    ap.add_argument("--names", nargs="+", default=None, help="labels for --models in the rows (default: their names)")
    ap.add_argument("--block-phase", action="store_true",
                    help="tasks suite: also print each model's held-out mask-loss CE with the block grid shifted "
                         "by 0..B-1")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (1 is fastest for these tiny models on a busy machine)")
    ap.add_argument("--dtype", default="auto",
                    choices=("auto", "float32", "bfloat16", "float16", "int8", "w8a8", "w8a16"),
                    help="weights dtype for load_model (auto: bfloat16 on a GPU, float32 on a CPU)")
    ap.add_argument("--device", default=None,
                    help="cpu, cuda or auto (default: cpu for the tasks suite, auto for the natural suite)")
    add_natural_args(ap)
    return ap


def check_args(args) -> None:
    """Counts, thresholds and output paths, before any model is loaded (a bad --html path must not cost the
    sweep)."""
    import math

    from finetune.config import check_output_file

    for flag, value in (("--batch-size", args.batch_size), ("--block-size", args.block_size),
                        ("--max-new-tokens", args.max_new_tokens), ("--threads", args.threads)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: use 1 or more")
    if args.timing_prompts < 0:
        raise ValueError(f"--timing-prompts {args.timing_prompts}: use 0 (skip) or more")
    for tau in args.taus or []:
        if not math.isfinite(tau) or tau <= 0:
            raise ValueError(f"--taus {tau}: use thresholds > 0 such as 0.9 0.95 1 (>= 1 is one-token mode)")
    if not math.isfinite(args.test_timeout) or args.test_timeout <= 0:
        raise ValueError(f"--test-timeout {args.test_timeout}: use a positive number of seconds such as 5")
    if args.json not in (None, "-"):
        check_output_file("--json", args.json)
    if args.html is not None:
        check_output_file("--html", args.html)
    from mars_core.models.sources import resolve_source

    for m in args.models or []:   # an unknown second model must not cost the first model's sweep
        resolve_source(m)


def main(argv: list[str] | None = None) -> list[dict]:
    args = _parser().parse_args(argv)
    check_args(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    log = sys.stderr if args.json == "-" else sys.stdout
    saved = RowLog(args.json, args.resume)
    try:
        rows = main_natural(args, log, saved) if args.suite == "natural" else _main_tasks(args, log, saved)
    except KeyboardInterrupt as exc:   # the finished rows are saved already; say so, run_main exits 130/143
        raise type(exc)(saved.interrupted()) from None
    if args.json == "-":
        json.dump(rows, sys.stdout, indent=1)
        print()
    else:
        print(format_natural_table(rows) if args.suite == "natural" else format_table(rows))
        if args.json:   # atomic: the partial file stays until the whole one is there; a full disk is one line
            atomic_write_text(args.json, json.dumps(rows, indent=1), f"--json {args.json}")
    if args.html:
        fig = natural_pareto_figure(rows) if args.suite == "natural" else pareto_figure(rows)
        atomic_write_text(args.html, fig.to_html(include_plotlyjs=True), f"--html {args.html}")
        print(f"wrote {args.html}", file=log)
    return rows


def _main_tasks(args, log, saved: RowLog | None = None) -> list[dict]:
    """The built-in task suite: accuracy, tokens/forward and speedup per (model, criterion, τ); one sweep per τ so
    that each row is saved as it finishes and a resumed run (`saved`) skips the rows it has."""
    if args.n < 1:
        raise ValueError(f"--n {args.n}: use at least 1 held-out example")
    taus = args.taus or list(TAUS)
    max_new_tokens = args.max_new_tokens or MAX_NEW_TOKENS
    models = args.models or list(DEFAULT_MODELS) + ([ABLATION_DIR] if Path(ABLATION_DIR).is_dir() else [])
    if args.names and len(args.names) != len(models):
        raise ValueError(f"--names has {len(args.names)} labels for {len(models)} models: give one per model")
    saved = saved or RowLog(None)
    saved.check(n=args.n, block_size=args.block_size)
    examples = make_examples("heldout", args.n, seed=args.seed)
    runs = [("mars", "linear")] + ([("verify", layout) for layout in args.draft_layouts] if args.lossless else [])
    saved.total = len(models) * len(args.criteria) * len(runs) * len(taus)
    for i, m in enumerate(models):
        name = model_label(args, i, m)
        lm = None
        for criterion in args.criteria:
            t0 = time.time()
            for mode, layout in runs:
                pl = args.prompt_lookup if mode == "verify" else 0
                for tau in taus:
                    key = (name, mode, criterion, layout if mode == "verify" else None,
                           pl if mode == "verify" else None,
                           float(tau))
                    if saved.done(key) is not None:
                        saved.add([saved.done(key)])
                        continue
                    if lm is None:   # loaded only when a row of it is left to do
                        lm = _load_task_model(args, m, name, examples, log)
                    settings = SweepSettings(block_size=args.block_size, max_new_tokens=max_new_tokens,
                                             batch_size=args.batch_size, timing_prompts=args.timing_prompts,
                                             model_name=name, criterion=criterion, mode=mode, draft_layout=layout,
                                             prompt_lookup=pl)
                    saved.add(sweep(lm, examples, [tau], settings,
                                    progress=lambda f, msg: print(f"  {msg}", file=log, flush=True)))
                print(f"{curve_label(saved.rows[-1])}: swept {len(taus)} τ values in {time.time() - t0:.0f}s",
                      file=log, flush=True)
    return saved.rows


def _load_task_model(args, m: str, name: str, examples: list[dict], log):
    """Load one task-suite model (and print its block-phase losses when asked)."""
    from mars_core import load_model

    lm = load_model(m, device=args.device or "cpu", dtype=args.dtype)
    if args.block_phase:
        ces = block_phase_losses(lm, examples, args.block_size)
        print(f"{name}: mask-loss CE by block offset r = 0..{args.block_size - 1}: "
              + " ".join(f"{ce:.4f}" for ce in ces) + f" (max/min {max(ces) / min(ces):.2f})",
              file=log, flush=True)
    return lm


if __name__ == "__main__":
    from finetune.config import run_main

    run_main(main)
