"""Draft layouts and prompt lookup in lossless MARS (mars_core.decode.drafts): whichever layout and draft source,
the answer is greedy AR's (fp32, both backends, batched and alone, cached == uncached step by step); the
quadratic layout's mask groups each see exactly their own prefix and keep drafting after a rejection; prompt
lookup drafts what followed the same tokens earlier in the text."""
import pytest
import torch

from mars_core import DecodeConfig, generate, generate_stream, reference_generate
from mars_core.decode.batch import _Batch, _Row
from mars_core.decode.drafts import choose_leaves, lookup_drafts
from tests.conftest import PROMPTS
from tests.test_decoding import hf_greedy, hf_greedy_batch
from tests.test_verify import MAX_NEW, suite_prompts, tiny_mars  # noqa: F401  (fixtures)

# (draft_layout, prompt_lookup); ("linear", 0) is test_verify's
LAYOUTS = [("linear", 3), ("quadratic", 0), ("quadratic", 3), ("tree", 0), ("tree", 3)]


def cfg(tau, block_size, layout, lookup, max_new=MAX_NEW):
    return DecodeConfig(mode="verify", tau=tau, block_size=block_size, max_new_tokens=max_new,
                        draft_layout=layout, prompt_lookup=lookup)


# ----------------------------------------------------------------------------- pure pieces

def _tree_step(n_masks=2):
    """One row after 5 cached tokens: pending [c d1 d2], leaves at depths 1, 2, 3, a group behind c, d1, d2 and
    behind each leaf, laid out and masked by the decoder's own chunk builder."""
    row = _Row(0, 50, [11, 12, 13], n_drafts=2, leaves=[(1, 21), (2, 22), (3, 23)], cached=5)
    batch = _Batch([row], None, "cpu")
    batch.kv_valid = torch.ones(1, 5, dtype=torch.bool)
    ids, pos, valid, width, blocks = batch.chunk(n_masks, 0, behind=[2, 1, 0], n_leaves=3, leaf_groups=True)
    return ids[0].tolist(), pos[0].tolist(), batch.attention(valid, width, blocks)[0, 0]


def test_the_tree_mask_lets_each_node_see_exactly_its_ancestors_and_the_prefix():
    ids, pos, mask = _tree_step()
    cache = set(range(5))
    col = lambda c: 5 + c                               # a chunk column's key index, after the cache
    sees = lambda q: {k for k in range(mask.shape[1]) if mask[q, k]}
    assert ids[:6] == [11, 12, 13, 21, 22, 23] and pos[:6] == [5, 6, 7, 6, 7, 8]
    assert sees(1) == cache | {col(0), col(1)}                              # d1: c, itself
    assert sees(2) == cache | {col(0), col(1), col(2)}                      # d2: c, d1, itself
    assert sees(3) == cache | {col(0), col(3)}                              # leaf at depth 1: c
    assert sees(4) == cache | {col(0), col(1), col(4)}                      # depth 2: c, d1
    assert sees(5) == cache | {col(0), col(1), col(2), col(5)}              # depth 3: c, d1, d2
    groups = {"c": 6, "d1": 8, "d2": 10, "leaf1": 12, "leaf2": 14, "leaf3": 16}   # first column of each group
    prefix = {"c": [0], "d1": [0, 1], "d2": [0, 1, 2], "leaf1": [0, 3], "leaf2": [0, 1, 4], "leaf3": [0, 1, 2, 5]}
    for name, first in groups.items():
        for s in range(2):
            assert sees(first + s) == cache | {col(c) for c in prefix[name]} | {col(first + j) for j in range(s + 1)}
            assert pos[first + s] == pos[prefix[name][-1]] + 1 + s           # positions continue the node


