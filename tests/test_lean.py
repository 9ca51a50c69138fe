"""The lean forward (mars_core/engine/lean.py) against the transformers model it is built from, and the w8a8 format.

fp32: the lean logits equal transformers' to 1e-4 for a prompt, a cached chunk, a chunk with hole columns, after
a crop and after a row selection (tiny Llama and Qwen2 here, SmolLM2 in test_smollm2_mars.py's style below). The
decoder equivalences on the lean backend run in test_decoding.py / test_verify.py through the `tiny_lm` fixture.
w8a8: each output row of a product is bitwise independent of the other rows, so in that format one-token mode,
lossless decoding and greedy AR give the same tokens, batched or alone."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from mars_core import DecodeConfig, generate, load_model
from mars_core.decode.batch import step_attention
from mars_core.engine.lean import LeanLM, unsupported
from mars_core.engine.lean_cache import GROW, LeanCache
from mars_core.models.formats import pick_backend
from mars_core.models.loading import wrap_model
from mars_core.engine.w8a8 import OWN, W8A8Linear, w8a8_supported
from tests.conftest import PROMPTS
from tests.tiny_fixtures import make_model, tiny_causal_lm

TOL = 1e-4


class Pair:
    """The same calls on the transformers model (DynamicCache) and on its lean forward (LeanCache)."""

    def __init__(self, model):
        self.hf, self.lean = model, LeanLM(model)
        self.hf_cache, self.lean_cache = DynamicCache(config=model.config), self.lean.new_cache()
        self.kv_valid = None

    def step(self, ids, valid=None, keep=None):
        """Feed `ids` [b, L] after the cache; `valid` marks real (non-hole) columns. Returns the max logit gap."""
        b, length = ids.shape
        valid = torch.ones(b, length, dtype=torch.bool) if valid is None else valid
        past = self.hf_cache.get_seq_length()
        assert self.lean_cache.get_seq_length() == past
        kv = self.kv_valid if self.kv_valid is not None else torch.zeros(b, 0, dtype=torch.bool)
        mask = step_attention(kv, valid)
        # holes take no position, as in the decoder's chunk
        pos = torch.where(valid, valid.long().cumsum(1) - 1 + kv.long().sum(1, keepdim=True), torch.zeros_like(ids))
        kw = dict(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                  logits_to_keep=keep if keep is not None else 0)
        with torch.inference_mode():
            want = self.hf(cache=self.hf_cache, **kw).logits
            got = self.lean(cache=self.lean_cache, **kw).logits
        self.kv_valid = torch.cat([kv, valid], dim=1)
        real = valid if keep is None else valid[:, keep]
        return (want - got)[real].abs().max().item()

    def crop(self, n):
        self.hf_cache.crop(-n)
        self.lean_cache.crop(-n)
        self.kv_valid = self.kv_valid[:, :-n]

    def select(self, rows):
        index = torch.tensor(rows)
        self.hf_cache.batch_select_indices(index)
        self.lean_cache.batch_select_indices(index)
        self.kv_valid = self.kv_valid[index]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_logits_equal_transformers_for_prompt_chunk_holes_crop_and_row_selection(arch, tokenizer):
    model = make_model(arch, len(tokenizer))
    gen = torch.Generator().manual_seed(0)
    rand = lambda b, n: torch.randint(5, len(tokenizer), (b, n), generator=gen)
    with torch.inference_mode():   # a prompt, no cache, no mask: plain causal
        ids = rand(1, 11)
        assert (model(input_ids=ids).logits - LeanLM(model)(input_ids=ids).logits).abs().max() <= TOL
    pair = Pair(model)
    holes = torch.tensor([[True] * 9, [False] * 3 + [True] * 6, [False] * 5 + [True] * 4])
    assert pair.step(rand(3, 9), holes) <= TOL                        # prompts of 9, 6, 4 tokens, right-aligned
    assert pair.step(rand(3, 5), keep=torch.arange(1, 5)) <= TOL      # a cached chunk, the head on 4 columns
    pair.crop(3)                                                       # the masks leave
    assert pair.step(rand(3, 1)) <= TOL                                # one position, as an AR step
    ragged = torch.tensor([[True] * 4, [False, False, True, True], [False, True, True, True]])
    assert pair.step(rand(3, 4), ragged) <= TOL                        # verify-style holes inside the chunk
    pair.select([0, 2])                                                # a row finished
    assert pair.step(rand(2, 7), keep=torch.arange(3, 7)) <= TOL
    pair.crop(2)
    assert pair.step(rand(2, 1)) <= TOL


@pytest.mark.parametrize("key_tiles", [False, True])
def test_lean_cache_keeps_its_columns_when_it_grows_and_grows_only_when_full(key_tiles):
    """Both layouts: keys by column as values are, and keys in tiles of 16 columns stored by dimension, as our native
    stack reads them."""
    cache = LeanCache(layers=2, kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu", limit=10_000,
                      key_tiles=key_tiles)
    cache.reserve(batch=2, columns=5)
    first = cache.v.shape[3]
    assert cache.k.shape == ((2, 2, 1, first // 16, 4, 16) if key_tiles else (2, 2, 1, first, 4))

    def keys(c, n):   # [layers, batch, kv, column, d]
        return c.k.transpose(4, 5).flatten(3, 4)[:, :, :, :n] if key_tiles else c.k[:, :, :, :n]

    keys(cache, 21).copy_(torch.arange(2 * 2 * 21 * 4, dtype=torch.float32).reshape(2, 2, 1, 21, 4))
    cache.v[:, :, :, :21] = -torch.arange(2 * 2 * 21 * 4, dtype=torch.float32).reshape(2, 2, 1, 21, 4)
    before, values = keys(cache, 21).clone(), cache.v[:, :, :, :21].clone()
    cache.length = 21                                                  # into a second tile of 16
    storage = cache.k.data_ptr(), cache.v.data_ptr()
    cache.reserve(batch=2, columns=first - 21)                         # fits: the same tensors
    assert (cache.k.data_ptr(), cache.v.data_ptr()) == storage
    cache.reserve(batch=2, columns=first)                              # past the first allocation
    assert cache.v.shape[3] >= 21 + first
    assert (cache.k.shape[3] * 16 if key_tiles else cache.k.shape[3]) == cache.v.shape[3]
    assert torch.equal(keys(cache, 21), before) and torch.equal(cache.v[:, :, :, :21], values)
    cache.length = 5
    cache.crop(-2)
    assert cache.get_seq_length() == 3
    cache.crop(10)
    assert cache.get_seq_length() == 3                                 # crop(n >= 0) keeps at most n columns


def test_a_generation_longer_than_the_first_cache_allocation_equals_transformers(tokenizer):
    model = tiny_causal_lm(len(tokenizer), "llama", context=1024, head_scale=60.0, eos_token_id=2, pad_token_id=0)
    hf, lean = wrap_model(model, tokenizer), wrap_model(model, tokenizer, backend="lean")
    ids = [hf.encode(PROMPTS[0])]
    cfg = DecodeConfig(mode="ar", max_new_tokens=GROW + 60)
    want, got = generate(hf, ids, cfg)[0], generate(lean, ids, cfg)[0]
    assert len(got.token_ids) > GROW and got.token_ids == want.token_ids


def test_backend_choice_and_its_errors(tokenizer):
    model = make_model("llama", len(tokenizer))
    assert pick_backend("auto", model, torch.device("cpu")) == "lean"
    assert pick_backend("hf", model, torch.device("cpu")) == "hf"
    with pytest.raises(ValueError, match="backend='turbo' is unknown: use auto, hf or lean"):
        pick_backend("turbo", model, torch.device("cpu"))
    model.config.model_type = "gpt2"
    assert "architecture 'gpt2'" in unsupported(model)
    assert pick_backend("auto", model, torch.device("cpu")) == "hf"   # falls back to the transformers model
    with pytest.raises(ValueError, match="backend='lean' cannot run this model: .*use backend='hf'"):
        pick_backend("lean", model, torch.device("cpu"))


def test_tiny_mars_loads_on_the_lean_backend_by_default_on_a_cpu():
    lm = load_model("tiny-mars", device="cpu")
    assert lm.backend == "lean" and isinstance(lm.net, LeanLM) and lm.weight_format == "float32"
    assert load_model("tiny-mars", device="cpu", backend="hf").backend == "hf"


# ----------------------------------------------------------------------------- w8a8

def test_this_torch_has_the_w8a8_kernel():
    """A canary: if a torch release drops fbgemm's dynamic int8 linear, this fails first and says so."""
    assert w8a8_supported(), (f"torch {torch.__version__} has no torch.ops.quantized.linear_dynamic/linear_prepack "
                              "with an fbgemm or x86 engine: dtype='w8a8' cannot run; mars_core/engine/w8a8.py needs "
                              "another int8 kernel")


