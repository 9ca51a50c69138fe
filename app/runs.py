"""Finetune jobs: one training process at a time, launched detached, observed through its files.

The job's state lives on disk (runs/<name>/), never in the browser, so a page
refresh — or a restart of the app — re-attaches to a running job. Files:
  written by the trainer (finetune.train, see the team contract): train_config.json,
      status.json, metrics.jsonl, checkpoint-<step>/
  written here: job.json (command, pid, process group), log.txt (stdout+stderr),
      exit_code (the launcher's return code, written when the process ends).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from finetune.config import STAGES, native_bf16_cpu
from finetune.status import METRICS_FILE, STOP_REQUEST, RunStatus, read_metrics_rows, read_status

RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MAX_UPLOAD_BYTES = 20 * 1024 * 1024


def _gpu_visible() -> bool:
    import torch   # asked when a command is built, not at import: the page's start does not wait for torch
    return torch.cuda.is_available()


# accelerate's launcher runs the trainer as a child process (one process; `--cpu` is added only when no GPU is
# visible, so a machine with a GPU trains on it).
# One thread: on a small shared CPU a second thread makes each training step several times slower.
ACCELERATE = ["-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--num_cpu_threads_per_process", "1"]
PLAIN = ["-m", "finetune.train"]


@dataclass
class FinetuneRequest:
    """What the Finetune tab asks for; validated before anything is launched."""
    base_model: str                 # a mars_core model name or an absolute checkpoint path
    data: str = "builtin"           # "builtin" or the path of a chat JSONL inside the run directory
    stage: str = "mars"             # "ar-sft" (stage 1) or "mars" (stage 2)
    block_size: int = 4
    ar_weight: float = 1.0
    max_steps: int = 200
    lr: float = 5e-4
    lora: bool = False
    batch_size: int = 8
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.base_model or len(self.base_model) > 500 or "\n" in self.base_model:
            raise ValueError(f"base model {self.base_model!r} is not a model name or path; pick one from the list")
        if self.stage not in STAGES:
            raise ValueError(f"stage {self.stage!r} is unknown; use one of {STAGES}")
        if not 1 <= int(self.block_size) <= 16:
            raise ValueError(f"block size {self.block_size} is out of range; use 1..16 (the paper uses 4)")
        if not 0.0 <= float(self.ar_weight) <= 10.0:
            raise ValueError(f"ar_weight {self.ar_weight} is out of range; use 0..10 (1.0 = MARS, 0 = no-SFT ablation)")
        if not 1 <= int(self.max_steps) <= 100_000:
            raise ValueError(f"steps {self.max_steps} is out of range; use 1..100000")
        if not 0.0 < float(self.lr) <= 1.0:
            raise ValueError(f"learning rate {self.lr} is out of range; use a value in (0, 1], e.g. 5e-4")
        if not 1 <= int(self.batch_size) <= 256:
            raise ValueError(f"batch size {self.batch_size} is out of range; use 1..256")


def build_command(req: FinetuneRequest, run_dir: Path, launcher: str = "accelerate") -> list[str]:
    """The exact argv that Start runs (shown on the page before it runs)."""
    head = [*ACCELERATE, *([] if _gpu_visible() else ["--cpu"]), *PLAIN] if launcher == "accelerate" else PLAIN
    cmd = [sys.executable, *head,
           "--base-model", req.base_model, "--data", req.data, "--stage", req.stage,
           "--block-size", str(int(req.block_size)), "--ar-weight", f"{float(req.ar_weight):g}",
           "--max-steps", str(int(req.max_steps)), "--lr", f"{float(req.lr):g}",
           "--batch-size", str(int(req.batch_size)), "--seed", str(int(req.seed)),
           "--output-dir", str(run_dir)]
    if req.lora:
        cmd.append("--lora")
    # masks at every phase, as the decoder appends them (docs/experiments/tiny-models.md, "Block phase")
    if req.stage == "mars":
        cmd.append("--random-block-offset")
    if not _gpu_visible() and native_bf16_cpu():   # bf16 autocast + eager attention: faster steps on such a CPU
        cmd += ["--mixed-precision", "bf16", "--attention", "eager"]
    for k, v in req.extra.items():
        cmd += [f"--{k}", str(v)]
    return cmd


def shell_quote(cmd: list[str], wrap: bool = False) -> str:
    """The argv as one shell command; with wrap, each --flag starts a continued line (same command)."""
    import shlex
    words = [shlex.quote(c) for c in cmd]
    if not wrap:
        return " ".join(words)
    lines = [words[0]]
    for w in words[1:]:
        if w.startswith("--") or w == "-m":
            lines.append(w)
        else:
            lines[-1] += " " + w
    return " \\\n    ".join(lines)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl rows, for the loss plot; a half-written last line (the trainer is appending) is skipped."""
    return [row for _, row in read_metrics_rows(run_dir / METRICS_FILE)]


