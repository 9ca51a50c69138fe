"""How many CPU threads torch should use for decoding.

A decoding step multiplies a handful of rows by every weight; a second thread helps little, and when
another process holds the other core a forward can take many times longer (the threads wait on each other;
docs/experiments/tiny-models.md, "Wall clock: `mars_core bench`").
So "auto" never asks for more threads than there are idle cores, and on a machine of two cores or
fewer it uses one.
"""
from __future__ import annotations

import os
import warnings


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


def machine_cpus() -> int:
    """Logical CPUs of the whole machine (not only those this process may use): no thread count above it helps."""
    return os.cpu_count() or usable_cores()


def check_thread_count(n: int, flag: str = "--threads") -> int:
    """Refuse a count above the machine's CPUs before anything is loaded: torch would try to start that many
    threads and fail far away (a MemoryError blamed on the model's config.json, or a crash)."""
    cpus = machine_cpus()
    if n > cpus:
        raise ValueError(f"{flag} {n} is more than the {cpus} CPUs of this machine (a thread beyond a core only "
                         f"waits): use at most {cpus}, or auto")
    return n


def idle_cores() -> float:
    """Cores not busy with other work, from the 1-minute load average (all cores where it is unknown)."""
    cores = usable_cores()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return float(cores)
    return max(0.0, cores - load)


def auto_threads() -> int:
    cores = usable_cores()
    if cores <= 2:
        return 1
    return max(1, min(cores, int(idle_cores())))


def parse_threads(value) -> int:
    """`--threads` value: "auto" or an integer >= 1; names the value and the fix otherwise."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return auto_threads()
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"--threads {value!r} is not a number: use auto or an integer such as 1") from None
    if n < 1 or str(n) != str(value).strip():
        raise ValueError(f"--threads {value!r} must be an integer >= 1, or auto")
    return check_thread_count(n)


def set_threads(value="auto") -> int:
    """Set torch's thread count from a --threads value; warn when it oversubscribes the idle cores."""
    import torch

    n = parse_threads(value)
    idle = idle_cores()
    if n > 1 and n > idle + 0.5:
        warnings.warn(f"--threads {n} but only ~{idle:.1f} cores are idle: another process will make the threads "
                      "wait on each other (forwards many times slower); use --threads 1 or auto", stacklevel=2)
    torch.set_num_threads(n)
    return n
