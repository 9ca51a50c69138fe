"""`dtype="auto"` on a CPU: the fastest weight format among those in which decoding is exact.

"Exact" means lossless decoding equals AR and a batch equals each row alone, token for token (docs/algorithm.md):
float32, w8a8 (int8 products whose rows are independent, mars_core/engine/w8a8.py) and w8a16 (the same with int16
activation levels, on the AVX2 kernel). bf16 is not offered: its multi-position forwards round differently from
one-position ones, so its lossless answer drifts from its AR answer. w8a8 and w8a16 round the model, so each is a
candidate only for a model whose quality in it was measured and kept (`mars_core.models.formats.W8A8_KEEPS_QUALITY`,
`W8A16_KEEPS_QUALITY`); every other model decodes in float32 without a probe.

With more than one candidate the probe times each format's decoding forward (the backend the decoder will run)
and AR's one-row forward decides, so the AR baseline runs in its own fastest configuration and MARS in the same
one; only when two one-row times are within `TIE` (the probe's own noise) does the cheaper 2B-1-row forward (a
full MARS step) break the tie. Models under `MIN_PARAMS` stay fp32 (their steps are bound by Python overhead,
not by weight reads). The choice is measured once per model file, CPU, torch version and set of candidates, and
cached in `cache_dir()/dtype-probe.json`.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from mars_core.engine.cache import cache_dir

MIN_PARAMS = 50_000_000
ROUNDS = 7
TIE = 0.03        # one-row times this close count as equal
MARS_ROWS = 7     # what a B = 4 step feeds after accepting all four
SLOW = 3.0        # forwards this many times the probe's are not the model's cost: the cores are shared


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


@torch.inference_mode()
def forward_ms(models: dict, rows: tuple[int, ...] = (1, MARS_ROWS), rounds: int = ROUNDS,
               context: int = 32) -> dict:
    """{(name, r): fastest ms} of a cached forward of r new tokens after a `context`-token prefix, the models
    and row counts taking turns every round so drift hits all alike; this thread's CPU time with one torch
    thread, so other processes do not decide the choice."""
    from mars_core.decode.backend import as_backend
    now = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    times = {(name, r): [] for name in models for r in rows}
    for i in range(rounds + 1):   # round 0 warms up
        for name, model in models.items():
            ids = torch.arange(1, context + 1)[None] % model.config.vocab_size
            for r in rows:
                cache = as_backend(model).new_cache()
                model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
                t0 = now()
                model(input_ids=ids[:, -r:], cache=cache, use_cache=True, logits_to_keep=min(r, 4))
                if i:
                    times[(name, r)].append(now() - t0)
    return {k: 1000 * min(v) for k, v in times.items()}   # the least disturbed run: neighbours only add time


def _cache_file() -> Path:
    return cache_dir() / "dtype-probe.json"


def _key(where: str, threads: int | None = None) -> str:
    weights = next((p for p in (Path(where) / "model.safetensors", Path(where)) if p.exists()), Path(where))
    stat = weights.stat() if weights.exists() else None
    stamp = f"{stat.st_size}:{int(stat.st_mtime)}" if stat else "?"
    threads = torch.get_num_threads() if threads is None else threads
    return f"{Path(where).resolve()}|{stamp}|{_cpu_name()}|torch {torch.__version__}|threads {threads}"


def _known() -> dict:
    try:
        known = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def choose_cpu_format(builders: dict, where: str, n_params: int) -> tuple[str, object]:
    """(name, its decoding forward or None) for the fastest of `builders` ({format name: a function that builds
    the decoding forward in that format}, the first one the default) for the model file at `where`. Measured once
    and cached; a single candidate, a model of fewer than MIN_PARAMS parameters or a cached choice builds nothing
    here (None: the caller builds the one it needs)."""
    names = list(builders)
    if len(names) == 1 or n_params < MIN_PARAMS:
        return names[0], None
    path, key = _cache_file(), _key(where)
    known = _known()
    if key in known and known[key].get("candidates") == names:   # probed among these very candidates
        return known[key]["dtype"], None
    nets = {name: build() for name, build in builders.items()}
    ms = forward_ms(nets)
    one = {n: ms[(n, 1)] for n in names}
    best = min(one.values())
    close = [n for n in names if one[n] <= best * (1 + TIE)]   # within the probe's noise of the fastest AR step
    choice = min(close, key=lambda n: ms[(n, MARS_ROWS)])
    known = {k: v for k, v in known.items() if Path(k.split("|", 1)[0]).exists()}   # forget deleted models
    known[key] = {"dtype": choice, "candidates": names,
                  **{f"{n}_ms_{r}_rows": round(v, 3) for (n, r), v in ms.items()}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass   # a read-only cache only costs the probe again next time
    return choice, nets[choice]


def slow_decoding_warning(lm, step_seconds: list[float], block_size: int = 4) -> str | None:
    """A warning when decoding's forwards ran far slower than this machine's probe of the same model and dtype
    (one thread, quiet), or None: that gap is other processes on the cores or too many torch threads, not the
    model. Steps after the first (the prompt's prefill) are compared, against the probe's time for the most
    positions a step can feed (1 for one-token steps, else 2B - 1), so only a real slowdown warns. A format the
    probe did not time (bf16, int8) is not checked."""
    if lm.device.type != "cpu" or len(step_seconds) < 2:
        return None
    name = lm.weight_format
    entry = _known().get(_key(lm.path, threads=1), {})
    rows = 1 if block_size <= 1 else MARS_ROWS
    probe = entry.get(f"{name}_ms_{rows}_rows")
    if not isinstance(probe, (int, float)) or probe <= 0:
        return None
    ms = 1000 * statistics.median(step_seconds[1:])
    if ms <= SLOW * probe:
        return None
    return (f"warning: a forward took {ms:.0f} ms, {ms / probe:.0f}x this machine's probe of this model "
            f"({probe:.0f} ms, one thread, {name}): other processes are using the cores, "
            f"or --threads {torch.get_num_threads()} oversubscribes them; try --threads 1 or stop the other work")
