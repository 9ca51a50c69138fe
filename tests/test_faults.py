"""Faults: SIGINT/SIGTERM stop every CLI with one line and 130/143, keeping what was finished (evaluate's partial
JSON, distill's JSONL) so that a rerun (--resume) completes it. Real subprocesses on the embedded tiny-mars."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    return env


def start(*args: str) -> subprocess.Popen:
    """The CLI as a terminal starts it: SIGINT at its default, even where this test run was started in the
    background, whose children inherit SIGINT ignored (Python then installs no KeyboardInterrupt handler, and the
    CLI rightly keeps ignoring it)."""
    return subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=run_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_until(proc: subprocess.Popen, ready, what: str, timeout: float = 90.0) -> None:
    """Poll `ready()` (a file appearing, a handler installed) instead of sleeping a guessed time."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if ready():
            return
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"exited ({proc.returncode}) before {what}: {err[-2000:]}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"timed out waiting for {what}")


def catches_sigterm(pid: int) -> bool:
    """The process has a SIGTERM handler (Linux: bit 14 of SigCgt): the CLI entered its clean-stop path."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


def finish(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()


def one_line(err: str, prefix: str) -> str:
    """The stop's single line: no traceback, and exactly one `interrupted` line."""
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("interrupted")]
    assert len(lines) == 1 and lines[0].startswith(prefix), err[-3000:]
    return lines[0]


