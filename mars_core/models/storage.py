"""Storage faults as one line: pre-flight checks (a writable folder, enough free space), atomic writes that leave
no temp file behind, and `storage_error`, which turns a full, read-only or otherwise refusing disk into a sentence
naming the path and what to free or change. Standard library only, so finetune/ and the CLIs can import it cheaply.
"""
from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

WHERE_ELSE = "point MARS_CACHE_DIR / --output-dir / --out elsewhere"

# errno -> (what happened, the fix); EFBIG is what a file-size limit (ulimit -f) gives
_FAULTS = {
    errno.ENOSPC: ("no space left on the device holding", f"free space there or {WHERE_ELSE}"),
    errno.EDQUOT: ("the disk quota is used up on", f"free space in your quota or {WHERE_ELSE}"),
    errno.EFBIG: ("a file grew past the allowed size (ulimit -f) at", f"raise the limit or {WHERE_ELSE}"),
    errno.EROFS: ("the file system is read-only at", f"remount it writable or {WHERE_ELSE}"),
    errno.ENAMETOOLONG: ("the file name is too long:", "use a shorter path"),
    errno.EACCES: ("permission denied for", f"make it writable (chmod/chown) or {WHERE_ELSE}"),
    errno.EPERM: ("the operation is not permitted on", f"make it writable (chmod/chown) or {WHERE_ELSE}"),
}


def storage_error(exc: OSError, path: str | os.PathLike | None = None, what: str | None = None) -> str:
    """One line for an OSError met while writing: what happened, at which path, while writing what, and the fix.
    ``path`` defaults to the path the OSError names."""
    where = str(path if path is not None else (exc.filename or "?"))
    doing = f" while writing {what}" if what else ""
    fault = _FAULTS.get(exc.errno)
    if fault is None:
        return f"{where} could not be written{doing} ({exc.strerror or exc}): check the path and the disk"
    happened, fix = fault
    return f"{happened} {where}{doing}: {fix}"


def check_writable(path: str | os.PathLike, what: str, fix: str = "pass a path you can write to",
                   folder: bool = False) -> Path:
    """Pre-flight: ``path`` (a file, or a folder when ``folder``) can be created and written. Its folders are
    created; an existing file is opened for appending (left unchanged), else a probe file is made and removed.
    Raises ValueError '<what> '<path>' cannot be written (<reason>): <fix>'."""
    p = Path(path).expanduser()
    try:
        if folder:
            p.mkdir(parents=True, exist_ok=True)
            probe = p / f".write-test-{os.getpid()}"
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            probe = p.with_name(f".{p.name}.write-test")
        if not folder and p.exists():
            with p.open("ab"):
                pass
        else:
            probe.write_bytes(b"")
            probe.unlink()
    except OSError as exc:
        raise ValueError(f"{what} {str(path)!r} cannot be written ({exc.strerror or exc}): {fix}") from None
    return p


def check_free_space(path: str | os.PathLike, need_bytes: int, what: str) -> None:
    """Pre-flight: the device holding ``path`` (or its nearest existing folder) has ``need_bytes`` free."""
    p = Path(path).expanduser().resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    free = shutil.disk_usage(p).free
    if free < need_bytes:
        raise ValueError(f"{what} needs about {need_bytes / 1e9:.1f} GB but only {free / 1e9:.1f} GB is free on the "
                         f"device holding {p}: free space there or {WHERE_ELSE}")


def _umask() -> int:
    """The process umask, read without setting it where Linux shows it (/proc/self/status, 4.7+): os.umask can
    only be read by setting it, and for that moment a file another thread creates would be world-writable."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)   # elsewhere: the briefest window, and a private one
    os.umask(mask)
    return mask


def plain_permissions(path: str | os.PathLike) -> None:
    """Widen ``path`` (a file, or a folder and everything in it) to what a plain ``open``/``mkdir`` would give
    under the user's umask. safetensors writes its files 0600 and mkdtemp its folders 0700, so without this an
    exported model is unreadable by the other users of a shared machine. Bits are only added, never taken."""
    path = Path(path)
    mask = _umask()
    todo = [path]
    while todo:
        p = todo.pop()
        if p.is_symlink():
            continue
        mode = p.stat().st_mode
        if p.is_dir():
            os.chmod(p, (mode | (0o777 & ~mask)) & 0o7777)
            todo.extend(p.iterdir())
        else:
            os.chmod(p, (mode | (0o666 & ~mask)) & 0o7777)


@contextmanager
def atomic_path(path: str | os.PathLike, what: str | None = None):
    """Yield a temp path next to ``path``; once the block finishes it is renamed onto ``path``. On any failure the
    temp file is removed, ``path`` keeps its old content, and an OSError becomes a one-line ValueError."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        plain_permissions(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        raise ValueError(storage_error(exc, path, what or path.name)) from None
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, what: str | None = None) -> None:
    with atomic_path(path, what) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str, what: str | None = None) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), what)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where the OS or the file
    system cannot, and the caller falls back to two renames."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def replace_folder(new: str | os.PathLike, final: str | os.PathLike) -> None:
    """Put the finished folder ``new`` at ``final``, replacing what is there: the old folder leaves by rename and
    is deleted only once the new one is in place, so a kill at any moment leaves a complete folder at ``final``
    (old or new; with the atomic exchange there is no moment without one) and never a half-deleted one.
    ``new`` must lie beside ``final`` (one file system). It goes in with the permissions of a plainly made folder
    (`plain_permissions`)."""
    new, final = Path(new), Path(final)
    plain_permissions(new)
    if not final.exists() and not final.is_symlink():
        os.replace(new, final)
        return
    if final.is_dir() and not final.is_symlink() and _exchange(new, final):
        shutil.rmtree(new, ignore_errors=True)   # `new` now holds the old folder
        return
    aside = final.with_name(f".{final.name}.old-{os.getpid()}")
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(final, aside)
    try:
        os.replace(new, final)
    except BaseException:
        os.rename(aside, final)   # the new one could not go in: the old one comes back
        raise
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)
