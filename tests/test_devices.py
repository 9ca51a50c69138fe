"""The decoder's equivalences on every device present, in the dtypes each holds: τ >= 1 == AR == transformers
`generate`, cached == uncached, a batch == each row alone, lossless == AR, custom_generate == our decoder.

Devices: the CPU in fp32 always; a CUDA GPU in fp32 and bf16 when `torch.cuda.is_available()`, else those cases
are skipped with the reason "no CUDA device" (with MARS_REQUIRE_CUDA=1, which benchmarks/gpu.sh sets, they fail).
The models run through the transformers backend (`backend="hf"`), the one a GPU decodes with;
tests/test_decoding.py and friends hold the CPU's lean backend to the same rules.

Tolerance rule. On the CPU every comparison is exact, as in the rest of the suite. Two runs of one computation
(τ = 1 and AR, custom_generate and our decoder) are exact on every device and dtype. Two different computations
of the same decision (cached and uncached, batched and alone, lossless and AR, ours and transformers') may differ
on a GPU only where rounding can decide: the tokens before the first difference must be identical, and at that
difference a fresh uncached forward over the common prefix must show the decision on a knife's edge, either two
tokens whose logits differ by at most RTOL * max(1, |logit|) (a near-tie) or, where one run accepted a candidate
the other did not, its log-probability within RTOL * max(1, |logit|) of log τ (an acceptance flip). RTOL is 1e-4
for CUDA fp32 and 5e-2 for CUDA bf16 (a dozen bf16 ulps). After the first difference the runs are not compared:
their contexts differ.
"""
from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import pytest
import torch

from mars_core import DecodeConfig, generate, generate_stream, load_model, reference_generate
from mars_core.decode.step import never_propose_mask
from mars_core.models.loading import wrap_model
from tests.conftest import PROMPTS
from tests.tiny_fixtures import make_model

REPO = Path(__file__).resolve().parent.parent
# benchmarks/gpu.sh sets MARS_REQUIRE_CUDA=1: on the GPU machine a missing GPU fails these cases instead of skipping
REQUIRE_CUDA = os.environ.get("MARS_REQUIRE_CUDA") == "1"
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available() and not REQUIRE_CUDA, reason="no CUDA device")
TARGETS = [
    pytest.param(("cpu", torch.float32), id="cpu-fp32"),
    pytest.param(("cuda", torch.float32), id="cuda-fp32", marks=NO_CUDA),
    pytest.param(("cuda", torch.bfloat16), id="cuda-bf16", marks=NO_CUDA),
]
RTOL = {("cpu", torch.float32): 0.0, ("cuda", torch.float32): 1e-4, ("cuda", torch.bfloat16): 5e-2}
MODELS = ("llama", "qwen2", "tiny-mars")
MAX_NEW = 32


@pytest.fixture(scope="module")
def built():
    return {}


@pytest.fixture(params=TARGETS)
def target(request):
    return request.param


@pytest.fixture(params=MODELS)
def lm(request, target, tokenizer, built):
    """One model on the target device and dtype, through the transformers backend."""
    device, dtype = target
    if device == "cuda" and not torch.cuda.is_available():
        pytest.fail("MARS_REQUIRE_CUDA=1 but torch.cuda.is_available() is False: no CUDA device for the CUDA cases")
    key = (request.param, device, dtype)
    if key not in built:
        if request.param == "tiny-mars":
            model = load_model("tiny-mars", device=device, dtype=str(dtype).replace("torch.", ""), backend="hf",
                               cpu_layout=False)
        else:
            model = make_model(request.param, len(tokenizer)).to(device=device, dtype=dtype)
            model = wrap_model(model, tokenizer, name=f"tiny-{request.param}", backend="hf")
        assert model.device.type == device and next(model.model.parameters()).dtype == dtype
        built[key] = model
    return built[key]


def prompts_for(lm) -> list[list[int]]:
    if lm.name == "tiny-mars":   # questions it was trained on, so that MARS accepts runs of tokens
        texts = ["Compute 651 + 151.", "Sort in ascending order: 18, 84, 33, 16, 29",
                 "Write these letters backwards: t p z h a i n"]
    else:
        texts = PROMPTS
    return [lm.encode(t) for t in texts]


# ----------------------------------------------------------------------------- the tolerance rule

def rtol(lm) -> float:
    return RTOL[(lm.device.type, next(lm.model.parameters()).dtype)]


