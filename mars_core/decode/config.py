"""What a decode is asked for: `DecodeConfig` (mode, τ, block size, sampling, draft layout) and `TauControl`,
a τ the caller may change while a generation runs. Every bad value is refused with its fix."""
from __future__ import annotations

import math
import numbers
import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass

from mars_core.decode.drafts import LAYOUTS

MODES = ("mars", "verify", "ar")   # verify: lossless MARS, the masks draft and the next forward checks
CRITERIA = ("prob", "entropy", "margin")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_tau(tau) -> float:
    """τ must be a positive finite number; τ >= 1 is one-token mode."""
    try:
        value = float(tau)
    except (TypeError, ValueError):
        raise ValueError(f"tau={tau!r} is not a number: use a value in (0, 1), "
                         "or 1.0 for one-token (AR) mode") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"tau={tau!r} is out of range: use a value in (0, 1), or 1.0 for one-token (AR) mode")
    return value


@dataclass
class DecodeConfig:
    """How to decode. Validated on creation; every error names the value and the fix."""
    mode: str = "mars"            # "mars": B candidates per forward; "verify": lossless MARS (the masks draft, the
                                  # next forward checks the drafts against AR); "ar": plain one-token decoding
    tau: float = 0.95             # acceptance threshold (verify: draft threshold); >= 1.0 is one token per step
    block_size: int = 4           # B: candidates per forward pass (q_0 .. q_{B-1})
    max_new_tokens: int = 128     # hard cap on new tokens per sequence (eos included)
    temperature: float = 0.0      # 0 = greedy; > 0 samples every candidate at this temperature
    top_p: float = 1.0            # nucleus sampling mass, with temperature > 0
    seed: int | None = None       # seed for sampling
    criterion: str = "prob"       # confidence: prob = p(t); entropy = exp(-H(q)); margin = p1 - p2
    max_accept: int | None = None  # optional cap on tokens accepted per forward
    stop_strings: tuple[str, ...] = ()  # stop once the decoded text contains one of these
    draft_layout: str = "linear"  # verify: "linear" (masks after the last draft), "quadratic" (after every one), "tree"
    tree_width: int = 2           # tree layout: candidates tried per draft slot (the draft and tree_width - 1 more)
    row_costs: tuple | None = None  # auto layout: relative forward cost by positions fed (bench.row_costs); None: free
    prompt_lookup: int = 0        # verify: also draft what followed the last 1..n tokens earlier in the text; 0 = off

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check every field (also called by the decoder, so a config changed after creation is checked too)."""
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is unknown: use 'mars', 'verify' or 'ar'")
        self.tau = check_tau(self.tau)
        for name in ("block_size", "max_new_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1"
                                 + (" (the paper uses 4)" if name == "block_size" else ""))
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be a number in (0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r} must be an integer or None")
        if self.criterion not in CRITERIA:
            raise ValueError(f"criterion={self.criterion!r} is unknown: use one of {', '.join(CRITERIA)}")
        if self.max_accept is not None and (not _is_int(self.max_accept) or self.max_accept < 1):
            raise ValueError(f"max_accept={self.max_accept!r} must be None or an integer >= 1")
        if self.mode == "verify" and self.temperature > 0:
            raise ValueError(f"temperature={self.temperature!r} with mode='verify': verify mode reproduces greedy AR, "
                             "so use temperature=0 (or mode='mars' to sample)")
        if isinstance(self.stop_strings, str):
            self.stop_strings = (self.stop_strings,)
        if not all(isinstance(s, str) for s in self.stop_strings):
            raise ValueError(f"stop_strings={self.stop_strings!r} must be strings")
        self.stop_strings = tuple(s for s in self.stop_strings if s)
        if self.draft_layout not in LAYOUTS:
            raise ValueError(f"draft_layout={self.draft_layout!r} is unknown: use one of {', '.join(LAYOUTS)}")
        if not _is_int(self.tree_width) or self.tree_width < 1:
            raise ValueError(f"tree_width={self.tree_width!r} must be an integer >= 1 (candidates tried per slot; "
                             "1 = no alternatives)")
        if self.row_costs is not None:
            if isinstance(self.row_costs, (str, bytes)) or not all(
                    _is_number(c) and math.isfinite(c) and c > 0 for c in self.row_costs) or not self.row_costs:
                raise ValueError(f"row_costs={self.row_costs!r} must be positive numbers, the relative cost of a "
                                 "forward over 1, 2, ... positions (as bench --row-costs prints), or None")
            self.row_costs = tuple(float(c) for c in self.row_costs)
        if not _is_int(self.prompt_lookup) or self.prompt_lookup < 0:
            raise ValueError(f"prompt_lookup={self.prompt_lookup!r} must be an integer >= 0 (the longest n-gram to "
                             "look up; 0 = off, 3 is a good start)")
        if self.mode != "verify" and (self.draft_layout != "linear" or self.prompt_lookup):
            what = f"draft_layout={self.draft_layout!r}" if self.draft_layout != "linear" else \
                f"prompt_lookup={self.prompt_lookup!r}"
            raise ValueError(f"{what} with mode={self.mode!r}: drafts exist only in lossless MARS, so use "
                             "mode='verify' (or leave the default)")

    @property
    def candidates(self) -> int:
        """Candidates per forward at most: B in MARS and verify mode, 1 in AR mode."""
        return 1 if self.mode == "ar" else self.block_size


class TauControl:
    """A τ the caller may change while a generation runs; the decoder reads it at every step."""

    def __init__(self, value: float):
        self.value = value

    @property
    def value(self) -> float:
        return self._value

    @value.setter
    def value(self, tau) -> None:
        self._value = tau

    def __setattr__(self, name, value) -> None:
        if name == "_value":   # the stored field too: nothing reaches the decoder past check_tau
            value = check_tau(value)
        super().__setattr__(name, value)


# ----------------------------------------------------------------------------- stopping (shared by every CLI)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like SIGINT's KeyboardInterrupt so that one `except KeyboardInterrupt` stops cleanly on both."""


@contextmanager
def sigterm_as_interrupt():
    """Within: SIGTERM raises Terminated (a KeyboardInterrupt) instead of killing the process unannounced; the
    previous handler comes back on exit. Only the main thread may set handlers, so elsewhere this does nothing.

    A handler's exception that lands inside a finalizer (a `__del__`, a weakref callback) is printed and dropped by
    Python, so the body would run on and exit 0; the signal is remembered too, and a body that ends normally after
    one raises Terminated on the way out."""
    received = []

    def raise_terminated(signum, frame):
        received.append(signum)
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, raise_terminated)
    except ValueError:   # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
    if received:
        raise Terminated("as the command was finishing: its output is complete")


def interrupt_exit(exc: BaseException, detail: str = "") -> int:
    """Print the one line of a stopped command and give its exit code: 143 for SIGTERM, 130 for SIGINT.
    `detail` (else the exception's own text) says how far it got and how to go on."""
    name, code = ("SIGTERM", 143) if isinstance(exc, Terminated) else ("SIGINT", 130)
    detail = detail or str(exc)
    print(f"interrupted ({name})" + (f" {detail}" if detail else ""), file=sys.stderr, flush=True)
    return code
