"""Learn tab: the training attention mask and one live inference step, in the paper's terms.

The mask comes from `finetune.losses.mars_attention_mask` (the one the trainer uses); the
inference step is the first StepEvent of `mars_core.generate_stream` on the current prompt.
Nothing here re-implements MARS.
"""
from __future__ import annotations

import html

import gradio as gr
import plotly.graph_objects as go

from app import inputs, models
from app.machine import MACHINE, take_turn
from app.plots import empty_figure

MASK_TEXT = """
**Training input** is `[noisy | clean]`: the clean half is the example; the noisy half is the same
sequence with every response token replaced by the mask token (`<|mask|>` in tiny-mars, `<repo_name>` in
smollm2-mars, shown as "(mask)" below). Positions are `0..n-1` in both halves and
blocks are absolute, `block(i) = i // B`. The four regions of the mask (row = query, column = key):

- **clean → clean**: plain causal (`k ≤ q`) — the ordinary AR-SFT loss is computed here.
- **noisy → noisy**: causal *inside its own block* only — a mask sees the masks before it in its block.
- **noisy → clean**: only *earlier* blocks — a block predicts its tokens from the clean past, never from itself.
- **clean → noisy**: never — the clean stream stays an ordinary causal LM.

Loss = CE(noisy) + `ar_weight` · CE(clean) over the response tokens (`ar_weight = 1` is the paper's MARS; the
embedded tiny-mars used 5, see its model card).
"""

STEP_TEXT = """
**One inference step = one forward pass.** The input is the committed tokens not yet in the KV cache
followed by masks (numbered 1, 2, … below). The output at the last committed token is the ordinary
next-token distribution `q₀`; the output at mask *j* predicts position *+j* (`q_j`). The paper appends B
masks; the output at the last one is never used, so the decoder appends B−1 and gets the same candidates.
Each candidate `t_j` has a confidence `c_j`. `t₀` is always accepted; `t_j` is accepted while every earlier one
was and `c_j ≥ τ`. The masks are then cropped from the cache and the accepted tokens enter at the next step — no
extra forward.
"""


_SUBSCRIPTS = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")


def _sub(j: int) -> str:
    return str(j).translate(_SUBSCRIPTS)


def tick_step(n: int) -> int:
    """Label every position up to n = 12, then every 2nd / 4th so that the labels stay readable."""
    return 1 if n <= 12 else 2 if n <= 20 else 4


