"""A candidate model on the page's teaching prompts, before it ships:
``python -m finetune.evals.teaching --model DIR --taus 0.99,0.97,0.95 --dtypes w8a8 float32 w8a16``.

For each served format and each teaching prompt (``app.models.TEACHING_FACTS``): does AR's answer end within the
page's token limit, not loop and hold the facts the page's test checks for (tests/test_teaching.py), and at each τ is
the lossy answer AR's, at how many tokens per forward. A training round can move AR's answer to a prompt it never
trained on (v3.3 and the own-answers run did, on the page's former "multiples of 10"), which the development
scores do not show.
Exit status 1 when any AR answer fails, so a round's script stops before it ships.
"""

from __future__ import annotations

import argparse
import json
import sys


def check_prompt(lm, prompt: str, facts: tuple[str, ...], taus: list[float], block_size: int,
                 max_new_tokens: int) -> dict:
    """AR's answer to `prompt` and what is wrong with it (``problems``, empty when none), then lossy MARS at each τ."""
    from finetune.evals.evaluate_common import repeats_itself
    from mars_core import DecodeConfig, generate

    ar = generate(lm, [prompt], DecodeConfig(mode="mars", tau=1.0, block_size=1, max_new_tokens=max_new_tokens))[0]
    problems = []
    if ar.finish_reason != "eos":
        problems.append(f"no end within {max_new_tokens} tokens")
    if repeats_itself(ar.token_ids):
        problems.append("loops")
    problems += [f"{fact!r} missing" for fact in facts if fact.lower() not in ar.text.lower()]
    lossy = []
    for tau in taus:
        r = generate(lm, [prompt], DecodeConfig(mode="mars", tau=tau, block_size=block_size,
                                                max_new_tokens=max_new_tokens))[0]
        lossy.append({"tau": tau, "same_as_ar": r.text == ar.text, "tokens_per_forward": r.tokens_per_forward})
    return {"prompt": prompt, "ar_text": ar.text, "problems": problems, "lossy": lossy}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m finetune.evals.teaching", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model name or folder (see mars_core.load_model)")
    ap.add_argument("--taus", default="0.99,0.97,0.95", help="comma-separated τ values for the lossy answers")
    ap.add_argument("--dtypes", nargs="+", default=["w8a8", "float32", "w8a16"],
                    help="the formats to check (the page serves w8a8 on CPUs with int8 kernels)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="B of the lossy answers (default: the B the page races smollm2-mars at, whose teaching "
                         "prompts these are: app.models.default_block_size)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="", help="also write every answer and verdict to this file")
    args = ap.parse_args(argv)
    try:
        args.tau_list = [float(t) for t in args.taus.split(",")]
    except ValueError:
        raise ValueError(f"--taus {args.taus!r}: write numbers separated by commas, e.g. 0.99,0.95") from None
    if not args.tau_list or any(not 0 < t <= 1.5 for t in args.tau_list):
        raise ValueError(f"--taus {args.taus!r}: each τ must be in (0, 1.5]")
    if args.block_size is None:
        from app.models import default_block_size

        args.block_size = default_block_size("smollm2-mars")
    if args.block_size < 2 or args.threads < 1:
        raise ValueError(f"--block-size {args.block_size} / --threads {args.threads}: use 2 or more / 1 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from app.models import TEACHING_FACTS
    from app.pick_examples import PAGE_MAX_NEW
    from mars_core import load_model

    torch.set_num_threads(args.threads)
    report, failed = [], 0
    for dtype in args.dtypes:
        lm = load_model(args.model, dtype=dtype)
        for prompt, facts in TEACHING_FACTS.items():
            row = check_prompt(lm, prompt, facts, args.tau_list, args.block_size, PAGE_MAX_NEW)
            row["dtype"], row["block_size"] = dtype, args.block_size
            report.append(row)
            failed += bool(row["problems"])
            lossy = f"B {args.block_size}, " + "; ".join(
                f"τ {x['tau']}: {'AR' if x['same_as_ar'] else 'differs'} {x['tokens_per_forward']:.2f}"
                for x in row["lossy"])
            verdict = "ok " if not row["problems"] else "BAD (" + ", ".join(row["problems"]) + ")"
            print(f"[{dtype}] {verdict} {prompt!r}: {lossy}\n    AR: {row['ar_text'][:160]!r}", flush=True)
    if args.json:
        from mars_core.models.storage import atomic_write_text
        atomic_write_text(args.json, json.dumps(report, indent=1, ensure_ascii=False) + "\n", "the teaching report")
    print(f"{failed} of {len(report)} AR answers fail the page's checks", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    from finetune.config import run_main

    run_main(main)
