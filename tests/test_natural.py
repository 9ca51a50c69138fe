"""finetune.evals.natural: the natural-prompt generator and its splits; finetune.evals.checkable: the checkable set's
checker."""

from collections import Counter
from pathlib import Path

import pytest

from finetune.evals.checkable import CheckItem, check, checkable_set
from finetune.evals.natural import CATEGORIES, SPLITS, main, natural_prompts, prompt_table, split_of


def test_the_two_splits_share_no_prompt_and_no_subject():
    train, held = prompt_table("train"), prompt_table("heldout")
    assert len(train) + len(held) >= 3000
    assert not {p for *_, p in train} & {p for *_, p in held}
    assert not {(c, s) for c, s, _ in train} & {(c, s) for c, s, _ in held}
    assert all(split_of(c, s) == "heldout" for c, s, _ in held)


def test_the_more_split_is_new_prompts_on_train_subjects_only():
    """'more' (training data after 'train' is used up) repeats no prompt of the other splits and asks about no
    held-out subject, and it covers every category."""
    train, held, more = prompt_table("train"), prompt_table("heldout"), prompt_table("more")
    assert len(more) >= 3000 and len({p for *_, p in more}) == len(more)
    assert not {p for *_, p in more} & ({p for *_, p in train} | {p for *_, p in held})
    assert not {(c, s) for c, s, _ in more} & {(c, s) for c, s, _ in held}
    assert {c for c, _, _ in more} == set(CATEGORIES)
    assert (natural_prompts("more", 50, seed=0) == natural_prompts("more", 50, seed=0)
            != natural_prompts("more", 50, seed=1))


def test_the_more2_split_is_new_prompts_on_train_subjects_only():
    """'more2' (after 'more' was used by v3) repeats no prompt of the three other splits and asks about no held-out
    subject; every category has some."""
    earlier = {p for split in ("train", "heldout", "more") for *_, p in prompt_table(split)}
    more2 = prompt_table("more2")
    assert len(more2) >= 2500 and len({p for *_, p in more2}) == len(more2)
    assert not {p for *_, p in more2} & earlier
    assert not {(c, s) for c, s, _ in more2} & {(c, s) for c, s, _ in prompt_table("heldout")}
    assert {c for c, _, _ in more2} == set(CATEGORIES)
    assert len(prompt_table("more")) == 3220


# each later split after the round that used the one before it; that one's size and order are pinned, because a
# shipped model's data came from it
@pytest.mark.parametrize("split, before, pinned", [("more3", "more2", (2731, "2941e05ca185")),
                                                   ("more4", "more3", (2691, "1a0ed6b2dd98")),
                                                   ("more5", "more4", (2697, "e1e3666f84f5"))])
def test_a_later_more_split_is_new_prompts_on_train_subjects_only_and_leaves_the_one_before_as_it_was(
        split, before, pinned):
    """The split repeats no prompt of any earlier split and asks about no held-out subject; every category has
    some; the split before it keeps its size and order."""
    import hashlib
    earlier = {p for e in SPLITS[:SPLITS.index(split)] for *_, p in prompt_table(e)}
    rows = prompt_table(split)
    assert len(rows) >= 2500 and len({p for *_, p in rows}) == len(rows)
    assert not {p for *_, p in rows} & earlier
    assert not {(c, s) for c, s, _ in rows} & {(c, s) for c, s, _ in prompt_table("heldout")}
    assert {c for c, _, _ in rows} == set(CATEGORIES)
    digest = hashlib.sha256("\n".join(natural_prompts(before)).encode()).hexdigest()[:12]
    assert (len(prompt_table(before)), digest) == pinned


def test_the_train_and_heldout_splits_are_unchanged_by_the_more_split():
    """Every earlier run drew from these two (the report set is natural_prompts("heldout", 64, seed=1)): their
    sizes and a digest of their seed-0 order pin them."""
    import hashlib
    digest = lambda split: hashlib.sha256("\n".join(natural_prompts(split)).encode()).hexdigest()[:12]
    assert (len(prompt_table("train")), digest("train")) == (4229, "5362f5e978c5")
    assert (len(prompt_table("heldout")), digest("heldout")) == (797, "053a3887c10e")


