"""Compare two models scored on the same prompts, with paired bootstrap intervals:
``python -m finetune.evals.paired BASE.jsonl CANDIDATE.jsonl``.

`finetune.evals.devscore --out` writes one line per model: every prompt's answer, tokens and forward passes at each
setting (τ and the lossless tree). A choice between two models made on those numbers is only as good as the number of
prompts lets it be: on 88 development prompts two cuts of one fine-tune differed by up to 0.05 tokens per forward
and 10 points of answers equal to AR, and the order reversed on the report's prompts. This prints, per setting and
group, both models' numbers, the candidate's difference, and the 95% interval of that difference when the prompts are
resampled with replacement (the same resample for both models: paired, since a prompt that is easy for one is easy
for the other). The numbers are devscore's own: tokens per forward is the mean over prompts of each answer's tokens ÷
its forwards; "equal to AR" is the share of answers identical to the same model's τ = 1 answer.

``python -m finetune.evals.paired --quality BASE.json CANDIDATE.json`` does the same for one-token quality: two
`finetune.evals.evaluate --suite natural --json` files of one draw (the same --seed, --n-checkable, --humaneval),
checkable accuracy and HumanEval pass@1 at each τ both rows have, question by question.
"""

from __future__ import annotations

import argparse
import random

RESAMPLES = 2000
GROUPS = ("all", "natural", "structured")


def read_scores(path: str, model: str | None = None) -> dict:
    """The devscore line for `model` in `path` (the only or, without `model`, the last line)."""
    from finetune.evals.devscore import read_out

    lines = read_out(path)
    if model is None:
        return lines[-1]
    mine = [rec for rec in lines if rec["model"] == model]
    if not mine:
        raise ValueError(f"{path}: no line for model {model!r}; its models are "
                         f"{', '.join(repr(rec['model']) for rec in lines)}")
    return mine[-1]


def groups_of(rec: dict) -> dict[str, list[int]]:
    """Prompt indices per group: all, and natural / structured where the line says (devscore's `categories`) or the
    prompts can be placed (an older line: looked up in its seed's development prompts)."""
    from finetune.evals.devscore import categories_of, group_of

    n = len(rec["prompts"])
    groups = {"all": list(range(n))}
    cats = rec.get("categories")
    if cats is None and "seed" in rec:
        cats = categories_of(rec["prompts"], rec["seed"])
    if cats is not None and None not in cats:
        for i, c in enumerate(cats):
            groups.setdefault(group_of(c), []).append(i)
    return groups


def per_prompt(rec: dict, setting: str) -> tuple[list[float], list[float]]:
    """(tokens per forward, 1.0 if equal to the model's AR answer else 0.0), one per prompt."""
    tpf = [t / f for t, f in zip(rec["tokens"][setting], rec["forwards"][setting])]
    same = [float(a == b) for a, b in zip(rec["answers"][setting], rec["answers"]["ar"])]
    return tpf, same


def paired_interval(a: list[float], b: list[float], idx: list[int], resamples: int = RESAMPLES,
                    seed: int = 0) -> tuple[float, float, float]:
    """(mean of b − a over idx, and the 2.5% and 97.5% points of that difference over resamples of idx)."""
    rng = random.Random(seed)
    diffs = [b[i] - a[i] for i in idx]
    n = len(diffs)
    mean = sum(diffs) / n
    boot = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return mean, boot[int(0.025 * resamples)], boot[min(resamples - 1, int(0.975 * resamples))]


def compare(base: dict, cand: dict, resamples: int = RESAMPLES, seed: int = 0) -> list[dict]:
    """One row per setting and group: n, base and candidate means, the difference and its 95% interval."""
    if base["prompts"] != cand["prompts"]:
        raise ValueError(f"{base['model']} and {cand['model']} were scored on different prompts: score both with the "
                         "same devscore --natural/--structured/--seed")
    settings = [s for s in base["tokens"] if s != "ar" and s in cand["tokens"]]
    if not settings:
        raise ValueError(f"{base['model']} and {cand['model']} share no setting (τ or tree): score both with the same "
                         "--taus")
    groups = groups_of(base)
    rows = []
    for setting in settings:
        (ta, sa), (tb, sb) = per_prompt(base, setting), per_prompt(cand, setting)
        for g in GROUPS:
            idx = groups.get(g)
            if not idx:
                continue
            row = {"setting": setting, "group": g, "n": len(idx)}
            for key, a, b in (("tpf", ta, tb), ("same", sa, sb)):
                d, lo, hi = paired_interval(a, b, idx, resamples, seed)
                row.update({f"{key}_base": sum(a[i] for i in idx) / len(idx),
                            f"{key}_cand": sum(b[i] for i in idx) / len(idx), f"{key}_diff": d,
                            f"{key}_lo": lo, f"{key}_hi": hi})
            rows.append(row)
    return rows


