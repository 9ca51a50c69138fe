"""Gated adapters (mars-gated-lora-v1, mars_core.engine.gated): the LoRA delta acts at mask positions only.

What a gated adapter promises: τ >= 1 and lossless decoding give the base model's answer token for token, and
only the masks' predictions change. Checked here in fp32 on the hf and lean backends (bf16 and int8: τ = 1 only,
where no mask is fed and the computation is the base's by construction), plus the match with training's gate
(finetune.train_model.MaskGate) and the refusals. Tiny random Llamas only (tests/tiny_fixtures.py).
"""
import json

import pytest
import torch

from mars_core import DecodeConfig, generate, load_model
from mars_core.models.adapter import AdapterSpec, merge_adapter, read_adapter_config, save_adapter
from mars_core.models.sources import is_prepared
from tests.tiny_fixtures import make_tiny_model_dir, own_w8a8_kernels

peft = pytest.importorskip("peft")

R, ALPHA, MASK_TOKEN = 4, 8.0, "<|mask|>"
PROMPTS = ["What is 2+3?", "Sort: c a b", "Hello there, tell me a long story about cats.", "Name three colours."]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("base"), seed=5)


def _peft_model(base_dir, seed=2):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    model = peft.get_peft_model(model, peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:   # large enough that the masks' predictions move
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "lora_B" in name else 0.5))
    return model.eval()


def _mask_id(base_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(base_dir)).convert_tokens_to_ids(MASK_TOKEN)


def _save(out, peft_model, base_dir, mask_row=None, gated=True):
    save_adapter(out, peft.get_peft_model_state_dict(peft_model), mask_row,
                 AdapterSpec(r=R, alpha=ALPHA, base=str(base_dir), mask_id=_mask_id(base_dir), mask_token=MASK_TOKEN,
                             block_size=4, dtype=torch.float32, gated=gated))
    return out


@pytest.fixture(scope="module")
def gated(base_dir, tmp_path_factory):
    """(gated adapter folder with a mask row, the peft model its deltas came from)."""
    model = _peft_model(base_dir)
    row = torch.randn(64, generator=torch.Generator().manual_seed(9))
    return _save(tmp_path_factory.mktemp("gated") / "tiny-gated", model, base_dir, mask_row=row), model


def _ids(results):
    return [r.token_ids for r in results]


def test_the_folder_says_it_is_gated_so_the_merging_loader_refuses_it(gated):
    folder, _ = gated
    assert read_adapter_config(folder)["format"] == "mars-gated-lora-v1"
    from safetensors import safe_open
    with safe_open(str(folder / "adapter.safetensors"), "pt") as f:
        assert f.metadata()["format"] == "mars-gated-lora-v1"
    with pytest.raises(ValueError, match="cannot be merged"):
        merge_adapter(torch.nn.Module(), folder)


@pytest.mark.parametrize("backend", ["hf", "lean"])
def test_tau_1_and_lossless_give_the_base_models_answer_and_the_masks_differ(gated, base_dir, backend):
    folder, _ = gated
    lm = load_model(str(folder), device="cpu", dtype="float32", backend=backend)
    base = load_model(str(base_dir), device="cpu", dtype="float32", backend=backend, mask_token=MASK_TOKEN)
    assert lm.backend == backend and lm.mask_id == base.mask_id
    assert lm.path == base.path and is_prepared(str(folder))   # nothing merged or cached: the base's own folder
    one = DecodeConfig(mode="mars", tau=1.0, max_new_tokens=24)
    want = _ids(generate(base, PROMPTS, one))
    assert _ids(generate(lm, PROMPTS, one)) == want
    assert _ids(generate(base, PROMPTS, DecodeConfig(mode="ar", max_new_tokens=24))) == want
    for layout in ("linear", "tree"):
        lossless = DecodeConfig(mode="verify", tau=0.05, max_new_tokens=24, draft_layout=layout)
        assert _ids(generate(lm, PROMPTS, lossless)) == want, layout
    # the same model runs the base at real positions and the adapter at the masks
    ids = torch.tensor([lm.encode(PROMPTS[0]) + [lm.mask_id] * 3])
    ours, theirs = lm.net(input_ids=ids).logits, base.net(input_ids=ids).logits
    n = ids.shape[1] - 3
    assert torch.equal(ours[:, :n], theirs[:, :n])
    assert (ours[:, n:] - theirs[:, n:]).abs().max() > 0.1
    guesses = lambda m: [m.net(input_ids=torch.tensor([m.encode(p) + [m.mask_id] * 3])).logits[0, -3:].argmax(-1)
                         for p in PROMPTS]
    assert any(not torch.equal(a, b) for a, b in zip(guesses(lm), guesses(base)))


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("backend", ["hf", "lean"])
def test_tau_1_is_the_base_model_in_every_weight_format(gated, base_dir, backend, dtype):
    folder, _ = gated
    if dtype == "int8":
        from mars_core.engine.int8 import int8_supported
        if not int8_supported():
            pytest.skip("this torch has no CPU int8 matmul")
    lm = load_model(str(folder), device="cpu", dtype=dtype, backend=backend)
    base = load_model(str(base_dir), device="cpu", dtype=dtype, backend=backend, mask_token=MASK_TOKEN)
    assert lm.weight_format == base.weight_format
    one = DecodeConfig(mode="mars", tau=1.0, max_new_tokens=16)
    assert _ids(generate(lm, PROMPTS, one)) == _ids(generate(base, PROMPTS, one))


