"""finetune.evals.paired: two devscore lines compared prompt by prompt, with paired bootstrap intervals."""

import json
import subprocess
import sys

import pytest

from finetune.evals import paired
from finetune.evals.devscore import categories_of, dev_prompts, score_model


def record(model, prompts, tokens, forwards, answers, ar, cats=None):
    rec = {"model": model, "prompts": prompts, "tokens": {"ar": list(forwards), "tau0.9": tokens},
           "forwards": {"ar": list(forwards), "tau0.9": forwards}, "answers": {"ar": ar, "tau0.9": answers}}
    if cats is not None:
        rec["categories"] = cats
    return rec


PROMPTS = ["p0", "p1", "p2", "p3"]
CATS = ["explain", "define", "enumerate", "arithmetic"]   # two natural, two structured


def test_the_difference_is_the_candidates_numbers_less_the_bases_per_group():
    base = record("A", PROMPTS, [10, 12, 20, 9], [10, 10, 10, 9], ["a", "b", "c", "d"], ["a", "x", "c", "d"], CATS)
    cand = record("B", PROMPTS, [15, 12, 30, 9], [10, 8, 10, 9], ["a", "b", "c", "y"], ["a", "b", "c", "d"], CATS)
    rows = {(r["setting"], r["group"]): r for r in paired.compare(base, cand)}
    a_tpf, b_tpf = [1.0, 1.2, 2.0, 1.0], [1.5, 1.5, 3.0, 1.0]
    a_same, b_same = [1, 0, 1, 1], [1, 1, 1, 0]
    for group, idx in (("all", [0, 1, 2, 3]), ("natural", [0, 1]), ("structured", [2, 3])):
        r = rows[("tau0.9", group)]
        assert r["n"] == len(idx)
        assert r["tpf_base"] == pytest.approx(sum(a_tpf[i] for i in idx) / len(idx))
        assert r["tpf_cand"] == pytest.approx(sum(b_tpf[i] for i in idx) / len(idx))
        assert r["tpf_diff"] == pytest.approx(r["tpf_cand"] - r["tpf_base"])
        assert r["same_diff"] == pytest.approx(sum(b_same[i] - a_same[i] for i in idx) / len(idx))
        assert r["tpf_lo"] <= r["tpf_diff"] <= r["tpf_hi"] and r["same_lo"] <= r["same_diff"] <= r["same_hi"]
    # a model against itself: no difference, and no interval around it
    same = {(r["setting"], r["group"]): r for r in paired.compare(base, base)}
    assert all(r["tpf_diff"] == r["tpf_lo"] == r["tpf_hi"] == 0 for r in same.values())


def test_four_times_the_prompts_give_about_half_the_interval():
    import random

    rng = random.Random(1)
    a = [1 + rng.random() for _ in range(60)]
    b = [x + rng.gauss(0.05, 0.2) for x in a]
    _, lo, hi = paired.paired_interval(a, b, list(range(60)))
    _, lo4, hi4 = paired.paired_interval(a * 4, b * 4, list(range(240)))
    assert 0.4 < (hi4 - lo4) / (hi - lo) < 0.6


def test_models_scored_on_different_prompts_are_refused_in_one_line(tmp_path):
    base = record("A", PROMPTS, [1] * 4, [1] * 4, list("abcd"), list("abcd"))
    cand = record("B", ["q"] + PROMPTS[1:], [1] * 4, [1] * 4, list("abcd"), list("abcd"))
    with pytest.raises(ValueError, match="A and B were scored on different prompts"):
        paired.compare(base, cand)
    (tmp_path / "a.jsonl").write_text(json.dumps(base) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps(cand) + "\n")
    proc = subprocess.run([sys.executable, "-m", "finetune.evals.paired", str(tmp_path / "a.jsonl"),
                           str(tmp_path / "b.jsonl")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "different prompts" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "finetune.evals.paired", str(tmp_path / "a.jsonl"),
                           str(tmp_path / "a.jsonl"), "--candidate-model", "C"], capture_output=True, text=True)
    assert proc.returncode == 2 and "no line for model 'C'" in proc.stderr and "'A'" in proc.stderr


def test_a_line_picks_its_model_and_the_table_prints_each_setting(tmp_path):
    lines = [record(m, PROMPTS, [2, 2, 2, 2], [1, 2, 1, 2], list("abcd"), list("abcd"), CATS) for m in ("A", "B")]
    path = tmp_path / "both.jsonl"
    path.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    assert paired.read_scores(str(path), "A")["model"] == "A" and paired.read_scores(str(path))["model"] == "B"
    text = paired.format_rows("A", "B", paired.compare(lines[0], lines[1]))
    assert "| tau0.9 | all | 4 | 1.500 → 1.500 | +0.000 (+0.000 .. +0.000) | 100% → 100% |" in text
    assert "16 prompts halve these" in text


@pytest.mark.parametrize("n_natural, n_structured, seed, report", [(5, 4, 77, False), (3, 6, 1, True),
                                                                    (0, 3, 78, False)])
def test_an_older_line_without_categories_gets_them_back_from_its_seed(n_natural, n_structured, seed, report):
    items = dev_prompts(n_natural, n_structured, seed, report=report)
    assert categories_of([p for _, p in items], seed) == [c for c, _ in items]


