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