def test_a_batch_decodes_as_each_row_alone(gated):
    folder, _ = gated
    lm = load_model(str(folder), device="cpu", dtype="float32", backend="lean")
    cfg = DecodeConfig(mode="mars", tau=0.5, max_new_tokens=24)
    assert _ids(generate(lm, PROMPTS, cfg)) == [generate(lm, [p], cfg)[0].token_ids for p in PROMPTS]


def test_lean_logits_equal_the_transformers_model_with_the_adapter(gated):
    folder, _ = gated
    lm = load_model(str(folder), device="cpu", dtype="float32", backend="lean")
    prompt = lm.encode(PROMPTS[2])
    ids = torch.tensor([prompt + [lm.mask_id] * 3, prompt[:-3] + [lm.mask_id] * 6])
    want = lm.model(input_ids=ids).logits
    assert (lm.net(input_ids=ids).logits - want).abs().max() <= 1e-4
    cache = lm.net.new_cache()   # a cached chunk of masks after a prompt without any
    lm.net(input_ids=ids[:, :-3], cache=cache)
    assert (lm.net(input_ids=ids[:, -3:], cache=cache).logits - want[:, -3:]).abs().max() <= 1e-4


def test_the_lean_module_loop_applies_the_deltas_as_the_scripted_fp32_loop(gated):
    from mars_core.engine.lean import LeanLM

    lm = load_model(str(gated[0]), device="cpu", dtype="float32", backend="hf", cpu_layout=False)
    ids = torch.tensor([lm.encode(PROMPTS[3]) + [lm.mask_id] * 3])
    scripted, eager = LeanLM(lm.model, "float", torch.float32), LeanLM(lm.model, "float", torch.float32, script=False)
    if scripted.scripted is None:
        pytest.skip("this torch cannot script the fp32 loop")
    assert eager.scripted is None
    assert torch.equal(scripted(input_ids=ids).logits, eager(input_ids=ids).logits)


def test_the_masks_see_what_training_trained_them_with(gated, base_dir):
    """The decoder's gate equals training's (finetune MaskGate on the peft model), on every column."""
    from finetune.train_model import MaskGate

    _, peft_model = gated
    lm = load_model(str(gated[0]), device="cpu", dtype="float32", backend="hf")
    trained = peft_model.get_base_model()
    MaskGate(trained, lm.mask_id)
    with torch.no_grad():   # training keeps the row in the embedding; the mask id's own logit is compared apart
        trained.get_input_embeddings().weight[lm.mask_id] = lm.model._mars_gated_mask_row
    ids = torch.tensor([lm.encode(PROMPTS[1]) + [lm.mask_id] * 3])
    ours, theirs = lm.model(input_ids=ids).logits, trained(input_ids=ids).logits
    keep = torch.arange(ours.shape[-1]) != lm.mask_id
    assert (ours[..., keep] - theirs[..., keep]).abs().max() <= 1e-5


def test_auto_serves_a_gated_adapter_in_float32_and_lean_w8a8_needs_our_kernels(gated, monkeypatch):
    folder, _ = gated
    assert load_model(str(folder), device="cpu", dtype="auto").weight_format == "float32"
    # fbgemm's products are separate torch ops, not our native stack, which is what applies the deltas in w8a8
    monkeypatch.setenv("MARS_W8A8_KERNEL", "fbgemm")
    with pytest.raises(ValueError, match="gated adapter.*own w8a8 kernels.*backend='hf'"):
        load_model(str(folder), device="cpu", dtype="w8a8", backend="lean")


