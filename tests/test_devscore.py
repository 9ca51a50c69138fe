"""finetune.evals.devscore: the per-group numbers it prints are recomputed here from the per-answer record."""

import pytest

from finetune.evals.devscore import dev_prompts, format_table, score_model


@pytest.fixture(scope="module")
def scored():
    from mars_core import load_model

    lm = load_model("tiny-mars", dtype="float32")
    items = [("enumerate", "1 2 3 4 5"), ("arithmetic", "12+34="), ("explain", "count: a b c d"),
             ("define", "9 8 7 6")]
    return score_model(lm, items, [1.0, 0.6], block_size=4, max_new_tokens=24, batch_size=2), items


def test_each_groups_tokens_per_forward_and_share_equal_to_ar_follow_from_the_answers(scored):
    res, items = scored
    groups = {"all": [0, 1, 2, 3], "structured": [0, 1], "natural": [2, 3], "enumerate": [0], "explain": [2]}
    for g, idx in groups.items():
        row = res["summary"][g]
        assert row["n"] == len(idx)
        for name in ("tau1.0", "tau0.6", "tree"):
            tpf = sum(res["tokens"][name][i] / res["forwards"][name][i] for i in idx) / len(idx)
            same = sum(res["answers"][name][i] == res["answers"]["ar"][i] for i in idx) / len(idx)
            assert row[f"{name}_tpf"] == pytest.approx(tpf)
            assert row[f"{name}_same"] == pytest.approx(same)


def test_tau_one_is_ar_and_lossless_tree_gives_ars_answer_in_fewer_forwards(scored):
    res, _ = scored
    assert res["answers"]["tau1.0"] == res["answers"]["ar"] == res["answers"]["tree"]
    assert res["forwards"]["tau1.0"] == res["forwards"]["ar"]
    assert sum(res["forwards"]["tree"]) < sum(res["forwards"]["ar"])
    assert res["summary"]["all"]["tau1.0_same"] == 1.0


def test_the_table_prints_the_summary():
    summary = {"all": {"n": 2, "tau0.9_tpf": 1.25, "tau0.9_same": 0.5, "tau0.9_loops": 1,
                       "tree_tpf": 2.0, "tree_same": 1.0, "tree_loops": 0}}
    table = format_table("m", summary, [0.9])
    assert "| all | 2 | 1.250 (50%, 1) | 2.000 (100%, 0) |" in table


def test_development_scores_refuse_the_report_seed():
    with pytest.raises(ValueError, match="report seed"):
        dev_prompts(2, 2, seed=1)
    assert dev_prompts(2, 2, seed=3, report=True) == dev_prompts(2, 2, seed=1, report=True)


def test_no_development_prompt_is_a_report_prompt():
    from finetune.evals.devscore import REPORT_RESERVE

    report = {p for _, p in dev_prompts(REPORT_RESERVE, REPORT_RESERVE, seed=0, report=True)}
    for seed in (77, 78, 5):
        dev = [p for _, p in dev_prompts(200, 200, seed=seed)]
        assert len(dev) == len(set(dev)) == 400 and not set(dev) & report, seed


def test_a_development_sample_is_its_seeds_order_with_the_report_prompts_left_out():
    from finetune.evals.natural import natural_prompts

    from finetune.evals.devscore import report_reserve

    reserve = report_reserve()
    order = natural_prompts("heldout", 60, seed=77)
    assert any(p in reserve for p in order[:40])   # the overlap this rule removes is real for seed 77
    want = [p for p in order if p not in reserve][:40]
    assert [p for _, p in dev_prompts(40, 0, seed=77)] == want


def test_the_report_sample_cannot_outgrow_the_prompts_development_leaves_out():
    from finetune.evals.devscore import REPORT_RESERVE

    with pytest.raises(ValueError, match=f"at most {REPORT_RESERVE} of each"):
        dev_prompts(REPORT_RESERVE + 1, 2, seed=0, report=True)
    with pytest.raises(ValueError, match="--natural 10000: the held-out splits have"):
        dev_prompts(10000, 2, seed=77)


@pytest.mark.parametrize("report", [False, True])
def test_each_prompt_is_grouped_by_the_list_it_was_drawn_from(report):
    """A prompt text in both catalogues (a natural `python` one is also a structured `code` one) counts as natural
    when drawn as natural: asking for 48 natural and 40 structured gives groups of 48 and 40."""
    from finetune.evals.devscore import group_of

    items = dev_prompts(48, 40, seed=1 if report else 77, report=report)
    groups = [group_of(c) for c, _ in items]
    assert groups == ["natural"] * 48 + ["structured"] * 40


def test_a_fresh_draw_leaves_out_the_prompts_of_earlier_lines(tmp_path):
    import json

    from finetune.evals.devscore import excluded_prompts

    seen = dev_prompts(10, 8, seed=77)
    path = tmp_path / "seen.jsonl"
    path.write_text(json.dumps({"model": "m", "prompts": [p for _, p in seen]}) + "\n\n")
    fresh = dev_prompts(10, 8, seed=77, exclude=excluded_prompts([str(path)]))
    assert not {p for _, p in fresh} & {p for _, p in seen}
    # the next prompts of the same order, each group the size asked for
    longer = dev_prompts(20, 16, seed=77)
    assert fresh == longer[10:20] + longer[28:36]
    with pytest.raises(ValueError, match="with --report"):
        dev_prompts(4, 4, seed=1, report=True, exclude=frozenset(["x"]))
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a devscore --out line \(no prompts\)"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"model": "m"}\n')
        excluded_prompts([str(bad)])
    with pytest.raises(ValueError, match="no such file"):
        excluded_prompts([str(tmp_path / "none.jsonl")])


@pytest.mark.parametrize("kind", ["natural", "structured"])
def test_development_draws_go_on_into_the_heldout_more_prompts_and_earlier_draws_stay_as_they_were(kind):
    import importlib

    from finetune.evals import devscore

    catalogue = importlib.import_module(f"finetune.evals.{kind}")
    draw = getattr(catalogue, f"{kind}_prompts")
    reserve = devscore.report_reserve()
    first = [p for p in draw("heldout", None, seed=77) if p not in reserve]
    order = getattr(devscore, f"development_{kind}")(77)
    assert order[:len(first)] == first   # every draw made before the new prompts: a prefix, unchanged
    assert order[len(first):] == draw(catalogue.HELDOUT_MORE, None, seed=77)
    sizes = (12, 0) if kind == "natural" else (0, 12)
    assert [p for _, p in dev_prompts(*sizes, seed=77)] == first[:12]
    # a fresh draw past the held-out prompts reaches the new ones, each with its category (more than five natural
    # categories in twelve prompts; all five structured ones)
    items = dev_prompts(*sizes, seed=77, exclude=frozenset(first))
    more = {p: c for c, _, p in catalogue.prompt_table(catalogue.HELDOUT_MORE)}
    assert [(more[p], p) for _, p in items] == items
    categories = {c for c, _ in items}
    assert (len(categories) > 6) if kind == "natural" else (len(categories) == 5)
