"""dtype="auto" on a CPU: the fastest exact format. float32 for every model, except that a model cleared for w8a8
(its quality measured and kept) gets whichever of the two has the faster one-token forward (a tie within 3% goes
to the cheaper 7-row forward), measured once and cached per model file and CPU; bf16 is never chosen."""
import json

import pytest
import torch

from mars_core.engine import dtype_probe


@pytest.fixture
def probe(monkeypatch, tmp_path):
    monkeypatch.setenv("MARS_CACHE_DIR", str(tmp_path))
    calls = []

    def fake(models, timings):
        calls.append(sorted(models))
        return timings

    return tmp_path, calls, fake


@pytest.mark.parametrize("timings, want", [
    ({("float32", 1): 60.0, ("float32", 7): 120.0, ("w8a8", 1): 50.0, ("w8a8", 7): 55.0}, "w8a8"),
    ({("float32", 1): 50.0, ("float32", 7): 120.0, ("w8a8", 1): 60.0, ("w8a8", 7): 62.0}, "float32"),
    ({("float32", 1): 60.0, ("float32", 7): 120.0, ("w8a8", 1): 61.0, ("w8a8", 7): 65.0}, "w8a8"),
    ({("float32", 1): 61.0, ("float32", 7): 64.0, ("w8a8", 1): 60.0, ("w8a8", 7): 65.0}, "float32"),
])
def test_the_faster_one_token_forward_decides_and_a_tie_goes_to_the_cheaper_step(probe, monkeypatch, tmp_path,
                                                                                  timings, want):
    cache, calls, fake = probe
    monkeypatch.setattr(dtype_probe, "forward_ms", lambda models: fake(models, timings))
    built = []
    nets = {name: (lambda name=name: built.append(name) or torch.nn.Linear(4, 4)) for name in ("float32", "w8a8")}
    # the model folder is not the cache folder: writing the cache must not change the model's key
    where = tmp_path / "model"
    where.mkdir()
    (where / "model.safetensors").write_bytes(b"weights")
    choice, net = dtype_probe.choose_cpu_format(nets, str(where), n_params=10**9)
    assert choice == want and isinstance(net, torch.nn.Linear) and built == ["float32", "w8a8"]
    saved = json.loads((cache / "dtype-probe.json").read_text())
    assert [v["dtype"] for v in saved.values()] == [want]
    # measured once: the second call reads the cache and builds nothing
    assert dtype_probe.choose_cpu_format(nets, str(where), n_params=10**9) == (want, None)
    assert len(calls) == 1 and len(built) == 2


def test_small_models_and_single_candidates_are_chosen_without_probing(probe, monkeypatch, tmp_path):
    cache, calls, fake = probe
    monkeypatch.setattr(dtype_probe, "forward_ms", lambda models: fake(models, {}))
    nets = {"float32": lambda: torch.nn.Linear(4, 4), "w8a8": lambda: torch.nn.Linear(4, 4)}
    assert dtype_probe.choose_cpu_format(nets, str(tmp_path), n_params=16) == ("float32", None)     # < MIN_PARAMS
    one = {"float32": nets["float32"]}
    assert dtype_probe.choose_cpu_format(one, str(tmp_path), n_params=10**9) == ("float32", None)
    assert calls == [] and not (cache / "dtype-probe.json").exists()


def test_auto_serves_float32_and_w8a8_only_to_a_model_cleared_for_it(monkeypatch, tmp_path):
    from mars_core import load_model
    from mars_core.models import formats

    monkeypatch.setenv("MARS_CACHE_DIR", str(tmp_path))
    lm = load_model("tiny-mars", device="cpu")
    assert lm.weight_format == "float32" and lm.backend == "lean"
    monkeypatch.setattr(formats, "W8A8_KEEPS_QUALITY", ("tiny-mars",))
    monkeypatch.setattr(dtype_probe, "MIN_PARAMS", 1)
    timed = {}
    monkeypatch.setattr(dtype_probe, "forward_ms", lambda nets: timed.update(nets) or {
        ("float32", 1): 2.0, ("float32", 7): 3.0, ("w8a8", 1): 1.0, ("w8a8", 7): 1.5})
    cleared = load_model("tiny-mars", device="cpu")
    assert cleared.weight_format == "w8a8" and cleared.net is timed["w8a8"]   # the probed forward is the one served
    again = load_model("tiny-mars", device="cpu")                           # the cached choice: only w8a8 is built
    assert again.weight_format == "w8a8" and again.net is not timed["w8a8"] and again.net.format == "w8a8"
    assert load_model("tiny-mars", device="cpu", backend="hf").weight_format == "float32"   # w8a8 exactness is lean's


