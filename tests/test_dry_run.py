"""finetune.train --dry-run (finetune.plan) on the paper's configs (configs/): the plan's numbers, no training."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from finetune.config import TrainConfig
from finetune.train import main
from tests.tiny_fixtures import make_tokenizer, save_model_dir, tiny_causal_lm

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("qwen2.5-*.json"))
H200_GB = 141


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    """(model folder, chat JSONL of 60 chats, parameter count): a random 2-layer Qwen2, tied like Qwen2.5-0.5B."""
    root = tmp_path_factory.mktemp("plan")
    tok = make_tokenizer()
    model = tiny_causal_lm(len(tok), "qwen2", context=32768, tie=True, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id, bos_token_id=None)
    n_params = sum(p.numel() for p in model.parameters())   # a tied head is one parameter
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {i}."},
                                                     {"role": "assistant", "content": f"{i}"}]}) + "\n"
                            for i in range(60)))
    return save_model_dir(root / "model", tok, model), data, n_params


def plan(capsys, *argv) -> str:
    assert main(["--dry-run", *argv]) == 0
    return capsys.readouterr().out


def number(text: str, pattern: str) -> float:
    found = re.search(pattern, text)
    assert found, (pattern, text)
    return float(found.group(1).replace(",", ""))


def test_every_config_is_the_papers_recipe():
    assert len(CONFIGS) == 8   # 0.5B and 7B: AR-SFT and MARS with B = 4, 8, 16
    for path in CONFIGS:
        cfg = TrainConfig.from_dict(json.loads(path.read_text()), where=str(path))
        assert (cfg.lr, cfg.epochs, cfg.max_length, cfg.sharding) == (5e-6, 5, 512, "full"), path.name
        assert cfg.batch_size * cfg.grad_accum * 8 == 384, path.name   # the paper's effective batch on 8 GPUs
        assert cfg.stage == ("ar-sft" if "ar-sft" in path.name else "mars"), path.name
        if cfg.stage == "mars":
            assert f"-b{cfg.block_size}." in path.name and cfg.ar_weight == 1.0
            ar = json.loads(path.with_name(re.sub(r"mars-b\d+", "ar-sft", path.name)).read_text())
            assert cfg.base_model.startswith(ar["output_dir"] + "/checkpoint-")   # stage 2 starts from stage 1


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_the_dry_run_plans_each_config_on_a_tiny_model_and_trains_nothing(config, tiny_qwen2, tmp_path, capsys):
    model_dir, data, n_params = tiny_qwen2
    out = tmp_path / "run"
    text = plan(capsys, "--config", str(config), "--base-model", str(model_dir), "--data", str(data),
                "--output-dir", str(out), "--plan-processes", "2")
    cfg = TrainConfig.from_dict(json.loads(config.read_text()))
    assert not out.exists()   # nothing written, nothing trained
    assert number(text, r"parameters ([\d,]+),") == n_params
    assert number(text, r"data: ([\d,]+) examples") == 60
    micro = 60 // (cfg.batch_size * 2)
    assert number(text, r"optimizer steps ([\d,]+)") == max(1, math.ceil(cfg.epochs * micro / cfg.grad_accum))
    # full sharding over 2 processes: each holds half the fp32 parameters, gradients and Adam moments
    assert number(text, r"parameters \(fp32\)\s+([\d.]+) GB") == pytest.approx(4 * n_params / 2 / 1e9, abs=0.006)
    assert f"4 B x {n_params:,} / 2" in text and f"8 B x {n_params:,} / 2" in text
    assert "layers x 2 B x (rows x (5h + 5q + 4I) + batch x seq^2)" in text   # the formula beside the number
    assert re.search(r"without --gradient-checkpointing  <- this run", text)


def test_the_plan_counts_the_steps_the_run_then_takes(tiny_qwen2, tmp_path, capsys):
    model_dir, data, _ = tiny_qwen2
    flags = ["--base-model", str(model_dir), "--data", str(data), "--output-dir", str(tmp_path / "run"),
             "--batch-size", "8", "--grad-accum", "2", "--epochs", "2", "--max-length", "64", "--threads", "1"]
    steps = number(plan(capsys, *flags), r"optimizer steps ([\d,]+)")
    main(flags)
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == steps == math.ceil(2 * (60 // 8) / 2)


def test_the_7b_mars_plan_fits_an_h200_with_full_sharding_on_8_gpus(tmp_path, capsys):
    config = REPO / "configs" / "qwen2.5-7b-mars-b4.json"
    text = plan(capsys, "--config", str(config), "--base-model", "Qwen/Qwen2.5-7B", "--plan-examples", "2000000",
                "--plan-processes", "8", "--output-dir", str(tmp_path / "run"))
    assert number(text, r"parameters ([\d,]+),") == 7_615_616_512   # Qwen2.5-7B: 7.61B, untied head
    assert "global batch 384" in text
    steps = number(text, r"optimizer steps ([\d,]+)")
    assert steps == math.ceil(5 * (2_000_000 // 64) / 6)
    # stage 2 starts from stage 1's last checkpoint: the AR-SFT run over the same data takes the same steps
    assert json.loads(config.read_text())["base_model"].endswith(f"checkpoint-{int(steps)}")
    total = number(text, r"total\s+([\d.]+) GB   without --gradient-checkpointing  <- this run")
    with_ckpt = number(text, r"total\s+([\d.]+) GB   with --gradient-checkpointing")
    assert with_ckpt < total <= H200_GB
    assert number(text, r"model\.safetensors ([\d.]+) GB") == pytest.approx(4 * 7_615_616_512 / 1e9, abs=0.01)


def test_a_sharded_plan_for_one_process_names_the_flag(tiny_qwen2, tmp_path):
    model_dir, data, _ = tiny_qwen2
    with pytest.raises(ValueError, match=r"--sharding full plans for 2 or more processes .* --plan-processes N"):
        main(["--dry-run", "--sharding", "full", "--base-model", str(model_dir), "--data", str(data),
              "--output-dir", str(tmp_path / "run")])


def test_a_missing_data_file_names_plan_examples(tmp_path):
    with pytest.raises(ValueError, match=r"--data .* is not on this machine: pass --plan-examples N"):
        main(["--dry-run", "--config", str(REPO / "configs" / "qwen2.5-0.5b-ar-sft.json"),
              "--plan-processes", "8", "--data", str(tmp_path / "absent.jsonl")])


def test_the_dry_run_reads_no_weights(tiny_qwen2, tmp_path, capsys):
    import shutil

    model_dir, data, n_params = tiny_qwen2
    shapes_only = tmp_path / "no-weights"
    shutil.copytree(model_dir, shapes_only, ignore=shutil.ignore_patterns("*.safetensors"))
    text = plan(capsys, "--base-model", str(shapes_only), "--data", str(data), "--output-dir", str(tmp_path / "run"))
    assert number(text, r"parameters ([\d,]+),") == n_params and number(text, r"data: ([\d,]+) examples") == 60


def saved_activation_bytes(n_layers: int) -> tuple[int, int]:
    """(bytes autograd keeps for the backward pass of one MARS loss forward, positions a sequence) for a random
    Qwen2 of ``n_layers`` layers over 4 sequences of 64 tokens; parameters (saved for their own gradients) are not
    counted."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from finetune.losses import MarsLossSettings, first_noisy_block_start, mars_loss

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=96, hidden_size=128, intermediate_size=352,
                                         num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=True)).train()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def keep(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(5, 96, (4, 64), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :16] = -100
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        mars_loss(model, ids, labels, torch.ones_like(ids, dtype=torch.bool), MarsLossSettings(block_size=4, mask_id=3))
    return sum(storages.values()), 64 - first_noisy_block_start(labels, 4) + 64   # [noisy from its start | clean]


def test_the_activation_formula_counts_what_autograd_keeps_per_layer():
    from transformers import Qwen2Config

    from finetune.plan import layer_bytes

    (two, seq), (four, _) = saved_activation_bytes(2), saved_activation_bytes(4)
    per_layer = (four - two) / 2   # what lies outside the decoder layers cancels out
    config = Qwen2Config(hidden_size=128, intermediate_size=352, num_attention_heads=4)
    assert per_layer == pytest.approx(layer_bytes(config, 4, seq, 4), rel=0.03)
