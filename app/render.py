"""The race rendered as HTML: each lane's chunks (one per forward pass, coloured by the tokens it committed),
the ledger of any step, the stats table, the speedup lines and the legend. It reads what `app.race` records
(SideRecord, StepRecord) and computes nothing the page does not show."""
from __future__ import annotations

import html

from app.race import LANES, Comparison, SideRecord, StepRecord, compare

# Colour of a chunk by how many tokens its forward pass committed (1 = plain AR step).
# A ramp: grey (plain AR step) → yellow → green; the greener, the more tokens that pass committed.
CHUNK_COLOURS = {1: "#e5e7eb", 2: "#fef08a", 3: "#bef264", 4: "#4ade80", 5: "#34d399"}
CHUNK_COLOUR_MORE = "#2dd4bf"  # 6 or more tokens in one forward

def chunk_colour(n: int) -> str:
    return CHUNK_COLOURS.get(n, CHUNK_COLOUR_MORE)


STAT_DEFINITIONS = (
    "**forwards** — forward passes of the model, the first (prompt) pass included. "
    "**tokens** — new tokens, end-of-turn counted once. "
    "**tokens/forward** — tokens ÷ forwards (the ceiling of any speedup). "
    "**time** — this lane's own compute in the race: the sum of its measured forward-pass times (the lanes take "
    "turns on the machine). "
    "**drafts confirmed** — lossless MARS: the mask proposals kept as drafts that the next forward found equal to "
    "AR's own token, out of the drafts it checked; with tree drafts also the *alternatives* (runner-up tokens "
    "checked beside a draft) that held AR's token where the draft did not. "
    "**speedup ×** — AR time ÷ this lane's time for its whole answer, *measured* after the race by timing the "
    "decoders again on the same prompt (alternating, warmed up; median and min–max; on a CPU by the decoding thread's "
    "CPU time, so other processes' turns on a shared machine do not count). Called a speedup only when the "
    "answer is the same as AR's. The **bound** is what the model's forward costs allow: tokens/forward × cost(1 "
    "position) ÷ cost(positions a step feeds), from forward costs measured right after "
    "(`mars_core.tools.bench.row_costs`)."
)


# The page's words, defined once: the glossary panel lists them and the stats table's labels show them on hover.
GLOSSARY = {
    "token": "a piece of text the model reads and writes: a word, part of a word, a digit or a sign",
    "forward pass": "one run of the model over the new positions; it gives a prediction at every position it reads",
    "mask": "a placeholder token appended after the text; the model predicts the token that belongs in its place",
    "τ (tau)": "the confidence threshold: a mask's guess is kept only while its confidence is at least τ; "
               "τ off (1) keeps none, which is exactly ordinary greedy (AR) decoding",
    "AR": "autoregressive decoding: one token per forward pass, always the model's most likely next token",
    "draft": "lossless MARS: a mask's guess kept for checking; the next forward pass compares it with AR's own "
             "token there and keeps it only if they are equal",
    "lossless": "the answer is exactly AR's: every token is checked against AR's choice before it counts",
    "tokens per forward": "tokens written ÷ forward passes (the prompt's pass included); AR's is 1, and it is "
                          "the ceiling of any speedup",
    "speedup": "AR's time ÷ this lane's time for the same answer, measured again after the race",
    "time ratio": "the same division when the answers differ: a comparison of different work, not a speedup",
}


def glossary_html() -> str:
    """The glossary panel: every word the page uses, one line each."""
    rows = "".join(f"<dt>{_esc(k)}</dt><dd>{_esc(v)}</dd>" for k, v in GLOSSARY.items())
    return f'<dl class="glossary">{rows}</dl>'


def gloss(word: str, text: str | None = None) -> str:
    """`text` (default `word`) with the glossary's definition of `word` on hover."""
    return f'<span class="gloss" title="{_esc(GLOSSARY[word])}">{_esc(text or word)}</span>'


