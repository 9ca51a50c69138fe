"""A run directory's live files, status.json and metrics.jsonl: one writer (finetune.train), several readers.

``RunStatus`` is status.json's one record: the trainer writes it through ``StatusWriter`` and every reader
(``read_status``, the app) gets it back from ``read_status``. ``read_metrics_rows`` is the one parser of
metrics.jsonl. Kept apart from finetune.train (no torch import) so the app can read a run's state cheaply.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime, timezone
from pathlib import Path

# Written into the run folder by the app's Stop button (app/runs.py) just before its SIGTERM: a stop asked for from
# the page is how that run is meant to end, so the trainer exits 0; a signal from elsewhere exits 143 / 130.
STOP_REQUEST = "stop-requested"

STATUS_FILE = "status.json"
METRICS_FILE = "metrics.jsonl"
LOCK_FILE = "train.lock"


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), or None off Linux:
    with the pid it tells a live trainer from a later process that got the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def writer_alive(pid, started) -> bool:
    """Whether the process that wrote a status.json still runs (not a zombie, not a reused pid)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive, but it cannot be ours unless the start time says so
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields_ = f.read().rsplit(")", 1)[1].split()
        if fields_[0] == "Z":
            return False
        return started is None or int(fields_[19]) == started
    except (OSError, ValueError, IndexError):
        return True


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, obj) -> None:
    """Atomic write: a reader (the app) never sees half a file, and a failed write (a full disk) leaves no temp
    file behind and the old file as it was. The OSError propagates: callers (the trainer) say what failed."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")   # per process: two writers never share a temp file
    try:
        tmp.write_text(json.dumps(obj, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- status.json


@dataclass
class RunStatus:
    """status.json. Every field may be missing from a file (an older trainer, a hand-written test file): it reads
    as None. "finished" means step == max_steps."""

    state: str | None = None  # running | finished | stopped | failed; read_status adds "interrupted"
    step: int | None = None
    max_steps: int | None = None
    pid: int | None = None
    pid_started: int | None = None  # with pid: tells the trainer from a later process given the same pid
    started_at: str | None = None
    updated_at: str | None = None
    eta_s: float | None = None
    last_checkpoint: str | None = None
    error: str | None = None

    @classmethod
    def of_this_process(cls, state: str, step: int, max_steps: int, last_checkpoint: str | None,
                        error: str | None = None) -> RunStatus:
        """A fresh record written by the calling process."""
        now, pid = utc_now(), os.getpid()
        return cls(state, step, max_steps, pid, process_start(pid), now, now, None, last_checkpoint, error)

    @classmethod
    def from_json(cls, data: dict) -> RunStatus:
        """Unknown keys are ignored, so a file from a newer trainer still reads."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def held_by_another_process(self) -> bool:
        """A live trainer other than this process owns the run (read_status has already marked dead ones)."""
        return self.state == "running" and self.pid != os.getpid()


def read_status(out: str | Path) -> RunStatus | None:
    """status.json as readers should see it: a "running" whose writer is gone (SIGKILL, power loss) is
    reported as "interrupted", with an error saying how to continue. None when there is no readable file."""
    try:
        data = json.loads((Path(out) / STATUS_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    st = RunStatus.from_json(data)
    if st.state == "running" and not writer_alive(st.pid, st.pid_started):
        st.state = "interrupted"
        st.error = st.error or (
            f"the training process (pid {st.pid}) ended without a word (killed?) at or after step "
            f"{st.step}: re-run the same command to resume from the last checkpoint")
    return st


def write_status(out: Path, st: RunStatus) -> None:
    write_json(Path(out) / STATUS_FILE, asdict(st))


def failed_status(before: RunStatus | None, max_steps: int, last_checkpoint: str | None, error: str) -> RunStatus:
    """The record of a run that failed before training started; a refused resume keeps the run's real step."""
    before = before or RunStatus()
    return RunStatus.of_this_process(
        "failed", before.step if before.step is not None else 0,
        before.max_steps if before.max_steps is not None else max_steps, last_checkpoint, error)


class StatusWriter:
    """Keeps one training session's status.json current; only the process given ``write=True`` touches the file."""

    def __init__(self, out: Path, record: RunStatus, write: bool):
        self.out, self.record, self.write = out, record, write

    def update(self, **changes) -> None:
        self.record = replace(self.record, **changes, updated_at=utc_now())
        if self.write:
            write_status(self.out, self.record)


# ----------------------------------------------------------------------------- the run folder's claim


class RunClaim:
    """One trainer per run folder: an flock on <out>/train.lock, holding the trainer's pid, for the run's life.

    Taking it is one atomic call, so two trainers started together cannot both pass (a look at status.json
    followed by a write left a gap of a whole model load). The kernel drops the lock when its process ends,
    however it ends, so a lock file left by a dead trainer is simply taken over."""

    def __init__(self, out: Path):
        self.out, self.fd = Path(out), None

    @property
    def path(self) -> Path:
        return self.out / LOCK_FILE

    def acquire(self) -> RunClaim:
        import fcntl

        self.out.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise ValueError(f"--output-dir {str(self.out)!r} is in use by the training process with pid {holder} "
                                 f"(it holds {LOCK_FILE}): stop it first (SIGTERM saves a checkpoint), or use another "
                                 "--output-dir") from None
            try:   # its last holder may have removed the file between our open and our lock: lock the new one
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def moved_to(self, out: Path) -> None:
        """The folder was renamed (--restart moves a run aside): the claim goes with it."""
        self.out = Path(out)

    def release(self) -> None:
        if self.fd is None:
            return
        try:   # removed while still locked, so nobody can lock the old file after we let go
            if os.path.samestat(os.fstat(self.fd), os.stat(self.path)):
                self.path.unlink()
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


# ----------------------------------------------------------------------------- metrics.jsonl


def read_metrics_rows(path: str | Path, up_to_step: int | None = None) -> list[tuple[str, dict]]:
    """metrics.jsonl as (line, row) pairs, oldest first; with ``up_to_step`` only rows of steps up to it.

    A line cut off by a SIGKILL mid-append, or caught half-written while the trainer appends, is skipped;
    so is any line that is not a row with an integer step."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            if up_to_step is None or row["step"] <= up_to_step:
                rows.append((line, row))
    return rows
