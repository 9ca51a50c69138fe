"""Plotly figures of the Generate tab, built from the race records (no model calls)."""
from __future__ import annotations

import difflib

import plotly.graph_objects as go

from app.race import SideRecord
from app.render import chunk_colour

_LAYOUT = dict(template="plotly_white", margin=dict(l=50, r=20, t=50, b=40), height=300,
               font=dict(size=12))


def tokens_per_forward_figure(mars: SideRecord, verify: SideRecord | None = None) -> go.Figure:
    """Bars: tokens committed by each MARS forward pass, coloured like the chunks; the lossless lane's beside them."""
    fig = go.Figure()
    lanes = [(mars, "MARS", None)]
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
            fig.add_hline(y=mean, line_dash="dash", line_color=line or "#2563eb",
                          annotation_text=f"{name}: mean {mean:.2f} tokens/forward",
                          annotation_position="top left" if line is None else "top right")
    fig.update_layout(title="Tokens committed per forward pass", xaxis_title="forward pass (step)",
                      yaxis_title="tokens committed", yaxis=dict(dtick=1, rangemode="tozero"), barmode="group",
                      showlegend=len(lanes) > 1, legend=dict(orientation="h", y=1.12, x=1, xanchor="right"),
                      **_LAYOUT)
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
                             text=[("—" if r is None else f"{r:.0%} of {d}") for _, r, d in conf],
                             textposition="outside"))
    fig.update_layout(title="Acceptance per slot", yaxis_title="share",
                      yaxis=dict(range=[0, 1.2], tickformat=".0%"), barmode="group", showlegend=bool(conf),
                      legend=dict(orientation="h", y=1.12, x=1, xanchor="right"), **_LAYOUT)
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


_DIFF_Z = {"equal": 0, "replace": 1, "only MARS": 2, "only AR": 3}
_DIFF_COLOURS = [[0.0, "#f3f4f6"], [0.25, "#f3f4f6"], [0.25, "#fca5a5"], [0.5, "#fca5a5"],
                 [0.5, "#93c5fd"], [0.75, "#93c5fd"], [0.75, "#fcd34d"], [1.0, "#fcd34d"]]


def diff_figure(mars_tokens: list[str], ar_tokens: list[str], width: int = 16) -> go.Figure:
    """Token-level diff of the MARS output against the AR output, wrapped `width` tokens per line."""
    aligned = token_diff(mars_tokens, ar_tokens)
    same = sum(1 for k, _, _ in aligned if k == "equal")
    lines = max(1, -(-len(aligned) // width))
    z, text, hover, ylabels = [], [], [], []
    for li in range(lines):
        seg = aligned[li * width:(li + 1) * width]
        pad = width - len(seg)
        for who, idx in (("MARS", 1), ("AR", 2)):
            z.append([_DIFF_Z[k] for k, _, _ in seg] + [None] * pad)
            text.append([_short(t[idx]) for t in seg] + [""] * pad)
            hover.append([f"{t[0]}: MARS {t[1]!r} · AR {t[2]!r}" for t in seg] + [""] * pad)
            ylabels.append(f"{who} {li * width}")
    fig = go.Figure(go.Heatmap(z=z, text=text, texttemplate="%{text}", hovertext=hover, hoverinfo="text",
                               colorscale=_DIFF_COLOURS, zmin=0, zmax=3, showscale=False, xgap=2, ygap=2,
                               y=list(range(len(z)))))
    title = (f"Token diff, MARS vs AR: {same} of {len(aligned)} aligned tokens equal "
             f"(grey = same, red = different, blue = only in MARS, yellow = only in AR)")
    fig.update_layout(title=dict(text=title, font=dict(size=12)), template="plotly_white",
                      height=max(160, 44 * len(z) + 70), margin=dict(l=80, r=10, t=50, b=10),
                      xaxis=dict(visible=False),
                      yaxis=dict(autorange="reversed", tickmode="array", tickvals=list(range(len(z))),
                                 ticktext=ylabels))
    return fig


def _short(tok: str, n: int = 8) -> str:
    tok = tok.replace("\n", "⏎")
    return tok if len(tok) <= n else tok[: n - 1] + "…"


def empty_figure(message: str) -> go.Figure:
    """A blank white panel holding `message`. Template "none" with white set directly: nothing here needs
    plotly_white's styling, whose copy made the page's six placeholders a part of its start-up time."""
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, font=dict(size=14, color="#6b7280"))
    fig.update_layout(template="none", paper_bgcolor="white", plot_bgcolor="white", height=220,
                      xaxis=dict(visible=False), yaxis=dict(visible=False), margin=dict(l=10, r=10, t=10, b=10))
    return fig
