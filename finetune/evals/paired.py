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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m finetune.evals.paired", description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="devscore --out file of the model to compare against")
    ap.add_argument("candidate", help="devscore --out file of the candidate (may be the same file with --*-model)")
    ap.add_argument("--base-model", default=None, help="which line of BASE (its model); default: the last")
    ap.add_argument("--candidate-model", default=None, help="which line of CANDIDATE (its model); default: the last")
    ap.add_argument("--resamples", type=int, default=RESAMPLES, help="bootstrap resamples (default 2000)")
    ap.add_argument("--seed", type=int, default=0, help="the resampling's seed")
    args = ap.parse_args(argv)
    if args.resamples < 100:
        raise ValueError(f"--resamples {args.resamples}: use at least 100 (2000 gives stable 95% intervals)")
    base = read_scores(args.base, args.base_model)
    cand = read_scores(args.candidate, args.candidate_model)
    print(format_rows(base["model"], cand["model"], compare(base, cand, args.resamples, args.seed)))
    return 0


if __name__ == "__main__":
    from finetune.config import run_main

    run_main(main)
