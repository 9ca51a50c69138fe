"""Nothing lost (issue 51): a training run folder is claimed, and its history checked, before anything is written;
an overwrite swaps a finished folder in and deletes the old one last; a Stop before step 1 is a normal end. Each
test is one data loss, silent wrong or traceback the issue found; tiny models, seconds each."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from finetune.train import main
from tests.test_faults import catches_sigterm, run_env, wait_until
from tests.tiny_fixtures import train_flags, train_metrics

REPO = Path(__file__).resolve().parent.parent


def status(out: Path) -> dict:
    return json.loads((out / "status.json").read_text())


def logged_steps(out: Path) -> list[int]:
    try:
        text = (out / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line)["step"] for line in text.splitlines() if line.endswith("}")]


def snapshot(out: Path) -> dict[str, bytes]:
    """Every file of a run folder but status.json (which records each attempt)."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != "status.json"}


# ----------------------------------------------------------------------------- the run folder's claim


def test_two_trainers_started_at_once_into_one_folder_one_exits_2_naming_the_holder(tiny, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "finetune.train",
           *train_flags(tiny, out, "--stage", "ar-sft", "--max-steps", "100000")]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    try:
        deadline = time.time() + 120
        while all(p.poll() is None for p in procs):
            steps = logged_steps(out)
            assert len(steps) == len(set(steps)), f"both trainers ran: steps {steps}"
            assert time.time() < deadline, "neither trainer refused the folder"
            time.sleep(0.05)
        loser = next(p for p in procs if p.poll() is not None)
        winner = next(p for p in procs if p is not loser)
        err = loser.communicate(timeout=30)[1]
        assert loser.returncode == 2, err[-3000:]
        assert "Traceback" not in err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and str(out) in lines[0] and f"pid {winner.pid}" in lines[0], err[-3000:]
        wait_until(winner, lambda: len(logged_steps(out)) >= 2, "the winner's second step")
        winner.send_signal(signal.SIGTERM)
        winner.communicate(timeout=120)
        assert winner.returncode == 143
        steps = logged_steps(out)
        assert steps == list(range(1, len(steps) + 1))   # each step once, in order
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_lock_left_by_a_dead_trainer_is_taken_over_and_released(tiny, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / "train.lock").write_text(f"{dead.pid}\n")   # what a SIGKILLed trainer leaves behind
    assert main(train_flags(tiny, out, "--stage", "ar-sft", "--max-steps", "1")) == 0
    assert status(out)["state"] == "finished"
    assert not (out / "train.lock").exists()


# ----------------------------------------------------------------------------- a run's history


@pytest.mark.parametrize("changed, words", [
    ([], r"every checkpoint in .* is damaged or incomplete \(checkpoint-2, checkpoint-1.*--restart"),
    (["--block-size", "2"], r"block_size=4 .*but this run has block_size=2"),
])
def test_checkpoints_without_trainer_state_are_refused_not_started_over(tiny, tmp_path, changed, words):
    out = tmp_path / "run"
    flags = ["--max-steps", "2", "--save-every", "1", "--keep-checkpoints", "5"]
    main(train_flags(tiny, out, *flags))
    for ckpt in out.glob("checkpoint-*"):
        (ckpt / "trainer_state.pt").unlink()   # the first file a user deletes to free disk: twice the model
    before = snapshot(out)
    with pytest.raises(ValueError, match=words):
        main(train_flags(tiny, out, *flags, *changed))
    assert snapshot(out) == before


