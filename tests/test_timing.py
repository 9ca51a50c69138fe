"""The one timing harness (mars_core.timing) and the lossless layout it picks (mars_core.fastest)."""
from __future__ import annotations

import pytest
import torch

from mars_core import fastest, timing


def test_alternate_rotates_the_order_every_repeat_and_times_each_run():
    order, now = [], [0.0]

    def run(name, cost):
        def go():
            order.append(name)
            now[0] += cost
            return name
        return go
    steps = list(timing.alternate({"a": run("a", 1.0), "b": run("b", 2.0), "c": run("c", 3.0)}, 3,
                                  clock=lambda: now[0], warmup=True))
    assert order == ["a", "b", "c"] + ["a", "b", "c", "b", "c", "a", "c", "a", "b"]   # warm-up, then rotating
    done, times, results = steps[-1]
    assert [s[0] for s in steps] == [1, 2, 3]
    assert times == {"a": [1.0] * 3, "b": [2.0] * 3, "c": [3.0] * 3} and results["b"] == ["b"] * 3


def test_spread_is_the_median_with_min_and_max():
    s = timing.Spread.of([3.0, 1.0, 10.0, 2.0, 4.0])
    assert (s.median, s.low, s.high, s.n) == (3.0, 1.0, 10.0, 5)
    with pytest.raises(ValueError, match="no measurements"):
        timing.Spread.of([])


def test_the_thread_clock_only_where_one_cpu_thread_does_all_the_work():
    cpu = torch.device("cpu")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert timing.pick_clock("auto", cpu) == "thread"
        torch.set_num_threads(2)
        assert timing.pick_clock("auto", cpu) == "wall"
        with pytest.raises(ValueError, match="one torch thread"):
            timing.pick_clock("thread", cpu)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="unknown"):
        timing.pick_clock("sundial", cpu)


def test_the_fastest_lossless_layout_is_the_one_whose_fastest_run_was_fastest(monkeypatch):
    # a fake clock: one mask a group takes 1 s, one mask + runner-ups 2 s, all of B's masks 3 s then 0.5 s
    now, runs = [0.0], []
    costs = {("linear", 4): [3.0, 0.5], ("linear", 2): [1.0, 1.0], ("tree", 2): [2.0, 2.0]}

    def fake_generate(lm, prompts, cfg):
        key = (cfg.draft_layout, cfg.block_size)
        runs.append((key, cfg.tree_width, cfg.tau, cfg.mode, cfg.max_new_tokens, prompts))
        now[0] += costs[key][sum(r[0] == key for r in runs) - 1]
        return []
    monkeypatch.setattr(fastest, "generate", fake_generate)
    choice = fastest.fastest_lossless(object(), [1, 2, 3], 0.7, 4, clock=lambda: now[0])
    assert choice.pick == fastest.LosslessLayout("linear", 4)            # its best run, 0.5 s, wins
    assert choice.seconds == {fastest.LosslessLayout("linear", 4): 0.5, fastest.LosslessLayout("linear", 2): 1.0,
                              fastest.LosslessLayout("tree", 2, 3): 2.0}
    assert len(runs) == 6 and all(r[2:] == (0.7, "verify", fastest.CALIBRATE_TOKENS, [[1, 2, 3]]) for r in runs)
    assert "all 3 masks a group" in choice.why and "500 ms" in choice.why and "2000 ms" in choice.why


def test_no_layout_is_timed_for_one_token_mode():
    with pytest.raises(ValueError, match="draft nothing"):
        fastest.fastest_lossless(object(), [1], 1.0, 4)


def test_every_fastest_candidate_decodes_exactly_ar():
    from app import models
    from mars_core import DecodeConfig, generate
    lm = models.get_model("tiny-mars")
    ids = lm.encode("Sort in descending order: 91, 57, 59, 87")
    ar = generate(lm, [ids], DecodeConfig(mode="ar", max_new_tokens=24))[0].token_ids
    for c in fastest.candidates(4):
        assert generate(lm, [ids], c.config(0.6, 24))[0].token_ids == ar, c
