"""The built-in task suite: determinism, split disjointness, exact scoring."""

import pytest

from finetune import tasks
from finetune.tasks import FAMILIES, check_answer, make_examples, split_of


def test_same_seed_same_examples_other_seed_differs():
    a = make_examples("train", 64, seed=3)
    b = make_examples("train", 64, seed=3)
    c = make_examples("train", 64, seed=4)
    assert a == b
    assert [e["messages"] for e in a] != [e["messages"] for e in c]


def test_every_family_appears_round_robin():
    exs = make_examples("heldout", 3 * len(FAMILIES), seed=0)
    assert [e["family"] for e in exs] == FAMILIES * 3
    for e in exs:
        assert [m["role"] for m in e["messages"]] == ["user", "assistant"]
        assert e["messages"][0]["content"] and e["messages"][1]["content"]


def test_train_and_heldout_never_share_a_question():
    train = {e["messages"][0]["content"] for seed in (0, 1) for e in make_examples("train", 4000, seed=seed)}
    held = [e["messages"][0]["content"] for e in make_examples("heldout", 800, seed=0)]
    assert len(set(held)) == len(held), "held-out questions repeat"
    assert not train & set(held)
    assert all(split_of(q) == "heldout" for q in held)
    assert all(split_of(q) == "train" for q in train)


def test_reference_response_passes_its_own_scorer():
    for e in make_examples("heldout", 400, seed=1):
        assert check_answer(e, e["messages"][1]["content"]), e


def test_answers_are_correct_arithmetic():
    for e in make_examples("train", 200, seed=2):
        q = e["messages"][0]["content"]
        if e["family"] == "addition":
            a, b = [int(t.strip("?.")) for t in q.replace("and", "+").split() if t.strip("?.").isdigit()]
            assert int(e["answer"]) == a + b
        elif e["family"] == "multiplication":
            a, b = [int(t.strip("?.")) for t in q.split() if t.strip("?.").isdigit()]
            assert int(e["answer"]) == a * b
        elif e["family"] == "sorting":
            nums = [int(t) for t in q.split(":")[1].split(",")]
            want = sorted(nums, reverse="descending" in q)
            assert e["answer"] == ", ".join(map(str, want))


@pytest.mark.parametrize("family", FAMILIES)
def test_wrong_or_missing_answers_are_rejected(family):
    e = next(x for x in make_examples("heldout", 2 * len(FAMILIES), seed=5) if x["family"] == family)
    good = e["messages"][1]["content"]
    assert check_answer(e, good)
    assert not check_answer(e, "")
    assert not check_answer(e, "I don't know")
    # corrupt the answer: change one character of it inside the response
    ans = e["answer"]
    i = max(k for k, ch in enumerate(ans) if ch.isalnum())
    bad_char = "7" if ans[i] != "7" else "3"
    bad = good.replace(ans, ans[:i] + bad_char + ans[i + 1:]) if family == "code" else good.replace(
        "Answer: " + ans, "Answer: " + ans[:i] + bad_char + ans[i + 1:])
    assert bad != good
    assert not check_answer(e, bad)


def test_answer_line_must_match_exactly_not_as_prefix():
    e = next(x for x in make_examples("heldout", 16, seed=0) if x["family"] == "addition")
    assert not check_answer(e, f"Answer: {e['answer']}0")
    assert check_answer(e, f"some steps\nAnswer: {e['answer']}  ")


def test_bad_arguments_raise_valueerror():
    with pytest.raises(ValueError, match="split"):
        make_examples("test", 3)
    with pytest.raises(ValueError, match="n="):
        make_examples("train", -1)
    with pytest.raises(ValueError, match="family"):
        check_answer({"family": "poetry", "answer": "x"}, "Answer: x")


def test_heldout_fraction_is_about_as_documented():
    qs = [tasks.GENERATORS[f](tasks.random.Random(i))[0] for i in range(2000) for f in ["addition"]]
    frac = sum(split_of(q) == "heldout" for q in qs) / len(qs)
    assert abs(frac - tasks.HELDOUT_PERCENT / 100) < 0.03


def test_tokenizer_special_tokens_digits_and_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from finetune.tokenizer import build_tokenizer

    build_tokenizer(vocab_size=320, n_examples=400).save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>" and tok.mask_token == "<|mask|>"
    assert len({tok.eos_token_id, tok.pad_token_id, tok.mask_token_id, tok.convert_tokens_to_ids("<|im_start|>")}) == 4
    pieces = tok.convert_ids_to_tokens(tok("Answer: 12345")["input_ids"])
    assert sum(any(c.isdigit() for c in p) for p in pieces) == 5  # one token per digit
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("x = 7\n    return -x")["input_ids"]
    assert tok.decode(ids) == "x = 7\n    return -x"


def test_every_worked_step_in_a_response_is_true_arithmetic():
    # The scaffolding teaches the working; a wrong intermediate fact would teach a wrong fact.
    import re

    fact = re.compile(r"(?<![\d.])(\d+(?: [+\-×÷] \d+)+) = (\d+)")
    checked = 0
    for e in make_examples("train", 800, seed=7):
        for lhs, rhs in fact.findall(e["messages"][1]["content"]):
            tokens = lhs.split()
            value = int(tokens[0])
            for op, b in zip(tokens[1::2], tokens[2::2]):
                value = (value + int(b) if op == "+" else value - int(b) if op == "-"
                         else value * int(b) if op == "×" else value // int(b))
            assert value == int(rhs), (e["family"], lhs, rhs)
            checked += 1
    assert checked > 1000


def test_sorting_buckets_hold_exactly_the_prompt_numbers_by_tens_digit():
    for e in make_examples("train", 400, seed=8, families=["sorting"]):
        q, resp = e["messages"][0]["content"], e["messages"][1]["content"]
        nums = [int(t) for t in q.split(":")[1].split(",")]
        desc = "descending" in q
        lines = resp.splitlines()[:-1]
        assert [ln.split(":")[0] for ln in lines] == [f"{d}0s" for d in (range(9, 0, -1) if desc else range(1, 10))]
        seen = []
        for ln in lines:
            tens = int(ln[0])
            body = ln.split(": ", 1)[1]
            got = [] if body == "none" else [int(x) for x in body.split(", ")]
            assert got == sorted((n for n in nums if n // 10 == tens), reverse=desc)
            seen += got
        assert ", ".join(map(str, seen)) == e["answer"]


def test_word_problem_totals_follow_the_story():
    for e in make_examples("train", 300, seed=9, families=["word_problem"]):
        q = e["messages"][0]["content"]
        words = q.replace(".", " ").replace("?", " ").split()
        total = int(words[2])
        for i, w in enumerate(words):
            if w.isdigit() and i > 2:
                total += -int(w) if words[i - 1] in ("away", "loses", "eats", "sells") else int(w)
        assert e["answer"] == str(total) and 10 <= total <= 99
        assert [ln for ln in e["messages"][1]["content"].splitlines() if ln.startswith("Now:")][-1] == f"Now: {total}"