@pytest.mark.parametrize("kernel", own_w8a8_kernels() + (["avx2w"] if "avx2" in own_w8a8_kernels() else []) or [
    pytest.param("vnni", marks=pytest.mark.skip(
        reason="neither of our w8a8 kernels builds on this machine (no g++ or no AVX2)"))])
def test_lean_w8a8_applies_the_deltas_at_the_masks_and_keeps_the_base_elsewhere(gated, base_dir, kernel, monkeypatch):
    """In the native stack the deltas are int8 products of the mask rows alone: τ = 1 and lossless are the base
    model's w8a8 answers, a batch decodes as each row alone, and the masks' logits are the fp32 adapter's to w8a8's
    precision (so smoothing's scales were carried into A and B). The same for w8a16 (kernel avx2w)."""
    dtype = "w8a16" if kernel == "avx2w" else "w8a8"
    if dtype == "w8a8":
        monkeypatch.setenv("MARS_W8A8_KERNEL", kernel)
    folder, _ = gated
    lm = load_model(str(folder), device="cpu", dtype=dtype, backend="lean")
    base = load_model(str(base_dir), device="cpu", dtype=dtype, backend="lean", mask_token=MASK_TOKEN)
    exact = load_model(str(folder), device="cpu", dtype="float32", backend="lean")
    assert lm.backend == "lean" and lm.weight_format == dtype and lm.net.kernel == kernel
    from mars_core.engine.lean import LeanLM
    with pytest.raises(ValueError, match="gated adapter only in our kernels' native layer stack.*script=False"):
        LeanLM(exact.model, "w8a8", kernel=kernel, script=False)   # the module loop has no delta to add
    one = DecodeConfig(mode="mars", tau=1.0, max_new_tokens=24)
    want = _ids(generate(base, PROMPTS, one))
    assert _ids(generate(lm, PROMPTS, one)) == want
    for layout in ("linear", "tree"):
        lossless = DecodeConfig(mode="verify", tau=0.05, max_new_tokens=24, draft_layout=layout)
        assert _ids(generate(lm, PROMPTS, lossless)) == want, layout
    cfg = DecodeConfig(mode="mars", tau=0.5, max_new_tokens=24)
    assert _ids(generate(lm, PROMPTS, cfg)) == [generate(lm, [p], cfg)[0].token_ids for p in PROMPTS]
    prompt = lm.encode(PROMPTS[2])
    ids = torch.tensor([prompt + [lm.mask_id] * 3, prompt[:-3] + [lm.mask_id] * 6])
    ours, theirs, fp32 = lm.net(input_ids=ids).logits, base.net(input_ids=ids).logits, exact.net(input_ids=ids).logits
    masks = ids == lm.mask_id
    assert torch.equal(ours[~masks], theirs[~masks])
    assert (ours[masks] - theirs[masks]).abs().max() > 0.1
    # w8a8 against fp32: no further at the masks than at the real positions (the base's own rounding)
    assert (ours[masks] - fp32[masks]).abs().max() <= 2 * (ours[~masks] - fp32[~masks]).abs().max() + 1e-3


def test_a_gated_adapter_for_another_base_is_refused_before_the_model_changes(gated, base_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from mars_core.models.adapter import attach_gated

    folder, _ = gated
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("adapter.safetensors", "adapter_config.json"):
        (bad / f).write_bytes((folder / f).read_bytes())
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["mask_id"] = 10_000   # past the embedding's rows
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    model = AutoModelForCausalLM.from_pretrained(str(base_dir))
    with pytest.raises(ValueError, match="another base"):
        attach_gated(model, bad)
    assert not hasattr(model, "_mars_gate") and all(type(m).__name__ != "GatedLinear" for m in model.modules())


def test_export_to_a_plain_checkpoint_refuses_a_gated_adapter(gated, tmp_path):
    from mars_core.models.export import export

    with pytest.raises(ValueError, match="gated adapter .* no plain transformers checkpoint can hold"):
        export(str(gated[0]), tmp_path / "out")
    assert not (tmp_path / "out").exists()
