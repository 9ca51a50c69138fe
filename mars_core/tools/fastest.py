"""Which lossless draft layout is fastest for this model on this machine: found by timing, not by a rule.

Every lossless layout writes greedy AR's tokens, so only its speed differs, and which wins depends on the model
(how many of its masks draft well) and on the machine (what a forward over more positions costs: on an AVX2 CPU
every position costs, with AMX a few more are nearly free). So the candidates decode the same prompt a few
times, alternating (mars_core.tools.timing), and the fastest run of each decides. The candidates: all of B's masks a
group (where B > 2), one mask a group, and one mask with runner-up tokens as extra leaves (a tree of width 3).

Used by the app's "fastest on this machine" choice and by the CLI and bench as `--draft-layout fastest`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mars_core.decode.config import DecodeConfig
from mars_core.decode.decoding import generate
from mars_core.tools.timing import Spread, clock_for, time_all

CALIBRATE_TOKENS = 32   # long enough to draft, short enough to wait for
REPEATS = 2


@dataclass(frozen=True)
class LosslessLayout:
    """How the lossless lane drafts: `layout` (mars_core.decode.drafts.LAYOUTS), masks per group + 1 (`block_size`),
    tokens tried per draft slot (`tree_width`, for the tree)."""
    layout: str
    block_size: int
    tree_width: int = 2

    @property
    def label(self) -> str:
        if self.block_size == 2:
            return "one mask a group" if self.layout == "linear" else "one mask + runner-ups"
        return f"all {self.block_size - 1} masks a group" if self.layout == "linear" else \
            f"{self.layout}, B = {self.block_size}"

    def config(self, tau: float, max_new_tokens: int, criterion: str = "prob", prompt_lookup: int = 0) -> DecodeConfig:
        return DecodeConfig(mode="verify", tau=tau, criterion=criterion, block_size=self.block_size,
                            draft_layout=self.layout, tree_width=self.tree_width, prompt_lookup=prompt_lookup,
                            max_new_tokens=max_new_tokens)


def candidates(block_size: int) -> list[LosslessLayout]:
    """The layouts timed for a race of block size B: all of B's masks (B > 2), one mask, one mask + runner-ups."""
    many = [LosslessLayout("linear", block_size)] if block_size > 2 else []
    return many + [LosslessLayout("linear", 2), LosslessLayout("tree", 2, 3)]


@dataclass(frozen=True)
class FastestChoice:
    pick: LosslessLayout
    seconds: dict[LosslessLayout, float]   # each candidate's fastest run
    tokens: int

    @property
    def why(self) -> str:
        timed = ", ".join(f"{c.label} {s * 1000:.0f} ms" for c, s in self.seconds.items())
        return (f"lossless drafts: {self.pick.label}, the fastest here for this model in a timed decode of "
                f"{self.tokens} tokens ({timed})")


def fastest_lossless(lm, prompt_ids: list[int], tau: float, block_size: int, criterion: str = "prob",
                     prompt_lookup: int = 0, clock: Callable[[], float] | None = None) -> FastestChoice:
    """Time every candidate layout decoding `prompt_ids` (CALIBRATE_TOKENS new tokens, REPEATS alternating runs
    each, on the model's clock: mars_core.tools.timing.clock_for) and return the fastest. A choice between layouts,
    not a number to quote: each candidate's fastest run, the one least disturbed, decides."""
    if tau >= 1.0:
        raise ValueError(f"tau {tau} makes every lossless layout draft nothing: pick a layout only for tau < 1")
    layouts = candidates(block_size)
    runs = {c: (lambda c=c: generate(lm, [prompt_ids], c.config(tau, CALIBRATE_TOKENS, criterion, prompt_lookup)))
            for c in layouts}
    times, _ = time_all(runs, REPEATS, clock or clock_for(lm)[0])
    best = {c: Spread.of(times[c]).low for c in layouts}
    return FastestChoice(min(layouts, key=best.__getitem__), best, CALIBRATE_TOKENS)
