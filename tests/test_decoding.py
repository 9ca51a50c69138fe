"""The decoder's spine: one-token mode == greedy AR == transformers generate; cached == uncached;
a batch == each row alone; the acceptance rule on hand-made logits; τ changes mid-generation."""
import math

import pytest
import torch

from mars_core import DecodeConfig, TauControl, accept_counts, generate, generate_stream, propose, reference_generate
from tests.conftest import PROMPTS


def hf_greedy(lm, prompt_ids, max_new_tokens, eos_ids):
    out = lm.model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_ids, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def hf_greedy_batch(lm, prompt_ids, max_new_tokens, eos_ids):
    """transformers generate on a left-padded batch; returns each row's tokens up to its first eos."""
    width = max(map(len, prompt_ids))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompt_ids])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    out = lm.model.generate(ids, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=eos_ids, pad_token_id=0)[:, width:].tolist()
    rows = []
    for row in out:
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        rows.append(row[:cut])
    return rows


@pytest.fixture
def eos_lm(tiny_lm):
    """The tiny model with an extra end-of-turn id that its greedy output of PROMPTS[0] actually emits
    mid-way, so generation really stops at an eos."""
    ids = tiny_lm.encode(PROMPTS[0])
    free = hf_greedy(tiny_lm, ids, 24, tiny_lm.eos_ids)
    stop = free[10]
    original = tiny_lm.eos_ids
    tiny_lm.eos_ids = sorted(set(original) | {stop})
    yield tiny_lm
    tiny_lm.eos_ids = original


@pytest.mark.parametrize("batch", [1, 3])
def test_tau_one_matches_ar_and_greedy_generate(eos_lm, batch):
    lm = eos_lm
    prompts = [lm.encode(p) for p in PROMPTS[:batch]]
    expected = (hf_greedy_batch(lm, prompts, 24, lm.eos_ids) if batch > 1
                else [hf_greedy(lm, prompts[0], 24, lm.eos_ids)])
    ar = generate(lm, prompts, DecodeConfig(mode="ar", max_new_tokens=24))
    mars = generate(lm, prompts, DecodeConfig(mode="mars", tau=1.0, block_size=4, max_new_tokens=24))
    assert [r.token_ids for r in ar] == expected
    assert [r.token_ids for r in mars] == expected
    assert all(len(s) == 1 for r in mars for s in r.steps)        # exactly one token per forward
    assert ar[0].finish_reason == "eos" and ar[0].token_ids[-1] in lm.eos_ids
    assert len(ar[0].token_ids) == 11                              # stopped at the injected eos


@pytest.mark.parametrize("tau", [0.9, 0.5])
def test_cached_matches_uncached_reference(tiny_lm, tau):
    prompts = [tiny_lm.encode(p) for p in PROMPTS]
    cfg = DecodeConfig(tau=tau, block_size=4, max_new_tokens=32)
    cached = generate(tiny_lm, prompts, cfg)
    uncached = reference_generate(tiny_lm, prompts, cfg)
    for c, u in zip(cached, uncached):
        assert c.steps == u.steps                                  # same tokens, same count each step
    assert max(r.tokens_per_forward for r in cached) > 1.0         # the test exercises multi-token steps


@pytest.mark.parametrize("tau", [0.9, 0.8])
def test_batch_matches_each_row_alone(tiny_lm, tau):
    prompts = [tiny_lm.encode(p) for p in PROMPTS]
    cfg = DecodeConfig(tau=tau, block_size=4, max_new_tokens=40)
    together = generate(tiny_lm, prompts, cfg)
    for p, row in zip(prompts, together):
        alone = generate(tiny_lm, [p], cfg)[0]
        assert row.steps == alone.steps
    counts = {len(s) for r in together for s in r.steps}
    assert len(counts) > 1                                         # rows really accepted different counts


def test_batch_with_early_finisher_matches_rows_alone(tiny_lm):
    prompts = [tiny_lm.encode(p) for p in PROMPTS]
    cfg = DecodeConfig(tau=0.8, block_size=3, max_new_tokens=30)
    free = generate(tiny_lm, prompts[:1], cfg)[0].token_ids
    original, tiny_lm.eos_ids = tiny_lm.eos_ids, sorted(set(tiny_lm.eos_ids) | {free[8]})
    try:
        together = generate(tiny_lm, prompts, cfg)
        assert together[0].finish_reason == "eos" and len(together[0].token_ids) <= 9
        for p, row in zip(prompts, together):
            assert row.steps == generate(tiny_lm, [p], cfg)[0].steps
    finally:
        tiny_lm.eos_ids = original


