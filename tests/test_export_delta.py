"""finetune.recipes.export_delta: a full fine-tune's change as a low-rank mars-lora-v1 adapter that today's loader
merges."""

import json

import pytest
import torch

from finetune.recipes.export_delta import low_rank, main
from finetune.train import main as train_main
from tests.tiny_fixtures import train_flags


def test_low_rank_is_exact_at_full_rank_and_keeps_the_largest_directions():
    g = torch.Generator().manual_seed(0)
    d = torch.randn(12, 5, generator=g) @ torch.randn(5, 9, generator=g)   # rank 5
    a, b, kept = low_rank(d, 5)
    assert a.shape == (5, 9) and b.shape == (12, 5) and kept == pytest.approx(1.0)
    torch.testing.assert_close(b @ a, d, atol=1e-4, rtol=1e-4)
    a2, b2, kept2 = low_rank(d, 2)
    s = torch.linalg.svdvals(d)
    assert kept2 == pytest.approx(float((s[:2] ** 2).sum() / (s ** 2).sum()), rel=1e-5)
    assert torch.linalg.matrix_norm(d - b2 @ a2) == pytest.approx(float(s[2:].norm()), rel=1e-4)
    a8, b8, _ = low_rank(d, 8)   # more rank than the matrix has: zero-padded to the config's r
    assert a8.shape == (8, 9) and b8.shape == (12, 8)


@pytest.fixture(scope="module")
def full_ft(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("ft") / "run"
    train_main(train_flags(tiny, out, "--stage", "mars", "--max-steps", "3", "--lr", "1e-2", "--train-mask-row",
                           "--freeze-embeddings", "--decay", "constant"))
    return out / "checkpoint-3"


def test_the_delta_at_full_rank_loads_through_the_adapter_path_and_decodes_like_the_fine_tune(tiny, full_ft,
                                                                                             tmp_path, monkeypatch):
    from mars_core import DecodeConfig, generate, load_model

    monkeypatch.setenv("MARS_CACHE_DIR", str(tmp_path / "cache"))
    model_dir, _ = tiny
    out = tmp_path / "delta"
    assert main(["--checkpoint", str(full_ft), "--base", str(model_dir), "--rank", "64", "--out", str(out),
                 "--dtype", "float32"]) == 0
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["format"] == "mars-lora-v1" and cfg["r"] == cfg["alpha"] == 64
    merged = load_model(str(out), device="cpu", dtype="float32", cpu_layout=False)
    tuned = load_model(str(full_ft), device="cpu", dtype="float32", cpu_layout=False)
    ids = merged.tokenizer("12 + 7 =")["input_ids"]
    with torch.no_grad():
        a = merged.model(torch.tensor([ids])).logits
        b = tuned.model(torch.tensor([ids])).logits
    torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)   # norms, mask row and every matrix carried over
    prompt = "What is 12 + 7?"
    for cfg_ in (DecodeConfig(mode="mars", tau=1.0, max_new_tokens=16),
                 DecodeConfig(mode="verify", tau=0.5, max_new_tokens=16)):
        assert generate(merged, [prompt], cfg_)[0].token_ids == generate(tuned, [prompt], cfg_)[0].token_ids
    ar = generate(merged, [prompt], DecodeConfig(mode="mars", tau=1.0, block_size=1, max_new_tokens=16))[0]
    assert generate(merged, [prompt],
                    DecodeConfig(mode="verify", tau=0.5, max_new_tokens=16))[0].token_ids == ar.token_ids


def test_a_fine_tune_that_moved_the_embedding_is_refused_by_name(tiny, tmp_path):
    model_dir, _ = tiny
    out = tmp_path / "run"
    train_main(train_flags(tiny, out, "--stage", "mars", "--max-steps", "1", "--lr", "1e-2", "--decay", "constant"))
    with pytest.raises(ValueError, match="embedding rows besides the mask token's changed.*--freeze-embeddings"):
        main(["--checkpoint", str(out / "checkpoint-1"), "--base", str(model_dir), "--out", str(tmp_path / "d")])
    with pytest.raises(ValueError, match="--rank 0"):
        main(["--checkpoint", str(out / "checkpoint-1"), "--base", str(model_dir), "--rank", "0",
              "--out", str(tmp_path / "d")])
