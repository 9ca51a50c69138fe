"""finetune.recipes.ab (the fixed-budget A/B harness), its scoring (finetune.recipes.ab_score) and gated LoRA, on a
tiny model."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.train import main as train_main

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["What is 3 + 4?", "What is 12 + 5?", "Sort 3, 1, 2.", "Reverse the word cat."]


@pytest.fixture(scope="module")
def gated_run(tiny, tmp_path_factory):
    model_dir, data = tiny
    out = tmp_path_factory.mktemp("gated") / "run"
    train_main(["--base-model", str(model_dir), "--data", str(data), "--output-dir", str(out), "--batch-size", "4",
                "--max-length", "64", "--threads", "1", "--stage", "mars", "--lora", "--lora-r", "4", "--gated-lora",
                "--lr", "3e-2", "--decay", "constant", "--max-steps", "3"])
    return out / "checkpoint-3"


def loaded(model, tokenizer, mask_id):
    from mars_core.models.loading import wrap_model

    lm = wrap_model(model, tokenizer, mask_token=tokenizer.convert_ids_to_tokens(mask_id))
    assert lm.mask_id == mask_id
    return lm


def test_mask_slots_count_the_masks_after_the_last_real_token_in_each_block():
    from finetune.recipes.ab_score import mask_slots

    labels = torch.tensor([[-100, -100, -100, 5, 6, 7, 8, 9, 1, 2, -100, -100]])   # prompt 0..2, answer 3..9, pad
    assert mask_slots(labels, 4, 0).tolist() == [[0, 0, 0, 1, 1, 2, 3, 4, 1, 2, 0, 0]]
    assert mask_slots(labels, 4, 1).tolist() == [[0, 0, 0, 1, 2, 3, 4, 1, 2, 3, 0, 0]]


def test_held_out_mask_ce_is_the_training_loss_mask_and_agreement_is_per_slot(tiny):
    from finetune.recipes.ab_score import MaskTally, mask_metrics, tally_batch
    from finetune.data import build_examples, collate, load_conversations
    from finetune.losses import MarsLossSettings, mars_loss
    from finetune.train_model import load_base

    model_dir, data = tiny
    base = load_base(str(model_dir))
    examples = build_examples(load_conversations(str(data))[:8], base.tokenizer, max_length=64, block_size=4,
                              eos_ids=base.eos_ids)
    batch = collate(examples, 0)
    for offset in (0, 3):
        tally = MaskTally(4)
        tally_batch(base.model, batch, base.mask_id, 4, offset, tally)
        with torch.no_grad():
            want = mars_loss(base.model, **batch,
                             settings=MarsLossSettings(block_size=4, mask_id=base.mask_id, block_offset=offset))
        assert tally.ce_mask / tally.labels == pytest.approx(float(want.loss_mask), abs=1e-5)
        assert tally.ce_ar / tally.labels == pytest.approx(float(want.loss_ar), abs=1e-5)
    got = mask_metrics(base.model, examples, base.mask_id, 0, 4, batch_size=3)
    assert set(got["agreement"]) == {"slot1", "slot2", "slot3"}
    assert all(0 <= v <= 1 for v in got["agreement"].values())


def test_gated_lora_keeps_the_one_token_path_the_base_model_and_changes_the_masks(tiny, gated_run):
    from finetune.recipes.ab_score import trained_model
    from finetune.train_model import load_base
    from mars_core import DecodeConfig, generate

    model_dir, _ = tiny
    plain = load_file(str(gated_run / "model.safetensors"))
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():   # the checkpoint is the base
        assert torch.equal(plain[name], tensor), name
    base = load_base(str(model_dir))
    gated = loaded(trained_model(gated_run, load_base(str(model_dir))), base.tokenizer, base.mask_id)
    reference = loaded(base.model.eval(), base.tokenizer, base.mask_id)
    for cfg in (DecodeConfig(mode="ar", max_new_tokens=24), DecodeConfig(mode="verify", tau=0.3, max_new_tokens=24)):
        want = [r.token_ids for r in generate(reference, PROMPTS, DecodeConfig(mode="ar", max_new_tokens=24))]
        assert [r.token_ids for r in generate(gated, PROMPTS, cfg)] == want, cfg.mode
    ids = torch.tensor([gated.encode(PROMPTS[0]) + [base.mask_id] * 3])
    with torch.no_grad():
        a, b = gated.model(input_ids=ids).logits, reference.model(input_ids=ids).logits
    n = ids.shape[1] - 3
    torch.testing.assert_close(a[:, :n], b[:, :n], atol=0, rtol=0)   # real tokens: the base model, bit for bit
    assert (a[:, n:] - b[:, n:]).abs().max() > 1e-3                  # masks: the adapter


def test_gated_lora_needs_lora_and_mars():
    from finetune.config import TrainConfig

    with pytest.raises(ValueError, match="gated_lora .*--lora and --stage mars"):
        TrainConfig(gated_lora=True)
    with pytest.raises(ValueError, match="gated_lora"):
        TrainConfig(gated_lora=True, lora=True, stage="ar-sft")


def run_ab(*args):
    env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    return subprocess.run([sys.executable, "-m", "finetune.recipes.ab", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600, check=False)


@pytest.mark.parametrize("args,fix", [
    (["--arms", "baseline,warp"], "unknown arms ['warp']"),
    (["--prompt-seed", "1"], "report seed"),
    (["--steps", "0"], "--steps 0: use 1 or more"),
    (["--arms", "baseline,warm"], "arms warm start from an adapter: pass --init-adapter"),
    (["--arms", "shipped", "--init-adapter", "/nonexistent"], "adapter_config.json is missing"),
])
def test_bad_flags_are_one_line_naming_the_fix_and_exit_2(tiny, tmp_path, args, fix):
    _, data = tiny
    done = run_ab("--data", str(data), "--work", str(tmp_path / "w"), *args)
    assert done.returncode == 2 and fix in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.slow
def test_one_command_trains_and_scores_every_arm_and_a_rerun_redoes_nothing(tiny, tmp_path):
    model_dir, data = tiny
    work = tmp_path / "ab"
    args = ["--data", str(data), "--work", str(work), "--base", str(model_dir), "--arms", "baseline,gated",
            "--steps", "2", "--dev-examples", "8", "--prompts", "2", "--max-new-tokens", "8"]
    first = run_ab(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    table = (work / "table.md").read_text()
    assert "| baseline | recipe | 2 |" in table and "| gated | gated_lora=True, train_mask_row=False | 2 |" in table
    assert len((work / "dev.jsonl").read_text().splitlines()) == 8
    assert len((work / "train.jsonl").read_text().splitlines()) == 32
    scores = {arm: (work / arm / "score.json").read_text() for arm in ("baseline", "gated")}
    again = run_ab(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("trained before") == 2 and again.stdout.count("scored before") == 2
    assert {arm: (work / arm / "score.json").read_text() for arm in scores} == scores
    other = run_ab(*args[:-6], "--dev-examples", "9", "--prompts", "2", "--max-new-tokens", "8")
    assert other.returncode == 2 and "use a new --work" in other.stderr


@pytest.mark.slow
def test_warm_arms_start_from_the_adapter_and_the_shipped_arm_is_scored_untrained(tiny, tmp_path):
    from mars_core import load_model
    from mars_core.models.adapter import AdapterSpec, save_adapter

    model_dir, data = tiny
    # an adapter of the recipe's shape (r 32, alpha 64, mask row) for the tiny model: one LoRA step, exported
    first = tmp_path / "first"
    train_main(["--base-model", str(model_dir), "--data", str(data), "--output-dir", str(first), "--batch-size", "4",
                "--max-length", "64", "--threads", "1", "--stage", "mars", "--lora", "--lora-r", "32",
                "--lora-alpha", "64", "--train-mask-row", "--lr", "1e-2", "--max-steps", "1"])
    state = torch.load(first / "checkpoint-1" / "trainer_state.pt", weights_only=False)
    lm = load_model(str(model_dir), device="cpu", cpu_layout=False)
    save_adapter(tmp_path / "adapter", state["lora"], state["mask_row"],
                 AdapterSpec(r=32, alpha=64, base=str(model_dir), mask_id=lm.mask_id,
                             mask_token=lm.tokenizer.convert_ids_to_tokens(lm.mask_id), block_size=4))
    work = tmp_path / "ab"
    done = run_ab("--data", str(data), "--work", str(work), "--base", str(model_dir), "--arms", "shipped,warm",
                  "--init-adapter", str(tmp_path / "adapter"), "--steps", "2", "--dev-examples", "8", "--prompts", "2",
                  "--max-new-tokens", "8")
    assert done.returncode == 0, done.stderr[-3000:]
    table = (work / "table.md").read_text()
    assert f"| shipped | init_adapter={tmp_path / 'adapter'} (as it is) | 0 | – | – |" in table
    assert f"| warm | init_adapter={tmp_path / 'adapter'} | 2 |" in table
    assert not (work / "shipped" / "train").exists()
    import json

    warm_cfg = json.loads((work / "warm" / "train" / "train_config.json").read_text())
    assert warm_cfg["init_adapter"] == str(tmp_path / "adapter") and warm_cfg["max_steps"] == 2
    shipped, warm = (json.loads((work / a / "score.json").read_text()) for a in ("shipped", "warm"))
    assert len(shipped["lossless_tpf_each"]) == 2 and shipped["mask_ce"] != warm["mask_ce"]


def test_the_table_pairs_each_arm_with_the_first_prompt_by_prompt():
    from finetune.recipes.ab import format_table

    def arm(name, each):
        return {"arm": name, "settings": {}, "steps": 3, "train_elapsed_s": 60.0, "train_mask_ce": 3.0, "mask_ce": 3.1,
                "ar_ce": 0.4, "agreement": {"slot1": 0.3, "slot2": 0.2, "slot3": 0.1}, "lossless_tpf": sum(each) / 3,
                "lossless_tpf_each": each, "lossy_tpf": 1.0, "lossy_same_answer": 0.5, "lossy_prefix_share": 0.5}

    rows = format_table([arm("a", [1.0, 1.2, 1.4]), arm("b", [1.3, 1.2, 1.1])]).splitlines()
    assert "lossless vs a, paired" in rows[0]
    assert "| 1.200 | – |" in rows[2]                 # the first arm is the reference
    assert "| 1.200 | +0.000 (1 / 1) |" in rows[3]     # +0.3, 0, -0.3: same mean, one prompt higher, one lower


def test_lora_layers_adapts_only_the_top_layers_and_the_backward_stops_below_them(tiny):
    from finetune.config import TrainConfig
    from finetune.train_model import load_base, prepare_model

    model_dir, _ = tiny
    base = load_base(str(model_dir))
    n = base.model.config.num_hidden_layers
    assert n >= 2
    cfg = TrainConfig(base_model=str(model_dir), stage="mars", lora=True, lora_r=4, lora_layers=1)
    model = prepare_model(base.model, cfg, None)
    adapted = {name.split(".layers.")[1].split(".")[0] for name, p in model.named_parameters() if p.requires_grad}
    assert adapted == {str(n - 1)}
    ids = torch.tensor([[1, 5, 7, 9, base.mask_id, base.mask_id]])
    out = model(input_ids=ids, output_hidden_states=True)
    assert not out.hidden_states[n - 1].requires_grad     # the top layer's input: no graph below it
    assert out.logits.requires_grad
    out.logits.float().pow(2).mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_lora_layers_is_checked_against_the_model_and_needs_lora(tiny):
    from finetune.config import TrainConfig
    from finetune.train_model import load_base, prepare_model

    model_dir, _ = tiny
    base = load_base(str(model_dir))
    n = base.model.config.num_hidden_layers
    with pytest.raises(ValueError, match=rf"lora_layers={n + 1} but .* has {n} decoder layers"):
        prepare_model(base.model, TrainConfig(base_model=str(model_dir), stage="mars", lora=True,
                                              lora_layers=n + 1), None)
    with pytest.raises(ValueError, match="lora_layers chooses .* use it with --lora"):
        TrainConfig(lora_layers=2)
    with pytest.raises(ValueError, match="lora_layers=-1"):
        TrainConfig(lora=True, lora_layers=-1)


@pytest.mark.slow
def test_a_gated_adapter_is_scored_as_served_and_warm_gated_trains_from_it(tiny, tmp_path):
    import json

    from finetune.recipes.export_adapter import export_adapter

    model_dir, data = tiny
    first = tmp_path / "first"
    train_main(["--base-model", str(model_dir), "--data", str(data), "--output-dir", str(first), "--batch-size", "4",
                "--max-length", "64", "--threads", "1", "--stage", "mars", "--lora", "--lora-r", "32",
                "--lora-alpha", "64", "--train-mask-row", "--gated-lora", "--lr", "1e-2", "--max-steps", "1"])
    assert export_adapter(first / "checkpoint-1", tmp_path / "gated", dtype="float32")["format"] == "mars-gated-lora-v1"
    work = tmp_path / "ab"
    done = run_ab("--data", str(data), "--work", str(work), "--base", str(model_dir), "--arms", "shipped,warm-gated",
                  "--init-adapter", str(tmp_path / "gated"), "--steps", "2", "--dev-examples", "8", "--prompts", "2",
                  "--max-new-tokens", "8")
    assert done.returncode == 0, done.stderr[-3000:]
    table = (work / "table.md").read_text()
    assert f"| shipped | init_adapter={tmp_path / 'gated'} (as it is) | 0 | – | – |" in table
    cfg = json.loads((work / "warm-gated" / "train" / "train_config.json").read_text())
    assert cfg["gated_lora"] and cfg["init_adapter"] == str(tmp_path / "gated")
    shipped, warm = (json.loads((work / a / "score.json").read_text()) for a in ("shipped", "warm-gated"))
    # gated both: the lossless answers are the base model's, so they agree; the masks have trained on
    assert shipped["lossless_answers"] == warm["lossless_answers"] and shipped["mask_ce"] != warm["mask_ce"]
