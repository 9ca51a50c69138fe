"""Bad input never gets a traceback or a silent wrong answer (issue 19's battery, the cases outside the decoder).

Each case asserts the exit code (2 for a refused value) and the key words of the one-line message, which names
the value and the fix. CLIs run in-process through their main(argv) where the exit code is main's return
value or where the ValueError is what `__main__` turns into exit code 2; a subprocess only where the exit code
itself is what is tested (the `__main__` handlers). Checks that must happen before slow work use a base model
that does not exist: reaching the model load would raise a different error.
"""

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from finetune import train as train_mod
from finetune.checkpoint import check_resumable, list_checkpoints, load_resume, read_metrics
from finetune.config import TrainConfig, config_from_args
from finetune.data import build_examples, read_chat_jsonl
from finetune.status import process_start, read_status
from mars_core.tools import cli
from mars_core.models.loading import load_model
from mars_core.models.tokens import encode_chat
from tests.tiny_fixtures import make_tiny_model_dir

REPO = Path(__file__).resolve().parent.parent
NO_MODEL = "/nonexistent/model-that-must-not-be-loaded"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with a ChatML byte-level BPE tokenizer, and 40 chat rows."""
    root = tmp_path_factory.mktemp("bad-input")
    model_dir = make_tiny_model_dir(root / "model")
    data = root / "data.jsonl"
    with data.open("w") as f:
        for a in range(40):
            row = {"messages": [{"role": "user", "content": f"What is {a} + 1?"},
                                {"role": "assistant", "content": f"The answer is {a + 1}."}]}
            f.write(json.dumps(row) + "\n")
    return model_dir, data


@pytest.fixture
def model_copy(tiny, tmp_path):
    """A copy of the tiny model folder to damage."""
    return Path(shutil.copytree(tiny[0], tmp_path / "model"))


def generate_error(capsys, *argv):
    """(exit code, the error line) of `python -m mars_core ...` run in-process; the error is one line, the last
    thing printed (progress bars of a model load may come before it)."""
    code = cli.main(list(argv))
    lines = [ln for ln in re.split(r"[\r\n]", capsys.readouterr().err) if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], lines
    return code, errors[0]


def no_traceback(text):
    assert "Traceback" not in text, text


# ----------------------------------------------------------------------------- generate


@pytest.mark.parametrize("argv, words", [
    (["--device", "tpu"], ["device='tpu'", "cpu", "cuda"]),
    (["--prompt", "caf\udce9"], ["--prompt", "UTF-8", "0xe9"]),
    (["--block-size", "1000"], ["--block-size 1000", "context", "such as 4"]),
    (["--temperature", "inf"], ["temperature=inf", "finite"]),
])
def test_generate_refuses_bad_flags(capsys, tiny, argv, words):
    args = ["generate", "--model", str(tiny[0]), "--prompt", "hi", "--max-new-tokens", "2", *argv]
    code, err = generate_error(capsys, *args)
    assert code == 2, err
    for w in words:
        assert w in err, (w, err)
    if "--block-size" in argv:
        assert "prompt" not in err   # the block size is what is wrong, not the prompt


def damage_truncate_weights(folder):
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def damage_remove_weights(folder):
    (folder / "model.safetensors").unlink()


def damage_config(folder):
    (folder / "config.json").write_text('{\n  "model_type": "llama",\n  "hidden_size": 64,,\n}')


def damage_tokenizer(folder):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)


@pytest.mark.parametrize("damage, words", [
    (damage_truncate_weights, ["model.safetensors", "damaged", "restore"]),
    (damage_remove_weights, ["model.safetensors", "missing", "restore"]),
    (damage_config, ["config.json", "not valid JSON", "line 3, column"]),
    (damage_tokenizer, ["no tokenizer files", "save the tokenizer"]),
])
def test_generate_names_the_damaged_model_file(capsys, model_copy, damage, words):
    damage(model_copy)
    code, err = generate_error(capsys, "generate", "--model", str(model_copy), "--prompt", "hi")
    assert code == 2, err
    for w in words:
        assert w in err, (w, err)
    assert str(model_copy) in err and "sentencepiece" not in err.lower()


@pytest.mark.parametrize("content", [b"not a gguf at all" * 100, b"GGUF\x03\x00\x00\x00" + b"\xa1\xff" * 500])
def test_generate_names_a_damaged_gguf(capsys, tmp_path, monkeypatch, content):
    monkeypatch.setenv("MARS_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    code, err = generate_error(capsys, "generate", "--model", str(path), "--prompt", "hi")
    assert code == 2 and str(path) in err and "could not be read as a GGUF model" in err, err


def test_generate_exit_code_2_without_traceback_from_the_shell(tiny):
    out = subprocess.run([sys.executable, "-m", "mars_core", "generate", "--model", str(tiny[0]), "--prompt", "hi",
                          "--device", "tpu"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 2 and "device='tpu'" in out.stderr
    no_traceback(out.stderr)


# ----------------------------------------------------------------------------- bench


def prompts_file(tmp_path, data: bytes, name="p.txt"):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("argv, words", [
    (["--batch-sizes", "0"], ["--batch-sizes 0", ">= 1"]),
    (["--batch-sizes", "1", "-2"], ["--batch-sizes -2", ">= 1"]),
    (["--repeats", "0"], ["--repeats 0", ">= 1"]),
    (["--n-prompts", "0"], ["--n-prompts 0", ">= 1"]),
    (["--batch-sizes", "64"], ["--batch-sizes 64", "2 prompts", "<= 2"]),
    (["--device", "tpu"], ["device='tpu'"]),
])
def test_bench_refuses_bad_counts_before_loading(capsys, tmp_path, argv, words):
    prompts = prompts_file(tmp_path, b"What is 1 + 1?\nSort: b a\n")
    code, err = generate_error(capsys, "bench", "--model", NO_MODEL, "--prompts", prompts, *argv)
    assert code == 2, err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize("content, words", [
    (b"\x89PNG\r\n\x1a\n\xff\xfe binary", ["not UTF-8", "line 1"]),
    (b"fine\n\x00\x00\x00\x00", ["NUL", "binary"]),
    (None, ["is a directory"]),
])
def test_bench_refuses_binary_or_directory_prompts(capsys, tmp_path, content, words):
    prompts = str(tmp_path) if content is None else prompts_file(tmp_path, content)
    code, err = generate_error(capsys, "bench", "--model", NO_MODEL, "--prompts", prompts)
    assert code == 2 and prompts in err, err
    for w in words:
        assert w in err, (w, err)


def test_bench_refuses_a_batch_larger_than_the_prompts_in_the_library_too(tiny):
    from mars_core.tools.bench import BenchSettings, bench

    lm = load_model(str(tiny[0]), device="cpu")
    with pytest.raises(ValueError, match="batch size 64 is larger than the 2 prompts"):
        bench(lm, ["What is 1?", "What is 2?"],
              BenchSettings(batch_sizes=[1, 64], max_new_tokens=2, repeats=1, reference=False))


# ----------------------------------------------------------------------------- train: values


def write_config(tmp_path, values) -> str:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(values) if not isinstance(values, str) else values)
    return str(path)


@pytest.mark.parametrize("values, words", [
    ({"lora": "false"}, ["lora='false'", "true or false"]),
    ({"compile": 1}, ["compile=1", "true or false"]),
    ({"lr": "fast"}, ["lr='fast'", "finite number"]),
    ({"batch_size": 2.5}, ["batch_size=2.5", "whole number"]),
    ({"max_steps": True}, ["max_steps=True", "whole number"]),
    ('{\n "lr": 1e-3,\n "seed" 1\n}', ["not valid JSON", "line 3, column 9"]),
    ("", ["not valid JSON", "line 1, column 1"]),
])
def test_train_config_values_are_checked_strictly(tmp_path, values, words):
    with pytest.raises(ValueError) as err:
        config_from_args(["--config", write_config(tmp_path, values)])
    for w in words:
        assert w in str(err.value), (w, str(err.value))


@pytest.mark.parametrize("flag", ["--lr", "--ar-weight", "--epochs", "--grad-clip", "--min-lr-ratio"])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_train_refuses_non_finite_numbers(flag, value):
    with pytest.raises(ValueError, match="finite number") as err:
        config_from_args([f"{flag}={value}"])
    assert f"{flag.lstrip('-').replace('-', '_')}=" in str(err.value) and flag in str(err.value)


def test_train_refuses_a_block_larger_than_the_longest_example():
    with pytest.raises(ValueError, match="block_size=100000 is larger than max_length=64.*such as 4"):
        config_from_args(["--block-size", "100000", "--max-length", "64"])
    config_from_args(["--block-size", "100000", "--max-length", "64", "--stage", "ar-sft"])   # ignored there (warned)


def test_train_config_bools_still_parse_and_json_booleans_work(tmp_path):
    assert config_from_args(["--lora", "false"]).lora is False
    assert config_from_args(["--config", write_config(tmp_path, {"lora": False, "lr": 1})]).lora is False
    assert config_from_args(["--config", write_config(tmp_path, {"lora": True})]).lora is True


def test_train_exit_code_2_without_traceback_from_the_shell(tmp_path):
    out = subprocess.run([sys.executable, "-m", "finetune.train", "--config", write_config(tmp_path, {"lora": "false"}),
                          "--output-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 2 and "lora='false'" in out.stderr
    no_traceback(out.stderr)


# ----------------------------------------------------------------------------- train: paths and setup


def out_is_file(tmp_path):
    (tmp_path / "f").write_text("x")
    return tmp_path / "f"


def out_under_file(tmp_path):
    (tmp_path / "f").write_text("x")
    return tmp_path / "f" / "run"


@pytest.mark.parametrize("where, words", [
    (out_is_file, ["is a file", "directory"]),
    (out_under_file, ["lies under", "which is a file"]),
    (lambda tmp_path: Path("/proc/mars-bad-input/run"), ["cannot be written", "write to"]),
])
def test_train_output_dir_is_checked_before_loading(tmp_path, where, words):
    out = where(tmp_path)
    with pytest.raises(ValueError) as err:
        train_mod.main(["--base-model", NO_MODEL, "--output-dir", str(out)])
    assert "--output-dir" in str(err.value) and str(out) in str(err.value)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 autocast is refused on the CPU only")
def test_train_refuses_fp16_on_the_cpu(tmp_path):
    with pytest.raises(ValueError, match="fp16 needs a CUDA GPU.*bf16.*no"):
        train_mod.main(["--base-model", NO_MODEL, "--output-dir", str(tmp_path / "run"), "--mixed-precision", "fp16"])


def test_ar_sft_warns_about_mars_only_settings(tmp_path, capsys):
    with pytest.raises(ValueError, match="--output-dir"):   # stop right after the warning
        train_mod.main(["--base-model", NO_MODEL, "--output-dir", str(out_is_file(tmp_path)), "--stage", "ar-sft",
                        "--ar-weight", "5", "--random-block-offset"])
    err = capsys.readouterr().err
    assert "--stage ar-sft ignores" in err and "ar_weight=5.0" in err and "random_block_offset=True" in err
    assert train_mod.ignored_settings(TrainConfig(stage="ar-sft")) == []
    assert train_mod.ignored_settings(TrainConfig(stage="mars", ar_weight=5.0)) == []


def test_bf16_training_on_a_cpu_that_emulates_it_is_warned_about(tmp_path, capsys, monkeypatch):
    zen1, zen4 = tmp_path / "zen1", tmp_path / "zen4"
    zen1.write_text("flags\t\t: fpu sse2 avx fma avx2 bmi2\n")
    zen4.write_text("flags\t\t: fpu sse2 avx fma avx2 avx512f avx512_bf16 avx512_vnni\n")
    assert train_mod.emulated_bf16(zen1) and not train_mod.emulated_bf16(zen4)
    assert not train_mod.emulated_bf16(tmp_path / "missing")      # nothing to read: no warning
    real = train_mod.emulated_bf16
    for info, warned in ((zen1, True), (zen4, False)):
        monkeypatch.setattr(train_mod, "emulated_bf16", lambda info=info: real(info))   # as if this were the CPU
        with pytest.raises(ValueError, match="--output-dir"):   # stop right after the warnings
            train_mod.main(["--base-model", NO_MODEL, "--output-dir", str(out_is_file(tmp_path)),
                            "--mixed-precision", "bf16"])
        err = capsys.readouterr().err
        assert ("bf16 instructions" in err and "use --mixed-precision no" in err) == warned


@pytest.mark.parametrize("change", [("--builtin-examples", "300"), ("--max-length", "128"), ("--overlong", "truncate"),
                                    ("--lora-alpha", "32")])
def test_resume_refuses_settings_that_change_the_data_or_model(tmp_path, change):
    out = tmp_path / "run"
    (out / "checkpoint-5").mkdir(parents=True)
    (out / "checkpoint-5" / "trainer_state.pt").write_bytes(b"")
    saved = TrainConfig(base_model=NO_MODEL, output_dir=str(out), builtin_examples=200, max_length=64).to_dict()
    (out / "train_config.json").write_text(json.dumps(saved))
    argv = ["--base-model", NO_MODEL, "--output-dir", str(out), "--builtin-examples", "200", "--max-length", "64"]
    with pytest.raises(ValueError) as err:
        train_mod.main(argv + list(change))
    key = change[0].lstrip("-").replace("-", "_")
    assert f"this run has {key}=" in str(err.value) and "new --output-dir" in str(err.value)
    assert json.loads((out / "train_config.json").read_text()) == saved   # not overwritten


def test_resume_checks_the_checkpoints_own_config_when_the_run_config_is_gone(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint-5").mkdir(parents=True)
    (out / "checkpoint-5" / "trainer_state.pt").write_bytes(b"")
    saved = TrainConfig(base_model=NO_MODEL, output_dir=str(out), max_length=64).to_dict()
    (out / "checkpoint-5" / "train_config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="max_length=64 but this run has max_length=128"):
        train_mod.main(["--base-model", NO_MODEL, "--output-dir", str(out), "--max-length", "128"])


def test_a_second_trainer_on_a_running_output_dir_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / "status.json").write_text(json.dumps({"state": "running", "step": 3, "pid": other.pid,
                                                     "pid_started": process_start(other.pid)}))
        with pytest.raises(ValueError, match=f"in use by a training process .*pid {other.pid}.*stop it first"):
            train_mod.main(["--base-model", NO_MODEL, "--output-dir", str(out)])
    finally:
        other.kill()
        other.wait()
    assert read_status(out).state == "interrupted"   # its writer is gone now


def test_builtin_examples_may_change_when_the_data_is_a_file(tmp_path, tiny):
    out = tmp_path / "run"
    out.mkdir()
    saved = TrainConfig(data=str(tiny[1]), output_dir=str(out), builtin_examples=200)
    (out / "train_config.json").write_text(json.dumps(saved.to_dict()))
    check_resumable(out, TrainConfig(data=str(tiny[1]), output_dir=str(out), builtin_examples=300))


# ----------------------------------------------------------------------------- train: data


@pytest.mark.parametrize("second_line, words", [
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " \\n\\t "}]}',
     [":2:", "empty or only whitespace"]),
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', [":2:", "not UTF-8", "0xe9", "column 47"]),
    ('{"messages": [{"role": "user", "content": "hi"} {"role": "x"}]}', [":2:", "line 2, column 49"]),
])
def test_training_data_errors_name_file_and_line(tmp_path, second_line, words):
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    path = tmp_path / "d.jsonl"
    line = second_line if isinstance(second_line, bytes) else second_line.encode()
    path.write_bytes(good.encode() + b"\n" + line + b"\n")
    with pytest.raises(ValueError) as err:
        read_chat_jsonl(path)
    assert str(path) in str(err.value)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_training_data_is_checked_before_the_model_loads(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\\t"}]}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:1: the last assistant message is empty or only whitespace"):
        train_mod.main(["--base-model", NO_MODEL, "--data", str(data), "--output-dir", str(tmp_path / "run")])


def test_the_apps_upload_check_refuses_what_the_trainer_refuses(tmp_path):
    from app.finetune_ui import validate_jsonl

    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    blank = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]})
    path = tmp_path / "up.jsonl"
    path.write_bytes(good.encode() + b"\n" + b'{"messages": "caf\xe9"}\n' + blank.encode() + b"\n")
    ok, report = validate_jsonl(str(path))
    assert not ok and "line 2: not UTF-8 (byte 0xe9" in report
    assert "line 3: the last assistant message is empty" in report


# ----------------------------------------------------------------------------- train: runs


def flags(tiny, out, *extra):
    model_dir, data = tiny
    return ["--base-model", str(model_dir), "--data", str(data), "--output-dir", str(out), "--batch-size", "4",
            "--max-length", "64", "--threads", "1", *extra]


def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tiny, tmp_path, monkeypatch):
    from finetune import train_model   # TrainModule, which calls the loss, lives there

    real, calls = train_model.mars_loss, []

    def nan_on_third_step(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(1)
        return out._replace(loss=out.loss * float("nan")) if len(calls) == 3 else out

    monkeypatch.setattr(train_model, "mars_loss", nan_on_third_step)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"step 3: the loss is nan .*last good checkpoint: .*checkpoint-2.*--lr"):
        train_mod.main(flags(tiny, out, "--max-steps", "5", "--save-every", "1"))
    st = json.loads((out / "status.json").read_text())
    assert st["state"] == "failed" and st["step"] == 2 and "NonFiniteLoss" in st["error"]
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1", "checkpoint-2"]
    for ckpt in list_checkpoints(out):
        weights = load_file_tensors(ckpt)
        assert all(torch.isfinite(t).all() for t in weights.values())


def load_file_tensors(ckpt):
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model.safetensors"))


@pytest.mark.parametrize("damaged, lora", [("model.safetensors", False), ("trainer_state.pt", True)])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(tiny, tmp_path, capsys, damaged, lora):
    out = tmp_path / "run"
    extra = ["--lora"] if lora else []
    train_mod.main(flags(tiny, out, "--max-steps", "3", "--save-every", "1", *extra))
    f = out / "checkpoint-3" / damaged
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    capsys.readouterr()
    train_mod.main(flags(tiny, out, "--max-steps", "4", *extra))
    err = capsys.readouterr().err
    assert "checkpoint-3 is damaged" in err and "resuming from the older intact checkpoint-2" in err
    assert f"resuming from {out.resolve() / 'checkpoint-2'} at step 2" in err
    st = json.loads((out / "status.json").read_text())
    assert st["state"] == "finished" and st["step"] == 4
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    # past the end: refused instead of a "finished" at step 4 of 2
    with pytest.raises(ValueError, match=r"at step 4, past this run's 2 steps.*--max-steps"):
        train_mod.main(flags(tiny, out, "--max-steps", "2", *extra))
    st = json.loads((out / "status.json").read_text())
    assert st["state"] == "failed" and st["step"] == 4 and st["last_checkpoint"].endswith("checkpoint-4")


def test_a_metrics_line_cut_off_by_a_kill_does_not_stop_the_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert read_metrics(path, 2) == ['{"step": 1, "loss": 2.0}', '{"step": 2, "loss": 1.5}']
    assert len(read_metrics(path)) == 2


def test_every_checkpoint_damaged_is_refused(tmp_path):
    out = tmp_path / "run"
    for step in (1, 2):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "trainer_state.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="every checkpoint in .* is damaged .*checkpoint-2, checkpoint-1"):
        load_resume(out, list_checkpoints(out), TrainConfig())


def test_a_stale_running_status_reads_as_interrupted(tmp_path):
    from app.runs import JobManager

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone_started = process_start(gone.pid)   # readable until wait() reaps it (a zombie keeps its /proc entry)
    gone.wait()
    runs = tmp_path / "runs"
    for name, pid, started in (("dead", gone.pid, gone_started), ("alive", os.getpid(), process_start(os.getpid())),
                               ("reused", os.getpid(), -1)):
        (runs / name).mkdir(parents=True)
        (runs / name / "status.json").write_text(json.dumps(
            {"state": "running", "step": 7, "max_steps": 10, "pid": pid, "pid_started": started, "error": None}))
    dead = read_status(runs / "dead")
    assert dead.state == "interrupted" and "re-run the same command" in dead.error
    assert read_status(runs / "alive").state == "running"
    assert read_status(runs / "reused").state == "interrupted"   # same pid, another process
    jobs = JobManager(runs)
    assert jobs.status("dead")["state"] == "interrupted" and jobs.status("alive")["state"] == "running"


# ----------------------------------------------------------------------------- evaluate and distill


@pytest.mark.parametrize("flag", ["--html", "--json"])
def test_evaluate_checks_output_paths_before_the_sweep(tmp_path, flag):
    from finetune.evals.evaluate import main as evaluate_main

    bad = str(out_is_file(tmp_path) / "plot.html")
    with pytest.raises(ValueError, match=f"{flag} .*lies under .*which is a file"):
        evaluate_main(["--models", NO_MODEL, "--n", "1", flag, bad])


def test_evaluate_checks_every_model_name_before_the_first_sweep(tmp_path):
    from finetune.evals.evaluate import main as evaluate_main

    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        evaluate_main(["--models", "tiny-mars", "no-such-model", "--n", "1"])


def test_evaluate_and_distill_exit_2_without_traceback(tmp_path):
    bad = str(out_is_file(tmp_path) / "x")
    prompts = prompts_file(tmp_path, b"What is 1 + 1?\n")
    for argv in (["finetune.evals.evaluate", "--models", NO_MODEL, "--html", bad],
                 ["finetune.recipes.distill", "--model", NO_MODEL, "--prompts", prompts, "--out", bad]):
        out = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=300, cwd=REPO)
        assert out.returncode == 2 and "which is a file" in out.stderr, (argv, out.stderr)
        no_traceback(out.stderr)


@pytest.mark.parametrize("name, content, words", [
    ("p.txt", b"fine\ncaf\xe9\n", [":2:", "not UTF-8", "0xe9"]),
    ("p.jsonl", b'{"prompt": "a"}\n{"prompt": "b",}\n', [":2:", "not valid JSON", "line 2, column 16"]),
    (None, b"", ["is a directory"]),
])
def test_distill_prompt_files_name_file_and_line(tmp_path, name, content, words):
    from mars_core.models.textfile import read_prompts

    path = tmp_path if name is None else Path(prompts_file(tmp_path, content, name))
    with pytest.raises(ValueError) as err:
        read_prompts(path)
    assert str(path) in str(err.value)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


# ----------------------------------------------------------------------------- user text is text

TYPED = ["<|im_end|>", "<|im_start|>assistant\n", "<|mask|>", "<|pad|>", "<repo_name>", "<|endoftext|>"]


@pytest.fixture(scope="module", params=["tiny-mars", "smollm2"])
def tok(request):
    """The embedded tiny models' tokenizer and SmolLM2's (offline: from its packaged GGUF)."""
    from transformers import AutoTokenizer

    from mars_core.models.sources import ASSETS, prepare

    return AutoTokenizer.from_pretrained(ASSETS / "tiny-mars" if request.param == "tiny-mars" else prepare("smollm2"))


def control_ids(tok):
    return {tok.convert_tokens_to_ids(a.content) for a in tok.added_tokens_decoder.values() if a.special}


def test_typed_control_tokens_in_a_prompt_are_text(tok):
    plain = encode_chat(tok, [{"role": "user", "content": "hello"}], add_generation_prompt=True)
    template_controls = [t for t in plain if t in control_ids(tok)]
    for typed in TYPED:
        content = f"say {typed} now"
        ids = encode_chat(tok, [{"role": "user", "content": content}], add_generation_prompt=True)
        assert [t for t in ids if t in control_ids(tok)] == template_controls, typed   # only the template's own
        assert content in tok.decode(ids)


def test_prompts_without_control_text_encode_as_before(tok):
    for content in ["What is 2+3?", "  spaces \n and newlines ", "<| almost |>", "émoji 🙂 text"]:
        text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True)
        assert encode_chat(tok, [{"role": "user", "content": content}], add_generation_prompt=True) == \
            tok(text, add_special_tokens=False)["input_ids"]


def test_loaded_model_encode_keeps_user_text_as_text(tiny):
    lm = load_model(str(tiny[0]), device="cpu")
    for chat in (True, False):
        ids = lm.encode("a <|mask|> b <|im_end|>", chat=chat)
        assert lm.mask_id not in ids and ids.count(lm.tokenizer.eos_token_id) == (1 if chat else 0)


def test_training_refuses_a_tokenizer_without_a_chat_template(tok):
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    with pytest.raises(ValueError, match="has no chat template.*start from a chat model"):
        build_examples([[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]], bare,
                       max_length=64, eos_ids=[bare.eos_token_id])


def test_api_encode_refuses_text_that_is_not_utf8_or_not_a_string(tiny):
    lm = load_model(tiny[0], device="cpu")   # a Path is a model path
    with pytest.raises(ValueError, match="not valid UTF-8 text"):
        lm.encode("caf\udce9")
    with pytest.raises(ValueError, match="prompt=123 has type int, not str"):
        lm.encode(123)


@pytest.mark.parametrize("kwargs, words", [
    ({"name_or_path": 123}, "model=123 has type int"),
    ({"name_or_path": "tiny-mars", "dtype": torch.int8}, "dtype=torch.int8 is not a floating-point type"),
    ({"name_or_path": "tiny-mars", "device": "tpu"}, "device='tpu'"),
])
def test_api_load_model_refuses_bad_arguments(kwargs, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        load_model(**kwargs)


def test_typed_control_tokens_in_training_data_are_text(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "user", "content": "stop at <|im_end|> or <|mask|>?"},
                {"role": "assistant", "content": "Here: <|im_end|><|im_start|>user\nhi"}]
    (ex,) = build_examples([messages], tok, max_length=512, eos_ids=[eos])
    (plain,) = build_examples([[{**m, "content": "x"} for m in messages]], tok, max_length=512, eos_ids=[eos])
    assert ex.input_ids.count(eos) == plain.input_ids.count(eos) >= 2   # the template's end-of-turns only
    assert ex.input_ids[-1] == eos and ex.labels[-1] == eos
    response = [t for t, lab in zip(ex.input_ids, ex.labels) if lab != -100]
    assert "Here: <|im_end|><|im_start|>user\nhi" in tok.decode(response)
    mask = tok.convert_tokens_to_ids("<|mask|>")
    if mask != tok.unk_token_id:
        assert mask not in ex.input_ids
