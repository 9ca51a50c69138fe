"""A race's settings: the page's values by name (`RaceInputs`), checked into what the decoders run
(`RaceSettings`), and the lossless lane's timed "fastest on this machine" layout (mars_core.tools.fastest)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mars_core   # its names load on first use: torch is imported by the first race, not by the page's start

from app import models, timing
from app.inputs import check_criterion, check_flag, check_inputs, check_seed, check_slow_motion
from app.race import LANES
from app.session import PAGES

if TYPE_CHECKING:
    from mars_core import DecodeConfig

# The lossless lane's drafts: where its masks go (mars_core.decode.drafts), and the n-gram length of prompt lookup.
# The "one mask" choices append a single mask per group, whatever B the MARS lane uses: on a CPU, where every
# position a forward feeds costs, what made smollm2-mars's lossless lane fastest
# (docs/experiments/cpu-speed-issue-27.md, "One mask per group"): alone on an AVX2 CPU, with two runner-ups per slot
# where extra positions are cheap (AMX). A model whose masks all draft well (tiny-mars) does better with B.
FASTEST = "fastest"   # the lossless layout a short timed decode finds fastest for this model here (fastest_lossless)
LAYOUT_CHOICES = [("fastest on this machine (timed)", FASTEST),
                  ("masks after the last draft", "linear"), ("masks after every draft", "quadratic"),
                  ("a tree: also runner-up tokens", "tree"), ("one mask a group (most CPUs)", "one-mask"),
                  ("one mask + runner-up tokens (CPUs with AMX)", "one-mask-tree")]
ONE_MASK = {"one-mask": ("linear", 2), "one-mask-tree": ("tree", 3)}   # choice -> (layout, tree width)
LOOKUP_N = 3


@dataclass
class RaceInputs:
    """The Race button's values by name, as the page (or an API client) sends them: unchecked. Only the page's
    wiring (ui._wire_race) spells them out one by one; everything below passes this object."""
    model: object = ""                 # the model picker's choice
    free_text: object = ""             # a run folder, a local folder or a hub id typed instead
    ar_choice: object = models.SAME_MODEL
    prompt: object = ""
    tau: object = 0.9
    tau_off: object = False
    block_size: object = 4
    max_new_tokens: object = 64
    temperature: object = 0.0
    slow_motion: object = 1
    criterion: object = "prob"
    seed: object = 0
    measure_after: object = True
    draft_layout: object = "linear"
    copy_drafts: object = False


def _repeat_clamp_note(session: str, tau: float, notes: list[str]) -> None:
    """Put the τ field's last clamp note first when the race runs at the value it was clamped to."""
    typed = PAGES.clamp_note(session, tau)
    if typed and not any(n.startswith("τ ") for n in notes):
        notes.insert(0, typed)


