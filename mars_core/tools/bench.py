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
from dataclasses import asdict, dataclass, field

import torch

from mars_core.decode.batch import step_attention
from mars_core.models.catalogue import NATURAL, TASKS, find
from mars_core.decode.config import DecodeConfig
from mars_core.decode.decoding import draft_acceptance, generate, reference_generate
from mars_core.tools.fastest import fastest_lossless
from mars_core.models.sources import ASSETS
from mars_core.models.textfile import read_prompts
from mars_core.tools.timing import NOW, alternate, pick_clock

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
    rec = find(model_name)
    tasks = ASSETS / "prompts" / "tasks-heldout.txt"
    if rec is not None and rec.prompts == TASKS and tasks.exists():
        return read_prompts(str(tasks))
    # finetune.evals.natural's first 16 held-out prompts, shipped as a file so that mars_core needs no finetune import;
    # only for the model MARS-trained on the natural train split, not for the base it started from
    natural = ASSETS / "prompts" / "natural-heldout.txt"
    if rec is not None and rec.prompts == NATURAL and rec.mars and natural.exists():
        return read_prompts(str(natural))
    return list(GENERAL_PROMPTS)


@dataclass
class BenchRow:
    batch_size: int
    prompts: int
    tokens_per_forward: float      # MARS, mean over sequences
    ar_time: float                 # median seconds for all prompts, our AR
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
    clock: str = "wall"            # what the times measure: wall (perf_counter) or thread (this thread's CPU time)
    hf_time: float | None = None   # transformers generate(do_sample=False), same model and batches
    hf_equals_ar: bool | None = None
    # the AR baseline every speedup below divides: "ours", "transformers" or other_ar_label
    fastest_ar: str = "ours"
    mars_speedup: float = 0.0      # fastest AR time / MARS time
    verify_time: float | None = None          # lossless MARS (mode="verify")
    verify_tokens_per_forward: float | None = None
    verify_speedup: float | None = None       # fastest AR time / verify time
    verify_equals_ar: bool | None = None      # token for token (guaranteed in fp32)
    draft_acceptance: list | None = None      # verify: share of drafts confirmed, per mask slot 1 .. B-1
    verify_positions_per_forward: float | None = None   # columns fed per forward after the prompt's (the layout's)
    verify_forward_cost: float | None = None  # verify ms per forward / AR ms per forward: what those columns cost
    mars_agreement: float = 0.0    # share of sequences whose MARS answer equals AR's
    time_ranges: dict = field(default_factory=dict)   # side -> [min, max] seconds over the repeats
    overhead_ms: dict = field(default_factory=dict)   # side -> ms per forward spent outside the model's forward
    overhead_share: dict = field(default_factory=dict)  # side -> that as a share of the step
    other_ar_label: str | None = None         # our AR on the same model in another weight format (bench other_ar)
    other_ar_time: float | None = None
    other_ar_agreement: float | None = None   # share of its answers equal to this format's AR answers
    # Time per generated token, side -> ms (sides that write other tokens, like llama.cpp, compare only this way),
    # and the fastest AR side's ms/token over each side's: > 1 means faster than every AR, llama.cpp included.
    ms_per_token: dict = field(default_factory=dict)
    per_token_speedup: dict = field(default_factory=dict)
    fastest_ar_per_token: str | None = None
    external_labels: dict = field(default_factory=dict)   # side ("llamacpp", "onnxruntime") -> what it ran
    external_agreement: dict = field(default_factory=dict)   # side -> share of prompts answered as our AR does


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@dataclass
class HFGreedy:
    """The transformers side of the bench: `model.generate(do_sample=False)` with its default cache."""
    max_new_tokens: int


@dataclass
class ExternalGreedy:
    """Another runtime's greedy AR (mars_core.tools.llamacpp.LlamaCppAR, mars_core.tools.ortgenai.OrtGenAIAR): one
    prompt at a time, batch size 1 only."""
    max_new_tokens: int