def mask_figure(n: int, block_size: int) -> go.Figure:
    """Heatmap of mars_attention_mask(n, B) over [noisy | clean] with the four regions named."""
    if not 2 <= int(n) <= 32:
        raise ValueError(f"n = {n} is out of range; use 2..32 positions")
    if not 1 <= int(block_size) <= 16:
        raise ValueError(f"B = {block_size} is out of range; use 1..16")
    from finetune.losses import mars_attention_mask
    n, B = int(n), int(block_size)
    mask = mars_attention_mask(n, B).to(int).tolist()   # [2n, 2n], True = may attend
    labels = [f"noisy {i}" for i in range(n)] + [f"clean {i}" for i in range(n)]
    region = [["noisy→noisy" if q < n and k < n else "noisy→clean" if q < n else
               "clean→noisy" if k < n else "clean→clean" for k in range(2 * n)] for q in range(2 * n)]
    hover = [[f"query {labels[q]} (block {q % n // B})<br>key {labels[k]} (block {k % n // B})<br>"
              f"{region[q][k]}: {'attends' if mask[q][k] else 'blocked'}" for k in range(2 * n)] for q in range(2 * n)]
    fig = go.Figure(go.Heatmap(z=mask, x=list(range(2 * n)), y=list(range(2 * n)), hovertext=hover,
                               hoverinfo="text", colorscale=[[0, "#f8fafc"], [1, "#2563eb"]], showscale=False,
                               xgap=1, ygap=1))
    for name, (x, y) in {"noisy → noisy": (n / 2 - 0.5, n / 2 - 0.5), "noisy → clean": (1.5 * n - 0.5, n / 2 - 0.5),
                         "clean → noisy (never)": (n / 2 - 0.5, 1.5 * n - 0.5),
                         "clean → clean": (1.5 * n - 0.5, 1.5 * n - 0.5)}.items():
        fig.add_annotation(x=x, y=y, text=f"<b>{name}</b>", showarrow=False, bgcolor="rgba(255,255,255,0.85)",
                           font=dict(size=13, color="#111827"))
    fig.add_shape(type="line", x0=n - 0.5, x1=n - 0.5, y0=-0.5, y1=2 * n - 0.5, line=dict(color="#dc2626", width=2))
    fig.add_shape(type="line", y0=n - 0.5, y1=n - 0.5, x0=-0.5, x1=2 * n - 0.5, line=dict(color="#dc2626", width=2))
    for b in range(B, n, B):  # block boundaries inside each half
        for off in (0, n):
            fig.add_shape(type="line", x0=off + b - 0.5, x1=off + b - 0.5, y0=-0.5, y1=2 * n - 0.5,
                          line=dict(color="#9ca3af", width=1, dash="dot"))
            fig.add_shape(type="line", y0=off + b - 0.5, y1=off + b - 0.5, x0=-0.5, x1=2 * n - 0.5,
                          line=dict(color="#9ca3af", width=1, dash="dot"))
    step = tick_step(n)
    ticks = [i for i in range(2 * n) if (i % n) % step == 0]
    short = [f"{'noisy' if i < n else 'clean'} {i % n}" for i in ticks]
    every = f" (every {step}{'nd' if step == 2 else 'th'} labelled)" if step > 1 else ""
    title = f"Training attention mask, n = {n}, B = {B}<br><sup>blue = may attend; rows = queries</sup>"
    fig.update_layout(title=title,
                      template="plotly_white", height=600, margin=dict(l=90, r=20, t=50, b=90),
                      xaxis=dict(title="key position" + every, tickvals=ticks, ticktext=short, tickangle=-60,
                                 tickfont=dict(size=11)),
                      yaxis=dict(title="query position" + every, tickvals=ticks, ticktext=short, autorange="reversed",
                                 tickfont=dict(size=11), scaleanchor="x"))
    return fig


def show_mask(n, block_size):
    """The mask figure for the sliders' n and B, or an empty figure saying what is wrong with them."""
    try:
        return mask_figure(inputs.whole(n, "sequence length n", 2, 32), inputs.whole(block_size, "block size B", 1, 8))
    except Exception as exc:
        return empty_figure(models.friendly_error(exc))


def _checked(choice, free_text, prompt, tau, tau_off, block_size, criterion, resolver):
    """The Learn tab's inputs checked (each bad one a ValueError naming it): (prompt, τ, notes, B, criterion,
    model name)."""
    prompt, tau, notes = inputs.check_prompt_and_tau(prompt, tau, inputs.check_flag(tau_off, "τ off"))
    block_size = inputs.whole(block_size, "block size B", 1, 8)
    return prompt, tau, notes, block_size, inputs.check_criterion(criterion), resolver.resolve(choice, free_text)


def one_step(choice, free_text, prompt, tau, tau_off, block_size, criterion, picked=True,
             resolver: models.Resolver = models.BUILTINS, machine=MACHINE):
    """The Learn tab's button: a generator of (step HTML, confidence figure) for the first forward pass on the
    Generate tab's prompt and τ; while a race or sweep holds the machine, a line saying where it waits. B is the
    Learn tab's own slider (the mask above shows the same B), not the Generate tab's.

    It runs the model the picker shows, like every other tab: one step needs no answer key, so any model will
    do. `picked` no longer changes the model; it stays so that the page's wiring and API keep their shape."""
    try:
        prompt, tau, notes, block_size, criterion, name = _checked(choice, free_text, prompt, tau, tau_off,
                                                                   block_size, criterion, resolver)
    except Exception as exc:
        yield f"<p>⚠ {html.escape(models.friendly_error(exc))}</p>", gr.skip()
        return
    ticket = yield from take_turn(machine, "a Learn step", lambda line: (f"<p>{html.escape(line)}</p>", gr.skip()))
    try:
        lm = models.get_model(name)
        event = first_step(lm, prompt, tau, block_size, criterion)
    except Exception as exc:
        yield f"<p>⚠ {html.escape(models.friendly_error(exc))}</p>", gr.skip()
        return
    finally:
        machine.leave(ticket)
    yield _preamble(model_label(choice, free_text, name), notes) + step_html(lm, prompt, event), \
        confidence_figure(lm, event)


