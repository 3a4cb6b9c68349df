"""The trace directory a recording writes into: created, checked (never mixed with another trace or unrelated
files) and locked for the recording process, so two recordings cannot interleave their files.

In: the path `record()` was given and `overwrite`. Out: the directory, ready and locked (`prepare_trace_dir`), the
lock released at close; `check_not_busy` for the CLI before it builds a model.
"""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from divtrace.errors import DivtraceError
from divtrace.oserrors import os_reason
from divtrace.trace.files import CHECKSUMS, META, RECORDS, SHARD_GLOB
from divtrace.trace.layouts import LAYOUTS
from divtrace.trace.param_names import PARAMS
from divtrace.trace.token_store import TOKEN_FILES

LOCK = ".divtrace-lock"  # {"pid", "host"} of the process recording into the directory; removed at close


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    except (OSError, OverflowError, ValueError):
        return False
    return True


def _lock_owner(lock: Path) -> dict | None:
    """The lock's {"pid", "host"} when a live process holds it, None when it is stale (its process is gone, or
    the file is unreadable: a recorder killed between creating and filling it)."""
    try:
        owner = json.loads(lock.read_text())
        pid = int(owner["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if owner.get("host") not in (None, platform.node()):
        return owner  # another machine's process (a shared file system): cannot tell, so it holds
    return owner if pid != os.getpid() and _pid_alive(pid) else None


def _busy_error(path: Path, lock: Path, owner: dict) -> DivtraceError:
    host = f" on {owner['host']}" if owner.get("host") not in (None, platform.node()) else ""
    return DivtraceError(f"{path}: is being recorded by process {owner['pid']}{host} (lock {lock}); wait for it to "
                         "finish or record into another --out (if that process is gone, remove the lock file)")


def check_not_busy(path: Path) -> None:
    """DivtraceError at once when a live process is recording into `path` (before a model is built for nothing);
    `take_lock` settles it for good."""
    owner = _lock_owner(Path(path) / LOCK) if (Path(path) / LOCK).exists() else None
    if owner is not None:
        raise _busy_error(Path(path), Path(path) / LOCK, owner)


def take_lock(path: Path) -> Path:
    """Create `path`/LOCK naming this process; a lock whose process is dead is replaced. DivtraceError when a
    live process holds it (two recordings into one directory would interleave their files)."""
    lock = path / LOCK
    body = json.dumps({"pid": os.getpid(), "host": platform.node()}).encode()
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            owner = _lock_owner(lock)
            if owner is not None:
                raise _busy_error(path, lock, owner) from None
            try:
                lock.unlink()  # stale: left by a killed recording
            except FileNotFoundError:
                pass
            continue
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        return lock
    raise DivtraceError(f"{path}: another process keeps taking the lock {lock}; record into another --out")


def release_lock(lock: Path | None) -> None:
    if lock is None:
        return
    try:
        owner = json.loads(lock.read_text())
        if int(owner.get("pid", -1)) == os.getpid():
            lock.unlink()
    except (OSError, ValueError, TypeError):
        pass


def prepare_trace_dir(path: Path, overwrite: bool) -> tuple[Path, bool]:
    """Create `path` and lock it for this process, refusing to mix with an existing trace, with unrelated files
    or with a recording still running into it. Returns (the lock, whether the directory was created here)."""
    try:
        if path.exists() and not path.is_dir():
            raise DivtraceError(f"{path}: exists and is not a directory")
        created = not path.exists()
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DivtraceError(f"{path}: cannot write trace directory: {os_reason(e)}") from None
    lock = None
    try:
        lock = take_lock(path)
        entries = [p for p in path.iterdir() if p.name != LOCK]
        if (path / META).exists():
            if not overwrite:
                raise DivtraceError(f"{path}: already holds a trace (pass overwrite=True / --overwrite to "
                                    "replace it)")
            for p in entries:
                if p.name in (META, RECORDS, CHECKSUMS, *TOKEN_FILES, LAYOUTS, PARAMS) or p.match(SHARD_GLOB) or p.name.endswith(".tmp"):
                    p.unlink()
        elif entries:
            raise DivtraceError(f"{path}: directory is not empty and holds no trace; choose a new directory")
        probe = path / ".divtrace-write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except BaseException as e:
        release_lock(lock)
        removed = remove_if_created(path, created)
        if isinstance(e, OSError):
            raise DivtraceError(f"{path}: cannot write trace directory: {os_reason(e)}"
                                + ("; the directory was removed" if removed else "")) from None
        raise
    return lock, created


def remove_if_created(path: Path, created: bool) -> bool:
    """Remove `path` when this run created it and it holds nothing (or only what this run wrote); whether it did."""
    if not created:
        return False
    try:
        for p in path.iterdir():
            if p.name in (META, RECORDS, CHECKSUMS, LOCK, ".divtrace-write-probe", *TOKEN_FILES, LAYOUTS, PARAMS) \
                    or p.name.endswith(".tmp"):
                p.unlink()
        path.rmdir()
        return True
    except OSError:
        return False
