"""The trace writer's device path: values fingerprinted on their device, records written by a writer thread.

A value on a device (or any value, when the device path is forced) gets a `PendingValue` for its hash and stats:
its words are computed by torch ops on the device and reach the host in batches (divtrace.trace.device_results).
A flush hands the pending records to the writer thread, which waits for their batches, resolves every value's
hash and stats and writes exactly the lines the CPU path writes for the same tensors.

Where the CPU path decides a value's identity from its bytes (a tensor met again whose version moved, an inference
tensor without a version counter, a buffer written behind torch's back: divtrace.record.values), the device path
cannot read them without waiting. It records a provisional new value (`Provisional`) and lets the writer thread
decide: when its fingerprint equals the old value's, the new value is dropped from its record and every later vid
is renumbered (`Renumbering`), so the lines are the CPU path's again.

In: values and records from the recorder through TraceWriter. Out: records.jsonl lines, through TraceWriter's own
checksummed append.
"""
from __future__ import annotations

import threading
import time
from bisect import bisect_left

import torch

from divtrace.trace import device_kernels
from divtrace.trace.device_results import (DeviceBatches, PendingRows, PendingValue, WriterThread, device_words,
                                           hex_of, row_words, stats_of)
from divtrace.trace.hashing.rows import row_fingerprints
from divtrace.trace.fingerprint import dtype_name, flat_bytes
from divtrace.trace.hashing.tensor import tensor_fingerprint
from divtrace.trace.files import compact_encoder
from divtrace.trace.records import TensorValue, json_safe, record_compact

_ENCODE = compact_encoder()


def encode_line(d: dict) -> str:
    """A record's line (records.jsonl), as compact JSON."""
    try:
        return _ENCODE(d)
    except ValueError:  # a non-finite float slipped into an op argument
        return _ENCODE(json_safe(d))


class DeviceWriterHooks:
    """What TraceWriter offers its device path (kept here, beside it): the path itself, and the writer thread's
    ways into the writer's files."""

    blobs = property(lambda self: self._shards.blobs, doc="Full mode: blob key -> the shard it is in.")
    shard_bytes = property(lambda self: self._shard_bytes)
    encode_record = staticmethod(encode_line)

    def use_device(self, forced: bool = False):
        """Write through the device path from now on: values on a device are fingerprinted there and records are
        written by a writer thread (DeviceWriting); `forced` sends CPU tensors that way too (tests run the device
        path's code on the CPU). Returns it."""
        self.device = DeviceWriting(self, forced)
        return self.device

    def write_record_lines(self, data: bytes, n: int) -> None:
        """(the writer thread) As TraceWriter.flush: finish the open shard, write the files beside the records
        (handed over on this thread), the checksums line, then `n` records' lines."""
        if self.failed:
            return
        try:
            if self._shards.open is not None:
                self._finish_shard()
            files = self.files is not None and self.files.pending_bytes > 0 and self.files.write()
            if n or files:
                self._write_records(data if n else b"", n)
        except OSError as e:
            self._fail(e)

    def store_blob(self, key: str, t: torch.Tensor) -> str:
        """(the writer thread) The shard holding blob `key`, writing `t`'s bytes there if new."""
        shard = self._shards.blobs.get(key)
        return shard if shard is not None else self._store(key, t)


class Renumbering:
    """Which provisional values were dropped (their bytes were the old value's) and the vids after them, settled on
    the writer thread in vid order."""

    def __init__(self, items: list, warnings_out: list):
        self.items = items  # (vid, new value, old value, warning if changed), appended by the recording thread
        self.warnings = warnings_out
        self.done = 0
        self.dropped: list[int] = []  # provisional vids dropped, ascending
        self.alias: dict[int, int] = {}  # dropped vid -> the final vid it stands for

    def settle(self, upto: int) -> None:
        for vid, new, old, warn in self.items[self.done:upto]:
            if hex_of(new.hash) == hex_of(old.hash):
                self.alias[vid] = self.final(old.vid)
                self.dropped.append(vid)
            elif warn is not None and warn not in self.warnings and len(self.warnings) < 100:
                self.warnings.append(warn)
        self.done = max(self.done, upto)

    def final(self, vid: int) -> int:
        if not self.dropped:
            return vid
        a = self.alias.get(vid)
        return a if a is not None else vid - bisect_left(self.dropped, vid)

    def record(self, d: dict) -> dict:
        """A compact record (records.record_compact) with every vid made final."""
        f = self.final
        k = d["k"]
        if k == "e":
            d["in"] = [[key, f(v)] for key, v in d["in"]]
        elif k == "x":
            d["out"] = [[key, f(v)] for key, v in d["out"]]
        else:
            d["a"], d["o"] = self._deep(d["a"]), self._deep(d["o"])
            if "kw" in d:
                d["kw"] = self._deep(d["kw"])
            d["in"], d["out"] = [f(v) for v in d["in"]], [f(v) for v in d["out"]]
        for v in d.get("V", ()):
            v["v"] = f(v["v"])
        return d

    def _deep(self, x):
        if type(x) is dict:
            if "$v" in x and len(x) == 1:
                return {"$v": self.final(x["$v"])}
            return {k: self._deep(v) for k, v in x.items()}
        if type(x) is list:
            return [self._deep(v) for v in x]
        return x


