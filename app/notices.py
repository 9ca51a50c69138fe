"""Right model, right message: notices for a model meeting prompts it was not trained for.

- The tiny models (tiny-mars, tiny-ar-sft) know only the built-in task suite: on any other text they
  write junk. `is_suite_task` recognises the suite's question shapes (finetune.tasks' templates).
- A model never MARS-trained (tiny-ar-sft, SmolLM2, an AR-SFT finetune run) has never learnt what a mask
  position should predict: its lossy MARS lane is guesses. Lossless MARS stays exact on it (its drafts are
  checked), one-token mode is plain AR.

Every `name` here is resolved (models.Resolver): a Finetune run is its checkpoint folder.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from app import models

# The question shapes of finetune.tasks' families (its generators' templates), numbers and names as wildcards.
_N = r"-?\d+"
_SUITE_PATTERNS = [
    rf"What is {_N} \+ {_N}\?", rf"Compute {_N} \+ {_N}\.", rf"Add {_N} and {_N}\.",
    rf"What is {_N} × {_N}\?", rf"Compute {_N} × {_N}\.", rf"Multiply {_N} by {_N}\.",
    rf"[A-Z][a-z]+ has {_N} [a-z]+\.( (Then )?[A-Z][a-z]+ [a-z]+( [a-z]+)? {_N}( more)?\.)+"
    rf" How many [a-z]+ does [A-Z][a-z]+ have now\?",
    rf"Sort in (ascending|descending) order: {_N}(, {_N})*",
    r"Reverse the letters: [a-z]( [a-z])*", r"Write these letters backwards: [a-z]( [a-z])*",
    rf"Convert {_N} [A-Za-z]+ to [A-Za-z]+\.", rf"How many [A-Za-z]+ are in {_N} [A-Za-z]+\?",
    r"Write a Python function [a-z_]+\(x\) that .+\.",
    rf"Which is larger, {_N} or {_N}\?", rf"Which number is bigger: {_N} or {_N}\?",
]
_SUITE_RE = re.compile("|".join(f"(?:{p})" for p in _SUITE_PATTERNS))

NOT_MARS_TRAINED = ("tiny-ar-sft", "smollm2", "smollm2-135m-instruct")


def is_suite_task(prompt: str) -> bool:
    """Whether `prompt` has the shape of a built-in task-suite question (what the tiny models were trained on)."""
    return bool(_SUITE_RE.fullmatch((prompt or "").strip()))


def _run_config(name: str) -> dict:
    """The train_config.json of a checkpoint folder (a run resolves to one), {} for a model without one."""
    try:
        return json.loads((Path(name) / "train_config.json").read_text())
    except (OSError, ValueError, AttributeError):
        return {}


def knows_only_tasks(name: str) -> bool:
    """The tiny models and runs fine-tuned from them on the built-in suite."""
    if name in models.TINY_MODELS:
        return True
    cfg = _run_config(name)
    return cfg.get("data") == "builtin" and str(cfg.get("base_model", "")).startswith("tiny-")


def never_mars_trained(name: str) -> bool:
    """Known to have had no MARS training: the AR baselines, SmolLM2, AR-SFT runs."""
    if name in NOT_MARS_TRAINED:
        return True
    cfg = _run_config(name)
    return cfg.get("stage") == "ar-sft" and "mars" not in str(cfg.get("base_model", ""))


def real_language_mars_model() -> str | None:
    return models.SMOLLM2_MARS if models.smollm2_mars_available() else None


def notice(name: str, prompt: str, tau: float) -> tuple[str, str | None, bool]:
    """(markdown, model to offer or None, offer one-token mode) for the model `name` on `prompt` at τ."""
    lines, offer_model, offer_off = [], None, False
    mars = tau < 1.0
    if knows_only_tasks(name) and (prompt or "").strip() and not is_suite_task(prompt):
        real = real_language_mars_model()
        lines.append(f"**{_short(name)}** was trained only on the built-in task suite (sums, sorting, unit "
                     f"conversions, …): on other text every lane writes junk, MARS or not. "
                     + (f"For free text use **{real}**, a real-language MARS model." if real
                        else "Pick an example prompt, or a real-language model."))
        offer_model = real
    if never_mars_trained(name) and mars:
        lines.append(f"**{_short(name)}** was never MARS-trained: its mask positions are guesses, so the lossy "
                     f"MARS lane is unreliable (the lossless lane stays exactly AR's answer, with few drafts "
                     f"confirmed). Use one-token mode (τ off) or a MARS model"
                     + (f" such as **tiny-mars**" if knows_only_tasks(name) else
                        f" such as **{real_language_mars_model()}**" if real_language_mars_model() else "") + ".")
        offer_off = True
        if offer_model is None:
            offer_model = "tiny-mars" if knows_only_tasks(name) else real_language_mars_model()
    return "\n\n".join("ℹ " + line for line in lines), offer_model, offer_off


def race_notice(name: str, prompt: str, tau: float) -> str:
    """The notice as plain text for the race's status line ('' when none)."""
    text, _, _ = notice(name, prompt, tau)
    return text.replace("ℹ ", "").replace("\n\n", " ")


def _short(name: str) -> str:
    return Path(name).name if "/" in name and Path(name).exists() else name


PREDICT = ("**Predict before you click:** which words will arrive together, in one forward pass? The status line "
           "answers after the race.")


def _block_note(name: str) -> str:
    """', with 2 masks per forward (B = 3) …' where the page starts a model below B = 4: why, and where to change
    it."""
    b = models.default_block_size(name)
    if b >= models.DEFAULT_BLOCK_SIZE:
        return ""
    masks = "one mask" if b == 2 else f"{b - 1} masks"
    return (f", with {masks} per forward (B = {b}): on development prompts that ran faster than "
            f"{models.DEFAULT_BLOCK_SIZE - 1} masks, whose forwards cost more (block size in Advanced settings "
            "changes it)")


def teaching_note(name: str) -> str:
    """'What you are seeing' for a real-language MARS model, and the question to ask before the race for every MARS
    model ('' for the others, whose notices say enough)."""
    if name in models.TINY_MODELS and not never_mars_trained(name):
        return PREDICT
    if name not in models.NATURAL_MODELS or never_mars_trained(name):
        return ""
    # folded: on a projector the explanation must not push the lanes below the first screen
    return (PREDICT + f"\n\n<details><summary><b>What you are seeing</b> on {_short(name)} (open)</summary>"
            f"{_short(name)} starts at τ {models.default_tau(name):g}, where its lossy answers to the examples are "
            f"AR's{_block_note(name)}. Lists, counting and arithmetic arrive in multi-token chunks more often; on "
            "ordinary sentences most chunks are one token, and one forward of MARS costs more than one of AR, so "
            "there the MARS lane can be slower than AR. The lossless lane checks each draft against "
            "AR's own next token, so its text is AR's exactly; it gains wherever drafts are confirmed. For the "
            "clearest multi-token picture, use tiny-mars.</details>")
