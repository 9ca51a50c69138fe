"""Draft layouts and prompt lookup in lossless MARS (mars_core.drafts): whichever layout and draft source,
the answer is greedy AR's (fp32, both backends, batched and alone, cached == uncached step by step); the
quadratic layout's mask groups each see exactly their own prefix and keep drafting after a rejection; prompt
lookup drafts what followed the same tokens earlier in the text."""
import pytest
import torch

from mars_core import DecodeConfig, generate, generate_stream, reference_generate
from mars_core.decoding import step_attention
from mars_core.drafts import group_attention, lookup_drafts
from tests.conftest import PROMPTS
from tests.test_decoding import hf_greedy, hf_greedy_batch
from tests.test_verify import MAX_NEW, suite_prompts, tiny_mars  # noqa: F401  (fixtures)

LAYOUTS = [("linear", 3), ("quadratic", 0), ("quadratic", 3)]   # (draft_layout, prompt_lookup); linear, 0 is test_verify's


def cfg(tau, block_size, layout, lookup, max_new=MAX_NEW):
    return DecodeConfig(mode="verify", tau=tau, block_size=block_size, max_new_tokens=max_new,
                        draft_layout=layout, prompt_lookup=lookup)


# ----------------------------------------------------------------------------- pure pieces

def test_each_mask_group_sees_its_prefix_and_its_own_earlier_masks_only():
    width, groups, n_masks, past = 4, 3, 2, 2          # chunk: c0 c1 d1 d2 | g0 g0 | g1 g1 | g2 g2
    length = width + groups * n_masks
    base = step_attention(torch.ones(1, past, dtype=torch.bool), torch.ones(1, length, dtype=torch.bool))
    mask = group_attention(base, width, groups, n_masks)[0, 0]
    assert mask.shape == (length, past + length)
    for q in range(width):                              # real tokens: plain causal
        assert mask[q].tolist() == [True] * (past + q + 1) + [False] * (length - q - 1)
    for g in range(groups):
        own = width - groups + g                        # the chunk column this group follows
        for s in range(n_masks):
            q = width + g * n_masks + s
            sees = {k for k in range(past + length) if mask[q, k]}
            want = set(range(past + own + 1)) | {past + width + g * n_masks + j for j in range(s + 1)}
            assert sees == want, (g, s)


def test_no_query_sees_a_hole_group():
    kv = torch.ones(1, 1, dtype=torch.bool)
    valid = torch.tensor([[True, True, False, True]])   # chunk: c d | hole-group | live group (n_masks 1)
    mask = group_attention(step_attention(kv, valid), 2, 2, 1)[0, 0]
    assert not mask[[0, 1, 3], 3].any()                 # the hole (key 3, after one cached column): seen by none
    assert [k for k in range(5) if mask[3, k]] == [0, 1, 2, 4]   # the live group: cache, c, d, itself


def test_lookup_drafts_continues_the_latest_longest_match():
    eos = {0}
    assert lookup_drafts([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], 3, 2, eos) == [7, 5]     # "2 3" latest: 7 5 (n=2)
    assert lookup_drafts([1, 2, 3, 9, 8, 1, 2, 3], 3, 4, eos) == [9, 8, 1, 2]          # n=3 beats a later n=1
    assert lookup_drafts([4, 5, 6], 3, 3, eos) == []                                   # nothing repeats
    assert lookup_drafts([4, 0, 7, 4], 2, 3, eos) == [0]                               # ends at an eos
    assert lookup_drafts([4, 5, 4], 2, 0, eos) == []                                   # no room
    assert lookup_drafts([4, 4, 4, 4], 3, 2, eos) == [4]                               # only what exists


@pytest.mark.parametrize("kwargs,word", [
    (dict(mode="verify", draft_layout="tree"), "draft_layout='tree' is unknown"),
    (dict(mode="verify", prompt_lookup=-1), "prompt_lookup=-1"),
    (dict(mode="mars", draft_layout="quadratic"), "draft_layout='quadratic' with mode='mars'"),
    (dict(mode="ar", prompt_lookup=3), "prompt_lookup=3 with mode='ar'"),
])
def test_bad_draft_options_are_refused_naming_the_value(kwargs, word):
    with pytest.raises(ValueError, match=word):
        DecodeConfig(**kwargs)


