"""The backend interface (mars_core.decode.backend) and one step's bookkeeping (mars_core.decode.step): the decoder
reaches a model only through the interface, and lossless mode's row bookkeeping, shared by the cached decoder and
the uncached reference, commits, keeps and drafts what the algorithm says."""
import dataclasses

import pytest
import torch
from transformers import DynamicCache

from mars_core import DecodeConfig, generate, wrap_model
from mars_core.decode.backend import Backend, TransformersBackend, backend
from mars_core.decode.step import StepPlan, check_drafts, draft_room, drafting_group, next_drafts
from tests.tiny_fixtures import make_model

EOS = {0}


# ----------------------------------------------------------------------------- the backend interface

def test_the_lean_forward_is_a_backend_and_a_transformers_model_is_wrapped(tokenizer):
    model = make_model("llama", len(tokenizer))
    hf = backend(wrap_model(model, tokenizer, backend="hf"))
    assert isinstance(hf, TransformersBackend) and hf.model is model
    assert not (hf.takes_draft_tail or hf.takes_head_top or hf.builds_causal_mask)
    assert isinstance(hf.new_cache(), DynamicCache)
    lean_lm = wrap_model(model, tokenizer, backend="lean")
    lean = backend(lean_lm)
    assert lean is lean_lm.net and isinstance(lean, Backend)
    assert lean.takes_draft_tail and lean.builds_causal_mask
    assert not isinstance(model, Backend)   # a bare transformers model lacks the capability flags


class _Counting:
    """A backend of our own around a transformers model: the interface and nothing else, counting forwards."""
    takes_draft_tail = takes_head_top = builds_causal_mask = False

    def __init__(self, model):
        self.model, self.calls, self.keys = model, 0, set()

    def new_cache(self):
        return DynamicCache(config=self.model.config)

    def __call__(self, **forward):
        self.calls += 1
        self.keys |= set(forward)
        return self.model(**forward)


@pytest.mark.parametrize("mode", ["ar", "mars", "verify"])
def test_the_decoder_runs_any_object_that_provides_the_interface(tokenizer, mode):
    model = make_model("llama", len(tokenizer))
    plain = wrap_model(model, tokenizer, backend="hf")
    counted = dataclasses.replace(plain, net=_Counting(model))
    assert isinstance(counted.net, Backend)
    cfg = DecodeConfig(mode=mode, tau=0.5, max_new_tokens=12)
    want = generate(plain, ["What is 2+3?"], cfg)[0]
    got = generate(counted, ["What is 2+3?"], cfg)[0]
    assert got.token_ids == want.token_ids
    assert counted.net.calls == len(got.steps)           # one forward per step, all through the interface
    assert counted.net.keys <= {"input_ids", "attention_mask", "position_ids", "cache", "use_cache",
                                "logits_to_keep"}        # no optional argument the backend did not declare


# ----------------------------------------------------------------------------- the step plan

def test_the_step_plan_counts_the_columns_it_lays_out():
    plan = StepPlan(tau=0.9, n_masks=3, n_verify=2, n_leaves=1, behind=(2, 1, 0), width=6)
    assert plan.n_out == 4                        # the last committed token, two drafts, one leaf
    assert plan.n_mask_cols == (3 + 1) * 3        # a group behind three pending columns and behind the leaf
    assert plan.keep(6 + 1 + 12, "cpu").tolist() == list(range(3, 19))   # q_0 at column 3 on


# ----------------------------------------------------------------------------- lossless bookkeeping

def test_check_drafts_keeps_drafts_while_they_equal_ars_tokens_and_replaces_the_first_that_does_not():
    # drafts 5 6 7 after the last committed token; AR says 5 6 9 then 4 after the last draft
    assert check_drafts([5, 6, 7], [5, 6, 9, 4], [], [], 50, EOS) == (2, None, [5, 6, 9])
    assert check_drafts([5, 6, 7], [5, 6, 7, 4], [], [], 50, EOS) == (3, None, [5, 6, 7, 4])   # all hold: +1 token
    assert check_drafts([], [8], [], [], 50, EOS) == (0, None, [8])                          # an AR step


