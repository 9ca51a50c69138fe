"""finetune.evals.structured: the five structured categories, their splits, their balance and the category tags."""

from collections import Counter

import pytest

from finetune.evals.natural import natural_prompts
from finetune.evals.structured import CATEGORIES, category_of, main, prompt_table, structured_prompts


def test_held_out_subjects_never_appear_in_training_prompts_of_their_category():
    train, held = prompt_table("train"), prompt_table("heldout")
    assert len(train) > 4000 and len(held) > 500
    assert not {(c, s) for c, s, _ in train} & {(c, s) for c, s, _ in held}
    assert not {p for _, _, p in train} & {p for _, _, p in held}
    assert {c for c, _, _ in held} == set(CATEGORIES)


def test_any_prefix_is_balanced_and_the_order_follows_the_seed():
    first = structured_prompts("train", 10, seed=0)
    by_prompt = {p: c for c, _, p in prompt_table("train")}
    assert Counter(by_prompt[p] for p in first) == {c: 2 for c in CATEGORIES}
    assert structured_prompts("train", 50, seed=3) == structured_prompts("train", 50, seed=3)
    assert structured_prompts("train", 50, seed=3) != structured_prompts("train", 50, seed=4)
    with pytest.raises(ValueError, match="must be an integer from 0"):
        structured_prompts("heldout", 10**6)


def test_every_natural_and_structured_prompt_has_its_category():
    tags = category_of()
    assert tags["List the days of the week."] == "enumerate"
    assert all(tags[p] in CATEGORIES for p in structured_prompts("heldout", 40, seed=77))
    assert tags[natural_prompts("train", 1)[0]] not in CATEGORIES


def test_counting_prompts_end_on_their_last_number():
    counts = [p for c, _, p in prompt_table("train") if "in steps of" in p]
    for p in counts:
        a, b, k = (int(w) for w in p.replace(".", "").split() if w.isdigit())
        assert (b - a) % k == 0, p


def test_the_command_writes_one_prompt_per_line(tmp_path):
    out = tmp_path / "p.txt"
    assert main(["--split", "heldout", "--n", "7", "--seed", "5", "--out", str(out)]) == 0
    assert out.read_text().splitlines() == structured_prompts("heldout", 7, seed=5)
