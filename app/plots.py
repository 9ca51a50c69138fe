"""Plotly figures of the Generate tab, built from the race records (no model calls)."""
from __future__ import annotations

import difflib
import html

import plotly.graph_objects as go

from app.race import SideRecord
from app.render import chunk_colour

_LAYOUT = dict(template="plotly_white", margin=dict(l=50, r=20, t=50, b=40), height=300,
               font=dict(size=12))
_LEGEND_BELOW = dict(orientation="h", y=-0.25, x=0, yanchor="top")   # beside the title it covers it on a phone


def tokens_per_forward_figure(mars: SideRecord, verify: SideRecord | None = None) -> go.Figure:
    """Bars: tokens committed by each MARS forward pass, coloured like the chunks; the lossless lane's beside them."""
    fig = go.Figure()
    lanes, means = [(mars, "MARS", None)], []
    if verify is not None and verify.steps:
        lanes.append((verify, "MARS lossless", "#7c3aed"))
    for side, name, line in lanes:
        ns = [s.n_accepted for s in side.steps]
        fig.add_trace(go.Bar(x=[s.step for s in side.steps], y=ns, name=name,
                             marker_color=[chunk_colour(n) for n in ns] if line is None else "#ddd6fe",
                             marker_line=dict(color=line or "#6b7280", width=0.8 if line else 0.5),
                             hovertext=[f"{name} step {s.step}: {s.text!r} (τ={s.tau:.2f})" for s in side.steps],
                             hoverinfo="text"))
        if ns:
            mean = sum(ns) / len(ns)
            fig.add_hline(y=mean, line_dash="dash", line_color=line or "#2563eb")
            means.append(f"{name} {mean:.2f}")
    # The means go in the title's second line, not on the lines: labels there collide on a phone's width.
    title = "Tokens committed per forward pass" + (f"<br><sup>dashed: the mean — {', '.join(means)}</sup>"
                                                   if means else "")
    fig.update_layout(title=title, xaxis_title="forward pass (step)",
                      yaxis_title="tokens committed", yaxis=dict(dtick=1, rangemode="tozero"), barmode="group",
                      # lower than the other plots' legends: this one has an axis title to clear (on a phone the
                      # legend sat on it)
                      showlegend=len(lanes) > 1, legend=dict(_LEGEND_BELOW, y=-0.36), **_LAYOUT)
    return fig


def acceptance_by_slot(mars: SideRecord) -> list[tuple[int, float, int]]:
    """(slot j, fraction of forwards whose candidate t_j was accepted, number of forwards)."""
    if not mars.steps:
        return []
    B = max(len(s.candidates) for s in mars.steps)
    n = len(mars.steps)
    return [(j, sum(1 for s in mars.steps if s.n_accepted > j) / n, n) for j in range(B)]


def draft_confirmation_by_slot(verify: SideRecord) -> list[tuple[int, float | None, int]]:
    """Lossless lane: (mask slot j = 1.., share of the drafts in slot j that the next forward confirmed, drafts)."""
    if not verify or len(verify.steps) < 2:
        return []
    width = max(len(s.candidate_ids) for s in verify.steps) or 0
    out = []
    for j in range(width):
        drafted = kept = 0
        for prev, s in zip(verify.steps, verify.steps[1:]):
            if len(prev.draft_ids) > j:
                drafted += 1
                kept += s.drafts_confirmed > j
        out.append((j + 1, kept / drafted if drafted else None, drafted))
    return out


