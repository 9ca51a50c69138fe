"""Pick a real-language MARS model's teaching prompts and default τ: `python -m app.pick_examples`.

Candidates are development prompts only: `natural_prompts("heldout", n, seed=77)` and
`structured_prompts("heldout", n, seed=77)` (the seed settings are chosen on), less any prompt of the report sets
(seed 1, which nothing is tuned on). Each is decoded as the page decodes it (batch 1, B 4, the page's 112 new
tokens): AR (τ off), lossy MARS at each τ of --taus, and lossless MARS. The table gives, per prompt, whether AR's
answer ends (eos) without a loop, its text (to check its facts by hand), and per τ the tokens/forward and whether
the lossy answer is AR's. A teacher's prompt must have an AR answer that is correct, ends and does not loop; the
page's list (models.TEACHING_PROMPTS) and default τ (models.DEFAULT_TAUS) are chosen from this table by hand, so
the app never decodes at start. tests/test_teaching.py checks each listed prompt's AR answer against its facts.
"""
from __future__ import annotations

import argparse
import json
import sys

DEV_SEED, REPORT_SEED = 77, 1
PAGE_MAX_NEW = 112   # the Generate tab's default


def candidates(n: int) -> list[str]:
    """Development prompts (natural, then structured), none of them in a report set."""
    from finetune.evals.natural import natural_prompts
    from finetune.evals.structured import structured_prompts
    report = set(natural_prompts("heldout", 64, seed=REPORT_SEED)) | set(structured_prompts("heldout", 64,
                                                                                             seed=REPORT_SEED))
    pool = natural_prompts("heldout", n, seed=DEV_SEED) + structured_prompts("heldout", n, seed=DEV_SEED)
    return [p for p in pool if p not in report]


def decode_table(lm, prompts: list[str], taus: list[float], block_size: int = 4,
                 max_new_tokens: int = PAGE_MAX_NEW) -> list[dict]:
    """One row per prompt: AR's answer, its finish and loop, and per τ the lossy tokens/forward and == AR."""
    from finetune.evals.evaluate_common import repeats_itself
    from mars_core import DecodeConfig, generate

    rows = []
    for p in prompts:   # one at a time, as the page decodes them
        ar = generate(lm, [p], DecodeConfig(mode="mars", tau=1.0, block_size=1, max_new_tokens=max_new_tokens))[0]
        row = {"prompt": p, "ar": ar.text, "ends": ar.finish_reason == "eos", "loops": repeats_itself(ar.token_ids)}
        for tau in taus:
            r = generate(lm, [p], DecodeConfig(mode="mars", tau=tau, block_size=block_size,
                                               max_new_tokens=max_new_tokens))[0]
            row[f"tau{tau}"] = {"tpf": r.tokens_per_forward, "same": r.token_ids == ar.token_ids,
                                "chunk": max((len(s) for s in r.steps), default=1)}
        v = generate(lm, [p], DecodeConfig(mode="verify", tau=min(taus), block_size=block_size,
                                           max_new_tokens=max_new_tokens))[0]
        row["lossless"] = {"tpf": v.tokens_per_forward, "same": v.token_ids == ar.token_ids}
        rows.append(row)
        print(f"{len(rows)}/{len(prompts)}", flush=True, file=sys.stderr)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-mars")
    ap.add_argument("--candidates", type=int, default=24, help="per prompt family (natural, structured)")
    ap.add_argument("--taus", default="0.95,0.9,0.8")
    ap.add_argument("--out", default="", help="JSON file for the whole table")
    args = ap.parse_args(argv)
    from mars_core import load_model
    taus = [float(t) for t in args.taus.split(",")]
    rows = decode_table(load_model(args.model), candidates(args.candidates), taus)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    for r in sorted(rows, key=lambda r: -r[f"tau{taus[-1]}"]["tpf"]):
        cells = " · ".join(f"τ{t} {r[f'tau{t}']['tpf']:.2f}{'=' if r[f'tau{t}']['same'] else '≠'}" for t in taus)
        flag = "ok" if r["ends"] and not r["loops"] else ("LOOP" if r["loops"] else "CAP")
        print(f"[{flag}] {cells} · lossless {r['lossless']['tpf']:.2f} · {r['prompt']}\n      AR: {r['ar'][:160]!r}")


if __name__ == "__main__":
    main()
