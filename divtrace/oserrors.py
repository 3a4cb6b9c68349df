"""Failed writes said in one line: the path and the system's reason (not "internal error: NotADirectoryError")."""
from __future__ import annotations

import errno
import re

from divtrace.errors import DivtraceError

_REASONS = {errno.ENOSPC: "no space left on device", errno.EROFS: "read-only file system",
            errno.ENOTDIR: "a part of the path is not a directory", errno.EACCES: "permission denied",
            errno.EPERM: "operation not permitted", errno.EDQUOT: "disk quota exceeded"}


def os_reason(e: BaseException) -> str:
    """The system's reason for a failed write, in words: an OSError's strerror, or the OS message inside a
    safetensors error ("Error while serializing: IoError(Os { code: 28, ... message: \"No space left...\" })")."""
    import shutil

    if isinstance(e, shutil.Error) and e.args and isinstance(e.args[0], list) and e.args[0]:
        # copytree's collected failures [(src, dst, "[Errno 28] No space left on device: '...'"), ...]: the first
        why = str(e.args[0][0][-1])
        m = re.match(r"\[Errno (\d+)\] ([^:]+)", why)
        return _REASONS.get(int(m.group(1)), m.group(2)) if m else why
    if isinstance(e, OSError):
        if e.errno in _REASONS:
            return _REASONS[e.errno]
        return e.strerror or str(e) or type(e).__name__
    text = str(e)
    m = re.search(r'code: (\d+).*?message: "([^"]*)"', text)
    if m:
        code = int(m.group(1))
        return _REASONS.get(code, m.group(2))
    return text.splitlines()[0] if text else type(e).__name__


def is_write_error(e: BaseException) -> bool:
    """An OSError, or a safetensors error that wraps one (its type is not importable without safetensors)."""
    return isinstance(e, OSError) or (type(e).__name__ == "SafetensorError" and "IoError" in str(e))


def cannot_write(path, e: BaseException, what: str = "cannot write", after: str = "") -> DivtraceError:
    """The one-line error for a failed write of `path` (exit 2); `after` adds what was done about it."""
    return DivtraceError(f"{path}: {what}: {os_reason(e)}" + (f"; {after}" if after else ""))
