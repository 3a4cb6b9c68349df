"""TraceWriter: streams records and tensor bytes to disk as they are produced.

Full mode writes each new value's bytes into the open safetensors shard the moment the value is produced
(divtrace.trace.shards: data first, the header at the end), so nothing is held in memory and a later in-place
write cannot change what was recorded. Records are buffered; a flush finishes the open shard (atomically: a temp
file renamed into place), then appends the records to records.jsonl. So every record on disk refers only to
bytes already on disk, and a crash at any moment leaves a readable prefix.

Integrity: before each append, `checksums.jsonl` gets the sha256 of records.jsonl as it will be after the
append (a running digest), and of each file appended beside it in step (the token files, side_files.py), whose
bytes go first. A reader verifies the records prefix a SIGKILL left behind from it; `close` also
copies the final digest into meta.json. Shard bytes are verified by the records: every stored tensor is
content-addressed by its fingerprint, checked on every read. A failed write (disk full) stops the recording:
records.jsonl is cut back to its last whole flush, the shard being filled is removed, the trace is marked
"error" and a DivtraceError says what failed.

In: records and tensors from the recorder (divtrace.record), the trace directory (directory.py). Out:
records.jsonl, checksums.jsonl, meta.json and the shards (shards.py), which the reader (reader.py) reads.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from divtrace.errors import DivtraceError
from divtrace.oserrors import os_reason
from divtrace.trace.directory import prepare_trace_dir, release_lock, remove_if_created
from divtrace.trace.files import CHECKSUMS, META, RECORDS, atomic_write_bytes, fsync_dir, readable_json
from divtrace.trace.fingerprint import dtype_name, flat_bytes
# Traces are written in the shard-summable scheme (docs/trace-format.md, "Fingerprint schemes"); the older
# lane32-wsum128 is still read (divtrace.trace.fingerprint.hasher).
from divtrace.trace.hashing import TENSOR_SCHEME as HASH_SCHEME
from divtrace.trace.hashing.tensor import IMPLEMENTATION, hash_with_stats as fingerprint
from divtrace.trace.records import FORMAT_VERSION, TensorValue, json_safe, record_line
from divtrace.trace.device_writer import DeviceWriterHooks
from divtrace.trace.shards import ShardStore
from divtrace.trace.side_files import ChecksummedFiles



def _record_line(rec, values: list[TensorValue]) -> str:
    # Records and values are flat dataclasses of JSON-ready fields (stats were made safe when taken), so
    # record_line reads their fields directly (dataclasses.asdict deep-copies and was a third of the cost) and
    # writes each value's part as text (records.record_line).
    return record_line(rec, values)


class TraceWriter(DeviceWriterHooks):
    def __init__(self, path, *, mode: str, meta: dict, overwrite: bool = False,
                 shard_bytes: int = 128 << 20, flush_records: int = 4096, durable: bool = False,
                 checksummed_files=()):
        if mode not in ("full", "hash"):
            raise DivtraceError(f"mode must be 'full' or 'hash', got {mode!r}")
        self.path = Path(path)
        self.mode = mode
        self._lock, created = prepare_trace_dir(self.path, overwrite)
        # The oldest version that holds what this mode writes, so older readers keep reading what they can:
        # hash mode's only addition in version 2 (the "r" mark) is an optional key they ignore.
        self.meta = dict(meta, format_version=FORMAT_VERSION if mode == "full" else 1, mode=mode, status="running",
                         complete=False, started=time.time(), hash_scheme=HASH_SCHEME, hash_impl=IMPLEMENTATION)
        if checksummed_files:  # from the start: a reader of a killed trace must know these files are vouched for
            self.meta["file_checksums"] = dict.fromkeys(checksummed_files)
        # files appended in step with records.jsonl (the token files: `files.add`), flushed with it
        self.files = ChecksummedFiles(self.path, checksummed_files) if checksummed_files else None
        self._files_bytes = min(shard_bytes, 64 << 20)  # flush when that much of them is pending
        # called at the start of each flush: the token store hands over what it holds for the records written with it
        self.before_flush: list = []
        self._shard_bytes = shard_bytes
        self._durable = durable
        self._flush_records = max(1, int(flush_records))
        self._pending_records: list = []
        self._shards = ShardStore(self.path)  # full mode's shard files
        self._records_sha = hashlib.sha256()
        self._records_size = 0  # bytes of records.jsonl known to be whole on disk
        self._sums_size = 0
        self.critical = False  # True while a flush writes: the recorder's signal handlers wait for it
        self.deferred: BaseException | None = None
        self._next_vid = 0
        self.n_records = 0  # records handed to append()
        self.n_written = 0  # records on disk
        self.store_seconds = 0.0  # full mode: time spent writing values' bytes and finishing shards (the write path)
        self.failed: str | None = None  # set when a write failed; nothing more is written after that
        self.device = None  # the device path (device_writer.DeviceWriting), from use_device()
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
            removed = remove_if_created(self.path, created)
            raise DivtraceError(f"{self.path}: cannot start the trace: {os_reason(e)}; "
                                + ("the directory was removed" if removed else "nothing was recorded")) from None

    def _sync_data(self) -> None:
        """fsync records.jsonl, the files beside it and every finished shard (best effort: a file system without
        fsync still closes)."""
        if self.files is not None:
            self.files.sync()
        try:
            os.fsync(self._records_fd)
            for name in self._shards.names:
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
        if self.device is not None and fp is None and (self.device.forced or not t.is_cpu):
            return self.device.new_value(t, producer)
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
            shard = self._shards.blobs.get(key)
            v.blob, v.shard = key, shard if shard is not None else self._store(key, src)
        return v

    def _store(self, key: str, t: torch.Tensor) -> str:
        """Write `t`'s bytes into the open shard now (later code may overwrite `t`); the shard's name."""
        self._refuse_after_failure()
        t0 = time.perf_counter()
        try:
            return self._shards.add(key, t)
        except OSError as e:
            self._fail(e)
        finally:
            self.store_seconds += time.perf_counter() - t0

    @property
    def bytes_written(self) -> int:
        """Bytes of records.jsonl and of the finished shards written."""
        return self._records_size + self._shards.bytes_written

    # records --------------------------------------------------------------------------------------------
    def _refuse_after_failure(self) -> None:
        if self.failed:
            raise DivtraceError(f"{self.path}: recording stopped after a failed write ({self.failed})")

    def append(self, rec, values: list[TensorValue]) -> None:
        self._refuse_after_failure()
        self._pending_records.append((rec, values))
        self.n_records += 1
        if len(self._pending_records) >= self._flush_records or (
                self._shards.open is not None and self._shards.open.size >= self._shard_bytes) or (
                self.files is not None and self.files.pending_bytes >= self._files_bytes) or (
                self.device is not None and self.device.flush_due(self._shard_bytes, self._files_bytes)):
            self.flush()

    def flush(self) -> None:
        """Finish the open shard, write the files appended beside the records, then the checksums line that
        vouches for both, then the pending records."""
        if self.failed:
            return
        if self.device is not None:  # the writer thread writes, once the values' device results have landed
            self.device.check()
            for hand_over in self.before_flush:  # (the device path's token store keeps them for the writer thread)
                hand_over()
            records = self._pending_records
            if records:
                self._written_vids_below = self._next_vid
                self._pending_records = []
            self.device.submit_records(records, len(records))
            return
        self.critical = True
        try:
            if self._shards.open is not None:
                self._finish_shard()
            for hand_over in self.before_flush:
                hand_over()
            data = self._take_records()
            files = self.files is not None and self.files.pending_bytes > 0 and self.files.write()
            if data is not None or files:
                self._write_records(*(data or (b"", 0)))
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
        self._shards.discard()
        if self.files is not None:
            self.files.discard()
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

    def _finish_shard(self) -> None:
        t0 = time.perf_counter()
        try:
            self._shards.finish()
        finally:
            self.store_seconds += time.perf_counter() - t0

    def _write_records(self, data: bytes, n: int) -> None:
        """The checksums line (records.jsonl as it will be, and the files beside it as they are), then the records."""
        running = self._records_sha.copy()
        running.update(data)
        # The digest goes first: a crash between the two writes leaves a digest for bytes that never came,
        # which the reader skips, never bytes without a digest.
        line = {"records": self._records_size + len(data), "sha256": running.hexdigest()}
        if self.files is not None and self.files.checkpoint():
            line["files"] = self.files.checkpoint()
        self._append_sums([line])
        self._append(self._records_fd, data, self._records_size)
        self._records_sha = running
        self._records_size += len(data)
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
        if self.device is not None:  # every job run, the thread stopped: nothing writes after this
            extra = self.device.close(extra)
            if flush_error is None:
                flush_error = self.device.thread.error
        self._shards.discard()  # not finished (the flush failed): no records point to it, leave no temp file
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
        if self.files is not None:
            self.files.close()
            extra["file_checksums"] = self.files.final()
        self.meta.update(status=status, complete=(status == "complete"), error=error, records=self.n_written,
                         shards=list(self._shards.names), finished=time.time(),
                         checksums={"records": {"sha256": self._records_sha.hexdigest(), "bytes": self._records_size},
                                    "shards": {}},  # no shard digests: see shards.write_shard
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
