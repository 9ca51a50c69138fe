"""Generate tab handlers: load a model, run the race, move τ mid-generation, browse the ledger.

Handlers are plain functions / generators of values (Gradio calls them); decoding is
`mars_core.generate_stream`, scheduling is `app.race.race`.
"""
from __future__ import annotations

import threading
import time

import gradio as gr

from app import models, plots
from app.race import SideRecord, race, render_chunks, render_ledger, render_stats
from mars_core.decoding import CRITERIA

TAU_MIN, TAU_MAX = 0.5, 1.0
MAX_PROMPT_CHARS = 4000
MAX_NEW_TOKENS = 512
YIELD_EVERY_S = 0.05  # coalesce page updates; the race itself is not slowed down
# Slow motion for teaching: after each forward, wait (factor - 1) × its measured time. Both sides are
# stretched by the same factor, so the relative speed on screen stays the measured one.
SLOW_MOTION = [("real time", 1), ("slow motion ×10", 10), ("slow motion ×50", 50), ("slow motion ×200", 200)]
# What "confidence ≥ τ" measures (docs/algorithm.md): the decoder's CRITERIA, labelled for the page.
_CRITERION_LABELS = {"prob": "probability", "entropy": "exp(−entropy)", "margin": "margin p1−p2"}
CRITERION_CHOICES = [(_CRITERION_LABELS[c], c) for c in CRITERIA]

# τ controls of running races, by browser session: the τ slider writes here, the decoder reads.
_tau_controls: dict[str, object] = {}
_tau_lock = threading.Lock()


