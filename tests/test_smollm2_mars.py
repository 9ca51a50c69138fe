"""The shipped smollm2-mars (SmolLM2-135M-Instruct + assets/smollm2-mars): offline load, the merge cache,
one-token mode == greedy AR == transformers generate, and several tokens per forward on held-out prompts.

Decoding here runs in fp32 (asked for explicitly: on a CPU with native bf16, dtype="auto" may pick bf16),
where the equivalences are exact."""

import os

import pytest
import torch

from mars_core import DecodeConfig, generate, load_model
from mars_core.models import sources
from mars_core.models.adapter import adapter_files_size
from tests.tiny_fixtures import own_w8a8_kernels

SHIPPED = sources.ASSETS / "smollm2-mars"
MAX_NEW = 48


@pytest.fixture(scope="module")
def lm():
    os.environ["HF_HUB_OFFLINE"] = "1"          # nothing here may touch the network
    return load_model("smollm2-mars", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def natural():
    from finetune.evals.natural import natural_prompts

    return natural_prompts("heldout", 12, seed=3)


def test_the_adapter_files_fit_48_mb_and_load_from_the_package_and_the_repo(lm):
    assert adapter_files_size(SHIPPED) <= 48 * 10**6   # issue 52: the adapter folder stays within 48 MB
    assert lm.mask_id == 3 and lm.tokenizer.convert_ids_to_tokens(3) == "<repo_name>"
    assert sources.is_prepared("smollm2-mars")


def test_a_second_load_reads_the_cached_merge_without_rebuilding(lm, monkeypatch):
    def no_rebuild(*args, **kwargs):
        raise AssertionError("the merged checkpoint was rebuilt")

    monkeypatch.setattr(sources, "merge_adapter", no_rebuild)
    monkeypatch.setattr(sources, "gguf_to_checkpoint", no_rebuild)
    again = load_model("smollm2-mars", device="cpu", dtype="float32")
    assert again.path == lm.path


@pytest.mark.slow
def test_one_token_mode_equals_greedy_ar_and_transformers_generate(lm, natural):
    prompts = natural[:4]
    one = generate(lm, prompts, DecodeConfig(mode="mars", tau=1.0, max_new_tokens=MAX_NEW))
    ar = generate(lm, prompts, DecodeConfig(mode="ar", max_new_tokens=MAX_NEW))
    assert [r.token_ids for r in one] == [r.token_ids for r in ar]
    for prompt, want in zip(prompts, ar):
        ids = lm.encode(prompt)
        ref = lm.model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                eos_token_id=lm.eos_ids, pad_token_id=lm.tokenizer.pad_token_id)
        assert ref[0, len(ids):].tolist() == want.token_ids


@pytest.mark.slow
def test_mars_steps_on_held_out_prompts_keep_the_one_token_answer(lm, natural):
    """At τ = 0.95 the trained masks commit several tokens on some steps and stay close to the one-token
    answer; base SmolLM2 in MARS mode keeps ~13% of it (junk at 1.10 tokens/forward on these prompts).
    The adapter reaches 1.02 tokens/forward here, under the 1.3 the issue asked for: docs/smollm2-mars.md."""
    from finetune.evals.evaluate import prefix_share

    prompts = natural[4:12]
    one = generate(lm, prompts, DecodeConfig(mode="ar", max_new_tokens=64))
    mars = generate(lm, prompts, DecodeConfig(mode="mars", tau=0.95, block_size=4, max_new_tokens=64))
    tpf = sum(r.tokens_per_forward for r in mars) / len(mars)
    kept = sum(prefix_share(m.token_ids, o.token_ids) for m, o in zip(mars, one)) / len(mars)
    assert tpf > 1.0 and any(len(s) > 1 for r in mars for s in r.steps), f"tokens/forward {tpf:.3f}"
    assert kept >= 0.7, f"only {kept:.0%} of the one-token answers kept at tau = 0.95"
    assert all(r.text.strip() for r in mars)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32"] + (["w8a8"] if own_w8a8_kernels() else [])
                         + (["w8a16"] if "avx2" in own_w8a8_kernels() else []))
def test_the_shipped_lora_served_gated_keeps_smollm2s_answer_and_changes_only_the_masks(tmp_path, natural, dtype):
    """Any gated adapter keeps the base's answer at τ = 1 and lossless (mars_core.engine.gated); here the shipped A and
    B, relabelled mars-gated-lora-v1, on SmolLM2 itself (the lean forward: fp32, and w8a8 where our kernels' native
    stack applies the deltas, and w8a16 on the AVX2 kernel's), four held-out natural prompts."""
    import json
    import shutil

    gated = tmp_path / "smollm2-gated"
    shutil.copytree(SHIPPED, gated)
    cfg = json.loads((gated / "adapter_config.json").read_text())
    (gated / "adapter_config.json").write_text(json.dumps({**cfg, "format": "mars-gated-lora-v1"}))
    lm = load_model(str(gated), device="cpu", dtype=dtype)
    base = load_model("smollm2", device="cpu", dtype=dtype, mask_token="<repo_name>")
    assert lm.backend == base.backend == "lean" and lm.path == base.path   # the base folder: nothing merged
    prompts, n = natural[4:8], 32
    want = [r.token_ids for r in generate(base, prompts, DecodeConfig(mode="ar", max_new_tokens=n))]
    assert [r.token_ids for r in generate(lm, prompts, DecodeConfig(mode="mars", tau=1.0, max_new_tokens=n))] == want
    lossless = generate(lm, prompts, DecodeConfig(mode="verify", tau=0.3, max_new_tokens=n))
    assert [r.token_ids for r in lossless] == want
    ids = torch.tensor([lm.encode(prompts[0]) + [lm.mask_id] * 3])
    with torch.no_grad():
        ours, theirs = lm.net(input_ids=ids).logits[0], base.net(input_ids=ids).logits[0]
    assert torch.equal(ours[:-3], theirs[:-3])
    assert not torch.equal(ours[-3:].argmax(-1), theirs[-3:].argmax(-1))
