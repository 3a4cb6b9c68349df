"""Files a trace appends to beside records.jsonl (the token files: tokens.jsonl, rows.jsonl, rows.bin), written in
step with the records and covered by the same checksums.

The recorder hands each file's bytes over as it makes them (`add`); nothing reaches the disk until the trace
writer flushes, and then in this order: these files' bytes, the checksums.jsonl line that vouches for them and for
records.jsonl as it will be, then the records. So a token line on disk never refers to a record that is not (the
recorder hands a root call's token lines over only after the call's records), and a killed recording leaves token
files that a checkpoint vouches for up to its last flush: the reader cuts them back to it.

meta.json's `file_checksums` names these files from the start (`{name: null}`: "the checksums cover this file"), and
holds their final `{"sha256", "bytes"}` after close. A trace without the key was written before token files had
checksums: its token files are read unverified, with a warning.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


class ChecksummedFiles:
    """Appended files with a running sha256 each (one per TraceWriter)."""

    def __init__(self, path: Path, names) -> None:
        self.path = Path(path)
        self.names = tuple(names)  # (the trace directory holds none of them yet: trace/directory.py)
        self._pending: dict[str, list[bytes]] = {n: [] for n in self.names}
        self._sha = {n: hashlib.sha256() for n in self.names}
        self._size = dict.fromkeys(self.names, 0)  # bytes on disk, whole
        self._fds: dict[str, int] = {}
        self.pending_bytes = 0
        self.closed = False

    def add(self, name: str, data: bytes) -> None:
        """Bytes to append to `name` at the next flush."""
        if data and not self.closed:
            self._pending[name].append(data)
            self.pending_bytes += len(data)

    def write(self) -> bool:
        """Append every pending byte (bytes first, in the order the names were given); whether anything was written.
        A failed write cuts the file back to its last whole flush and raises the OSError."""
        wrote = False
        for name in self.names:
            chunks = self._pending[name]
            if not chunks:
                continue
            data = b"".join(chunks)
            chunks.clear()
            fd = self._fds.get(name)
            if fd is None:
                fd = self._fds[name] = os.open(self.path / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            except BaseException:
                try:
                    os.ftruncate(fd, self._size[name])
                except OSError:
                    pass
                raise
            self._sha[name].update(data)
            self._size[name] += len(data)
            wrote = True
        self.pending_bytes = 0
        return wrote

    def checkpoint(self) -> dict:
        """{name: [bytes, sha256]} of every file written so far (a checksums.jsonl line's `files`)."""
        return {n: [self._size[n], self._sha[n].hexdigest()] for n in self.names if self._size[n]}

    def final(self) -> dict:
        """{name: {"sha256", "bytes"}} of every file (meta.json's `file_checksums` after close; 0 bytes: never
        written, and absent on disk)."""
        return {n: {"sha256": self._sha[n].hexdigest(), "bytes": self._size[n]} for n in self.names}

    def sync(self) -> None:
        for fd in self._fds.values():
            try:
                os.fsync(fd)
            except OSError:
                pass

    def discard(self) -> None:
        """Forget what was not written (a failed recording writes nothing more)."""
        for chunks in self._pending.values():
            chunks.clear()
        self.pending_bytes = 0

    def close(self) -> None:
        self.closed = True
        self.discard()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
