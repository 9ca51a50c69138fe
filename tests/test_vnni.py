"""mars_core/engine/vnni.cpp, w8a8's AVX512-VNNI kernel: it must give fbgemm's results bit for bit (so that which
kernel a machine runs never changes an answer), and a machine where it cannot run must fall back to fbgemm, saying
why."""
import pytest
import torch

import mars_core.engine.vnni as vnni
from mars_core.engine.native import cpu_flags
from mars_core.engine.w8a8 import W8A8Linear, pick_kernel

pytestmark = pytest.mark.skipif(not vnni.cpu_supported(),
                                reason="this CPU has no AVX512-VNNI, which mars_core/engine/vnni.cpp is written for")


def test_the_kernel_builds_and_loads_on_this_cpu():
    """Where the CPU has the instructions, the build must succeed (a compiler error here is a bug, not a skip)."""
    assert vnni.load(), vnni.why_not()
    assert vnni.why_not() == ""


# SmolLM2-135M's products (fused q/k/v, o, gate/up, down, the head) and two odd sizes that leave padding in both
# the channel blocks (16) and the 4-byte groups, with a bias as Qwen2's q/k/v have
SHAPES = [(960, 576, None), (576, 576, None), (3072, 576, None), (576, 1536, None), (49152, 576, None),
          (37, 23, "bias"), (100, 129, "bias")]


@pytest.mark.parametrize("n,k,bias", SHAPES)
@pytest.mark.parametrize("passes", [1, 2])
def test_the_kernel_equals_fbgemm_bitwise_for_any_number_of_rows(n, k, bias, passes):
    gen = torch.Generator().manual_seed(n + k + passes)
    weight = torch.randn(n, k, generator=gen) * 0.05
    weight[:, 1] *= 20                                                       # an outlier input channel
    b = torch.randn(n, generator=gen) if bias else None
    fbgemm = W8A8Linear(weight, b, passes=passes, kernel="fbgemm")
    ours = W8A8Linear(weight, b, passes=passes, kernel="vnni")
    for rows in (1, 2, 7, 16, 25, 49):                                       # 24 rows per pass over the weights
        x = torch.randn(rows, k, generator=gen) * 3
        x[:, 2] *= 40
        x[0, :] = 0.0                                                        # an all-zero row: magnitude 1e-30
        with torch.inference_mode():
            expected, got = fbgemm(x), ours(x)
        assert torch.equal(got, expected), (rows, (got - expected).abs().max().item())


@pytest.mark.parametrize("n,k,bias", [(960, 576, None), (100, 129, "bias")])
def test_a_tail_skips_the_second_pass_on_the_last_positions_of_each_row_and_nothing_else(n, k, bias):
    """length 5, tail 2 on a batch of 3 rows of 5 positions: positions 3-4 of every row get the one-pass product,
    every other position the two-pass one, bitwise."""
    from mars_core.engine.w8a8 import _INVERSE, _STEP

    assert vnni.load(), vnni.why_not()
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen) * 0.05
    b = torch.randn(n, generator=gen) if bias else None
    one, two = (W8A8Linear(weight, b, passes=p, kernel="vnni") for p in (1, 2))
    x = torch.randn(15, k, generator=gen) * 3
    v = two._own
    with torch.inference_mode():
        got = torch.ops.mars_vnni.linear(x, v.packed, v.scale, b, True, _INVERSE, float(_STEP), 5, 2)
        single, double = one(x), two(x)
    tail = torch.tensor([p % 5 >= 3 for p in range(15)])
    assert torch.equal(got[tail], single[tail]) and torch.equal(got[~tail], double[~tail])
    assert not torch.equal(single, double)   # the two passes really differ here, so the test can fail
    with pytest.raises(RuntimeError, match="tail"):
        torch.ops.mars_vnni.linear(x, v.packed, v.scale, b, True, _INVERSE, float(_STEP), 5, 6)


def test_values_on_fbgemms_rounding_ties_round_as_fbgemm_rounds_them():
    """fbgemm rounds u * 1/scale + 128 with one fused multiply-add; values on a tie of the plain product would
    round the other way with two roundings (mars_core.engine.w8a8.on_grid differs there)."""
    from mars_core.engine.w8a8 import _INVERSE

    k = 256
    ties = (torch.arange(-127, 129, dtype=torch.float32)[:k] + 0.5) / _INVERSE
    x = torch.stack([ties.clamp(-1, 1), torch.nextafter(ties, torch.zeros(k)).clamp(-1, 1)])
    x[:, 0] = 1.0                                                            # pin the magnitude to 1
    weight = torch.eye(k)
    for passes in (1, 2):
        with torch.inference_mode():
            assert torch.equal(W8A8Linear(weight, passes=passes, kernel="vnni")(x),
                               W8A8Linear(weight, passes=passes, kernel="fbgemm")(x))