@torch.inference_mode()
def _candidate_logits(lm, prefix: list[int], j: int) -> torch.Tensor:
    """q_j's logits (fp32, [vocab]) after `prefix`, from one uncached forward of [prefix | j masks]."""
    ids = torch.tensor([prefix + [lm.mask_id] * j], device=lm.device)
    logits = lm.model(input_ids=ids).logits[:, -1:].float()                    # [1, 1, vocab]
    return never_propose_mask(logits, lm.mask_id, first=0 if j else 1)[0, 0]


def _on_edge(lm, prefix: list[int], j: int, a: int, b: int | None, tau: float | None) -> tuple[bool, str]:
    """Whether rounding can decide candidate j after `prefix`: tokens a and b near-tied, or (b None) token a's
    log-probability near log τ."""
    logits = _candidate_logits(lm, prefix, j)
    if b is not None:
        gap, scale = abs(float(logits[a] - logits[b])), max(1.0, abs(float(logits[a])), abs(float(logits[b])))
        return gap <= rtol(lm) * scale, f"logits of {a} and {b} differ by {gap:.4g} (scale {scale:.3g})"
    logp = float(torch.log_softmax(logits, -1)[a])
    gap, scale = abs(logp - math.log(tau)), max(1.0, abs(float(logits[a])))
    return gap <= rtol(lm) * scale, f"log p({a}) is {gap:.4g} from log tau (scale {scale:.3g})"


def assert_same_steps(lm, prompt, got: list[list[int]], want: list[list[int]], tau: float, what: str) -> None:
    """Per-forward accepted tokens equal, or (off the CPU) equal up to a decision rounding can flip."""
    if got == want:
        return
    k = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    prefix = prompt + [t for s in got[:k] for t in s]
    a, b = got[k], want[k]
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert rtol(lm) > 0, f"{what}: forward {k} accepted {a}, the reference {b} (exact on this device)"
    if j < min(len(a), len(b)):
        ok, why = _on_edge(lm, prefix, j, a[j], b[j], None)
    else:
        longer = a if len(a) > len(b) else b
        ok, why = _on_edge(lm, prefix, j, longer[j], None, tau)
    assert ok, f"{what}: forward {k} accepted {a}, the reference {b}, and rounding cannot explain it: {why}"


def assert_same_tokens(lm, prompt, got: list[int], want: list[int], what: str) -> None:
    """Greedy token sequences equal, or (off the CPU) equal up to a near-tie."""
    if got == want:
        return
    i = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), None)
    assert rtol(lm) > 0 and i is not None, f"{what}: {got} != {want} (exact on this device)"
    ok, why = _on_edge(lm, prompt + got[:i], 0, got[i], want[i], None)
    assert ok, f"{what}: token {i} is {got[i]}, the reference's {want[i]}, not a near-tie: {why}"


def hf_greedy(lm, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy `generate` on the model's device, up to and with the first end-of-turn id."""
    ids = torch.tensor([prompt], device=lm.device)
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=lm.eos_ids, pad_token_id=lm.tokenizer.pad_token_id or 0)
    new = out[0, len(prompt):].tolist()
    return new[: next((i + 1 for i, t in enumerate(new) if t in lm.eos_ids), len(new))]


# ----------------------------------------------------------------------------- the equivalences

def test_the_decoder_keeps_every_tensor_on_the_models_device(lm):
    seen = []
    forward = lm.model.forward

    def spy(*args, **kwargs):
        seen.extend(v.device.type for v in kwargs.values() if isinstance(v, torch.Tensor))
        return forward(*args, **kwargs)

    lm.model.forward = spy
    try:
        for mode in ("mars", "verify", "ar"):
            generate(lm, prompts_for(lm)[:2], DecodeConfig(mode=mode, tau=0.9, max_new_tokens=8))
    finally:
        del lm.model.forward
    assert seen and set(seen) == {lm.device.type}


def test_tau_one_equals_ar_exactly_and_transformers_generate(lm):
    prompts = prompts_for(lm)
    ar = generate(lm, prompts, DecodeConfig(mode="ar", max_new_tokens=MAX_NEW))
    one = generate(lm, prompts, DecodeConfig(mode="mars", tau=1.0, block_size=4, max_new_tokens=MAX_NEW))
    assert [r.token_ids for r in one] == [r.token_ids for r in ar]     # the same computation: exact everywhere
    assert all(len(s) == 1 for r in one for s in r.steps)
    for p, r in zip(prompts, ar):
        assert_same_tokens(lm, p, r.token_ids, hf_greedy(lm, p, MAX_NEW), "AR vs transformers generate")


