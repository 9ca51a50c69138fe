"""What a decode yields: `RowStep` (one sequence in one forward), `StepEvent` (one forward of the batch),
`SequenceResult` (one sequence, folded from the events by mars_core.decode.decoding.collect)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RowStep:
    """What one sequence did in one forward pass."""
    accepted_ids: list[int]
    candidates: list[int]
    confidences: list[float]
    n_accepted: int
    done: bool
    active: bool
    tokenizer: object = field(default=None, repr=False)
    finish_reason: str | None = None   # eos | length | stop, on the step that finished the row
    # verify mode only: `candidates`/`confidences` are the mask proposals, and
    drafts: list[int] = field(default_factory=list)   # the ones kept as drafts, checked by the next forward
    confirmed: int = 0                # how many of the previous step's drafts equal AR's token (now committed)
    rejected: int | None = None       # the first previous draft that did not; accepted_ids[confirmed] replaced it
    draft_source: str | None = None   # where `drafts` came from: "masks" or "prompt" (prompt lookup)
    leaves: list[int] = field(default_factory=list)   # tree layout: alternatives to the drafts, checked next forward
    leaf_confirmed: bool = False      # tree layout: a previous leaf held AR's token where `rejected` did not (it is
                                      # the last of the `confirmed`, and AR's token after it is committed too)

    @property
    def text(self) -> str:
        if not self.accepted_ids or self.tokenizer is None:
            return ""
        return self.tokenizer.decode(self.accepted_ids, skip_special_tokens=True)


@dataclass
class StepEvent:
    step: int            # 0-based forward index; step 0 also encodes the prompt
    tau: float           # τ used at this step (1.0 in AR mode)
    step_time: float     # seconds of this forward + acceptance
    elapsed: float       # seconds since generation started
    rows: list[RowStep]
    positions: int = 0   # columns this forward fed per row (holes and masks included): what its cost follows


@dataclass
class SequenceResult:
    prompt_ids: list[int]
    token_ids: list[int]          # new tokens, eos counted once
    text: str
    steps: list[list[int]]        # accepted ids per forward
    step_times: list[float]
    wall_time: float              # seconds until this sequence finished
    finish_reason: str            # eos | length | stop
    drafted: list[int] = field(default_factory=list)     # verify mode: drafts proposed per forward
    confirmed: list[int] = field(default_factory=list)   # verify mode: previous drafts confirmed per forward
    positions: list[int] = field(default_factory=list)   # columns fed per forward (StepEvent.positions)
    sources: list = field(default_factory=list)          # verify mode: where each forward's drafts came from

    @property
    def positions_per_forward(self) -> float | None:
        """Mean columns fed by the forwards after the prompt's (what a step's cost follows); None for one forward."""
        return sum(self.positions[1:]) / (len(self.positions) - 1) if len(self.positions) > 1 else None

    @property
    def forwards(self) -> int:
        return len(self.steps)

    @property
    def tokens_per_forward(self) -> float:
        return len(self.token_ids) / max(1, self.forwards)

    def to_dict(self) -> dict:
        return {
            "prompt_ids": self.prompt_ids, "token_ids": self.token_ids, "text": self.text,
            "forwards": self.forwards, "tokens_per_forward": self.tokens_per_forward,
            "steps": self.steps, "step_times": self.step_times, "wall_time": self.wall_time,
            "finish_reason": self.finish_reason, "drafted": self.drafted, "confirmed": self.confirmed,
            "positions": self.positions, "sources": self.sources,
        }