def format_rows(base: str, cand: str, rows: list[dict]) -> str:
    lines = [f"candidate {cand} against {base}: difference (95% paired bootstrap interval)", "",
             "| setting | group | n | tokens/forward | difference | equal to AR | difference |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        same = "—" if r["setting"] == "tree" else (f"{r['same_base']:.0%} → {r['same_cand']:.0%}")
        same_d = "—" if r["setting"] == "tree" else (f"{100 * r['same_diff']:+.1f} pts ({100 * r['same_lo']:+.1f} .. "
                                                      f"{100 * r['same_hi']:+.1f})")
        lines.append(f"| {r['setting']} | {r['group']} | {r['n']} | {r['tpf_base']:.3f} → {r['tpf_cand']:.3f} | "
                     f"{r['tpf_diff']:+.3f} ({r['tpf_lo']:+.3f} .. {r['tpf_hi']:+.3f}) | {same} | {same_d} |")
    n = rows[0]["n"] if rows else 0
    lines += ["", f"An interval shrinks as one over the square root of the prompts: {4 * n} prompts halve these."]
    return "\n".join(lines)


QUALITY = (("checkable", "checkable_questions", "checkable_correct"),
           ("HumanEval", "humaneval_tasks", "humaneval_passed"))   # (measure, its question ids, its 0/1 verdicts)


def read_quality(path: str, model: str | None = None) -> list[dict]:
    """The natural-suite rows of `model` (the file's only model when None) in an evaluate --json file, each with its
    per-question verdicts."""
    from finetune.evals.evaluate_common import read_rows

    rows, _ = read_rows(path, path, "pass a file written by finetune.evals.evaluate --suite natural --json")
    rows = [r for r in rows if r.get("suite") == "natural"]
    if rows and not any("checkable_correct" in r for r in rows):
        raise ValueError(f"{path}: its rows have no per-question verdicts (written before 2026-12-07): run "
                         "finetune.evals.evaluate again to compare question by question")
    models = list(dict.fromkeys(r["model"] for r in rows))
    if model is None and len(models) > 1:
        raise ValueError(f"{path}: holds {len(models)} models ({', '.join(map(repr, models))}): pick one with "
                         "--base-model / --candidate-model")
    mine = [r for r in rows if r["model"] == (model if model is not None else (models or [None])[0])]
    if not mine:
        raise ValueError(f"{path}: no natural-suite row for model {model!r}; its models are "
                         f"{', '.join(map(repr, models)) or 'none'}")
    return mine


def compare_quality(base: list[dict], cand: list[dict], resamples: int = RESAMPLES, seed: int = 0) -> list[dict]:
    """One row per (τ, mode) both have and measure (checkable, HumanEval): n, both accuracies, the difference and
    its 95% paired interval."""
    out = []
    cand_at = {(r["tau"], r["mode"]): r for r in cand}
    for b in base:
        c = cand_at.get((b["tau"], b["mode"]))
        if c is None:
            continue
        for name, ids, verdicts in QUALITY:
            if not b.get(verdicts) or not c.get(verdicts):
                continue
            if b[ids] != c[ids]:
                raise ValueError(f"{b['model']} and {c['model']} were asked different {name} questions: evaluate both "
                                 "with the same --seed, --n-checkable and --humaneval (and --development)")
            x, y = [float(v) for v in b[verdicts]], [float(v) for v in c[verdicts]]
            d, lo, hi = paired_interval(x, y, list(range(len(x))), resamples, seed)
            out.append({"tau": b["tau"], "mode": b["mode"], "measure": name, "n": len(x), "base": sum(x) / len(x),
                        "cand": sum(y) / len(y), "diff": d, "lo": lo, "hi": hi})
    if not out:
        raise ValueError(f"{base[0]['model']} and {cand[0]['model']} share no τ with per-question verdicts: evaluate "
                         "both with the same --taus")
    return out


def format_quality(base: str, cand: str, rows: list[dict]) -> str:
    lines = [f"candidate {cand} against {base}: one-token quality, difference (95% paired bootstrap interval)", "",
             "| τ | mode | measure | n | accuracy | difference |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tau']:g} | {r['mode']} | {r['measure']} | {r['n']} | {r['base']:.1%} → "
                     f"{r['cand']:.1%} | {100 * r['diff']:+.1f} pts ({100 * r['lo']:+.1f} .. {100 * r['hi']:+.1f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m finetune.evals.paired", description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="devscore --out file of the model to compare against (--quality: evaluate --json)")
    ap.add_argument("candidate", help="devscore --out file of the candidate (may be the same file with --*-model)")
    ap.add_argument("--quality", action="store_true",
                    help="compare two evaluate --suite natural --json files: checkable and HumanEval per τ")
    ap.add_argument("--base-model", default=None, help="which line of BASE (its model); default: the last")
    ap.add_argument("--candidate-model", default=None, help="which line of CANDIDATE (its model); default: the last")
    ap.add_argument("--resamples", type=int, default=RESAMPLES, help="bootstrap resamples (default 2000)")
    ap.add_argument("--seed", type=int, default=0, help="the resampling's seed")
    args = ap.parse_args(argv)
    if args.resamples < 100:
        raise ValueError(f"--resamples {args.resamples}: use at least 100 (2000 gives stable 95% intervals)")
    if args.quality:
        base_rows = read_quality(args.base, args.base_model)
        cand_rows = read_quality(args.candidate, args.candidate_model)
        print(format_quality(base_rows[0]["model"], cand_rows[0]["model"],
                             compare_quality(base_rows, cand_rows, args.resamples, args.seed)))
        return 0
    base = read_scores(args.base, args.base_model)
    cand = read_scores(args.candidate, args.candidate_model)
    print(format_rows(base["model"], cand["model"], compare(base, cand, args.resamples, args.seed)))
    return 0


if __name__ == "__main__":
    from finetune.config import run_main

    run_main(main)