def test_this_torch_has_the_onednn_w8a8_kernel_and_an_unknown_kernel_is_refused(monkeypatch):
    from mars_core.engine.w8a8 import onednn_supported, pick_kernel

    assert onednn_supported(), f"torch {torch.__version__} has no torch.ops.onednn.qlinear_pointwise/qlinear_prepack"
    monkeypatch.setenv("MARS_W8A8_KERNEL", "avx9000")
    with pytest.raises(ValueError,
                       match="MARS_W8A8_KERNEL='avx9000' is unknown: use one of fbgemm, onednn, vnni, avx2"):
        pick_kernel()
    with pytest.raises(ValueError, match="kernel='x' is unknown"):
        W8A8Linear(torch.ones(2, 2), kernel="x")


def test_w8a8_without_the_kernel_is_a_clear_error(monkeypatch):
    import mars_core.engine.w8a8 as w8a8

    monkeypatch.setattr(w8a8, "w8a8_supported", lambda: False)
    with pytest.raises(ValueError, match=r"dtype='w8a8' needs fbgemm's dynamic int8 linear .*use dtype='int8'"):
        load_model("tiny-mars", device="cpu", dtype="w8a8")


@pytest.mark.parametrize("kernel", ["fbgemm", "onednn", "vnni", "avx2"])
@pytest.mark.parametrize("passes", [1, 2])
def test_w8a8_rows_are_bitwise_independent_of_the_batch_and_close_to_fp32(passes, kernel):
    need_kernel(kernel)
    if kernel in ("fbgemm", "onednn") and not vnni_cpu():
        pytest.skip(f"{kernel}'s sums saturate on a CPU without AVX512-VNNI: "
                    "test_torch_kernels_saturate_without_vnni_which_is_why_avx2_is_picked asserts that here")
    together, rel, act_error = w8a8_errors(passes, kernel)
    assert rel < 0.05, rel
    # two passes leave only the weights' rounding: the activations' own error is ~255 times smaller
    assert act_error < (0.002 if passes == 2 else 0.05) and (passes == 2 or act_error > 0.002), act_error


