"""Full mode's shard files: safetensors files written while their tensors are produced, and which blob lives in
which shard.

Each value's bytes go straight from the tensor into the open shard (`ShardFile`: data first, the header at the
end) at the moment it is produced, so full mode holds no copy in memory and a later in-place write cannot change
what was recorded. A shard whose header room is full is finished early and the next gets more room (`ShardStore`).

In: tensors to store, keyed by their blob key (the trace writer's values). Out: *.safetensors files in the trace
directory, any safetensors reader reads them.
"""
from __future__ import annotations

import ctypes
import os
import re
import struct
from pathlib import Path

import torch

from divtrace.errors import DivtraceError
from divtrace.trace.files import SHARD_PATTERN, compact_encoder, temp_beside
from divtrace.trace.fingerprint import flat_bytes

# safetensors' names of the dtypes it stores (from the installed safetensors where it says, so a newer one's
# additions are used); any other dtype is stored as its raw bytes (U8) and viewed back by the reader.
try:
    from safetensors.torch import _TYPES as _ST_TYPES
except ImportError:  # pragma: no cover - every safetensors divtrace supports has it
    _ST_TYPES = {}
ST_NAMES = {dt: name for name, dt in _ST_TYPES.items()} or {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


_ENCODE = compact_encoder()
_FIRST_ROOM = 16 << 10  # header bytes reserved in a trace's first shard; each overflow quadruples it
_MAX_ROOM = 64 << 20  # safetensors refuses headers over 100 MB


def _write_at(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _memory_view_factory():
    """A read-only memoryview over `n` bytes at an address (CPython's PyMemoryView_FromMemory): 1 us, where a
    ctypes array of a length not seen before costs 21 us (a new ctypes type per length; 350 values a forward)."""
    try:
        f = ctypes.pythonapi.PyMemoryView_FromMemory
    except AttributeError:  # not CPython
        return lambda addr, n: (ctypes.c_char * n).from_address(addr)
    f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int], ctypes.py_object
    return lambda addr, n: f(addr, n, 0x100)  # PyBUF_READ


_memory_at = _memory_view_factory()


def _tensor_bytes(t: torch.Tensor):
    """(buffer, owner): `t`'s bytes in logical order, and the tensor that holds them (keep it alive while the
    buffer is used). A contiguous CPU tensor's own memory, with no torch op (none goes through the recorder's
    dispatch mode); else a contiguous CPU copy."""
    n = t.numel() * t.element_size()
    if t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        return _memory_at(t.data_ptr(), n), t
    flat = flat_bytes(t).cpu()
    return _memory_at(flat.data_ptr(), n), flat


def _entry(t: torch.Tensor, offset: int) -> dict:
    n = t.numel() * t.element_size()
    name, numel = ST_NAMES.get(t.dtype), t.numel()
    if name is None:  # no safetensors dtype: its raw bytes, viewed back by the reader
        name, numel = "U8", n
    return {"dtype": name, "shape": [numel], "data_offsets": [offset, offset + n]}


_PLAIN_KEY = re.compile(r"[\w.-]*\Z", re.ASCII)  # what JSON writes as it is between quotes (blob keys)


def _entry_len(key: str, entry: dict) -> int:
    """len of `"key":{...}` as the header's JSON writes it (checked against the header at finish)."""
    if _PLAIN_KEY.match(key) is None:
        return len(_ENCODE({key: entry})) - 2
    a, b = entry["data_offsets"]
    return (len(key) + len(entry["dtype"]) + len(str(entry["shape"][0])) + len(str(a)) + len(str(b))
            + 45)  # the 45 fixed characters of '"":{"dtype":"","shape":[],"data_offsets":[,]}'


class ShardFile:
    """One safetensors shard, written while its tensors are produced.

    safetensors puts its header (names, dtypes, offsets) before the data, and the header is known only once
    the shard is done. So the data goes first, after `room` bytes left for the header, and the header
    (padded with spaces, which the format allows) is written at `finish`, before the temp file is renamed
    into place. Each value's bytes thus go straight from the tensor into the file at the moment it is
    produced: full mode holds no copy in memory. (Copying values into reused arenas for a background writer,
    the design before, cost 2-4x `save_file`'s time on the project's VM: the arenas' fresh pages, the extra
    copy, and a writer thread that fell behind on two cores.)"""

    def __init__(self, path: Path, room: int) -> None:
        self.path, self.room = path, room
        self.fd: int | None
        self.fd, self.tmp = temp_beside(path)
        self.header: dict = {}
        self.header_len = 2  # "{}"
        self.size = 0  # data bytes written

    def add(self, key: str, t: torch.Tensor) -> bool:
        """Write `t`'s bytes; False (nothing written) when its header entry does not fit the room left."""
        entry = _entry(t, self.size)
        grow = _entry_len(key, entry) + (1 if self.header else 0)  # '"key":{...}' and a comma
        if self.header_len + grow > self.room:
            return False
        n = entry["data_offsets"][1] - self.size
        if n:
            buf, owner = _tensor_bytes(t)
            _write_at(self.fd, buf, 8 + self.room + self.size)
            del buf, owner
        self.header[key] = entry
        self.header_len += grow
        self.size += n
        return True

    def finish(self) -> int:
        """Write the header and move the file into place (not fsynced: a shard an OS crash cut short fails its
        tensors' fingerprints when read). Returns the file's size."""
        head = _ENCODE(self.header).encode()
        assert len(head) == self.header_len <= self.room, (len(head), self.header_len, self.room)
        _write_at(self.fd, struct.pack("<Q", self.room) + head + b" " * (self.room - len(head)), 0)
        os.close(self.fd)
        self.fd = None
        os.replace(self.tmp, self.path)
        return 8 + self.room + self.size

    def discard(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


def write_shard(path: Path, tensors: dict) -> int:
    """Write tensors as one safetensors file (flat, in logical order), atomically, by the shard writer that
    full mode uses; returns the file's size. No digest of the file is taken: every tensor in a trace's shard
    is content-addressed by its fingerprint (the blob key), which the reader checks on every read. (A sha256
    of each shard, taken before, made the writer 1.7x slower than `save_file` and caught nothing the
    fingerprints miss.)"""
    header, offset = {}, 0
    for key, t in tensors.items():
        header[key] = e = _entry(t, offset)
        offset = e["data_offsets"][1]
    shard = ShardFile(path, -(-len(_ENCODE(header)) // 8) * 8)
    try:
        for key, t in tensors.items():
            if not shard.add(key, t):
                raise AssertionError("header room")  # sized from the same entries above
        return shard.finish()
    except BaseException:
        shard.discard()
        raise


class ShardStore:
    """The shards of one trace recorded in full mode: the one being filled, those finished (in order), and the
    shard each blob is in. Content-addressed: views, reshapes and copies of the same bytes share one blob."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.blobs: dict[str, str] = {}  # blob key -> shard file it lives in (or will, once finished)
        self.names: list[str] = []  # finished shards, in order
        self.open: ShardFile | None = None  # the shard being filled
        self._room = _FIRST_ROOM
        self.bytes_written = 0  # bytes of the finished shards

    def add(self, key: str, t: torch.Tensor) -> str:
        """Write `t`'s bytes into the open shard now (later code may overwrite `t`); the shard's name. OSError
        when the write fails."""
        if self.open is None:
            self.open = ShardFile(self.path / SHARD_PATTERN.format(len(self.names)), self._room)
        if not self.open.add(key, t):
            # Its header is full: finish it as it is (the records pointing to it are written at the next
            # flush, after it) and give the next shard more room.
            self.finish()
            self._room = min(self._room * 4, _MAX_ROOM)
            self.open = ShardFile(self.path / SHARD_PATTERN.format(len(self.names)), self._room)
            if not self.open.add(key, t):
                raise DivtraceError(f"{self.path}: blob key {key[:80]!r} too long for a shard header")
        name = self.open.path.name
        self.blobs[key] = name
        return name

    def finish(self) -> None:
        """Finish the open shard (its header written, moved into place)."""
        shard, self.open = self.open, None
        try:
            self.bytes_written += shard.finish()
        except BaseException:
            shard.discard()
            raise
        self.names.append(shard.path.name)

    def discard(self) -> None:
        """Remove the open shard unfinished (no record points to it)."""
        if self.open is not None:
            self.open.discard()
            self.open = None
