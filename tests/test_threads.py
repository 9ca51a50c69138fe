"""--threads auto never oversubscribes: 1 on <= 2 cores, else the idle cores; a bad value is named."""
import pytest
import torch

from mars_core.engine import threads


@pytest.mark.parametrize("cores, load, want", [(1, 0.0, 1), (2, 0.0, 1), (8, 0.2, 7), (8, 6.5, 1), (16, 12.0, 4),
                                               (4, 9.0, 1)])
def test_auto_uses_the_idle_cores_and_one_on_small_machines(monkeypatch, cores, load, want):
    monkeypatch.setattr(threads, "usable_cores", lambda: cores)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (load, load, load))
    assert threads.parse_threads("auto") == want


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5", ""])
def test_bad_thread_counts_are_named(value):
    with pytest.raises(ValueError, match="--threads"):
        threads.parse_threads(value)


def test_oversubscribing_the_idle_cores_warns_and_one_thread_does_not(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "idle_cores", lambda: 1.0)
    try:
        with pytest.warns(UserWarning, match="only ~1.0 cores are idle"):
            assert threads.set_threads("2") == 2
        assert torch.get_num_threads() == 2
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert threads.set_threads("1") == 1
    finally:
        torch.set_num_threads(before)


def test_cli_refuses_a_bad_thread_count_before_loading(capsys):
    from mars_core.tools.cli import main

    assert main(["generate", "--model", "tiny-mars", "--prompt", "hi", "--threads", "0"]) == 2
    assert "--threads '0' must be an integer >= 1, or auto" in capsys.readouterr().err
