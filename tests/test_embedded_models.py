"""The committed models in assets/: MARS one-token mode is greedy AR, MARS accepts several tokens
per forward at τ = 0.95, and the AR-SFT model actually solves held-out tasks."""

from pathlib import Path

import pytest
import torch

from finetune.evals.evaluate import MAX_NEW_TOKENS  # the evaluation budget: covers the longest suite answer

ASSETS = Path(__file__).resolve().parent.parent / "assets"
N_PROMPTS = 16   # two per family: enough to catch a broken model, fast on a CPU

@pytest.fixture(scope="module")
def heldout():
    from finetune.tasks import make_examples

    return make_examples("heldout", N_PROMPTS, seed=123)


@pytest.fixture(scope="module")
def mars():
    from mars_core import load_model

    return load_model("tiny-mars", device="cpu")


def test_both_models_fit_the_size_budget():
    total = sum(f.stat().st_size for d in ("tiny-ar-sft", "tiny-mars") for f in (ASSETS / d).iterdir())
    assert total <= 30 * 1024 * 1024, f"{total / 2**20:.1f} MB > 30 MB"


def test_model_dirs_have_tokens_and_cards():
    from transformers import AutoTokenizer

    for name in ("tiny-ar-sft", "tiny-mars"):
        tok = AutoTokenizer.from_pretrained(ASSETS / name)
        assert tok.mask_token == "<|mask|>" and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"
        card = (ASSETS / name / "README.md").read_text()
        assert "python -m finetune.recipes.recipe" in card and "| model | τ | accuracy |" in card


def test_mars_one_token_mode_equals_its_greedy_ar_output(mars, heldout):
    from mars_core import DecodeConfig, generate

    prompts = [ex["messages"][0]["content"] for ex in heldout]
    one_token = generate(mars, prompts, DecodeConfig(mode="mars", tau=1.0, max_new_tokens=MAX_NEW_TOKENS))
    ar = generate(mars, prompts, DecodeConfig(mode="ar", max_new_tokens=MAX_NEW_TOKENS))
    assert [r.token_ids for r in one_token] == [r.token_ids for r in ar]
    # and transformers' own greedy generate agrees (a reference no one here wrote)
    ids = mars.encode(prompts[0])
    ref = mars.model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                              eos_token_id=mars.eos_ids, pad_token_id=mars.tokenizer.pad_token_id)
    assert ref[0, len(ids):].tolist() == ar[0].token_ids


def test_mars_accepts_several_tokens_per_forward_at_tau_095(mars, heldout):
    from mars_core import DecodeConfig, generate

    prompts = [ex["messages"][0]["content"] for ex in heldout]
    res = generate(mars, prompts, DecodeConfig(mode="mars", tau=0.95, max_new_tokens=MAX_NEW_TOKENS))
    tpf = sum(r.tokens_per_forward for r in res) / len(res)
    assert tpf > 1.5, f"tokens/forward {tpf:.2f} at τ=0.95"


def test_ar_sft_model_solves_heldout_tasks(heldout):
    from finetune.evals.evaluate import score
    from mars_core import DecodeConfig, generate, load_model

    lm = load_model("tiny-ar-sft", device="cpu")
    res = generate(lm, [ex["messages"][0]["content"] for ex in heldout],
                   DecodeConfig(mode="ar", max_new_tokens=MAX_NEW_TOKENS))
    accuracy, _ = score(heldout, [r.text for r in res])
    assert accuracy >= 0.7, f"AR-SFT accuracy {accuracy:.0%} on {len(heldout)} held-out prompts"


@pytest.mark.slow
def test_mars_mask_predictions_do_not_depend_on_the_block_grid_phase(mars):
    """tiny-mars trained on a block grid shifted at random every step, so its held-out mask loss is about the same
    whichever way the grid is shifted (on these 64 tasks max/min 1.08); the fixed-grid tiny-mars of c5c8762 read
    0.10 on its own grid and 0.15-0.20 on the other three, max/min 1.98 (docs/experiments.md). 64 tasks, not
    16: at this model's loss (~0.05) 16 tasks' ratio wanders (1.35 for the same weights)."""
    from finetune.evals.evaluate import block_phase_losses
    from finetune.tasks import make_examples

    ces = block_phase_losses(mars, make_examples("heldout", 64, seed=123))
    assert len(ces) == 4 and max(ces) / min(ces) < 1.25, ces
