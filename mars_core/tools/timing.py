"""One timing harness for every side-by-side number: bench, evaluation, the app's race and its lossless choice.

The rules, each for a reason:
- Alternate: every repeat runs every contestant once, and the order rotates each repeat, so slow drift of a
  shared machine (another process, frequency changes) hits every contestant alike.
- Warm up first: the first call of a decoder pays for allocations and kernel choices the others do not.
- Report the median with its min–max: one interrupted run moves a mean, not a median, and the spread says how
  far to trust it.
- The clock: with the model on a CPU and one torch thread, every operation runs on the calling thread, so that
  thread's CPU time is the decoding's own work and leaves out the turns the OS gave other processes (which the
  wall clock counts). With several threads or a GPU only the wall clock sees all the work.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator

CLOCKS = ("auto", "wall", "thread")
NOW: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}
CLOCK_NAMES = {"wall": "wall clock", "thread": "CPU time of the decoding thread"}


def _one_cpu_thread(device) -> bool:
    import torch
    return device is not None and device.type == "cpu" and torch.get_num_threads() == 1


def pick_clock(clock: str, device) -> str:
    """"thread" (this thread's CPU time) when the model runs on one CPU thread, else "wall" (for "auto");
    "thread" asked for where it would miss work is refused."""
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r} is unknown: use auto, wall or thread")
    if clock == "auto":
        return "thread" if _one_cpu_thread(device) else "wall"
    if clock == "thread" and not _one_cpu_thread(device):
        raise ValueError("clock='thread' needs the model on the CPU with one torch thread (--threads 1): "
                         "use --clock wall")
    return clock


def clock_for(lm) -> tuple[Callable[[], float], str]:
    """(clock, what it measures) for a loaded model, by the "auto" rule."""
    name = pick_clock("auto", getattr(lm, "device", None))
    return NOW[name], CLOCK_NAMES[name]


def alternate(runs: dict[str, Callable[[], object]], repeats: int, clock: Callable[[], float] = time.perf_counter,
              warmup: bool = False) -> Iterator[tuple[int, dict[str, list[float]], dict[str, list[object]]]]:
    """Time each run `repeats` times, the order rotating every repeat (with `warmup`, each runs once untimed
    first). Yields (repeats done, {name: seconds so far}, {name: what each run returned}) after every repeat, so
    a caller can show progress or stop between repeats; nothing else runs while a repeat is timed."""
    names = list(runs)
    if warmup:
        for n in names:
            runs[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    results: dict[str, list[object]] = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names):] + names[: r % len(names)]:
            t0 = clock()
            out = runs[n]()
            times[n].append(clock() - t0)
            results[n].append(out)
        yield r + 1, times, results


def time_all(runs: dict[str, Callable[[], object]], repeats: int, clock: Callable[[], float] = time.perf_counter,
             warmup: bool = False) -> tuple[dict[str, list[float]], dict[str, list[object]]]:
    """`alternate` run to the end: ({name: seconds per repeat}, {name: results})."""
    times: dict[str, list[float]] = {n: [] for n in runs}
    results: dict[str, list[object]] = {n: [] for n in runs}
    for _, times, results in alternate(runs, repeats, clock, warmup):
        pass
    return times, results


@dataclass(frozen=True)
class Spread:
    """The median of some repeated measurements with their min and max."""
    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        if not values:
            raise ValueError("no measurements to summarise: time at least one repeat")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def text(self, fmt: str = ".2f", unit: str = "") -> str:
        return f"{self.median:{fmt}}{unit} (min {self.low:{fmt}} – max {self.high:{fmt}}, {self.n} runs)"
