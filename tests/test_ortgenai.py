"""bench's other-runtime AR sides (llama.cpp, ONNX Runtime GenAI): how they join the race, and ONNX Runtime GenAI's
folder handling. The runtimes themselves are optional and not installed in CI; a stand-in runtime takes their
place in the race, and the ONNX Runtime folder handling is checked on files alone."""
import json

import pytest

from mars_core import DecodeConfig, generate, wrap_model
from tests.tiny_fixtures import make_model, make_tokenizer


class EchoRuntime:
    """A stand-in other runtime: greedy AR through our own decoder (so its answers are our AR's), or a fixed
    answer of one token (`short`)."""

    def __init__(self, lm, short=False):
        self.lm, self.short, self.label = lm, short, "echo (stand-in)"
        self.device = lm.device

    def generate(self, prompt_ids, max_new_tokens):
        if self.short:
            return [5]
        return generate(self.lm, [prompt_ids], DecodeConfig(mode="ar", max_new_tokens=max_new_tokens))[0].token_ids


def test_other_runtimes_join_the_race_as_ar_baselines_per_token():
    from mars_core.tools.bench import BenchSettings, bench, format_table

    tok = make_tokenizer()
    lm = wrap_model(make_model("llama", len(tok)), tok)
    prompts = ["What is 2+3?", "Sort: c a b"]
    externals = {"llamacpp": EchoRuntime(lm), "onnxruntime": EchoRuntime(lm, short=True)}
    row1, row2 = bench(lm, prompts, BenchSettings(batch_sizes=(1, 2), tau=0.5, max_new_tokens=8, repeats=2,
                                                     reference=False, transformers=False), externals=externals)
    assert set(row1.time_ranges) == {"ar", "mars", "verify", "llamacpp", "onnxruntime"}
    assert row1.external_labels == {"llamacpp": "echo (stand-in)", "onnxruntime": "echo (stand-in)"}
    assert row1.external_agreement == {"llamacpp": 1, "onnxruntime": 0}
    # per token: the stand-in that writes one token a prompt is timed over those 2 tokens
    lo, hi = row1.time_ranges["onnxruntime"]   # two repeats: the median is their mean
    assert row1.ms_per_token["onnxruntime"] == pytest.approx(1000 * (lo + hi) / 2 / 2)
    assert row1.fastest_ar_per_token in ("ar", "llamacpp", "onnxruntime")
    assert row1.per_token_speedup[row1.fastest_ar_per_token] == pytest.approx(1.0)
    assert min(row1.ms_per_token[s] for s in ("ar", "llamacpp", "onnxruntime")) == \
        row1.ms_per_token[row1.fastest_ar_per_token]
    assert "onnxruntime = echo (stand-in), its answers equal our AR's in 0%" in format_table([row1])
    # other runtimes decode one prompt at a time: they run at batch size 1 only
    assert "onnxruntime" not in row2.time_ranges and row2.external_labels == {}


def test_an_onnxruntime_folder_without_its_config_is_named_before_the_model_loads(monkeypatch, tmp_path, capsys):
    import mars_core.tools.ortgenai as ortgenai
    from mars_core.tools import cli

    monkeypatch.setattr(ortgenai, "check_usable", lambda: None)
    with pytest.raises(ValueError, match="is not an ONNX Runtime GenAI model folder .*genai_config.json.*int8 or int4"):
        ortgenai.OrtGenAIAR(tmp_path, eos_ids=[2])
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    assert cli.main(["bench", "--model", "tiny-mars", "--onnxruntime", str(tmp_path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not an ONNX Runtime GenAI model folder" in err


def test_the_thread_count_goes_into_a_view_and_the_model_folder_stays_untouched(tmp_path):
    from mars_core.tools.ortgenai import _with_threads

    folder, view = tmp_path / "model", tmp_path / "view"
    folder.mkdir()
    view.mkdir()
    config = {"model": {"decoder": {"session_options": {"log_id": "x"}, "filename": "model.onnx"}}}
    (folder / "genai_config.json").write_text(json.dumps(config))
    (folder / "model.onnx").write_bytes(b"onnx")
    _with_threads(folder, 1, view)
    assert json.loads((folder / "genai_config.json").read_text()) == config
    seen = json.loads((view / "genai_config.json").read_text())["model"]["decoder"]["session_options"]
    assert seen == {"log_id": "x", "intra_op_num_threads": 1, "inter_op_num_threads": 1}
    assert (view / "model.onnx").is_symlink() and (view / "model.onnx").read_bytes() == b"onnx"


def test_a_failed_onnxruntime_build_is_one_line_and_leaves_no_model(monkeypatch, tmp_path):
    import mars_core.tools.ortgenai as ortgenai

    monkeypatch.setenv("MARS_CACHE_DIR", str(tmp_path / "cache"))
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()   # no config.json: ONNX Runtime's builder (or a missing builder) fails on it
    with pytest.raises(ValueError, match="model builder failed on .*ckpt.*--onnxruntime DIR"):
        ortgenai.build(checkpoint)
    assert list((tmp_path / "cache" / "onnxruntime").iterdir()) == []


def test_an_unknown_onnxruntime_precision_is_named_before_any_build(tmp_path):
    from mars_core.tools.ortgenai import build

    with pytest.raises(ValueError, match="'int3': build int8 or int4, or pass a model folder"):
        build(tmp_path, "int3")