def test_torch_kernels_saturate_without_vnni_which_is_why_avx2_is_picked(monkeypatch):
    """fbgemm's and oneDNN's AVX2 paths sum byte products in int16 pairs that saturate: their rows stay
    independent but their products are several times further from fp32 than the exact one. Where the CPU has
    AVX512-VNNI their sums are exact and the test above covers them."""
    from mars_core.engine.w8a8 import pick_kernel

    if vnni_cpu():
        pytest.skip("fbgemm's and oneDNN's sums are exact on this AVX512-VNNI CPU (the test above checks it)")
    need_kernel("avx2")
    monkeypatch.delenv("MARS_W8A8_KERNEL", raising=False)
    assert pick_kernel() == "avx2"
    for passes in (1, 2):
        _, exact, _ = w8a8_errors(passes, "avx2")
        for kernel in ("fbgemm", "onednn"):
            _, saturated, _ = w8a8_errors(passes, kernel)
            assert saturated > 2 * exact and exact < 0.05, (kernel, passes, saturated, exact)


def vnni_cpu() -> bool:
    from mars_core.engine.vnni import cpu_supported

    return cpu_supported()


def w8a8_errors(passes, kernel):
    """A W8A8Linear's output on 7 rows of very different scales (asserted equal to the rows one at a time), its
    largest relative error against fp32, and against the weight-only rounding (the activations' own error)."""
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(96, 80, generator=gen) * 0.05, torch.randn(96, generator=gen)
    x = torch.randn(7, 80, generator=gen) * torch.tensor([1, 30, 0.01, 1, 5, 1, 200.0])[:, None]
    x[:, 3] *= 40                                                        # an outlier channel, as after a norm
    lin = W8A8Linear(weight, bias, passes=passes, kernel=kernel)
    scale = weight.abs().amax(dim=1, keepdim=True) / 127
    with torch.inference_mode():
        together = lin(x)
        alone = torch.cat([lin(x[i:i + 1]) for i in range(7)])
        exact = x @ weight.t() + bias
        weight_only = x @ (torch.round(weight / scale) * scale).t() + bias      # what both kernels multiply by
    assert torch.equal(together, alone)
    rel = ((together - exact).norm(dim=1) / exact.norm(dim=1)).max().item()
    act_error = ((together - weight_only).norm(dim=1) / exact.norm(dim=1)).max().item()
    return together, rel, act_error


