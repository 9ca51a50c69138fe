"""Self-distillation data: a model's own greedy answers to a list of prompts, as chat JSONL.

MARS (stage 2) should be trained on data the model itself would produce; for a
model whose SFT data you lack (SmolLM2, say) its own greedy AR answers are that
data. Answers cut off by --max-new-tokens are dropped (they would teach the
model to stop mid-answer) unless --keep-truncated, and so are answers that
repeat themselves (a loop, not an answer); the dropped prompts are counted.
With --check-answers, wrong answers to the generated arithmetic and counting
prompts (finetune.evals.structured computes their results) are dropped too.

    python -m finetune.recipes.distill --model smollm2 --prompts prompts.txt --out data.jsonl
    python -m finetune.train --stage mars --data data.jsonl ...

Decoding is batched (--batch-size rows, left-padded by the project's own AR
decoder). The run is resumable: every finished batch is appended to --out (and
the prompts it dropped to --out's ``.dropped.jsonl`` sidecar) at once, and a
restart skips every prompt already answered or dropped. ``--shard K/N`` takes
every N-th prompt starting at K, so N processes can split one prompts file.

The prompts file has one prompt per line (blank lines and lines starting with
'#' are skipped), or is a .jsonl file of {"prompt": ...} or {"messages": [...]}
rows (the first user message is used). mars_core.models.textfile.read_prompts reads it, as
it reads ``python -m mars_core bench --prompts``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from finetune.config import parse_bool   # standard library only, like the next three
from finetune.evals.evaluate_common import repeats_itself   # no torch there either: --help stays quick
from finetune.host_memory import keep_freed_memory
from mars_core.models.storage import storage_error   # standard library only: --help stays quick

MAX_NEW_TOKENS = 256


def drop_reason(res, keep_truncated: bool = False, prompt: str | None = None) -> str | None:
    """Why an answer is not training data: 'length' (hit the cap), 'repeat' (a loop), 'empty', or with `prompt`
    'wrong: …' where finetune.evals.structured knows the exact answer to it and this is not it; else None."""
    if res.finish_reason != "eos" and not keep_truncated:
        return "length"
    if repeats_itself(res.token_ids):
        return "repeat"
    if not res.text.strip():
        return "empty"
    if prompt is not None:
        from finetune.evals.structured import check_answer

        why = check_answer(prompt, res.text)
        return None if why is None else f"wrong: {why}"
    return None


def distill_batches(lm, prompts: list[str], max_new_tokens: int = MAX_NEW_TOKENS, batch_size: int = 8,
                    keep_truncated: bool = False, check_answers: bool = False):
    """Yield (rows, dropped, new_tokens) per batch: greedy AR answers of `lm` as chat rows, and the
    {"prompt", "reason"} of each dropped prompt. `check_answers`: also drop wrong answers to the generated
    arithmetic and counting prompts (finetune.evals.structured.check_answer)."""
    from mars_core import DecodeConfig, generate

    cfg = DecodeConfig(mode="ar", max_new_tokens=max_new_tokens)
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i: i + batch_size]
        rows, dropped, n_tokens = [], [], 0
        for prompt, res in zip(chunk, generate(lm, chunk, cfg), strict=True):
            n_tokens += len(res.token_ids)
            reason = drop_reason(res, keep_truncated, prompt if check_answers else None)
            if reason is not None:
                dropped.append({"prompt": prompt, "reason": reason})
                continue
            rows.append({"messages": [{"role": "user", "content": prompt},
                                      {"role": "assistant", "content": res.text}]})
        yield rows, dropped, n_tokens


def distill(lm, prompts: list[str], max_new_tokens: int = MAX_NEW_TOKENS, batch_size: int = 8,
            keep_truncated: bool = False) -> tuple[list[dict], int]:
    """All rows at once; returns (rows, number dropped)."""
    rows, dropped = [], 0
    for r, d, _ in distill_batches(lm, prompts, max_new_tokens, batch_size, keep_truncated):
        rows.extend(r)
        dropped += len(d)
    return rows, dropped


def _complete_lines(path: Path) -> list[str]:
    """The complete JSON lines of a file a killed run may have left half-written; the torn tail is cut off."""
    if not path.is_file():
        return []
    raw = path.read_bytes()
    keep = raw[: raw.rfind(b"\n") + 1]
    if len(keep) != len(raw):
        with path.open("r+b") as fh:
            fh.truncate(len(keep))
    lines = []
    for line in keep.decode("utf-8").splitlines():
        if line.strip():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return lines


def done_prompts(out: Path) -> set[str]:
    """Prompts an earlier run already answered (in `out`) or dropped (in its sidecar)."""
    seen = {row["messages"][0]["content"] for row in _complete_lines(out) if "messages" in row}
    seen |= {row["prompt"] for row in _complete_lines(dropped_path(out)) if "prompt" in row}
    return seen


def dropped_path(out: Path) -> Path:
    return out.with_name(out.name + ".dropped.jsonl")


def parse_shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r} is not K/N: use e.g. 0/2 and 1/2 for two processes") from None
    if n < 1 or not 0 <= k < n:
        raise ValueError(f"--shard {text!r}: need N >= 1 and 0 <= K < N (e.g. 0/2)")
    return k, n


def _append(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    size = path.stat().st_size if path.exists() else None
    try:
        with path.open("a", encoding="utf-8") as fh:
            fh.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:   # a full disk: undo this batch (no torn line, no empty new file), say so in one line
        try:
            path.unlink(missing_ok=True) if size is None else os.truncate(path, size)
        except OSError:
            pass
        raise ValueError(storage_error(exc, path, f"{len(rows)} distilled rows")) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m finetune.recipes.distill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model name or directory (see mars_core.load_model)")
    ap.add_argument("--prompts", required=True, help="text file, one prompt per line (or .jsonl)")
    ap.add_argument("--out", required=True, help="chat JSONL to write; appended to, and resumed, if it exists")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--keep-truncated", action="store_true", help="keep answers cut off by --max-new-tokens")
    ap.add_argument("--check-answers", action="store_true",
                    help="drop wrong answers to the generated arithmetic and counting prompts "
                    "(finetune.evals.structured knows their results), so AR is not trained on its own mistakes")
    ap.add_argument("--shard", default="0/1", help="K/N: answer every N-th prompt starting at K (default 0/1)")
    ap.add_argument("--skip-seen", default="", help="a data manifest (or a folder holding data_manifest.json, e.g. "
                    "an exported adapter): its prompts are not answered again, so a new round distils new prompts only")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto",
                    help="any format load_model takes: auto, float32, bfloat16 (fast on CPUs with "
                    "avx512_bf16/AMX), or w8a16 / w8a8 (CPU: int8 weights, the fastest answers where bf16 is slow)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (use 1 per process on a 2-core machine)")
    ap.add_argument("--keep-freed-memory", nargs="?", const=True, default=True, type=parse_bool,
                    help="on a CPU, keep freed memory in this process instead of handing it back to the kernel "
                    "after every batch (default true; the same answers, 3 to 7 percent faster measured); false "
                    "keeps glibc's malloc defaults")
    args = ap.parse_args(argv)
    for flag, value in (("--batch-size", args.batch_size), ("--max-new-tokens", args.max_new_tokens),
                        ("--threads", args.threads)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: use 1 or more")
    return args


def prompts_to_do(args: argparse.Namespace) -> list[str]:
    """This shard's prompts that no earlier run into --out answered or dropped; --out is checked first."""
    from finetune.config import check_output_file
    from mars_core.models.textfile import read_prompts   # here, not at the top: mars_core imports torch

    k, n = parse_shard(args.shard)
    out, src = Path(args.out), Path(args.prompts)
    if out.resolve() == src.resolve() or dropped_path(out).resolve() == src.resolve():
        raise ValueError(f"--out {args.out!r} is the prompts file: writing there would destroy the prompts; "
                         "pick another --out")
    prompts = read_prompts(src)[k::n]
    if out.exists() and not out.is_file():
        raise ValueError(f"--out {args.out!r} is not a file: pass a .jsonl path")
    check_output_file("--out", out)
    seen = done_prompts(out)
    todo = [p for p in prompts if p not in seen]
    note = ""
    if args.skip_seen:
        from finetune.data import prompt_text_key, read_manifest

        trained = set(read_manifest(args.skip_seen)["prompts"])
        before = len(todo)
        todo = [p for p in todo if prompt_text_key(p) not in trained]
        note = f", {before - len(todo)} in the --skip-seen manifest"
    done = sum(p in seen for p in prompts)
    print(f"[finetune.recipes.distill] {len(prompts)} prompts, {done} already done{note}, {len(todo)} to go",
          file=sys.stderr)
    return todo


