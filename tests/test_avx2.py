"""mars_core/engine/avx2.cpp, w8a8's AVX2 kernel: exact int32 sums, so it must give bit for bit what the definition
gives (fbgemm's quantization and rescale, W8A8Linear's epilogue) and what the VNNI kernel and fbgemm give on an
AVX512-VNNI CPU; the second pass skipped on exactly the tail positions; and a machine where it cannot be built
falls back, saying why."""
import pytest
import torch

import mars_core.engine.avx2 as avx2
from mars_core.engine.w8a8 import _INVERSE, _STEP, W8A8Linear, pick_kernel
from tests.tiny_fixtures import int8_weights, kernel_case, kernel_rows

pytestmark = pytest.mark.skipif(not avx2.cpu_supported(),
                                reason="this CPU has no AVX2/FMA, which mars_core/engine/avx2.cpp is written for")
STEP = float(_STEP)

# SmolLM2-135M's products (fused q/k/v, o, gate/up, down, the head) and two odd sizes that leave padding in both
# the channel blocks (4) and the 16-input steps, with a bias as Qwen2's q/k/v have
SHAPES = [(960, 576, None), (576, 576, None), (3072, 576, None), (576, 1536, None), (49152, 576, None),
          (37, 23, "bias"), (100, 129, "bias")]


def definition(lin: W8A8Linear, weight: torch.Tensor, x: torch.Tensor, length: int = 1, tail: int = 0):
    """W8A8Linear's product from its definition, in torch: fbgemm's quantization (one rounding of u / scale + 128,
    emulated exactly in float64 then rounded to fp32 as a fused multiply-add does), integer sums in float64
    (exact), fbgemm's rescale and the fp32 epilogue in W8A8Linear's order."""
    w = lin._own
    q_w, _ = int8_weights(weight)
    mag = x.abs().amax(1, keepdim=True).clamp(min=1e-30)
    u = x / mag

    def quantized(v):
        return (torch.round((v.double() * _INVERSE + 128).float()).clamp(0, 255) - 128).double()

    y = (quantized(u) @ q_w.t()).float() * w.scale
    if lin.passes == 2:
        r = u - torch.round(u * _INVERSE).clamp(-128.0, 127.0) * STEP
        r_mag = r.abs().amax(1, keepdim=True).clamp(min=1e-30)
        second = (quantized(r / r_mag) @ q_w.t()).float() * w.scale * r_mag
        keep = torch.tensor([m % length < length - tail for m in range(x.shape[0])])[:, None]
        y = torch.where(keep, y + second, y)
    y = y * mag
    return y if lin.bias is None else y + lin.bias


def linear(n, k, bias, passes, seed=0):
    return kernel_case(n, k, bias, passes, "avx2", seed)


def test_the_kernel_builds_and_loads_on_this_cpu():
    """Where the CPU has the instructions, the build must succeed (a compiler error here is a bug, not a skip)."""
    assert avx2.load(), avx2.why_not()
    assert avx2.why_not() == ""


@pytest.mark.parametrize("n,k,bias", SHAPES)
@pytest.mark.parametrize("passes", [1, 2])
def test_the_kernel_equals_the_definition_bitwise_for_any_number_of_rows(n, k, bias, passes):
    lin, weight, gen = linear(n, k, bias, passes)
    for rows in (1, 2, 3, 4, 7, 16):                                         # 3 rows per pass over a block
        x = kernel_rows(gen, rows, k)
        with torch.inference_mode():
            expected, got = definition(lin, weight, x), lin(x)
        assert torch.equal(got, expected), (rows, (got - expected).abs().max().item())


@pytest.mark.parametrize("n,k,bias", [(960, 576, None), (100, 129, "bias")])
def test_a_tail_skips_the_second_pass_on_the_last_positions_of_each_row_and_nothing_else(n, k, bias):
    """length 5, tail 2 on a batch of 3 rows of 5 positions: positions 3-4 of every row get the one-pass product,
    every other position the two-pass one, bitwise."""
    lin, weight, gen = linear(n, k, bias, 2)
    x = torch.randn(15, k, generator=gen) * 3
    w = lin._own
    with torch.inference_mode():
        got = torch.ops.mars_avx2.linear(x, w.packed, w.scale, lin.bias, True, _INVERSE, STEP, 5, 2)
    assert torch.equal(got, definition(lin, weight, x, 5, 2))
    assert not torch.equal(got, lin(x))   # the skipped second pass really changes those rows, so this can fail
    with pytest.raises(RuntimeError, match="tail"):
        torch.ops.mars_avx2.linear(x, w.packed, w.scale, lin.bias, True, _INVERSE, STEP, 5, 6)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.mars_avx2.linear(x.double(), w.packed, w.scale, lin.bias, True, _INVERSE, STEP, 5, 2)


def test_the_kernel_equals_the_vnni_kernel_and_fbgemm_where_this_cpu_has_avx512_vnni():
    import mars_core.engine.vnni as vnni

    if not vnni.cpu_supported():
        pytest.skip("no AVX512-VNNI here: the other kernels' sums are not exact (fbgemm) or cannot run (vnni)")
    for n, k, bias in SHAPES:
        lin, weight, gen = linear(n, k, bias, 2)
        others = [W8A8Linear(weight, lin.bias, passes=2, kernel=kn) for kn in ("vnni", "fbgemm")]
        x = torch.randn(7, k, generator=gen)
        with torch.inference_mode():
            assert all(torch.equal(lin(x), other(x)) for other in others), (n, k)


def test_tiny_mars_w8a8_answers_with_the_kernel_and_lossless_equals_ar(monkeypatch):
    from mars_core import DecodeConfig, generate, load_model

    monkeypatch.setenv("MARS_W8A8_KERNEL", "avx2")
    lm = load_model("tiny-mars", device="cpu", dtype="w8a8", backend="lean")
    assert lm.net.kernel == "avx2" and lm.net.scripted is not None
    prompts = ["What is 12 plus 30?", "What is 7 times 6?"]
    ar = [r.token_ids for r in generate(lm, prompts, DecodeConfig(mode="ar", max_new_tokens=24))]
    lossless = generate(lm, prompts, DecodeConfig(mode="verify", tau=0.3, max_new_tokens=24))
    assert [r.token_ids for r in lossless] == ar
    assert max(r.tokens_per_forward for r in lossless) > 1.5                  # drafts really were confirmed


def test_it_is_the_default_without_vnni_and_off_falls_back_to_fbgemm(monkeypatch):
    import mars_core.engine.vnni as vnni

    monkeypatch.delenv("MARS_W8A8_KERNEL", raising=False)
    monkeypatch.setattr(vnni.OP, "state", {})
    monkeypatch.setenv("MARS_VNNI", "0")
    assert pick_kernel() == "avx2"
    monkeypatch.setattr(avx2.OP, "state", {})
    monkeypatch.setenv("MARS_AVX2", "0")
    assert pick_kernel() == "fbgemm" and avx2.why_not() == "MARS_AVX2=0"
    with pytest.raises(ValueError, match=r"the w8a8 kernel 'avx2' is not available here \(MARS_AVX2=0\): use "
                                         r"MARS_W8A8_KERNEL=fbgemm"):
        W8A8Linear(torch.ones(4, 4), kernel="avx2")
