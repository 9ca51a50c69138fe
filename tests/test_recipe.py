"""The recipe's command lines are valid finetune.train command lines, and --compile auto follows the compiler."""

import os
import shutil
from pathlib import Path

import pytest

from finetune import recipe
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
    assert not recipe.compile_wanted("auto", which=lambda c: None, works=lambda: pytest.fail("probed without a compiler"))
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


def test_the_toy_compile_fails_without_a_compiler_and_works_with_one():
    assert not recipe.compile_works(env=dict(os.environ, PATH="/nonexistent"))
    if any(shutil.which(c) for c in recipe.CXX):
        assert recipe.compile_works()


def _card_info(arw0_parallel: list[str]) -> dict:
    stage = lambda minutes, side=(): {"settings": {}, "steps": 10, "wall_s": 60 * minutes,   # noqa: E731
                                      "threads": 1, "parallel_with": list(side)}
    return {"parameters": 1, "vocab_size": 512, "stages": {
        "base": {"wall_s": 6.0}, "tiny-ar-sft-1": stage(18), "tiny-ar-sft-2": stage(10),
        "tiny-ar-sft": stage(14, ["tiny-mars"] + arw0_parallel), "tiny-mars": stage(23, ["tiny-ar-sft"] + arw0_parallel),
        "tiny-mars-arw0": stage(30, [] if not arw0_parallel else ["tiny-ar-sft", "tiny-mars"]),
        "eval": {"wall_s": 240.0}, "eval-ablation": {"wall_s": 120.0}}}


def test_card_time_counts_side_by_side_runs_once_and_an_ablation_trained_apart_not_at_all():
    # 0.1 + 18 + 10 + max(14, 23) + 4 = 55.1 min; the ablation trained on its own (30 min) and evaluated apart is
    # named but not added; trained side by side with stage 2 it is the group's longest run and counts.
    card = recipe.model_card("tiny-mars", "what", _card_info([]), ["tiny-mars"], [], "cmd")
    assert "add up to 55 min, not counting the ablation `tiny-mars-arw0` (`--stages ablation,eval`, 30.0 min)" in card
    card = recipe.model_card("tiny-mars", "what", _card_info(["tiny-mars-arw0"]), ["tiny-mars"], [], "cmd")
    assert "add up to 62 min." in card and "not counting" not in card
    card = recipe.model_card("tiny-ar-sft", "what", _card_info([]), ["tiny-ar-sft"], [], "cmd")
    assert "add up to 55 min." in card


def test_stage2_steps_sets_the_length_and_one_fresh_example_per_row():
    s = recipe.stage_settings(recipe.MARS, steps=3000)
    assert s["max_steps"] == 3000 and s["builtin_examples"] == 3000 * s["batch_size"]
    assert recipe.stage_settings(recipe.MARS, steps=recipe.STAGE2["max_steps"]) == recipe.stage_settings(recipe.MARS)
    assert recipe.stage_settings(recipe.MARS, scale=0.01, steps=3000)["max_steps"] == 30
    with pytest.raises(ValueError, match="--stage2-steps 0"):
        recipe.stage_settings(recipe.MARS, steps=0)
