"""Lossless MARS (mode="verify"): the masks draft, the next forward checks. Its tokens are greedy AR's at
every τ and B, batched or alone, cached or not (fp32); the events say which drafts were confirmed or
rejected; on tiny-mars it still writes several tokens per forward."""
import pytest
import torch

from mars_core import DecodeConfig, TauControl, generate, generate_stream, reference_generate
from mars_core.decode.drafts import clip_commit, confirm, keep_drafts
from tests.conftest import PROMPTS
from tests.test_decoding import hf_greedy, hf_greedy_batch

N_SUITE = 12
MAX_NEW = 48


@pytest.fixture(scope="module")
def tiny_mars():
    from mars_core import load_model

    return load_model("tiny-mars", device="cpu")


@pytest.fixture(scope="module")
def suite_prompts(tiny_mars):
    from finetune.tasks import make_examples

    return [tiny_mars.encode(e["messages"][0]["content"]) for e in make_examples("heldout", N_SUITE, seed=321)]


def verify(lm, prompts, tau, block_size, max_new_tokens=MAX_NEW, **kw):
    return generate(lm, prompts, DecodeConfig(mode="verify", tau=tau, block_size=block_size,
                                              max_new_tokens=max_new_tokens, **kw))


# ----------------------------------------------------------------------------- pure pieces

def test_confirm_counts_the_leading_drafts_equal_to_ar():
    assert confirm([5, 6, 7], [5, 6, 9, 1]) == 2
    assert confirm([5, 6], [4, 6, 1]) == 0
    assert confirm([], [3]) == 0
    assert confirm([1, 2], [1, 2, 3]) == 2


def test_keep_drafts_takes_the_confident_leading_run_up_to_the_cap_and_eos():
    assert keep_drafts([4, 5, 6], [0.95, 0.99, 0.5], 0.9, 3, eos_ids=[0]) == [4, 5]
    assert keep_drafts([4, 5, 6], [0.95, 0.99, 0.99], 0.9, 1, eos_ids=[0]) == [4]
    assert keep_drafts([4, 0, 6], [0.95, 0.99, 0.99], 0.9, 3, eos_ids=[0]) == [4, 0]
    assert keep_drafts([4, 5], [0.99, 0.99], 1.0, 3, eos_ids=[0]) == []       # τ >= 1: AR, no drafts
    assert keep_drafts([4, 5], [0.5, 0.99], 0.9, 3, eos_ids=[0]) == []


def test_clip_commit_ends_at_the_budget_and_after_the_first_eos():
    assert clip_commit([1, 2, 3], 2, eos_ids=[9]) == [1, 2]
    assert clip_commit([1, 9, 3], 5, eos_ids=[9]) == [1, 9]


def test_verify_mode_refuses_sampling():
    with pytest.raises(ValueError, match="temperature=0.7 with mode='verify'"):
        DecodeConfig(mode="verify", temperature=0.7)


# ----------------------------------------------------------------------------- equals greedy AR

@pytest.mark.parametrize("tau", [0.5, 0.9, 0.99])
@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_verify_equals_ar_and_generate_on_tiny_random_models(tiny_lm, tau, block_size):
    prompts = [tiny_lm.encode(p) for p in PROMPTS]
    want = hf_greedy_batch(tiny_lm, prompts, 32, tiny_lm.eos_ids)
    assert [r.token_ids for r in verify(tiny_lm, prompts, tau, block_size, 32)] == want
    assert verify(tiny_lm, prompts[:1], tau, block_size, 32)[0].token_ids == hf_greedy(tiny_lm, prompts[0], 32,
                                                                                      tiny_lm.eos_ids)


@pytest.mark.parametrize("tau", [0.5, 0.9, 0.99])
@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_verify_equals_ar_on_tiny_mars_batched_and_alone(tiny_mars, suite_prompts, tau, block_size):
    ar = generate(tiny_mars, suite_prompts, DecodeConfig(mode="ar", max_new_tokens=MAX_NEW))
    batch = verify(tiny_mars, suite_prompts, tau, block_size)      # prompts of different lengths
    assert [r.token_ids for r in batch] == [r.token_ids for r in ar]
    for p, row in zip(suite_prompts[:3], batch[:3]):
        alone = verify(tiny_mars, [p], tau, block_size)[0]
        assert alone.token_ids == row.token_ids and alone.steps == row.steps
    assert max(r.tokens_per_forward for r in batch) > 1.0          # drafts were really confirmed