def test_no_query_sees_a_hole_group():
    batch = _Batch([_Row(0, 50, [3, 4, 5], n_drafts=2, cached=2), _Row(1, 50, [6, 7, 8], n_drafts=0, cached=2)],
                   None, "cpu")
    batch.kv_valid = torch.ones(2, 2, dtype=torch.bool)
    ids, pos, valid, width, blocks = batch.chunk(1, 0, behind=[2, 1, 0])
    assert valid[1].tolist() == [True, True, True, False, False, True]   # row 1's groups behind committed tokens
    mask = batch.attention(valid, width, blocks)[1, 0]
    for hole in (3, 4):
        assert not mask[[q for q in range(6) if q != hole], 2 + hole].any()


def test_choose_leaves_offers_the_next_likeliest_tokens_at_each_depth():
    probs = torch.tensor([[0.6, 0.3, 0.1, 0.0], [0.5, 0.05, 0.25, 0.2], [0.2, 0.5, 0.3, 0.0]])
    # drafts [0, 0]: depth 1 offers token 1 (0.3), depth 2 token 2 (0.25), depth 3 (after the drafts) its top: 1
    assert choose_leaves(probs, [0, 0], 2, 3) == [(1, 1), (2, 2), (3, 1)]
    assert choose_leaves(probs, [0, 0], 3, 3) == [(1, 1), (1, 2), (2, 2), (2, 3), (3, 1), (3, 2)]
    assert choose_leaves(probs, [0, 0], 2, 2) == [(1, 1), (2, 2)]                  # depth <= cap
    assert choose_leaves(probs, [0, 0], 2, 3, min_prob=0.26) == [(1, 1), (3, 1)]    # depth 2's 0.25 too unlikely
    assert choose_leaves(probs, [0, 0], 1, 3) == []                                 # width 1: no tree


def test_lookup_drafts_continues_the_latest_longest_match():
    eos = {0}
    assert lookup_drafts([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], 3, 2, eos) == [7, 5]     # "2 3" latest: 7 5 (n=2)
    assert lookup_drafts([1, 2, 3, 9, 8, 1, 2, 3], 3, 4, eos) == [9, 8, 1, 2]          # n=3 beats a later n=1
    assert lookup_drafts([4, 5, 6], 3, 3, eos) == []                                   # nothing repeats
    assert lookup_drafts([4, 0, 7, 4], 2, 3, eos) == [0]                               # ends at an eos
    assert lookup_drafts([4, 5, 4], 2, 0, eos) == []                                   # no room
    assert lookup_drafts([4, 4, 4, 4], 3, 2, eos) == [4]                               # only what exists


