"""TraceWriter: streams records and tensor bytes to disk as they are produced.

Records are buffered together with the tensors they define. A flush first writes the pending tensors as one
safetensors shard (atomically), then appends the records to records.jsonl. So every record on disk refers only
to bytes already on disk, and a crash at any moment leaves a readable prefix.

In full mode the writes run on a background thread while the model goes on: the records are encoded on the
caller's thread, then sha256 and the file writes (both release the GIL) run beside the forward. One flush is
in flight at a time, in order, so memory stays bounded by about twice `shard_bytes`: the shard being written
and the one filling up. A failed background write is raised at the next flush or at close.

Integrity: before each append, `checksums.jsonl` gets the sha256 of every new shard and of records.jsonl as
it will be after the append (a running digest). A reader verifies the records prefix a SIGKILL left behind,
and any shard, from it. `close` also copies the final digests into meta.json. A failed write (disk full)
stops the recording: records.jsonl is cut back to its last whole flush, the trace is marked "error" and a
DivtraceError says what failed.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import queue
import struct
import threading
import time
from pathlib import Path

import torch

from divtrace.errors import DivtraceError
from divtrace.fingerprint import HASH_SCHEME, IMPLEMENTATION, dtype_name, fingerprint, flat_bytes
from divtrace.records import FORMAT_VERSION, TensorValue, json_safe, record_compact
from divtrace.trace.files import (CHECKSUMS, META, RECORDS, SHARD_GLOB, SHARD_PATTERN, atomic_write_json,
                                  atomic_write_with, compact_encoder)

# safetensors' names of the dtypes it stores (from the installed safetensors where it says, so a newer one's
# additions are used); any other dtype is stored as its raw bytes (U8) and viewed back by the reader.
try:
    from safetensors.torch import _TYPES as _ST_TYPES
except ImportError:  # pragma: no cover - every safetensors divtrace supports has it
    _ST_TYPES = {}
ST_NAMES = {dt: name for name, dt in _ST_TYPES.items()} or {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


class Arena:
    """Reused memory for the tensor bytes of one shard while it fills and is written.

    Full mode must copy every new value at once (later code may overwrite it). A fresh allocation per copy
    cost more than the rest of full mode together: the OS faults new pages in at ~1-1.7 GB/s on the machines
    we measured, where a copy into memory already touched runs at ~15 GB/s. Two arenas alternate (one
    filling, one being written), so a recording touches at most twice `shard_bytes` of new memory."""

    __slots__ = ("buf", "view", "ptr", "used")

    def __init__(self, nbytes: int) -> None:
        self.buf = torch.empty(nbytes, dtype=torch.uint8)
        self.view = memoryview(self.buf.numpy())
        self.ptr = self.buf.data_ptr()
        self.used = 0

    def take(self, t: torch.Tensor, nbytes: int) -> "ArenaSlice | None":
        """Copy `t`'s bytes in logical order into the arena, or None when they do not fit."""
        off = -(-self.used // 64) * 64  # aligned for any element type
        if off + nbytes > len(self.view):
            return None
        if t.device.type == "cpu" and t.is_contiguous():
            # no torch op: inside the recorder's dispatch mode every op costs a Python round trip
            ctypes.memmove(self.ptr + off, t.data_ptr(), nbytes)
        else:
            try:
                self.buf[off:off + nbytes].view(t.dtype).view(t.shape).copy_(t.detach())
            except RuntimeError:  # a dtype with no byte view
                return None
        self.used = off + nbytes
        return ArenaSlice(self, off, nbytes, t.dtype, t.numel())


class ArenaSlice:
    """A kept tensor's bytes inside an Arena (flat, `numel` elements of `dtype`)."""

    __slots__ = ("arena", "off", "nbytes", "dtype", "numel")

    def __init__(self, arena: Arena, off: int, nbytes: int, dtype: torch.dtype, numel: int) -> None:
        self.arena, self.off, self.nbytes, self.dtype, self.numel = arena, off, nbytes, dtype, numel

    def bytes_view(self) -> memoryview:
        return self.arena.view[self.off:self.off + self.nbytes]


_SHA_BESIDE = 8 << 20  # shards at least this big are hashed on a second thread while they are written
_CHUNK = 4 << 20


def write_shard(path: Path, tensors: dict) -> tuple[str, int]:
    """Write flat contiguous CPU tensors (or ArenaSlices) as one safetensors file, atomically; returns
    (sha256, size).

    The file is the format's 8-byte header length, JSON header (padded to 8 bytes) and the tensors' bytes
    back to back, streamed straight from memory: `safetensors.torch.save` first builds the whole file in
    memory, a copy that cost as much as the write itself. sha256 and the write both release the GIL, so a big
    shard is hashed on a second thread beside the write."""
    header, parts, offset = {}, [], 0
    for key, t in tensors.items():
        if isinstance(t, ArenaSlice):
            dtype, numel, n, data = t.dtype, t.numel, t.nbytes, t.bytes_view()
        else:
            dtype, numel = t.dtype, t.numel()
            n = numel * t.element_size()
            data = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if n else b""
        name = ST_NAMES.get(dtype)
        if name is None:
            name, numel = "U8", n
        header[key] = {"dtype": name, "shape": [numel], "data_offsets": [offset, offset + n]}
        parts.append(data)
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    head = struct.pack("<Q", len(head)) + head
    digest = hashlib.sha256(head)

    def fill(f):
        f.write(head)
        if offset < _SHA_BESIDE:
            for data in parts:
                digest.update(data)
                f.write(data)
            return
        todo: queue.SimpleQueue = queue.SimpleQueue()

        def hash_all():
            while (chunk := todo.get()) is not None:
                digest.update(chunk)

        hasher = threading.Thread(target=hash_all, name="divtrace-sha256", daemon=True)
        hasher.start()
        try:
            for data in parts:
                for i in range(0, len(data), _CHUNK):
                    chunk = data[i:i + _CHUNK]
                    todo.put(chunk)
                    f.write(chunk)
        finally:
            todo.put(None)
            hasher.join()

    atomic_write_with(path, fill, durable=False)  # its sha256 is recorded: a shard an OS crash cut short is caught
    return digest.hexdigest(), len(head) + offset


_ENCODE = compact_encoder()


class _Flush:
    """One write job on its own thread (a thread per shard of 128 MiB: its start is noise beside the write)."""

    def __init__(self, writer: "TraceWriter", job) -> None:
        self.error: BaseException | None = None
        self.arena = job[4]
        self.thread = threading.Thread(target=self._run, args=(writer, job), name="divtrace-writer", daemon=True)
        self.thread.start()

    def _run(self, writer, job) -> None:
        try:
            writer._write(job)
        except BaseException as e:  # raised on the recording thread by TraceWriter._wait
            self.error = e


def _record_line(rec, values: list[TensorValue]) -> str:
    # Records and values are flat dataclasses of JSON-ready fields (stats were made safe when taken), so
    # record_compact reads their fields directly: dataclasses.asdict deep-copies and was a third of the cost.
    d = record_compact(rec, values)
    try:
        return _ENCODE(d)
    except ValueError:  # a non-finite float slipped into an op argument
        return _ENCODE(json_safe(d))


def prepare_trace_dir(path: Path, overwrite: bool) -> None:
    """Create `path`, refusing to mix with an existing trace or with unrelated files."""
    if path.exists() and not path.is_dir():
        raise DivtraceError(f"{path}: exists and is not a directory")
    try:
        if path.is_dir():
            entries = list(path.iterdir())
            if (path / META).exists():
                if not overwrite:
                    raise DivtraceError(f"{path}: already holds a trace (pass overwrite=True / --overwrite to "
                                        "replace it)")
                for p in entries:
                    if p.name in (META, RECORDS, CHECKSUMS) or p.match(SHARD_GLOB) or p.name.endswith(".tmp"):
                        p.unlink()
            elif entries:
                raise DivtraceError(f"{path}: directory is not empty and holds no trace; choose a new directory")
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".divtrace-write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise DivtraceError(f"{path}: cannot write trace directory: {e.strerror or e}") from None


class TraceWriter:
    def __init__(self, path, *, mode: str, meta: dict, overwrite: bool = False,
                 shard_bytes: int = 128 << 20, flush_records: int = 4096):
        if mode not in ("full", "hash"):
            raise DivtraceError(f"mode must be 'full' or 'hash', got {mode!r}")
        self.path = Path(path)
        self.mode = mode
        prepare_trace_dir(self.path, overwrite)
        self.meta = dict(meta, format_version=FORMAT_VERSION, mode=mode, status="running", complete=False,
                         started=time.time(), hash_scheme=HASH_SCHEME, hash_impl=IMPLEMENTATION)
        self._shard_bytes = shard_bytes
        self._flush_records = max(1, int(flush_records))
        self._pending_records: list = []
        self._pending_tensors: dict = {}  # blob key -> torch.Tensor or ArenaSlice
        self._pending_nbytes = 0
        self._blobs: dict[str, str] = {}  # blob key -> shard file it lives in
        self._shards: list[str] = []
        self._shard_sums: dict[str, str] = {}
        self._background = mode == "full"  # hash-mode flushes are small: written in place, no thread
        self._inflight: _Flush | None = None
        self._arena: Arena | None = None  # holds the pending tensors' bytes (full mode)
        self._spare: Arena | None = None  # the last written shard's arena, free again
        self._records_sha = hashlib.sha256()
        self._records_size = 0  # bytes of records.jsonl known to be whole on disk
        self._sums_size = 0
        self.critical = False  # True while a flush writes: the recorder's signal handlers wait for it
        self.deferred: BaseException | None = None
        self._next_vid = 0
        self.n_records = 0  # records handed to append()
        self.n_written = 0  # records on disk
        self.bytes_written = 0
        self.failed: str | None = None  # set when a write failed; nothing more is written after that
        self._closed = False
        try:
            # status "running": an OS crash loses the run anyway, so no fsync; close() writes the durable one
            atomic_write_json(self.path / META, json_safe(self.meta), durable=False)
            self._records_fd = os.open(self.path / RECORDS, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._sums_fd = os.open(self.path / CHECKSUMS, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise DivtraceError(f"{self.path}: cannot start the trace: {e.strerror or e}") from None

    # values ---------------------------------------------------------------------------------------------
    def is_buffered(self, vid: int) -> bool:
        """Whether the record defining `vid` is still in memory (not yet written), so it may be amended."""
        return vid >= getattr(self, "_written_vids_below", 0)

    def take_vid(self) -> int:
        vid = self._next_vid
        self._next_vid += 1
        return vid

    def new_value(self, t: torch.Tensor, producer: int | None, fp: tuple[str, dict] | None = None) -> TensorValue:
        """Fingerprint `t` now (and keep a copy of its bytes in full mode), returning its new value. `fp` is
        `fingerprint(t)` when the caller has just taken it."""
        h, stats = fp if fp is not None else fingerprint(t)
        dev = t.device
        v = TensorValue(self.take_vid(), dtype_name(t.dtype), list(t.shape), list(t.stride()), h,
                        dev.type if dev.index is None else str(dev), stats, producer, None, None,
                        t.numel() * t.element_size())
        if self.mode == "full":
            # Content-addressed: views, reshapes and copies of the same bytes share one blob.
            key = f"{v.dtype.removeprefix('torch.')}-{t.numel()}-{h}"
            if key not in self._blobs and key not in self._pending_tensors:
                self._pending_tensors[key] = self._keep(t, v.nbytes)
                self._pending_nbytes += v.nbytes
            v.blob = key
            v.shard = self._blobs.get(key)  # filled at flush for pending blobs
        return v

    def _keep(self, t: torch.Tensor, nbytes: int):
        """A private copy of `t`'s bytes in logical order: in the filling arena when they fit, else their own."""
        if nbytes and not (t.is_conj() or t.is_neg()):
            if self._arena is None:
                self._arena, self._spare = self._spare or Arena(self._shard_bytes), None
                self._arena.used = 0
            kept = self._arena.take(t, nbytes)
            if kept is not None:
                return kept
        # `flat` is already a private copy when `t` was not contiguous; otherwise it aliases `t`.
        flat = flat_bytes(t)
        keep = flat if flat.data_ptr() != t.data_ptr() or flat.numel() == 0 else flat.clone()
        return keep.to("cpu")

    # records --------------------------------------------------------------------------------------------
    def append(self, rec, values: list[TensorValue]) -> None:
        if self.failed:
            raise DivtraceError(f"{self.path}: recording stopped after a failed write ({self.failed})")
        self._pending_records.append((rec, values))
        self.n_records += 1
        if self._pending_nbytes >= self._shard_bytes or len(self._pending_records) >= self._flush_records:
            self.flush()

    def flush(self, wait: bool = False) -> None:
        """Write what is pending; in full mode hand it to the background thread (`wait`: and wait for it)."""
        if self.failed:
            return
        self.critical = True
        try:
            job = self._take_pending()
            if not self._background:
                if job is not None:
                    self._write(job)
            else:
                self._wait()  # one flush in flight: order on disk, and memory bounded
                if job is not None:
                    self._inflight = _Flush(self, job)
                    if wait:
                        self._wait()
        except OSError as e:
            self._fail(e)
        finally:
            self.critical = False
        if self.deferred is not None:  # a signal came while writing: raise it now that the files are whole
            exc, self.deferred = self.deferred, None
            raise exc

    def _wait(self) -> None:
        """Wait for the flush in flight; raise what it raised."""
        job = self._inflight
        if job is not None:
            job.thread.join()
            self._inflight = None  # only once joined: an interrupt inside join() leaves it for close() to wait on
            if job.error is not None:
                raise job.error
            if job.arena is not None:
                self._spare = job.arena  # written: its memory may take the next shard

    def _fail(self, e: OSError) -> None:
        what = e.strerror or str(e)
        if e.errno == errno.ENOSPC:
            what = "no space left on device"
        self.failed = f"write failed: {what}"
        self._pending_tensors, self._pending_records, self._pending_nbytes = {}, [], 0
        self._arena = self._spare = None
        self._shards = [s for s in self._shards if s in self._shard_sums]  # named, never written
        raise DivtraceError(f"{self.path}: {self.failed}; recording stopped, the trace keeps the "
                            f"{self.n_written} records written before and is marked incomplete") from None

    def _take_pending(self):
        """The pending shard and records as one write job (shard name, tensors, records bytes, record count),
        or None. Runs on the caller's thread: it names the shard, encodes the records and ends the time in
        which buffered records may be amended, so the job owns everything it holds."""
        shard = tensors = data = arena = None
        if self._pending_tensors:
            shard, tensors = SHARD_PATTERN.format(len(self._shards)), self._pending_tensors
            self._shards.append(shard)
            for key in tensors:
                self._blobs[key] = shard
            self._pending_tensors, self._pending_nbytes = {}, 0
            arena, self._arena = self._arena, None
        n = len(self._pending_records)
        if n:
            lines = []
            for rec, values in self._pending_records:
                for v in values:
                    if v.blob is not None and v.shard is None:
                        v.shard = self._blobs[v.blob]
                lines.append(_record_line(rec, values))
            data = ("\n".join(lines) + "\n").encode()
            self._written_vids_below = self._next_vid
            self._pending_records = []
        return None if shard is None and data is None else (shard, tensors, data, n, arena)

    def _write(self, job) -> None:
        """Write one job: the shard, then the checksums, then the records. The only code that touches the files
        and their digests while recording (on the background thread in full mode)."""
        shard, tensors, data, n, _ = job
        sums = []
        if shard is not None:
            digest, size = write_shard(self.path / shard, tensors)
            self.bytes_written += size
            self._shard_sums[shard] = digest
            sums.append({"shard": shard, "sha256": digest, "bytes": size})
        if data is None:
            self._append_sums(sums)
            return
        running = self._records_sha.copy()
        running.update(data)
        sums.append({"records": self._records_size + len(data), "sha256": running.hexdigest()})
        # The digest goes first: a crash between the two writes leaves a digest for bytes that never came,
        # which the reader skips, never bytes without a digest.
        self._append_sums(sums)
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
            self.flush(wait=True)
        except BaseException as e:  # a failed write, or a signal held during the last write
            flush_error = e
        try:
            self._wait()  # a signal during the flush above left its write in flight
        except OSError as e:
            try:
                self._fail(e)
            except DivtraceError as err:
                flush_error = flush_error or err
        except BaseException as e:
            flush_error = flush_error or e
        self._arena = self._spare = None  # the recorder object may outlive the block: give the memory back
        if self.failed:
            status, error = "error", self.failed
        for fd in (self._records_fd, self._sums_fd):
            try:
                os.fsync(fd)
            except OSError:
                pass
            os.close(fd)
        self.meta.update(status=status, complete=(status == "complete"), error=error, records=self.n_written,
                         shards=list(self._shards), finished=time.time(),
                         checksums={"records": {"sha256": self._records_sha.hexdigest(), "bytes": self._records_size},
                                    "shards": dict(self._shard_sums)},
                         **extra)
        try:
            atomic_write_json(self.path / META, json_safe(self.meta))
        except OSError as e:
            # meta.json keeps status "running": still read as incomplete, and the records stay verifiable
            # from checksums.jsonl.
            if flush_error is None or not isinstance(flush_error, DivtraceError):
                raise DivtraceError(f"{self.path / META}: cannot write the final metadata: {e.strerror or e}; "
                                    "the trace is left marked incomplete") from None
        if flush_error is not None:
            raise flush_error
