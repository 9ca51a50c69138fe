"""The race: AR, lossless MARS (verify) and lossy MARS share the machine, least compute runs next.

No model logic lives here. `race()` only decides *which* decoder runs its next forward pass (the
one that has spent less compute so far, measured by the decoder's own `step_time`), so each text
grows at its measured relative speed. `SideRecord` keeps what the page shows about one lane, and
`app.render` turns it into HTML (chunks, ledger, stats). Events come from
`mars_core.generate_stream` (one StepEvent per forward pass, one prompt = row 0).

Lanes: "ar" (one token per forward), "verify" (lossless MARS: the masks draft, the next forward
checks the drafts against AR's own greedy token, so the text is exactly AR's) and "mars" (lossy
MARS: candidates with confidence >= τ are kept as they are).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

LANES = ("ar", "verify", "mars")   # the page's order, left to right
LANE_LABELS = {"ar": "AR", "verify": "MARS lossless", "mars": "MARS"}


def race(*streams, **named) -> Iterator[tuple[str, object]]:
    """Yield (lane, event), running next the lane with less compute so far.

    `race(mars_events, ar_events)` races two lanes named "mars" and "ar"; `race(lanes={name: events})`
    races any number, ties going to the earlier name. Pulling from a generator is what runs its forward
    pass, so this scheduler is the whole fairness argument: compute spent is the sum of each lane's
    `step_time`, or of `cost(lane, event)` where one is given (live slow motion: each lane's warm cost, since
    forwards that run after a pause are slowed unevenly). When a lane ends the others run on.
    """
    lanes = named.pop("lanes", None)
    cost = named.pop("cost", None)
    if named:
        raise TypeError(f"race() got unexpected arguments {sorted(named)}")
    if lanes is None:
        if len(streams) != 2:
            raise TypeError("race(mars_events, ar_events) or race(lanes={name: events})")
        lanes = {"mars": streams[0], "ar": streams[1]}
    order = list(lanes)
    spent = {name: 0.0 for name in order}
    live = list(order)
    while live:
        name = min(live, key=lambda s: (spent[s], order.index(s)))
        try:
            event = next(lanes[name])
        except StopIteration:
            live.remove(name)
            continue
        spent[name] += float(event.step_time if cost is None else cost(name, event))
        yield name, event
        if all(not r.active or r.done for r in event.rows):
            live.remove(name)


@dataclass
class WarmCost:
    """A lane's forward time on a warm CPU: its prompt pass and (median) one later pass, in seconds; for a lane
    whose τ the slider moves, also a one-position pass (`one_s`: τ off appends no masks, so it costs AR's)."""
    prompt_s: float
    step_s: float
    one_s: float | None = None

    def of(self, step) -> float:
        """The warm cost of a forward (a StepEvent or StepRecord: anything with its `step` and `positions`)."""
        if step.step == 0:
            return self.prompt_s
        if self.one_s is not None and getattr(step, "positions", 0) == 1:
            return self.one_s
        return self.step_s


@dataclass
class StepRecord:
    """One forward pass of one lane, as the page shows it."""
    step: int
    tau: float
    step_time: float
    tokens: list[str]          # committed tokens, one display string each
    token_ids: list[int]
    candidates: list[str]      # mars: the B candidates (1 in ar mode); verify: the mask proposals
    candidate_ids: list[int]
    confidences: list[float]
    n_accepted: int
    text: str                  # decoded committed ids (what is appended to the output)
    done: bool
    finish_reason: str | None = None   # eos | length | stop on the pass that ended the run
    # verify mode: drafts proposed now (checked at the next pass), previous drafts confirmed, the first rejected
    drafts: list[str] = field(default_factory=list)
    draft_ids: list[int] = field(default_factory=list)
    confirmed: int = 0
    rejected: str | None = None
    rejected_id: int | None = None
    confirmed_text: str = ""   # decoded confirmed drafts (the start of `text`)
    draft_source: str | None = None   # where `drafts` came from: "masks", or "prompt" (prompt lookup)
    leaves: list[str] = field(default_factory=list)   # tree layout: alternatives to the drafts, checked next pass
    leaf_confirmed: bool = False      # tree layout: an alternative held AR's token where a draft did not
    positions: int = 0         # columns this forward fed (StepEvent.positions; 0 when unknown)

    @property
    def drafts_confirmed(self) -> int:
        """Verify mode: how many of the previous step's drafts this pass confirmed. The decoder's `confirmed`
        also counts a tree alternative (leaf) that held AR's token where a draft did not; that one is not a
        draft, and counting it as one once showed "9 of 2 drafts confirmed"."""
        return self.confirmed - int(self.leaf_confirmed)


@dataclass
class SideRecord:
    """Everything one lane of the race has produced so far."""
    label: str
    mode: str                  # "mars" | "verify" | "ar"
    steps: list[StepRecord] = field(default_factory=list)
    finished: bool = False
    note: str = ""             # why the lane did not run (e.g. verify mode is greedy only)
    layout: str = "linear"     # verify: the draft layout (mars_core.decode.drafts)
    slowed: int = 1            # live slow motion's factor: >1 = its forwards ran after pauses, cold, so their
                               # times are not this machine's speed and the page does not quote them
    pace: WarmCost | None = None   # a slowed lane's warm forward costs (app.generate.warm_costs)

    def add(self, event, token_text: Callable[[int], str], decode: Callable[[list[int]], str] | None = None) -> None:
        row = event.rows[0]
        if not row.active:
            self.finished = True
            return
        accepted = list(row.accepted_ids)
        confirmed = int(getattr(row, "confirmed", 0) or 0)
        rejected = getattr(row, "rejected", None)
        drafts = list(getattr(row, "drafts", []) or [])
        confirmed_text = ""
        if self.mode == "verify" and confirmed:
            confirmed_text = (decode(accepted[:confirmed]) if decode
                              else "".join(token_text(t) for t in accepted[:confirmed]))
        self.steps.append(StepRecord(
            step=int(event.step), tau=float(event.tau), step_time=float(event.step_time),
            tokens=[token_text(t) for t in accepted], token_ids=accepted,
            candidates=[token_text(t) for t in row.candidates], candidate_ids=list(row.candidates),
            confidences=[float(c) for c in row.confidences], n_accepted=int(row.n_accepted),
            text=row.text, done=bool(row.done), finish_reason=getattr(row, "finish_reason", None),
            drafts=[token_text(t) for t in drafts], draft_ids=drafts, confirmed=confirmed,
            rejected=None if rejected is None else token_text(rejected), rejected_id=rejected,
            confirmed_text=confirmed_text, draft_source=getattr(row, "draft_source", None),
            leaves=[token_text(t) for t in getattr(row, "leaves", []) or []],
            leaf_confirmed=bool(getattr(row, "leaf_confirmed", False)),
            positions=int(getattr(event, "positions", 0) or 0)))
        self.finished = self.finished or bool(row.done)

    # Measurements (definitions in STAT_DEFINITIONS, from docs/algorithm.md, "Metrics").
    @property
    def forwards(self) -> int:
        return len(self.steps)

    @property
    def n_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.steps)

    @property
    def compute_time(self) -> float:
        return sum(s.step_time for s in self.steps)

    @property
    def round_time(self) -> float:
        """What decoding this answer once takes on a warm CPU: its compute, or for a slowed lane its warm costs."""
        return self.compute_time if self.pace is None else sum(self.pace.of(s) for s in self.steps)

    @property
    def tokens_per_forward(self) -> float:
        return self.n_tokens / self.forwards if self.forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        t = self.compute_time
        return self.n_tokens / t if t > 0 else 0.0

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.steps)

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.steps for t in s.token_ids]

    @property
    def token_strings(self) -> list[str]:
        return [t for s in self.steps for t in s.tokens]

    @property
    def taus(self) -> list[float]:
        return [s.tau for s in self.steps]

    def drafts_checked(self) -> tuple[int, int]:
        """Verify mode: (drafts confirmed, drafts checked). A pass checks the drafts of the pass before it; the
        last pass's drafts are never checked."""
        checked = sum(len(prev.draft_ids) for prev in self.steps[:-1])
        return sum(s.drafts_confirmed for s in self.steps[1:]), checked

    def alternatives_checked(self) -> tuple[int, int]:
        """Tree layout: (alternatives confirmed, alternatives checked): the runner-up tokens fed beside the drafts,
        of which at most one per pass can hold AR's token."""
        checked = sum(len(prev.leaves) for prev in self.steps[:-1])
        return sum(int(s.leaf_confirmed) for s in self.steps[1:]), checked

    def positions_fed(self) -> list[int]:
        """New positions each pass after the first fed to its forward (what its cost depends on).

        What the decoder reports (StepEvent.positions), else: mars: the tokens the previous pass accepted + the
        masks (candidates - 1); verify: AR's last token + the previous drafts + the masks (= the proposals);
        ar: 1. The first pass feeds the prompt.
        """
        fed = []
        for prev, s in zip(self.steps, self.steps[1:]):
            if s.positions:
                fed.append(s.positions)
            elif self.mode == "verify":
                fed.append(1 + len(prev.draft_ids) + len(s.candidate_ids))
            elif self.mode == "mars":
                fed.append(len(prev.token_ids) + max(0, len(s.candidate_ids) - 1))
            else:
                fed.append(1)
        return fed


