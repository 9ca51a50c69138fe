"""dtype="int8": int8 linear weights with a scale per row. Lossy against the float model, but the decoder's
guarantees hold against the int8 model itself: with fp32 activations one-token mode == AR == transformers
generate, batched == alone, lossless == AR, cached == uncached; with bf16 activations the one-token
equalities hold (every step feeds one position, as in AR)."""
import pytest
import torch

from mars_core import DecodeConfig, generate, load_model, reference_generate
from mars_core.engine.int8 import Int8Linear, quantize_int8
from mars_core.models.formats import pick_dtype
from tests.test_decoding import hf_greedy, hf_greedy_batch

MAX_NEW = 40


def int8_tiny_mars(act: torch.dtype):
    lm = load_model("tiny-mars", device="cpu", dtype="float32", cpu_layout=False)
    lm.model.to(act)
    quantize_int8(lm.model, act)
    return lm


@pytest.fixture(scope="module")
def prompts():
    from finetune.tasks import make_examples

    lm = load_model("tiny-mars", device="cpu", dtype="float32")
    return [lm.encode(e["messages"][0]["content"]) for e in make_examples("heldout", 8, seed=77)]


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32-act", "bf16-act"])
def lm_int8(request):
    return int8_tiny_mars(request.param)


@pytest.fixture(scope="module")
def lm_int8_fp32():
    return int8_tiny_mars(torch.float32)


def tokens(lm, prompts, **cfg):
    return [r.token_ids for r in generate(lm, prompts, DecodeConfig(max_new_tokens=MAX_NEW, **cfg))]


def test_int8_linear_rounds_each_weight_to_its_rows_scale():
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 24)
    q = Int8Linear(lin.weight, lin.bias, torch.float32)
    deq = q.qweight.float() * q.scale[:, None]
    assert q.qweight.dtype == torch.int8 and q.scale.shape == (24,)
    assert torch.all((deq - lin.weight).abs() <= q.scale[:, None] / 2 + 1e-7)
    x = torch.randn(3, 5, 48)
    assert torch.allclose(q(x), torch.nn.functional.linear(x, deq, lin.bias), atol=1e-5)
    assert not torch.allclose(q(x), lin(x), atol=1e-7)   # it is lossy: not the float layer


def test_quantize_replaces_every_linear_layer_the_tied_head_included(lm_int8_fp32):
    model = lm_int8_fp32.model
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert isinstance(model.get_output_embeddings(), Int8Linear)
    assert model.get_input_embeddings().weight.dtype == torch.float32   # the lookup table stays as it was


def test_one_token_mode_equals_ar_and_transformers_generate_in_int8(lm_int8, prompts):
    ar = tokens(lm_int8, prompts, mode="ar")
    assert tokens(lm_int8, prompts, mode="mars", tau=1.0) == ar
    assert [hf_greedy(lm_int8, p, MAX_NEW, lm_int8.eos_ids) for p in prompts[:4]] == ar[:4]


def test_batch_equals_alone_and_batched_generate_with_fp32_activations(lm_int8_fp32, prompts):
    ar = tokens(lm_int8_fp32, prompts, mode="ar")
    assert [tokens(lm_int8_fp32, [p], mode="ar")[0] for p in prompts] == ar
    assert hf_greedy_batch(lm_int8_fp32, prompts, MAX_NEW, lm_int8_fp32.eos_ids) == ar
    mars = tokens(lm_int8_fp32, prompts, mode="mars", tau=0.9)
    assert [tokens(lm_int8_fp32, [p], mode="mars", tau=0.9)[0] for p in prompts[:3]] == mars[:3]


def test_lossless_equals_ar_and_cached_equals_uncached_with_fp32_activations(lm_int8_fp32, prompts):
    ar = tokens(lm_int8_fp32, prompts, mode="ar")
    assert tokens(lm_int8_fp32, prompts, mode="verify", tau=0.9) == ar
    cfg = DecodeConfig(mode="mars", tau=0.9, max_new_tokens=MAX_NEW)
    cached = generate(lm_int8_fp32, prompts[:4], cfg)
    assert [r.steps for r in cached] == [r.steps for r in reference_generate(lm_int8_fp32, prompts[:4], cfg)]
    assert max(r.tokens_per_forward for r in cached) > 1.5   # tiny-mars still writes several tokens per forward


def test_load_model_int8_on_cpu_and_refused_elsewhere():
    lm = load_model("tiny-mars", device="cpu", dtype="int8")
    assert any(isinstance(m, Int8Linear) for m in lm.model.modules())
    assert lm.model.dtype in (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="int8.*CPU weight format.*--device cpu"):
        pick_dtype("int8", torch.device("cuda"))
    with pytest.raises(ValueError, match="int8"):
        pick_dtype("int4", torch.device("cpu"))


def test_cli_generate_and_row_costs_run_in_int8(capsys):
    from mars_core.tools.cli import main

    assert main(["generate", "--model", "tiny-mars", "--dtype", "int8", "--device", "cpu", "--max-new-tokens", "8",
                 "--threads", "1", "--prompt", "What is 2 + 3?"]) == 0
    assert main(["bench", "--model", "tiny-mars", "--dtype", "int8", "--device", "cpu", "--row-costs", "--rounds", "2",
                 "--threads", "1", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"dtype": "int8 (activations' in out and '"layout": "int8"' in out


def test_bench_counts_our_ar_in_another_format_as_a_baseline_and_divides_by_the_fastest(lm_int8_fp32):
    from mars_core.tools.bench import BenchSettings, bench, format_table

    lm = load_model("tiny-mars", device="cpu", dtype="float32")
    texts = ["What is 12 + 30?", "Sort: 3 1 2", "Reverse the word hello."]
    row = bench(lm, texts, BenchSettings(batch_sizes=(1,), max_new_tokens=16, repeats=1, reference=False),
                other_ar=lm_int8_fp32)[0]
    ids = [lm.encode(t) for t in texts]
    ar16 = DecodeConfig(mode="ar", max_new_tokens=16)
    same = [a.token_ids == b.token_ids for a, b in zip(generate(lm, ids, ar16), generate(lm_int8_fp32, ids, ar16))]
    label = f"ours, int8, {lm_int8_fp32.backend}"   # the format and what runs it
    assert row.other_ar_label == label and row.other_ar_time > 0
    assert row.other_ar_agreement == pytest.approx(sum(same) / len(same))
    fastest = min(t for t in (row.ar_time, row.hf_time, row.other_ar_time) if t is not None)
    assert row.mars_speedup == pytest.approx(fastest / row.mars_time)
    assert row.verify_speedup == pytest.approx(fastest / row.verify_time)
    assert (row.fastest_ar == label) == (fastest == row.other_ar_time)
    assert f"AR ({label})" in format_table([row])


def test_cli_bench_refuses_ar_dtype_with_row_costs_before_loading(capsys):
    from mars_core.tools.cli import main

    assert main(["bench", "--model", "tiny-mars", "--ar-dtype", "int8", "--row-costs"]) == 2
    assert "--ar-dtype" in capsys.readouterr().err
