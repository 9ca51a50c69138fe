"""The unclear ones named (issue 51, item 4): each case the hostile-user battery found answered with a wrong or
vague line is answered with one line naming the real fault and the fix, exit 2, before anything slow starts.
Tiny models and seconds each; the subprocess tests run the CLI as a user would (locale, pipes, redirects)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mars_core.tools import cli
from tests.tiny_fixtures import train_flags

REPO = Path(__file__).resolve().parent.parent


def refuse_loading(monkeypatch):
    """Make any model load fail the test: the refusal must come before it."""
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad value was refused")

    monkeypatch.setattr(cli, "load_model", no_load)


def cli_run(*args: str, env: dict | None = None, stdout=subprocess.PIPE, timeout: float = 120):
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "mars_core", *args], cwd=REPO, env=env, stdout=stdout,
                          stderr=subprocess.PIPE, timeout=timeout)


def error_line(stderr: bytes | str) -> str:
    text = stderr.decode("utf-8", "replace") if isinstance(stderr, bytes) else stderr
    assert "Traceback" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


# ----------------------------------------------------------------------------- --threads against the machine


def test_cli_refuses_more_threads_than_the_machine_has_before_loading(monkeypatch, capsys):
    refuse_loading(monkeypatch)
    n = (os.cpu_count() or 1) * 1000
    assert cli.main(["generate", "--model", "tiny-mars", "--prompt", "hi", "--threads", str(n)]) == 2
    err = capsys.readouterr().err
    assert f"--threads {n} is more than the {os.cpu_count()} CPUs of this machine" in err
    assert "config.json" not in err


def test_bench_refuses_more_threads_than_the_machine_has_before_loading(monkeypatch, capsys):
    refuse_loading(monkeypatch)
    assert cli.main(["bench", "--model", "tiny-mars", "--threads", "1000000"]) == 2
    assert "--threads 1000000 is more than the" in capsys.readouterr().err


def test_train_refuses_more_threads_than_the_machine_has_before_loading(tiny, tmp_path, monkeypatch):
    from finetune import train

    def no_setup(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad value was refused")

    monkeypatch.setattr(train, "setup", no_setup)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"--threads 1000000 is more than the \d+ CPUs of this machine"):
        train.main(train_flags(tiny, out, "--threads", "1000000"))
    assert not out.exists() or not any(out.iterdir())


# ----------------------------------------------------------------------------- special files


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "prompts.fifo"
    os.mkfifo(path)
    return path


def test_a_fifo_as_prompts_is_named_a_fifo_not_missing(fifo, monkeypatch, capsys):
    refuse_loading(monkeypatch)
    assert cli.main(["bench", "--model", "tiny-mars", "--threads", "1", "--prompts", str(fifo)]) == 2
    err = capsys.readouterr().err
    assert f"prompts file {str(fifo)!r} is a FIFO (named pipe), not a regular file" in err
    assert "does not exist" not in err


def test_a_device_as_data_is_named_a_device_not_missing(tiny, tmp_path):
    from finetune.train import main

    with pytest.raises(ValueError, match="data file '/dev/null' is a character device, not a regular file"):
        main(train_flags(tiny, tmp_path / "run", "--data", "/dev/null"))


def test_a_fifo_as_train_config_is_named_a_fifo(fifo):
    from finetune.config import config_from_args

    with pytest.raises(ValueError,
                       match=re.escape(f"--config {str(fifo)!r} is a FIFO (named pipe), not a regular file")):
        config_from_args(["--config", str(fifo)])


def test_read_prompts_names_each_kind_of_path(fifo, tmp_path):
    from mars_core.models.textfile import read_prompts

    for path, said in ((fifo, "is a FIFO (named pipe), not a regular file"), ("/dev/zero", "is a character device"),
                       (tmp_path, "is a directory"), (tmp_path / "gone.txt", "does not exist")):
        with pytest.raises(ValueError, match=re.escape(f"prompts file '{path}' {said}")):
            read_prompts(path)


# ----------------------------------------------------------------------------- stdout


GENERATE = ("generate", "--model", "tiny-mars", "--device", "cpu", "--dtype", "float32", "--threads", "1",
            "--prompt", "What is 2 + 3?", "--max-new-tokens", "8")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_json_to_a_full_device_names_stdout_and_exits_2():
    with open("/dev/full", "w") as full:
        done = cli_run(*GENERATE, "--json", stdout=full)
    assert done.returncode == 2
    line = error_line(done.stderr)
    assert line.startswith("error: stdout could not be written (no space left on the device it is redirected to)")
    assert "?" not in line


def test_a_closed_pipe_ends_quietly_like_a_unix_tool():
    read_end, write_end = os.pipe()
    os.close(read_end)   # the reader is gone before the first write, as `| head -c 1` after its byte
    try:
        done = cli_run(*GENERATE, stdout=write_end)
    finally:
        os.close(write_end)
    assert done.returncode == 141, done.stderr.decode()[-2000:]   # 128 + SIGPIPE, what the shell shows for `yes | head`
    err = done.stderr.decode()
    assert "error" not in err and "Traceback" not in err and "Exception ignored" not in err


def test_an_answer_the_ascii_locale_cannot_hold_is_escaped_not_an_error(monkeypatch):
    import io

    from mars_core.tools.exits import guarded_stdout

    raw = io.BytesIO()
    ascii_out = io.TextIOWrapper(raw, encoding="ascii", errors="strict")
    monkeypatch.setattr(sys, "stdout", ascii_out)
    with guarded_stdout():
        print("café")
    assert raw.getvalue() == b"caf\\xe9\n" and ascii_out.errors == "strict"


# ----------------------------------------------------------------------------- command-line text


def test_a_surrogate_escaped_utf8_prompt_is_decoded_again_and_bad_bytes_still_named():
    assert cli._text_arg("--prompt", "caf\udcc3\udca9") == "café"   # b"caf\xc3\xa9" under an ASCII locale
    with pytest.raises(ValueError, match=r"--prompt is not valid UTF-8 text \(byte 0xe9 at byte 3\)"):
        cli._text_arg("--prompt", "caf\udce9 ok")   # b"caf\xe9": Latin-1, not UTF-8


def test_a_utf8_prompt_under_the_c_locale_decodes_as_under_utf8(capsys):
    args = [a for a in GENERATE if a not in ("--prompt", "What is 2 + 3?")]
    args += ["--prompt", "Combien font 2 + 3 ? Réponds, s'il te plaît.", "--json"]
    assert cli.main(args) == 0   # this process: the prompt as a str, never through a locale
    expected = json.loads(capsys.readouterr().out)["token_ids"]
    c_locale = cli_run(*args, env=dict(os.environ, LC_ALL="C", LANG="C", PYTHONUTF8="0"))
    assert c_locale.returncode == 0, c_locale.stderr.decode()[-2000:]
    assert json.loads(c_locale.stdout)["token_ids"] == expected


# ----------------------------------------------------------------------------- NaN weights, out of memory


def test_nan_weights_are_one_line_and_exit_2(tiny, tmp_path, capsys):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    model = tmp_path / "nan-model"
    shutil.copytree(tiny[0], model)
    weights = load_file(str(model / "model.safetensors"))
    save_file({k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in weights.items()},
              str(model / "model.safetensors"), metadata={"format": "pt"})
    assert cli.main(["generate", "--model", str(model), "--device", "cpu", "--dtype", "float32", "--threads", "1",
                     "--prompt", "hi", "--max-new-tokens", "4"]) == 2
    line = error_line(capsys.readouterr().err)
    assert "NaN/inf logits" in line and str(model) in line


@pytest.mark.parametrize("failure", ["MemoryError", "torch", "loader", "shared library"])
def test_out_of_memory_is_one_line_naming_the_models_size(failure, monkeypatch, capsys):
    def load_model(*args, **kwargs):
        if failure == "MemoryError":
            raise MemoryError()
        if failure == "shared library":   # what `prlimit --as=800000000` gave: the loader blamed the weights file
            try:
                raise ImportError("libscipy_openblas-6cdc3b4a.so: failed to map segment from shared object")
            except ImportError as exc:
                raise ValueError(f"assets/tiny-mars: the model weights could not be read ({exc}): the weights "
                                 "file (model.safetensors) is missing or damaged; restore it") from exc
        if failure == "torch":
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't allocate memory: "
                               "you tried to allocate 1048576 bytes. Error code 12 (Cannot allocate memory)")
        try:   # a loader that words any failure reading config.json as that file's fault
            raise MemoryError()
        except MemoryError as exc:
            raise ValueError(f"tiny-mars/config.json is not a usable model config ({type(exc).__name__}): fix or "
                             "restore it") from None

    monkeypatch.setattr(cli, "load_model", load_model)
    assert cli.main(["generate", "--model", "tiny-mars", "--threads", "1", "--prompt", "hi"]) == 2
    line = error_line(capsys.readouterr().err)
    assert line.startswith("error: out of memory loading or running tiny-mars (its weights take ")
    assert "MB on disk" in line and "config.json" not in line


# ----------------------------------------------------------------------------- oversized training rows


def chats_with_a_big_row(path: Path, row_bytes: int, at_line: int = 3) -> Path:
    rows = (path.parent / "base.jsonl")
    from tests.tiny_fixtures import write_addition_chats

    lines = write_addition_chats(rows, 12).read_text().splitlines()
    big = {"messages": [{"role": "user", "content": "x" * row_bytes}, {"role": "assistant", "content": "y"}]}
    lines.insert(at_line - 1, json.dumps(big))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_row_over_the_size_limit_is_refused_by_line_before_tokenizing(tiny, tmp_path, monkeypatch):
    from finetune import train

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the rows were tokenized before the oversized one was refused")

    monkeypatch.setattr(train, "build_examples", no_tokenizing)
    data = chats_with_a_big_row(tmp_path / "data.jsonl", 2_000_000, at_line=3)
    with pytest.raises(ValueError, match=rf"{re.escape(str(data))}:3: the line is 2,000,0\d\d bytes, over the limit "
                                         r"of 1,000,000: .*--max-row-bytes"):
        train.main(train_flags(tiny, tmp_path / "run", "--data", str(data)))


def test_max_row_bytes_raises_the_limit(tmp_path):
    from finetune.config import config_from_args
    from finetune.data import load_conversations

    data = chats_with_a_big_row(tmp_path / "data.jsonl", 1_500_000)
    with pytest.raises(ValueError, match=":3: the line is"):
        load_conversations(str(data))
    cfg = config_from_args(["--data", str(data), "--max-row-bytes", "2000000"])
    rows = load_conversations(cfg.data, max_row_bytes=cfg.max_row_bytes)
    assert len(rows) == 13 and len(rows[2][0]["content"]) == 1_500_000


def test_a_row_of_exactly_the_limit_is_read_and_one_byte_more_is_not(tmp_path):
    from finetune.data import read_chat_jsonl

    row = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    path = tmp_path / "d.jsonl"
    path.write_text(row + "\n" + row)   # the last line has no newline
    assert len(read_chat_jsonl(path, max_row_bytes=len(row))) == 2
    with pytest.raises(ValueError, match=rf":1: the line is {len(row) + 1:,} bytes, over the limit of {len(row) - 1}"):
        read_chat_jsonl(path, max_row_bytes=len(row) - 1)


# ----------------------------------------------------------------------------- the app's upload refusal


def test_the_apps_start_refusal_names_the_bad_line_and_the_bad_role(tmp_path):
    from app.finetune_ui import DEFAULTS, make_request

    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    bad = {"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    upload = tmp_path / "up.jsonl"
    upload.write_text("\n".join(json.dumps(r) for r in (good, good, bad)) + "\n")
    with pytest.raises(ValueError) as refused:
        make_request(None, DEFAULTS["base"], "upload", str(upload), "mars", 4, 1.0, 10, 1e-3, False)
    message = str(refused.value)
    assert "line 3" in message and "'human'" in message and "use one of system, user, assistant" in message


def test_the_apps_upload_check_refuses_a_row_the_trainer_would_refuse_for_its_size(tmp_path):
    from app.finetune_ui import validate_jsonl

    upload = chats_with_a_big_row(tmp_path / "up.jsonl", 1_200_000, at_line=2)
    ok, report = validate_jsonl(str(upload))
    assert not ok and "line 2: the row is 1,200,0" in report
    assert "over the limit of 1,000,000 that training reads" in report


def test_the_api_refuses_a_block_size_the_cli_refuses(capsys):
    from mars_core import DecodeConfig, generate, load_model

    lm = load_model("tiny-mars", device="cpu", dtype="float32")
    big = DecodeConfig(block_size=10**6, max_new_tokens=4)
    with pytest.raises(ValueError, match=rf"block_size=1000000 does not fit .* context of {lm.context_length} tokens"):
        generate(lm, ["What is 2 + 3?"], big)
    assert cli.main(["generate", "--model", "tiny-mars", "--device", "cpu", "--dtype", "float32", "--threads", "1",
                     "--prompt", "hi", "--block-size", str(10**6)]) == 2
    assert "--block-size 1000000 does not fit" in capsys.readouterr().err


@pytest.mark.parametrize("fault, words", [(FloatingPointError("tiny produced NaN/inf logits at step 3: restore it"),
                                            "NaN/inf logits"),
                                           (MemoryError(), "out of memory (MemoryError)"),
                                           (RuntimeError("[enforce fail] can't allocate memory: you tried 9 GB"),
                                            "out of memory ([enforce fail] can't allocate memory")])
def test_finetune_tools_end_numeric_and_memory_faults_in_one_line(fault, words, capsys):
    from finetune.config import run_main

    def main():
        raise fault
    with pytest.raises(SystemExit) as stop:
        run_main(main)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and words in err, err


def test_finetune_tools_name_stdout_and_end_quietly_on_a_closed_pipe(monkeypatch, capsys):
    import errno

    from finetune.config import run_main
    full = subprocess.run(f"{sys.executable} -m finetune.evals.evaluate --help > /dev/full", shell=True,
                          capture_output=True, text=True, timeout=120)
    assert full.returncode == 2 and "stdout could not be written" in full.stderr and "Traceback" not in full.stderr

    class ClosedPipe:   # what a reader that went away (`| head -c 1`) leaves a long output to write into
        encoding = "utf-8"

        def write(self, text):
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

        def flush(self):
            pass
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    with pytest.raises(SystemExit) as stop:
        run_main(lambda: print("a long table"))
    assert stop.value.code == 141 and capsys.readouterr().err == ""