def comparison_html(c: Comparison | None, lane_label: str) -> str:
    if c is None:
        return ""
    if c.identical:
        return f"<span class='same' data-identical='1'>✓ same answer as AR ({c.aligned} tokens)</span>"
    lt = "its answer ends" if c.lane_token == "" else f"{lane_label} {_esc(repr(c.lane_token))}"
    at = "AR's answer ends" if c.ar_token == "" else f"AR {_esc(repr(c.ar_token))}"
    return (f"<span class='differs' data-identical='0' data-first-diff='{c.first_diff}' "
            f"data-agree='{c.share:.4f}'>⚠ different answer: first difference at token {c.first_diff} "
            f"({lt} · {at}); {c.share:.0%} of tokens agree ({c.agree} of {c.aligned} aligned) — "
            f"a time ratio of different work, not a speedup</span>")


def _esc(s: str) -> str:
    return html.escape(s, quote=True)


def _visible(tok: str) -> str:
    """Token text for a tooltip: whitespace made visible."""
    return tok.replace("\n", "⏎").replace(" ", "␣") or "∅"


def _tau_text(tau: float) -> str:
    return "off" if tau >= 1.0 else f"{tau:.2f}"


def tau_summary(taus: list[float]) -> str:
    """'0.90', 'off', or '0.90 → 0.60' when τ moved mid-run (every distinct value in order)."""
    seen = []
    for t in taus:
        if not seen or abs(seen[-1] - t) > 1e-9:
            seen.append(t)
    return " → ".join(_tau_text(t) for t in seen) if seen else ""


# ----------------------------------------------------------------------------- chunks
def _verify_chunk(side: SideRecord, k: int, s: StepRecord) -> str:
    """One verify pass: the confirmed drafts (verified), the rejected drafts struck through, AR's token."""
    prev = side.steps[k - 1] if k > 0 else None
    c, chain = s.confirmed, s.drafts_confirmed
    tips = [f"step {s.step} · τ={_tau_text(s.tau)} · {s.n_accepted} token{'s' if s.n_accepted != 1 else ''} committed"]
    parts = []
    copied = prev is not None and prev.draft_source == "prompt"
    if c:
        what = f"{chain} draft{'s' if chain != 1 else ''}" + (" + 1 alternative" if s.leaf_confirmed else "")
        tips.append(f"  {what} of step {s.step - 1}"
                    + (" (copied from earlier text: prompt lookup)" if copied else "")
                    + " confirmed = AR's own tokens: " + " ".join(_visible(t) for t in s.tokens[:c]))
        parts.append(f'<span class="verified{" from-prompt" if copied else ""}">{_esc(s.confirmed_text)}</span>')
    rest_text = s.text[len(s.confirmed_text):] if s.text.startswith(s.confirmed_text) else s.text
    if prev is not None and s.rejected is not None:
        dropped = prev.drafts[chain:]
        if s.leaf_confirmed:
            tips.append(f"  draft {_visible(s.rejected)} rejected, but an alternative at its depth, "
                        f"{_visible(s.tokens[chain])}, is AR's token: confirmed, and AR's token after it too")
        tips.append(f"  draft {_visible(s.rejected)} rejected: AR's token there is "
                    f"{_visible(s.tokens[c]) if c < len(s.tokens) else '∅'}"
                    + (f"; {len(dropped) - 1} later draft(s) dropped with it" if len(dropped) > 1 else ""))
        parts.append(f'<del class="rejected" title="rejected drafts">{_esc("".join(dropped))}</del>')
        if rest_text:
            parts.append(f'<span class="replacement">{_esc(rest_text)}</span>')
    elif rest_text:
        tips.append(f"  AR's token: {_visible(s.tokens[-1]) if s.tokens else '∅'}")
        parts.append(f'<span class="ar-tok">{_esc(rest_text)}</span>')
    if s.drafts:
        tips.append(f"  new drafts{' copied from earlier text' if s.draft_source == 'prompt' else ''} (checked next "
                    "step): " + " ".join(_visible(t) for t in s.drafts))
    return (f'<span class="chunk n{min(s.n_accepted, 6)}" data-step="{s.step}" data-n="{s.n_accepted}" '
            f'data-ms="{s.step_time * 1000:.3f}" '
            f'data-confirmed="{c}" data-rejected="{0 if s.rejected is None else 1}" '
            f'style="background:{chunk_colour(max(1, s.n_accepted))}" '
            f'title="{_esc(chr(10).join(tips))}">{"".join(parts)}</span>')