def _timed_run(lm, batches, cfg, clock: str = "wall") -> tuple[float, int, list]:
    """Seconds, batched forwards and results for all batches (HFGreedy: token lists, forwards not counted)."""
    now = NOW[clock]
    _sync(lm.device)
    t0 = now()
    results, forwards = [], 0
    for batch in batches:
        if isinstance(cfg, HFGreedy):
            results.extend(hf_generate(lm, batch, cfg.max_new_tokens))
            continue
        if isinstance(cfg, ExternalGreedy):
            results.extend(lm.generate(p, cfg.max_new_tokens) for p in batch)
            continue
        out = generate(lm, batch, cfg)
        forwards += max(r.forwards for r in out)
        results.extend(out)
    _sync(lm.device)
    return now() - t0, forwards, results


@torch.inference_mode()
def hf_generate(lm, batch: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate on a left-padded batch; each row's tokens up to its first eos."""
    width = max(map(len, batch))
    pad = lm.eos_ids[0]
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=lm.device)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=lm.device)
    out = lm.model.generate(ids, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=lm.eos_ids, pad_token_id=pad)[:, width:].tolist()
    rows = []
    for row in out:
        cut = next((i + 1 for i, t in enumerate(row) if t in lm.eos_ids), len(row))
        rows.append(row[:cut])
    return rows


def decoder_overhead(lm, batches, cfg, clock: str = "wall") -> tuple[float, float]:
    """One extra, instrumented run: ms per forward spent outside the model's forward, and its share of a step."""
    spent = [0.0]
    forward, now = lm.net.forward, NOW[clock]

    def timed(*args, **kwargs):
        _sync(lm.device)
        t0 = now()
        out = forward(*args, **kwargs)
        _sync(lm.device)
        spent[0] += now() - t0
        return out

    lm.net.forward = timed
    try:
        total, forwards, _ = _timed_run(lm, batches, cfg, clock)
    finally:
        del lm.net.forward            # back to the class's own forward
    outside = max(0.0, total - spent[0])
    return 1000 * outside / forwards, outside / total


def peak_memory_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # process peak RSS (Linux: KiB)


@dataclass
class BenchSettings:
    """What `bench` races: one field per flag of `python -m mars_core bench`. `clock` (see `pick_clock`) decides
    what every time in the rows measures; `draft_layout`, `prompt_lookup` and `tree_width` are lossless MARS's
    (DecodeConfig), and `draft_layout="fastest"` times the candidate layouts first (mars_core.tools.fastest) and
    races the fastest, with its own block size."""
    batch_sizes: tuple = (1, 4)
    tau: float = 0.95
    block_size: int = 4
    max_new_tokens: int = 64
    repeats: int = 3
    reference: bool = True       # the uncached reference beside them, run once
    criterion: str = "prob"
    transformers: bool = True    # transformers' own generate as a side
    verify: bool = True          # lossless MARS as a side
    clock: str = "auto"
    draft_layout: str = "linear"
    prompt_lookup: int = 0
    tree_width: int = 2

    def check(self, n_prompts: int) -> None:
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats={self.repeats!r} must be an integer >= 1 (--repeats)")
        bad = [b for b in self.batch_sizes if not isinstance(b, int) or b < 1]
        if bad:
            raise ValueError(f"batch size {bad[0]!r} must be an integer >= 1 (--batch-sizes)")
        if max(self.batch_sizes) > n_prompts:
            raise ValueError(f"batch size {max(self.batch_sizes)} is larger than the {n_prompts} prompts: pass more "
                             f"prompts (--n-prompts, --prompts) or a batch size <= {n_prompts}")


@dataclass
class _Timed:
    """One batch size's alternating runs: each side's median time, every repeat's time, its last run's
    (forwards, answers), and the uncached reference's time (None when not run)."""
    med: dict
    times: dict
    runs: dict
    ref_time: float | None