def need_kernel(kernel: str) -> None:
    """Our own kernels run only on CPUs with their instructions; where the CPU has them, they must build
    (tests/test_vnni.py, tests/test_avx2.py)."""
    from mars_core.engine.w8a8 import OWN, own_kernel

    if kernel in OWN and not own_kernel(kernel).cpu_supported():
        pytest.skip(f"this CPU lacks the instructions mars_core/{kernel}.cpp is written for")


@pytest.fixture(scope="module", params=["fbgemm", "onednn", "vnni", "avx2"])
def tiny_mars_w8a8(request):
    """tiny-mars in w8a8 with each kernel (MARS_W8A8_KERNEL, read when the model is built)."""
    need_kernel(request.param)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MARS_W8A8_KERNEL", request.param)
        lm = load_model("tiny-mars", device="cpu", dtype="w8a8")
    assert lm.net.kernel == request.param
    return lm


@pytest.fixture(scope="module")
def suite(tiny_mars_w8a8):
    from finetune.tasks import make_examples

    return [tiny_mars_w8a8.encode(e["messages"][0]["content"]) for e in make_examples("heldout", 8, seed=321)]


def test_w8a8_one_token_mode_and_lossless_equal_ar_in_that_format(tiny_mars_w8a8, suite):
    lm = tiny_mars_w8a8
    assert lm.backend == "lean" and lm.weight_format == "w8a8"
    ar = [r.token_ids for r in generate(lm, suite, DecodeConfig(mode="ar", max_new_tokens=40))]
    one = generate(lm, suite, DecodeConfig(mode="mars", tau=1.0, max_new_tokens=40))
    assert [r.token_ids for r in one] == ar
    for tau in (0.5, 0.9):
        lossless = generate(lm, suite, DecodeConfig(mode="verify", tau=tau, max_new_tokens=40))
        assert [r.token_ids for r in lossless] == ar
        assert max(r.tokens_per_forward for r in lossless) > 1.5     # drafts really were confirmed
        for p, row in zip(suite[:3], lossless[:3]):
            assert generate(lm, [p], DecodeConfig(mode="verify", tau=tau, max_new_tokens=40))[0].steps == row.steps


def test_our_kernels_stream_their_weights_from_one_buffer(tiny_mars_w8a8):
    """mars_core.engine.hugepages: the packed weights of our kernels are moved into one buffer (on 2 MB pages where
    the OS grants them); the torch kernels keep theirs where they are."""
    net = tiny_mars_w8a8.net
    if net.kernel not in OWN:
        assert not net.huge_pages and not hasattr(net.layers[0].qkv, "_own")
        return
    packed = [getattr(layer, n)._own.packed for layer in net.layers for n in ("qkv", "o", "gate_up", "down")]
    packed.append(net.head._own.packed)
    assert len({p.untyped_storage().data_ptr() for p in packed}) == 1


def test_w8a8_mars_batch_equals_each_row_alone(tiny_mars_w8a8, suite):
    cfg = DecodeConfig(mode="mars", tau=0.8, max_new_tokens=40)
    together = generate(tiny_mars_w8a8, suite, cfg)
    for p, row in zip(suite, together):
        assert generate(tiny_mars_w8a8, [p], cfg)[0].steps == row.steps
    assert len({len(s) for r in together for s in r.steps}) > 1