def render_chunks(side: SideRecord, placeholder: str = "") -> str:
    """The output text, one highlighted span per forward pass; hover = step + per-token confidence.

    A marker is inserted wherever τ differs from the previous pass (τ moved mid-generation). In the
    lossless lane the confirmed drafts are marked as verified, a rejected draft is struck through before
    AR's replacement, and while the run goes on the drafts awaiting their check trail the cursor.
    """
    parts = []
    prev_tau = None
    for k, s in enumerate(side.steps):
        if side.mode != "ar" and prev_tau is not None and abs(s.tau - prev_tau) > 1e-9:
            parts.append(f'<span class="tau-mark" title="τ changed before step {s.step}">'
                         f'τ→{_tau_text(s.tau)}</span>')
        prev_tau = s.tau
        if side.mode == "verify":
            parts.append(_verify_chunk(side, k, s))
            continue
        tips = [f"step {s.step} · {s.n_accepted} token{'s' if s.n_accepted != 1 else ''} · τ={_tau_text(s.tau)}"]
        for j, tok in enumerate(s.tokens):
            conf = s.confidences[j] if j < len(s.confidences) else float("nan")
            tips.append(f"  {_visible(tok)}  conf {conf:.3f}")
        parts.append(f'<span class="chunk n{min(s.n_accepted, 6)}" data-step="{s.step}" '
                     f'data-n="{s.n_accepted}" data-ms="{s.step_time * 1000:.3f}" '
                     f'style="background:{chunk_colour(s.n_accepted)}" '
                     f'title="{_esc(chr(10).join(tips))}">{_esc(s.text)}</span>')
    if side.note and not side.steps:
        body = f'<span class="placeholder lane-note">{_esc(side.note)}</span>'
    else:
        body = "".join(parts) or f'<span class="placeholder">{_esc(placeholder)}</span>'
    running = not side.finished and side.steps
    cursor = '<span class="cursor">▍</span>' if running else ""
    if running and side.mode == "verify" and side.steps[-1].drafts:
        cursor += (f'<span class="pending-drafts" title="drafts awaiting the next forward\'s check">'
                   f'{_esc("".join(side.steps[-1].drafts))}</span>')
    key = ""
    if side.mode == "verify" and any(s.draft_source == "prompt" for s in side.steps):
        key = ('<div class="lane-key"><span class="verified from-prompt">copied</span> = drafts copied from earlier '
               'text (prompt lookup), confirmed by the next forward</div>')
    finished = "1" if side.finished or (side.note and not side.steps) else "0"
    return (f'{lane_score_html(side)}<div class="race-text" data-side="{side.mode}" data-finished="{finished}" '
            f'data-forwards="{side.forwards}" data-slowed="{side.slowed}">{body}{cursor}</div>{key}')


SLOWED_TIMES = ("slow motion: each forward ran after a pause, on a cold CPU, so this race's times are not this "
                "machine's speed and are not shown")


def lane_score_html(side: SideRecord) -> str:
    """One lane's two big numbers: tokens per forward (tokens ÷ forwards, the prompt pass included, as in the
    stats table) and tokens per second of the lane's own compute (tokens ÷ the sum of its forward times). The
    replay (app/replay.js) recomputes both from the chunks it shows, by the same definitions."""
    tpf = f"{side.tokens_per_forward:.2f}" if side.steps else "–"
    tps = f"{side.tokens_per_s:.0f}" if side.steps and side.compute_time > 0 and side.slowed == 1 else "–"
    tip = (SLOWED_TIMES if side.slowed > 1 else
           "tokens per second of this lane\'s own compute: its tokens ÷ the sum of its forward-pass times")
    return (f'<div class="lane-score" data-side="{side.mode}"><span class="score"><b class="score-tpf">{tpf}</b> '
            f'<small>tokens/forward</small></span><span class="score" title="{tip}"><b class="score-tps">{tps}</b> '
            f'<small>tokens/s</small></span></div>')


# ----------------------------------------------------------------------------- stats
def _status(side: SideRecord) -> str:
    if side.note and not side.steps:
        return "not run"
    return "done" if side.finished else ("running" if side.steps else "waiting")


