"""Score models on development prompts, per category: ``python -m finetune.evals.devscore --model A --model B``.

For choosing training settings (smollm2-mars v3's learning-rate and step probe) without touching the report set:
prompts are the first ``n`` of ``natural_prompts("heldout", seed=seed)`` and of ``structured_prompts(...)`` with a
development seed (77 by default; the report seed 1 is refused), leaving out the report seed's first 64 of each, so
no development prompt is a report prompt. Per model and category it prints

- tokens per forward of lossy MARS at each τ and the share of those answers identical to the model's own τ = 1
  (AR) answer,
- tokens per forward of lossless MARS (tree drafts at draft threshold 0.3; its answer is AR's, checked),
- loops: answers that repeat an 8-token run 3 times (finetune.evals.evaluate_common.repeats_itself) where AR's does not.

Every decode is batched (``--batch-size``) in one format (``--dtype``); one JSON line per model goes to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPORT_SEED = 1
# The report sample is a prefix of the report seed's order; so is a development sample of its seed's. Both orders
# range over the same held-out split, so without this a development sample shared prompts with the report (12 of
# seed 77's 88 did). Development samples skip the report seed's first REPORT_RESERVE prompts of each group (the set
# app.pick_examples keeps out of the page's examples as well), and the report may not ask for more than those.
REPORT_RESERVE = 64
# The report's checkable questions (finetune.evals.evaluate --seed 1 --n-checkable 120): evaluate --development
# leaves them out.
REPORT_CHECKABLE = 120


def report_reserve() -> set[str]:
    """The report seed's first REPORT_RESERVE natural and structured held-out prompts: never development prompts."""
    from finetune.evals.natural import natural_prompts
    from finetune.evals.structured import structured_prompts

    return (set(natural_prompts("heldout", REPORT_RESERVE, seed=REPORT_SEED))
            | set(structured_prompts("heldout", REPORT_RESERVE, seed=REPORT_SEED)))


def _development(draw, held_out_more: str, seed: int) -> list[str]:
    """A development seed's whole order of one catalogue's held-out prompts (`draw`: natural_prompts or
    structured_prompts): the "heldout" split's without the report's (report_reserve), then the `held_out_more`
    split's (drawn once the first are used up; appended, so every earlier draw, a prefix, is unchanged)."""
    reserve = report_reserve()
    return [p for p in draw("heldout", None, seed=seed) if p not in reserve] + draw(held_out_more, None, seed=seed)


def development_natural(seed: int) -> list[str]:
    """A development seed's whole order of held-out natural prompts (_development)."""
    from finetune.evals.natural import HELDOUT_MORE, natural_prompts

    return _development(natural_prompts, HELDOUT_MORE, seed)


def development_structured(seed: int) -> list[str]:
    """The same for the structured prompts."""
    from finetune.evals.structured import HELDOUT_MORE, structured_prompts

    return _development(structured_prompts, HELDOUT_MORE, seed)