@pytest.mark.parametrize("tau", [0.9, 0.5])
def test_cached_equals_the_uncached_reference(lm, tau):
    prompts = prompts_for(lm)
    cfg = DecodeConfig(tau=tau, block_size=4, max_new_tokens=MAX_NEW)
    cached, uncached = generate(lm, prompts, cfg), reference_generate(lm, prompts, cfg)
    for p, c, u in zip(prompts, cached, uncached):
        assert_same_steps(lm, p, c.steps, u.steps, tau, "cached vs uncached")
    assert max(r.tokens_per_forward for r in cached) > 1.0              # multi-token steps were exercised


def test_a_batch_equals_each_row_alone(lm):
    prompts = prompts_for(lm)
    cfg = DecodeConfig(tau=0.8, block_size=4, max_new_tokens=MAX_NEW)
    together = generate(lm, prompts, cfg)
    for p, row in zip(prompts, together):
        assert_same_steps(lm, p, row.steps, generate(lm, [p], cfg)[0].steps, 0.8, "batched vs alone")
    assert len({len(s) for r in together for s in r.steps}) > 1          # rows accepted different counts


@pytest.mark.parametrize("layout", ["linear", "tree"])
def test_lossless_equals_ar(lm, layout):
    prompts = prompts_for(lm)
    ar = generate(lm, prompts, DecodeConfig(mode="ar", max_new_tokens=MAX_NEW))
    lossless = generate(lm, prompts, DecodeConfig(mode="verify", tau=0.5, block_size=4, max_new_tokens=MAX_NEW,
                                                  draft_layout=layout))
    for p, a, v in zip(prompts, ar, lossless):
        assert_same_tokens(lm, p, v.token_ids, a.token_ids, f"lossless ({layout}) vs AR")
    if lm.name == "tiny-mars":
        assert max(r.tokens_per_forward for r in lossless) > 1.0       # drafts were confirmed


def test_custom_generate_equals_our_decoder_exactly(lm):
    prompt = prompts_for(lm)[0]
    ids = torch.tensor([prompt], device=lm.device)
    out = lm.model.generate(ids, custom_generate=str(REPO), trust_remote_code=True, tau=0.9, block_size=4,
                            mask_token_id=lm.mask_id, max_new_tokens=MAX_NEW, eos_token_id=lm.eos_ids,
                            return_dict_in_generate=True)
    ours = generate(lm, [prompt], DecodeConfig(tau=0.9, block_size=4, max_new_tokens=MAX_NEW))[0]
    assert out.sequences.device.type == lm.device.type
    assert out.step_tokens[0] == ours.steps                             # the same decoder on the same model


def test_sampling_with_a_seed_repeats_on_the_device(lm):
    cfg = DecodeConfig(tau=0.9, block_size=4, max_new_tokens=16, temperature=0.8, seed=7)
    first, again = (generate(lm, prompts_for(lm)[:2], copy.copy(cfg)) for _ in range(2))
    assert [r.steps for r in first] == [r.steps for r in again]


def test_the_tolerance_rule_refuses_a_difference_rounding_cannot_explain(tokenizer, monkeypatch):
    """The rule is not a pass-all: at bf16's tolerance, a token swapped where the model is confident still fails."""
    lm = wrap_model(make_model("llama", len(tokenizer)), tokenizer, name="tiny-llama", backend="hf")
    monkeypatch.setitem(RTOL, ("cpu", torch.float32), RTOL[("cuda", torch.bfloat16)])
    prompt = lm.encode(PROMPTS[0])
    ar = generate(lm, [prompt], DecodeConfig(mode="ar", max_new_tokens=8))[0].token_ids

    def margin(i):   # (relative top-2 logit gap, runner-up) at AR's token i
        logits = _candidate_logits(lm, prompt + ar[:i], 0)
        top2 = logits.topk(2)
        return float(top2.values[0] - top2.values[1]) / max(1.0, float(top2.values[0].abs())), int(top2.indices[1])

    i = max(range(len(ar)), key=lambda i: margin(i)[0])
    gap, runner_up = margin(i)
    assert gap > RTOL[("cuda", torch.bfloat16)]   # the model is confident there, beyond bf16's tolerance
    swapped = ar[:i] + [runner_up] + ar[i + 1:]
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_same_tokens(lm, prompt, swapped, ar, "swapped")
    with pytest.raises(AssertionError, match="rounding cannot explain"):
        assert_same_steps(lm, prompt, [[t] for t in swapped], [[t] for t in ar], 0.9, "swapped")
    assert_same_tokens(lm, prompt, ar, list(ar), "same")   # and equal runs pass
