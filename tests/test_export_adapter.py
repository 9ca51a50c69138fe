"""finetune.recipes.export_adapter: a LoRA checkpoint as an adapter folder; a --gated-lora run's as mars-gated-lora-v1,
which mars_core decodes as training ran it and a later gated run warm-starts from. Tiny models only."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from finetune.train import main
from tests.tiny_fixtures import train_flags, train_metrics

pytest.importorskip("peft")
REPO = Path(__file__).resolve().parent.parent
GATED = ["--stage", "mars", "--lora", "--lora-r", "4", "--lora-alpha", "8", "--train-mask-row", "--gated-lora",
         "--lr", "3e-2", "--decay", "constant"]


@pytest.fixture(scope="module")
def gated_export(tiny, tmp_path_factory):
    """(checkpoint of a 3-step gated run, the adapter exported from it in fp32)."""
    from finetune.recipes.export_adapter import export_adapter

    root = tmp_path_factory.mktemp("gated")
    main(train_flags(tiny, root / "run", *GATED, "--max-steps", "3"))
    checkpoint = root / "run" / "checkpoint-3"
    done = export_adapter(checkpoint, root / "adapter", dtype="float32")
    assert done["format"] == "mars-gated-lora-v1" and done["step"] == 3 and done["bytes"] > 0
    return checkpoint, root / "adapter"


def _training_model(tiny, checkpoint):
    from finetune.recipes.ab_score import trained_model
    from finetune.train_model import load_base

    return trained_model(checkpoint, load_base(str(tiny[0]))).eval()


def test_the_exported_gated_adapter_decodes_as_training_ran_it(tiny, gated_export):
    from mars_core import DecodeConfig, generate, load_model

    checkpoint, adapter = gated_export
    lm = load_model(str(adapter), device="cpu", dtype="float32", backend="hf")
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["alpha"], cfg["block_size"], cfg["steps"]) == (4, 8, 4, 3) and cfg["mask_id"] == lm.mask_id
    ids = torch.tensor([lm.encode("What is 3 + 4?") + [lm.mask_id] * 3])
    with torch.no_grad():
        ours, theirs = lm.model(input_ids=ids).logits, _training_model(tiny, checkpoint)(input_ids=ids).logits
    keep = torch.arange(ours.shape[-1]) != lm.mask_id   # training's tied head also carries the row at that column
    assert (ours[..., keep] - theirs[..., keep]).abs().max() <= 1e-5
    base = load_model(str(tiny[0]), device="cpu", dtype="float32", backend="hf")
    one = DecodeConfig(mode="mars", tau=1.0, max_new_tokens=12)
    prompts = ["What is 3 + 4?", "What is 12 + 5?"]
    assert [r.token_ids for r in generate(lm, prompts, one)] == [r.token_ids for r in generate(base, prompts, one)]


def test_a_gated_run_warm_starts_from_exactly_the_exported_adapter(tiny, gated_export, tmp_path):
    from finetune.config import TrainConfig
    from finetune.train_model import WarmStart, load_base, prepare_model, wrap_model

    checkpoint, adapter = gated_export
    cfg = TrainConfig(base_model=str(tiny[0]), stage="mars", lora=True, lora_r=4, lora_alpha=8, train_mask_row=True,
                      gated_lora=True, init_adapter=str(adapter))
    init = WarmStart.read(cfg)
    base = load_base(str(tiny[0]))
    module = wrap_model(prepare_model(base.model, cfg, None, init), cfg, base.mask_id, None, init).eval()
    ids = torch.tensor([[5, 9, 14, 22, base.mask_id, base.mask_id, base.mask_id]])
    with torch.no_grad():
        warm, want = module.causal_lm()(input_ids=ids).logits, _training_model(tiny, checkpoint)(input_ids=ids).logits
    keep = torch.arange(warm.shape[-1]) != base.mask_id   # training's tied head also carries the row there
    torch.testing.assert_close(warm[..., keep], want[..., keep], atol=1e-5, rtol=1e-5)
    # and the loop runs from it: step 1 of the new run is near the old run's last, not a fresh adapter's
    main(train_flags(tiny, tmp_path / "warm", *GATED, "--init-adapter", str(adapter), "--max-steps", "1"))
    main(train_flags(tiny, tmp_path / "fresh", *GATED, "--max-steps", "1"))
    old = train_metrics(checkpoint.parent)[-1]["loss_mask"]
    warm_1, fresh_1 = (train_metrics(tmp_path / r)[0]["loss_mask"] for r in ("warm", "fresh"))
    assert abs(warm_1 - old) < abs(fresh_1 - old)


def test_a_gated_adapter_does_not_warm_start_a_plain_run(tiny, gated_export, tmp_path):
    _, adapter = gated_export
    plain = [f for f in GATED if f != "--gated-lora"]
    with pytest.raises(ValueError, match="is a gated adapter but this run is not gated: pass --gated-lora"):
        main(train_flags(tiny, tmp_path / "run", *plain, "--init-adapter", str(adapter), "--max-steps", "1"))
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_the_cli_names_a_folder_that_is_no_checkpoint_in_one_line(tmp_path):
    env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    done = subprocess.run([sys.executable, "-m", "finetune.recipes.export_adapter", str(tmp_path),
                           "--out", str(tmp_path / "a")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: {tmp_path} has no train_config.json: pass a checkpoint folder of a finetune.train run "
        "(e.g. runs/x/train/checkpoint-200)"]
    assert not (tmp_path / "a").exists()


def test_an_int8_gated_export_is_half_bf16s_bytes_and_decodes_like_the_float_one(tiny, gated_export, tmp_path):
    """--dtype int8 stores each factor as int8 with a float32 scale per rank component (as export_delta's int8
    folders): the loader dequantizes, the masks' logits stay within int8 rounding of the float32 export's, and
    τ = 1 and lossless are still the base model's answers."""
    from safetensors.torch import load_file

    from finetune.recipes.export_adapter import export_adapter
    from mars_core import DecodeConfig, generate, load_model

    checkpoint, f32 = gated_export
    for dtype in ("bfloat16", "int8"):
        assert export_adapter(checkpoint, tmp_path / dtype, dtype=dtype)["format"] == "mars-gated-lora-v1"

    def factor_bytes(folder):
        return sum(t.numel() * t.element_size() for k, t in load_file(str(folder / "adapter.safetensors")).items()
                   if ".lora_" in k)
    assert json.loads((tmp_path / "int8" / "adapter_config.json").read_text())["dtype"] == "int8"
    assert factor_bytes(tmp_path / "int8") < 0.6 * factor_bytes(tmp_path / "bfloat16")
    lm8, lm32 = (load_model(str(a), device="cpu", dtype="float32", backend="hf") for a in (tmp_path / "int8", f32))
    ids = torch.tensor([lm8.encode("What is 3 + 4?") + [lm8.mask_id] * 3])
    with torch.no_grad():
        l8, l32 = lm8.model(input_ids=ids).logits, lm32.model(input_ids=ids).logits
    moved = (l32[0, -3:] - l8[0, -3:]).abs().max()
    assert moved <= 0.02 * l32[0, -3:].abs().max()   # int8 rounding, not another adapter
    base = load_model(str(tiny[0]), device="cpu", dtype="float32", backend="hf")
    with torch.no_grad():
        assert (base.model(input_ids=ids).logits[0, -3:] - l32[0, -3:]).abs().max() > 10 * moved   # it is applied
    prompts = ["What is 3 + 4?", "What is 12 + 5?"]
    ar = [r.token_ids for r in generate(base, prompts, DecodeConfig(mode="mars", tau=1.0, max_new_tokens=12))]
    assert [r.token_ids for r in generate(lm8, prompts, DecodeConfig(mode="mars", tau=1.0, max_new_tokens=12))] == ar
    assert [r.token_ids for r in generate(lm8, prompts, DecodeConfig(mode="verify", tau=0.1, max_new_tokens=12))] == ar
