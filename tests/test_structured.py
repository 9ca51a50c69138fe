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


def test_the_checker_knows_each_arithmetic_and_counting_prompts_answer_from_its_numbers():
    from finetune.evals.structured import check_answer

    table = prompt_table("train") + prompt_table("heldout")
    sums = [p for c, s, p in table if c == "arithmetic" and s.startswith("+") and p.startswith("What is")]
    a, b = (int(x) for x in sums[0][len("What is "):-1].split(" + "))
    assert check_answer(sums[0], f"{a} + {b} = {a + b}.") is None
    assert check_answer(sums[0], f"{a} + {b} = {a + b + 1}.") == f"want {a + b}, wrote {a + b + 1}"
    assert check_answer(sums[0], "I cannot say.") == f"want {a + b}, wrote no number"
    # the last number is the answer: the right one written in a step, then a wrong total, is wrong
    assert check_answer(sums[0], f"First {a + b}, so the answer is {a + b + 10}.") is not None
    big = next(p for c, s, p in table if c == "arithmetic" and s.startswith("*") and p.startswith("What is"))
    x, y = (int(v) for v in big[len("What is "):-1].split(" × "))
    assert check_answer(big, f"{x} × {y} = {x * y}") is None
    word = next(p for p in (q for _, _, q in table) if p.startswith("A farmer has"))
    sheep, more = _two_numbers(word)
    assert check_answer(word, f"{sheep} + {more} - 5 = {sheep + more - 5} sheep.") is None


def _two_numbers(text):
    nums = [int(w) for w in text.replace(",", " ").split() if w.isdigit()]
    return nums[0], nums[1]


def test_the_checker_wants_the_whole_counting_sequence_in_order():
    from finetune.evals.structured import check_answer

    table = prompt_table("train") + prompt_table("heldout")
    up = next(p for c, _, p in table if c == "enumerate" and p.startswith("Count from") and "steps" not in p)
    a, b = (int(x) for x in up[len("Count from "):-1].split(" to "))
    assert check_answer(up, ", ".join(str(n) for n in range(a, b + 1))) is None
    assert check_answer(up, "Sure: " + "\n".join(f"{n}." for n in range(a, b + 1)) + " Done.") is None
    assert check_answer(up, ", ".join(str(n) for n in range(a, b))) is not None          # one short
    assert check_answer(up, ", ".join(str(n) for n in range(b, a - 1, -1))) is not None  # the wrong way round
    down = next(p for c, _, p in table if c == "enumerate" and p.startswith("Count down from"))
    hi, lo = (int(x) for x in down[len("Count down from "):-1].split(" to "))
    assert check_answer(down, " ".join(str(n) for n in range(hi, lo - 1, -1))) is None


def test_prompts_without_one_exact_answer_are_not_judged():
    from finetune.evals.structured import check_answer

    assert check_answer("Define recycling in one sentence.", "anything at all") is None
    assert check_answer("List the days of the week.", "Monday") is None


def test_the_more_split_is_new_prompts_on_train_subjects_only():
    """'more' (training data after 'train' was used by v3) repeats no prompt of the other splits, asks about no
    held-out subject, and leaves both earlier splits as they were (their sizes and a digest of their order)."""
    import hashlib

    train, held, more = prompt_table("train"), prompt_table("heldout"), prompt_table("more")
    assert len(more) >= 3000 and len({p for *_, p in more}) == len(more)
    assert not {p for *_, p in more} & ({p for *_, p in train} | {p for *_, p in held})
    assert not {(c, s) for c, s, _ in more} & {(c, s) for c, s, _ in held}
    assert {c for c, _, _ in more} == set(CATEGORIES)
    digest = lambda split: hashlib.sha256("\n".join(structured_prompts(split)).encode()).hexdigest()[:12]
    assert (len(train), digest("train")) == (5367, "d4cba39ce3e8")
    assert (len(held), digest("heldout")) == (880, "903b8db7ec73")
    tags = category_of()
    assert all(tags[p] == c for c, _, p in more)


def test_the_more2_split_is_new_prompts_on_train_subjects_only_and_leaves_more_as_it_was():
    """'more2' (after v3.1 used 'more') repeats no prompt of the three other splits and asks about no held-out
    subject; 'more', which v3.1 was trained on, keeps its size and order; every new prompt has its category."""
    import hashlib

    earlier = {p for split in ("train", "heldout", "more") for *_, p in prompt_table(split)}
    more2 = prompt_table("more2")
    assert len(more2) >= 3000 and len({p for *_, p in more2}) == len(more2)
    assert not {p for *_, p in more2} & earlier
    assert not {(c, s) for c, s, _ in more2} & {(c, s) for c, s, _ in prompt_table("heldout")}
    assert {c for c, _, _ in more2} == set(CATEGORIES)
    digest = hashlib.sha256("\n".join(structured_prompts("more")).encode()).hexdigest()[:12]
    assert (len(prompt_table("more")), digest) == (3759, "8b7d417cd056")
    tags = category_of()
    assert all(tags[p] == c for c, _, p in more2)