def dev_prompts(n_natural: int, n_structured: int, seed: int, report: bool = False,
                exclude: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """(category, prompt) pairs: natural then structured held-out prompts of a development seed, none of them a
    report prompt, or with `report` of the report seed (for the final report only, once the settings are chosen).
    `exclude`: prompts left out as well (a fresh draw, disjoint from prompts already scored)."""
    from finetune.evals.natural import natural_prompts
    from finetune.evals.structured import structured_prompts

    if report:
        if exclude:
            raise ValueError("--exclude with --report: the report sample is fixed (the report seed's first prompts); "
                             "leave --exclude out")
        if max(n_natural, n_structured) > REPORT_RESERVE:
            raise ValueError(f"--report with --natural {n_natural} --structured {n_structured}: the report sample is "
                             f"at most {REPORT_RESERVE} of each (the prompts development samples leave out); ask for "
                             "fewer")
        return _tagged(natural_prompts("heldout", n_natural, seed=REPORT_SEED),
                      structured_prompts("heldout", n_structured, seed=REPORT_SEED))
    if seed == REPORT_SEED:
        raise ValueError(f"--seed {seed} is the report seed: development scores must not use it; pick another "
                         "(77), or pass --report for the final report once every setting is chosen")
    natural = [p for p in development_natural(seed) if p not in exclude]
    structured = [p for p in development_structured(seed) if p not in exclude]
    for flag, n, pool in (("--natural", n_natural, natural), ("--structured", n_structured, structured)):
        if n > len(pool):
            raise ValueError(f"{flag} {n}: the held-out splits have {len(pool)} development prompts of that kind (the "
                             f"report's{' and the excluded' if exclude else ''} are left out); ask for at most that "
                             "many")
    return _tagged(natural[:n_natural], structured[:n_structured])


def _tagged(natural: list[str], structured: list[str]) -> list[tuple[str | None, str]]:
    """(category, prompt) pairs; None for a prompt its catalogue does not hold."""
    from finetune.evals.natural import HELDOUT_MORE
    from finetune.evals.natural import prompt_table as natural_table
    from finetune.evals.structured import category_of

    # A prompt text in both catalogues gets the category of the list it was drawn from: category_of() gives it the
    # structured one, which filed a natural prompt under `code` and split the groups 47 / 41 for 48 / 40.
    natural_cats = {p: c for split in ("heldout", HELDOUT_MORE) for c, _, p in natural_table(split)}
    cats = category_of()
    return [(natural_cats.get(p), p) for p in natural] + [(cats.get(p), p) for p in structured]


def categories_of(prompts: list[str], seed: int) -> list[str | None]:
    """Each prompt's category in a sample dev_prompts drew with `seed` (the report's with REPORT_SEED): its natural
    prompts are a prefix of the seed's natural order, the rest structured. For a devscore line written before the
    line kept its categories; None where a prompt is in neither catalogue."""
    from finetune.evals.natural import natural_prompts

    natural = natural_prompts("heldout", None, seed=seed) if seed == REPORT_SEED else development_natural(seed)
    k = 0
    while k < min(len(prompts), len(natural)) and prompts[k] == natural[k]:
        k += 1
    return [c for c, _ in _tagged(prompts[:k], prompts[k:])]


def group_of(category: str) -> str:
    """'structured' for the five structured categories, else 'natural'."""
    from finetune.evals.structured import CATEGORIES

    return "structured" if category in CATEGORIES else "natural"


def score_model(lm, items: list[tuple[str, str]], taus: list[float], *, block_size: int, max_new_tokens: int,
                batch_size: int) -> dict:
    """Per-prompt results of AR, lossy MARS at each τ and lossless tree MARS, summarised per group."""
    from finetune.evals.evaluate_common import repeats_itself
    from finetune.evals.evaluate_common import decode_batches
    from mars_core import DecodeConfig

    ids = [lm.encode(p) for _, p in items]
    runs = {"ar": DecodeConfig(mode="mars", tau=1.0, block_size=1, max_new_tokens=max_new_tokens)}
    for tau in taus:
        runs[f"tau{tau}"] = DecodeConfig(mode="mars", tau=tau, block_size=block_size, max_new_tokens=max_new_tokens)
    # verify mode's τ picks which mask guesses become drafts (τ >= 1: none); 0.3 as finetune.recipes.ab scores
    # lossless
    runs["tree"] = DecodeConfig(mode="verify", tau=0.3, block_size=block_size, max_new_tokens=max_new_tokens,
                                draft_layout="tree")
    out = {name: decode_batches(lm, ids, cfg, batch_size) for name, cfg in runs.items()}
    ar = [r.token_ids for r in out["ar"]]
    groups: dict[str, list[int]] = {"all": list(range(len(items)))}
    for i, (cat, _) in enumerate(items):
        groups.setdefault(group_of(cat), []).append(i)
        groups.setdefault(cat, []).append(i)
    summary = {}
    for g, idx in groups.items():
        row = {"n": len(idx)}
        for name in runs:
            if name == "ar":
                continue
            res = [out[name][i] for i in idx]
            row[f"{name}_tpf"] = sum(r.tokens_per_forward for r in res) / len(res)
            row[f"{name}_same"] = sum(res[k].token_ids == ar[i] for k, i in enumerate(idx)) / len(idx)
            row[f"{name}_loops"] = sum(repeats_itself(res[k].token_ids) and not repeats_itself(ar[i])
                                       for k, i in enumerate(idx))
        summary[g] = row
    return {"summary": summary, "answers": {name: [r.text for r in res] for name, res in out.items()},
            "forwards": {name: [r.forwards for r in res] for name, res in out.items()},
            "tokens": {name: [len(r.token_ids) for r in res] for name, res in out.items()}}


def format_table(name: str, summary: dict, taus: list[float]) -> str:
    cols = [f"tau{t}" for t in taus] + ["tree"]
    head = "| group | n | " + " | ".join(f"{c} tpf (== AR, loops)" for c in cols) + " |"
    lines = [f"### {name}", "", head, "|" + "---|" * (2 + len(cols))]
    for g, row in summary.items():
        cells = [f"{row[c + '_tpf']:.3f} ({row[c + '_same']:.0%}, {row[c + '_loops']})" for c in cols]
        lines.append(f"| {g} | {row['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


OUT_KEYS = ("model", "prompts", "answers", "tokens", "forwards")


def read_out(path: str, keys: tuple[str, ...] = OUT_KEYS) -> list[dict]:
    """The lines of a devscore --out file, each checked to hold `keys`; a bad one is named FILE:LINE."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such file; give a file written by `python -m finetune.evals.devscore --out`")
    lines = []
    for n, text in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not text.strip():
            continue
        try:
            rec = json.loads(text)
        except json.JSONDecodeError:
            rec = None
        missing = [k for k in keys if not isinstance(rec, dict) or k not in rec]
        if missing:
            raise ValueError(f"{path}:{n}: not a devscore --out line (no {', '.join(missing)}); give a file written "
                             "by `python -m finetune.evals.devscore --out`")
        lines.append(rec)
    if not lines:
        raise ValueError(f"{path}: empty; give a file written by `python -m finetune.evals.devscore --out`")
    return lines


def excluded_prompts(paths: list[str]) -> frozenset[str]:
    """Every prompt of the devscore --out files `paths` (all their lines)."""
    return frozenset(p for path in paths for rec in read_out(path, ("prompts",)) for p in rec["prompts"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m finetune.evals.devscore", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", required=True, help="model name or folder (repeatable)")
    ap.add_argument("--natural", type=int, default=24, help="natural held-out prompts")
    ap.add_argument("--structured", type=int, default=20, help="structured held-out prompts")
    ap.add_argument("--seed", type=int, default=77, help="development seed (not 1, the report seed)")
    ap.add_argument("--report", action="store_true", help="score the report seed (1): the final report only")
    ap.add_argument("--taus", default="0.95,0.9,0.8")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="", help="JSONL file to append one line per model to")
    ap.add_argument("--exclude", action="append", default=[], metavar="FILE",
                    help="a devscore --out file whose prompts this draw leaves out (repeatable): a fresh draw")
    args = ap.parse_args(argv)
    taus = [float(t) for t in args.taus.split(",")]
    items = dev_prompts(args.natural, args.structured, args.seed, args.report, excluded_prompts(args.exclude))
    import torch

    from mars_core import load_model

    torch.set_num_threads(args.threads)
    for name in args.model:
        t0 = time.time()
        lm = load_model(name, dtype=args.dtype)
        res = score_model(lm, items, taus, block_size=args.block_size, max_new_tokens=args.max_new_tokens,
                          batch_size=args.batch_size)
        print(format_table(f"{name} ({time.time() - t0:.0f} s)", res["summary"], taus), flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps({"model": name, "dtype": args.dtype, "taus": taus,
                                    "seed": REPORT_SEED if args.report else args.seed,
                                    "prompts": [p for _, p in items], "categories": [c for c, _ in items],
                                    "excluded": args.exclude,
                                    **res}) + "\n")
    return 0


if __name__ == "__main__":
    from finetune.config import run_main

    run_main(main)
