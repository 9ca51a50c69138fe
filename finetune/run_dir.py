"""The run folder (``--output-dir``) around a finetune.train run: checking and claiming it, writing what a run
starts with, the status a failed or stopped start leaves, and the exit code and line of a stopped run.

What the folder holds is described in finetune.train's docstring; status.json and metrics.jsonl themselves are
finetune.status's, checkpoints finetune.checkpoint's. Only the main process (RANK 0) writes here.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from finetune.checkpoint import CONFIG_FILE, all_checkpoints, keep_metrics, list_checkpoints
from finetune.config import TrainConfig, refuse_file_above
from finetune.data import MANIFEST_FILE, write_manifest
from finetune.status import (
    METRICS_FILE, STOP_REQUEST, RunClaim, RunStatus, failed_status, read_metrics_rows, read_status, write_json,
    write_status,
)
from finetune.train_model import Run, StopFlag
from mars_core.models.storage import check_writable


def check_output_dir(output_dir: str) -> Path:
    """--output-dir is (or can become) a directory this process can write to; checked before any loading."""
    out = Path(output_dir).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output-dir {output_dir!r} is a file, not a directory: pass a new or existing directory")
    refuse_file_above(out, f"--output-dir {output_dir!r}", "pass a directory path")
    check_writable(output_dir, "--output-dir", "pass a directory you can write to", folder=True)
    return out


def has_history(out: Path) -> bool:
    """Whether --output-dir holds an earlier run: a checkpoint folder (complete or not) or a logged step."""
    return bool(all_checkpoints(out) or read_metrics_rows(out / METRICS_FILE))


def claim_run_dir(out: Path, restart: bool) -> RunClaim | None:
    """Take the run folder (the main process; the others follow it); with --restart, move an earlier run aside
    first, by rename: nothing of it is deleted."""
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    claim = RunClaim(out).acquire()
    if not (restart and has_history(out)):
        return claim
    try:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside, n = out.with_name(f"{out.name}.old-{stamp}"), 1
        while aside.exists():
            n += 1
            aside = out.with_name(f"{out.name}.old-{stamp}-{n}")
        os.rename(out, aside)   # the claim's lock file goes with it, so no one enters the old run meanwhile
        claim.moved_to(aside)
        fresh = RunClaim(out).acquire()
    finally:
        claim.release()
    print(f"[finetune.train] --restart: moved the earlier run to {aside}", file=sys.stderr)
    return fresh


def write_failed_status(cfg: TrainConfig, out: Path, exc: BaseException) -> None:
    """Setup failed before a Run existed: still tell the app why (main process only; called only while this
    process holds the run folder, so it never overwrites another trainer's status.json)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    try:
        before = read_status(out)   # a refused resume keeps the run's real step and checkpoint
        checkpoints = list_checkpoints(out)
        last = str(checkpoints[-1]) if checkpoints else None
        write_status(out, failed_status(before, cfg.max_steps, last, f"{type(exc).__name__}: {exc}"))
    except OSError:  # an unwritable --output-dir is what failed: the error message says so
        pass


def drop_stale_stop_request(out: Path, started_at: float) -> None:
    """A Stop request older than this command was left by an earlier run in this folder (one that died before
    reading it): not this run's. A newer one is: the app's Stop can come while this process still imports torch.
    ``started_at``: when this command started (finetune.train's STARTED_AT, taken before its slow imports)."""
    request = out / STOP_REQUEST
    try:
        if request.stat().st_mtime < started_at - 60:   # the launcher's own start-up comes before ours
            request.unlink()
    except OSError:
        pass


def stopped_before_start(cfg: TrainConfig, out: Path, stop: StopFlag) -> int:
    """Signalled before setup: record "stopped" where the run stands (step 0, or a resumable checkpoint's)."""
    main_process = int(os.environ.get("RANK", "0")) == 0
    before = read_status(out) or RunStatus()
    step = before.step or 0
    checkpoints = list_checkpoints(out)
    last = str(checkpoints[-1]) if checkpoints else None
    if main_process:
        write_status(out, RunStatus.of_this_process("stopped", step, before.max_steps or cfg.max_steps, last))
    return stop_exit(out, stop, step, step, before.max_steps or cfg.max_steps, last, main_process)


def stop_exit(out: Path, stop: StopFlag, step: int, start_step: int, total_steps, last_checkpoint,
              main_process: bool) -> int:
    """One line and 130 (SIGINT) / 143 (SIGTERM), as every command stopped by a signal; 0 when the app's Stop
    asked for it (a requested end is a normal end)."""
    requested = (out / STOP_REQUEST).exists()
    if requested and int(os.environ.get("WORLD_SIZE", "1")) == 1:   # (other processes may still have to read it)
        (out / STOP_REQUEST).unlink(missing_ok=True)   # read: a later run in this folder must not take it as its own
    if step == start_step:
        where = f"before step {step + 1}: nothing to save" + (f"; {last_checkpoint} is as it was"
                                                                if last_checkpoint else "")
    else:
        where = f"after step {step} of {total_steps}; last checkpoint: {last_checkpoint}"
    if requested:
        if main_process:
            print(f"[finetune.train] stopped ({stop.signal_name}) {where}", file=sys.stderr)
        return 0
    if main_process:
        print(f"interrupted ({stop.signal_name}) {where}: rerun the same command to resume", file=sys.stderr)
    return 143 if stop.signal_name == "SIGTERM" else 130


def start_run_dir(run: Run) -> None:
    """Write the run's config, drop metrics logged after the resumed checkpoint (about to be redone), and say
    what is about to happen."""
    run.out.mkdir(parents=True, exist_ok=True)
    write_json(run.out / CONFIG_FILE, run.cfg.to_dict())
    if run.manifest is not None:
        write_manifest(run.out / MANIFEST_FILE, *run.manifest)
    keep_metrics(run.out / METRICS_FILE, run.out / METRICS_FILE, run.start_step)
    where = f"resuming from {run.resumed_from} at step {run.start_step}" if run.resumed_from else "starting"
    n_params = sum(p.numel() for p in run.module.parameters())
    n_train = sum(p.numel() for p in run.module.parameters() if p.requires_grad)
    print(
        f"[finetune.train] {where}; {len(run.examples)} examples, {run.total_steps} steps, "
        f"{run.accelerator.num_processes} process(es), {n_train:,}/{n_params:,} trainable parameters",
        file=sys.stderr,
    )