def test_the_compiled_w8a8_layers_exist_here_and_match_the_eager_loop(tiny_mars_w8a8, suite):
    """fbgemm's and oneDNN's loops run through TorchScript, the same ops in the same order: their logits are the
    eager loop's, bit for bit (this fails first, and says so, if a torch release can no longer script them). Our
    kernels run every layer in one native call (mars_core/engine/w8a8_layers.h), whose small ops are loops of its
    own: its logits are close to the eager loop's and as close to fp32's."""
    from mars_core.engine.lean_script import scripted
    from mars_core.engine.w8a8 import OWN
    from mars_core.models.formats import calibration_ranges

    net, fp32 = tiny_mars_w8a8.net, tiny_mars_w8a8_fp32()
    loop = {"fbgemm": "w8a8", "onednn": "w8a8-onednn", "vnni": "w8a8-vnni", "avx2": "w8a8-avx2"}[net.kernel]
    assert scripted(loop) is not None, (f"torch {torch.__version__} cannot script "
                                        f"mars_core/engine/lean_script.py's {loop}")
    eager = LeanLM(fp32, "w8a8", script=False, ranges=calibration_ranges(fp32, tiny_mars_w8a8.tokenizer),
                   kernel=net.kernel)
    ref = LeanLM(fp32, "float", script=False)
    assert net.scripted is not None and eager.scripted is None
    ids = torch.tensor([suite[0]])
    step = torch.tensor([[5, 6, 7]])
    mask = step_attention(torch.ones(1, ids.shape[1], dtype=torch.bool), torch.ones(1, 3, dtype=torch.bool))
    rel = lambda x, y: ((x - y).norm() / y.norm()).item()
    with torch.inference_mode():
        caches = [m.new_cache() for m in (net, eager, ref)]
        for args in (dict(input_ids=ids), dict(input_ids=step, attention_mask=mask)):
            ours, plain, exact = (m(**args, cache=c).logits for m, c in zip((net, eager, ref), caches))
            if net.kernel in OWN:
                assert rel(ours, plain) < 0.01 and rel(ours, exact) < 1.25 * rel(plain, exact) + 1e-4, (
                    rel(ours, plain), rel(ours, exact), rel(plain, exact))
            else:
                assert torch.equal(ours, plain)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_our_kernels_native_layers_compute_each_position_on_its_own(arch, tokenizer):
    """A position's logits from mars_core/engine/w8a8_layers.h are bitwise the same fed alone, in a chunk with
    others, in a batch beside another row, or beside hidden columns: what lossless == AR and batch == alone rest on.
    Grouped-query attention (4 heads, 2 KV heads) and Qwen2's q/k/v biases included; close to the eager loop."""
    from mars_core.engine.w8a8 import OWN, own_kernel

    kernel = next((k for k in OWN if own_kernel(k).cpu_supported()), None)
    if kernel is None:
        pytest.skip("this CPU has neither AVX512-VNNI nor AVX2 for our kernels")
    model = make_model(arch, len(tokenizer))
    with torch.no_grad():   # sharper attention than a random init's near-uniform one: its sums must not round alike
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight *= 8
    net, eager = LeanLM(model, "w8a8", kernel=kernel), LeanLM(model, "w8a8", script=False, kernel=kernel)
    assert net.scripted is not None
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(5, len(tokenizer), (2, 41), generator=gen)
    chunk = torch.randint(5, 40, (2, 4), generator=gen)
    valid = torch.tensor([[True] * 41, [False] * 5 + [True] * 36])           # row 1: a 36-token prompt, right-aligned
    pos = lambda start, n: torch.arange(start, start + n).expand(2, n)
    with torch.inference_mode():
        cache = net.new_cache()
        net(input_ids=prompt, attention_mask=step_attention(valid[:, :0], valid), position_ids=pos(0, 41), cache=cache)
        ones = torch.ones(2, 4, dtype=torch.bool)
        together = net(input_ids=chunk, attention_mask=step_attention(valid, ones), position_ids=pos(41, 4),
                       cache=cache).logits
        alone = []                                                          # the same positions one at a time
        cache = net.new_cache()
        net(input_ids=prompt, attention_mask=step_attention(valid[:, :0], valid), position_ids=pos(0, 41), cache=cache)
        for j in range(4):
            kv = torch.cat([valid, torch.ones(2, j, dtype=torch.bool)], dim=1)
            alone.append(net(input_ids=chunk[:, j:j + 1], attention_mask=step_attention(kv, ones[:, :1]),
                             position_ids=pos(41 + j, 1), cache=cache).logits)
        assert torch.equal(together, torch.cat(alone, dim=1))
        row = net.new_cache()                                               # row 0 in a batch of one
        net(input_ids=prompt[:1], position_ids=pos(0, 41)[:1], cache=row)
        first = net(input_ids=chunk[:1], position_ids=pos(41, 4)[:1], cache=row).logits
        assert torch.equal(first, together[:1])
        # row 1 alone, without its 5 hidden columns: every later key sits 5 columns further left, so nothing in
        # attention may depend on a key's column (a padded batch row, or a row with holes, against itself alone)
        row = net.new_cache()
        net(input_ids=prompt[1:, 5:], position_ids=pos(5, 36)[:1], cache=row)
        second = net(input_ids=chunk[1:], position_ids=pos(41, 4)[:1], cache=row).logits
        assert torch.equal(second, together[1:])
        plain = eager(input_ids=prompt[:1], position_ids=pos(0, 41)[:1], cache=eager.new_cache()).logits
        ours = net(input_ids=prompt[:1], position_ids=pos(0, 41)[:1], cache=net.new_cache()).logits
        assert ((ours - plain).norm() / plain.norm()).item() < 0.02
    with pytest.raises(RuntimeError, match=r"layers: a float32 \[b \* length, hidden\] input is expected"):
        net.scripted(torch.zeros(3, 64, dtype=torch.float64), *net._script_weights, row.k, row.v, 0, 1, 3, 4, 2, 16,
                     torch.zeros(3, 6, 8, dtype=torch.complex64), None, 1e-6)


