"""The one timing harness (mars_core.tools.timing) and the lossless layout it picks (mars_core.tools.fastest)."""
from __future__ import annotations

import pytest
import torch

from mars_core.tools import fastest, timing


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


def test_bench_races_the_fastest_lossless_layout_with_its_own_block_size(monkeypatch):
    from app import models
    from mars_core.tools.bench import BenchSettings, bench
    lm = models.get_model("tiny-mars")
    # make one mask + runner-ups the fastest whatever the machine: the others' decodes cost 1 s more on the clock
    real = fastest.generate
    extra = [0.0]

    def slowed(lm_, prompts, cfg):
        if (cfg.draft_layout, cfg.block_size) != ("tree", 2):
            extra[0] += 1.0
        return real(lm_, prompts, cfg)
    monkeypatch.setattr(fastest, "generate", slowed)
    monkeypatch.setattr("mars_core.tools.bench.fastest_lossless",
                        lambda *a, **k: fastest.fastest_lossless(*a, **{**k, "clock": lambda: extra[0]}))
    said = []
    rows = bench(lm, ["Sort in descending order: 91, 57, 59, 87"],
                 BenchSettings(batch_sizes=(1,), tau=0.6, block_size=4, max_new_tokens=24, repeats=1, reference=False,
                               transformers=False, draft_layout="fastest"), progress=said.append)
    assert any("one mask + runner-ups" in s and s.startswith("lossless drafts: one mask + runner-ups") for s in said)
    assert rows[0].verify_equals_ar is True
    assert len(rows[0].draft_acceptance) == 1   # one mask a group: one draft slot


def test_cli_fastest_layout_says_which_and_writes_ars_answer():
    import subprocess
    import sys
    prompt = "Sort in descending order: 91, 57, 59, 87"
    common = ["-m", "mars_core", "generate", "--model", "tiny-mars", "--prompt", prompt, "--max-new-tokens", "24",
              "--threads", "1", "--json"]
    fast = subprocess.run([sys.executable, *common, "--mode", "verify", "--tau", "0.7", "--draft-layout", "fastest"],
                          capture_output=True, text=True, timeout=300)
    ar = subprocess.run([sys.executable, *common, "--mode", "ar"], capture_output=True, text=True, timeout=300)
    assert fast.returncode == 0 and ar.returncode == 0, fast.stderr[-500:] + ar.stderr[-500:]
    import json
    f, a = json.loads(fast.stdout.splitlines()[-1]), json.loads(ar.stdout.splitlines()[-1])
    assert f["token_ids"] == a["token_ids"] and f["forwards"] < a["forwards"]
    plain = subprocess.run([sys.executable, *common[:-1], "--mode", "verify", "--tau", "0.7", "--draft-layout",
                            "fastest"], capture_output=True, text=True, timeout=300)
    assert "lossless drafts:" in plain.stderr and "the fastest here for this model" in plain.stderr
