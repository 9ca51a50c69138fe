"""The recipe's command lines are valid finetune.train command lines, and --compile auto follows the compiler."""

import json
import os
import shutil
from pathlib import Path

import pytest

from finetune.recipes import model_cards, recipe
from finetune.config import config_from_args


@pytest.mark.parametrize("name", ["AR_SFT", "AR_SFT_2", "AR_SFT_3", "MARS", "ABLATION"])
def test_every_stage_command_parses_to_its_settings(name):
    settings = dict(getattr(recipe, name), compile=True)   # every stage, so the flag is parsed too
    cmd = recipe.train_cmd("base", Path("out"), settings, seed=0, threads=1)
    assert cmd[1:3] == ["-m", "finetune.train"]
    cfg = config_from_args(cmd[3:])
    assert cfg.seed == settings.get("seed_offset", 0)   # a continued stage draws fresh data
    for key, value in settings.items():
        if key != "seed_offset":
            assert getattr(cfg, key) == value, key


def test_compile_auto_needs_a_compiler_on_path_and_a_toy_compile_that_works():
    clang_only = lambda c: "/usr/bin/" + c if c == "clang++" else None   # noqa: E731
    assert recipe.compile_wanted("auto", which=clang_only, works=lambda: True)
    assert not recipe.compile_wanted("auto", which=clang_only, works=lambda: False)
    assert not recipe.compile_wanted("auto", which=lambda c: None,
                                     works=lambda: pytest.fail("probed without a compiler"))
    assert recipe.compile_wanted("on", which=lambda c: None)
    assert not recipe.compile_wanted("off", which=lambda c: "/usr/bin/g++")
    with pytest.raises(ValueError, match="'yes'.*auto, on or off"):
        recipe.compile_wanted("yes")


def test_only_stage_2_compiles_and_only_when_asked():
    compiled = {name: recipe.stage_settings(getattr(recipe, name), compile_=True).get("compile", False)
                for name in ("AR_SFT", "AR_SFT_2", "AR_SFT_3", "MARS", "ABLATION")}
    assert compiled == {"AR_SFT": False, "AR_SFT_2": False, "AR_SFT_3": True, "MARS": True, "ABLATION": True}
    assert "compile" not in recipe.stage_settings(recipe.MARS, compile_=False)


def test_scale_shrinks_steps_and_data_but_keeps_a_runnable_stage():
    s = recipe.stage_settings(recipe.AR_SFT, scale=0.001)
    assert s["max_steps"] == 4 and s["builtin_examples"] == 112 and s["warmup_steps"] == 2
    assert recipe.stage_settings(recipe.AR_SFT) == recipe.AR_SFT   # scale 1 changes nothing


def test_a_stage_exports_the_checkpoint_its_finished_run_names(tmp_path):
    from finetune.status import RunStatus, write_status

    with pytest.raises(RuntimeError, match=r"did not finish \(None, None\)"):
        recipe.final_checkpoint(tmp_path)   # no status.json: the run never started
    write_status(tmp_path, RunStatus(state="failed", error="boom"))
    with pytest.raises(RuntimeError, match=r"did not finish \(failed, boom\)"):
        recipe.final_checkpoint(tmp_path)
    write_status(tmp_path, RunStatus(state="finished", last_checkpoint=str(tmp_path / "checkpoint-3")))
    assert recipe.final_checkpoint(tmp_path) == tmp_path / "checkpoint-3"


@pytest.mark.slow
def test_the_toy_compile_fails_without_a_compiler_and_works_with_one():
    assert not recipe.compile_works(env=dict(os.environ, PATH="/nonexistent"))
    if any(shutil.which(c) for c in recipe.CXX):
        assert recipe.compile_works()