def bench(lm, prompts: list[str], settings: BenchSettings | None = None, progress=None, other_ar=None,
          externals: dict | None = None) -> list[BenchRow]:
    """Time transformers generate, our AR, MARS and lossless MARS side by side, alternating, per batch size.
    `other_ar`, the same model loaded in another weight format (e.g. dtype="int8"), adds our AR in that format
    to the race and to the choice of the fastest AR, since a user would pick whichever format decodes fastest;
    its answers differ, and the row says by how much. `externals` ({side: another runtime's AR}, e.g.
    "llamacpp": mars_core.tools.llamacpp.LlamaCppAR, "onnxruntime": mars_core.tools.ortgenai.OrtGenAIAR) join at
    batch size 1 as speed references and AR baselines: their weight formats and answers differ, so they are
    compared by time per token."""
    s = settings or BenchSettings()
    clock = pick_clock(s.clock, lm.device)
    ids = [lm.encode(p) for p in prompts]
    s.check(len(ids))
    cfgs = _side_configs(lm, ids[0], s, clock, progress)
    models = {side: lm for side in cfgs}
    if other_ar is not None:
        cfgs["other_ar"], models["other_ar"] = cfgs["ar"], other_ar
    rows, ref_time = [], None
    for bs in s.batch_sizes:
        batches = [ids[i:i + bs] for i in range(0, len(ids), bs)]
        if lm.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(lm.device)
        sides = dict(cfgs)
        if bs == 1:   # other runtimes decode one prompt at a time
            for name, runtime in (externals or {}).items():
                sides[name], models[name] = ExternalGreedy(s.max_new_tokens), runtime
        med, times, runs = _race(models, sides, batches, s.repeats, clock, progress, bs)
        if s.reference and ref_time is None:   # one row at a time whatever the batch: run it once, model warm
            t0 = NOW[clock]()
            reference_generate(lm, ids, cfgs["mars"])
            ref_time = NOW[clock]() - t0
        other = None if other_ar is None else f"ours, {weight_format(other_ar)}"
        row = _row(lm, bs, len(ids), batches, _Timed(med, times, runs, ref_time), cfgs, clock, other)
        _per_token(row, med, runs, {n: r.label for n, r in (externals or {}).items() if n in sides})
        rows.append(row)
    return rows


def _race(models: dict, sides: dict, batches, repeats: int, clock: str, progress, bs: int):
    """Every side warmed up on one batch, then timed over all batches in alternating runs (rotating order:
    mars_core.tools.timing) -> (median time, every repeat's time, the last run's (forwards, answers)) per side.
    Each run takes its own time (it syncs a GPU before it stops its clock)."""
    for side, cfg in sides.items():
        _timed_run(models[side], batches[:1], cfg, clock)
    timed = {side: (lambda m=models[side], c=cfg: _timed_run(m, batches, c, clock)) for side, cfg in sides.items()}
    for _, _, out in alternate(timed, repeats, NOW[clock]):
        if progress:
            progress(f"batch {bs}: " + ", ".join(f"{side} {out[side][-1][0]:.2f}s" for side in sides))
    times = {side: [t for t, _, _ in out[side]] for side in sides}
    runs = {side: out[side][-1][1:] for side in sides}
    return {side: statistics.median(t) for side, t in times.items()}, times, runs


def _side_configs(lm, first_ids: list[int], s: BenchSettings, clock: str, progress) -> dict:
    """{side: how it decodes} for our AR, MARS, lossless MARS (`verify`) and transformers' generate; lossless's
    layout timed first on the first prompt where it is "fastest"."""
    layout, tree_width, verify_block = s.draft_layout, s.tree_width, s.block_size
    if s.verify and layout == "fastest":
        choice = fastest_lossless(lm, first_ids, s.tau, s.block_size, s.criterion, s.prompt_lookup, clock=NOW[clock])
        if progress:
            progress(choice.why)
        layout, tree_width, verify_block = choice.pick.layout, choice.pick.tree_width, choice.pick.block_size
    cfgs = {"ar": DecodeConfig(mode="ar", max_new_tokens=s.max_new_tokens),
            "mars": DecodeConfig(mode="mars", tau=s.tau, block_size=s.block_size, max_new_tokens=s.max_new_tokens,
                                 criterion=s.criterion)}
    if s.verify:
        cfgs["verify"] = DecodeConfig(mode="verify", tau=s.tau, block_size=verify_block,
                                      max_new_tokens=s.max_new_tokens, criterion=s.criterion, draft_layout=layout,
                                      prompt_lookup=s.prompt_lookup, tree_width=tree_width)
    if s.transformers:
        cfgs["transformers"] = HFGreedy(s.max_new_tokens)
    return cfgs


