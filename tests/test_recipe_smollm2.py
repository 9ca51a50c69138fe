"""finetune.recipes.recipe_smollm2 end to end at a tiny scale: the embedded tiny-ar-sft stands in for SmolLM2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def test_flags_are_checked_before_any_stage_runs():
    from finetune.recipes.recipe_smollm2 import parse_args

    assert parse_args(["--stages", "prompts, train"]).stages == ["prompts", "train"]
    with pytest.raises(ValueError, match=r"--stages names \['nope'\]"):
        parse_args(["--stages", "prompts,nope"])
    with pytest.raises(ValueError, match="--prompts and --jobs need 1 or more"):
        parse_args(["--jobs", "0"])


def test_export_takes_the_newest_complete_checkpoint(tmp_path):
    from finetune.recipes.recipe_smollm2 import final_checkpoint

    with pytest.raises(SystemExit, match="no checkpoint"):
        final_checkpoint(tmp_path)
    for step in (2, 10):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.pt").write_bytes(b"")
    (tmp_path / "checkpoint-11").mkdir()   # no trainer_state.pt: a save cut short
    assert final_checkpoint(tmp_path) == tmp_path / "checkpoint-10"


@pytest.mark.slow
def test_the_recipe_distils_trains_exports_evaluates_and_resumes(tmp_path):
    from mars_core import DecodeConfig, generate, load_model

    work, out = tmp_path / "work", tmp_path / "tiny-mars-lora"
    cmd = [sys.executable, "-m", "finetune.recipes.recipe_smollm2", "--base", "tiny-ar-sft", "--work", str(work),
           "--out", str(out), "--prompts", "24", "--steps", "2", "--n-natural", "2", "--humaneval", "0",
           "--n-checkable", "8", "--threads", "2"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "eval-base beside the training" in done.stdout          # the base's evaluation used the spare core
    data = [json.loads(line) for line in (work / "data.jsonl").read_text().splitlines()]
    distilled = json.loads((work / "stage-distill.json").read_text())
    assert len(data) == distilled["kept"] and distilled["kept"] + sum(distilled["dropped"].values()) == 24

    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base"] == "tiny-ar-sft" and cfg["mask_token"] == "<|mask|>" and cfg["steps"] == 2
    lm, base = load_model(str(out), device="cpu"), load_model("tiny-ar-sft", device="cpu")
    ids = torch.tensor([[base.mask_id, 5, 6]])
    with torch.no_grad():   # the trained mask row and the LoRA deltas are in the merged model
        assert not torch.allclose(lm.model(input_ids=ids).logits, base.model(input_ids=ids).logits)
    one = generate(lm, ["What is 2 + 3?"], DecodeConfig(mode="mars", tau=1.0, max_new_tokens=12))[0]
    ar = generate(lm, ["What is 2 + 3?"], DecodeConfig(mode="ar", max_new_tokens=12))[0]
    assert one.token_ids == ar.token_ids

    rows = json.loads((work / "eval.json").read_text())
    assert [(r["model"], r["tau"]) for r in rows] == [("tiny-ar-sft", 1.0)] + [
        ("tiny-mars-lora", t) for t in (1.0, 0.95, 0.9, 0.8, 0.7)]
    card = (out / "README.md").read_text()
    assert "| tiny-mars-lora | 0.95 |" in card and "--steps 2" in card

    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0
    for stage in ("prompts", "distill", "train", "eval-base", "export", "eval"):
        assert f"{stage}: done before" in again.stdout


def test_compile_auto_compiles_only_a_long_cpu_run_with_native_bf16_and_a_working_compiler():
    from finetune.recipes.recipe_smollm2 import COMPILE_FROM_STEPS, TRAIN, parse_args, train_settings

    probes = []

    def works():
        probes.append(1)
        return True

    assert TRAIN["max_steps"] >= COMPILE_FROM_STEPS   # the recipe's own run is a long one
    assert train_settings(False, True, None, 1.0, "auto", works)["compile"] is True
    assert train_settings(False, True, None, 1.0, "auto", lambda: False).get("compile") is None   # no compiler
    n = len(probes)
    assert train_settings(False, True, COMPILE_FROM_STEPS - 1, 1.0, "auto", works).get("compile") is None  # short
    assert train_settings(False, True, None, 0.01, "auto", works).get("compile") is None   # a smoke run
    assert train_settings(False, False, None, 1.0, "auto", works).get("compile") is None   # emulated bf16 (fp32)
    assert train_settings(True, True, None, 1.0, "auto", works).get("compile") is None     # a GPU: not measured
    assert len(probes) == n   # the compiler is probed only when the answer matters
    assert train_settings(False, False, 10, 1.0, "on")["compile"] is True
    assert train_settings(False, True, None, 1.0, "off").get("compile") is None
    assert parse_args([]).compile == "auto" and parse_args(["--compile", "off"]).compile == "off"