@dataclass
class RaceSettings:
    """A race's settings as the decoders run them; `notes` says what was clamped or cut on the way."""
    prompt: str
    tau: float
    block_size: int
    max_new_tokens: int
    temperature: float
    seed: int | None = None
    criterion: str = "prob"
    slow_motion: int = 1
    measure_after: bool = True
    notes: list[str] = field(default_factory=list)
    draft_layout: str = "linear"     # the lossless lane's (mars_core.decode.drafts)
    prompt_lookup: int = 0
    one_mask: bool = False           # the lossless lane appends one mask per group (B = 2), whatever block_size
    tree_width: int = 2
    fastest: bool = False            # the lossless layout is picked once the model has loaded (pick_fastest)

    @classmethod
    def from_inputs(cls, given: RaceInputs, session: str = "default") -> RaceSettings:
        """The page's values made runnable (see app.inputs.check_inputs); ValueError for what cannot run."""
        tau_off, measure_after = check_flag(given.tau_off, "τ off"), check_flag(given.measure_after, "then time again")
        copy_drafts = check_flag(given.copy_drafts, "copy drafts from the prompt")
        prompt, tau, block_size, max_new_tokens, temperature, notes = check_inputs(
            given.prompt, given.tau, tau_off, given.block_size, given.max_new_tokens, given.temperature)
        seed = check_seed(given.seed, temperature, notes)
        if not tau_off:
            _repeat_clamp_note(session, tau, notes)
        from mars_core.decode.drafts import LAYOUTS
        draft_layout = given.draft_layout
        if not isinstance(draft_layout, str) or draft_layout not in (FASTEST, *LAYOUTS, *ONE_MASK):
            raise ValueError(f"draft layout {draft_layout!r} is unknown: pick one of "
                             f"{', '.join((FASTEST, *LAYOUTS, *ONE_MASK))}")
        fastest = draft_layout == FASTEST
        if fastest:
            draft_layout = "one-mask"   # until pick_fastest has timed the loaded model
        layout, width = ONE_MASK.get(draft_layout, (draft_layout, 2))
        return cls(prompt, tau, block_size, max_new_tokens, temperature, seed,
                   slow_motion=check_slow_motion(given.slow_motion), criterion=check_criterion(given.criterion),
                   measure_after=bool(measure_after), notes=notes, draft_layout=layout,
                   prompt_lookup=LOOKUP_N if copy_drafts else 0, one_mask=draft_layout in ONE_MASK,
                   tree_width=width, fastest=fastest)

    def pick_fastest(self, lm, name: str) -> str | None:
        """For the "fastest" choice: the layout fastest_lossless finds for `lm` at this race's B and τ; returns
        the line that says which and why (None where there is nothing to choose)."""
        if not self.fastest or self.tau >= 1.0:
            return None
        (layout, block, width), why = fastest_lossless(lm, name, self.tau, self.block_size, self.criterion,
                                                       self.prompt_lookup)
        self.draft_layout, self.tree_width, self.one_mask = layout, width, block == 2
        return why

    @property
    def lanes(self) -> list[str]:
        """The lanes that race, in the page's order: lossless MARS reproduces greedy AR, so not when sampling."""
        return [n for n in LANES if n != "verify" or self.temperature <= 0]

    def config(self, lane: str) -> DecodeConfig:
        common = dict(block_size=self.block_size, max_new_tokens=self.max_new_tokens)
        if lane == "ar":
            return mars_core.DecodeConfig(mode="ar", tau=1.0, temperature=self.temperature, seed=self.seed, **common)
        if lane == "verify":
            if self.one_mask:
                common["block_size"] = 2
            return mars_core.DecodeConfig(mode="verify", tau=self.tau, criterion=self.criterion,
                                          draft_layout=self.draft_layout, tree_width=self.tree_width,
                                          prompt_lookup=self.prompt_lookup, **common)
        return mars_core.DecodeConfig(mode="mars", tau=self.tau, temperature=self.temperature, seed=self.seed,
                                      criterion=self.criterion, **common)


_fastest_lock = threading.Lock()
_fastest: dict[tuple, tuple[object, tuple, str]] = {}   # (id(lm), B, τ, ...) -> (lm, (layout, B, width), why)


def lossless_candidates(block_size: int) -> list[tuple[str, int, int]]:
    """(layout, B, tree width) of the lossless lanes "fastest" times (mars_core.tools.fastest.candidates)."""
    from mars_core.tools.fastest import candidates
    return [(c.layout, c.block_size, c.tree_width) for c in candidates(block_size)]


def fastest_lossless(lm, name: str, tau: float, block_size: int, criterion: str = "prob",
                     prompt_lookup: int = 0) -> tuple[tuple[str, int, int], str]:
    """The lossless layout that decodes the model's first example prompt fastest here (mars_core.tools.fastest, on the
    race's clock), and the line that says why; timed once per model and setting."""
    key = (id(lm), block_size, round(tau, 3), criterion, prompt_lookup)
    with _fastest_lock:
        hit = _fastest.get(key)
        if hit is not None and hit[0] is lm:
            return hit[1], hit[2]
    from mars_core.tools.fastest import fastest_lossless as time_layouts
    prompt_ids = lm.encode(models.example_prompts(name, 1)[0])
    choice = time_layouts(lm, prompt_ids, tau, block_size, criterion, prompt_lookup, clock=timing.clock_for(lm)[0])
    pick = (choice.pick.layout, choice.pick.block_size, choice.pick.tree_width)
    with _fastest_lock:
        _fastest[key] = (lm, pick, choice.why)
    return pick, choice.why