def test_a_newest_checkpoint_without_trainer_state_is_skipped_by_name(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    flags = ["--stage", "ar-sft", "--save-every", "1", "--keep-checkpoints", "5"]
    main(train_flags(tiny, out, *flags, "--max-steps", "2"))
    (out / "checkpoint-2" / "trainer_state.pt").unlink()
    capsys.readouterr()
    assert main(train_flags(tiny, out, *flags, "--max-steps", "3")) == 0
    err = capsys.readouterr().err
    assert "checkpoint-2 is damaged (ValueError: it has no trainer_state.pt)" in err
    assert f"resuming from {out.resolve() / 'checkpoint-1'} at step 1" in err
    assert [r["step"] for r in train_metrics(out)] == [1, 2, 3]


def test_a_trainer_state_without_its_optimizer_falls_back_to_the_older_checkpoint(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    flags = ["--stage", "ar-sft", "--save-every", "1", "--keep-checkpoints", "5"]
    main(train_flags(tiny, out, *flags, "--max-steps", "2"))
    state_file = out / "checkpoint-2" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=False)
    del state["optimizer"]
    torch.save(state, state_file)
    capsys.readouterr()
    assert main(train_flags(tiny, out, *flags, "--max-steps", "3")) == 0
    err = capsys.readouterr().err
    assert "checkpoint-2 is damaged (ValueError: trainer_state.pt has no 'optimizer' entry)" in err
    assert "resuming from the older intact checkpoint-1" in err
    assert status(out)["state"] == "finished" and status(out)["step"] == 3


def test_logged_steps_without_a_checkpoint_are_kept_and_restart_moves_them_aside(tiny, tmp_path):
    out = tmp_path / "run"
    flags = train_flags(tiny, out, "--stage", "ar-sft", "--max-steps", "2")
    main(flags)
    shutil.rmtree(out / "checkpoint-2")   # as after a kill before the first save
    metrics = (out / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=r"metrics.jsonl with 2 logged step\(s\) but no checkpoint.*--restart"):
        main(flags)
    assert (out / "metrics.jsonl").read_text() == metrics
    assert main([*flags, "--restart"]) == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and (aside[0] / "metrics.jsonl").read_text() == metrics
    assert [r["step"] for r in train_metrics(out)] == [1, 2] and (out / "checkpoint-2").is_dir()


def drop_every_config(out: Path) -> None:
    for path in out.rglob("train_config.json"):
        path.unlink()


def config_from_another_run(out: Path) -> None:
    """The run's own record replaced by one that agrees with the new command (copied over from another run);
    the checkpoints' copies still say what they were trained with."""
    saved = json.loads((out / "train_config.json").read_text())
    (out / "train_config.json").write_text(json.dumps({**saved, "block_size": 2, "ar_weight": 0.25}))


@pytest.mark.parametrize("damage, changed, key", [
    (drop_every_config, ["--ar-weight", "0.25"], "ar_weight=1.0"),
    (config_from_another_run, ["--block-size", "2", "--ar-weight", "0.25"], "block_size=4"),
])
def test_the_settings_guard_reads_every_surviving_record(tiny, tmp_path, damage, changed, key):
    out = tmp_path / "run"
    main(train_flags(tiny, out, "--max-steps", "1"))
    damage(out)
    before = snapshot(out)
    with pytest.raises(ValueError, match=rf"holds a run with {key} .*but this run has"):
        main(train_flags(tiny, out, "--max-steps", "2", *changed))
    assert snapshot(out) == before


def test_a_run_with_no_settings_record_left_is_refused_not_resumed(tiny, tmp_path):
    """Checkpoints from before the settings were kept in trainer_state.pt, with every train_config.json gone."""
    out = tmp_path / "run"
    main(train_flags(tiny, out, "--max-steps", "1"))
    drop_every_config(out)
    state_file = out / "checkpoint-1" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=False)
    del state["config"]
    torch.save(state, state_file)
    before = snapshot(out)
    with pytest.raises(ValueError, match=r"no record of the settings they were trained with .*--restart"):
        main(train_flags(tiny, out, "--max-steps", "2"))
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- replace, never delete first


def test_export_force_interrupted_while_the_old_export_goes_leaves_a_complete_folder(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from mars_core.models.export import export

    out = tmp_path / "out"
    export("tiny-mars", out, dtype="float32")
    names = sorted(p.name for p in out.iterdir())
    real_rmtree, cut = shutil.rmtree, []

    def signalled_halfway(path, *args, **kwargs):
        """The deletion of a complete export (not of a temp folder) dies after its first file, as under SIGTERM."""
        folder = Path(path)
        if not cut and (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
            cut.append(folder)
            (folder / "model.safetensors").unlink()
            raise KeyboardInterrupt
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", signalled_halfway)
    with pytest.raises(KeyboardInterrupt):
        export("tiny-mars", out, force=True, dtype="bfloat16")
    monkeypatch.undo()
    assert cut and sorted(p.name for p in out.iterdir()) == names
    AutoModelForCausalLM.from_pretrained(out)   # complete: the new export (the old one was being deleted)


def test_the_later_of_two_conversions_of_one_gguf_uses_the_first_ones_folder(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from mars_core.models import sources
    from tests.tiny_fixtures import make_model, make_tokenizer

    monkeypatch.setenv("MARS_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF, read by the fake loader below")
    target = sources._gguf_target(gguf)
    tok = make_tokenizer()
    model = make_model("llama", len(tok))

    def converted_elsewhere_meanwhile(*args, **kwargs):
        """Another process finishes the same conversion while this one dequantises."""
        other = target.parent / ".other-process"
        other.mkdir(parents=True)
        model.save_pretrained(other)
        tok.save_pretrained(other)
        (other / "source.json").write_text(json.dumps({"gguf": str(gguf), "by": "the other process"}))
        os.replace(other, target)
        return model

    monkeypatch.setattr(sources, "AutoTokenizer", SimpleNamespace(from_pretrained=lambda *a, **k: tok))
    monkeypatch.setattr(sources, "AutoModelForCausalLM", SimpleNamespace(
        from_pretrained=converted_elsewhere_meanwhile, from_config=AutoModelForCausalLM.from_config))
    assert sources.gguf_to_checkpoint(str(gguf)) == str(target)
    assert json.loads((target / "source.json").read_text())["by"] == "the other process"
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]   # no temp folder left


def test_export_adapter_replaces_the_adapter_whole_and_keeps_other_files(tiny, tmp_path, monkeypatch):
    from finetune.recipes.export_adapter import export_adapter
    from mars_core.models import adapter

    run = tmp_path / "run"
    main(train_flags(tiny, run, "--lora", "--lora-r", "4", "--max-steps", "1"))
    out = tmp_path / "adapter"
    export_adapter(run / "checkpoint-1", out, dtype="float32")
    (out / "README.md").write_text("my notes")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = adapter.atomic_write_text

    def killed_before_the_config(*args, **kwargs):
        raise KeyboardInterrupt   # the new weights are written, the config not yet

    monkeypatch.setattr(adapter, "atomic_write_text", killed_before_the_config)
    with pytest.raises(KeyboardInterrupt):
        export_adapter(run / "checkpoint-1", out, dtype="bfloat16")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before   # the old adapter, whole
    monkeypatch.setattr(adapter, "atomic_write_text", real)
    export_adapter(run / "checkpoint-1", out, dtype="bfloat16")
    assert json.loads((out / "adapter_config.json").read_text())["dtype"] == "bfloat16"
    assert (out / "README.md").read_text() == "my notes"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".adapter")]