def test_tiny_mars_decodes_to_the_same_logits_with_either_own_kernel_and_near_fbgemms(monkeypatch):
    """Our two kernels share the native layer stack (mars_core/engine/w8a8_layers.h), so a machine's choice between them
    changes no bit; fbgemm's runs the TorchScript loop, whose small ops round differently, so it is close only."""
    from mars_core import load_model

    nets = {}
    for kernel in ("fbgemm", "vnni", "avx2"):
        monkeypatch.setenv("MARS_W8A8_KERNEL", kernel)
        nets[kernel] = load_model("tiny-mars", device="cpu", dtype="w8a8", backend="lean")
        assert nets[kernel].net.kernel == kernel
    ids = torch.tensor([nets["vnni"].encode("What is 12 plus 30?")])
    with torch.inference_mode():
        logits = {k: lm.net(input_ids=ids, cache=lm.net.new_cache()).logits for k, lm in nets.items()}
    assert torch.equal(logits["vnni"], logits["avx2"])
    assert (logits["vnni"] - logits["fbgemm"]).abs().max() < 0.2
    assert torch.equal(logits["vnni"].argmax(-1), logits["fbgemm"].argmax(-1))


def test_the_kernel_is_the_default_here_and_off_falls_back_to_fbgemm(monkeypatch):
    monkeypatch.delenv("MARS_W8A8_KERNEL", raising=False)
    assert pick_kernel() == "vnni"
    monkeypatch.setattr(vnni.OP, "state", {})
    monkeypatch.setenv("MARS_VNNI", "0")
    monkeypatch.setenv("MARS_AVX2", "0")   # the next in line (tests/test_avx2.py)
    import mars_core.engine.avx2 as avx2

    monkeypatch.setattr(avx2.OP, "state", {})
    assert pick_kernel() == "fbgemm" and vnni.why_not() == "MARS_VNNI=0"
    monkeypatch.setenv("MARS_W8A8_KERNEL", "vnni")
    with pytest.raises(ValueError, match=r"the w8a8 kernel 'vnni' is not available here \(MARS_VNNI=0\): use "
                                         r"MARS_W8A8_KERNEL=fbgemm"):
        W8A8Linear(torch.ones(4, 4), kernel="vnni")


amx_cpu = pytest.mark.skipif("amx_int8" not in cpu_flags(),
                             reason="this CPU has no AMX-INT8, which the kernel's tile path uses")


@amx_cpu
def test_amx_is_used_here_and_gives_the_vnni_loops_bits_for_any_rows_widths_and_tails(monkeypatch):
    """On an AMX CPU every product runs on tiles (64-input chunks; the last k % 64 inputs on the VNNI loop). The
    int32 sums are the same integers, so the outputs must be bitwise the VNNI loop's: shapes with and without a
    remainder, fewer than 64 inputs, 1 to 49 rows (more than one group of 16), a lossless step's tail."""
    from mars_core.engine.w8a8 import _INVERSE, _STEP

    monkeypatch.delenv("MARS_AMX", raising=False)
    assert vnni.amx_used()
    op = torch.ops.mars_vnni
    try:
        for n, k, bias in SHAPES + [(50, 200, None), (33, 64, None), (70, 1000, "bias")]:
            gen = torch.Generator().manual_seed(3 * n + k)
            weight = torch.randn(n, k, generator=gen) * 0.05
            b = torch.randn(n, generator=gen) if bias else None
            v = W8A8Linear(weight, b, passes=2, kernel="vnni")._own
            for rows in (1, 2, 5, 16, 17, 49):
                x = torch.randn(rows, k, generator=gen) * 3
                for length, tail in ((1, 0), (rows, min(2, rows - 1))):
                    args = (x, v.packed, v.scale, b, True, _INVERSE, float(_STEP), length, tail)
                    with torch.inference_mode():
                        op.use_amx(0)
                        loop = op.linear(*args)
                        op.use_amx(1)
                        tiles = op.linear(*args)
                    assert torch.equal(tiles, loop), (n, k, rows, tail, (tiles - loop).abs().max().item())
    finally:
        op.use_amx(1)


@amx_cpu
def test_mars_amx_0_keeps_the_vnni_loop(monkeypatch):
    monkeypatch.setenv("MARS_AMX", "0")
    try:
        assert vnni.load() and not vnni.amx_used()
    finally:
        torch.ops.mars_vnni.use_amx(1)
    monkeypatch.delenv("MARS_AMX")
    assert vnni.amx_used()


@pytest.mark.parametrize("head_dim", [4, 8, 12, 20, 24, 28, 64])
def test_both_kernels_give_the_same_bits_and_fp32s_attention_whatever_the_head_size(head_dim):
    """The attention dot products sum sixteen partial sums (one AVX-512 register in this kernel, two AVX2 ones in
    the other), and a head size that is not a multiple of 16 leaves a last 4, 8 or 12 past them, which both builds
    must add the same way; the weighted sums of the values run 64, 8 and 4 columns at a time. Both must be the
    attention itself: the logits stay as close to the fp32 forward's as w8a8's products allow."""
    from mars_core.engine.lean import LeanLM
    from tests.tiny_fixtures import tiny_causal_lm

    model = tiny_causal_lm(50, "llama", head_dim=head_dim)
    nets = {kernel: LeanLM(model, "w8a8", kernel=kernel) for kernel in ("vnni", "avx2")}
    ref = LeanLM(model, "float")
    assert nets["vnni"].head_dim == head_dim and nets["vnni"].new_cache().dtype == torch.float32
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        logits = {k: net(input_ids=ids, cache=net.new_cache()).logits for k, net in nets.items()}
        exact = ref(input_ids=ids, cache=ref.new_cache()).logits
    assert torch.equal(logits["vnni"], logits["avx2"])
    assert logits["vnni"].abs().max() > 0 and not torch.equal(logits["vnni"][0], logits["vnni"][1])
    assert ((logits["vnni"] - exact).norm() / exact.norm()).item() < 0.05