# The real CLI and signal, with the stream held open after its last step: tiny-mars can finish a short answer before
# a signal sent the moment the handler is installed arrives, and the test must see the stop, not a race.
HELD_OPEN = """
import sys, time
from mars_core.tools import cli
real = cli.generate_stream
def held_open(*args, **kwargs):
    yield from real(*args, **kwargs)
    time.sleep(300)
cli.generate_stream = held_open
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads SigCgt from /proc")
def test_generate_sigterm_exits_143_with_one_line():
    proc = subprocess.Popen([sys.executable, "-c", HELD_OPEN, "generate", "--model", "tiny-mars", "--device", "cpu",
                             "--threads", "1", "--prompt", "What is 2 + 3?", "--max-new-tokens", "64"],
                            cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(proc, lambda: catches_sigterm(proc.pid), "the SIGTERM handler")
    proc.send_signal(signal.SIGTERM)
    out, err = finish(proc)
    assert proc.returncode == 143, err[-3000:]
    line = one_line(err, "interrupted (SIGTERM) after ")
    assert "of at most 64 tokens" in line


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")   # the dropped raise, on purpose
def test_sigterm_swallowed_by_a_finalizer_still_stops():
    """Python prints and drops an exception raised in a `__del__`; a SIGTERM whose handler ran there must still stop
    the command (before: the CLI went on and exited 0)."""
    from mars_core.decode.config import Terminated, sigterm_as_interrupt

    class SignalsOnCollection:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):   # bytecodes, so the handler runs here, inside the finalizer
                pass

    previous = signal.getsignal(signal.SIGTERM)
    reached_the_end = False
    with pytest.raises(Terminated, match="output is complete"):
        with sigterm_as_interrupt():
            SignalsOnCollection()
            reached_the_end = True
    assert reached_the_end                              # the handler's own raise was swallowed, as in the CI failure
    assert signal.getsignal(signal.SIGTERM) is previous


def test_generate_sigint_mid_stream_keeps_the_answer_so_far(monkeypatch, capsys):
    from mars_core.tools import cli

    real = cli.generate_stream

    def one_step_then_ctrl_c(*args, **kwargs):
        yield next(iter(real(*args, **kwargs)))
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "generate_stream", one_step_then_ctrl_c)
    code = cli.main(["generate", "--model", "tiny-mars", "--device", "cpu", "--threads", "1",
                     "--prompt", "What is 2 + 3?", "--max-new-tokens", "32"])
    out, err = capsys.readouterr()
    assert code == 130
    assert out.endswith("|\n") and len(out) > 2            # the first step's tokens, and the stream's line end
    assert one_line(err, "interrupted (SIGINT) after ") .endswith("of at most 32 tokens")
    code = cli.main(["generate", "--model", "tiny-mars", "--device", "cpu", "--threads", "1", "--json",
                     "--prompt", "What is 2 + 3?", "--max-new-tokens", "32"])
    partial = json.loads(capsys.readouterr().out)
    assert code == 130 and partial["partial"] is True and partial["token_ids"]


TAUS = ["0.95", "0.9", "0.85", "0.8", "0.75", "0.7", "0.65", "0.6", "0.55", "0.5"]


def evaluate(out: Path, *extra: str) -> subprocess.Popen:
    return start("finetune.evals.evaluate", "--models", "tiny-mars", "--device", "cpu", "--threads", "1", "--n", "24",
                 "--timing-prompts", "0", "--taus", *TAUS, "--json", str(out), *extra)


def saved_rows(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return data["rows"] if isinstance(data, dict) else data


def test_evaluate_sigint_saves_partial_rows_and_resume_finishes(tmp_path):
    out = tmp_path / "rows.json"
    proc = evaluate(out)
    wait_until(proc, lambda: len(saved_rows(out)) >= 1, "the first finished row")
    proc.send_signal(signal.SIGINT)
    _, err = finish(proc)
    assert proc.returncode == 130, err[-3000:]
    line = one_line(err, "interrupted (SIGINT) after ")
    partial = json.loads(out.read_text())
    assert partial["partial"] is True and 1 <= len(partial["rows"]) < len(TAUS)
    assert f"after {len(partial['rows'])} of {len(TAUS)} rows" in line and "--resume" in line

    again = subprocess.run([sys.executable, "-m", "finetune.evals.evaluate", "--models", "tiny-mars",
                            "--json", str(out)], cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "add --resume" in again.stderr    # the finished rows are not overwritten
    assert json.loads(out.read_text()) == partial

    _, err = finish(evaluate(out, "--resume"))
    rows = json.loads(out.read_text())
    assert isinstance(rows, list) and [r["tau"] for r in rows] == [float(t) for t in TAUS], err[-3000:]
    assert rows[: len(partial["rows"])] == partial["rows"]    # kept, not redone


def test_evaluate_resume_refuses_other_settings_and_needs_json(tmp_path):
    out = tmp_path / "rows.json"
    row = {"model": "tiny-mars", "mode": "mars", "criterion": "prob", "draft_layout": None, "prompt_lookup": None,
           "tau": 0.9, "n": 5, "block_size": 4}
    out.write_text(json.dumps({"partial": True, "rows": [row]}))
    for flags, message in ((["--json", str(out), "--resume"], "n=5"), (["--resume"], "--json FILE")):
        res = subprocess.run([sys.executable, "-m", "finetune.evals.evaluate", "--models", "tiny-mars", "--n", "8",
                              "--device", "cpu", *flags], cwd=REPO, env=run_env(), capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_distill_sigterm_keeps_rows_and_rerun_resumes(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"What is {i} + {i + 1}?" for i in range(60)) + "\n")
    out = tmp_path / "data.jsonl"
    cmd = ("finetune.recipes.distill", "--model", "tiny-mars", "--device", "cpu", "--threads", "1", "--batch-size", "1",
           "--max-new-tokens", "48", "--keep-truncated", "--prompts", str(prompts), "--out", str(out))

    def answered() -> int:
        sidecar = out.with_name(out.name + ".dropped.jsonl")
        return sum(len(p.read_text().splitlines()) for p in (out, sidecar) if p.exists())

    proc = start(*cmd)
    wait_until(proc, lambda: answered() >= 1, "the first answered prompt")
    proc.send_signal(signal.SIGTERM)
    _, err = finish(proc)
    assert proc.returncode == 143, err[-3000:]
    assert "of 60 prompts" in one_line(err, "interrupted (SIGTERM) after ")
    first = answered()
    assert 1 <= first < 60
    rerun = start(*cmd)
    _, err = finish(rerun)
    assert rerun.returncode == 0, err[-3000:]
    assert f"{first} already done" in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    asked = [r["messages"][0]["content"] for r in rows]
    assert len(asked) == len(set(asked)) and answered() == 60


# ----------------------------------------------------------------------------- environment values


@pytest.mark.parametrize("var", ["MARS_CACHE_DIR"])
def test_cache_dir_env_values(monkeypatch, tmp_path, var):
    from mars_core.engine.cache import cache_dir

    monkeypatch.setenv(var, "")
    assert cache_dir() == Path.home() / ".cache" / "mars-playground"    # empty means unset
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for bad in (str(a_file), str(a_file / "under")):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=f"{var}=.*{bad[-6:]}.*(folder|created)"):
            cache_dir()
    monkeypatch.setenv(var, str(tmp_path / "new" / "cache"))
    assert cache_dir().is_dir()


def test_cli_turns_a_bad_env_value_into_exit_2(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    env = {**run_env(), "MARS_ASSETS": str(a_file)}
    res = subprocess.run([sys.executable, "-m", "mars_core", "generate", "--model", "tiny-mars", "--device", "cpu",
                          "--prompt", "hi"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"MARS_ASSETS={str(a_file)!r} is a file" in res.stderr


# ----------------------------------------------------------------------------- decoder inputs


def test_prompt_without_text_is_refused():
    from mars_core import DecodeConfig, generate, load_model

    lm = load_model("tiny-mars", device="cpu")
    for ids in ([lm.mask_id] * 3, [lm.mask_id, lm.eos_ids[0]]):
        with pytest.raises(ValueError, match="only mask-token .* no text"):
            generate(lm, [ids], DecodeConfig(max_new_tokens=4))


def test_tau_control_cannot_store_an_unchecked_value():
    from mars_core.decode.config import TauControl

    tc = TauControl(0.9)
    for bad in (0, -1, float("nan"), "x"):
        with pytest.raises(ValueError, match="tau="):
            tc.value = bad
        with pytest.raises(ValueError, match="tau="):
            tc._value = bad
    assert tc.value == 0.9


# ----------------------------------------------------------------------------- storage faults
# A full, read-only or refusing disk: one line naming the path (exit 2 from a CLI), no temp file or folder and no
# empty output file left behind. ENOSPC is simulated by patching the write path (or by a file-size limit in a
# child), since tests cannot fill a real disk; tests may run as root, where chmod does not stop writes.

import errno  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from mars_core.models import storage  # noqa: E402


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if ".tmp" in p.name or p.name.startswith(".tmp-")
                  or "write-test" in p.name or "export-" in p.name)


@pytest.mark.parametrize("code, words", [(errno.ENOSPC, "no space left"), (errno.EROFS, "read-only"),
                                         (errno.ENAMETOOLONG, "too long"), (errno.EACCES, "permission denied"),
                                         (errno.EPERM, "not permitted"), (errno.EDQUOT, "quota"),
                                         (errno.EIO, "could not be written")])
def test_storage_error_is_one_line_naming_the_path_and_the_fix(code, words):
    msg = storage.storage_error(OSError(code, os.strerror(code)), "/data/run/x.json", "--json x.json")
    assert "\n" not in msg and words in msg and "/data/run/x.json" in msg and "--json x.json" in msg
    assert ": " in msg   # what happened, then the fix


def test_atomic_write_on_a_full_disk_keeps_the_old_file_and_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "rows.json"
    target.write_text("old")
    monkeypatch.setattr(storage.os, "replace", enospc)
    with pytest.raises(ValueError, match="no space left") as info:
        storage.atomic_write_text(target, "new", "--json rows.json")
    assert str(target) in str(info.value) and "\n" not in str(info.value)
    assert target.read_text() == "old" and leftovers(tmp_path) == []


def test_an_atomic_write_by_a_private_writer_gets_the_umask_and_keeps_its_own_bits(tmp_path):
    """safetensors' save_file makes its file 0600; through atomic_path it lands as open() would make it."""
    import torch
    from safetensors.torch import save_file

    old = os.umask(0o027)
    try:
        with storage.atomic_path(tmp_path / "w.safetensors") as tmp:
            save_file({"a": torch.zeros(2)}, str(tmp))
        with storage.atomic_path(tmp_path / "x.sh") as tmp:
            tmp.write_text("#!/bin/sh\n")
            tmp.chmod(0o700)   # a bit the writer set on purpose is kept
    finally:
        os.umask(old)
    assert oct((tmp_path / "w.safetensors").stat().st_mode & 0o7777) == oct(0o640)
    assert oct((tmp_path / "x.sh").stat().st_mode & 0o7777) == oct(0o740)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the umask from Linux's /proc")