def test_a_draft_tail_changes_only_the_tail_positions_outputs(tiny_mars_w8a8, suite):
    """A lossless step tells the forward that its last positions (masks) only propose drafts: VNNI computes them
    with one pass (so does the AVX2 kernel), and every other position's logits stay bitwise what they were; other
    kernels ignore it."""
    net = tiny_mars_w8a8.net
    ids = torch.tensor([suite[0]])
    step = torch.tensor([[5, 6, 7, tiny_mars_w8a8.mask_id, tiny_mars_w8a8.mask_id]])
    with torch.inference_mode():
        outs = []
        for tail in (0, 2):
            cache = net.new_cache()
            net(input_ids=ids, cache=cache)
            mask = step_attention(torch.ones(1, ids.shape[1], dtype=torch.bool), torch.ones(1, 5, dtype=torch.bool))
            outs.append(net(input_ids=step, attention_mask=mask, cache=cache, draft_tail=tail).logits[0])
    full, cheap = outs
    assert torch.equal(full[:3], cheap[:3])
    assert torch.equal(full[3:], cheap[3:]) == (net.kernel not in ("vnni", "avx2"))


def tiny_mars_w8a8_fp32():
    return load_model("tiny-mars", device="cpu", dtype="float32", backend="hf").model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_smoothing_moves_scale_between_activations_and_weights_without_changing_the_function(arch, tokenizer):
    """SmoothQuant's folding (into the norms, the v rows and the up rows) leaves the float model's logits as they
    were; in w8a8 it only changes which values get rounded."""
    from mars_core.engine.w8a8 import activation_ranges

    model = make_model(arch, len(tokenizer))
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(5, len(tokenizer), (1, 12), generator=gen)
    ranges = activation_ranges(model, [ids[0].tolist()[:7], ids[0].tolist()[3:]])
    smoothed = LeanLM(model, "float", ranges=ranges)
    assert not torch.equal(smoothed.layers[0].norm_in, LeanLM(model).layers[0].norm_in)   # it did move scale
    with torch.inference_mode():
        assert (model(input_ids=ids).logits - smoothed(input_ids=ids).logits).abs().max() <= TOL


