"""The project's line-length rule, enforced without ruff: no tracked Python file has a line over 120 characters.

The limit is the one pyproject.toml's [tool.ruff] section documents (line-length = 120); this test reads it from
there, so the two cannot drift. Characters, not bytes: a line is measured as Python's len() of its decoded text.
No imports of the project: only `git ls-files` and the files' text.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"


def _line_length() -> int:
    """line-length from pyproject.toml's [tool.ruff] section (a plain read, no TOML parser needed on 3.10)."""
    section = re.search(r"^\[tool\.ruff\]\s*$(.*?)(?=^\[|\Z)", PYPROJECT.read_text(encoding="utf-8"), re.M | re.S)
    assert section, "pyproject.toml has no [tool.ruff] section"
    value = re.search(r"^line-length\s*=\s*(\d+)\s*$", section.group(1), re.M)
    assert value, "pyproject.toml's [tool.ruff] section sets no line-length"
    return int(value.group(1))


def _tracked_python() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (or git missing): the tracked files cannot be listed")
    return [REPO / name for name in out.stdout.splitlines() if (REPO / name).is_file()]


def test_line_length_rule_is_120():
    assert _line_length() == 120


def test_no_python_line_over_the_limit():
    limit = _line_length()
    files = _tracked_python()
    assert files, "git ls-files found no Python files"
    offenders = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if len(line) > limit:
                offenders.append(f"{path.relative_to(REPO).as_posix()}:{number}:{len(line)}")
    assert not offenders, (f"{len(offenders)} line(s) over {limit} characters (file:line:length); rewrap them "
                           "(custom_generate/mars_step.py: fix mars_core/decode/ and rerun "
                           "`python -m mars_core.tools.vendor_custom_generate`):\n" + "\n".join(offenders))