def test_tau_change_takes_effect_at_next_step(llama_lm):
    control = TauControl(0.05)
    events = []
    for event in generate_stream(llama_lm, [PROMPTS[2]], DecodeConfig(block_size=4, max_new_tokens=60), control):
        events.append(event)
        if event.step == 2:
            control.value = 1.0
    assert [e.tau for e in events[:3]] == [0.05] * 3
    assert all(e.tau == 1.0 for e in events[3:])
    assert max(e.rows[0].n_accepted for e in events[:3]) > 1
    assert all(e.rows[0].n_accepted == 1 for e in events[3:])
    assert len(events) > 4


def test_events_carry_candidates_confidences_and_metrics(llama_lm):
    cfg = DecodeConfig(tau=0.5, block_size=4, max_new_tokens=20)
    events = list(generate_stream(llama_lm, [PROMPTS[0]], cfg))
    for e in events:
        row = e.rows[0]
        assert len(row.candidates) == 4 and len(row.confidences) == 4
        assert row.accepted_ids == row.candidates[: row.n_accepted]
        assert all(0.0 <= c <= 1.0 for c in row.confidences)
        assert e.step_time > 0 and e.elapsed >= e.step_time
    result = generate(llama_lm, [PROMPTS[0]], cfg)[0]
    assert result.forwards == len(events)
    assert result.tokens_per_forward == pytest.approx(len(result.token_ids) / len(events))
    assert sum(map(len, result.steps)) == len(result.token_ids) == 20


def test_ar_mode_uses_one_candidate(llama_lm):
    events = list(generate_stream(llama_lm, [PROMPTS[0]], DecodeConfig(mode="ar", max_new_tokens=5)))
    assert len(events) == 5 and all(len(e.rows[0].candidates) == 1 for e in events)


def test_max_accept_caps_each_step(llama_lm):
    result = generate(llama_lm, [PROMPTS[2]], DecodeConfig(tau=0.05, block_size=4, max_accept=2, max_new_tokens=30))[0]
    assert max(map(len, result.steps)) == 2


def test_max_new_tokens_is_never_exceeded(llama_lm):
    for n in (1, 3, 6):
        result = generate(llama_lm, [PROMPTS[2]], DecodeConfig(tau=0.05, block_size=4, max_new_tokens=n))[0]
        assert len(result.token_ids) == n and result.finish_reason == "length"


def test_stop_string_ends_generation(llama_lm):
    free = generate(llama_lm, [PROMPTS[1]], DecodeConfig(tau=0.5, max_new_tokens=30))[0].text
    stop = free[5:7]
    result = generate(llama_lm, [PROMPTS[1]], DecodeConfig(tau=0.5, max_new_tokens=30, stop_strings=(stop,)))[0]
    assert result.finish_reason == "stop" and stop in result.text
    assert stop not in llama_lm.decode(result.token_ids[:-1])       # nothing kept past the completing token


def test_sampling_is_reproducible_with_a_seed(llama_lm):
    cfg = DecodeConfig(tau=0.5, temperature=1.0, top_p=0.9, seed=123, max_new_tokens=20)
    a = generate(llama_lm, [PROMPTS[0]], cfg)[0].token_ids
    b = generate(llama_lm, [PROMPTS[0]], cfg)[0].token_ids
    c = generate(llama_lm, [PROMPTS[0]], DecodeConfig(tau=0.5, temperature=1.0, seed=7, max_new_tokens=20))[0].token_ids
    assert a == b and a != c


# ----------------------------------------------------------------------------- acceptance rule

def _logits_for(probs_rows):
    """Logits whose softmax gives rows with these top probabilities on tokens 0..k-1 (vocab 8)."""
    rows = []
    for j, p in enumerate(probs_rows):
        row = torch.full((8,), (1 - p) / 7)
        row[j] = p
        rows.append(torch.log(row))
    return torch.stack(rows)[None]          # [1, k, 8]


EOS = torch.tensor([7])


def _accept(probs_rows, tau, limit=None, criterion="prob"):
    tokens, conf = propose(_logits_for(probs_rows), criterion)
    limit = torch.tensor([limit or len(probs_rows)])
    return int(accept_counts(tokens, conf, tau, limit, EOS)[0])


def test_first_candidate_always_accepted():
    assert _accept([0.2, 0.99, 0.99, 0.99], tau=0.9) == 4
    assert _accept([0.2, 0.1, 0.99, 0.99], tau=0.9) == 1


def test_run_stops_at_first_candidate_below_tau():
    assert _accept([0.9, 0.95, 0.5, 0.99], tau=0.9) == 2
    assert _accept([0.9, 0.95, 0.96, 0.89], tau=0.9) == 3


def test_acceptance_capped_by_block_and_budget():
    assert _accept([0.99] * 4, tau=0.5) == 4
    assert _accept([0.99] * 4, tau=0.5, limit=2) == 2


