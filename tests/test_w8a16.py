"""dtype="w8a16": w8a8's layer stack with each row's activations rounded once to int16 levels (mars_core/engine/avx2.cpp
built with MARS_WIDE). Its sums are exact int32 sums, so it must give bit for bit what its definition gives, never
overflow, keep every row independent of the others (lossless == AR, batch == alone) and refuse clearly where the
kernel cannot run."""
import pytest
import torch

import mars_core.engine.avx2 as avx2
from mars_core.engine.w8a8 import _INVERSE, _STEP, WIDE, W8A8Linear
from tests.tiny_fixtures import int8_weights, kernel_case, kernel_rows

pytestmark = pytest.mark.skipif(not avx2.cpu_supported(),
                                reason="this CPU has no AVX2/FMA, which mars_core/engine/avx2.cpp is written for")
INT32_MAX = 2 ** 31 - 1
# SmolLM2-135M's products (fused q/k/v, o, gate/up, down, the head), Qwen2.5-0.5B's down (4864 inputs: fewer
# levels) and two odd sizes that leave padding in the channel blocks and the 16-input steps, with a bias
SHAPES = [(960, 576, None), (576, 576, None), (3072, 576, None), (576, 1536, None), (49152, 576, None),
          (64, 4864, None), (37, 23, "bias"), (100, 129, "bias")]


