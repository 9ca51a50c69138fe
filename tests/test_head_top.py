"""The LM head's argmax gathered while it writes the logits (mars_core/engine/w8a8_kernel.h, Top; W8A8Linear.with_top;
LeanLM's head_top): the same logits bit for bit, the argmax of exactly those logits (the first column of a tie, the
mask column left out where the decoder leaves it out), a NaN reported as NaN, and a decoding that does not change.
Our own w8a8 kernels only (the ones that build on this CPU)."""
import numpy as np
import pytest
import torch

from mars_core import DecodeConfig, generate, load_model
from mars_core.decode.backend import net
from mars_core.engine.lean import LeanLM
from mars_core.engine.w8a8 import W8A8Linear
from tests.tiny_fixtures import make_tiny_model_dir, own_w8a8_kernels

KERNELS = own_w8a8_kernels()
no_kernel = pytest.mark.skip(reason="neither of our own w8a8 kernels builds on this CPU (no g++ or no AVX2)")
kernels = pytest.mark.parametrize("kernel", KERNELS or [pytest.param("vnni", marks=no_kernel)])


def _expected(y: torch.Tensor, exclude: int, period: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's own rule on the returned logits: the mask column set to -inf at the excluded rows
    (never_propose_mask), then numpy's argmax (mars_core.decode.step.argmax) and the value there."""
    ruled = y.clone()
    if exclude >= 0:
        rows = [m for m in range(y.shape[0]) if m % period >= first]
        ruled[rows, exclude] = float("-inf")
    index = torch.from_numpy(ruled.numpy().argmax(axis=-1))
    return ruled.gather(-1, index[:, None])[:, 0], index


def _ties(n: int) -> list[tuple[int, int]]:
    return [(a, b) for a, b in ((5, 5 + 16 * 3 + 7), (9, 9 + 16 * (n // 32))) if b < n]


def _head(n: int, k: int, seed: int, bias: bool = False):
    """Random weights with two exact ties for the largest output of every row (the same weight row at two columns,
    in different 16-column blocks and lanes, and once in the same lane of blocks far apart), and a strong column
    `n // 2` that wins wherever it is not excluded. Inputs share one direction so that those columns lead."""
    gen = torch.Generator().manual_seed(seed)
    direction = torch.randn(k, generator=gen)
    weight = torch.randn(n, k, generator=gen) * 0.02
    b = torch.randn(n, generator=gen) * 0.01 if bias else None
    for one, other in _ties(n):
        weight[one] = weight[other] = direction * 0.05
        if b is not None:
            b[one] = b[other] = 0.0
    weight[n // 2] = direction * 0.08
    x_gen = torch.Generator().manual_seed(seed + 1)

    def inputs(rows):
        return direction + 0.3 * torch.randn(rows, k, generator=x_gen)
    return weight, b, inputs


@kernels
@pytest.mark.parametrize("n,k,bias", [(49152, 576, False), (960, 576, True), (37, 23, True), (100, 129, False)])
@pytest.mark.parametrize("passes", [1, 2])
def test_the_head_s_top_is_the_argmax_of_its_own_logits_with_the_mask_column_left_out(kernel, n, k, bias, passes):
    weight, b, inputs = _head(n, k, n + k + passes, bias)
    head = W8A8Linear(weight, b, passes=passes, kernel=kernel)
    for rows, period, first in ((1, 1, 0), (1, 1, 1), (7, 7, 1), (8, 4, 2), (25, 5, 3), (49, 7, 7), (16, 1, 0)):
        x = inputs(rows)
        with torch.inference_mode():
            plain = head(x)
            for exclude in (-1, n // 2, 5):
                y, value, index, _ = head.with_top(x, exclude, period, first)
                assert torch.equal(y, plain), "the logits must not change when the top is gathered"
                want_value, want_index = _expected(y, exclude, period, first)
                assert torch.equal(index, want_index), (rows, period, first, exclude, index, want_index)
                assert torch.equal(value, want_value), (rows, period, first, exclude)
    # the ties are real: without the strong column, the first of the equal largest columns wins
    with torch.inference_mode():
        y, _, index, _ = head.with_top(inputs(3), n // 2, 1, 0)
    columns = sorted(c for pair in _ties(n) for c in pair)
    assert all(torch.equal(y[:, c], y[:, columns[0]]) for c in columns), "the fixture lost its ties"
    assert index.tolist() == [columns[0]] * 3


@pytest.mark.skipif("vnni" not in KERNELS, reason="the VNNI kernel (parallel over channel blocks) does not build here")
def test_two_threads_split_the_columns_and_give_the_same_top():
    """The VNNI kernel splits the channel blocks between threads; each chunk's top is merged under a lock with the
    same rule (larger value, else smaller column), so the result cannot depend on the split."""
    weight, _, inputs = _head(49152, 576, 11)
    head = W8A8Linear(weight, None, passes=2, kernel="vnni")
    x = inputs(7)
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            one = head.with_top(x, 49152 // 2, 7, 1)
            torch.set_num_threads(2)
            two = head.with_top(x, 49152 // 2, 7, 1)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one[:3], two[:3]):
        assert torch.equal(a, b)
    assert torch.equal(one[2], _expected(one[0], 49152 // 2, 7, 1)[1])


@kernels
def test_a_nan_logit_makes_its_row_s_top_nan(kernel):
    weight, _, inputs = _head(300, 64, 3)
    b = torch.zeros(300)
    b[200] = float("nan")                     # every row's column 200
    head = W8A8Linear(weight, b, passes=1, kernel=kernel)
    with torch.inference_mode():
        _, value, index, _ = head.with_top(inputs(3), -1, 1, 0)
    assert torch.isnan(value).all() and index.tolist() == [200] * 3
    b[200] = float("inf")
    head = W8A8Linear(weight, b, passes=1, kernel=kernel)
    with torch.inference_mode():
        _, value, index, _ = head.with_top(inputs(2), -1, 1, 0)
    assert torch.isinf(value).all() and index.tolist() == [200] * 2


@kernels
@pytest.mark.parametrize("n,k", [(49152, 576), (100, 129)])
def test_the_head_s_sums_give_the_softmax_probability_of_the_top_where_asked(kernel, n, k):
    """1 / sum is the decoder's confidence, softmax(logits)[argmax] with the mask column left out, at the rows from
    `conf_from` on (NaN before); the AVX2 loop gathers no sums and says so with NaN everywhere."""
    weight, b, inputs = _head(n, k, 7, bias=True)
    head = W8A8Linear(weight, b, passes=2, kernel=kernel)
    x = inputs(14)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                y, _, index, total = head.with_top(x, n // 2, 7, 2, 1)
            ruled = y.clone()
            ruled[[m for m in range(14) if m % 7 >= 2], n // 2] = float("-inf")
            want = torch.softmax(ruled, dim=-1).gather(-1, index[:, None])[:, 0]
            asked = torch.tensor([m % 7 >= 1 for m in range(14)])
            if head.gives_sums:
                assert torch.isnan(total[~asked]).all()
                assert torch.allclose(1 / total[asked], want[asked], rtol=1e-5, atol=0), (1 / total, want)
            else:
                assert torch.isnan(total).all()
    finally:
        torch.set_num_threads(before)


def test_the_fbgemm_head_refuses_with_top_by_name():
    head = W8A8Linear(torch.randn(40, 16), None, kernel="fbgemm")
    assert not head.gives_top
    with pytest.raises(ValueError, match="with_top needs one of our own w8a8 kernels.*'fbgemm'"):
        head.with_top(torch.randn(2, 16))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=3)


@kernels
@pytest.mark.parametrize("mode,tau", [("mars", 0.01), ("mars", 0.5), ("verify", 0.3), ("ar", 1.0)])
def test_decoding_with_the_head_s_top_writes_what_it_writes_without(tiny_dir, kernel, mode, tau, monkeypatch):
    """Every step of a w8a8 decode on our kernels asks the head for its top (a step's rows: q_0, drafts, masks,
    the mask id left out at the masks) and, on the VNNI kernel, the confidences; the tokens and the forwards are
    the same as with the argmax and the softmax taken from the logits afterwards."""
    monkeypatch.setenv("MARS_W8A8_KERNEL", kernel)
    lm = load_model(str(tiny_dir), device="cpu", dtype="w8a8", backend="lean")
    assert net(lm).takes_head_top
    prompts = ["What is 2+3?", "Hello there, tell me a long story about cats.", "Sort: c a b"]
    cfg = DecodeConfig(mode=mode, tau=tau, max_new_tokens=24, block_size=4)
    forward, asked, confs = net(lm).forward, [], []

    def counted(*args, **kwargs):
        out = forward(*args, **kwargs)
        asked.append(out.top is not None)
        confs.append(out.conf is not None)
        return out
    monkeypatch.setattr(net(lm), "forward", counted)
    with_top = generate(lm, prompts, cfg)
    assert asked and all(asked)
    assert all(confs) if kernel == "vnni" else not any(confs)
    asked.clear()
    monkeypatch.setattr(LeanLM, "takes_head_top", property(lambda self: False))
    without = generate(lm, prompts, cfg)
    assert asked and not any(asked)
    for a, b in zip(with_top, without):
        assert a.token_ids == b.token_ids
        assert a.steps == b.steps and a.drafted == b.drafted