class StagedBytes:
    """Full mode: a value's bytes on their way to a host buffer (copied on a side stream after the producing one)."""

    __slots__ = ("host", "event", "nbytes")

    def __init__(self, host: torch.Tensor, event, nbytes: int):
        self.host, self.event, self.nbytes = host, event, nbytes

    def land(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host


class Staging:
    """Full mode's bounded staging: values' bytes copied to host memory off the producing stream. A snapshot on
    the device first (a later in-place write on the producing stream cannot reach the copy), then a copy to pinned
    memory on a side stream that waits for the producing one. At most `limit` bytes are staged and not yet written
    to a shard (at least two shards' worth, so the bytes of flushes already handed to the writer thread can free
    room): past that the recording thread waits for the writer thread (counted). It goes over the limit by one
    value only where waiting could not help: nothing staged before it is queued for the writer thread."""

    def __init__(self, limit: int, thread):
        self.limit = limit
        self._thread = thread
        self._bytes = 0  # staged, not yet in a shard
        self._room = threading.Condition()
        self._side: dict = {}  # device -> side stream
        self.waits = 0
        self.wait_seconds = 0.0
        self.peak = 0
        self.copied = 0

    def stage(self, t: torch.Tensor) -> StagedBytes:
        flat = flat_bytes(t)
        n = flat.numel() * flat.element_size()
        with self._room:
            if self._bytes and self._bytes + n > self.limit:
                t0 = time.perf_counter()
                self.waits += 1
                while self._bytes and self._bytes + n > self.limit:
                    if self._thread.error is not None or not self._thread.alive() or self._thread.idle():
                        break  # (stopped, or nothing queued that could free room: go on, over the limit)
                    self._room.wait(0.05)
                self.wait_seconds += time.perf_counter() - t0
            self._bytes += n
            self.peak = max(self.peak, self._bytes)
        if flat.data_ptr() == t.data_ptr():
            flat = flat.clone()  # the snapshot (flat_bytes copied already where `t` was strided)
        if flat.is_cuda:
            main = torch.cuda.current_stream(flat.device)
            side = self._side.get(flat.device)
            if side is None:
                side = self._side[flat.device] = torch.cuda.Stream(flat.device)
            side.wait_stream(main)
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            with torch.cuda.stream(side):
                host.copy_(flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
            flat.record_stream(side)  # (its memory is not reused before the side stream has read it)
        else:  # the CPU (forced), or a device without events here: copied now
            host, event = (flat if flat.is_cpu else flat.cpu()), None
        self.copied += n
        return StagedBytes(host, event, n)

    def written(self, staged: StagedBytes) -> None:
        """(writer thread) `staged`'s bytes are in a shard (or were a blob already there): room again."""
        with self._room:
            self._bytes -= staged.nbytes
            staged.nbytes = 0
            self._room.notify_all()

    def summary(self) -> dict:
        return {"bytes_staged": self.copied, "staging_peak_bytes": self.peak, "staging_limit_bytes": self.limit,
                "staging_waits": self.waits, "staging_wait_seconds": round(self.wait_seconds, 6)}


class DeviceWriting:
    """One TraceWriter's device path: batches, the writer thread, provisional values and their renumbering."""

    def __init__(self, writer, forced: bool):
        self.forced = forced  # CPU tensors take this path too (tests: the device path's code, run on the CPU)
        self.batches = DeviceBatches()
        self.thread = WriterThread()
        self.batches.lander = self.thread
        self.provisional: list = []
        self.late_warnings: list[str] = []  # raw writes found by the writer thread (meta.json warnings)
        self.renumbering = Renumbering(self.provisional, self.late_warnings)
        self._writer = writer
        self.token_store = None  # the recorder's DeviceTokenStore (divtrace.record.device), if it keeps tokens
        self.fingerprint = tensor_fingerprint
        self.staging = Staging(2 * max(writer.shard_bytes, 64 << 20), self.thread) if writer.mode == "full" else None
        self.staged_bytes = 0  # full mode: bytes staged since the last flush (a shard's worth flushes)

    def takes(self, t: torch.Tensor) -> bool:
        return self.forced or not t.is_cpu

    def pending(self, t: torch.Tensor) -> PendingValue:
        """Enqueue `t`'s fingerprint and stats on its device; their pending result."""
        with torch.no_grad():
            words = device_words(t, self.fingerprint, stats=True)
        return PendingValue(self.batches.add(words), t.numel(), t.is_floating_point())

    def pending_rows(self, rows: torch.Tensor) -> PendingRows:
        """Enqueue the row fingerprints of `rows` ([R, ...], token_layout.rows_2d) on their device."""
        with torch.no_grad():
            return PendingRows(self.batches.add(row_words(rows, row_fingerprints)))

    def new_value(self, t: torch.Tensor, producer) -> TensorValue:
        p = self.pending(t)
        if self.staging is not None:
            p.staged = self.staging.stage(t)
            self.staged_bytes += p.staged.nbytes
        dev = t.device
        dev = dev.type if dev.index is None else str(dev)
        return TensorValue(self._writer.take_vid(), dtype_name(t.dtype), list(t.shape), list(t.stride()), p, dev, p,
                           producer, None, None, t.numel() * t.element_size())

    def provisional_value(self, t: torch.Tensor, old: TensorValue, warn: str | None) -> TensorValue:
        """A new value for `t` that the writer thread drops again when its bytes turn out to be `old`'s (same dtype,
        shape and stride, checked by the caller). `warn` goes to meta.json's warnings when they differ."""
        v = self.new_value(t, None)
        self.provisional.append((v.vid, v, old, warn))
        return v

    def wait_idle(self) -> None:
        """Wait until the writer thread has run every job submitted so far (at close: outside the block)."""
        done = threading.Event()
        self.thread.submit([], done.set, always=True)
        while not done.wait(0.05):
            if not self.thread.alive():
                return

    def submit(self, fn) -> None:
        """Run `fn(settled)` on the writer thread once everything recorded so far has landed; `settled` is how
        many provisional values it may rely on."""
        upto = len(self.provisional)
        self.thread.submit(self.batches.seal(), lambda: fn(upto))

    def flush_due(self, shard_bytes: int, files_bytes: int) -> bool:
        """Whether the bytes staged (full mode) or the token lines handed over call for a flush now."""
        store = self.token_store
        return self.staged_bytes >= shard_bytes or (store is not None and store.pending_bytes >= files_bytes)

    def flush_and_wait(self) -> None:
        """Flush the trace writer and wait for the writer thread (at close: outside the block)."""
        self._writer.flush()
        self.wait_idle()

    def submit_records(self, records: list, n: int) -> None:
        """(a flush) The pending records, and the token lines handed over, to the writer thread."""
        parts = self.token_store.take_handed() if self.token_store is not None else []
        if not (n or parts):
            return
        self.staged_bytes = 0
        self.submit(lambda upto: self._write(records, n, upto, parts))

    def _write(self, records: list, n: int, upto: int, parts: list) -> None:
        """(writer thread) The lines of `records`, as the CPU path writes them, appended to records.jsonl."""
        ren = self.renumbering
        ren.settle(upto)
        encode = self._writer.encode_record
        lines = []
        for rec, values in records:
            for v in values:
                h = v.hash
                if type(h) is not str:
                    hx = hex_of(h)
                    if type(h) is PendingValue and h.staged is not None:
                        if v.vid not in ren.alias:
                            self._store(v, hx, h.staged)
                        else:  # dropped: its bytes are the old value's blob
                            self.staging.written(h.staged)
                    # The hash last: the recording thread copies a value (an alias of it) as it finds it, and a
                    # hex hash must come with its blob.
                    v.hash = hx
                if type(v.stats) is not dict:
                    v.stats = stats_of(v.stats)
            if ren.dropped:
                values = [v for v in values if v.vid not in ren.alias]
                lines.append(encode(ren.record(record_compact(rec, values))))
            else:
                lines.append(encode(record_compact(rec, values)))
        if parts:
            self.token_store.write_handed(parts)
        self._writer.write_record_lines(("\n".join(lines) + "\n").encode() if lines else b"", n)

    def _store(self, v: TensorValue, hx: str, staged: StagedBytes) -> None:
        """(writer thread) Full mode: `v`'s blob, its bytes written into the open shard when new."""
        key = f"{v.dtype.removeprefix('torch.')}-{staged.host.numel()}-{hx}"
        if key not in self._writer.blobs:
            v.shard = self._writer.store_blob(key, staged.land())
        else:
            v.shard = self._writer.blobs[key]
        v.blob = key
        self.staging.written(staged)

    def check(self) -> None:
        e = self.thread.error
        if e is not None:
            self.thread.error = None
            raise e

    def close(self, extra: dict) -> dict:
        """Drain the writer thread; `extra` (TraceWriter.close's meta.json fields) with the device path's figures
        and the raw writes the writer thread found added to its warnings."""
        self.thread.drain()
        staging = self.staging.summary() if self.staging is not None else {}
        figures = dict(self.batches.summary(), **staging, provisional=len(self.provisional),
                       provisional_dropped=len(self.renumbering.dropped),
                       writer_thread_seconds=round(self.thread.busy_seconds, 6), kernels=device_kernels.status())
        if self.late_warnings:
            warnings = list(extra.get("warnings") or [])
            extra = dict(extra, warnings=warnings + [w for w in self.late_warnings if w not in warnings])
        return dict(extra, device_path=figures)