def render_stats(sides: dict, measured: dict | None = None, ar_label: str = "AR", measuring: str = "") -> str:
    """The lanes' numbers side by side, then one speedup line per MARS lane.

    `sides` maps lane -> SideRecord (any of LANES); `measured` maps lane -> the measurement after the race
    (app.timing.Measurement) once it exists; `measuring` is shown while it runs.
    """
    if not isinstance(sides, dict):   # render_stats(mars, ar[, label]) of the two-lane page
        raise TypeError("render_stats takes {lane: SideRecord}")
    lanes = [n for n in LANES if n in sides]
    ar = sides.get("ar")

    def cell(side: SideRecord, key: str) -> str:
        if side.note and not side.steps and key != "status":
            return "—"
        if key == "forwards":
            return f"{side.forwards}"
        if key == "tokens":
            return f"{side.n_tokens}"
        if key == "tpf":
            return f"{side.tokens_per_forward:.2f}"
        if key in ("tps", "time") and side.slowed > 1:
            return f"<span title=\"{SLOWED_TIMES}\">slowed</span>"
        if key == "tps":
            return f"{side.tokens_per_s:.1f}"
        if key == "time":
            return f"{side.compute_time:.2f}"
        if key == "drafts":
            if side.mode != "verify":
                return "—"
            ok, checked = side.drafts_checked()
            text = f"{ok} of {checked}" + (f" ({ok / checked:.0%})" if checked else "")
            alt_ok, alt_checked = side.alternatives_checked()
            if alt_checked:
                text += f" · alternatives {alt_ok} of {alt_checked}"
            return text
        if key == "same":
            if side.mode == "ar" or ar is None or not side.finished or not ar.finished:
                return "—"
            return "yes" if compare(side.token_strings, ar.token_strings).identical else "no"
        return _status(side)

    rows = [("forwards", gloss("forward pass", "forwards")), ("tokens", gloss("token", "tokens")),
            ("tpf", gloss("tokens per forward", "tokens/forward")), ("tps", "tokens/s"),
            ("time", "time (s)"), ("drafts", gloss("draft", "drafts confirmed")), ("same", "same answer as AR"),
            ("status", "status")]
    head = "".join(f"<th>{_esc(ar_label if n == 'ar' else sides[n].label)}</th>" for n in lanes)
    body = "".join(f"<tr><th>{label}</th>" + "".join(f"<td class='stat-{key}-{n}'>{cell(sides[n], key)}</td>"
                                                      for n in lanes) + "</tr>" for key, label in rows)
    lines = "".join(speedup_html(n, sides[n], ar, (measured or {}).get(n), measuring)
                    for n in ("mars", "verify") if n in sides and ar is not None)
    return (f'<table class="stats"><thead><tr><th></th>{head}</tr></thead><tbody>{body}</tbody></table>'
            f'<div class="speedups">{lines}</div>')


def speedup_html(lane: str, side: SideRecord, ar: SideRecord, m=None, measuring: str = "") -> str:
    """One lane's line: the measured median with min–max, the bound, and whether the answers are the same."""
    vid = "speedup-value" if lane == "mars" else f"speedup-{lane}"
    label = side.label
    if side.note and not side.steps:
        return (f'<div class="speedup" data-lane="{lane}">{_esc(label)}: <b id="{vid}">—</b>'
                f'<span class="how">{_esc(side.note)}</span></div>')
    done = side.finished and ar.finished and side.steps and ar.steps
    cmp = compare(side.token_strings, ar.token_strings) if done else None
    word = "speedup" if cmp is None or cmp.identical else "time ratio"
    if m is not None:
        return _measured_html(lane, vid, label, word, cmp, m, (ar.forwards - 1, side.forwards - 1))
    race_ratio = ""
    if side.slowed > 1:
        race_ratio = (f"slow motion ×{side.slowed}: each forward ran after a pause, on a cold CPU, so this race's "
                      f"times are not this machine's speed")
    elif done and side.compute_time > 0:
        race_ratio = (f"this race, one run: {ar.compute_time / side.compute_time:.2f}× "
                      f"(AR time ÷ {label} time; noisy)")
    wait = measuring or ("the measured speedup follows the race" if not done else
                         "not timed again after the race (tick 'then time again' for a number you can quote)")
    return (f'<div class="speedup" data-lane="{lane}">{_esc(label)} vs AR, {word}: <b id="{vid}">—</b>'
            f'<span class="how">{_esc(" · ".join(x for x in (race_ratio, wait) if x))}</span>'
            f'<div class="equal-work">{comparison_html(cmp, label)}</div></div>')