def test_the_more3_split_is_new_prompts_on_train_subjects_only_and_leaves_more2_as_it_was():
    """'more3' (after v3.5 used 'more2') repeats no prompt of the four other splits and asks about no held-out
    subject; 'more2', which v3.5 was trained on, keeps its size and order; every new prompt has its category."""
    import hashlib

    earlier = {p for split in ("train", "heldout", "more", "more2") for *_, p in prompt_table(split)}
    more3 = prompt_table("more3")
    assert len(more3) >= 3000 and len({p for *_, p in more3}) == len(more3)
    assert not {p for *_, p in more3} & earlier
    assert not {(c, s) for c, s, _ in more3} & {(c, s) for c, s, _ in prompt_table("heldout")}
    assert {c for c, _, _ in more3} == set(CATEGORIES)
    digest = hashlib.sha256("\n".join(structured_prompts("more2")).encode()).hexdigest()[:12]
    assert (len(prompt_table("more2")), digest) == (3565, "9c2747df1362")
    tags = category_of()
    assert all(tags[p] == c for c, _, p in more3)


def test_the_checker_knows_the_answers_of_the_more3_prompts():
    from finetune.evals.structured import check_answer

    more3 = prompt_table("more3")
    up = next(p for c, _, p in more3 if p.startswith("List the numbers from") and "going up by" in p)
    a, b = _two_numbers(up)
    k = int(up.rstrip(".").split()[-1])
    assert check_answer(up, ", ".join(str(n) for n in range(a, b + 1, k))) is None
    assert k > 1 and check_answer(up, ", ".join(str(n) for n in range(a, b + 1))) is not None
    prod = next(p for c, s, p in more3 if c == "arithmetic" and s.startswith("*") and p.startswith("Multiply"))
    x, y = (int(v) for v in prod[len("Multiply "):-1].split(" and "))
    assert check_answer(prod, f"{x} × {y} = {x * y}") is None
    assert check_answer(prod, f"{x} × {y} = {x * y + 1}") == f"want {x * y}, wrote {x * y + 1}"


def test_the_checker_knows_the_answers_of_the_more2_prompts():
    from finetune.evals.structured import check_answer

    more2 = prompt_table("more2")
    down = next(p for c, _, p in more2 if p.startswith("Count down from") and p.endswith("one per line."))
    b, a = _two_numbers(down)
    assert check_answer(down, "\n".join(str(n) for n in range(b, a - 1, -1))) is None
    assert check_answer(down, "\n".join(str(n) for n in range(b, a, -1))) is not None
    prod = next(p for c, s, p in more2 if c == "arithmetic" and s.startswith("*") and p.startswith("Compute"))
    x, y = (int(v) for v in prod[len("Compute "):-1].split(" × "))
    assert check_answer(prod, f"{x} × {y} = {x * y}") is None
    assert check_answer(prod, f"{x} × {y} = {x * y + 1}") == f"want {x * y}, wrote {x * y + 1}"


def test_the_checker_knows_the_answers_of_the_more_prompts():
    from finetune.evals.structured import check_answer

    more = prompt_table("more")
    back = next(p for c, _, p in more if p.startswith("Count backwards from"))
    b, a = _two_numbers(back)
    right = ", ".join(str(n) for n in range(b, a - 1, -1))
    assert check_answer(back, right) is None
    assert check_answer(back, ", ".join(str(n) for n in range(a, b + 1))) is not None
    work = next(p for c, s, p in more if c == "arithmetic" and s.startswith("-") and p.startswith("Work out"))
    x, y = (int(v) for v in work[len("Work out "):-1].split(" - "))
    assert check_answer(work, f"{x} - {y} = {x - y}.") is None
    assert check_answer(work, f"{x} - {y} = {x - y + 2}.") == f"want {x - y}, wrote {x - y + 2}"


def test_the_heldout_more_split_is_new_prompts_on_heldout_subjects_only():
    # development draws go on here once "heldout" is used up: the later sets' templates on held-out subjects, so none
    # of its prompts is a training prompt of either catalogue or asks about a subject a training prompt mentions
    from finetune.evals.natural import SPLITS as NATURAL_SPLITS
    from finetune.evals.natural import prompt_table as natural_table
    from finetune.evals.natural import split_of
    from finetune.evals.structured import HELDOUT_MORE, SPLITS, check_answer

    table = prompt_table(HELDOUT_MORE)
    prompts = [p for _, _, p in table]
    assert len(prompts) > 1500 and len(set(prompts)) == len(prompts)
    assert all(split_of(c, s) == "heldout" for c, s, _ in table)
    assert {c for c, _, _ in table} == set(CATEGORIES)
    trained = ({p for split in SPLITS if split != "heldout" for _, _, p in prompt_table(split)}
               | {p for split in NATURAL_SPLITS if split != "heldout" for _, _, p in natural_table(split)})
    heldout = {p for _, _, p in prompt_table("heldout")}
    assert not set(prompts) & trained and not set(prompts) & heldout
    train_subjects = {(c, s) for split in SPLITS if split != "heldout" for c, s, _ in prompt_table(split)}
    assert not {(c, s) for c, s, _ in table} & train_subjects
    assert structured_prompts(HELDOUT_MORE, 5, seed=1) == structured_prompts(HELDOUT_MORE, None, seed=1)[:5]
    # every prompt is tagged with its category, and the checker knows the sums it asks for
    tags = category_of()
    assert all(tags[p] == c for c, _, p in table)
    subject, add = next((s, p) for c, s, p in table if c == "arithmetic" and s.startswith("+"))
    x, y = (int(v) for v in subject[1:].split(","))
    assert check_answer(add, f"{x} + {y} = {x + y}") is None and check_answer(add, str(x + y + 1)) is not None