def _per_token(row: BenchRow, med: dict, runs: dict, external_labels: dict) -> None:
    """Fill the row's ms/token of every side and each one's speedup over the fastest AR side per token."""
    for side, (_, res) in runs.items():
        tokens = sum(len(r if isinstance(r, list) else r.token_ids) for r in res)
        row.ms_per_token[side] = 1000 * med[side] / max(1, tokens)
    ar_sides = [s for s in ("ar", "transformers", "other_ar", *external_labels) if s in row.ms_per_token]
    row.fastest_ar_per_token = min(ar_sides, key=row.ms_per_token.get)
    best = row.ms_per_token[row.fastest_ar_per_token]
    row.per_token_speedup = {side: best / ms for side, ms in row.ms_per_token.items()}
    row.external_labels = dict(external_labels)
    ar_tokens = [r.token_ids for r in runs["ar"][1]]
    row.external_agreement = {side: statistics.mean(r == a for r, a in zip(runs[side][1], ar_tokens))
                              for side in external_labels}


def weight_format(lm) -> str:
    """What tells two loads of one model apart: "w8a8", "int8" or the float dtype, and the backend."""
    return f"{lm.weight_format}, {lm.backend}"


def _row(lm, bs: int, n_prompts: int, batches, timed: _Timed, cfgs, clock: str, other=None) -> BenchRow:
    """One batch size's row; `other` labels our AR in another weight format (side "other_ar"), if it ran."""
    med, times, runs, ref_time = timed.med, timed.times, timed.runs, timed.ref_time
    (ar_fwd, ar_res), (mars_fwd, mars_res) = runs["ar"], runs["mars"]
    ar_tokens = [r.token_ids for r in ar_res]
    baselines = {"ours": med["ar"], "transformers": med.get("transformers"), other: med.get("other_ar")}
    fastest = min((name for name, t in baselines.items() if t is not None), key=baselines.get)
    base = baselines[fastest]
    ar_ms, mars_ms = 1000 * med["ar"] / ar_fwd, 1000 * med["mars"] / mars_fwd
    overhead = {side: decoder_overhead(lm, batches, cfgs[side], clock) for side in cfgs
                if side not in ("transformers", "other_ar")}
    row = BenchRow(
        batch_size=bs, prompts=n_prompts,
        tokens_per_forward=statistics.mean(r.tokens_per_forward for r in mars_res),
        ar_time=med["ar"], mars_time=med["mars"], speedup=med["ar"] / med["mars"],
        ar_forward_ms=ar_ms, mars_forward_ms=mars_ms, forward_cost=mars_ms / ar_ms,
        ar_tokens_per_s=sum(map(len, ar_tokens)) / med["ar"],
        mars_tokens_per_s=sum(len(r.token_ids) for r in mars_res) / med["mars"],
        reference_time=ref_time, reference_speedup=(med["ar"] / ref_time) if ref_time else None,
        peak_memory_mb=peak_memory_mb(lm.device), clock=clock,
        fastest_ar=fastest, mars_speedup=base / med["mars"],
        mars_agreement=statistics.mean(r.token_ids == a for r, a in zip(mars_res, ar_tokens)),
        time_ranges={side: [min(t), max(t)] for side, t in times.items()},
        overhead_ms={side: o[0] for side, o in overhead.items()},
        overhead_share={side: o[1] for side, o in overhead.items()},
    )
    if "transformers" in med:
        row.hf_time, row.hf_equals_ar = med["transformers"], runs["transformers"][1] == ar_tokens
    if other is not None:
        row.other_ar_label, row.other_ar_time = other, med["other_ar"]
        row.other_ar_agreement = statistics.mean(r.token_ids == a for r, a in zip(runs["other_ar"][1], ar_tokens))
    if "verify" in med:
        v_fwd, v_res = runs["verify"]
        row.verify_forward_cost = 1000 * med["verify"] / v_fwd / ar_ms
        positions = [r.positions_per_forward for r in v_res if r.positions_per_forward is not None]
        row.verify_positions_per_forward = statistics.mean(positions) if positions else None
        row.verify_time, row.verify_speedup = med["verify"], base / med["verify"]
        row.verify_tokens_per_forward = statistics.mean(r.tokens_per_forward for r in v_res)
        row.verify_equals_ar = [r.token_ids for r in v_res] == ar_tokens
        row.draft_acceptance = draft_acceptance(v_res, cfgs["verify"].block_size)
    return row


