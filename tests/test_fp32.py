"""mars_core/engine/fp32.cpp, the lean fp32 loop's products: each row's sums in one fixed order whatever the other
rows (so a row is the same bits alone or among others), close to the float64 product, the scripted loop equal to the
module loop on it, and a machine where it cannot be built falls back to MKL, saying why."""
import pytest
import torch

import mars_core.engine.fp32 as fp32
from mars_core.engine.lean import FloatLinear, LeanLM

pytestmark = pytest.mark.skipif(not fp32.cpu_supported(),
                                reason="this CPU has no AVX2/FMA, which mars_core/engine/fp32.cpp is written for")

# tiny-mars's and SmolLM2's products, and odd sizes: an input width that is odd (the last input joins the even
# chain) and output widths that leave a partial panel of 16 columns, with a bias as Qwen2's q/k/v have
SHAPES = [(576, 192, None), (192, 512, None), (576, 1536, None), (1536, 576, None), (37, 23, "bias"),
          (100, 129, "bias"), (16, 1, None)]


def test_the_kernel_builds_and_loads_on_this_cpu():
    """Where the CPU has the instructions, the build must succeed (a compiler error here is a bug, not a skip)."""
    assert fp32.load(), fp32.why_not()
    assert fp32.why_not() == ""


@pytest.mark.parametrize("n,k,bias", SHAPES)
def test_every_row_is_the_same_bits_alone_as_among_others_and_close_to_float64(n, k, bias):
    gen = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=gen), (torch.randn(n, generator=gen) if bias else None)
    lin = FloatLinear(w, b, torch.float32)
    assert lin.own32 is not None and lin.w is None                          # the kernel runs, no MKL copy is kept
    x = torch.randn(16, k, generator=gen)
    with torch.inference_mode():
        for rows in (2, 3, 4, 7, 16):                                        # 3 rows share each weight load
            together = lin(x[:rows])
            alone = torch.cat([lin(x[m: m + 1]) for m in range(rows)])
            assert torch.equal(together, alone), rows
        exact = x.double() @ w.double().t() + (0 if b is None else b.double())
        assert (lin(x).double() - exact).abs().max().item() <= 1e-5 * (k ** 0.5) * exact.abs().max().item()
        assert torch.allclose(lin(x), FloatLinear(w, b, torch.float32, own=False)(x), rtol=1e-4, atol=1e-4)


def test_a_batched_3d_input_is_each_row_alone():
    lin = FloatLinear(torch.randn(40, 24), None, torch.float32)
    x = torch.randn(2, 5, 24)
    with torch.inference_mode():
        assert torch.equal(lin(x), torch.stack([lin(x[i]) for i in range(2)]))


def test_a_mismatched_packed_weight_is_refused():
    packed = torch.ops.mars_fp32.pack(torch.randn(24, 40))
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.mars_fp32.linear(torch.randn(3, 25), packed, None, 40)
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.mars_fp32.linear(torch.randn(3, 24).double(), packed, None, 40)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_lean_fp32_loop_runs_the_kernel_and_stays_within_1e_4_of_transformers(arch, tokenizer):
    from tests.tiny_fixtures import make_model

    model = make_model(arch, len(tokenizer))
    net = LeanLM(model)
    assert net.scripted is not None and net.layers[0].qkv.own32 is not None and net.head.own32 is not None
    ids = torch.randint(5, len(tokenizer), (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        got, ref = net(input_ids=ids).logits, model(input_ids=ids).logits
    assert (got - ref).abs().max().item() <= 1e-4


def test_off_falls_back_to_mkl_and_says_why(monkeypatch):
    monkeypatch.setattr(fp32.OP, "state", {})
    monkeypatch.setenv("MARS_FP32", "0")
    assert not fp32.load() and fp32.why_not() == "MARS_FP32=0"
    lin = FloatLinear(torch.randn(8, 4), None, torch.float32)
    assert lin.own32 is None and lin.w is not None