def check_inputs(prompt, tau, tau_off, block_size, max_new_tokens, temperature) -> tuple:
    """Validate the Generate tab's inputs; ValueError names the value and the allowed range."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("the prompt is empty: type a question or pick an example")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ValueError(f"the prompt has {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
    tau = effective_tau(tau, tau_off)
    try:
        block_size = int(block_size)
        max_new_tokens = int(max_new_tokens)
        temperature = float(temperature)
    except (TypeError, ValueError):
        raise ValueError("block size, max new tokens and temperature must be numbers") from None
    if not 2 <= block_size <= 8:
        raise ValueError(f"block size {block_size} is out of range; use 2..8 (the embedded model was trained with 4)")
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"max new tokens {max_new_tokens} is out of range; use 1..{MAX_NEW_TOKENS}")
    if not 0.0 <= temperature <= 2.0:
        raise ValueError(f"temperature {temperature} is out of range; use 0 (greedy) .. 2")
    return prompt, tau, block_size, max_new_tokens, temperature


def effective_tau(tau, tau_off) -> float:
    """τ from the slider, or 1.0 (one-token mode) when 'off' is ticked."""
    if tau_off:
        return 1.0
    try:
        tau = float(tau)
    except (TypeError, ValueError):
        raise ValueError(f"τ {tau!r} is not a number; use {TAU_MIN}..{TAU_MAX}") from None
    if not TAU_MIN <= tau <= TAU_MAX:
        raise ValueError(f"τ {tau} is out of range; use {TAU_MIN}..{TAU_MAX} (or tick 'off' for one-token mode)")
    return tau


def token_texts(lm):
    """id -> display string for one token (end-of-turn shown as ⟨eos⟩)."""
    eos = set(lm.eos_ids)
    cache: dict[int, str] = {}

    def text(t: int) -> str:
        if t not in cache:
            cache[t] = "⟨eos⟩" if t in eos else lm.tokenizer.decode([t], skip_special_tokens=False)
        return cache[t]
    return text


def load_model_ui(choice, free_text, jobs=None):
    """Generator for the Load button: progress line first, then a description or a readable error."""
    try:
        name = models.resolve(choice, free_text, jobs)
    except Exception as exc:
        yield f"⚠ {models.friendly_error(exc)}"
        return
    if not models.is_loaded(name):
        note = models.loading_note(name) or " (first load of a model takes a few seconds)"
        yield f"Loading **{name}** …{note}"
    try:
        lm, secs = models.load_with_timing(name)
    except Exception as exc:
        yield f"⚠ Could not load **{name}**: {models.friendly_error(exc)}"
        return
    yield f"✓ {models.describe(lm)} · ready ({secs:.1f} s)"


def set_tau(tau, tau_off, request: gr.Request | None = None):
    """τ slider / 'off' box moved: the running race (if any) uses the new τ from its next forward pass."""
    try:
        value = effective_tau(tau, tau_off)
    except ValueError as exc:
        return f"⚠ {exc}"
    key = _session(request)
    with _tau_lock:
        control = _tau_controls.get(key)
    if control is None:
        return f"τ = {'off' if value >= 1.0 else f'{value:.2f}'} (applies to the next run)"
    control.value = value
    return f"τ → {'off' if value >= 1.0 else f'{value:.2f}'} from the next forward pass"


def _session(request) -> str:
    return getattr(request, "session_hash", None) or "default"


def _outputs(status, mars, ar, ar_label, final=False):
    """The tuple of values the race yields (see OUTPUT ORDER in ui.py)."""
    vals = [status,
            render_chunks(mars, "MARS output appears here"),
            render_chunks(ar, "AR output appears here"),
            render_stats(mars, ar, ar_label)]
    if final:
        mars_toks = [t for s in mars.steps for t in s.tokens]
        ar_toks = [t for s in ar.steps for t in s.tokens]
        last = max(0, mars.forwards - 1)
        vals += [plots.tokens_per_forward_figure(mars), plots.acceptance_figure(mars),
                 plots.diff_figure(mars_toks, ar_toks),
                 gr.update(minimum=0, maximum=max(1, last), value=0, interactive=mars.forwards > 1),
                 render_ledger(mars, 0), (mars, ar)]
    else:
        vals += [gr.skip()] * 6
    return tuple(vals)


def check_criterion(criterion) -> str:
    if criterion not in CRITERIA:
        raise ValueError(f"confidence criterion {criterion!r} is unknown; use one of {', '.join(CRITERIA)}")
    return criterion


def run_race(choice, free_text, ar_choice, prompt, tau, tau_off, block_size, max_new_tokens, temperature,
             slow_motion=1, jobs=None, request: gr.Request | None = None, criterion="prob"):
    """Stream MARS and the AR baseline side by side; least compute so far runs the next forward."""
    mars, ar = SideRecord("MARS", "mars"), SideRecord("AR", "ar")
    try:
        prompt, tau, block_size, max_new_tokens, temperature = check_inputs(
            prompt, tau, tau_off, block_size, max_new_tokens, temperature)
        if slow_motion not in [v for _, v in SLOW_MOTION]:
            raise ValueError(f"slow motion {slow_motion!r} is not one of {[v for _, v in SLOW_MOTION]}")
        criterion = check_criterion(criterion)
        name = models.resolve(choice, free_text, jobs)
        ar_name = name if ar_choice in (None, "", models.SAME_MODEL) else models.resolve(ar_choice, "", jobs)
    except Exception as exc:
        yield _outputs(f"⚠ {models.friendly_error(exc)}", mars, ar, "AR")
        return
    ar_label = "AR (same model, τ off)" if ar_name == name else f"AR ({ar_name})"
    ar.label = ar_label
    try:
        for n in dict.fromkeys([name, ar_name]):
            if not models.is_loaded(n):
                yield _outputs(f"Loading **{n}** …{models.loading_note(n)}", mars, ar, ar_label)
            models.get_model(n)
        lm, ar_lm = models.get_model(name), models.get_model(ar_name)
    except Exception as exc:
        yield _outputs(f"⚠ Could not load the model: {models.friendly_error(exc)}", mars, ar, ar_label)
        return

    from mars_core import DecodeConfig, TauControl, generate_stream
    control = TauControl(tau)
    key = _session(request)
    with _tau_lock:
        _tau_controls[key] = control
    try:
        seed = 0 if temperature > 0 else None
        mars_cfg = DecodeConfig(mode="mars", tau=tau, block_size=block_size, max_new_tokens=max_new_tokens,
                                temperature=temperature, seed=seed, criterion=criterion)
        ar_cfg = DecodeConfig(mode="ar", tau=1.0, block_size=block_size, max_new_tokens=max_new_tokens,
                              temperature=temperature, seed=seed)
        texts = {"mars": token_texts(lm), "ar": token_texts(ar_lm)}
        sides = {"mars": mars, "ar": ar}
        streams = race(generate_stream(lm, [prompt], mars_cfg, tau_control=control),
                       generate_stream(ar_lm, [prompt], ar_cfg))
        yield _outputs("▶ Racing …", mars, ar, ar_label)
        last = 0.0
        for side, event in streams:
            sides[side].add(event, texts[side])
            if slow_motion > 1:
                time.sleep((slow_motion - 1) * event.step_time)
            now = time.perf_counter()
            if now - last >= YIELD_EVERY_S:
                last = now
                yield _outputs("▶ Racing …", mars, ar, ar_label)
        mars.finished = ar.finished = True
        yield _outputs(f"✓ Done: MARS {mars.tokens_per_forward:.2f} tokens/forward, "
                       f"{mars.forwards} forwards vs {ar.forwards} for AR.", mars, ar, ar_label, final=True)
    except Exception as exc:
        yield _outputs(f"⚠ Generation failed: {models.friendly_error(exc)}", mars, ar, ar_label)
    finally:
        with _tau_lock:
            if _tau_controls.get(key) is control:
                del _tau_controls[key]


def show_ledger(race_state, side, step):
    if not race_state:
        return render_ledger(SideRecord("MARS", "mars"), 0)
    mars, ar = race_state
    return render_ledger(ar if side == "AR" else mars, int(step or 0))


def ledger_side_changed(race_state, side):
    """Switching MARS/AR resets the step slider to that side's range."""
    if not race_state:
        return gr.update(), show_ledger(race_state, side, 0)
    rec = race_state[1] if side == "AR" else race_state[0]
    return (gr.update(minimum=0, maximum=max(1, rec.forwards - 1), value=0, interactive=rec.forwards > 1),
            render_ledger(rec, 0))


def examples_for(choice, free_text="", jobs=None):
    name = (free_text or "").strip() or choice or models.DEFAULT_MODEL
    prompts = models.example_prompts(name, jobs=jobs)
    return gr.update(choices=prompts, value=None)


PREPARE_POLL_S = 2.0  # how often the page asks about the background model (gr.Timer in ui.py)


def poll_default_model(choice, free_text="", picked=False, jobs=None):
    """Timer tick / page load: the background model's status line, and the switch to it once it is ready.

    Returns (status markdown, picker update, examples update, timer update). The picker moves to
    smollm2-mars only when it is ready, the user has not picked a model (`picked`, set by the picker's
    input event) and the free field is empty; the examples follow it. The timer stops once nothing is
    left to wait for (ready, failed, not available, never started).
    """
    st = models.prepare_status()
    target = models.PREPARER.name
    stop = gr.Timer(active=False)
    if st["state"] == "preparing":
        return st["text"], gr.skip(), gr.skip(), gr.skip()
    if st["state"] != "ready":
        return st["text"], gr.skip(), gr.skip(), stop
    if picked or (free_text or "").strip() or choice == target or target not in models.builtin_names():
        return st["text"], gr.skip(), gr.skip(), stop
    return (st["text"], gr.update(choices=models.model_choices(jobs), value=target),
            gr.update(choices=models.example_prompts(target, jobs=jobs), value=None), stop)
