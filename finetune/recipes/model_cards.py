"""The embedded models' cards (OUT/<model>/README.md): shape, training runs, evaluation table and notes.

Written from the recipe's settings (finetune.recipes.recipe_settings), its stage records (WORK/recipe_info.json) and
this run's evaluation rows, so a card never repeats the numbers of an earlier run.
"""

from __future__ import annotations

from pathlib import Path

from finetune.recipes.recipe_settings import AR_SFT, AR_SFT_2, MARS, MODEL, TIMING_PROMPTS

STAGE1_RUNS = ["tiny-ar-sft-1", "tiny-ar-sft-2"]
CARD_RUNS = {"tiny-ar-sft": STAGE1_RUNS + ["tiny-ar-sft"], "tiny-mars": STAGE1_RUNS + ["tiny-mars", "tiny-mars-arw0"]}


def stage1_steps() -> int:
    return AR_SFT["max_steps"] + AR_SFT_2["max_steps"]


def intro(name: str) -> str:
    """The card's opening paragraph: what the model is."""
    if name == "tiny-ar-sft":
        return ("The AR baseline of the MARS recipe: a tiny Llama trained from scratch with plain AR-SFT on "
                "the built-in task suite (stage 1), then given the same stage-2 steps and data as "
                "`tiny-mars` with the AR loss alone: the matched baseline for `tiny-mars`.")
    mars = MARS
    return ("Stage 2 of the MARS recipe (arXiv 2604.07023): the stage-1 AR-SFT model fine-tuned with the "
            f"MARS loss (B = {mars['block_size']}, ar_weight = {mars['ar_weight']:g}"
            + (", the block grid shifted at random every step (docs/experiments.md, \"Block phase\")"
               if mars.get("random_block_offset") else "") + "). The same "
            "architecture and weight count as the AR model — no heads, no draft model; decode with "
            "`mars_core` and a confidence threshold τ.")


def write_cards(out: Path, info: dict, rows: dict[str, list[dict]], command: str,
                timing_prompts: int = TIMING_PROMPTS) -> None:
    """README.md of each evaluated embedded model (`rows`: model name -> its rows; `timing_prompts`: how many
    prompts the speedups were timed on)."""
    # The stage-1 score is quoted only when stage 1 ran at the recipe's length (not under --scale).
    recipe_stage1 = all(info["stages"].get(r, {}).get("steps") == s["max_steps"]
                        for r, s in zip(STAGE1_RUNS, (AR_SFT, AR_SFT_2)))
    for name in ("tiny-ar-sft", "tiny-mars"):
        if name in rows:
            table_rows = rows[name]
            if name == "tiny-mars":   # the ablation and its matched ar_weight = 1 run (recipe_settings.ABLATION)
                table_rows = table_rows + rows.get("tiny-mars ar_weight=0", []) + rows.get("extra", [])
            card = model_card(name, intro(name), info, CARD_RUNS[name], table_rows, command,
                              card_notes(name, rows, recipe_stage1), timing_prompts)
            (out / name / "README.md").write_text(card)


def eval_row(rows: list[dict], model: str | None, tau: float) -> dict | None:
    """The probability-criterion row of `model` (None: any model) at `tau` (None if it was not measured)."""
    return next((r for r in rows if model in (None, r["model"]) and abs(r["tau"] - tau) < 1e-9
                 and r.get("criterion", "prob") == "prob"), None)


