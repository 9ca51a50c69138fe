"""Side-by-side benchmark: AR with a KV cache vs MARS, measured alternately in one process.

Ratios, not absolute times, are the result (docs/algorithm.md, "Metrics"):
  speedup      = AR time / MARS time  (same prompts, batch size, max_new_tokens; both warmed up)
  forward cost = (MARS time per forward) / (AR time per forward); tokens/forward ÷ forward cost
                 is roughly the speedup, so this says how close we get to the ceiling.
The uncached reference (one full forward per step, no cache) is shown beside them, like the
paper's "no cache" row.

`row_costs` (CLI: `bench --row-costs`) times the decoder's cached forward alone for 1, 2, ... new positions.
An AR step feeds 1 position; a MARS step feeds the n tokens it accepted last time plus B - 1 masks. So
speedup <= tokens/forward x cost(1) / cost(n + B - 1): this says what the hardware allows before any decoding.
"""
from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mars_core.decoding import DecodeConfig, generate, reference_generate, step_attention
from mars_core.loading import ASSETS

GENERAL_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a prime number is in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Give me a short tip for learning to code.",
    "What is 12 times 7?",
    "Name the largest planet in the solar system.",
]


def default_prompts(model_name: str) -> list[str]:
    """Held-out prompts of what each embedded model was trained on: tasks for the tiny models, the natural
    held-out set for smollm2-mars (trained on the natural train split); general questions for anything else."""
    tasks = ASSETS / "prompts" / "tasks-heldout.txt"
    if model_name.startswith("tiny-") and tasks.exists():
        return read_prompts(str(tasks))
    if model_name.lower() == "smollm2-mars":
        from finetune.natural import natural_prompts  # lazy: only this model needs the catalogue

        return natural_prompts("heldout", 16)
    return list(GENERAL_PROMPTS)