def _preamble(model: str, notes: list[str]) -> str:
    """The lines above a step: the model it ran on, and what was clamped or cut (a long prompt, τ)."""
    return (f"<p class='defs'>model: <b>{html.escape(model)}</b></p>"
            + "".join(f"<p class='defs'>✂ {html.escape(n)}</p>" for n in notes))


STEPS_MAX_NEW = 64   # "every step" decodes this many tokens at most: a lesson's answer, not an essay


def decode_steps(lm, prompt: str, tau: float, block_size: int, criterion: str = "prob",
                 max_new_tokens: int = STEPS_MAX_NEW) -> list:
    """Every forward pass of MARS decoding on `prompt` (the StepEvents of mars_core.generate_stream)."""
    from mars_core import DecodeConfig, generate_stream
    cfg = DecodeConfig(mode="mars", tau=tau, block_size=block_size, max_new_tokens=max_new_tokens,
                       criterion=criterion)
    return [ev for ev in generate_stream(lm, [prompt], cfg) if ev.rows[0].active]


def step_view(state, k) -> tuple[str, object]:
    """Pass k of a recorded decode (the Learn tab's slider): its HTML, with everything committed before it as the
    input, and its confidence figure. The model is not run again."""
    if not state:
        return "<p>Press “Step through every forward pass” first.</p>", gr.skip()
    lm, prompt, events = state["lm"], state["prompt"], state["events"]
    k = max(0, min(int(k or 0), len(events) - 1))
    context = lm.encode(prompt) + [t for ev in events[:k] for t in ev.rows[0].accepted_ids]
    text = "".join(ev.rows[0].text for ev in events[:k + 1])
    head = (_preamble(state.get("model", lm.name), state.get("notes", []))
            + f"<p class='defs'>forward pass {k + 1} of {len(events)} · answer so far: "
            f"<b>{html.escape(text)}</b></p>")
    return head + step_html(lm, prompt, events[k], context_ids=context), confidence_figure(lm, events[k])


def all_steps(choice, free_text, prompt, tau, tau_off, block_size, criterion,
              resolver: models.Resolver = models.BUILTINS, machine=MACHINE):
    """The Learn tab's "every forward pass" button: decodes the prompt once (at most STEPS_MAX_NEW tokens) and
    yields (first pass HTML, its figure, the slider over the passes, the recorded decode)."""
    try:
        prompt, tau, notes, block_size, criterion, name = _checked(choice, free_text, prompt, tau, tau_off,
                                                                   block_size, criterion, resolver)
    except Exception as exc:
        yield f"<p>⚠ {html.escape(models.friendly_error(exc))}</p>", gr.skip(), gr.skip(), gr.skip()
        return
    ticket = yield from take_turn(machine, "a Learn decode",
                                  lambda line: (f"<p>{html.escape(line)}</p>", gr.skip(), gr.skip(), gr.skip()))
    try:
        lm = models.get_model(name)
        events = decode_steps(lm, prompt, tau, block_size, criterion)
    except Exception as exc:
        yield f"<p>⚠ {html.escape(models.friendly_error(exc))}</p>", gr.skip(), gr.skip(), gr.skip()
        return
    finally:
        machine.leave(ticket)
    state = {"lm": lm, "prompt": prompt, "events": events, "notes": notes,
             "model": model_label(choice, free_text, name)}
    view, fig = step_view(state, 0)
    slider = gr.update(minimum=0, maximum=max(1, len(events) - 1), value=0, interactive=len(events) > 1)
    yield view, fig, slider, state


def model_label(choice, free_text, name: str) -> str:
    """What the page calls the model: the picker's value ("run:<name>", not its checkpoint path) unless a path or
    hub id was typed."""
    return name if (free_text or "").strip() else str(choice)


def first_step(lm, prompt: str, tau: float, block_size: int, criterion: str = "prob"):
    """The first forward pass of MARS decoding on `prompt` (one StepEvent), from mars_core."""
    from mars_core import DecodeConfig, generate_stream
    cfg = DecodeConfig(mode="mars", tau=tau, block_size=block_size, max_new_tokens=max(block_size, 8),
                       criterion=criterion)
    stream = generate_stream(lm, [prompt], cfg)
    try:
        return next(stream)
    finally:
        stream.close()