def test_tau_one_accepts_exactly_one_even_at_probability_one():
    tokens = torch.tensor([[0, 1, 2, 3]])
    conf = torch.ones(1, 4)                  # a bf16 probability that rounded to 1.0
    assert int(accept_counts(tokens, conf, 1.0, torch.tensor([4]), EOS)[0]) == 1


def test_eos_ends_the_accepted_run():
    tokens = torch.tensor([[0, 7, 2, 3]])
    conf = torch.ones(1, 4) * 0.99
    assert int(accept_counts(tokens, conf, 0.5, torch.tensor([4]), EOS)[0]) == 2
    tokens = torch.tensor([[7, 1, 2, 3]])
    assert int(accept_counts(tokens, conf, 0.5, torch.tensor([4]), EOS)[0]) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tau_is_compared_rounded_to_the_confidences_dtype(dtype):
    """0.95 is no fp32 (or bf16) number: a confidence equal to τ rounded to its dtype passes, as the tensor
    comparison `conf >= tau` decides; the next value below it does not."""
    tokens = torch.tensor([[0, 1, 2, 3]])
    for tau in (0.95, 0.9, 0.3):
        at = torch.tensor(tau, dtype=dtype)
        below = torch.nextafter(at, torch.tensor(0.0, dtype=dtype))
        assert bool(at >= tau) and not bool(below >= tau)      # what torch decides, and what we must match
        conf = torch.stack([at, at, below, at])[None]
        assert int(accept_counts(tokens, conf, tau, torch.tensor([4]), EOS)[0]) == 2, tau


def test_entropy_and_margin_criteria():
    logits = _logits_for([0.9, 0.97, 0.6, 0.99])
    _, ent = propose(logits, "entropy")
    _, marg = propose(logits, "margin")
    probs = torch.softmax(logits, -1)
    h = -(probs * probs.log()).sum(-1)
    assert torch.allclose(ent, torch.exp(-h))
    top2 = probs.topk(2, -1).values
    assert torch.allclose(marg, top2[..., 0] - top2[..., 1])
    assert _accept([0.9, 0.97, 0.6, 0.99], tau=0.8, criterion="margin") == 2
    assert _accept([0.9, 0.97, 0.6, 0.99], tau=math.exp(-0.4), criterion="entropy") == 2


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs, word", [
    (dict(tau=0), "tau"), (dict(tau=-0.5), "tau"), (dict(tau=float("nan")), "tau"), (dict(tau="fast"), "tau"),
    (dict(block_size=0), "block_size"), (dict(max_new_tokens=0), "max_new_tokens"), (dict(mode="beam"), "mode"),
    (dict(criterion="vibes"), "criterion"), (dict(temperature=-1.0), "temperature"),
    (dict(block_size=True), "block_size=True"), (dict(block_size=2.5), "block_size"),
    (dict(max_new_tokens=False), "max_new_tokens"), (dict(temperature="hot"), "temperature='hot'"),
    (dict(temperature=float("inf")), "finite"), (dict(top_p="all"), "top_p"), (dict(seed=1.5), "seed"),
    (dict(max_accept=True), "max_accept"), (dict(stop_strings=(3,)), "stop_strings"),
])
def test_bad_config_raises_value_error_naming_the_value(kwargs, word):
    with pytest.raises(ValueError, match=word):
        DecodeConfig(**kwargs)


def test_a_config_changed_after_creation_is_checked_before_decoding(llama_lm):
    cfg = DecodeConfig()
    cfg.block_size = 0
    with pytest.raises(ValueError, match="block_size=0"):
        generate(llama_lm, [PROMPTS[0]], cfg)
    cfg.block_size, cfg.temperature = 4, "hot"
    with pytest.raises(ValueError, match="temperature='hot'"):
        list(generate_stream(llama_lm, [PROMPTS[0]], cfg))


@pytest.mark.parametrize("prompts, word", [
    ([[1.7, 2.2]], "token id 1.7"), ([[True, 3]], "token id True"), ([[None]], "token id None"),
    ([[-1, 3]], "token id -1"), ([[10**6]], "token id 1000000"), (b"hi", "non-empty list"), ([b"hi"], "decode bytes"),
    ([None], "prompt None"), ([[2, None]], "token id None"),
])
def test_bad_prompts_and_token_ids_are_refused_naming_the_value(llama_lm, prompts, word):
    with pytest.raises(ValueError, match=word):
        generate(llama_lm, prompts, DecodeConfig(max_new_tokens=2))


def test_tau_control_rejects_bad_values():
    control = TauControl(0.9)
    with pytest.raises(ValueError, match="tau"):
        control.value = float("nan")
    assert control.value == 0.9