def _measured_html(lane: str, vid: str, label: str, word: str, cmp, m, forwards: tuple[int, int]) -> str:
    """The speedup line once timed: the median and spread of the repeats so far, and the bound once measured."""
    # full precision in the data attributes, so whoever reads them rounds exactly as the text does
    bound_attr = "" if m.bound is None else f' data-bound="{float(m.bound)!r}"'
    value = (f'<b id="{vid}" data-median="{float(m.median)!r}" data-min="{float(m.low)!r}" '
             f'data-max="{float(m.high)!r}"{bound_attr} data-repeats="{m.repeats}">{m.median:.2f}×</b>')
    how = (f"measured: median of {m.repeats} alternating run{'s' if m.repeats != 1 else ''} after the race, "
           f"min {m.low:.2f}× – max {m.high:.2f}× ({_esc(m.clock)})")
    note = f"<div class='exceeds'>{_esc(m.note)}</div>" if m.note else ""
    if m.bound is None:
        bound = "" if m.note else "the bound follows once the repeats are done"
        return (f'<div class="speedup" data-lane="{lane}">{_esc(label)} vs AR, {word}: {value}'
                f'<span class="how">{how}</span><div class="bound-line">{bound}</div>'
                f'<div class="equal-work">{comparison_html(cmp, label)}</div>{note}</div>')
    # Named by what it is, AR's forwards over this lane's, with both counts: it equals the lane's tokens/forward
    # after the prompt pass only when the answers are the same, and must never read as a second tokens/forward.
    bound = (f"expected bound <b class='bound'>{m.bound:.2f}×</b> = AR forwards ÷ {_esc(label)} forwards after "
             f"the prompt pass ({forwards[0]} ÷ {forwards[1]} = {m.forward_ratio:.2f}) × cost(1) ÷ "
             f"cost({m.mean_fed:.1f} positions fed) = "
             f"{m.forward_ratio:.2f} ÷ {m.mean_cost:.2f}; cost = the forward (measured after the race: "
             f"{m.forward_ms:.1f} ms for 1 position) + {m.overhead_ms:.1f} ms of per-step work outside it (AR's "
             f"timed run per forward − its forward)")
    if m.forward_ratio_label:
        bound += f" ({_esc(m.forward_ratio_label)})"
    if m.median > m.bound * 1.0005:
        note = (f"<div class='exceeds'>The measurement exceeds the bound by {m.median / m.bound - 1:.0%}: the "
                f"bound and the timing were measured at different moments on a machine shared with other work, "
                f"and the spread (min–max) shows how much that moves a run; a MARS step cannot really cost less "
                f"than its forward.</div>") + note
    return (f'<div class="speedup" data-lane="{lane}">{_esc(label)} vs AR, {word}: {value}'
            f'<span class="how">{how}</span><div class="bound-line">{bound}</div>'
            f'<div class="equal-work">{comparison_html(cmp, label)}</div>{note}</div>')


# ----------------------------------------------------------------------------- ledger
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


def _confbar(conf: float, tau: float) -> str:
    bar = max(0.0, min(1.0, conf))
    return (f"<div class='confbar'><div style='width:{bar*100:.1f}%'></div>"
            f"<span class='tauline' style='left:{min(tau,1.0)*100:.1f}%'></span></div>{conf:.3f}")