def _card_info(arw0_parallel: list[str]) -> dict:
    stage = lambda minutes, side=(): {"settings": {}, "steps": 10, "wall_s": 60 * minutes,   # noqa: E731
                                      "threads": 1, "parallel_with": list(side)}
    return {"parameters": 1, "vocab_size": 512, "stages": {
        "base": {"wall_s": 6.0}, "tiny-ar-sft-1": stage(18), "tiny-ar-sft-2": stage(10),
        "tiny-ar-sft": stage(14, ["tiny-mars"] + arw0_parallel),
        "tiny-mars": stage(23, ["tiny-ar-sft"] + arw0_parallel),
        "tiny-mars-arw0": stage(30, [] if not arw0_parallel else ["tiny-ar-sft", "tiny-mars"]),
        "eval": {"wall_s": 240.0}, "eval-ablation": {"wall_s": 120.0}}}


def test_card_time_counts_side_by_side_runs_once_and_an_ablation_trained_apart_not_at_all():
    # 0.1 + 18 + 10 + max(14, 23) + 4 = 55.1 min; the ablation trained on its own (30 min) and evaluated apart is
    # named but not added; trained side by side with stage 2 it is the group's longest run and counts.
    card = model_cards.model_card("tiny-mars", "what", _card_info([]), ["tiny-mars"], [], "cmd")
    assert "add up to 55 min, not counting the ablation `tiny-mars-arw0` (`--stages ablation,eval`, 30.0 min)" in card
    card = model_cards.model_card("tiny-mars", "what", _card_info(["tiny-mars-arw0"]), ["tiny-mars"], [], "cmd")
    assert "add up to 62 min." in card and "not counting" not in card
    card = model_cards.model_card("tiny-ar-sft", "what", _card_info([]), ["tiny-ar-sft"], [], "cmd")
    assert "add up to 55 min." in card


def test_stage2_steps_sets_the_length_and_one_fresh_example_per_row():
    s = recipe.stage_settings(recipe.MARS, steps=3000)
    assert s["max_steps"] == 3000 and s["builtin_examples"] == 3000 * s["batch_size"]
    assert recipe.stage_settings(recipe.MARS, steps=recipe.STAGE2["max_steps"]) == recipe.stage_settings(recipe.MARS)
    assert recipe.stage_settings(recipe.MARS, scale=0.01, steps=3000)["max_steps"] == 30
    with pytest.raises(ValueError, match="--stage2-steps 0"):
        recipe.stage_settings(recipe.MARS, steps=0)


def _rows(model: str, tau: float, acc: float, tpf: float, **families) -> dict:
    per_family = dict({"addition": 1.0, "units": 1.0, "sorting": 1.0}, **families)
    return {"model": model, "tau": tau, "criterion": "prob", "accuracy": acc, "tokens_per_forward": tpf,
            "per_family": per_family}


def test_card_notes_are_computed_from_this_runs_rows_not_copied_from_the_shipped_run():
    rows = {"tiny-ar-sft": [_rows("tiny-ar-sft", 1.0, 0.913, 1.0, sorting=0.52),
                            _rows("tiny-ar-sft", 0.95, 0.011, 1.9, sorting=0.0)],
            "tiny-mars": [_rows("tiny-mars", 1.0, 0.925, 1.0, units=0.9, sorting=0.8),
                          _rows("tiny-mars", 0.95, 0.9, 2.0, units=0.9),
                          _rows("tiny-mars", 0.95, 0.871, 2.57, units=0.7, sorting=0.75)]}
    rows["tiny-mars"][1]["criterion"] = "entropy"   # listed first at the same τ, yet not the row reported
    rows["tiny-mars ar_weight=0"] = [_rows("tiny-mars ar_weight=0", 1.0, 0.067, 1.0)]
    mars = model_cards.card_notes("tiny-mars", rows)
    assert "(tiny-ar-sft: " in mars and "; 91.3%) MARS at τ = 1 scores 92.5% (+1.2 points" in mars
    assert "At τ = 0.95 it scores 87.1% (-5.4 points against τ = 1) at 2.57 tokens per forward" in mars
    assert "units 90% -> 70%, sorting 80% -> 75% lose most" in mars
    assert "scores 6.7% at τ = 1 against MARS's 92.5%" in mars
    assert "96.2%" not in mars and "3.41" not in mars   # the shipped run's numbers
    ar = model_cards.card_notes("tiny-ar-sft", rows)
    assert ar.startswith("Notes: 91.3% exact overall, weakest family sorting at 52%") and "is met" in ar
    assert "(τ = 0.95: 1.1% at 1.90 tokens/forward)" in ar
    stage1 = "scored 80.8% with sorting at 8% on 400 held-out questions, so the stage-2 AR steps are what lift sorting."
    assert stage1 not in ar   # the stage-1 model was not measured: nothing claimed
    rows["stage-1"] = [dict(_rows("final", 1.0, 0.808, 1.0, sorting=0.08), n=400)]
    ar = model_cards.card_notes("tiny-ar-sft", rows)
    assert stage1 in ar and stage1 not in model_cards.card_notes("tiny-ar-sft", rows, recipe_stage1=False)  # --scale
    rows["tiny-ar-sft"][0]["per_family"]["sorting"] = 0.49
    assert "is NOT met" in model_cards.card_notes("tiny-ar-sft", rows)
    assert model_cards.card_notes("tiny-mars", {}) == ""   # nothing measured, nothing claimed