def test_reading_the_umask_never_sets_it(tmp_path, monkeypatch):
    """os.umask reads only by setting: meanwhile another thread's new file would get that mode. Where /proc shows
    the umask, plain_permissions must not call os.umask at all."""
    old = os.umask(0o027)
    try:
        monkeypatch.setattr(storage.os, "umask", lambda *_: pytest.fail("os.umask was called"))
        f = tmp_path / "f"
        f.write_bytes(b"")
        f.chmod(0o600)
        storage.plain_permissions(f)
        assert oct(f.stat().st_mode & 0o7777) == oct(0o640)
    finally:
        monkeypatch.undo()
        os.umask(old)


def test_a_run_status_write_on_a_full_disk_keeps_the_old_file_and_no_temp(tmp_path, monkeypatch):
    """finetune.status.write_json (status.json, config.json): the app reads these while the trainer writes them."""
    from finetune import status

    target = tmp_path / "status.json"
    status.write_json(target, {"step": 1})
    monkeypatch.setattr(status.os, "replace", enospc)
    with pytest.raises(OSError, match="No space left"):   # the trainer maps it to its own line
        status.write_json(target, {"step": 2})
    assert json.loads(target.read_text()) == {"step": 1} and leftovers(tmp_path) == []


def test_check_writable_refuses_a_too_long_name_and_a_read_only_folder(tmp_path, monkeypatch):
    from finetune.config import check_output_file

    long = tmp_path / ("x" * 300 + ".jsonl")
    with pytest.raises(ValueError, match="cannot be written .*pass a path you can write to") as info:
        check_output_file("--out", long)
    assert str(long) in str(info.value) and "\n" not in str(info.value)
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):   # root: chmod does not stop writes, so refuse the probe's write instead
            monkeypatch.setattr(Path, "write_bytes", lambda self, data: (_ for _ in ()).throw(
                OSError(errno.EACCES, os.strerror(errno.EACCES), str(self))))
        with pytest.raises(ValueError, match="--output-dir .*cannot be written"):
            storage.check_writable(folder / "run", "--output-dir", folder=True)
    finally:
        folder.chmod(0o755)
    assert leftovers(tmp_path) == []


