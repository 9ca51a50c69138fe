"""status.json for readers: whether the trainer that wrote "running" is still alive.

Kept apart from finetune.train (no torch import) so the app can read a run's state cheaply.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


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


def read_status(out: str | Path) -> dict | None:
    """status.json as readers should see it: a "running" whose writer is gone (SIGKILL, power loss) is
    reported as "interrupted", with an error saying how to continue. None when there is no readable file."""
    path = Path(out) / "status.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    if data.get("state") == "running" and not writer_alive(data.get("pid"), data.get("pid_started")):
        data["state"] = "interrupted"
        data["error"] = data.get("error") or (
            f"the training process (pid {data.get('pid')}) ended without a word (killed?) at or after step "
            f"{data.get('step')}: re-run the same command to resume from the last checkpoint")
    return data
