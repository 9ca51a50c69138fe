"""Text files a user hands in, read line by line with errors that name the file, the line and the fix.

``read_lines`` is the one walk over such a file (the prompts files below, finetune.data's chat JSONL) and
``json_line`` the one parse of a JSONL line. ``read_prompts`` reads a prompts file, the same for
``python -m mars_core bench --prompts`` and ``python -m finetune.recipes.distill --prompts``:

- a text file holds one prompt per line: surrounding whitespace is stripped, blank lines and lines starting
  with '#' are skipped, and a literal backslash-n (``\\n``) is a newline inside a prompt;
- a ``.jsonl`` file holds one row per line, ``{"prompt": "..."}`` or a chat row ``{"messages": [...]}`` whose
  first user message is the prompt.

Lines are split at newlines only, so line N of an error is line N in an editor; a leading byte-order mark is
not part of the first line.
"""
from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path

PROMPTS_FIX = "give a text file with one prompt per line (or a .jsonl file of prompt rows)"


def not_a_file(path: str | Path) -> str:
    """What ``path`` is when it is not a regular file, as the rest of a sentence ("is a directory", "is a FIFO
    (named pipe), not a regular file", "does not exist"). A FIFO or a device must not be read as a file: a FIFO
    blocks until a writer comes, /dev/zero never ends, /dev/null looks like an empty file."""
    try:
        mode = Path(path).stat().st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:
        return f"cannot be looked at ({exc.strerror or exc})"
    if stat.S_ISDIR(mode):
        return "is a directory"
    kinds = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    kind = next((word for test, word in kinds if test(mode)), "not a regular file")
    return f"is {kind}, not a regular file" if kind != "not a regular file" else "is not a regular file"


def read_lines(path: str | Path, what: str, fix: str,
               max_line_bytes: int | None = None, too_long: str = "") -> Iterator[tuple[int, str]]:
    """(line number, line without its newline) of a UTF-8 text file; ``what`` names the file in errors
    ("prompts file") and ``fix`` says what to pass instead of a directory, a missing or a binary file. A line
    over ``max_line_bytes`` is refused by number, before it is decoded or held whole (``too_long``: the fix)."""
    name, path = str(path), Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {name!r} {not_a_file(path)}: {fix}")
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise ValueError(f"{what} {name!r} cannot be read ({exc.strerror or exc}): check its permissions") from None
    limit = -1 if max_line_bytes is None else max_line_bytes + 1   # one byte more than allowed: enough to know
    with fh:
        lineno = 0
        while raw := fh.readline(limit):
            lineno += 1
            if max_line_bytes is not None and len(raw.removesuffix(b"\n")) > max_line_bytes:
                size = len(raw) + _rest_of_line(fh)
                raise ValueError(f"{name}:{lineno}: the line is {size:,} bytes, over the limit of "
                                 f"{max_line_bytes:,}: {too_long or fix}")
            try:
                line = raw.decode("utf-8").removesuffix("\n")
            except UnicodeDecodeError as e:
                raise ValueError(f"{name}:{lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} at line {lineno}, column "
                                 f"{e.start + 1}): save the {what} as UTF-8") from None
            if "\x00" in line:
                raise ValueError(f"{name}:{lineno}: holds NUL bytes (a binary file?): {fix}")
            yield lineno, line.removeprefix("\ufeff") if lineno == 1 else line


def _rest_of_line(fh, chunk: int = 1 << 20) -> int:
    """Bytes up to and including the next newline, read a chunk at a time (counted, never held)."""
    n = 0
    while part := fh.readline(chunk):
        n += len(part)
        if part.endswith(b"\n"):
            break
    return n


def json_line(line: str, path: str | Path, lineno: int):
    """One line of a JSONL file, parsed; ValueError naming the file, the line and the column."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg.removesuffix(' at')} at line {lineno}, column "
                         f"{e.colno}); write one JSON object per line") from None


def prompt_of_row(row, where: str) -> str:
    """The prompt of a prompts-JSONL row: its "prompt", or the first user message of its "messages"."""
    try:
        if "prompt" in row:
            prompt = row["prompt"]
        else:
            prompt = next(m["content"] for m in row["messages"] if m["role"] == "user")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("empty prompt")
    except (KeyError, StopIteration, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: not a prompt row ({exc}); expected "
                         '{"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]}') from None
    return prompt


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a text or .jsonl prompts file (the module's docstring has the format)."""
    jsonl = Path(path).suffix == ".jsonl"
    prompts = []
    for lineno, line in read_lines(path, "prompts file", PROMPTS_FIX):
        if not line.strip() or (not jsonl and line.lstrip().startswith("#")):
            continue
        if jsonl:
            prompts.append(prompt_of_row(json_line(line, path, lineno), f"{path}:{lineno}"))
        else:
            prompts.append(line.strip().replace("\\n", "\n"))
    if not prompts:
        raise ValueError(f"prompts file {str(path)!r} has no prompts: write one prompt per line")
    return prompts
