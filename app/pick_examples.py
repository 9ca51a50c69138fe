"""Pick the Generate tab's example prompts for a real-language MARS model: `python -m app.pick_examples`.

Candidates are development prompts only: `finetune.natural.natural_prompts("heldout", n, seed=77)` (the seed the
A/B runs tune on), less any prompt of the report set (seed 1, which nothing is tuned on). Each is decoded at the
page's defaults (τ 0.9, B 4) in lossy MARS and in lossless MARS; the ranking puts first the prompts where MARS
visibly commits several tokens in one forward (the most tokens/forward, then the largest chunk). The page's
list (models.TEACHING_PROMPTS) is the top of this ranking, copied by hand, so the app never decodes at start.
"""
from __future__ import annotations

import argparse
import sys

DEV_SEED, REPORT_SEED = 77, 1


def candidates(n: int) -> list[str]:
    from finetune.natural import natural_prompts
    report = set(natural_prompts("heldout", 64, seed=REPORT_SEED))
    return [p for p in natural_prompts("heldout", n, seed=DEV_SEED) if p not in report]


def rank(model: str, prompts: list[str], tau: float, block_size: int, max_new_tokens: int) -> list[dict]:
    from mars_core import DecodeConfig, generate, load_model
    lm = load_model(model)
    rows = {}
    for p in prompts:   # one at a time, as the page decodes them
        for mode in ("mars", "verify"):
            cfg = DecodeConfig(mode=mode, tau=tau, block_size=block_size, max_new_tokens=max_new_tokens)
            r = generate(lm, [p], cfg)[0]
            chunks = [len(s) for s in r.steps]   # tokens committed by each forward
            rows.setdefault(p, {"prompt": p})[mode] = (r.tokens_per_forward, max(chunks or [1]))
        print(f"{len(rows)}/{len(prompts)}", flush=True, file=sys.stderr)
    return sorted(rows.values(), key=lambda r: (r["mars"][0] + r["verify"][0], r["mars"][1]), reverse=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-mars")
    ap.add_argument("--candidates", type=int, default=32)
    ap.add_argument("--tau", type=float, default=0.9)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    for r in rank(args.model, candidates(args.candidates), args.tau, args.block_size, args.max_new_tokens):
        print(f"MARS {r['mars'][0]:.2f} tok/fwd (largest chunk {r['mars'][1]}) · lossless {r['verify'][0]:.2f} · "
              f"{r['prompt']}")


if __name__ == "__main__":
    main()