@pytest.mark.parametrize("kwargs,word", [
    (dict(mode="verify", draft_layout="star"), "draft_layout='star' is unknown"),
    (dict(mode="verify", draft_layout="tree", tree_width=0), "tree_width=0"),
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


# ----------------------------------------------------------------------------- draft_layout="auto"

def test_the_planner_spends_positions_only_where_they_pay():
    from mars_core.decode.drafts import DraftPlanner

    rows = [_Row(0, 50, [1, 2, 3, 4], n_drafts=3)]
    free, dear = DraftPlanner(None, 3), DraftPlanner([float(p) for p in range(1, 60)], 3)
    for planner in (free, dear):
        planner.drafted[1:4], planner.confirmed[1:4] = [100.0] * 3, [50.0, 40.0, 20.0]   # slot 1 holds half the time
        planner.drafted_tokens, planner.drafted_steps = 30.0, 10.0                     # drafted steps: 3 tokens
    assert free.behind(rows, 3) == [3, 2, 1, 0]           # free positions: a group behind every draft
    assert dear.behind(rows, 3) == [0]                    # every position a full forward: the plain layout
    probs = torch.full((3, 8), 0.01)
    probs[0, 5] = 0.4
    assert free.keep_leaves(probs, [1, 2, 3], [(1, 5), (2, 6)], 3) == [(1, 5), (2, 6)]
    assert dear.keep_leaves(probs, [1, 2, 3], [(1, 5), (2, 6)], 3) == []
    assert dear.cost(100) > dear.cost(59)                 # past the measured range: the last slope
    dips = DraftPlanner([1.0, 1.5, 1.2, 1.6], 3)
    assert [dips.cost(p) for p in (1, 2, 3, 4)] == [1.0, 1.5, 1.5, 1.6]   # a measured dip is not a free position


def test_the_planner_appends_masks_only_as_deep_as_their_drafts_pay():
    from mars_core.decode.drafts import DraftPlanner

    fresh = [_Row(0, 50, [1])]                            # nothing to check: the masks' group always counts
    zen1 = [1.0, 1.22, 1.75, 2.27, 2.7, 3.1, 3.49]        # a CPU where each position costs about half a forward
    free, cpu, steep = DraftPlanner(None, 3), DraftPlanner(zen1, 3), DraftPlanner([float(p) for p in range(1, 9)], 3)
    assert free.masks(fresh, 3) == 3                      # free positions: every mask
    assert steep.masks(fresh, 3) == 0                     # a full forward per position: AR's steps
    assert cpu.masks(fresh, 3) == 1                       # prior rates (1 of 2): only the first draft pays
    mild = DraftPlanner([1.0 + 0.1 * p for p in range(8)], 3)   # a tenth of a forward per position
    assert mild.masks(fresh, 3) == 2
    for planner in (cpu, mild):
        planner.drafted[1:4], planner.confirmed[1:4] = [100.0] * 3, [95.0, 95.0, 95.0]
    assert mild.masks(fresh, 3) == 3                      # drafts that almost always hold pay their positions
    assert mild.masks(fresh, 2) == 2                      # never more than the step may append
    mild.asked[1:4], mild.offered[1:4] = [100.0] * 3, [100.0, 30.0, 5.0]
    assert mild.masks(fresh, 3) == 2                      # a third mask that rarely reaches tau drafts too seldom
    assert cpu.masks(fresh, 3) == 1                       # here a second draft (0.9 tokens) costs more (1.06)
    cpu.confirmed[1:4] = [20.0, 50.0, 50.0]
    assert cpu.masks(fresh, 3) == 0                       # a first draft confirmed 1 time in 5 does not
    behind = [_Row(0, 50, [1, 2, 3, 4], n_drafts=3)]      # behind 3 drafts the group counts only if all hold
    cpu.confirmed[1:4] = [60.0, 60.0, 60.0]
    assert cpu.masks(behind, 3) < cpu.masks(fresh, 3)


def test_the_planner_counts_how_deep_a_groups_masks_draft():
    from mars_core.decode.step import Settled as _Settled
    from mars_core.decode.drafts import DraftPlanner

    planner, row = DraftPlanner(None, 3), _Row(0, 50, [1])
    step = [_Settled([5], [7, 8, 9], [0.9, 0.2, 0.8], [7], source="masks")]   # the second mask stopped the drafts
    planner.observe([row], step, 4)                       # the prompt's forward: not counted
    planner.observe([row], step, 4)
    planner.observe([row], [_Settled([5], [7, 8], [0.1, 0.9], [], source=None)], 3)   # no draft from two masks
    planner.observe([row], [_Settled([5], [7, 8, 9], [0.9, 0.9, 0.9], [4, 4], source="prompt")], 4)   # lookup's
    assert planner.asked[1:4] == [3.0, 3.0, 2.0] and planner.offered[1:4] == [2.0, 1.0, 1.0]
    assert planner.offer(1) == 2 / 3 and planner.offer(3) == 1 / 2


def test_auto_keeps_ars_answer_and_with_free_positions_decodes_as_the_tree(tiny_mars, suite_prompts):
    ar = generate(tiny_mars, suite_prompts, DecodeConfig(mode="ar", max_new_tokens=MAX_NEW))
    steep = tuple(float(p) for p in range(1, 80))
    cpu = (1.0, 1.23, 1.32, 1.5, 1.55, 1.64, 1.81, 1.86, 1.96, 2.14, 2.12, 2.07, 2.19, 2.28, 2.32)
    for costs in (None, cpu, steep):
        c = DecodeConfig(mode="verify", tau=0.9, max_new_tokens=MAX_NEW, draft_layout="auto", row_costs=costs)
        assert [r.token_ids for r in generate(tiny_mars, suite_prompts, c)] == [r.token_ids for r in ar]
    for p in suite_prompts[:4]:
        auto = generate(tiny_mars, [p], cfg(0.9, 4, "auto", 0))[0]
        assert auto.steps == generate(tiny_mars, [p], cfg(0.9, 4, "tree", 0))[0].steps
        dear = generate(tiny_mars, [p], DecodeConfig(mode="verify", tau=0.9, max_new_tokens=MAX_NEW,
                                                      draft_layout="auto", row_costs=steep))[0]
        assert max(dear.positions[1:]) < max(auto.positions[1:])


def test_the_planner_pauses_drafting_after_a_window_that_lost_to_ar_and_doubles_the_pause():
    from mars_core.decode.drafts import DraftPlanner

    steep = DraftPlanner([1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0], 3)
    for _ in range(steep.WINDOW):
        assert steep.drafting()
        steep._verdict(1.4, 2.5)                         # 1.4 tokens for 2.5 forwards' cost: AR writes more
    assert [steep.drafting() for _ in range(steep.PAUSE + 1)] == [False] * steep.PAUSE + [True]
    for _ in range(steep.WINDOW):
        steep._verdict(1.4, 2.5)
    assert steep.paused == 2 * steep.PAUSE and steep.pause == 4 * steep.PAUSE   # a second loss in a row: twice as long
    steep.paused = 0
    for _ in range(steep.WINDOW):
        steep._verdict(3.0, 2.5)                         # drafting won this window
    assert steep.paused == 0 and steep.pause == steep.PAUSE
    free = DraftPlanner(None, 3)                         # free positions: a drafting step never loses to AR
    for _ in range(3 * free.WINDOW):
        free._verdict(1.0, free.cost(7))
    assert free.drafting() and free.paused == 0


def test_auto_drafts_only_while_it_pays_and_keeps_ars_answer(tiny_mars, suite_prompts):
    """Where every extra position costs two forwards, drafting loses to AR: auto then pauses it for AR's own
    one-position steps (a third of them here, none before), and writes AR's answer; with free positions it
    drafts on every step."""
    ar = generate(tiny_mars, suite_prompts[:4], DecodeConfig(mode="ar", max_new_tokens=MAX_NEW))
    dear = tuple(1.0 + 2.0 * p for p in range(30))
    for costs, ar_like in ((dear, True), (None, False)):
        c = DecodeConfig(mode="verify", tau=0.9, max_new_tokens=MAX_NEW, draft_layout="auto", row_costs=costs)
        out = generate(tiny_mars, suite_prompts[:4], c)
        assert [r.token_ids for r in out] == [r.token_ids for r in ar]
        positions = [p for r in out for p in r.positions[1:]]
        share = positions.count(1) / len(positions)
        assert (share > 0.25) if ar_like else (share == 0), (costs, share)


def test_auto_is_refused_by_the_uncached_reference_and_bad_costs_are_named(tiny_mars, suite_prompts):
    with pytest.raises(ValueError, match="draft_layout='auto' adapts"):
        reference_generate(tiny_mars, suite_prompts[:1], cfg(0.9, 4, "auto", 0))
    with pytest.raises(ValueError, match="row_costs=\\(1.0, -2.0\\) must be positive numbers"):
        DecodeConfig(mode="verify", draft_layout="auto", row_costs=(1.0, -2.0))


def test_lookup_replaces_mask_drafts_only_when_it_extends_them_or_they_are_none():
    from mars_core.decode.drafts import lookup_wins

    assert lookup_wins([5, 6], [])                 # the masks offer nothing
    assert lookup_wins([5, 6, 7], [5])             # it starts with the masks' draft and runs longer
    assert not lookup_wins([4, 6, 7], [5])         # it disagrees with a confident mask draft
    assert not lookup_wins([5], [5, 9])            # shorter
    assert not lookup_wins([], [])