def test_verify_equals_transformers_generate_on_tiny_mars(tiny_mars, suite_prompts):
    want = [hf_greedy(tiny_mars, p, MAX_NEW, tiny_mars.eos_ids) for p in suite_prompts[:4]]
    assert [r.token_ids for r in verify(tiny_mars, suite_prompts[:4], 0.9, 4)] == want


@pytest.mark.parametrize("tau,block_size", [(0.5, 4), (0.9, 8), (0.99, 2)])
def test_cached_verify_equals_the_uncached_reference(tiny_mars, suite_prompts, tau, block_size):
    cfg = DecodeConfig(mode="verify", tau=tau, block_size=block_size, max_new_tokens=MAX_NEW)
    cached = generate(tiny_mars, suite_prompts[:4], cfg)
    uncached = reference_generate(tiny_mars, suite_prompts[:4], cfg)
    assert [r.steps for r in cached] == [r.steps for r in uncached]   # same tokens, same count per forward


def test_verify_equals_ar_with_tau_changed_mid_generation(tiny_mars, suite_prompts):
    control = TauControl(0.5)
    cfg = DecodeConfig(mode="verify", block_size=4, max_new_tokens=MAX_NEW)
    events = []
    for event in generate_stream(tiny_mars, suite_prompts[:4], cfg, control):
        events.append(event)
        control.value = [0.5, 1.0, 0.9, 0.3][event.step % 4]
    got = [[t for e in events for t in e.rows[r].accepted_ids] for r in range(4)]
    ar = generate(tiny_mars, suite_prompts[:4], DecodeConfig(mode="ar", max_new_tokens=MAX_NEW))
    assert got == [r.token_ids for r in ar]
    assert {e.tau for e in events} >= {0.5, 1.0}


def test_verify_stops_at_eos_and_budget_like_ar(tiny_mars, suite_prompts):
    for budget in (1, 3, 7):
        ar = generate(tiny_mars, suite_prompts[:3], DecodeConfig(mode="ar", max_new_tokens=budget))
        got = verify(tiny_mars, suite_prompts[:3], 0.5, 4, budget)
        assert [(r.token_ids, r.finish_reason) for r in got] == [(r.token_ids, r.finish_reason) for r in ar]


# ----------------------------------------------------------------------------- events and speed

def test_events_say_which_drafts_were_confirmed_and_which_rejected(tiny_mars, suite_prompts):
    cfg = DecodeConfig(mode="verify", tau=0.5, block_size=4, max_new_tokens=MAX_NEW)
    previous = [[] for _ in suite_prompts]
    confirmed = rejected = 0
    for event in generate_stream(tiny_mars, suite_prompts, cfg):
        for r, row in enumerate(event.rows):
            if not row.active:
                continue
            drafts = previous[r]
            assert row.accepted_ids[: row.confirmed] == drafts[: row.confirmed]   # confirmed drafts are committed
            assert row.n_accepted == min(row.confirmed + 1, len(row.accepted_ids)) or row.done
            if row.rejected is not None:
                assert row.rejected == drafts[row.confirmed] != row.accepted_ids[row.confirmed]  # AR replaced it
                rejected += 1
            else:
                assert row.confirmed == len(drafts)
            assert len(row.drafts) <= 3
            confirmed += row.confirmed
            previous[r] = row.drafts
    assert confirmed > 0 and rejected > 0      # both paths ran, in a batch (rows rejecting different counts)


def test_verify_writes_more_than_one_and_a_half_tokens_per_forward_on_tiny_mars(tiny_mars, suite_prompts):
    res = verify(tiny_mars, suite_prompts, 0.9, 4, 96)
    tpf = sum(len(r.token_ids) for r in res) / sum(r.forwards for r in res)
    assert tpf > 1.5, tpf


def test_nan_logits_stop_decoding_with_an_error_naming_the_model(llama_lm):
    import copy

    from mars_core.models.loading import wrap_model

    model = copy.deepcopy(llama_lm.model)
    with torch.no_grad():
        model.get_input_embeddings().weight.fill_(float("nan"))
    lm = wrap_model(model, llama_lm.tokenizer, name="broken-tiny")
    for mode in ("ar", "mars", "verify"):
        with pytest.raises(FloatingPointError, match="broken-tiny produced NaN/inf logits at step 0"):
            generate(lm, [PROMPTS[0]], DecodeConfig(mode=mode, max_new_tokens=4))
