"""Self-distillation data: a model's own greedy answers to a list of prompts, as chat JSONL.

MARS (stage 2) should be trained on data the model itself would produce; for a
model whose SFT data you lack (SmolLM2, say) its own greedy AR answers are that
data. Answers cut off by --max-new-tokens are dropped (they would teach the
model to stop mid-answer) unless --keep-truncated.

    python -m finetune.distill --model smollm2 --prompts prompts.txt --out data.jsonl
    python -m finetune.train --stage mars --data data.jsonl ...

The prompts file has one prompt per line (blank lines and lines starting with
'#' are skipped), or is a .jsonl file of {"prompt": ...} or {"messages": [...]}
rows (the first user message is used).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a text file (one per line) or a JSONL file; ValueError naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompts file {str(path)!r} does not exist: pass a text file with one prompt per line")
    prompts = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.rstrip("\n")
            if not line.strip() or (path.suffix != ".jsonl" and line.lstrip().startswith("#")):
                continue
            if path.suffix != ".jsonl":
                prompts.append(line.strip().replace("\\n", "\n"))
                continue
            try:
                row = json.loads(line)
                if "prompt" in row:
                    prompt = row["prompt"]
                else:
                    prompt = next(m["content"] for m in row["messages"] if m["role"] == "user")
                if not isinstance(prompt, str) or not prompt.strip():
                    raise ValueError("empty prompt")
            except (json.JSONDecodeError, KeyError, StopIteration, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: not a prompt row ({exc}); expected "
                                 '{"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]}') from None
            prompts.append(prompt)
    if not prompts:
        raise ValueError(f"prompts file {str(path)!r} has no prompts: write one prompt per line")
    return prompts


def distill(lm, prompts: list[str], max_new_tokens: int = 256, batch_size: int = 8,
            keep_truncated: bool = False) -> tuple[list[dict], int]:
    """Greedy AR answers of `lm` (a mars_core LoadedModel) as chat rows; returns (rows, dropped)."""
    from mars_core import DecodeConfig, generate

    cfg = DecodeConfig(mode="ar", max_new_tokens=max_new_tokens)
    rows, dropped = [], 0
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i: i + batch_size]
        for prompt, res in zip(chunk, generate(lm, chunk, cfg), strict=True):
            if res.finish_reason != "eos" and not keep_truncated:
                dropped += 1
                continue
            rows.append({"messages": [{"role": "user", "content": prompt},
                                      {"role": "assistant", "content": res.text}]})
    return rows, dropped


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model name or directory (see mars_core.load_model)")
    ap.add_argument("--prompts", required=True, help="text file, one prompt per line (or .jsonl)")
    ap.add_argument("--out", required=True, help="chat JSONL to write")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--keep-truncated", action="store_true", help="keep answers cut off by --max-new-tokens")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size}: use 1 or more")

    from mars_core import load_model

    prompts = read_prompts(args.prompts)
    lm = load_model(args.model, device=args.device)
    rows, dropped = distill(lm, prompts, args.max_new_tokens, args.batch_size, args.keep_truncated)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} rows to {out}" + (f"; dropped {dropped} truncated answers" if dropped else ""),
          file=sys.stderr)


if __name__ == "__main__":
    main()