def test_empty_and_too_long_prompts_are_rejected(llama_lm):
    with pytest.raises(ValueError, match="empty"):
        generate(llama_lm, ["   "], DecodeConfig())
    with pytest.raises(ValueError, match="context"):
        generate(llama_lm, ["x" * 400], DecodeConfig())
    with pytest.raises(ValueError, match="non-empty list"):
        generate(llama_lm, [], DecodeConfig())


def test_the_mask_id_is_never_proposed_at_a_mask_position_but_q0_is_untouched():
    from mars_core.decode.step import never_propose_mask

    logits = torch.zeros(1, 4, 10)
    logits[0, :, 3] = 5.0                  # the mask id (3) is everyone's argmax
    logits[0, :, 6] = 4.0
    q0 = logits[0, 0].clone()
    out = never_propose_mask(logits, mask_id=3)
    tokens, _ = propose(out)
    assert tokens.tolist() == [[3, 6, 6, 6]]
    assert torch.equal(out[0, 0], q0) and torch.isinf(out[0, 1:, 3]).all()


def test_one_token_mode_runs_ars_computation_in_bf16_too(llama_lm, monkeypatch):
    """τ >= 1 appends no masks: each step feeds exactly what AR feeds, so the tokens agree in bf16 as well."""
    import copy

    from mars_core.models.loading import wrap_model

    lm = wrap_model(copy.deepcopy(llama_lm.model).to(torch.bfloat16), llama_lm.tokenizer, name="tiny-bf16")
    widths = []
    forward = lm.model.forward
    monkeypatch.setattr(lm.model, "forward",
                        lambda *a, **k: (widths.append(k["input_ids"].shape[1]), forward(*a, **k))[1])
    prompts = [lm.encode(p) for p in PROMPTS]
    mars = generate(lm, prompts, DecodeConfig(mode="mars", tau=1.0, block_size=4, max_new_tokens=16))
    mars_widths, widths[:] = list(widths), []
    ar = generate(lm, prompts, DecodeConfig(mode="ar", max_new_tokens=16))
    assert [r.token_ids for r in mars] == [r.token_ids for r in ar]
    assert mars_widths == widths and set(widths[1:]) == {1}


def test_near_the_context_limit_one_token_mode_writes_as_many_tokens_as_ar(llama_lm):
    ids = llama_lm.encode(PROMPTS[0])
    room = llama_lm.context_length - len(ids)
    cfg = dict(max_new_tokens=room + 10)
    ar = generate(llama_lm, [ids], DecodeConfig(mode="ar", **cfg))[0]
    one = generate(llama_lm, [ids], DecodeConfig(mode="mars", tau=1.0, **cfg))[0]
    assert ar.finish_reason == "length" and len(ar.token_ids) == room - 1    # this prompt runs to the limit
    assert one.token_ids == ar.token_ids
    # MARS at τ < 1 also runs to the last position, appending only the masks that still fit, as the reference does
    lossy = generate(llama_lm, [ids], DecodeConfig(mode="mars", tau=0.5, **cfg))[0]
    ref = reference_generate(llama_lm, [ids], DecodeConfig(mode="mars", tau=0.5, **cfg))[0]
    assert lossy.token_ids == ref.token_ids and lossy.steps == ref.steps and len(lossy.token_ids) == room - 1
    assert all(len(p) + len(r.token_ids) <= llama_lm.context_length for p, r in [(ids, ar), (ids, lossy)])


def test_argmax_is_torchs_first_index_of_the_largest_value_on_ties_slices_and_infinities():
    from mars_core.decode.step import argmax

    torch.manual_seed(0)
    x = torch.randn(2, 7, 1000)
    x[0, 1, [5, 600]] = 50.0             # a tie: the first index wins
    x[1, 2] = float("-inf")              # a row with nothing but -inf: index 0
    x[1, 3, 10] = float("inf")
    x[0, 4, 3] = float("nan")            # NaN counts as the largest, as in torch
    for view in (x, x[:, :4], x[:, 4:], x[1], x.double(), x.bfloat16()):
        assert torch.equal(argmax(view), view.argmax(dim=-1)), view.shape
    assert argmax(x)[0, 1] == 5 and argmax(x)[1, 2] == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "row of -inf"])
def test_a_nan_an_inf_or_a_row_of_minus_inf_anywhere_in_a_steps_logits_is_refused(bad):
    from mars_core.decode.step import check_finite

    logits = torch.randn(2, 5, 300)
    logits[:, 3:, 7] = float("-inf")            # the mask id ruled out: legitimate
    assert torch.equal(check_finite(logits.clone(), None, 0), logits.argmax(dim=-1))
    if bad == "row of -inf":
        logits[1, 4] = float("-inf")
    else:
        logits[1, 2, 100] = bad
    with pytest.raises(FloatingPointError, match="NaN/inf logits at step 3"):
        check_finite(logits, None, 3)
