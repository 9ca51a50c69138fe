"""finetune.evals.evaluate: a τ sweep on a tiny random model gives well-formed rows; the Pareto HTML is written."""

import json

import pytest


@pytest.fixture(scope="module")
def tiny_lm():
    from mars_core import wrap_model
    from tests.tiny_fixtures import make_task_tokenizer, tiny_causal_lm

    tok = make_task_tokenizer()
    model = tiny_causal_lm(len(tok), kv_heads=4, tie=True, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
    return wrap_model(model, tok, name="tiny-random")


def test_sweep_rows_are_well_formed(tiny_lm):
    from finetune.evals.evaluate import SweepSettings, sweep
    from finetune.tasks import FAMILIES, make_examples

    examples = make_examples("heldout", len(FAMILIES), seed=0)
    seen = []
    rows = sweep(tiny_lm, examples, taus=[1.0, 0.5],
                 settings=SweepSettings(max_new_tokens=8, batch_size=4, timing_prompts=2),
                 progress=lambda f, msg: seen.append(f))
    assert [r["tau"] for r in rows] == [1.0, 0.5]
    assert seen == [0.5, 1.0]
    from finetune.tasks import check_answer
    from mars_core import DecodeConfig, generate

    for r in rows:
        assert r["model"] == "tiny-random" and r["n"] == len(FAMILIES)
        cfg = DecodeConfig(tau=r["tau"], max_new_tokens=8, mode="ar" if r["tau"] >= 1 else "mars")
        answers = [res.text for res in generate(tiny_lm, [e["messages"][0]["content"] for e in examples], cfg)]
        right = [check_answer(e, a) for e, a in zip(examples, answers)]   # the row's accuracy, scored again
        assert r["accuracy"] == pytest.approx(sum(right) / len(right))
        assert set(r["per_family"]) == set(FAMILIES)
        assert 1.0 <= r["tokens_per_forward"] <= 4.0
        assert r["speedup"] > 0 and r["ar_time_s"] > 0 and r["mars_time_s"] > 0
    # τ = 1 is one-token mode: exactly one token per forward
    assert rows[0]["tokens_per_forward"] == 1.0
    json.dumps(rows)  # JSON-serialisable as --json prints it


def test_sweep_passes_the_confidence_criterion(tiny_lm):
    # A random model spreads its probability thinly: its top-token probabilities sit at 0.008-0.009, exp(-entropy)
    # at 0.0034 and top-1 - top-2 margins at 0.002-0.004, so at τ = 0.005 only "prob" accepts masks.
    from finetune.evals.evaluate import SweepSettings, curve_label, sweep
    from finetune.tasks import make_examples
    from mars_core import DecodeConfig, generate

    examples = make_examples("heldout", 4, seed=0)
    prompts = [tiny_lm.encode(ex["messages"][0]["content"]) for ex in examples]
    tpf = {}
    for criterion in ("prob", "entropy", "margin"):
        (row,) = sweep(tiny_lm, examples, taus=[0.005],
                       settings=SweepSettings(max_new_tokens=8, batch_size=4, timing_prompts=0, criterion=criterion))
        assert row["criterion"] == criterion
        direct = generate(tiny_lm, prompts, DecodeConfig(tau=0.005, max_new_tokens=8, criterion=criterion))
        assert row["tokens_per_forward"] == sum(r.tokens_per_forward for r in direct) / len(direct)
        tpf[criterion] = row["tokens_per_forward"]
    assert tpf["prob"] > 1.5 and tpf["entropy"] == tpf["margin"] == 1.0
    assert curve_label({"model": "m", "criterion": "margin"}) == "m [margin]"
    assert curve_label({"model": "m", "criterion": "prob"}) == curve_label({"model": "m"}) == "m"
    with pytest.raises(ValueError, match="criterion"):
        sweep(tiny_lm, examples, taus=[0.5],
              settings=SweepSettings(max_new_tokens=4, timing_prompts=0, criterion="nope"))


def test_sweep_rejects_empty_examples(tiny_lm):
    from finetune.evals.evaluate import SweepSettings, sweep

    with pytest.raises(ValueError, match="examples"):
        sweep(tiny_lm, [], taus=[1.0])


def test_score_counts_exact_answers():
    from finetune.evals.evaluate import score
    from finetune.tasks import make_examples

    exs = make_examples("heldout", 4, seed=0)
    texts = [exs[0]["messages"][1]["content"], "Answer: nope", exs[2]["messages"][1]["content"], ""]
    overall, per_family = score(exs, texts)
    assert overall == 0.5
    assert per_family[exs[0]["family"]] == 1.0 and per_family[exs[1]["family"]] == 0.0


def test_pareto_html_and_table(tmp_path):
    from finetune.evals.evaluate import format_table, pareto_figure

    rows = [{"model": m, "tau": t, "accuracy": a, "per_family": {"addition": a}, "tokens_per_forward": x,
             "speedup": s} for m, t, a, x, s in [("a", 1.0, 0.9, 1.0, 0.95), ("a", 0.5, 0.7, 2.5, 2.2),
                                                  ("b", 1.0, 0.8, 1.0, None)]]
    fig = pareto_figure(rows)
    assert [tr.name for tr in fig.data] == ["a", "b"]
    assert list(fig.data[0].x) == [1.0, 2.5]
    out = tmp_path / "pareto.html"
    fig.write_html(out, include_plotlyjs=True)
    assert out.stat().st_size > 10_000 and "tokens per forward" in out.read_text()
    table = format_table(rows)
    assert "| a | 0.5 | 70.0% | 2.50 | 2.20× | 70% |" in table and "| b | 1 | 80.0% | 1.00 | – |" in table


def test_cli_writes_json_and_html(tmp_path, tiny_lm, capsys):
    from finetune.evals.evaluate import main

    tiny_lm.model.save_pretrained(tmp_path / "m")
    tiny_lm.tokenizer.save_pretrained(tmp_path / "m")
    rows = main(["--models", str(tmp_path / "m"), "--names", "tiny", "--n", "2", "--taus", "1.0", "0.9",
                 "--max-new-tokens", "4", "--timing-prompts", "1", "--threads", "1",
                 "--json", str(tmp_path / "rows.json"), "--html", str(tmp_path / "p.html")])
    saved = json.loads((tmp_path / "rows.json").read_text())
    assert saved == rows and [(r["model"], r["tau"]) for r in saved] == [("tiny", 1.0), ("tiny", 0.9)]
    assert {"model", "tau", "accuracy", "tokens_per_forward", "speedup"} <= set(saved[0])
    assert (tmp_path / "p.html").stat().st_size > 10_000
    assert "| tiny | 0.9 |" in capsys.readouterr().out
    rows = main(["--models", str(tmp_path / "m"), "--names", "tiny", "--n", "2", "--taus", "0.9",
                 "--criteria", "prob", "entropy", "--max-new-tokens", "4", "--timing-prompts", "0",
                 "--html", str(tmp_path / "c.html")])
    assert [(r["model"], r["criterion"]) for r in rows] == [("tiny", "prob"), ("tiny", "entropy")]
    assert "| tiny [entropy] | 0.9 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # argparse rejects an unknown criterion
        main(["--models", str(tmp_path / "m"), "--criteria", "nope"])
    with pytest.raises(ValueError, match="--names"):
        main(["--models", str(tmp_path / "m"), "--names", "a", "b", "--n", "1"])


def test_lossless_rows_score_exactly_ar_and_report_draft_acceptance():
    # Verify mode's answers are AR's, so its accuracy equals the τ = 1 row's at every τ, while tiny-mars
    # still writes several tokens per forward; the rows carry the per-slot draft acceptance.
    from finetune.evals.evaluate import SweepSettings, curve_label, sweep
    from finetune.tasks import make_examples
    from mars_core import load_model

    lm = load_model("tiny-mars", device="cpu")
    examples = make_examples("heldout", 24, seed=11)
    (ar,) = sweep(lm, examples, taus=[1.0], settings=SweepSettings(max_new_tokens=64, timing_prompts=0))
    rows = sweep(lm, examples, taus=[0.5, 0.9],
                 settings=SweepSettings(max_new_tokens=64, timing_prompts=0, mode="verify"))
    for r in rows:
        assert r["mode"] == "verify" and curve_label(r) == "tiny-mars (lossless)"
        assert r["accuracy"] == ar["accuracy"] and r["per_family"] == ar["per_family"]
        assert r["tokens_per_forward"] > 1.5
        assert len(r["draft_acceptance"]) == 3 and all(a is None or 0 <= a <= 1 for a in r["draft_acceptance"])
        assert r["draft_acceptance"][0] is not None
    tree = sweep(lm, examples, taus=[0.9],
                 settings=SweepSettings(max_new_tokens=64, timing_prompts=0, mode="verify", draft_layout="tree"))
    assert curve_label(tree[0]) == "tiny-mars (lossless, tree)" and tree[0]["accuracy"] == ar["accuracy"]
    assert tree[0]["positions_per_forward"] > rows[1]["positions_per_forward"]