def log_tail(run_dir: Path, n_lines: int = 30) -> str:
    try:
        with open(run_dir / "log.txt", "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 16384))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    # progress bars redraw a line with '\r': keep what each line finally showed
    lines = [line.rsplit("\r", 1)[-1] for line in data.split("\n")]
    return "\n".join([line for line in lines if line.strip()][-n_lines:])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class JobManager:
    """Starts, observes, stops and kills finetune runs under `runs_dir`; one job at a time."""

    def __init__(self, runs_dir: str | Path, launcher: str = "accelerate"):
        self.runs_dir = Path(runs_dir).resolve()
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self.launcher = launcher
        self._lock = threading.Lock()
        self._procs: dict[str, subprocess.Popen] = {}

    # ---- paths ---------------------------------------------------------------------------
    def run_dir(self, name: str) -> Path:
        """runs/<name>, refusing any name that could leave the runs directory."""
        if not isinstance(name, str) or not RUN_NAME_RE.match(name) or ".." in name:
            raise ValueError(f"run name {name!r} is not allowed; use letters, digits, '-', '_' or '.' (max 64)")
        path = (self.runs_dir / name).resolve()
        if path.parent != self.runs_dir:
            raise ValueError(f"run name {name!r} leaves the runs directory")
        return path

    def new_run_name(self, stage: str) -> str:
        base = time.strftime("%Y%m%d-%H%M%S") + f"-{stage}"
        name, k = base, 1
        while (self.runs_dir / name).exists():
            k += 1
            name = f"{base}-{k}"
        return name

    # ---- launching -----------------------------------------------------------------------
    def start(self, req: FinetuneRequest, name: str | None = None, data_file: str | None = None) -> str:
        """Launch the trainer detached (own session) with output to runs/<name>/log.txt."""
        with self._lock:
            running = self.running_job()
            if running:
                raise ValueError(f"run {running!r} is still running; stop it first (one job at a time)")
            name = name or self.new_run_name(req.stage)
            run_dir = self.run_dir(name)
            if run_dir.exists():
                raise ValueError(f"run {name!r} already exists; choose another name")
            run_dir.mkdir(parents=True)
            if data_file is not None:  # an uploaded dataset is copied into the run: the job never reads elsewhere
                dst = run_dir / "data.jsonl"
                dst.write_bytes(Path(data_file).read_bytes())
                req.data = str(dst)
            cmd = build_command(req, run_dir, self.launcher)
            log = open(run_dir / "log.txt", "wb")
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=str(Path(__file__).resolve().parent.parent), env=env,
                                    start_new_session=True)
            log.close()
            job = {"name": name, "pid": proc.pid, "pgid": proc.pid, "command": cmd,
                   "launcher": self.launcher, "request": asdict(req), "started_at": time.time()}
            (run_dir / "job.json").write_text(json.dumps(job, indent=1))
            self._procs[name] = proc
            threading.Thread(target=self._wait, args=(name, proc, run_dir), daemon=True).start()
            return name

    def _wait(self, name: str, proc: subprocess.Popen, run_dir: Path) -> None:
        code = proc.wait()
        (run_dir / "exit_code").write_text(str(code))
        (run_dir / "ended_at").write_text(str(time.time()))

    # ---- observing -----------------------------------------------------------------------
    def _job(self, name: str) -> dict | None:
        return _read_json(self.run_dir(name) / "job.json")

    def is_running(self, name: str) -> bool:
        proc = self._procs.get(name)
        if proc is not None:
            return proc.poll() is None
        job = self._job(name)  # started by an earlier server process: re-attach by pid
        if not job or (self.run_dir(name) / "exit_code").exists():
            return False
        pid = int(job.get("pid", -1))
        return pid > 0 and _pid_alive(pid) and "finetune.train" in _cmdline(pid)

    def list_runs(self) -> list[str]:
        names = [p.name for p in self.runs_dir.iterdir() if p.is_dir() and RUN_NAME_RE.match(p.name)]
        return sorted(names, key=lambda n: (self.runs_dir / n).stat().st_mtime, reverse=True)

    def running_job(self) -> str | None:
        for name in self.list_runs():
            if (self.runs_dir / name / "job.json").exists() and self.is_running(name):
                return name
        return None

    def latest_job(self) -> str | None:
        """The running job, else the most recently started one (what the tab shows after a refresh)."""
        running = self.running_job()
        if running:
            return running
        jobs = [n for n in self.list_runs() if (self.runs_dir / n / "job.json").exists()]
        return jobs[0] if jobs else None

    def status(self, name: str) -> dict:
        """Merged view: the trainer's status.json + process liveness + recorded exit code."""
        run_dir = self.run_dir(name)
        st = read_status(run_dir) or RunStatus()   # a "running" whose trainer is gone reads as "interrupted"
        job = self._job(name) or {}
        running = self.is_running(name) or st.state == "running"   # a CLI run has no job.json
        code_file = run_dir / "exit_code"
        exit_code = None
        if code_file.exists():
            try:
                exit_code = int(code_file.read_text().strip())
            except ValueError:
                exit_code = None
        trainer_state = st.state
        if running:
            state = "running"
        elif exit_code is None:  # ended while no server was watching: trust the trainer's own file
            state = trainer_state if trainer_state in ("finished", "stopped", "failed", "interrupted") else "ended"
        elif exit_code == 0:
            state = trainer_state if trainer_state in ("finished", "stopped") else "finished"
        elif exit_code == -signal.SIGKILL:
            state = "killed"
        elif trainer_state == "stopped":
            state = "stopped"
        else:
            state = "failed"
        return {"name": name, "state": state, "trainer_state": trainer_state, "exit_code": exit_code,
                "step": st.step, "max_steps": st.max_steps or job.get("request", {}).get("max_steps"),
                "eta_s": st.eta_s, "error": st.error, "last_checkpoint": st.last_checkpoint,
                "command": job.get("command"), "started_at": job.get("started_at"), "run_dir": str(run_dir)}

    def finished_checkpoints(self) -> list[tuple[str, str]]:
        """(run name, checkpoint dir) for runs that ended with a saved checkpoint inside runs/."""
        out = []
        for name in self.list_runs():
            st = read_status(self.runs_dir / name) or RunStatus()
            ckpt = st.last_checkpoint
            if st.state not in ("finished", "stopped") or not ckpt or self.is_running(name):
                continue
            path = Path(ckpt).resolve()
            if self.runs_dir in path.parents and (path / "config.json").exists():
                out.append((name, str(path)))
        return out

    def checkpoint_for(self, name: str) -> str:
        self.run_dir(name)  # refuses names that could leave the runs directory
        for n, path in self.finished_checkpoints():
            if n == name:
                return path
        raise ValueError(f"run {name!r} has no finished checkpoint under {self.runs_dir}")

    # ---- stopping ------------------------------------------------------------------------
    def _pgid(self, name: str) -> int:
        job = self._job(name)
        if not job or not self.is_running(name):
            raise ValueError(f"run {name!r} is not running")
        return int(job["pgid"])

    def stop(self, name: str) -> str:
        """SIGTERM to the trainer itself (it saves a checkpoint, then exits).

        accelerate's launcher does not forward signals, so the trainer's pid comes from
        its status.json (checked to be in our process group) or the launcher's child.
        """
        pgid = self._pgid(name)
        st = read_status(self.run_dir(name)) or RunStatus()
        targets = []
        pid = st.pid
        if isinstance(pid, int) and pid > 0 and _pid_alive(pid):
            try:
                if os.getpgid(pid) == pgid:
                    targets.append(pid)
            except ProcessLookupError:
                pass
        if not targets:
            targets = _children(pgid) or [pgid]
        (self.run_dir(name) / STOP_REQUEST).touch()   # the trainer then ends with exit 0, as a requested stop
        for p in targets:
            os.kill(p, signal.SIGTERM)
        return f"sent SIGTERM to pid {', '.join(map(str, targets))}: the trainer saves a checkpoint, then exits"

    def kill(self, name: str) -> str:
        pgid = self._pgid(name)
        os.killpg(pgid, signal.SIGKILL)
        return f"sent SIGKILL to process group {pgid}"


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]
