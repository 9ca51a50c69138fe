"""finetune.evals.teaching: a candidate model's AR answers to the page's teaching prompts are checked the way
tests/test_teaching.py checks the shipped one, and a failing answer stops the command with exit status 1."""

import json

import pytest

from app import models
from finetune.evals import teaching


@pytest.fixture
def tiny_facts(monkeypatch):
    # tiny-mars's held-out examples stand in for the page's prompts: their answers are known exactly
    from finetune.tasks import make_examples

    ex = make_examples("heldout", 2, seed=0)
    facts = {e["messages"][0]["content"]: (e["messages"][1]["content"].split()[0],) for e in ex}
    monkeypatch.setattr(models, "TEACHING_FACTS", facts)
    return facts


def test_answers_holding_their_facts_pass_and_tau_1_is_ar(tiny_facts, tmp_path):
    out = tmp_path / "report.json"
    code = teaching.main(["--model", "tiny-mars", "--dtypes", "float32", "--taus", "1.0,0.5", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert code == 0 and [r["prompt"] for r in rows] == list(tiny_facts)
    for r in rows:
        assert r["problems"] == [] and r["dtype"] == "float32"
        at_1 = r["lossy"][0]
        assert at_1["tau"] == 1.0 and at_1["same_as_ar"] and at_1["tokens_per_forward"] == 1.0


def test_a_missing_fact_fails_with_exit_1_and_names_it(tiny_facts, monkeypatch, tmp_path, capsys):
    first = next(iter(tiny_facts))
    monkeypatch.setitem(models.TEACHING_FACTS, first, ("zebra-not-in-the-answer",))
    out = tmp_path / "report.json"
    assert teaching.main(["--model", "tiny-mars", "--dtypes", "float32", "--taus", "0.9", "--json", str(out)]) == 1
    rows = json.loads(out.read_text())
    assert rows[0]["problems"] == ["'zebra-not-in-the-answer' missing"] and rows[1]["problems"] == []
    assert "BAD ('zebra-not-in-the-answer' missing)" in capsys.readouterr().out


@pytest.mark.parametrize("taus", ["0.9,x", "0", "2"])
def test_bad_taus_are_refused_before_any_model_loads(taus):
    with pytest.raises(ValueError, match="--taus"):
        teaching.parse_args(["--model", "tiny-mars", "--taus", taus])


def test_the_lossy_answers_default_to_the_block_size_the_page_races_smollm2_mars_at(monkeypatch):
    """The check stands in for the page: its B follows app.models.DEFAULT_BLOCK_SIZES, unless --block-size says."""
    monkeypatch.setitem(models.DEFAULT_BLOCK_SIZES, "smollm2-mars", 2)
    assert teaching.parse_args(["--model", "x"]).block_size == 2
    monkeypatch.setitem(models.DEFAULT_BLOCK_SIZES, "smollm2-mars", 5)
    assert teaching.parse_args(["--model", "x"]).block_size == 5
    assert teaching.parse_args(["--model", "x", "--block-size", "4"]).block_size == 4