def card_notes(name: str, rows: dict[str, list[dict]], recipe_stage1: bool = True) -> str:
    """A card's findings, computed from this run's evaluation rows (`rows`: model name -> its rows), so a card
    never repeats the numbers of an earlier run. Development facts that no single run measures are named so.
    The stage-1 model's score comes from its own rows (`rows["stage-1"]`, recipe_settings.STAGE1_ROWS), quoted
    only for a stage 1 of the recipe's length (`recipe_stage1`)."""
    ar = eval_row(rows.get("tiny-ar-sft", []), "tiny-ar-sft", 1.0)
    mars = eval_row(rows.get("tiny-mars", []), "tiny-mars", 1.0)
    if name == "tiny-ar-sft":
        if ar is None:
            return ""
        weakest = min(ar["per_family"], key=ar["per_family"].get)
        met = ar["accuracy"] >= 0.8 and ar["per_family"][weakest] >= 0.5
        guess = eval_row(rows["tiny-ar-sft"], "tiny-ar-sft", 0.95)
        stage1 = eval_row(rows.get("stage-1", []), None, 1.0) if recipe_stage1 else None
        return (f"Notes: {ar['accuracy']:.1%} exact overall, weakest family {weakest} at "
                f"{ar['per_family'][weakest]:.0%} (the goal for an AR teaching model, ≥ 80% overall and every family "
                f"≥ 50%, is {'met' if met else 'NOT met'}). It is the matched baseline of tiny-mars: the same "
                "stage-1 start, the same stage-2 steps on the same draw, only the loss differs"
                + (stage1_note(stage1, ar) if stage1 else ".")
                + (f" Rows with τ < 1 decode this AR model with masks it was never trained on (τ = 0.95: "
                   f"{guess['accuracy']:.1%} at {guess['tokens_per_forward']:.2f} tokens/forward): MARS needs its "
                   "own training." if guess else ""))
    if name != "tiny-mars" or mars is None:
        return ""
    parts = ["Notes: "]
    if ar is not None:
        parts.append(f"against the matched AR baseline (tiny-ar-sft: the same stage-1 start, the same stage-2 steps "
                     f"on the same draw, AR loss only; {ar['accuracy']:.1%}) MARS at τ = 1 scores "
                     f"{mars['accuracy']:.1%} ({100 * (mars['accuracy'] - ar['accuracy']):+.1f} points; the paper's "
                     "claim is \"at least as good\"). ")
    fast = eval_row(rows["tiny-mars"], "tiny-mars", 0.95)
    if fast is not None:
        drops = sorted(((fast["per_family"][f] - mars["per_family"][f], f) for f in mars["per_family"]))[:2]
        cost = 100 * (fast["accuracy"] - mars["accuracy"])
        losers = ", ".join(f"{f} {mars['per_family'][f]:.0%} -> {fast['per_family'][f]:.0%}" for d, f in drops if d < 0)
        parts.append(f"At τ = 0.95 it scores {fast['accuracy']:.1%} ({cost:+.1f} points against τ = 1) at "
                     f"{fast['tokens_per_forward']:.2f} tokens per forward; "
                     + (f"{losers} lose most. " if losers else "no family loses. "))
    arw0 = eval_row(rows.get("tiny-mars ar_weight=0", []), "tiny-mars ar_weight=0", 1.0)
    if arw0 is not None:
        parts.append(f"The ablation (ar_weight = 0, no SFT loss in stage 2, otherwise the same run) scores "
                     f"{arw0['accuracy']:.1%} at τ = 1 against MARS's {mars['accuracy']:.1%}. ")
    parts.append(f"ar_weight is {MARS['ar_weight']:g}, not the paper's 1: at this size the mask loss competes with the "
                 "one-token path, and weighting the AR term up bought most of it back (development runs from the "
                 "5,500-step stage-1 model of earlier recipe versions, 1,000 fp32 steps, 400 held-out: τ = 1 85.0% "
                 "at ar_weight 1, 87.5% at 2, 89.5% at 3, 90.2% at 5"
                 + ("; the table's \"1,000 fp32 steps\" rows" if "extra" in rows else "") + "). Other confidence "
                 "criteria: `python -m finetune.evals.evaluate --models tiny-mars --criteria prob entropy margin`.")
    return "".join(parts)


def stage1_note(stage1: dict, ar: dict) -> str:
    """What stage 2's AR steps add to the stage-1 model, from both models' rows at τ = 1."""
    lagging = min(stage1["per_family"], key=stage1["per_family"].get)
    lifted = ar["per_family"].get(lagging, 0.0) > stage1["per_family"][lagging]
    held_out = f"{stage1['n']} " if "n" in stage1 else ""
    return (f"; the stage-1 model alone ({stage1_steps():,} eager fp32 steps, deterministic here) scored "
            f"{stage1['accuracy']:.1%} with {lagging} at {stage1['per_family'][lagging]:.0%} on {held_out}held-out "
            "questions" + (f", so the stage-2 AR steps are what lift {lagging}." if lifted else "."))


def timing_note(info: dict, runs: list[str], timing_prompts: int = TIMING_PROMPTS) -> str:
    """Where the card's wall times come from: which recipe invocation ran each run (recorded in recipe_info.json)."""
    keys = [r for r in ["base"] + runs + ["eval"] if r in info["stages"]]
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(info["stages"][key].get("invocation") or "not recorded", []).append(f"`{key}`")
    if list(groups) == ["not recorded"]:
        where = "Timing: which recipe invocation ran each run was not recorded (recipe_info.json predates it)."
    elif len(groups) == 1:
        (when,) = groups
        where = f"Timing: every run above and the evaluation ran in one invocation of the recipe (started {when})."
    else:
        where = ("Timing: the runs come from " + str(len(groups)) + " invocations of the recipe, a later one "
                 "continuing from the checkpoints of an earlier one: " + "; ".join(
                     f"{', '.join(names)} (started {when})" for when, names in groups.items()) + ".")
    return where + (" Stage 1 (eager fp32) is deterministic here: its first cycle came out byte for byte the same in "
                    "every whole recipe run measured; the compiled bf16 stage 2 is reproducible only approximately. "
                    f"Speedups come from the first {timing_prompts} held-out prompts timed at batch 1, one thread, "
                    "one model at a time (each the fastest of 3 alternating runs); where a model's answers change "
                    "length with τ, the speedup can differ from tokens/forward by more than the cost of a wider "
                    "forward.")