def answer(args: argparse.Namespace, todo: list[str], own_process: bool = False) -> None:
    """Load the model and append its answers to --out (and the dropped prompts to its sidecar), batch by batch.
    ``own_process``: this process is the distiller's own (``python -m``), so it may change the process-wide malloc
    policy; a caller of ``main()`` keeps its own."""
    import torch
    from tqdm.auto import tqdm

    from mars_core import load_model

    if own_process and args.keep_freed_memory and runs_on_cpu(args.device):
        # each batch's KV cache and logits are tens of MB: glibc maps and unmaps them afresh every batch, and the
        # kernel zeroes those pages again (3.8 M page faults for 128 prompts against 0.3 M kept: finetune.host_memory)
        keep_freed_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    out = Path(args.out)
    kept = dropped = tokens = 0
    start = time.perf_counter()
    bar = tqdm(total=len(todo), unit="prompt", desc="distill", dynamic_ncols=True)
    try:
        for rows, lost, n_tokens in distill_batches(lm, todo, args.max_new_tokens, args.batch_size,
                                                    args.keep_truncated, args.check_answers):
            _append(out, rows)
            _append(dropped_path(out), lost)
            kept, dropped, tokens = kept + len(rows), dropped + len(lost), tokens + n_tokens
            bar.update(len(rows) + len(lost))
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.0f}", kept=kept, dropped=dropped)
    except KeyboardInterrupt as exc:   # every finished batch is on disk (a torn last line is cut on restart)
        bar.close()
        raise type(exc)(f"after {kept + dropped} of {len(todo)} prompts; {kept} rows are in {str(out)!r}: rerun "
                        "the same command to resume") from None
    bar.close()
    print(f"[finetune.recipes.distill] wrote {kept} rows to {out}; dropped {dropped} (see {dropped_path(out).name}); "
          f"{tokens} tokens in {time.perf_counter() - start:.0f} s", file=sys.stderr)


def runs_on_cpu(device: str) -> bool:
    """Whether ``--device`` puts the model on the CPU (auto does where no CUDA device is present)."""
    import torch

    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def main(argv: list[str] | None = None, own_process: bool = False) -> int:
    args = parse_args(argv)
    todo = prompts_to_do(args)
    if todo:
        answer(args, todo, own_process)
    return 0


if __name__ == "__main__":
    from finetune.config import run_main

    run_main(lambda: main(own_process=True))