def test_check_free_space_refuses_before_writing(tmp_path, monkeypatch):
    storage.check_free_space(tmp_path / "new" / "deeper", 1, "a build")   # a folder not made yet: its parent counts
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: SimpleNamespace(total=10**9, used=10**9, free=10**6))
    with pytest.raises(ValueError, match=r"a build needs about 1\.2 GB but only 0\.0 GB is free") as info:
        storage.check_free_space(tmp_path, 1_200_000_000, "a build")
    assert str(tmp_path) in str(info.value) and "MARS_CACHE_DIR" in str(info.value)


def test_distill_full_disk_leaves_no_empty_file_and_no_torn_batch(tmp_path, monkeypatch):
    from finetune.recipes import distill

    out = tmp_path / "out.jsonl"
    monkeypatch.setattr(distill.os, "fsync", enospc)
    with pytest.raises(ValueError, match="no space left") as info:
        distill._append(out, [{"prompt": "p", "answer": "a"}])
    assert str(out) in str(info.value) and not out.exists()
    out.write_text('{"prompt": "q"}\n')
    with pytest.raises(ValueError, match="no space left"):
        distill._append(out, [{"prompt": "p", "answer": "a"}])
    assert out.read_text() == '{"prompt": "q"}\n'


def test_checkpoint_save_on_a_full_disk_leaves_no_temp_folder(tmp_path, monkeypatch):
    from finetune import checkpoint

    def half_write(run, directory, step, elapsed, export=None):
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"half")
        enospc()

    monkeypatch.setattr(checkpoint, "write_checkpoint", half_write)
    acc = SimpleNamespace(wait_for_everyone=lambda: None, num_processes=1, is_main_process=True)
    run = SimpleNamespace(accelerator=acc, out=tmp_path, cfg=SimpleNamespace(keep_checkpoints=2, sharding="no"))
    with pytest.raises(ValueError, match="no space left .*checkpoint-5") as info:
        checkpoint.save_checkpoint(run, 5, 1.0)
    assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_cache_build_refuses_a_full_disk_and_removes_its_temp_folder(tmp_path, monkeypatch):
    import torch

    from mars_core.models import sources

    model, target = torch.nn.Linear(4, 4), tmp_path / "cache" / "smollm2"
    with pytest.raises(ValueError, match="no space left .*the conversion of x.gguf"):
        with sources._cache_build(target, model, "the conversion of x.gguf") as tmp:
            (tmp / "model.safetensors").write_bytes(b"half")
            enospc()
    assert list(target.parent.iterdir()) == []
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: SimpleNamespace(total=1, used=1, free=0))
    with pytest.raises(ValueError, match="needs about 0.1 GB but only 0.0 GB is free"):
        with sources._cache_build(target, model, "the conversion of x.gguf"):
            pytest.fail("built without room")
    assert list(target.parent.iterdir()) == []


def test_clis_turn_an_oserror_into_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from finetune.config import run_main
    from mars_core.tools import cli

    def full():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "rows.json"))

    with pytest.raises(SystemExit) as info:
        run_main(full)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "no space left" in err and "rows.json" in err
    monkeypatch.setattr(cli, "cmd_export", lambda args: full())
    assert cli.main(["export", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: no space left") and "rows.json" in err


def test_a_file_size_limit_in_a_child_is_one_line_and_leaves_no_temp(tmp_path):
    """A real failing write (not a patched one): RLIMIT_FSIZE makes the write fail with EFBIG, as a full disk does."""
    target = tmp_path / "big.json"
    code = ("import resource, signal, sys\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))\n"
            "from finetune.config import run_main\n"
            "from mars_core.models.storage import atomic_write_text\n"
            f"run_main(lambda: atomic_write_text({str(target)!r}, 'x' * 100_000, '--json big.json'))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=run_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and str(target) in proc.stderr
    assert list(tmp_path.iterdir()) == []
