"""The race: MARS and the AR baseline share the machine, least compute runs next.

No model logic lives here. `race()` only decides *which* decoder runs its next
forward pass (the one that has spent less compute so far, measured by the
decoder's own `step_time`), so each text grows at its measured relative speed.
`SideRecord` keeps what the page shows about one side, and the `render_*`
functions turn it into HTML (chunks, ledger, stats). Events come from
`mars_core.generate_stream` (one StepEvent per forward pass, one prompt = row 0).
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Callable, Iterator

# Colour of a chunk by how many tokens its forward pass accepted (1 = plain AR step).
# A ramp: grey (plain AR step) → yellow → green; the greener, the more tokens that pass accepted.
CHUNK_COLOURS = {1: "#e5e7eb", 2: "#fef08a", 3: "#bef264", 4: "#4ade80", 5: "#34d399"}
CHUNK_COLOUR_MORE = "#2dd4bf"  # 6 or more tokens in one forward


def chunk_colour(n: int) -> str:
    return CHUNK_COLOURS.get(n, CHUNK_COLOUR_MORE)


def race(mars_events: Iterator, ar_events: Iterator) -> Iterator[tuple[str, object]]:
    """Yield ("mars" | "ar", event), running next the side with less compute so far.

    Pulling from a generator is what runs its forward pass, so this scheduler is
    the whole fairness argument: compute spent is the sum of each side's
    `step_time`; ties go to MARS. When one side ends the other runs alone.
    """
    sides = {"mars": mars_events, "ar": ar_events}
    spent = {"mars": 0.0, "ar": 0.0}
    live = ["mars", "ar"]
    while live:
        name = min(live, key=lambda s: (spent[s], s != "mars"))
        try:
            event = next(sides[name])
        except StopIteration:
            live.remove(name)
            continue
        spent[name] += float(event.step_time)
        yield name, event
        if all(not r.active or r.done for r in event.rows):
            live.remove(name)


@dataclass
class StepRecord:
    """One forward pass of one side, as the page shows it."""
    step: int
    tau: float
    step_time: float
    tokens: list[str]          # accepted tokens, one display string each
    token_ids: list[int]
    candidates: list[str]      # all candidates of this pass (B in mars mode, 1 in ar mode)
    candidate_ids: list[int]
    confidences: list[float]
    n_accepted: int
    text: str                  # decoded accepted ids (what is appended to the output)
    done: bool
    finish_reason: str | None = None   # eos | length | stop on the pass that ended the run


@dataclass
class SideRecord:
    """Everything one side of the race has produced so far."""
    label: str
    mode: str                  # "mars" | "ar"
    steps: list[StepRecord] = field(default_factory=list)
    finished: bool = False

    def add(self, event, token_text: Callable[[int], str]) -> None:
        row = event.rows[0]
        if not row.active:
            self.finished = True
            return
        self.steps.append(StepRecord(
            step=int(event.step), tau=float(event.tau), step_time=float(event.step_time),
            tokens=[token_text(t) for t in row.accepted_ids], token_ids=list(row.accepted_ids),
            candidates=[token_text(t) for t in row.candidates], candidate_ids=list(row.candidates),
            confidences=[float(c) for c in row.confidences], n_accepted=int(row.n_accepted),
            text=row.text, done=bool(row.done), finish_reason=getattr(row, "finish_reason", None)))
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


STAT_DEFINITIONS = (
    "**forwards** — forward passes of the model, the first (prompt) pass included. "
    "**tokens** — new tokens, end-of-turn counted once. "
    "**tokens/forward** — tokens ÷ forwards (the ceiling of any speedup). "
    "**time** — this side's own compute: the sum of its measured forward-pass times (the two sides take turns on the CPU). "
    "**tokens/s** — tokens ÷ time. "
    "**speedup ×** — MARS tokens/s ÷ AR tokens/s (= AR time ÷ MARS time when both answers have the same length). "
    "tokens/forward is its ceiling; the cost of one MARS forward relative to one AR forward decides how close it gets."
)


def speedup(mars: SideRecord, ar: SideRecord) -> tuple[float | None, str]:
    """(MARS tokens/s ÷ AR tokens/s, how). Equal to AR time ÷ MARS time when both wrote the same
    number of tokens; unlike the time ratio it stays honest when the two answers differ in length."""
    if mars.tokens_per_s > 0 and ar.tokens_per_s > 0:
        how = "MARS tokens/s ÷ AR tokens/s" + ("" if mars.finished and ar.finished else " (so far)")
        return mars.tokens_per_s / ar.tokens_per_s, how
    return None, ""


def _esc(s: str) -> str:
    return html.escape(s, quote=True)


def _visible(tok: str) -> str:
    """Token text for a tooltip: whitespace made visible."""
    return tok.replace("\n", "⏎").replace(" ", "␣") or "∅"


def render_chunks(side: SideRecord, placeholder: str = "") -> str:
    """The output text, one highlighted span per forward pass; hover = step + per-token confidence.

    A marker is inserted wherever τ differs from the previous pass (τ moved mid-generation).
    """
    parts = []
    prev_tau = None
    for s in side.steps:
        if side.mode == "mars" and prev_tau is not None and abs(s.tau - prev_tau) > 1e-9:
            parts.append(f'<span class="tau-mark" title="τ changed before step {s.step}">'
                         f'τ→{_tau_text(s.tau)}</span>')
        prev_tau = s.tau
        tips = [f"step {s.step} · {s.n_accepted} token{'s' if s.n_accepted != 1 else ''} · τ={_tau_text(s.tau)}"]
        for k, tok in enumerate(s.tokens):
            conf = s.confidences[k] if k < len(s.confidences) else float("nan")
            tips.append(f"  {_visible(tok)}  conf {conf:.3f}")
        parts.append(f'<span class="chunk n{min(s.n_accepted, 6)}" data-step="{s.step}" '
                     f'data-n="{s.n_accepted}" style="background:{chunk_colour(s.n_accepted)}" '
                     f'title="{_esc(chr(10).join(tips))}">{_esc(s.text)}</span>')
    body = "".join(parts) or f'<span class="placeholder">{_esc(placeholder)}</span>'
    cursor = "" if side.finished or not side.steps else '<span class="cursor">▍</span>'
    return f'<div class="race-text" data-side="{side.mode}">{body}{cursor}</div>'


def _tau_text(tau: float) -> str:
    return "off" if tau >= 1.0 else f"{tau:.2f}"


def render_stats(mars: SideRecord, ar: SideRecord, ar_label: str = "AR") -> str:
    sp, how = speedup(mars, ar)
    rows = [
        ("forwards", "forwards", f"{mars.forwards}", f"{ar.forwards}"),
        ("tokens", "tokens", f"{mars.n_tokens}", f"{ar.n_tokens}"),
        ("tpf", "tokens/forward", f"{mars.tokens_per_forward:.2f}", f"{ar.tokens_per_forward:.2f}"),
        ("tps", "tokens/s", f"{mars.tokens_per_s:.1f}", f"{ar.tokens_per_s:.1f}"),
        ("time", "time (s)", f"{mars.compute_time:.2f}", f"{ar.compute_time:.2f}"),
        ("status", "status", "done" if mars.finished else ("running" if mars.steps else "waiting"),
         "done" if ar.finished else ("running" if ar.steps else "waiting")),
    ]
    body = "".join(f"<tr><th>{label}</th><td class='stat-{key}-mars'>{m}</td><td class='stat-{key}-ar'>{a}</td></tr>"
                   for key, label, m, a in rows)
    sp_text = f"{sp:.2f}×" if sp is not None else "—"
    return (f'<table class="stats"><thead><tr><th></th><th>MARS</th><th>{_esc(ar_label)}</th></tr></thead>'
            f'<tbody>{body}</tbody></table>'
            f'<div class="speedup">speedup <b id="speedup-value">{sp_text}</b>'
            f'<span class="how">{_esc(how)}</span></div>')


_FINISH = {"eos": "the model ended its turn (end-of-turn token accepted)",
           "length": "max new tokens reached", "stop": "a stop string appeared"}


def stop_reason(s: StepRecord) -> str:
    """Why this pass accepted exactly n_accepted of its candidates (docs/algorithm.md, "Decoding", step 4)."""
    n, B = s.n_accepted, len(s.candidates)
    if B == 1:
        why = "one-token mode: the AR token t0 is always accepted, nothing else is proposed"
    elif n < B and s.confidences[n] < s.tau:
        why = (f"candidate t{n} has confidence {s.confidences[n]:.3f} < τ = {_tau_text(s.tau)}: "
               f"it and everything after it are dropped")
    elif n >= B:
        why = f"all {B} candidates reached τ — the block is full"
    else:
        why = f"t{n} reached τ but the pass stopped early"
    if s.done and s.finish_reason:
        why += f"; the run ends here: {_FINISH.get(s.finish_reason, s.finish_reason)}"
    return why


def render_ledger(side: SideRecord, step: int) -> str:
    """The B candidates of one forward pass: confidence, τ, accepted or not, and which one stopped it."""
    if not side.steps:
        return '<div class="ledger placeholder">Generate first — then pick a step to see its candidates.</div>'
    step = max(0, min(int(step), len(side.steps) - 1))
    s = side.steps[step]
    rows = []
    for j, (tok, conf) in enumerate(zip(s.candidates, s.confidences)):
        src = "last committed token" if j == 0 else f"mask {j}"
        if j < s.n_accepted:
            verdict, cls = ("accepted (t₀ is always kept)" if j == 0 else "accepted: conf ≥ τ"), "acc"
        elif j == s.n_accepted:
            verdict, cls = (("rejected: conf < τ — stops this pass" if conf < s.tau
                             else "not used: the run ended first"), "stop")
        else:
            verdict, cls = "not considered (an earlier candidate stopped the pass)", "skip"
        bar = max(0.0, min(1.0, conf))
        rows.append(
            f"<tr class='{cls}'><td>t{j}</td><td>{_esc(src)}</td><td class='tok'>{_esc(_visible(tok))}</td>"
            f"<td><div class='confbar'><div style='width:{bar*100:.1f}%'></div>"
            f"<span class='tauline' style='left:{min(s.tau,1.0)*100:.1f}%'></span></div>{conf:.3f}</td>"
            f"<td>{verdict}</td></tr>")
    return (f"<div class='ledger'><div class='ledger-head'>{_esc(side.label)} · step {s.step} of "
            f"{len(side.steps) - 1} · τ = {_tau_text(s.tau)} · accepted {s.n_accepted} of {len(s.candidates)} · "
            f"{s.step_time * 1000:.1f} ms</div>"
            f"<table><thead><tr><th>slot</th><th>predicted by the output at</th><th>candidate</th>"
            f"<th>confidence (| = τ)</th><th>verdict</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
            f"<div class='why'>Why: {_esc(stop_reason(s))}</div></div>")


def legend_html(block_size: int = 4) -> str:
    items = "".join(f'<span class="chunk" style="background:{chunk_colour(n)}">{n} token{"s" if n > 1 else ""}</span> '
                    for n in range(1, max(2, block_size) + 1))
    return (f'<div class="legend">One highlighted chunk = one forward pass, coloured by how many tokens it '
            f'accepted: {items} <span class="tau-mark">τ→x</span> = τ moved here. Hover a chunk for its step '
            f'and each token\'s confidence.</div>')