def read_prompts(path: str) -> list[str]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"prompts file {path!r} does not exist: give a text file with one prompt per line")
    prompts = [line.replace("\\n", "\n") for line in p.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompts file {path!r} has no prompts: put one prompt per line")
    return prompts


@dataclass
class BenchRow:
    batch_size: int
    prompts: int
    tokens_per_forward: float      # mean over sequences
    ar_time: float                 # median seconds for all prompts
    mars_time: float
    speedup: float                 # ar_time / mars_time
    ar_forward_ms: float           # mean ms per batched forward
    mars_forward_ms: float
    forward_cost: float            # mars_forward_ms / ar_forward_ms
    ar_tokens_per_s: float
    mars_tokens_per_s: float
    reference_time: float | None   # uncached reference, one row at a time (the same run for every batch size)
    reference_speedup: float | None  # ar_time / reference_time
    peak_memory_mb: float          # CUDA: peak allocated in this batch size; CPU: process peak RSS so far


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed_run(lm, batches, cfg) -> tuple[float, int, list]:
    """Seconds, batched forwards and results for all batches."""
    _sync(lm.device)
    t0 = time.perf_counter()
    results, forwards = [], 0
    for batch in batches:
        out = generate(lm, batch, cfg)
        forwards += max(r.forwards for r in out)
        results.extend(out)
    _sync(lm.device)
    return time.perf_counter() - t0, forwards, results


def peak_memory_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # process peak RSS (Linux: KiB)


def bench(lm, prompts: list[str], batch_sizes=(1, 4), tau: float = 0.95, block_size: int = 4,
          max_new_tokens: int = 64, repeats: int = 3, reference: bool = True, progress=None,
          criterion: str = "prob") -> list[BenchRow]:
    ids = [lm.encode(p) for p in prompts]
    ar_cfg = DecodeConfig(mode="ar", max_new_tokens=max_new_tokens)
    mars_cfg = DecodeConfig(mode="mars", tau=tau, block_size=block_size, max_new_tokens=max_new_tokens,
                            criterion=criterion)
    rows = []
    ref_time = None
    for bs in batch_sizes:
        batches = [ids[i:i + bs] for i in range(0, len(ids), bs)]
        if lm.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(lm.device)
        _timed_run(lm, batches[:1], ar_cfg)            # warm-up, both sides
        _timed_run(lm, batches[:1], mars_cfg)
        ar_t, mars_t = [], []
        for _ in range(repeats):                       # alternate so drift hits both sides alike
            t, ar_fwd, ar_res = _timed_run(lm, batches, ar_cfg)
            ar_t.append(t)
            t, mars_fwd, mars_res = _timed_run(lm, batches, mars_cfg)
            mars_t.append(t)
            if progress:
                progress(f"batch {bs}: AR {ar_t[-1]:.2f}s, MARS {mars_t[-1]:.2f}s")
        ar_time, mars_time = statistics.median(ar_t), statistics.median(mars_t)
        if reference and ref_time is None:   # one row at a time whatever the batch: run it once, model warm
            t0 = time.perf_counter()
            reference_generate(lm, ids, mars_cfg)
            ref_time = time.perf_counter() - t0
        ar_ms, mars_ms = 1000 * ar_time / ar_fwd, 1000 * mars_time / mars_fwd
        rows.append(BenchRow(
            batch_size=bs, prompts=len(ids),
            tokens_per_forward=statistics.mean(r.tokens_per_forward for r in mars_res),
            ar_time=ar_time, mars_time=mars_time, speedup=ar_time / mars_time,
            ar_forward_ms=ar_ms, mars_forward_ms=mars_ms, forward_cost=mars_ms / ar_ms,
            ar_tokens_per_s=sum(len(r.token_ids) for r in ar_res) / ar_time,
            mars_tokens_per_s=sum(len(r.token_ids) for r in mars_res) / mars_time,
            reference_time=ref_time, reference_speedup=(ar_time / ref_time) if ref_time else None,
            peak_memory_mb=peak_memory_mb(lm.device),
        ))
    return rows


def format_table(rows: list[BenchRow]) -> str:
    head = ("batch", "tok/fwd", "AR s", "MARS s", "speedup", "AR ms/fwd", "MARS ms/fwd", "fwd cost",
            "no-cache s", "no-cache ×", "peak MB")
    lines = [" | ".join(head), " | ".join("-" * len(h) for h in head)]
    for r in rows:
        ref = f"{r.reference_time:.2f}" if r.reference_time else "-"
        refx = f"{r.reference_speedup:.2f}" if r.reference_speedup else "-"
        lines.append(" | ".join([
            str(r.batch_size), f"{r.tokens_per_forward:.2f}", f"{r.ar_time:.2f}", f"{r.mars_time:.2f}",
            f"{r.speedup:.2f}", f"{r.ar_forward_ms:.1f}", f"{r.mars_forward_ms:.1f}", f"{r.forward_cost:.2f}",
            ref, refx, f"{r.peak_memory_mb:.0f}",
        ]))
    return "\n".join(lines)


def rows_as_dicts(rows: list[BenchRow]) -> list[dict]:
    return [asdict(r) for r in rows]


@dataclass
class RowCost:
    rows: int                      # new positions fed to one cached forward
    forward_ms: float              # median milliseconds of that forward
    cost: float                    # forward_ms / forward_ms at 1 row (an AR step)


@torch.inference_mode()
def row_costs(lm, prompt: str | list[int], max_rows: int = 7, block_size: int = 4, rounds: int = 40) -> list[RowCost]:
    """Median time of one cached decoding forward that feeds r = 1..max_rows positions after `prompt`.

    The forward is the decoder's own call (4D step mask, explicit positions, LM head on the last
    min(r, block_size) rows); the cache holds the prompt and is cropped back after every call, so each r
    sees the same cache length. The r values take turns, in a shuffled order each round, so drift on a
    shared machine hits all of them alike. Only the model forward is timed (no acceptance logic).
    """
    from transformers import DynamicCache

    if not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows={max_rows!r} must be an integer >= 1 (MARS with B = 4 feeds up to 7)")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r} must be an integer >= 1 (--rounds on the command line)")
    ids = lm.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if len(ids) + max_rows > lm.context_length:
        raise ValueError(f"a prompt of {len(ids)} tokens + {max_rows} rows exceeds the context of {lm.context_length}")
    model, device = lm.model, lm.device
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([ids], device=device), cache=cache, use_cache=True, logits_to_keep=1)
    past = len(ids)
    kv_valid = torch.ones(1, past, dtype=torch.bool, device=device)

    def forward(r: int) -> float:
        chunk = torch.full((1, r), lm.mask_id, device=device)
        pos = torch.arange(past, past + r, device=device)[None]
        mask = step_attention(kv_valid, torch.ones(1, r, dtype=torch.bool, device=device))
        keep = torch.arange(r - min(r, block_size), r, device=device)
        _sync(device)
        t0 = time.perf_counter()
        model(input_ids=chunk, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=keep)
        _sync(device)
        elapsed = time.perf_counter() - t0
        cache.crop(-r)
        return elapsed

    sizes = list(range(1, max_rows + 1))
    for r in sizes:                                   # warm-up
        forward(r)
    times = {r: [] for r in sizes}
    order = torch.Generator().manual_seed(0)
    for _ in range(rounds):
        for i in torch.randperm(len(sizes), generator=order).tolist():
            times[sizes[i]].append(forward(sizes[i]))
    medians = {r: statistics.median(t) for r, t in times.items()}
    return [RowCost(r, 1000 * medians[r], medians[r] / medians[1]) for r in sizes]


def format_row_costs(rows: list[RowCost], block_size: int = 4) -> str:
    lines = ["rows | ms/forward | cost vs 1 row", "---- | ---------- | -------------"]
    lines += [f"{r.rows} | {r.forward_ms:.3f} | {r.cost:.2f}" for r in rows]
    full = next((r for r in rows if r.rows == 2 * block_size - 1), None)
    if full is not None:
        lines.append(f"A MARS step after accepting all B = {block_size} feeds {full.rows} rows: it costs "
                     f"{full.cost:.2f} AR steps, so at {block_size} tokens/forward the speedup is at most {block_size / full.cost:.2f}x.")
    return "\n".join(lines)
