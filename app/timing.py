"""The speedup you can quote: the race's decoders timed again after the race, and what the hardware allows.

The streaming race runs each decoder once, interleaved with the others and with page updates, so a few
milliseconds of noise decide a short race. `measure()` therefore times the same decoders again on the
same prompt (the race was their warm-up), by the CPU time of the decoding thread where that is the decoder's
own compute (one torch thread on a CPU; see mars_core.tools.timing), else by the wall clock: alternating (the
order rotates every repeat, so drift on a shared machine hits every lane alike), enough repeats for about
`target_s` of compute or `min_repeats`, whichever is more, but only as many as fit in `budget_s` (a long answer
gets fewer repeats, at least one), and a job waiting for the machine ends them early. Each repeat gives AR time
÷ lane time; the page shows the median with its min–max as the repeats arrive.

The bound is what the model's forward costs allow (mars_core.tools.bench.row_costs: the decoder's cached forward
alone, for 1, 2, ... new positions): AR feeds 1 position per step, a MARS step feeds the tokens it accepted
last time plus the masks, a lossless step AR's last token plus the drafts plus the masks. Over the lane's
steps after the prompt pass,

    bound = (AR forwards − 1) × cost(1) ÷ Σ cost(positions fed)
          = tokens/forward × cost(1) ÷ cost(positions fed, mean over the steps),

tokens/forward here being AR's forwards per lane forward after the prompt pass (the lane's tokens/forward
when the answers are the same), and cost(r) = forward(r) + o: the forward alone from row_costs plus o, the
work a decoding step does outside the forward (cache bookkeeping, the acceptance test, the host sync),
measured as AR's timed run per forward minus its forward and taken to be the same for every lane. On a tiny
model o is a large share of a step, which is why a step feeding 7 positions costs far less than 7 AR steps.
The prompt pass, the same for every lane, is left out, which pulls a real speedup below the bound; a MARS
step's extra bookkeeping (B candidates to test) pulls it down too. Above the bound means noise.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

from mars_core.tools.timing import alternate, clock_for  # noqa: F401  (clock_for: the race's lanes and tests)

TARGET_S = 1.0       # about a second of compute ...
MIN_REPEATS = 5      # ... or five repeats, whichever is more
MAX_REPEATS = 40
BUDGET_S = 10.0      # ... but no more repeats than fit in this: a class waits for the quotable number
ROW_COST_TARGET_S = 1.0   # time for the row-cost measurement (rounds adapt to the forward's cost)


@dataclass
class Measurement:
    lane: str
    repeats: int
    ratios: list[float]          # AR time ÷ lane time, one per repeat
    ar_times: list[float]
    lane_times: list[float]
    bound: float | None          # None until the forward costs are measured (or when the timing gave way)
    forward_ratio: float         # AR forwards after the prompt ÷ lane forwards after the prompt
    mean_fed: float              # positions a lane step feeds, mean over its steps after the prompt
    mean_cost: float             # cost(positions fed) ÷ cost(1), mean over those steps
    forward_ratio_label: str = ""
    note: str = ""
    forward_ms: float = 0.0      # AR's forward alone (row_costs, 1 position)
    overhead_ms: float = 0.0     # an AR step's measured time minus that forward: per-step work outside it
    clock: str = "wall clock"    # what the repeats were timed with (clock_for)

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def low(self) -> float:
        return min(self.ratios)

    @property
    def high(self) -> float:
        return max(self.ratios)


class ReplayTau:
    """A TauControl stand-in that replays the τ of each step of a race (the decoder reads it once a step)."""

    def __init__(self, taus: list[float]):
        self.taus, self.i = list(taus) or [1.0], 0

    @property
    def value(self) -> float:
        v = self.taus[min(self.i, len(self.taus) - 1)]
        self.i += 1
        return v


def repeats_for(round_s: float, target_s: float = TARGET_S, min_repeats: int = MIN_REPEATS,
                max_repeats: int = MAX_REPEATS) -> int:
    """Enough repeats for about `target_s` of compute, at least `min_repeats` (each repeat runs every lane once)."""
    if not round_s > 0 or not math.isfinite(round_s):
        return min_repeats
    return max(min_repeats, min(max_repeats, math.ceil(target_s / round_s)))


def row_cost_table(lm, prompt_ids: list[int], max_rows: int, block_size: int, est_forward_s: float) -> dict[int, float]:
    """{positions: seconds} of one cached forward (median), from mars_core.tools.bench.row_costs."""
    from mars_core.tools.bench import row_costs
    per_round = max(1e-4, est_forward_s) * max_rows
    rounds = max(10, min(40, int(ROW_COST_TARGET_S / per_round)))
    max_rows = max(1, min(max_rows, lm.context_length - len(prompt_ids)))
    return {r.rows: r.forward_ms / 1000 for r in row_costs(lm, prompt_ids, max_rows=max_rows,
                                                         block_size=block_size, rounds=rounds)}


def bound(ar_forwards: int, fed: list[int], cost_ar1: float, costs: dict[int, float],
          overhead: float = 0.0) -> tuple[float, float, float, float]:
    """(bound, forward ratio, mean positions fed, mean relative cost) of a lane; see the module docstring.
    A step costs its forward (`costs`, `cost_ar1` for AR's) plus `overhead` seconds of work outside it."""
    if not fed or ar_forwards < 2:
        return 1.0, 1.0, 1.0, 1.0
    top = max(costs)
    ar1 = cost_ar1 + overhead
    total = sum(costs[min(max(1, f), top)] + overhead for f in fed)
    forward_ratio = (ar_forwards - 1) / len(fed)
    mean_cost = total / len(fed) / ar1
    return (ar_forwards - 1) * ar1 / total, forward_ratio, sum(fed) / len(fed), mean_cost


def repeats_within(round_s: float, budget_s: float = BUDGET_S, target_s: float = TARGET_S,
                   min_repeats: int = MIN_REPEATS) -> int:
    """repeats_for, cut to what fits in `budget_s` (at least one): the timing must not keep a class waiting."""
    wanted = repeats_for(round_s, target_s, min_repeats)
    if not round_s > 0 or not math.isfinite(round_s):
        return wanted
    return max(1, min(wanted, int(budget_s // round_s)))


def _ratios(times: dict[str, list[float]], lane: str) -> list[float]:
    return [a / t for a, t in zip(times["ar"], times[lane]) if t > 0]


def _so_far(runs, times: dict[str, list[float]], clock_name: str) -> dict[str, Measurement]:
    """The lanes' measurements after the repeats done so far, before the bound is known."""
    return {n: Measurement(n, len(times[n]), _ratios(times, n), list(times["ar"]), list(times[n]), None, 0.0, 0.0,
                           0.0, clock=clock_name)
            for n in runs if n != "ar" and _ratios(times, n)}


def measure_iter(lanes: dict, runs: dict[str, Callable[[], object]], ar_lm, lane_lm, prompt_ids: list[int],
                 block_size: int, target_s: float = TARGET_S, min_repeats: int = MIN_REPEATS,
                 budget_s: float = BUDGET_S, stop: Callable[[], bool] | None = None):
    """Time the lanes again and bound each MARS lane: a generator of (progress line, {lane: Measurement so far})
    whose return value is {lane: Measurement}. `lanes` maps lane -> its SideRecord from the race (its steps,
    and the time of one round); `runs` maps lane -> a function decoding the prompt once ("ar" among them).
    The repeats fit in about `budget_s`; `stop()`, asked after each repeat, ends them early (a new job is
    waiting): the measurements then have the repeats done and no bound."""
    # a slowed race's own times are cold (app.generate.warm_costs): its warm costs size the repeats instead
    round_s = sum(lanes[n].round_time for n in runs)
    repeats = repeats_within(round_s, budget_s, target_s, min_repeats)
    times, results = {n: [] for n in runs}, {}
    clock, clock_name = clock_for(lane_lm)
    if ar_lm is not lane_lm and clock_for(ar_lm)[1] != clock_name:
        clock, clock_name = time.perf_counter, "wall clock"
    for done, times, results in alternate(runs, repeats, clock):
        partial = _so_far(runs, times, clock_name)
        if stop is not None and stop():
            cut = f"timed {done} of {repeats} times only" if done < repeats else "the bound was not measured"
            for m in partial.values():
                m.note = f"{cut}: a new job was waiting, so the timing gave way"
            return partial
        yield (f"◔ timing again: repeat {done} of {repeats} (the decoders alternating; about {round_s * repeats:.0f} s "
               f"in all)"), partial
    yield "◔ measuring the forward costs for the bound …", _so_far(runs, times, clock_name)
    return _bounded(lanes, runs, ar_lm, lane_lm, prompt_ids, block_size, times, results, clock_name)


def _bounded(lanes, runs, ar_lm, lane_lm, prompt_ids, block_size, times, results, clock_name):
    """The finished measurements: each MARS lane's ratios with its bound (see the module docstring)."""
    ar = lanes["ar"]
    ar_steps = [s.step_time for s in ar.steps[1:]] or [s.step_time for s in ar.steps]
    est = statistics.median(ar_steps) if ar_steps else 0.01
    max_fed = max([f for n in runs if n != "ar" for f in lanes[n].positions_fed()] or [1])
    costs = row_cost_table(lane_lm, prompt_ids, max(max_fed, 2 * block_size - 1), block_size, est)
    cost_ar1 = costs[1] if ar_lm is lane_lm else row_cost_table(ar_lm, prompt_ids, 1, 1, est)[1]
    # the part of a decoding step outside the model forward (cache bookkeeping, the acceptance test, the host
    # sync, the decoding loop): AR's timed run per forward, on the same clock, minus its forward alone; taken
    # to be the same for every lane (the lanes' own times are not used: the bound stays a prediction)
    overhead = max(0.0, statistics.median(times["ar"]) / max(1, ar.forwards) - cost_ar1) if times.get("ar") else 0.0
    out = {}
    for n in runs:
        if n == "ar":
            continue
        side = lanes[n]
        b, fr, fed, mc = bound(ar.forwards, side.positions_fed(), cost_ar1, costs, overhead)
        label = ("" if side.token_strings == ar.token_strings
                 else "the answers differ: a ratio of different work")
        if ar_lm is not lane_lm:
            label = (label + "; " if label else "") + "AR is another model: cost(1) is its own forward"
        again = [list(res[0].token_ids) for res in results.get(n, []) if res and hasattr(res[0], "token_ids")]
        note = ("" if all(ids == side.token_ids for ids in again) else
                "the timed runs wrote another answer than the race's (the race moved τ or sampled differently)")
        out[n] = Measurement(n, len(times[n]), _ratios(times, n), times["ar"], times[n], b, fr, fed, mc, label,
                             note, forward_ms=1000 * cost_ar1, overhead_ms=1000 * overhead, clock=clock_name)
    return out


def measure(*args, **kwargs) -> dict[str, Measurement]:
    """measure_iter without the progress lines."""
    gen = measure_iter(*args, **kwargs)
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value