def test_on_grid_rounds_as_fbgemm_does():
    """The two-pass products take what fbgemm's rounding left out; that needs fbgemm's own grid, read off a product
    with the identity matrix."""
    from mars_core.engine.w8a8 import RAILS, on_grid

    gen = torch.Generator().manual_seed(2)
    u = torch.rand(64, 256, generator=gen) * 2 - 1
    u = u / u.abs().amax(dim=1, keepdim=True)
    u[0, :2] = torch.tensor([1.0, -1.0])
    rails = torch.tensor([[1.0, -1.0]]).expand(64, RAILS)
    with torch.inference_mode():
        seen = torch.ops.quantized.linear_dynamic(torch.cat([u, rails], dim=1), W8A8Linear(torch.eye(256))._packed)
    assert (seen - on_grid(u)).abs().max() < 1e-6


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_scripted_fp32_layers_equal_the_module_loop_bitwise(arch, tokenizer):
    model = make_model(arch, len(tokenizer))
    fast, plain = LeanLM(model), LeanLM(model, script=False)
    assert fast.scripted is not None and plain.scripted is None
    ids = torch.randint(5, len(tokenizer), (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        assert torch.equal(fast(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_a_quantized_load_still_counts_the_models_parameters(tiny_mars_w8a8):
    float_count = sum(p.numel() for p in load_model("tiny-mars", device="cpu", dtype="float32").model.parameters())
    assert tiny_mars_w8a8.n_params == float_count                     # the packed int8 weights hide theirs
    assert sum(p.numel() for p in tiny_mars_w8a8.model.parameters()) < float_count


@pytest.mark.skipif(not __import__("mars_core.engine.lean", fromlist=["x"]).packed_bf16_supported(),
                    reason="bf16's packed products need oneDNN on a CPU with AMX; elsewhere bf16 runs F.linear, "
                           "whose multi-row results drift, and makes no exactness claim")
def test_bf16_on_an_amx_cpu_is_packed_and_exact_lossless_equals_ar_and_batch_equals_alone():
    from finetune.tasks import make_examples

    lm = load_model("tiny-mars", device="cpu", dtype="bfloat16")
    assert lm.backend == "lean" and lm.net.layers[0].qkv.packed is not None and lm.net.head.packed is not None
    prompts = [lm.encode(e["messages"][0]["content"]) for e in make_examples("heldout", 8, seed=321)]
    ar = [r.token_ids for r in generate(lm, prompts, DecodeConfig(mode="ar", max_new_tokens=40))]
    for layout in ("linear", "tree"):
        cfg = DecodeConfig(mode="verify", tau=0.5, max_new_tokens=40, draft_layout=layout)
        lossless = generate(lm, prompts, cfg)
        assert [r.token_ids for r in lossless] == ar
        for p, row in zip(prompts[:3], lossless[:3]):
            assert generate(lm, [p], cfg)[0].steps == row.steps
    mars = DecodeConfig(mode="mars", tau=0.8, max_new_tokens=40)
    for p, row in zip(prompts, generate(lm, prompts, mars)):
        assert generate(lm, [p], mars)[0].steps == row.steps


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_no_mask_is_the_causal_mask_bitwise_for_a_chunk_after_a_cache(arch, tokenizer):
    """The decoder passes attention_mask=None for a plain multi-position step on the lean forward
    (builds_causal_mask): its own causal mask must give exactly the logits step_attention's mask gives."""
    from mars_core.decode.batch import _Batch, _Row

    net = LeanLM(make_model(arch, len(tokenizer)))
    assert net.builds_causal_mask
    prompt, chunk = torch.tensor([[5, 9, 12, 7, 3, 8, 11]] * 2), torch.tensor([[4, 6, 10, 13]] * 2)
    batch = _Batch([_Row(0, 9, [4, 6, 10, 13]), _Row(1, 9, [4, 6, 10, 13])], None, "cpu")
    batch.kv_valid = torch.ones(2, 7, dtype=torch.bool)
    valid = torch.ones(2, 4, dtype=torch.bool)
    assert batch.attention(valid, 4, own_causal=True) is None
    logits = []
    for mask in (None, step_attention(batch.kv_valid, valid)):
        cache = net.new_cache()
        with torch.inference_mode():
            net(input_ids=prompt, cache=cache)
            logits.append(net(input_ids=chunk, attention_mask=mask, cache=cache).logits)
    assert torch.equal(*logits)
    batch.kv_holes = True                     # a hole in the cache: the mask must be built
    assert batch.attention(valid, 4, own_causal=True) is not None