def test_it_reads_what_devscore_writes():
    from mars_core import load_model

    lm = load_model("tiny-mars", dtype="float32")
    items = [("enumerate", "1 2 3 4 5"), ("arithmetic", "12+34="), ("explain", "count: a b c d"),
             ("define", "9 8 7 6")]
    res = score_model(lm, items, [0.6], block_size=4, max_new_tokens=24, batch_size=2)
    rec = {"model": "tiny-mars", "prompts": [p for _, p in items], "categories": [c for c, _ in items], **res}
    rows = {(r["setting"], r["group"]): r for r in paired.compare(rec, rec)}
    for g in ("all", "natural", "structured"):   # devscore's own summary, number for number
        for setting in ("tau0.6", "tree"):
            assert rows[(setting, g)]["tpf_base"] == pytest.approx(res["summary"][g][f"{setting}_tpf"])
        assert rows[("tau0.6", g)]["same_base"] == pytest.approx(res["summary"][g]["tau0.6_same"])


# ----------------------------------------------------------------------------- one-token quality (--quality)

def quality_row(model, tau, correct, passed, questions=("q0", "q1", "q2", "q3"), tasks=("HumanEval/0", "HumanEval/1")):
    return {"model": model, "tau": tau, "mode": "mars", "suite": "natural", "checkable_questions": list(questions),
            "checkable_correct": list(correct), "checkable_accuracy": sum(correct) / len(correct),
            "humaneval_tasks": list(tasks), "humaneval_passed": list(passed)}


def test_quality_differences_are_the_candidates_accuracy_less_the_bases_question_by_question():
    base = [quality_row("A", 1.0, [1, 0, 1, 1], [1, 0]), quality_row("A", 0.97, [1, 0, 1, 0], [1, 0])]
    cand = [quality_row("B", 1.0, [1, 1, 1, 0], [1, 1]), quality_row("B", 0.9, [0, 0, 0, 0], [0, 0])]
    rows = {(r["tau"], r["measure"]): r for r in paired.compare_quality(base, cand)}
    assert set(rows) == {(1.0, "checkable"), (1.0, "HumanEval")}   # only the τ both have
    chk, he = rows[(1.0, "checkable")], rows[(1.0, "HumanEval")]
    assert (chk["n"], chk["base"], chk["cand"], chk["diff"]) == (4, 0.75, 0.75, 0.0)
    assert (he["n"], he["base"], he["cand"], he["diff"]) == (2, 0.5, 1.0, 0.5)
    # per question: one gained and one lost, so resamples spread both ways around 0
    assert chk["lo"] < 0 < chk["hi"] and he["lo"] <= he["diff"] <= he["hi"]
    itself = paired.compare_quality(base, base)
    assert all(r["diff"] == r["lo"] == r["hi"] == 0 for r in itself)
    text = paired.format_quality("A", "B", paired.compare_quality(base, cand))
    assert "| 1 | mars | HumanEval | 2 | 50.0% → 100.0% | +50.0 pts" in text


def test_quality_of_different_questions_or_old_rows_is_a_one_line_error(tmp_path):
    base = [quality_row("A", 1.0, [1, 0, 1, 1], [1, 0])]
    other = [quality_row("B", 1.0, [1, 0, 1, 1], [1, 0], questions=("q0", "q1", "q2", "x"))]
    with pytest.raises(ValueError, match="were asked different checkable questions"):
        paired.compare_quality(base, other)
    (tmp_path / "a.json").write_text(json.dumps(base))
    (tmp_path / "b.json").write_text(json.dumps({"partial": True, "rows": other}))
    proc = subprocess.run([sys.executable, "-m", "finetune.evals.paired", "--quality", str(tmp_path / "a.json"),
                           str(tmp_path / "b.json")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "different checkable questions" in proc.stderr
    old = [{k: v for k, v in base[0].items() if k not in ("checkable_correct", "humaneval_passed")}]
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match="no per-question verdicts"):
        paired.read_quality(str(tmp_path / "old.json"))
    (tmp_path / "two.json").write_text(json.dumps(base + [quality_row("C", 1.0, [0] * 4, [0, 0])]))
    with pytest.raises(ValueError, match="holds 2 models"):
        paired.read_quality(str(tmp_path / "two.json"))
    assert paired.read_quality(str(tmp_path / "two.json"), "C")[0]["model"] == "C"


def test_quality_reads_what_evaluate_writes(tmp_path):
    from finetune.evals import evaluate

    out = tmp_path / "q.json"
    evaluate.main(["--suite", "natural", "--models", "tiny-mars", "--n-natural", "2", "--n-checkable", "6",
                   "--humaneval", "0", "--taus", "1", "0.5", "--seed", "3", "--max-new-tokens", "8",
                   "--json", str(out)])
    rows = paired.read_quality(str(out))
    compared = {r["tau"]: r for r in paired.compare_quality(rows, rows)}
    assert set(compared) == {1.0, 0.5}
    for r in rows:   # evaluate's own accuracy, recomputed from the verdicts it recorded
        assert compared[r["tau"]]["base"] == pytest.approx(r["checkable_accuracy"])
        assert len(r["checkable_correct"]) == len(r["checkable_questions"]) == 6