# ----------------------------------------------------------------------------- equals greedy AR

@pytest.mark.parametrize("layout,lookup", LAYOUTS)
@pytest.mark.parametrize("tau", [0.3, 0.9])
@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_every_layout_equals_ar_and_generate_on_tiny_random_models(tiny_lm, layout, lookup, tau, block_size):
    prompts = [tiny_lm.encode(p) for p in PROMPTS]
    c = cfg(tau, block_size, layout, lookup, 32)
    batch = generate(tiny_lm, prompts, c)
    assert [r.token_ids for r in batch] == hf_greedy_batch(tiny_lm, prompts, 32, tiny_lm.eos_ids)
    alone = generate(tiny_lm, prompts[:1], c)[0]
    assert alone.token_ids == hf_greedy(tiny_lm, prompts[0], 32, tiny_lm.eos_ids)
    assert alone.steps == batch[0].steps


@pytest.mark.parametrize("layout,lookup", LAYOUTS)
@pytest.mark.parametrize("tau", [0.3, 0.9])
@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_every_layout_equals_ar_on_tiny_mars_batched_alone_and_uncached(tiny_mars, suite_prompts, layout, lookup,
                                                                        tau, block_size):
    ar = generate(tiny_mars, suite_prompts, DecodeConfig(mode="ar", max_new_tokens=MAX_NEW))
    c = cfg(tau, block_size, layout, lookup)
    batch = generate(tiny_mars, suite_prompts, c)                  # prompts of different lengths
    assert [r.token_ids for r in batch] == [r.token_ids for r in ar]
    for p, row in zip(suite_prompts[:2], batch[:2]):
        assert generate(tiny_mars, [p], c)[0].steps == row.steps
    uncached = reference_generate(tiny_mars, suite_prompts[:3], c)
    assert [r.steps for r in uncached] == [r.steps for r in batch[:3]]   # same tokens, same count per forward


def test_the_quadratic_layout_drafts_right_after_a_rejection(tiny_mars, suite_prompts):
    """The linear layout cannot draft on a step that rejected a draft (its masks saw the wrong token); the
    quadratic one has a group behind every confirmed prefix, so it can, and it needs fewer forwards."""
    def after_rejection(layout):
        rows = [e.rows[0] for p in suite_prompts for e in generate_stream(tiny_mars, [p], cfg(0.3, 4, layout, 0))]
        return [bool(r.drafts) for r in rows if r.rejected is not None]

    linear, quadratic = after_rejection("linear"), after_rejection("quadratic")
    assert linear and not any(linear)
    assert quadratic and any(quadratic)
    batch = generate(tiny_mars, suite_prompts, cfg(0.3, 4, "quadratic", 0))
    assert sum(r.forwards for r in batch) < sum(r.forwards for r in generate(tiny_mars, suite_prompts,
                                                                             cfg(0.3, 4, "linear", 0)))


def test_the_quadratic_layout_feeds_a_mask_group_per_draft(tiny_mars, suite_prompts):
    events = list(generate_stream(tiny_mars, suite_prompts[:1], cfg(0.9, 4, "quadratic", 0)))
    for before, event in zip(events, events[1:]):
        drafts = len(before.rows[0].drafts)
        assert event.positions == 1 + drafts + (drafts + 1) * 3 or event.rows[0].done


def test_prompt_lookup_drafts_a_repeating_answer_and_keeps_ars_tokens(tiny_lm):
    """A tiny random model's greedy answer falls into a loop; its masks never reach τ, the text so far does."""
    prompt = tiny_lm.encode(PROMPTS[2])
    want = hf_greedy(tiny_lm, prompt, 60, tiny_lm.eos_ids)
    plain = generate(tiny_lm, [prompt], cfg(0.9, 8, "linear", 0, 60))[0]
    looked = generate(tiny_lm, [prompt], cfg(0.9, 8, "linear", 3, 60))[0]
    assert plain.token_ids == looked.token_ids == want
    assert plain.tokens_per_forward == 1.0
    assert looked.tokens_per_forward > 2.0
    sources = {r.rows[0].draft_source for r in generate_stream(tiny_lm, [prompt], cfg(0.9, 8, "linear", 3, 60))}
    assert "prompt" in sources and sources <= {None, "prompt", "masks"}