def test_card_timing_names_the_recipe_invocations_the_runs_came_from():
    info = _card_info(["tiny-mars-arw0"])
    runs = ["tiny-ar-sft-1", "tiny-ar-sft-2", "tiny-mars"]
    assert "was not recorded" in model_cards.timing_note(info, runs)
    for stage in info["stages"].values():
        stage["invocation"] = "2026-11-30 18:57 UTC"
    assert "ran in one invocation of the recipe (started 2026-11-30 18:57 UTC)" in model_cards.timing_note(info, runs)
    for key in ("base", "tiny-ar-sft-1", "tiny-ar-sft-2"):
        info["stages"][key]["invocation"] = "2026-11-30 12:06 UTC"
    note = model_cards.timing_note(info, runs)
    assert ("2 invocations of the recipe, a later one continuing from the checkpoints of an earlier one: `base`, "
            "`tiny-ar-sft-1`, `tiny-ar-sft-2` (started 2026-11-30 12:06 UTC); `tiny-mars`, `eval` (started "
            "2026-11-30 18:57 UTC)") in note


@pytest.mark.slow
def test_the_whole_recipe_at_a_tiny_scale_trains_the_ablation_only_when_asked(tmp_path, monkeypatch):
    # Every stage for real (subprocesses of finetune.train and finetune.evals.evaluate), a few steps each.
    monkeypatch.setattr(recipe, "TIMING_PROMPTS", 1)
    out, work, arw0 = tmp_path / "out", tmp_path / "work", tmp_path / "arw0"
    common = ["--out", str(out), "--work", str(work), "--ablation-dir", str(arw0), "--scale", "0.001",
              "--eval-n", "4", "--compile", "off", "--cores", "2"]
    recipe.main(common)
    info = json.loads((work / "recipe_info.json").read_text())
    assert {"base", "tiny-ar-sft-1", "tiny-ar-sft-2", "tiny-ar-sft", "tiny-mars", "eval"} <= set(info["stages"])
    assert "tiny-mars-arw0" not in info["stages"] and not arw0.exists()
    assert info["stages"]["tiny-mars"]["parallel_with"] == ["tiny-ar-sft"]
    assert info["stages"]["tiny-mars"]["settings"]["random_block_offset"] is True
    for name in ("tiny-ar-sft", "tiny-mars"):
        assert (out / name / "model.safetensors").is_file() and (out / name / "README.md").is_file()
    assert "| tiny-mars ar_weight=0 |" not in (out / "tiny-mars" / "README.md").read_text()

    recipe.main(common + ["--stages", "ablation,eval", "--eval-reuse", "tiny-ar-sft,tiny-mars"])
    info = json.loads((work / "recipe_info.json").read_text())
    ablation = info["stages"]["tiny-mars-arw0"]
    assert ablation["parallel_with"] == [] and ablation["threads"] == 2 and ablation["settings"]["ar_weight"] == 0
    assert (arw0 / "model.safetensors").is_file() and "eval-ablation" in info["stages"]
    card = (out / "tiny-mars" / "README.md").read_text()
    assert "| tiny-mars ar_weight=0 |" in card and "not counting the ablation `tiny-mars-arw0`" in card