def levels(k: int) -> int:
    return torch.ops.mars_avx2w.levels((k + 15) // 16 * 16)


def definition(lin: W8A8Linear, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """w8a16's product in torch: W8A8Linear's per-channel int8 weights, each row divided by its largest magnitude
    and rounded to `levels` (half to even), integer sums in float64 (exact), then fp32 sums * (w_scale / levels),
    * magnitude, + bias, in that order."""
    q_w, w_scale = int8_weights(weight)
    top = float(levels(weight.shape[1]))
    mag = x.abs().amax(1, keepdim=True).clamp(min=1e-30)
    a = torch.round((x / mag) * top).clamp(-top, top).double()
    sums = a @ q_w.t()
    assert sums.abs().max() <= INT32_MAX
    y = sums.float() * (w_scale.float() / top) * mag
    return y if lin.bias is None else y + lin.bias


def linear(n, k, bias, seed=0):
    return kernel_case(n, k, bias, 2, WIDE, seed)


def test_the_wide_kernel_builds_and_loads_on_this_cpu():
    assert avx2.WIDE.load(), avx2.WIDE.why_not()


def test_levels_are_the_most_that_no_int32_sum_can_overflow():
    for kp in (16, 512, 576, 1536, 4864, 18944):
        top = torch.ops.mars_avx2w.levels(kp)
        assert top <= 32767 and kp * top * 127 <= INT32_MAX
        assert top == 32767 or kp * (top + 1) * 127 > INT32_MAX, kp
    assert torch.ops.mars_avx2w.levels(576) == 29356 and torch.ops.mars_avx2w.levels(16) == 32767


@pytest.mark.parametrize("n,k,bias", SHAPES)
def test_the_kernel_equals_the_definition_bitwise_for_any_number_of_rows(n, k, bias):
    lin, weight, gen = linear(n, k, bias)
    for rows in (1, 2, 3, 4, 7, 16):                                         # 3 rows per pass over a block
        x = kernel_rows(gen, rows, k)
        with torch.inference_mode():
            expected, got = definition(lin, weight, x), lin(x)
            alone = torch.cat([lin(x[m: m + 1]) for m in range(rows)])
        assert torch.equal(got, expected), (rows, (got - expected).abs().max().item())
        assert torch.equal(alone, got)


def test_the_largest_possible_sums_do_not_overflow():
    """Every weight at 127 and every input at its largest level: each sum is k * levels * 127, just under the int32
    limit for the widest SmolLM2 and Qwen2.5 products; wrapped int32 sums would turn the outputs negative."""
    for k in (1536, 4864):
        lin = W8A8Linear(torch.ones(8, k), kernel=WIDE)
        x = torch.ones(3, k)
        x[1] *= -2.0
        with torch.inference_mode():
            y = lin(x)
        assert torch.allclose(y, x @ torch.ones(k, 8), rtol=1e-6), (k, y[:, 0])


def test_the_second_pass_flags_and_tail_change_nothing():
    """w8a16 has one pass: the arguments w8a8 uses to skip its second pass on a lossless step's masks are ignored,
    so the masks' rows are the same product as every other row."""
    lin, weight, gen = linear(960, 576, None)
    x = torch.randn(10, 576, generator=gen)
    w = lin._own
    with torch.inference_mode():
        plain = torch.ops.mars_avx2w.linear(x, w.packed, w.scale, None, False, _INVERSE, float(_STEP), 1, 0)
        tailed = torch.ops.mars_avx2w.linear(x, w.packed, w.scale, None, True, _INVERSE, float(_STEP), 5, 2)
    assert torch.equal(plain, tailed) and torch.equal(plain, definition(lin, weight, x))


def test_it_rounds_less_than_w8a8():
    """The activations keep ~15 bits where w8a8's one-pass products keep 8 (two-pass ones ~16): over a product with
    an outlier channel, the error against the fp32 product of the same int8 weights is smaller than w8a8's."""
    lin, weight, gen = linear(576, 1536, None)
    one_pass = W8A8Linear(weight, passes=1, kernel="avx2")
    x = torch.randn(4, 1536, generator=gen)
    x[:, 3] *= 50
    q_w, w_scale = int8_weights(weight)
    exact = x.double() @ (q_w * w_scale.double()[:, None]).t()
    with torch.inference_mode():
        wide_err = (lin(x).double() - exact).abs().mean()
        w8a8_err = (one_pass(x).double() - exact).abs().mean()
    assert wide_err < 0.5 * w8a8_err, (wide_err, w8a8_err)


def test_tiny_mars_in_w8a16_lossless_equals_ar_and_a_batch_equals_each_row_alone():
    from mars_core import DecodeConfig, generate, load_model

    lm = load_model("tiny-mars", device="cpu", dtype="w8a16", backend="lean")
    assert lm.net.kernel == WIDE and lm.net.native and lm.weight_format == "w8a16"
    prompts = ["What is 12 plus 30?", "What is 7 times 6?", "Name a colour."]
    ar = [r.token_ids for r in generate(lm, prompts, DecodeConfig(mode="ar", max_new_tokens=24))]
    alone = [generate(lm, [p], DecodeConfig(mode="ar", max_new_tokens=24))[0].token_ids for p in prompts]
    assert ar == alone
    lossless = generate(lm, prompts, DecodeConfig(mode="verify", tau=0.3, max_new_tokens=24))
    assert [r.token_ids for r in lossless] == ar
    assert max(r.tokens_per_forward for r in lossless) > 1.5                  # drafts really were confirmed
    one = generate(lm, prompts, DecodeConfig(mode="mars", tau=1.0, max_new_tokens=24))
    assert [r.token_ids for r in one] == ar                                  # tau >= 1 is AR


def test_w8a16_is_refused_with_the_fix_where_the_kernel_is_off(monkeypatch):
    from mars_core.models.formats import pick_dtype

    monkeypatch.setattr(avx2.WIDE, "state", {})
    monkeypatch.setenv("MARS_AVX2", "0")
    with pytest.raises(ValueError, match=r"dtype='w8a16' needs our AVX2 kernel .*MARS_AVX2=0.*use dtype='w8a8' or "
                                         r"'float32'"):
        pick_dtype("w8a16", torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU weight format"):
        pick_dtype("w8a16", torch.device("meta"))


@pytest.mark.slow
def test_smollm2_mars_in_w8a16_lossless_and_a_batch_equal_its_ar():
    """The format dtype="auto" may serve on an AVX2 CPU, on the real model: held-out natural prompts, lossless
    (linear and tree) == AR == τ = 1, and a batch == each row alone."""
    from finetune.evals.natural import natural_prompts
    from mars_core import DecodeConfig, generate, load_model

    lm = load_model("smollm2-mars", device="cpu", dtype="w8a16")
    assert lm.backend == "lean" and lm.weight_format == "w8a16" and lm.net.native
    prompts = natural_prompts("heldout", 12, seed=3)[:4]
    ar = [r.token_ids for r in generate(lm, prompts, DecodeConfig(mode="ar", max_new_tokens=32))]
    assert ar == [generate(lm, [p], DecodeConfig(mode="ar", max_new_tokens=32))[0].token_ids for p in prompts]
    assert [r.token_ids for r in generate(lm, prompts, DecodeConfig(mode="mars", tau=1.0, max_new_tokens=32))] == ar
    for layout in ("linear", "tree"):
        lossless = generate(lm, prompts, DecodeConfig(mode="verify", tau=0.3, max_new_tokens=32,
                                                      draft_layout=layout, block_size=2))
        assert [r.token_ids for r in lossless] == ar, layout
        assert sum(r.tokens_per_forward for r in lossless) / len(prompts) > 1.1, layout
