"""How a command ends when something other than its flags fails: one line naming the fault and the fix, exit 2,
never a traceback; a closed pipe ends it quietly, as it ends a Unix tool.

- stdout: a print whose write fails raises an OSError that names no file, and it was worded as a disk fault at
  "?". ``guarded_stdout`` marks such failures (``StdoutFault``) so ``stdout_exit`` can name stdout, or stay silent
  when the reader went away (``| head -c 1``).
- memory: ``out_of_memory`` recognises an allocation failure however it arrives (a MemoryError, torch's "can't
  allocate memory", ENOMEM, or a loader's ValueError raised while handling one), and ``out_of_memory_line`` says
  so with the size of the model's weights, instead of blaming a good config.json.
"""
from __future__ import annotations

import codecs
import errno
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

# What a Unix tool killed by SIGPIPE exits with, as the shell reports it
SIGPIPE_EXIT = 128 + signal.SIGPIPE


class StdoutFault(Exception):
    """Writing the command's own output to stdout failed (a closed pipe, a redirect to a full disk)."""

    def __init__(self, exc: OSError):
        super().__init__(str(exc))
        self.exc = exc


class GuardedStdout:
    """A text stream whose failed write or flush raises ``StdoutFault``; everything else is the wrapped stream's."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise StdoutFault(exc) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise StdoutFault(exc) from None

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextmanager
def guarded_stdout():
    """sys.stdout as a ``GuardedStdout`` for the block, flushed at its end (so what is still buffered fails inside
    the command, not at interpreter exit). On a stdout that cannot encode all of Unicode (LC_ALL=C: ASCII) a
    character it cannot hold is written as a backslash escape: a model's answer is never an encoding error."""
    real = sys.stdout
    if real is None:   # no stdout at all (pythonw): nothing to guard
        yield
        return
    errors = getattr(real, "errors", None)
    narrow = _narrow_encoding(real)
    if narrow:
        real.reconfigure(errors="backslashreplace")
    sys.stdout = GuardedStdout(real)
    try:
        yield
        sys.stdout.flush()
    finally:
        sys.stdout = real
        if narrow:
            real.reconfigure(errors=errors)


def _narrow_encoding(stream) -> bool:
    try:
        name = codecs.lookup(stream.encoding).name
    except (AttributeError, LookupError, TypeError):
        return False
    return not name.startswith("utf") and hasattr(stream, "reconfigure")


def stdout_exit(fault: StdoutFault) -> int:
    """The exit of a command whose stdout failed: a closed pipe quietly (SIGPIPE's status), else one line
    naming stdout on stderr and 2."""
    exc = fault.exc
    _discard_stdout()   # what is still buffered would fail again at exit, with Python's own message
    if exc.errno == errno.EPIPE:
        return SIGPIPE_EXIT
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        why = "no space left on the device it is redirected to"
        fix = "free space there, or redirect stdout to another device"
    else:
        why = exc.strerror or str(exc)
        fix = "check where stdout goes (the redirect or the pipe)"
    print(f"error: stdout could not be written ({why}): {fix}", file=sys.stderr)
    return 2


def _discard_stdout() -> None:
    """Point file descriptor 1 at /dev/null, so the interpreter's final flush has somewhere to go."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, sys.stdout.fileno())
        finally:
            os.close(null)
    except (OSError, ValueError, AttributeError):   # not a real file (a test's captured stdout): nothing to do
        pass


# ----------------------------------------------------------------------------- memory

# "failed to map segment": the dynamic loader's words when a shared library (scipy's OpenBLAS, which transformers
# imports) cannot be mapped into an address space that is full
_OOM_WORDS = ("can't allocate memory", "cannot allocate memory", "out of memory", "failed to allocate",
              "failed to map segment")


def out_of_memory(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from or while handling, is an allocation failure."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
            return True
        if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
            return True
        if isinstance(exc, (RuntimeError, ImportError, OSError)) and any(w in str(exc).lower() for w in _OOM_WORDS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def weights_size(name_or_path) -> int | None:
    """Bytes of the model's weight files on disk (None where they are not local: a hub id, a GGUF to convert)."""
    try:
        from mars_core.models.sources import resolve_source

        kind, where = resolve_source(name_or_path)
    except Exception:   # a bad name is not this message's business
        return None
    if kind == "gguf":
        return Path(where).stat().st_size
    if kind != "dir":
        return None
    folder = Path(where)
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in folder.glob(pattern)) or None


def out_of_memory_line(name_or_path) -> str:
    """One line for an allocation failure while loading or running ``name_or_path``."""
    size = weights_size(name_or_path)
    sized = f" (its weights take {size / 1e6:,.1f} MB on disk, more once loaded)" if size else ""
    return (f"out of memory loading or running {name_or_path}{sized}: this process could not allocate more; free "
            "memory, raise the limit (ulimit -v / prlimit --as), or use a smaller model or --dtype int8")
