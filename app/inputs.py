"""The page's input checks, shared by the Generate, Learn and Explorer tabs.

A value that can run is made runnable: out-of-range numbers are clamped and a too long prompt is cut, each with
a note for the page. ValueError, naming the value and the fix, only for what cannot run (an empty prompt, a
non-number, an unknown choice).
"""
from __future__ import annotations

import gradio as gr

TAU_MIN, TAU_MAX = 0.5, 1.0
MAX_PROMPT_CHARS = 4000
MAX_NEW_TOKENS = 512
# Slow motion for teaching: after each forward, wait (factor - 1) × its measured time. Both sides are
# stretched by the same factor, so the relative speed on screen stays the measured one.
SLOW_MOTION = [("real time", 1), ("slow motion ×10", 10), ("slow motion ×50", 50), ("slow motion ×200", 200)]


def lenient(component):
    """Let a value the component refuses reach the handler as sent; the handler checks it and says in the page
    what is wrong (a slider's out-of-range value is clamped there, with a note).

    Gradio's own checks raise before the handler: a slider refuses an out-of-range value with an error toast for
    every event that reads it (τ typed as 1.5 gave two or three stacked toasts), and a non-number sent through
    the API to a number field reaches the client only as "the upstream Gradio app has raised an exception".
    The instance's preprocess is wrapped: subclassing a Gradio component would make Gradio write a .pyi stub
    next to this file at import.
    """
    checked = component.preprocess

    def preprocess(payload):
        try:
            return checked(payload)
        except Exception:
            return payload

    component.preprocess = preprocess
    return component


def check_flag(value, name: str) -> bool:
    """A checkbox's value: True or False (a client may send anything else, which `bool()` would take as True)."""
    if isinstance(value, bool):
        return value
    raise ValueError(f"{name} is {'empty' if value in (None, '') else repr(value)}: send true or false")


def whole(value, name: str, lo: int, hi: int) -> int:
    """A whole number in lo..hi, or ValueError naming the field and the range (nothing is clamped)."""
    notes: list[str] = []
    v = clamp(value, lo, hi, name, notes, integer=True, fmt="{:g}")
    if notes or float(value) != v:
        raise ValueError(f"{name} {value!r} is not a whole number in {lo}..{hi}: type one")
    return v


def clamp(value, lo, hi, name: str, notes: list[str], integer: bool = False, fmt="{:g}"):
    """value clamped to [lo, hi]; a note says so when it moved. ValueError when it is not a number."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} is {'empty' if value in (None, '') else repr(value)}: "
                         f"type a number in {fmt.format(lo)}..{fmt.format(hi)}") from None
    if v != v:
        raise ValueError(f"{name} is not a number: type a number in {fmt.format(lo)}..{fmt.format(hi)}")
    c = min(hi, max(lo, v))
    if integer:
        c = int(round(c))
    if c != v:
        side = "below" if v < lo else "above"
        notes.append(f"{name} {fmt.format(v)} is {side} the range {fmt.format(lo)}..{fmt.format(hi)}: "
                     f"ran with {fmt.format(c)}")
    return c


def check_prompt_and_tau(prompt, tau, tau_off) -> tuple[str, float, list[str]]:
    """The prompt and τ, made runnable: (prompt, τ, notes). What the Learn tab reads; the Generate tab checks
    them the same way (check_inputs)."""
    notes: list[str] = []
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("the prompt is empty: type a question or pick an example")
    if len(prompt) > MAX_PROMPT_CHARS:
        notes.append(f"the prompt has {len(prompt):,} characters: cut to the first {MAX_PROMPT_CHARS:,} (the limit)")
        prompt = prompt[:MAX_PROMPT_CHARS]
    return prompt, effective_tau(tau, tau_off, notes), notes


def check_inputs(prompt, tau, tau_off, block_size, max_new_tokens, temperature) -> tuple:
    """The Generate tab's inputs, made runnable: (prompt, τ, B, max new tokens, temperature, notes)."""
    prompt, tau, notes = check_prompt_and_tau(prompt, tau, tau_off)
    block_size = clamp(block_size, 2, 8, "block size B", notes, integer=True)
    max_new_tokens = clamp(max_new_tokens, 1, MAX_NEW_TOKENS, "max new tokens", notes, integer=True)
    temperature = clamp(temperature, 0.0, 2.0, "temperature", notes)
    return prompt, tau, block_size, max_new_tokens, temperature, notes


def effective_tau(tau, tau_off, notes: list[str] | None = None) -> float:
    """τ from the slider, or 1.0 (one-token mode) when 'off' is ticked; clamped into [TAU_MIN, TAU_MAX]
    with a note (ValueError when `notes` is None and τ is out of range, or when it is not a number)."""
    if tau_off:
        return 1.0
    if notes is None:
        try:
            value = float(tau)
        except (TypeError, ValueError):
            raise ValueError(f"τ is {'empty' if tau in (None, '') else repr(tau)}: type a number in "
                             f"{TAU_MIN}..{TAU_MAX}") from None
        if not TAU_MIN <= value <= TAU_MAX:
            raise ValueError(f"τ {value:g} is out of range; use {TAU_MIN}..{TAU_MAX} "
                             "(or tick 'off' for one-token mode)")
        return value
    value = clamp(tau, TAU_MIN, TAU_MAX, "τ", notes, fmt="{:.2f}")
    if notes and notes[-1].startswith("τ ") and value >= 1.0:
        notes[-1] += " (one-token mode)"
    return value


def check_seed(seed, temperature, notes) -> int | None:
    """The sampling seed (None when greedy); an empty field means 0, said in a note."""
    if temperature <= 0:   # greedy: no seed is used, but a value that is not a number is still named
        if seed not in (None, ""):
            clamp(seed, 0, 2**31 - 1, "seed", [], integer=True, fmt="{:.0f}")
        return None
    if seed in (None, ""):
        notes.append("the seed field is empty: sampled with seed 0")
        return 0
    return clamp(seed, 0, 2**31 - 1, "seed", notes, integer=True, fmt="{:.0f}")


def check_criterion(criterion) -> str:
    from mars_core.decode.config import CRITERIA   # here, not at import: mars_core.decode.config imports torch
    if criterion not in CRITERIA:
        what = "no confidence criterion is chosen" if criterion in (None, "") else \
            f"confidence criterion {criterion!r} is unknown"
        raise ValueError(f"{what}; use one of {', '.join(CRITERIA)}")
    return criterion


def check_slow_motion(factor) -> int:
    """The slow-motion factor as an int. The page's dropdown (and so the API, which documents it as
    '1' | '10' | '50' | '200') sends a string; Python callers may pass the int."""
    allowed = {str(v): v for _, v in SLOW_MOTION}
    key = None if isinstance(factor, bool) or not isinstance(factor, (int, str)) else str(factor).strip()
    if key not in allowed:
        raise ValueError(f"slow motion {'is empty' if factor in (None, '') else repr(factor)}: pick one of "
                         f"{', '.join(label for label, _ in SLOW_MOTION)} ({' | '.join(allowed)})")
    return allowed[key]