# ----------------------------------------------------------------------------- the app's Stop before step 1


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads SigCgt from /proc")
def test_the_apps_stop_while_the_trainer_starts_ends_it_stopped_with_exit_0(tiny, tmp_path):
    """The app's Stop writes stop-requested, then SIGTERMs the trainer, which may still be importing torch (before:
    killed there, or its start deleted the request as an old one, and it exited 143; accelerate's launcher turns
    either into exit 1 with a traceback)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "stop-requested").touch()   # Stop pressed while the launcher was starting the trainer
    proc = subprocess.Popen([sys.executable, "-m", "finetune.train", *train_flags(tiny, out, "--max-steps", "5")],
                            cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(proc, lambda: catches_sigterm(proc.pid), "a SIGTERM handler")
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "stopped (SIGTERM) before step 1: nothing to save" in err, err[-3000:]
    st = status(out)
    assert st["state"] == "stopped" and st["step"] == 0 and st["last_checkpoint"] is None
    assert not (out / "stop-requested").exists()   # read: a later run here must not take it as its own


# ----------------------------------------------------------------------------- a full disk at the final checkpoint


def full_disk(kind: str) -> BaseException:
    """What each writer raises when the disk fills under it (the texts are the real ones, from a full tmpfs)."""
    import errno

    from safetensors import SafetensorError

    return {"OSError": OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
            "safetensors": SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
            "torch zip": RuntimeError("[enforce fail at inline_container.cc:672] . "
                                      "unexpected pos 178624 vs 178516")}[kind]


@pytest.mark.parametrize("writer, kind", [("torch.save", "OSError"), ("safetensors", "safetensors"),
                                          ("torch.save", "torch zip")])
def test_a_full_disk_at_the_final_checkpoint_keeps_the_previous_one_and_says_so(tiny, tmp_path, monkeypatch,
                                                                                writer, kind):
    import transformers.modeling_utils as modeling_utils

    from finetune import checkpoint

    out = tmp_path / "run"
    final_tmp = out / ".checkpoint-2.tmp"
    module, name = (torch, "save") if writer == "torch.save" else (modeling_utils, "safe_save_file")
    real = getattr(module, name)

    def fills_the_disk_at_the_final_checkpoint(obj, path, *args, **kwargs):
        if Path(path).parent == final_tmp:
            raise full_disk(kind)
        return real(obj, path, *args, **kwargs)

    monkeypatch.setattr(module, name, fills_the_disk_at_the_final_checkpoint)
    if kind == "torch zip":   # torch's zip writer keeps no errno: a device with no space left tells
        real_usage = checkpoint.shutil.disk_usage
        monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: real_usage(p)._replace(free=0))
    flags = train_flags(tiny, out, "--stage", "ar-sft", "--save-every", "1", "--max-steps", "2")
    with pytest.raises(ValueError) as refused:
        main(flags)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"no space left on the device holding {out} while writing checkpoint-2: free space")
    assert message.endswith(f"the previous checkpoint {out / 'checkpoint-1'} is kept as it was: rerun the same "
                            "command to resume from it")
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-1"]
    assert status(out)["state"] == "failed" and status(out)["last_checkpoint"] == str(out / "checkpoint-1")
    monkeypatch.undo()   # space freed: the same command resumes from checkpoint-1 and writes the final one
    assert main(flags) == 0
    assert status(out)["state"] == "finished" and (out / "checkpoint-2" / "trainer_state.pt").is_file()


def test_a_write_fault_that_is_no_disk_fault_is_not_worded_as_one(tmp_path):
    from finetune.checkpoint import write_fault

    assert write_fault(KeyError("optimizer"), tmp_path) is None
    assert write_fault(RuntimeError("CUDA error: an illegal memory access"), tmp_path) is None
    fault = write_fault(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 9 vs 8"), tmp_path)
    assert "unexpected pos 9 vs 8" in str(fault)   # a disk with room: the writer's own words, not "no space"