def _checked_html(s: StepRecord, prev: StepRecord | None, checked: list) -> tuple[str, str]:
    """The verdict on each draft the previous step made (and on the tree's alternatives), and the line on AR's
    own token committed after them."""
    rows = []
    for j, d in enumerate(checked):
        if j < s.drafts_confirmed:
            verdict, cls, ar_tok = "confirmed: equal to AR's token — committed", "acc", d
        elif j == s.drafts_confirmed and s.rejected is not None:
            ar_tok = s.tokens[j] if j < len(s.tokens) else ""
            verdict, cls = f"rejected: AR's token is {_visible(ar_tok)} — it replaces the draft", "stop"
        else:
            verdict, cls, ar_tok = "dropped: an earlier draft was rejected (its position moved)", "skip", ""
        rows.append(f"<tr class='{cls}'><td>draft {j + 1}</td><td class='tok'>{_esc(_visible(d))}</td>"
                    f"<td class='tok'>{_esc(_visible(ar_tok)) if ar_tok else '—'}</td><td>{_esc(verdict)}</td></tr>")
    bonus = ""
    if s.rejected is None and len(s.tokens) > s.confirmed:
        bonus = (f"<div class='why'>Then AR's own next token "
                 f"<b class='tok'>{_esc(_visible(s.tokens[s.confirmed]))}</b> "
                 f"(from the output at the last {'draft' if checked else 'committed token'}) is committed too.</div>")
    checked_html = (f"<table class='checked'><thead><tr><th>checked</th><th>draft (step {s.step - 1})</th>"
                    f"<th>AR's token</th><th>verdict</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
                    if rows else "<div class='why'>No drafts to check at this step.</div>")
    leaf_rows = []
    for leaf in (prev.leaves if prev is not None else []):
        took = s.leaf_confirmed and leaf == s.tokens[s.confirmed - 1]
        leaf_rows.append(f"<tr class='{'acc' if took else 'skip'}'><td>alternative</td><td class='tok'>"
                         f"{_esc(_visible(leaf))}</td><td></td><td>"
                         f"{'confirmed: AR’s token where the draft was rejected' if took else 'not AR’s token there'}"
                         f"</td></tr>")
    if leaf_rows:
        checked_html += (f"<div class='ledger-sub'>Tree: the runner-up tokens checked beside the drafts</div>"
                         f"<table class='checked'><tbody>{''.join(leaf_rows)}</tbody></table>")
    return checked_html, bonus


def _proposals_html(side: SideRecord, s: StepRecord) -> str:
    """This step's mask proposals and which of them became the next step's drafts, and why."""
    props = []
    stopped = False
    copied = s.draft_source == "prompt"
    for j, (tok, conf) in enumerate(zip(s.candidates, s.confidences)):
        if s.rejected is not None and side.layout == "linear" and not copied:
            verdict, cls = "not drafted: a draft was rejected, so the masks saw a wrong token", "skip"
        elif copied:
            verdict, cls = "not drafted: the text so far offered a longer run (below)", "skip"
        elif j < len(s.draft_ids):
            verdict, cls = "kept as a draft: conf ≥ τ — checked by the next forward", "acc"
        elif not stopped and conf < s.tau:
            verdict, cls, stopped = "not drafted: conf < τ — stops drafting", "stop", True
        elif stopped:
            verdict, cls = "not drafted (an earlier proposal stopped drafting)", "skip"
        else:
            verdict, cls, stopped = "not drafted: no room left or the run ended", "skip", True
        props.append(f"<tr class='{cls}'><td>mask {j + 1}</td><td class='tok'>{_esc(_visible(tok))}</td>"
                     f"<td>{_confbar(conf, s.tau)}</td><td>{_esc(verdict)}</td></tr>")
    props_html = (f"<table class='proposals'><thead><tr><th>slot</th><th>proposal</th><th>confidence (| = τ)</th>"
                  f"<th>verdict</th></tr></thead><tbody>{''.join(props)}</tbody></table>" if props
                  else "<div class='why'>No masks at this step (τ off, or no room left).</div>")
    if side.layout == "quadratic" and props:
        props_html = (f"<div class='why'>Quadratic layout: a group of masks followed the last committed token and "
                      f"every draft; these are the proposals of the group behind the last token this pass "
                      f"committed.</div>{props_html}")
    if copied:
        props_html += (f"<div class='why'>Prompt lookup: the last tokens occurred earlier in the text, "
                       f"so what followed them there is drafted instead: <b class='tok from-prompt'>"
                       f"{_esc(' '.join(_visible(t) for t in s.drafts))}</b></div>")
    return props_html


