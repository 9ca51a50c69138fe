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

from mars_core import cli
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


def test_read_prompts_names_each_kind_of_path(fifo, tmp_path):
    from mars_core.textfile import read_prompts

    for path, said in ((fifo, "is a FIFO (named pipe), not a regular file"), ("/dev/zero", "is a character device"),
                       (tmp_path, "is a directory"), (tmp_path / "gone.txt", "does not exist")):
        with pytest.raises(ValueError, match=re.escape(f"prompts file '{path}' {said}")):
            read_prompts(path)