def training_lines(info: dict, runs: list[str]) -> str:
    """One card line per recorded training run: steps, wall time, threads, side-by-side runs, settings."""
    return "\n".join(
        f"  - run `{r}`: {info['stages'][r]['steps']} optimizer steps, "
        f"{info['stages'][r]['wall_s'] / 60:.1f} min wall, {info['stages'][r].get('threads', 1)} thread(s)"
        + "".join(", side by side with " + " and ".join(f"`{g}`" for g in side)
                  for side in [info["stages"][r].get("parallel_with")] if side)
        + "; "
        + ", ".join(f"{k}={v}" for k, v in info["stages"][r]["settings"].items())
        for r in runs if r in info["stages"]
    )


def recipe_seconds(name: str, info: dict) -> tuple[float, str]:
    """(seconds of the default stages, what `name`'s card says that sum leaves out).

    Runs side by side count once (the longest of the group). An ablation trained on its own
    (`--stages ablation,eval`) and its evaluation ("eval-ablation") are not part of it."""
    arw0 = info["stages"].get("tiny-mars-arw0")
    alone = bool(arw0) and not arw0.get("parallel_with")
    total, seen = 0.0, set()
    for key in ("base", "tiny-ar-sft-1", "tiny-ar-sft-2", "tiny-ar-sft", "tiny-mars", "eval"):
        if key in seen or key not in info["stages"]:
            continue
        group = [key] + [g for g in info["stages"][key].get("parallel_with", []) if g in info["stages"]]
        seen.update(group)
        total += max(info["stages"][g].get("wall_s", 0) for g in group)
    ablation = "" if not alone or name != "tiny-mars" else (
        f", not counting the ablation `tiny-mars-arw0` (`--stages ablation,eval`, {arw0['wall_s'] / 60:.1f} min)")
    if len({info["stages"][k].get("invocation") for k in seen if k in info["stages"]}) > 1:
        ablation += ("; they come from separate invocations (below), so runs the recipe puts side by side may be "
                     "counted one after the other: docs/experiments.md, \"Recipe time\", has an uninterrupted run")
    return total, ablation


def model_card(name: str, what: str, info: dict, runs: list[str], rows: list[dict], command: str,
               notes: str = "", timing_prompts: int = TIMING_PROMPTS) -> str:
    """README.md of an embedded model: shape, data, training runs, reproduction, evaluation table, notes."""
    from finetune.evals.evaluate import format_table
    from finetune.tasks import FAMILIES, HELDOUT_PERCENT

    training = training_lines(info, runs)
    total, ablation = recipe_seconds(name, info)
    return f"""# {name}

{what}

- Architecture: LlamaForCausalLM, {MODEL['num_hidden_layers']} layers, hidden {MODEL['hidden_size']}, \
{MODEL['num_attention_heads']} heads, MLP {MODEL['intermediate_size']}, tied embeddings, \
context {MODEL['max_position_embeddings']}; **{info['parameters']:,} parameters** (fp32).
- Tokenizer: byte-level BPE, {info['vocab_size']} tokens, digits always single tokens, trained on the suite
  (`finetune/tokenizer.py`). Special tokens: `<|im_start|>`, `<|im_end|>` (eos), `<|pad|>` (pad),
  `<|mask|>` (mask_token, the MARS mask id); ChatML chat template.
- Data: the built-in task suite (`finetune/tasks.py`), train split only; families: {', '.join(FAMILIES)}.
  Held-out = the {HELDOUT_PERCENT}% of questions whose hash falls in the held-out buckets (never trained on).
- Training (`python -m finetune.train`, batch 32, AdamW, cosine schedule, on a 2-core CPU; torch threads
  per run as listed):
{training}
- Reproduce (whole recipe, both models): `{command}`; the recorded stage wall times of these weights
  (runs above and evaluation; side-by-side runs counted once) add up to {total / 60:.0f} min{ablation}.

## Evaluation (held-out suite, {rows[0]['n'] if rows else 0} examples, greedy, B = 4)

Accuracy = exact final answer; tokens/forward = mean over sequences; speedup = AR (KV cache)
time ÷ this decoder's time, batch 1, same prompts and max_new_tokens, measured alternately.
τ = 1 is one-token mode (exactly greedy AR).

{format_table(rows)}

{notes}

{timing_note(info, runs, timing_prompts)}
"""
