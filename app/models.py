"""Which models the app may load, loading them once, and example prompts that suit each.

The picker offers the embedded models, SmolLM2 (offline), finished Finetune runs
(addressed as "run:<name>", resolved inside the runs directory only) and a free
field: a local directory / .gguf file or a hub id the user types. Loading itself is
`mars_core.load_model`; this module only validates names and caches results.
"""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path

BUILTIN_MODELS = [
    ("tiny-mars — embedded MARS model (B=4)", "tiny-mars"),
    ("tiny-ar-sft — embedded AR-SFT baseline", "tiny-ar-sft"),
    ("smollm2 — SmolLM2-135M-Instruct (offline, AR only)", "smollm2"),
]
DEFAULT_MODEL = "tiny-mars"
SAME_MODEL = "same"  # AR baseline = the selected checkpoint in one-token mode
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")
TINY_MODELS = ("tiny-mars", "tiny-ar-sft")

GENERAL_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "List three primary colours.",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "What is 12 times 12?",
]

_cache: dict[str, object] = {}
_lock = threading.Lock()


def model_choices(jobs=None) -> list[tuple[str, str]]:
    """(label, value) pairs for the picker; finished runs come last, newest first."""
    choices = list(BUILTIN_MODELS)
    if jobs is not None:
        for name, _path in jobs.finished_checkpoints():
            choices.append((f"run: {name} (your finetune)", f"run:{name}"))
    return choices


def resolve(choice: str, free_text: str = "", jobs=None) -> str:
    """The name or path to hand to mars_core.load_model; ValueError for anything not allowed.

    A typed path must exist (a transformers directory or a .gguf file); a typed hub id
    must look like owner/name. Runs resolve only to checkpoints inside the runs directory.
    """
    free_text = (free_text or "").strip()
    if free_text:
        if len(free_text) > 300 or any(c in free_text for c in "\n\r\0"):
            raise ValueError("the model field holds a path or hub id of at most 300 characters on one line")
        path = Path(free_text).expanduser()
        if path.exists():
            if path.is_dir() and (path / "config.json").exists():
                return str(path.resolve())
            if path.is_file() and path.suffix == ".gguf":
                return str(path.resolve())
            raise ValueError(f"{free_text!r} is neither a transformers directory (with config.json) nor a .gguf file")
        if free_text.startswith(("/", ".", "~")) or "\\" in free_text:
            raise ValueError(f"path {free_text!r} does not exist; type an existing directory or .gguf file")
        if not HUB_ID_RE.match(free_text):
            raise ValueError(f"{free_text!r} is not a local path or a hub id like 'owner/model'")
        return free_text
    if not choice:
        raise ValueError("pick a model from the list or type a path / hub id")
    if choice.startswith("run:"):
        if jobs is None:
            raise ValueError("finetune runs are not available in this app")
        return jobs.checkpoint_for(choice[4:])
    known = [v for _, v in BUILTIN_MODELS]
    if choice not in known:
        raise ValueError(f"model {choice!r} is not in the list {known}; type other paths in the free field")
    return choice


def is_loaded(name: str) -> bool:
    return name in _cache


def get_model(name: str):
    """mars_core.load_model(name), loaded once per server process (thread-safe)."""
    with _lock:
        if name not in _cache:
            from mars_core import load_model
            lm = load_model(name)
            warm_up(lm)
            _cache[name] = lm
        return _cache[name]


def warm_up(lm) -> None:
    """One short decode in each mode, so one-off start-up costs do not land on either side of a race."""
    from mars_core import DecodeConfig, generate
    for mode in ("ar", "mars"):
        generate(lm, ["Hi"], DecodeConfig(mode=mode, max_new_tokens=4))


def load_with_timing(name: str):
    t0 = time.perf_counter()
    lm = get_model(name)
    return lm, time.perf_counter() - t0


def describe(lm) -> str:
    n_params = sum(p.numel() for p in lm.model.parameters())
    return (f"**{lm.name}** · {n_params / 1e6:.1f} M parameters · device {lm.device} · "
            f"mask token id {lm.mask_id} · `{lm.path}`")


def friendly_error(exc: BaseException) -> str:
    """One readable line for the page: never a stack trace."""
    msg = str(exc).strip().splitlines()
    first = msg[0] if msg else ""
    if isinstance(exc, (ValueError, FileNotFoundError)):
        return first or type(exc).__name__
    if isinstance(exc, OSError) and ("connect" in first.lower() or "offline" in first.lower()
                                      or "resolve" in first.lower() or "hub" in first.lower()):
        return f"could not fetch the model (this machine is offline?): {first[:300]}"
    return f"{type(exc).__name__}: {first[:300]}"


def _trained_on_builtin(name: str, jobs=None) -> bool:
    """A model from finetune.train on the built-in suite (its train_config.json says data = builtin)."""
    import json
    try:
        path = Path(jobs.checkpoint_for(name[4:])) if name.startswith("run:") and jobs else Path(name)
        return json.loads((path / "train_config.json").read_text()).get("data") == "builtin"
    except (OSError, ValueError, AttributeError):
        return False


def example_prompts(name: str, n: int = 6, jobs=None) -> list[str]:
    """Prompts that suit the model: held-out task prompts for the tiny models and anything trained on the
    built-in suite, general prompts otherwise."""
    if name in TINY_MODELS or _trained_on_builtin(name, jobs):
        try:
            from finetune.tasks import make_examples
            examples = make_examples("heldout", n, seed=0)
            return [ex["messages"][0]["content"] for ex in examples]
        except Exception:  # finetune.tasks missing or broken: fall back to general prompts
            pass
    return list(GENERAL_PROMPTS)