def test_auto_times_w8a16_only_for_a_model_cleared_for_it_and_probes_again_for_a_new_candidate_set(monkeypatch,
                                                                                                     tmp_path):
    from mars_core import load_model
    from mars_core.engine import avx2
    from mars_core.models import formats

    if not avx2.WIDE.load():
        pytest.skip(f"w8a16's kernel is not available here ({avx2.WIDE.why_not()})")
    monkeypatch.setenv("MARS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(formats, "W8A8_KEEPS_QUALITY", ("tiny-mars",))
    monkeypatch.setattr(dtype_probe, "MIN_PARAMS", 1)
    timed = {}
    monkeypatch.setattr(dtype_probe, "forward_ms", lambda nets: timed.update({n: None for n in nets}) or {
        ("float32", 1): 2.0, ("float32", 7): 3.0, ("w8a8", 1): 1.0, ("w8a8", 7): 1.5, ("w8a16", 1): 1.01,
        ("w8a16", 7): 1.2})
    assert load_model("tiny-mars", device="cpu").weight_format == "w8a8"   # w8a16 not cleared: not timed
    assert sorted(timed) == ["float32", "w8a8"]
    monkeypatch.setattr(formats, "W8A16_KEEPS_QUALITY", ("tiny-mars",))
    timed.clear()
    lm = load_model("tiny-mars", device="cpu")   # the cached choice was made among fewer: probed again
    assert sorted(timed) == ["float32", "w8a16", "w8a8"]
    assert lm.weight_format == "w8a16" and lm.net.kernel == "avx2w"   # one-row tie within 3%: the cheaper 7 rows


def test_forward_ms_times_every_model_and_row_count(tiny_lm):
    ms = dtype_probe.forward_ms({"a": tiny_lm.net}, rows=(1, 3), rounds=2, context=8)   # either backend
    assert set(ms) == {("a", 1), ("a", 3)} and all(v > 0 for v in ms.values())


def test_load_model_auto_keeps_the_tiny_models_in_fp32():
    from mars_core import load_model

    assert load_model("tiny-mars", device="cpu").model.dtype == torch.float32


def _probe_entry(lm, cache, ms_1, ms_7):
    key = dtype_probe._key(lm.path, threads=1)
    (cache / "dtype-probe.json").write_text(json.dumps({key: {"dtype": "float32", "float32_ms_1_rows": ms_1,
                                                              "float32_ms_7_rows": ms_7}}))


def test_decoding_far_slower_than_the_probe_warns_and_names_the_fix(monkeypatch, tmp_path):
    from mars_core import load_model

    monkeypatch.setenv("MARS_CACHE_DIR", str(tmp_path))
    lm = load_model("tiny-mars", device="cpu", dtype="float32")
    steps = [0.5, 0.040, 0.050, 0.045]                     # the first step holds the prompt's prefill
    assert dtype_probe.slow_decoding_warning(lm, steps) is None          # no probe on file: nothing to compare
    _probe_entry(lm, tmp_path, ms_1=2.0, ms_7=10.0)
    warning = dtype_probe.slow_decoding_warning(lm, steps)               # 45 ms against the probe's 10 ms at 7 rows
    assert "45 ms" in warning and "--threads 1" in warning
    assert dtype_probe.slow_decoding_warning(lm, [0.5, 0.025, 0.028]) is None   # under 3x the 7-row probe
    assert "45 ms" in dtype_probe.slow_decoding_warning(lm, [0.5, 0.045, 0.045, 0.045], 1)
    assert dtype_probe.slow_decoding_warning(lm, [0.5, 0.005, 0.005], 1) is None   # AR steps against the 1-row probe


def test_cli_generate_warns_on_stderr_when_forwards_run_far_slower_than_the_probe(monkeypatch, tmp_path, capsys):
    from mars_core import load_model
    from mars_core.tools.cli import main

    monkeypatch.setenv("MARS_CACHE_DIR", str(tmp_path))
    _probe_entry(load_model("tiny-mars", device="cpu", dtype="float32"), tmp_path, ms_1=1e-6, ms_7=1e-6)
    assert main(["generate", "--model", "tiny-mars", "--dtype", "float32", "--device", "cpu", "--threads", "1",
                 "--max-new-tokens", "8", "--prompt", "What is 2 + 3?"]) == 0
    assert "other processes are using the cores" in capsys.readouterr().err


def test_the_probe_cache_forgets_models_whose_folder_is_gone(probe, monkeypatch, tmp_path):
    cache, calls, fake = probe
    timings = {("float32", 1): 60.0, ("float32", 7): 120.0, ("w8a8", 1): 50.0, ("w8a8", 7): 55.0}
    monkeypatch.setattr(dtype_probe, "forward_ms", lambda models: fake(models, timings))
    nets = {"float32": lambda: torch.nn.Linear(4, 4), "w8a8": lambda: torch.nn.Linear(4, 4)}
    gone, kept, new = (tmp_path / name for name in ("gone", "kept", "new"))
    for folder in (gone, kept, new):
        folder.mkdir()
    dtype_probe.choose_cpu_format(nets, str(gone), n_params=10**9)
    dtype_probe.choose_cpu_format(nets, str(kept), n_params=10**9)
    gone.rmdir()                                     # e.g. a test's temporary checkpoint, deleted
    dtype_probe.choose_cpu_format(nets, str(new), n_params=10**9)
    folders = {k.split("|", 1)[0] for k in json.loads((cache / "dtype-probe.json").read_text())}
    assert folders == {str(kept.resolve()), str(new.resolve())}