# ----------------------------------------------------------------------------- equal work
@dataclass
class Comparison:
    """How a lane's answer compares with AR's, token by token."""
    identical: bool
    first_diff: int | None = None      # index of the first differing token
    lane_token: str | None = None      # the lane's token there ("" = its answer ended)
    ar_token: str | None = None
    agree: int = 0                     # aligned tokens equal
    aligned: int = 0                   # aligned positions (difflib)

    @property
    def share(self) -> float:
        return self.agree / self.aligned if self.aligned else 1.0


def compare(lane_tokens: list[str], ar_tokens: list[str]) -> Comparison:
    """Identical or not; if not, the first differing token and the share of aligned tokens that agree."""
    if lane_tokens == ar_tokens:
        return Comparison(True, agree=len(ar_tokens), aligned=len(ar_tokens))
    import difflib
    i = 0
    while i < min(len(lane_tokens), len(ar_tokens)) and lane_tokens[i] == ar_tokens[i]:
        i += 1
    sm = difflib.SequenceMatcher(a=lane_tokens, b=ar_tokens, autojunk=False)
    agree = aligned = 0
    for op, i1, i2, j1, j2 in sm.get_opcodes():
        aligned += max(i2 - i1, j2 - j1)
        agree += (i2 - i1) if op == "equal" else 0
    return Comparison(False, i, lane_tokens[i] if i < len(lane_tokens) else "",
                      ar_tokens[i] if i < len(ar_tokens) else "", agree, aligned)