def _tok(lm, t: int, eos_label: bool = True) -> str:
    if eos_label and t in lm.eos_ids:
        return "⟨eos⟩"
    s = lm.tokenizer.decode([t], skip_special_tokens=False)
    return s.replace("\n", "⏎").replace(" ", "␣") or "∅"


def step_html(lm, prompt: str, event, show_last: int = 10, context_ids: list[int] | None = None) -> str:
    """Committed tokens, the masks, which output predicts which position, and the verdicts. `context_ids`: what
    is committed before this pass (default: the prompt alone, i.e. the first pass)."""
    row = event.rows[0]
    ids = lm.encode(prompt) if context_ids is None else list(context_ids)
    tau, B, n = event.tau, len(row.candidates), row.n_accepted
    shown = ids[-show_last:]
    e = html.escape
    committed = "".join(f'<div class="cell committed" title="prompt position {len(ids) - len(shown) + i}">'
                        f'{e(_tok(lm, t, eos_label=False))}</div>' for i, t in enumerate(shown))
    masks = "".join(f'<div class="cell maskcell">⟨mask⟩<small>mask {j}</small></div>' for j in range(1, B))
    p = len(ids)
    rows = []
    # the pass stops at t_n on a confidence below τ, or because the answer finished in this pass
    ended = {"eos": "the answer ended (end of turn)", "length": "the token limit was reached",
             "stop": "a stop string ended the answer"}.get(row.finish_reason or "")
    for j, (t, c) in enumerate(zip(row.candidates, row.confidences)):
        src = "last committed token" if j == 0 else f"mask {j}"
        if j == 0:
            verdict, cls = "accepted — t₀ is always kept (it is the plain AR token)", "acc"
        elif j < n:
            before = "t₀ was accepted" if j == 1 else f"t₀..t{_sub(j - 1)} were accepted"
            verdict, cls = f"accepted — c = {c:.3f} ≥ τ and {before}", "acc"
        elif j == n and not ended:
            verdict, cls = f"rejected — c = {c:.3f} < τ = {tau:.2f}; stops the pass", "stop"
        elif ended:
            verdict, cls = f"not used — {ended} before it", "stop" if j == n else "skip"
        else:
            verdict, cls = f"dropped — t{n} was rejected before it (accepted tokens must be contiguous)", "skip"
        rows.append(f"<tr class='{cls}'><td>output at {e(src)}</td><td>→ position {p + j}</td>"
                    f"<td>t{j} = <b>{e(_tok(lm, t))}</b></td><td data-label='confidence '>{c:.3f}</td>"
                    f"<td>{e(verdict)}</td></tr>")
    accepted = "".join(f'<div class="cell accepted">{e(_tok(lm, t))}</div>' for t in row.accepted_ids)
    return (f"<div class='learn-step'>"
            f"<div class='lane'><span class='lane-label'>"
            f"forward input (…last {len(shown)} committed + {B - 1} masks)</span>"
            f"<div class='cells'>{committed}{masks}</div></div>"
            f"<table><thead><tr><th>output</th><th>predicts</th><th>candidate</th><th>confidence</th>"
            f"<th>verdict (τ = {tau:.2f})</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
            f"<div class='lane'><span class='lane-label'>committed after this step ({n} token{'s' if n != 1 else ''}, "
            f"one forward)</span><div class='cells'>{accepted}</div></div></div>")


def confidence_figure(lm, event) -> go.Figure:
    """Each candidate's confidence against τ (bars), accepted ones in green."""
    row = event.rows[0]
    labels = [f"t{j}: {_tok(lm, t)}" for j, t in enumerate(row.candidates)]
    colours = ["#22c55e" if j < row.n_accepted else "#f87171" for j in range(len(row.candidates))]
    fig = go.Figure(go.Bar(x=labels, y=row.confidences, marker_color=colours,
                           text=[f"{c:.3f}" for c in row.confidences], textposition="outside"))
    fig.add_hline(y=event.tau, line_dash="dash", line_color="#111827", annotation_text=f"τ = {event.tau:.2f}")
    # two short title lines: one long line is cut off on a phone
    fig.update_layout(title="Candidate confidence vs τ<br>(green = accepted)", yaxis=dict(range=[0, 1.1]),
                      template="plotly_white", height=300, margin=dict(l=50, r=20, t=60, b=40))
    return fig
