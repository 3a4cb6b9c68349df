"""TraceWriter: streams records and tensor bytes to disk as they are produced.

Full mode writes each new value's bytes into the open safetensors shard the moment the value is produced
(`ShardFile`: data first, the header at the end), so nothing is held in memory and a later in-place write
cannot change what was recorded. Records are buffered; a flush finishes the open shard (atomically: a temp
file renamed into place), then appends the records to records.jsonl. So every record on disk refers only to
bytes already on disk, and a crash at any moment leaves a readable prefix.

Integrity: before each append, `checksums.jsonl` gets the sha256 of records.jsonl as it will be after the
append (a running digest). A reader verifies the records prefix a SIGKILL left behind from it; `close` also
copies the final digest into meta.json. Shard bytes are verified by the records: every stored tensor is
content-addressed by its fingerprint, checked on every read. A failed write (disk full) stops the recording:
records.jsonl is cut back to its last whole flush, the shard being filled is removed, the trace is marked
"error" and a DivtraceError says what failed.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import re
import struct
import time
from pathlib import Path

import torch

from divtrace.errors import DivtraceError
from divtrace.trace.fingerprint import HASH_SCHEME, IMPLEMENTATION, dtype_name, fingerprint, flat_bytes
from divtrace.oserrors import os_reason
from divtrace.trace.records import FORMAT_VERSION, TensorValue, json_safe, record_compact
from divtrace.trace.files import (CHECKSUMS, META, RECORDS, SHARD_GLOB, SHARD_PATTERN, atomic_write_bytes,
                                  compact_encoder, fsync_dir, readable_json, temp_beside)

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


def _record_line(rec, values: list[TensorValue]) -> str:
    # Records and values are flat dataclasses of JSON-ready fields (stats were made safe when taken), so
    # record_compact reads their fields directly: dataclasses.asdict deep-copies and was a third of the cost.
    d = record_compact(rec, values)
    try:
        return _ENCODE(d)
    except ValueError:  # a non-finite float slipped into an op argument
        return _ENCODE(json_safe(d))


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
                if p.name in (META, RECORDS, CHECKSUMS) or p.match(SHARD_GLOB) or p.name.endswith(".tmp"):
                    p.unlink()
        elif entries:
            raise DivtraceError(f"{path}: directory is not empty and holds no trace; choose a new directory")
        probe = path / ".divtrace-write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except BaseException as e:
        release_lock(lock)
        removed = _remove_if_created(path, created)
        if isinstance(e, OSError):
            raise DivtraceError(f"{path}: cannot write trace directory: {os_reason(e)}"
                                + ("; the directory was removed" if removed else "")) from None
        raise
    return lock, created


def _remove_if_created(path: Path, created: bool) -> bool:
    """Remove `path` when this run created it and it holds nothing (or only what this run wrote); whether it did."""
    if not created:
        return False
    try:
        for p in path.iterdir():
            if p.name in (META, RECORDS, CHECKSUMS, LOCK, ".divtrace-write-probe") or p.name.endswith(".tmp"):
                p.unlink()
        path.rmdir()
        return True
    except OSError:
        return False


class TraceWriter:
    def __init__(self, path, *, mode: str, meta: dict, overwrite: bool = False,
                 shard_bytes: int = 128 << 20, flush_records: int = 4096, durable: bool = False):
        if mode not in ("full", "hash"):
            raise DivtraceError(f"mode must be 'full' or 'hash', got {mode!r}")
        self.path = Path(path)
        self.mode = mode
        self._lock, created = prepare_trace_dir(self.path, overwrite)
        # The oldest version that holds what this mode writes, so older readers keep reading what they can:
        # hash mode's only addition in version 2 (the "r" mark) is an optional key they ignore.
        self.meta = dict(meta, format_version=FORMAT_VERSION if mode == "full" else 1, mode=mode, status="running",
                         complete=False, started=time.time(), hash_scheme=HASH_SCHEME, hash_impl=IMPLEMENTATION)
        self._shard_bytes = shard_bytes
        self._durable = durable
        self._flush_records = max(1, int(flush_records))
        self._pending_records: list = []
        self._blobs: dict[str, str] = {}  # blob key -> shard file it lives in (or will, once finished)
        self._shards: list[str] = []  # finished shards, in order
        self._open: ShardFile | None = None  # the shard being filled (full mode)
        self._room = _FIRST_ROOM
        self._records_sha = hashlib.sha256()
        self._records_size = 0  # bytes of records.jsonl known to be whole on disk
        self._sums_size = 0
        self.critical = False  # True while a flush writes: the recorder's signal handlers wait for it
        self.deferred: BaseException | None = None
        self._next_vid = 0
        self.n_records = 0  # records handed to append()
        self.n_written = 0  # records on disk
        self.bytes_written = 0
        self.store_seconds = 0.0  # full mode: time spent writing values' bytes and finishing shards (the write path)
        self.failed: str | None = None  # set when a write failed; nothing more is written after that
        self._closed = False
        fds = []
        try:
            # status "running": an OS crash loses the run anyway, so no fsync (close() fsyncs when durable)
            self._write_meta(durable=False)
            self._records_fd = os.open(self.path / RECORDS, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            fds.append(self._records_fd)
            self._sums_fd = os.open(self.path / CHECKSUMS, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            # Nothing was recorded: leave no directory that looks like a trace (remove what was made here).
            for fd in fds:
                os.close(fd)
            try:
                (self.path / META).unlink()
            except OSError:
                pass
            release_lock(self._lock)
            removed = _remove_if_created(self.path, created)
            raise DivtraceError(f"{self.path}: cannot start the trace: {os_reason(e)}; "
                                + ("the directory was removed" if removed else "nothing was recorded")) from None

    def _sync_data(self) -> None:
        """fsync records.jsonl and every finished shard (best effort: a file system without fsync still closes)."""
        try:
            os.fsync(self._records_fd)
            for name in self._shards:
                fd = os.open(self.path / name, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError:
            pass

    def _write_meta(self, durable: bool) -> None:
        try:  # json_safe walks every field (the module tree: ~0.6 ms a write); only a NaN or Inf needs it
            text = readable_json(self.meta)
        except ValueError:
            text = readable_json(json_safe(self.meta))
        atomic_write_bytes(self.path / META, (text + "\n").encode(), durable)

    # values ---------------------------------------------------------------------------------------------
    def is_buffered(self, vid: int) -> bool:
        """Whether the record defining `vid` is still in memory (not yet written), so it may be amended."""
        return vid >= getattr(self, "_written_vids_below", 0)

    def take_vid(self) -> int:
        vid = self._next_vid
        self._next_vid += 1
        return vid

    def new_value(self, t: torch.Tensor, producer: int | None, fp: tuple[str, dict] | None = None) -> TensorValue:
        """Fingerprint `t` now (and, in full mode, write its bytes into the open shard), returning its new
        value. `fp` is `fingerprint(t)` when the caller has just taken it."""
        src = t
        if self.mode == "full" and fp is None and not (t.is_cpu and t.is_contiguous()):
            # The bytes must be made contiguous (and on the CPU) to be written anyway: torch's copy is
            # cache-blocked, and the fingerprint of the copy is the fingerprint of `t` (both read the logical
            # order), where gathering a transposed weight element by element to hash it cost more than the copy.
            t0 = time.perf_counter()
            src = flat_bytes(t).cpu()
            self.store_seconds += time.perf_counter() - t0  # part of the write path: hash mode needs no copy
        h, stats = fp if fp is not None else fingerprint(src)
        if t.is_cpu:  # (a sixth of the time of t.device, which builds a device object)
            dev = "cpu"
        else:
            dev = t.device
            dev = dev.type if dev.index is None else str(dev)
        v = TensorValue(self.take_vid(), dtype_name(t.dtype), list(t.shape), list(t.stride()), h, dev, stats,
                        producer, None, None, t.numel() * t.element_size())
        if self.mode == "full":
            # Content-addressed: views, reshapes and copies of the same bytes share one blob.
            key = f"{v.dtype.removeprefix('torch.')}-{t.numel()}-{h}"
            shard = self._blobs.get(key)
            v.blob, v.shard = key, shard if shard is not None else self._store(key, src)
        return v

    def _store(self, key: str, t: torch.Tensor) -> str:
        """Write `t`'s bytes into the open shard now (later code may overwrite `t`); the shard's name."""
        self._refuse_after_failure()
        t0 = time.perf_counter()
        try:
            if self._open is None:
                self._open = ShardFile(self.path / SHARD_PATTERN.format(len(self._shards)), self._room)
            if not self._open.add(key, t):
                # Its header is full: finish it as it is (the records pointing to it are written at the next
                # flush, after it) and give the next shard more room.
                self._finish_shard()
                self._room = min(self._room * 4, _MAX_ROOM)
                self._open = ShardFile(self.path / SHARD_PATTERN.format(len(self._shards)), self._room)
                if not self._open.add(key, t):
                    raise DivtraceError(f"{self.path}: blob key {key[:80]!r} too long for a shard header")
        except OSError as e:
            self._fail(e)
        finally:
            self.store_seconds += time.perf_counter() - t0
        name = self._open.path.name
        self._blobs[key] = name
        return name

    def _finish_shard(self) -> None:
        shard, self._open = self._open, None
        try:
            self.bytes_written += shard.finish()
        except BaseException:
            shard.discard()
            raise
        self._shards.append(shard.path.name)

    # records --------------------------------------------------------------------------------------------
    def _refuse_after_failure(self) -> None:
        if self.failed:
            raise DivtraceError(f"{self.path}: recording stopped after a failed write ({self.failed})")

    def append(self, rec, values: list[TensorValue]) -> None:
        self._refuse_after_failure()
        self._pending_records.append((rec, values))
        self.n_records += 1
        if len(self._pending_records) >= self._flush_records or (
                self._open is not None and self._open.size >= self._shard_bytes):
            self.flush()

    def flush(self) -> None:
        """Finish the open shard, then write the pending records after it."""
        if self.failed:
            return
        self.critical = True
        try:
            if self._open is not None:
                t0 = time.perf_counter()
                try:
                    self._finish_shard()
                finally:
                    self.store_seconds += time.perf_counter() - t0
            data = self._take_records()
            if data is not None:
                self._write_records(*data)
        except OSError as e:
            self._fail(e)
        finally:
            self.critical = False
        if self.deferred is not None:  # a signal came while writing: raise it now that the files are whole
            exc, self.deferred = self.deferred, None
            raise exc

    def _fail(self, e: OSError) -> None:
        what = os_reason(e)
        self.failed = f"write failed: {what}"
        self._pending_records = []
        if self._open is not None:
            self._open.discard()
            self._open = None
        raise DivtraceError(f"{self.path}: {self.failed}; recording stopped, the trace keeps the "
                            f"{self.n_written} records written before and is marked incomplete") from None

    def _take_records(self):
        """(records bytes, count) of the pending records, or None; ends the time in which they may be amended."""
        n = len(self._pending_records)
        if not n:
            return None
        data = ("\n".join(_record_line(rec, values) for rec, values in self._pending_records) + "\n").encode()
        self._written_vids_below = self._next_vid
        self._pending_records = []
        return data, n

    def _write_records(self, data: bytes, n: int) -> None:
        """The records checksum line, then the records."""
        running = self._records_sha.copy()
        running.update(data)
        # The digest goes first: a crash between the two writes leaves a digest for bytes that never came,
        # which the reader skips, never bytes without a digest.
        self._append_sums([{"records": self._records_size + len(data), "sha256": running.hexdigest()}])
        self._append(self._records_fd, data, self._records_size)
        self._records_sha = running
        self._records_size += len(data)
        self.bytes_written += len(data)
        self.n_written += n

    def _append_sums(self, sums: list[dict]) -> None:
        data = "".join(json.dumps(s, separators=(",", ":")) + "\n" for s in sums).encode()
        self._append(self._sums_fd, data, self._sums_size)
        self._sums_size += len(data)

    def _append(self, fd: int, data: bytes, whole_size: int | None) -> None:
        """Write all of `data`; on any failure cut the file back to `whole_size` so no half line stays."""
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        except BaseException:
            if whole_size is not None:
                try:
                    os.ftruncate(fd, whole_size)
                except OSError:
                    pass
            raise

    def close(self, status: str = "complete", error: str | None = None, **extra) -> None:
        """Flush everything and mark the trace; `status` other than "complete" marks it incomplete."""
        if self._closed:
            return
        self._closed = True
        flush_error = None
        try:
            self.flush()
        except BaseException as e:  # a failed write, or a signal held during the last write
            flush_error = e
        if self._open is not None:  # not finished (the flush failed): no records point to it, leave no temp file
            self._open.discard()
            self._open = None
        if self.failed:
            status, error = "error", self.failed
        # Durable: records.jsonl and the shards reach the disk before the meta.json that vouches for them
        # (checksums.jsonl is only read while meta.json has no checksums), then the directory entries. Not
        # durable (the default), an OS crash soon after may cut what the page cache held; checksums and
        # fingerprints make that an error when read, never a wrong trace.
        if self._durable:
            self._sync_data()
        for fd in (self._records_fd, self._sums_fd):
            os.close(fd)
        self.meta.update(status=status, complete=(status == "complete"), error=error, records=self.n_written,
                         shards=list(self._shards), finished=time.time(),
                         checksums={"records": {"sha256": self._records_sha.hexdigest(), "bytes": self._records_size},
                                    "shards": {}},  # no shard digests: see write_shard
                         **extra)
        try:
            self._write_meta(durable=self._durable)
            if self._durable:
                fsync_dir(self.path.parent)  # the trace directory's own entry
        except OSError as e:
            # meta.json keeps status "running": still read as incomplete, and the records stay verifiable
            # from checksums.jsonl.
            release_lock(self._lock)
            if flush_error is None or not isinstance(flush_error, DivtraceError):
                raise DivtraceError(f"{self.path / META}: cannot write the final metadata: {e.strerror or e}; "
                                    "the trace is left marked incomplete") from None
        release_lock(self._lock)
        if flush_error is not None:
            raise flush_error