def acceptance_figure(mars: SideRecord, verify: SideRecord | None = None) -> go.Figure:
    """Acceptance rate per slot: t0 (the AR token) is always kept; later slots need conf ≥ τ. The lossless
    lane's bars: the share of its drafts in each mask slot that AR's own token confirmed."""
    rows = acceptance_by_slot(mars)
    labels = [("t0 (AR token)" if j == 0 else f"t{j} (mask {j})") for j, _, _ in rows]
    fig = go.Figure(go.Bar(x=labels, y=[r for _, r, _ in rows], name="MARS: accepted (share of forwards)",
                           text=[f"{r:.0%}" for _, r, _ in rows], textposition="outside", marker_color="#60a5fa"))
    conf = draft_confirmation_by_slot(verify) if verify is not None else []
    if conf:
        fig.add_trace(go.Bar(x=[f"t{j} (mask {j})" for j, _, _ in conf], y=[r or 0 for _, r, _ in conf],
                             name="lossless: drafts confirmed (share of drafts)", marker_color="#a78bfa",
                             text=[("—" if r is None else f"{r:.0%}<br>of {d}") for _, r, d in conf],
                             textposition="outside"))
    fig.update_layout(title="Acceptance per slot", yaxis_title="share",
                      yaxis=dict(range=[0, 1.4], tickformat=".0%"), barmode="group", showlegend=bool(conf),
                      legend=_LEGEND_BELOW, uniformtext=dict(minsize=10, mode="show"),   # narrow bars shrank them
                      **_LAYOUT)
    return fig


def token_diff(mars_tokens: list[str], ar_tokens: list[str]) -> list[tuple[str, str, str]]:
    """Align the two token sequences: (op, mars token, ar token) with op equal/replace/insert/delete."""
    out = []
    sm = difflib.SequenceMatcher(a=mars_tokens, b=ar_tokens, autojunk=False)
    for op, i1, i2, j1, j2 in sm.get_opcodes():
        a, b = mars_tokens[i1:i2], ar_tokens[j1:j2]
        for k in range(max(len(a), len(b))):
            ta = a[k] if k < len(a) else ""
            tb = b[k] if k < len(b) else ""
            kind = op if op == "equal" else ("replace" if ta and tb else ("only MARS" if ta else "only AR"))
            out.append((kind, ta, tb))
    return out


_DIFF_CLASS = {"equal": "same", "replace": "changed", "only MARS": "only-mars", "only AR": "only-ar"}


def diff_html(mars_tokens: list[str], ar_tokens: list[str]) -> str:
    """Token-level diff of the MARS output against the AR output as HTML: one cell per aligned pair (MARS's token
    over AR's), cells wrapping like words, so it reads at a projector's width and at a phone's."""
    aligned = token_diff(mars_tokens, ar_tokens)
    same = sum(1 for k, _, _ in aligned if k == "equal")
    cells = "".join(
        f'<span class="dt {_DIFF_CLASS[k]}" title="{html.escape(f"{k}: MARS {a!r} · AR {b!r}", quote=True)}">'
        f'<i>{_cell(a)}</i><i>{_cell(b)}</i></span>' for k, a, b in aligned)
    return (f'<div class="token-diff"><p class="diff-title"><b>Token diff, MARS vs AR: {same} of {len(aligned)} '
            f'aligned tokens equal</b><br><span class="dt-key"><span class="dt same">same</span> '
            f'<span class="dt changed">different</span> <span class="dt only-mars">only in MARS</span> '
            f'<span class="dt only-ar">only in AR</span> · each cell: MARS above, AR below</span></p>'
            f'<div class="diff-cells">{cells}</div></div>')


def diff_placeholder(message: str = "the token diff appears after a run") -> str:
    return f'<div class="token-diff"><p class="diff-empty">{html.escape(message)}</p></div>'


def _cell(tok: str) -> str:
    """A token as a cell shows it: whitespace made visible (⏎ a newline, · a space), never empty."""
    shown = tok.replace("\n", "⏎").replace(" ", "·")
    return html.escape(shown) if tok else "&nbsp;"


def empty_figure(message: str) -> go.Figure:
    """A blank white panel holding `message`. Template "none" with white set directly: nothing here needs
    plotly_white's styling, whose copy made the page's six placeholders a part of its start-up time."""
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, font=dict(size=14, color="#6b7280"))
    fig.update_layout(template="none", paper_bgcolor="white", plot_bgcolor="white", height=220,
                      xaxis=dict(visible=False), yaxis=dict(visible=False), margin=dict(l=10, r=10, t=10, b=10))
    return fig