def _step_time(side: SideRecord, s) -> str:
    """A ledger step's time: what its forward took, or in a slowed race the warm time it was shown for (after a
    pause the forward ran on a cold CPU, so its own time is not this machine's speed)."""
    if side.slowed <= 1:
        return f"{s.step_time * 1000:.1f} ms"
    if side.pace is None:
        return f"shown ×{side.slowed} slower"
    return f"{side.pace.of(s) * 1000:.1f} ms warm, shown ×{side.slowed} slower"


def _verify_ledger(side: SideRecord, k: int) -> str:
    s = side.steps[k]
    prev = side.steps[k - 1] if k > 0 else None
    checked = prev.drafts if prev is not None else []
    checked_html, bonus = _checked_html(s, prev, checked)
    props_html = _proposals_html(side, s)
    chain = s.drafts_confirmed
    alt = " + 1 confirmed alternative" if s.leaf_confirmed else ""
    why = (f"Lossless: a token is committed only when it equals AR's greedy token at its position, so the text is "
           f"exactly AR's; this pass committed {s.n_accepted} token{'s' if s.n_accepted != 1 else ''} "
           f"({chain} confirmed draft{'s' if chain != 1 else ''}{alt} + AR's token).")
    if s.done and s.finish_reason:
        why += f" The run ends here: {_FINISH.get(s.finish_reason, s.finish_reason)}."
    return (f"<div class='ledger'><div class='ledger-head'>{_esc(side.label)} · step {s.step} of "
            f"{len(side.steps) - 1} · τ = {_tau_text(s.tau)} · confirmed {chain} of {len(checked)} drafts{alt} · "
            f"committed {s.n_accepted} · {_step_time(side, s)}</div>{checked_html}{bonus}"
            f"<div class='ledger-sub'>New mask proposals → drafts for step {s.step + 1}</div>{props_html}"
            f"<div class='why'>Why: {_esc(why)}</div></div>")


def render_ledger(side: SideRecord, step: int) -> str:
    """The candidates of one forward pass: confidence, τ, accepted or not, and which one stopped it.
    Lossless lane: the drafts this pass checked (confirmed / rejected, AR's token) and its new proposals."""
    if not side.steps:
        return '<div class="ledger placeholder">Generate first — then pick a step to see its candidates.</div>'
    step = max(0, min(int(step), len(side.steps) - 1))
    if side.mode == "verify":
        return _verify_ledger(side, step)
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
        rows.append(
            f"<tr class='{cls}'><td>t{j}</td><td>{_esc(src)}</td><td class='tok'>{_esc(_visible(tok))}</td>"
            f"<td>{_confbar(conf, s.tau)}</td><td>{verdict}</td></tr>")
    return (f"<div class='ledger'><div class='ledger-head'>{_esc(side.label)} · step {s.step} of "
            f"{len(side.steps) - 1} · τ = {_tau_text(s.tau)} · accepted {s.n_accepted} of {len(s.candidates)} · "
            f"{_step_time(side, s)}</div>"
            f"<table><thead><tr><th>slot</th><th>predicted by the output at</th><th>candidate</th>"
            f"<th>confidence (| = τ)</th><th>verdict</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
            f"<div class='why'>Why: {_esc(stop_reason(s))}</div></div>")


def legend_html(block_size: int = 4, copied: bool = False) -> str:
    """The race's legend; `copied`: some lossless draft came from prompt lookup, so its mark is explained too."""
    items = "".join(f'<span class="chunk" style="background:{chunk_colour(n)}">{n} token{"s" if n > 1 else ""}</span> '
                    for n in range(1, max(2, block_size) + 1))
    lookup = (' <span class="verified from-prompt">copied draft</span> = a draft copied from earlier text (prompt '
              'lookup) that the next forward confirmed,' if copied else '')
    return (f'<div class="legend">One highlighted chunk = one forward pass, coloured by how many tokens it '
            f'committed: {items} <span class="tau-mark">τ→x</span> = τ moved here. Lossless lane: '
            f'<span class="verified">verified draft</span> = a mask guess the next forward confirmed,{lookup} '
            f'<del class="rejected">draft</del><span class="replacement">AR</span> = a rejected draft and AR\'s '
            f'replacement, <span class="pending-drafts">grey</span> = drafts awaiting their check. Hover a chunk for '
            f'its step and each token\'s confidence.</div>')
