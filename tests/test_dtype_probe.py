"""dtype="auto" on a CPU: fp32 for small models; otherwise the dtype whose one-token forward is faster (a tie
within 3% goes to the cheaper 7-row forward), measured once and cached per model file and CPU."""
import json

import pytest
import torch

from mars_core import dtype_probe


@pytest.fixture
def probe(monkeypatch, tmp_path):
    monkeypatch.setenv("MARS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dtype_probe, "cpu_has_native_bf16", lambda: True)
    calls = []

    def fake(models, timings):
        calls.append(sorted(models))
        return timings

    return tmp_path, calls, fake


@pytest.mark.parametrize("timings, want", [
    ({("float32", 1): 60.0, ("float32", 7): 120.0, ("bfloat16", 1): 50.0, ("bfloat16", 7): 55.0}, torch.bfloat16),
    ({("float32", 1): 50.0, ("float32", 7): 120.0, ("bfloat16", 1): 60.0, ("bfloat16", 7): 62.0}, torch.float32),
    ({("float32", 1): 60.0, ("float32", 7): 120.0, ("bfloat16", 1): 61.0, ("bfloat16", 7): 65.0}, torch.bfloat16),
    ({("float32", 1): 61.0, ("float32", 7): 64.0, ("bfloat16", 1): 60.0, ("bfloat16", 7): 65.0}, torch.float32),
])
def test_the_faster_one_token_forward_decides_and_a_tie_goes_to_the_cheaper_step(probe, monkeypatch, tmp_path,
                                                                                  timings, want):
    cache, calls, fake = probe
    monkeypatch.setattr(dtype_probe, "forward_ms", lambda models: fake(models, timings))
    model = torch.nn.Linear(4, 4)
    monkeypatch.setattr(dtype_probe, "MIN_PARAMS", 1)
    assert dtype_probe.choose_cpu_dtype(model, str(tmp_path)) == want
    assert model.weight.dtype == torch.float32                       # the probe leaves the model as it found it
    saved = json.loads((cache / "dtype-probe.json").read_text())
    assert [v["dtype"] for v in saved.values()] == [str(want).replace("torch.", "")]
    # measured once: the second call reads the cache
    assert dtype_probe.choose_cpu_dtype(model, str(tmp_path)) == want and len(calls) == 1


def test_small_models_and_cpus_without_bf16_stay_fp32_without_probing(probe, monkeypatch, tmp_path):
    cache, calls, fake = probe
    monkeypatch.setattr(dtype_probe, "forward_ms", lambda models: fake(models, {}))
    assert dtype_probe.choose_cpu_dtype(torch.nn.Linear(4, 4), str(tmp_path)) == torch.float32   # < MIN_PARAMS
    monkeypatch.setattr(dtype_probe, "MIN_PARAMS", 1)
    monkeypatch.setattr(dtype_probe, "cpu_has_native_bf16", lambda: False)
    assert dtype_probe.choose_cpu_dtype(torch.nn.Linear(4, 4), str(tmp_path)) == torch.float32
    assert calls == [] and not (cache / "dtype-probe.json").exists()


def test_forward_ms_times_every_model_and_row_count(tiny_lm):
    ms = dtype_probe.forward_ms({"a": tiny_lm.model}, rows=(1, 3), rounds=2, context=8)
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
    from mars_core.cli import main

    monkeypatch.setenv("MARS_CACHE_DIR", str(tmp_path))
    _probe_entry(load_model("tiny-mars", device="cpu", dtype="float32"), tmp_path, ms_1=1e-6, ms_7=1e-6)
    assert main(["generate", "--model", "tiny-mars", "--dtype", "float32", "--device", "cpu", "--threads", "1",
                 "--max-new-tokens", "8", "--prompt", "What is 2 + 3?"]) == 0
    assert "other processes are using the cores" in capsys.readouterr().err


def test_the_probe_cache_forgets_models_whose_folder_is_gone(probe, monkeypatch, tmp_path):
    cache, calls, fake = probe
    timings = {("float32", 1): 60.0, ("float32", 7): 120.0, ("bfloat16", 1): 50.0, ("bfloat16", 7): 55.0}
    monkeypatch.setattr(dtype_probe, "forward_ms", lambda models: fake(models, timings))
    monkeypatch.setattr(dtype_probe, "MIN_PARAMS", 1)
    gone, kept, new = (tmp_path / name for name in ("gone", "kept", "new"))
    for folder in (gone, kept, new):
        folder.mkdir()
    model = torch.nn.Linear(4, 4)
    dtype_probe.choose_cpu_dtype(model, str(gone))
    dtype_probe.choose_cpu_dtype(model, str(kept))
    gone.rmdir()                                     # e.g. a test's temporary checkpoint, deleted
    dtype_probe.choose_cpu_dtype(model, str(new))
    folders = {k.split("|", 1)[0] for k in json.loads((cache / "dtype-probe.json").read_text())}
    assert folders == {str(kept.resolve()), str(new.resolve())}