def test_check_drafts_confirms_a_leaf_holding_ars_token_and_commits_the_token_after_it():
    # the draft at depth 2 (6) is wrong, AR wants 9 there; leaf 1 (depth 2, token 9) holds it, AR after it: 3
    leaves, leaf_ar = [(1, 11), (2, 9)], [12, 3]
    assert check_drafts([5, 6], [5, 9, 1], leaves, leaf_ar, 50, EOS) == (1, 1, [5, 9, 3])
    # clipped by the budget to the leaf's own token: the row ends there, so no leaf is kept
    assert check_drafts([5, 6], [5, 9, 1], leaves, leaf_ar, 2, EOS) == (1, None, [5, 9])
    # an eos among the committed tokens ends the commit
    assert check_drafts([5, 0, 7], [5, 0, 7, 4], [], [], 50, EOS) == (3, None, [5, 0])


def test_the_drafting_group_is_the_one_behind_the_last_confirmed_token():
    assert drafting_group((0,), 3, 3, None) == 0           # linear: all confirmed, the group after the last draft
    assert drafting_group((0,), 3, 1, None) == -1          # linear after a rejection: its masks saw a wrong token
    assert drafting_group((3, 2, 1, 0), 3, 1, None) == 1   # quadratic: the group behind draft 1
    assert drafting_group((2, 1, 0), 2, 0, 1) == 3 + 1     # a confirmed leaf: the group behind that leaf slot


def test_draft_room_is_none_after_an_eos_or_a_clipped_commit_else_bounded_by_masks_budget_and_block():
    assert draft_room([5, 6], 1, None, EOS, n_masks=3, left=50, most=4) == 3
    assert draft_room([5, 6], 1, None, EOS, n_masks=3, left=4, most=4) == 1   # 4 left: 2 now, 1 next, 1 draft
    assert draft_room([5, 6], 1, None, EOS, n_masks=3, left=50, most=2) == 1  # max_accept 2: one draft
    assert draft_room([5, 0], 1, None, EOS, n_masks=3, left=50, most=4) == 0  # ended on an eos
    assert draft_room([5], 1, None, EOS, n_masks=3, left=50, most=4) == 0     # clipped: fewer tokens than checked
    assert draft_room([5, 6], 1, None, EOS, n_masks=0, left=50, most=4) == 0  # no masks this step


def test_next_drafts_takes_confident_candidates_or_a_longer_prompt_lookup():
    assert next_drafts([7, 8, 9], [0.99, 0.97, 0.5], 0.95, 3, EOS, [], 0) == ([7, 8], "masks", [])
    assert next_drafts([7, 8, 9], [0.99, 0.99, 0.99], 0.95, 2, EOS, [], 0) == ([7, 8], "masks", [])   # the cap
    assert next_drafts([7, 8, 9], [0.9, 0.99, 0.99], 0.95, 3, EOS, [], 0) == ([], None, [])
    history = [1, 7, 8, 3, 4, 2, 1]                       # "1" was followed by 7 8 3 before
    assert next_drafts([7, 8, 9], [0.99, 0.5, 0.5], 0.95, 3, EOS, history, 2) == ([7, 8, 3], "prompt", [])
    assert next_drafts([6], [0.99], 0.95, 3, EOS, history, 2) == ([6], "masks", [])   # lookup must agree on 1st
    assert next_drafts([7, 8], [0.99, 0.99], 0.95, 0, EOS, history, 2) == ([], None, [])   # no room
    chosen = next_drafts([7], [0.99], 0.95, 3, EOS, [], 0, leaf_group=lambda new: [(len(new) + 1, 42)])
    assert chosen == ([7], "masks", [(2, 42)])