def format_table(rows: list[BenchRow]) -> str:
    head = ("batch", "transformers s", "AR s", "MARS s", "tok/fwd", "speedup", "same as AR", "lossless s",
            "lossless tok/fwd", "lossless speedup", "lossless pos/fwd", "lossless fwd cost", "AR ms/fwd", "MARS ms/fwd",
            "fwd cost", "MARS overhead", "no-cache s", "peak MB")
    lines = [" | ".join(head), " | ".join("-" * len(h) for h in head)]
    opt = lambda v, f: "-" if v is None else format(v, f)
    for r in rows:
        lines.append(" | ".join([
            str(r.batch_size), opt(r.hf_time, ".2f") + _spread(r, "transformers"),
            f"{r.ar_time:.2f}" + _spread(r, "ar"),
            f"{r.mars_time:.2f}" + _spread(r, "mars"), f"{r.tokens_per_forward:.2f}", f"{r.mars_speedup:.2f}",
            f"{r.mars_agreement:.0%}", opt(r.verify_time, ".2f") + _spread(r, "verify"),
            opt(r.verify_tokens_per_forward, ".2f"), opt(r.verify_speedup, ".2f"),
            opt(r.verify_positions_per_forward, ".1f"), opt(r.verify_forward_cost, ".2f"),
            f"{r.ar_forward_ms:.1f}", f"{r.mars_forward_ms:.1f}", f"{r.forward_cost:.2f}",
            f"{r.overhead_ms.get('mars', 0):.2f} ms ({r.overhead_share.get('mars', 0):.0%})",
            opt(r.reference_time, ".2f"), f"{r.peak_memory_mb:.0f}",
        ]))
    notes = []
    for r in rows:
        notes.append(f"batch {r.batch_size}: times are {r.clock} seconds; "
                     f"speedups divide the fastest AR ({r.fastest_ar}); "
                     f"transformers == our AR: {r.hf_equals_ar}; lossless == AR: {r.verify_equals_ar}; "
                     "lossless drafts confirmed per slot: "
                     + (", ".join("-" if a is None else f"{a:.0%}" for a in r.draft_acceptance or []) or "-")
                     + ("" if r.other_ar_time is None else
                        f"; AR ({r.other_ar_label}) {r.other_ar_time:.2f}" + _spread(r, "other_ar")
                        + f", its answers equal this AR's in {r.other_ar_agreement:.0%}"))
        notes.append(f"batch {r.batch_size} per token: " + ", ".join(
            f"{side} {ms:.1f} ms ({r.per_token_speedup[side]:.2f}x)" for side, ms in r.ms_per_token.items())
            + f"; x = the fastest AR per token ({r.fastest_ar_per_token}) over each side"
            + "".join(f"; {side} = {label}, its answers equal our AR's in {r.external_agreement[side]:.0%}"
                      for side, label in r.external_labels.items()))
    return "\n".join(lines + notes)


def _spread(r: BenchRow, side: str) -> str:
    return f" ({r.time_ranges[side][0]:.2f}–{r.time_ranges[side][1]:.2f})" if side in r.time_ranges else ""


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
    from mars_core.decode.backend import backend

    if not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows={max_rows!r} must be an integer >= 1 (MARS with B = 4 feeds up to 7)")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r} must be an integer >= 1 (--rounds on the command line)")
    ids = lm.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if len(ids) + max_rows > lm.context_length:
        raise ValueError(f"a prompt of {len(ids)} tokens + {max_rows} rows exceeds the context of {lm.context_length}")
    model, device = lm.net, lm.device
    now = NOW[pick_clock("auto", device)]   # one CPU thread: its CPU time, immune to other processes
    cache = backend(lm).new_cache()
    model(input_ids=torch.tensor([ids], device=device), cache=cache, use_cache=True, logits_to_keep=1)
    past = len(ids)
    kv_valid = torch.ones(1, past, dtype=torch.bool, device=device)

    def forward(r: int) -> float:
        chunk = torch.full((1, r), lm.mask_id, device=device)
        pos = torch.arange(past, past + r, device=device)[None]
        mask = step_attention(kv_valid, torch.ones(1, r, dtype=torch.bool, device=device))
        keep = torch.arange(r - min(r, block_size), r, device=device)
        _sync(device)
        t0 = now()
        model(input_ids=chunk, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=keep)
        _sync(device)
        elapsed = now() - t0
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
                     f"{full.cost:.2f} AR steps, so at {block_size} tokens/forward the speedup is at most "
                     f"{block_size / full.cost:.2f}x.")
    return "\n".join(lines)