def test_prompts_are_distinct_seeded_and_every_category_is_in_train():
    a, b = natural_prompts("train", 3000, seed=0), natural_prompts("train", 3000, seed=0)
    c = natural_prompts("train", 3000, seed=1)
    assert a == b and a != c and len(set(a)) == 3000
    cats = Counter(cat for cat, _, p in prompt_table("train") if p in set(a))
    assert set(cats) == set(CATEGORIES)
    # a short prefix is already balanced: the first 15 come from 15 different categories
    first = natural_prompts("heldout", 15, seed=0)
    by_prompt = {p: cat for cat, _, p in prompt_table("heldout")}
    assert len({by_prompt[p] for p in first}) == 15


def test_asking_for_more_prompts_than_a_split_holds_names_the_size():
    size = len(prompt_table("heldout"))
    with pytest.raises(ValueError, match=str(size)):
        natural_prompts("heldout", size + 1)
    with pytest.raises(ValueError, match="split"):
        natural_prompts("dev", 3)


def test_the_checkable_set_is_large_distinct_and_never_a_training_prompt():
    items = checkable_set()
    assert len(items) >= 300 and len({i.prompt for i in items}) == len(items)
    train = {p for *_, p in prompt_table("train")}
    assert not {i.prompt for i in items} & train
    assert checkable_set(10, seed=0) == checkable_set(10, seed=0) != checkable_set(10, seed=1)


def test_checker_reads_words_and_numbers_as_whole_tokens():
    paris = CheckItem("What is the capital of France?", ("paris",), "capital")
    assert check(paris, "The capital of France is Paris.")
    assert not check(paris, "It is Lyon.") and not check(paris, "Parisian food is good.")
    add = CheckItem("What is 7 + 5?", ("12",), "arithmetic", numeric=True)
    assert check(add, "To add 7 and 5: 7 + 5 = 12.")
    assert not check(add, "7 + 5 = 13, or 120 if you like") and not check(add, "It is 1.2 or 12.5")
    big = CheckItem("How many metres are in a kilometre?", ("1000",), "unit", numeric=True)
    assert check(big, "There are 1,000 metres in a kilometre.")
    freeze = CheckItem("What is the freezing point of water in Celsius?", ("0", "zero"), "fact", numeric=True)
    assert check(freeze, "Water freezes at zero degrees.") and check(freeze, "It is 0 °C.")


def test_arithmetic_answers_are_never_an_operand():
    for item in checkable_set():
        if item.kind == "arithmetic":
            operands = [w.strip("?") for w in item.prompt.split() if w.strip("?").isdigit()]
            assert item.answers[0] not in operands


def test_cli_writes_one_prompt_per_line(tmp_path):
    out = tmp_path / "p.txt"
    assert main(["--split", "heldout", "--n", "20", "--out", str(out)]) == 0
    assert out.read_text().splitlines() == natural_prompts("heldout", 20)


def test_the_shipped_natural_heldout_file_is_what_the_cli_writes(tmp_path):
    """assets/prompts/natural-heldout.txt, bench's default prompts for smollm2-mars, cannot drift from the generator."""
    from mars_core.models.textfile import read_prompts

    shipped = Path(__file__).resolve().parents[1] / "assets" / "prompts" / "natural-heldout.txt"
    out = tmp_path / "p.txt"
    assert main(["--split", "heldout", "--n", "16", "--out", str(out)]) == 0
    assert shipped.read_bytes() == out.read_bytes()
    assert read_prompts(str(shipped)) == natural_prompts("heldout", 16)


def test_the_heldout_more_split_is_new_prompts_on_heldout_subjects_only():
    # development draws go on here once "heldout" is used up: the MORE templates on held-out subjects, so none of
    # its prompts is a training prompt or asks about a subject a training prompt of its category mentions
    from finetune.evals.natural import HELDOUT_MORE

    table = prompt_table(HELDOUT_MORE)
    prompts = [p for _, _, p in table]
    assert len(prompts) > 2000 and len(set(prompts)) == len(prompts)
    assert all(split_of(c, s) == "heldout" for c, s, _ in table)
    assert len({c for c, _, _ in table}) == len(CATEGORIES)
    trained = {p for split in SPLITS if split != "heldout" for _, _, p in prompt_table(split)}
    heldout = {p for _, _, p in prompt_table("heldout")}
    assert not set(prompts) & trained and not set(prompts) & heldout
    train_subjects = {(c, s) for split in SPLITS if split != "heldout" for c, s, _ in prompt_table(split)}
    assert not {(c, s) for c, s, _ in table} & train_subjects
    assert natural_prompts(HELDOUT_MORE, 5, seed=1) == natural_prompts(HELDOUT_MORE, None, seed=1)[:5]
