"""Results computed on a device that reach the host later, so a recorded block never waits for its device.

A value recorded on a device gets its fingerprint (and summary statistics, and token-row fingerprints) computed
there by torch ops that read nothing back (divtrace.trace.hashing), as a few int64 words on the device. Those
words are gathered per device into a batch (`DeviceBatches.add` gives a `Slot`); a sealed batch is concatenated
on the device and copied to a host buffer in ONE asynchronous copy on the producing stream (pinned memory, an
event recorded after it). A writer thread (`WriterThread`) waits for the event, never the recording thread, and
then turns the slots into the trace's lines (`PendingValue.hex`, `.stats`).

Staging is bounded: `ring` host buffers of `words` int64 each are reused; when all are in flight the recording
thread waits for the oldest (counted in `waits` and `wait_seconds`, reported in meta.json). The same code runs on
CPU tensors when the device path is forced (tests): the copy is then an ordinary copy and there is no event.

In: int64 device tensors from the trace writer (values) and the recorder (token rows). Out: host words, read by
the trace writer's thread when it writes records.jsonl and the token files.
"""
from __future__ import annotations

import math
import queue
import threading
import time

import torch

from divtrace.trace import device_kernels
from divtrace.trace.hashing import weights
from divtrace.trace.hashing.spec import BLOCK, to_hex
from divtrace.trace.memo import bounded_put



class Slot:
    """`length` int64 words at `offset` of a batch, readable (`words`) once the batch has landed."""

    __slots__ = ("batch", "offset", "length")

    def __init__(self, batch, offset: int, length: int):
        self.batch, self.offset, self.length = batch, offset, length

    def words(self):
        """The slot's words as a numpy int64 array (writer thread, after the batch landed)."""
        return self.batch.landed[self.offset:self.offset + self.length]


class Batch:
    """The words of one device, gathered until sealed, then copied to the host in one copy."""

    __slots__ = ("parts", "size", "host", "event", "landed", "owner")

    def __init__(self, owner):
        self.parts: list[torch.Tensor] = []
        self.size = 0
        self.host = self.event = self.landed = None
        self.owner = owner

    def land(self) -> None:
        """Wait for the copy (writer thread, or a recording thread that needs its buffer) and keep the words; the
        host buffer goes back to the ring."""
        with self.owner.landing:
            if self.landed is not None:
                return
            if self.event is not None:
                self.event.synchronize()
            self.landed = self.host[:self.size].numpy().copy()
            host, self.host, self.event = self.host, None, None
        self.owner.give_back(host)


class DeviceBatches:
    """The open batch of each device, and the bounded ring of host buffers they are copied into."""

    def __init__(self, words: int = 1 << 18, ring: int = 8):
        self.words, self.ring = words, ring
        self.lander = None  # a WriterThread that lands each batch as soon as it is sealed (its buffer comes back)
        self._open: dict = {}  # device -> Batch
        self._free: dict = {}  # pinned: bool -> [host buffers]
        self._made = 0
        self._sealed: list[Batch] = []  # sealed since the last seal(): handed to the next job
        self._flying: list[Batch] = []  # sealed, maybe not landed yet (oldest first): what a full ring waits for
        self._lock = threading.Lock()
        self.landing = threading.Lock()
        self.waits = 0  # times the recording thread waited for a free host buffer
        self.wait_seconds = 0.0
        self.batches = 0
        self.words_copied = 0

    def add(self, x: torch.Tensor) -> Slot:
        """Queue the int64 words of `x` (1-D, on its device) for the host."""
        dev = x.device
        b = self._open.get(dev)
        if b is None:
            b = self._open[dev] = Batch(self)
        s = Slot(b, b.size, x.shape[0])
        b.parts.append(x)
        b.size += x.shape[0]
        if b.size >= self.words:
            self._seal(dev, b)
        return s

    def seal(self) -> list[Batch]:
        """Seal every open batch (its copy enqueued); the batches sealed since the last call, to land later."""
        for dev, b in list(self._open.items()):
            self._seal(dev, b)
        out, self._sealed = self._sealed, []
        return out

    def _seal(self, dev, b: Batch) -> None:
        del self._open[dev]
        if not b.size:
            return
        words = b.parts[0] if len(b.parts) == 1 else torch.cat(b.parts)
        b.parts = []
        b.host = self._buffer(b.size, dev.type == "cuda")
        # Enqueued on the current (producing) stream: ordered after the ops that made the words, and before
        # any later in-place write to the tensors they were computed from.
        # (asynchronous on CUDA, into pinned memory, with an event; other devices copy synchronously: correct,
        # not fast, as no event says when their copy is done)
        b.host[:b.size].copy_(words, non_blocking=dev.type == "cuda")
        if dev.type == "cuda":
            b.event = torch.cuda.Event()
            b.event.record()
        self.batches += 1
        self.words_copied += b.size
        self._sealed.append(b)
        self._flying = [x for x in self._flying if x.landed is None]
        self._flying.append(b)
        if self.lander is not None:
            self.lander.submit([b], _nothing)

    def _buffer(self, n: int, pinned: bool) -> torch.Tensor:
        if n > self.words:  # (an oversized batch: a long row list) a buffer of its own, not kept
            return torch.empty(n, dtype=torch.int64, pin_memory=pinned)
        with self._lock:
            free = self._free.setdefault(pinned, [])
            if free:
                return free.pop()
            if self._made < self.ring:
                self._made += 1
                return torch.empty(self.words, dtype=torch.int64, pin_memory=pinned)
        # Staging is full: wait for the oldest batch in flight (counted; the writer thread lands it too).
        t0 = time.perf_counter()
        self.waits += 1
        while True:
            oldest = next((b for b in self._flying if b.landed is None), None)
            if oldest is not None:
                oldest.land()
            with self._lock:
                if free:
                    self.wait_seconds += time.perf_counter() - t0
                    return free.pop()
            if oldest is None:  # (every buffer is held by a batch the writer thread is landing)
                time.sleep(0.0002)

    def give_back(self, host: torch.Tensor) -> None:
        if host.shape[0] == self.words:
            with self._lock:
                self._free.setdefault(host.is_pinned(), []).append(host)

    def summary(self) -> dict:
        return {"batches": self.batches, "words": self.words_copied, "batch_waits": self.waits,
                "batch_wait_seconds": round(self.wait_seconds, 6), "batch_buffers": self._made,
                "batch_buffer_bytes": self._made * self.words * 8}


_TABLE_LANES = 1 << 22  # lanes of the cached per-lane weight table (2 x 32 MiB of int64 on the device at most)
_TABLES: dict = {}  # device -> int64 [2, n]: W_r(i) for every lane i < n
_FILLS: dict = {}  # (device, dtype) -> [[inf], [-inf], [0]]: what non-finite elements become for min, max and sum


_TABLE_VIEWS: dict = {}  # (device, n, W_0 only) -> the table's first n lanes (a view, kept: the same sizes come back)


def _lane_table(n: int, device, row: bool = False) -> torch.Tensor:
    """W_r(i), i < n (grown by doubling, made on the device from the weights' formula); `row`: W_0 only."""
    got = _TABLE_VIEWS.get((device, n, row))
    if got is not None:
        return got
    key = str(device)
    tab = _TABLES.get(key)
    if tab is None or tab.shape[1] < n:
        size = min(_TABLE_LANES, max(n, 1 << 16, 2 * (0 if tab is None else tab.shape[1])))
        blocks = -(-size // BLOCK)
        w, u = weights.inner(device), weights.outer(blocks, device)
        tab = _TABLES[key] = (w.unsqueeze(1) * u.unsqueeze(2)).reshape(2, -1)[:, :size]
        _TABLE_VIEWS.clear()  # (views of the old table)
    got = tab[0, :n] if row else tab[:, :n]
    bounded_put(_TABLE_VIEWS, (device, n, row), got)
    return got


def _nothing() -> None:
    pass


def _lanes(x: torch.Tensor) -> torch.Tensor | None:
    """`x`'s bytes as int32 lanes over its last dim (a view), or None where they are not whole aligned lanes of
    a dense row-major tensor (the general torch path then)."""
    es = x.element_size()
    if (x.shape[-1] * es % 4 or not x.is_contiguous() or x.is_conj() or x.is_neg() or x.is_complex()
            or x.dtype == torch.bool or (x.storage_offset() * es) % 4):
        return None
    return x.view(torch.int32)


def whole_fingerprint(t: torch.Tensor, fallback) -> torch.Tensor:
    """`fallback(t)` (the v2 whole-value fingerprint, int64 [2]) in the fewest device ops: a contiguous value
    whose bytes are whole 32-bit lanes is one multiply and one sum against a cached table of every lane's
    weight, or blockwise sums and the block weights when it is larger than the table. Same numbers: the products
    and sums wrap mod 2**64 in any order."""
    lanes = _lanes(t.reshape(-1)) if t.numel() and t.is_contiguous() else None
    if lanes is None:
        return fallback(t)
    n = lanes.shape[0]
    if n <= _TABLE_LANES:
        return (lanes * _lane_table(n, t.device)).sum(-1)
    if n % BLOCK:
        return fallback(t)
    b = n // BLOCK
    bs = (lanes.view(1, b, BLOCK) * weights.inner(t.device).unsqueeze(1)).sum(-1)  # [2, b]
    return (bs * weights.outer(b, t.device)).sum(-1)


def row_words(rows: torch.Tensor, fallback) -> torch.Tensor:
    """`fallback(rows)` (the v2 row fingerprints of a [R, ...] tensor, int64 [R]) in five device ops where each
    row is whole aligned lanes: rotate each lane left by one bit, multiply by the lanes' weights W_0, sum."""
    x = rows.reshape(rows.shape[0], -1) if rows.dim() != 2 else rows
    if device_kernels.available(x):
        got = device_kernels.row_words(x, weights.inner(x.device)[0], lambda b: weights.outer(b, x.device))
        if got is not None:
            return got
    lanes = _lanes(x) if x.shape[0] and x.shape[1] else None
    if lanes is None or lanes.shape[1] > _TABLE_LANES:
        return fallback(rows)
    rot = (lanes << 1) | (lanes < 0)  # rotl32(lane, 1): the top bit comes round to bit 0
    return (rot * _lane_table(lanes.shape[1], rows.device, row=True)).sum(-1)


def device_words(t: torch.Tensor, fingerprint, stats: bool) -> torch.Tensor:
    """int64 words on `t`'s device: its fingerprint (2), then, for floating dtypes with `stats`, the finite values'
    min, max and sum and the finite and NaN counts (float64 bits). Nothing is read back; nine device ops for the
    statistics (the finite mask, one masked copy of the values, four reductions, the NaN mask, one concatenation).
    Run under no_grad (the caller's). With Triton on CUDA: one fused pass (divtrace.trace.device_kernels)."""
    if device_kernels.available(t):
        got = device_kernels.value_words(t, weights.inner(t.device), lambda b: weights.outer(b, t.device), stats)
        if got is not None:
            return got
    fp = whole_fingerprint(t, fingerprint)
    if not (stats and t.is_floating_point() and t.numel()):
        return fp
    x = t
    if x.element_size() == 1:  # fp8 has few kernels
        x = x.float()
    x = x.reshape(1, -1)
    key = (x.device, x.dtype)
    fill = _FILLS.get(key)
    if fill is None:
        fill = torch.full((3, 1), math.inf, dtype=x.dtype, device=x.device)  # (made there: no copy from the host)
        fill[1].fill_(-math.inf)
        fill[2].fill_(0.0)
        _FILLS[key] = fill
    fin = (x - x) == 0  # (isfinite is four kernels; x - x is 0 exactly where x is finite, NaN elsewhere)
    y = torch.where(fin, x, fill)  # [3, n]: for the min, the max and the sum, non-finite values made neutral
    lo, hi = torch.aminmax(y, dim=1)  # (of all three rows: slicing costs the host more than the extra reads)
    # fp bits as float64 (a view), the rest converted: one concatenation, read back as int64 words
    return torch.cat([fp.view(torch.float64), lo, hi, y.sum(1, dtype=torch.float64), fin.sum(1),
                      torch.isnan(x).sum(1)]).view(torch.int64)


class PendingValue:
    """The fingerprint and statistics of one value, in a slot (`device_words`'s layout), resolved once."""

    __slots__ = ("slot", "numel", "float", "staged", "_hex", "_stats")

    def __init__(self, slot: Slot, numel: int, is_float: bool):
        self.slot, self.numel, self.float = slot, numel, is_float
        self.staged = None  # full mode: the value's bytes on their way to the host (device_writer.StagedBytes)
        self._hex = self._stats = None

    def hex(self) -> str:
        if self._hex is None:
            self._resolve()
        return self._hex

    def stats(self) -> dict:
        if self._hex is None:
            self._resolve()
        return self._stats

    def _resolve(self) -> None:
        w = self.slot.words()
        stats = {}
        if w.shape[0] > 2:
            st = w[2:].view("<f8")  # lo[3], hi[3], sums[3], finite, nan (device_words)
            lo, hi, total, finite, nan = float(st[0]), float(st[4]), float(st[8]), float(st[9]), float(st[10])
            finite, nan = int(finite), int(nan)
            stats = summary_from(lo, hi, total, finite, nan, self.numel - finite - nan)
        self._stats = stats
        self._hex = to_hex(int(w[0]), int(w[1]))


def summary_from(lo: float, hi: float, total: float, finite: int, nan: int, inf: int) -> dict:
    """The summary stats dict, as the CPU kernel's (divtrace.trace.hashing.base.finish_stats) gives it."""
    if not finite:
        return {"min": "nan", "max": "nan", "mean": "nan", "absmax": "nan", "nan": nan, "inf": inf}
    mean = total / finite
    if not math.isfinite(mean):
        mean = repr(mean)
    return {"min": lo, "max": hi, "mean": mean, "absmax": max(-lo, hi), "nan": nan, "inf": inf}


class PendingRows:
    """The token-row fingerprints of one value, in a slot: rows.bin's bytes once landed."""

    __slots__ = ("slot",)

    def __init__(self, slot: Slot):
        self.slot = slot

    def __len__(self) -> int:
        return self.slot.length

    def bytes(self) -> bytes:
        return self.slot.words().astype("<i8", copy=False).tobytes()


class PendingDerived:
    """A derived view's fingerprint (divtrace.trace.derived_views) whose source fingerprint is still pending: the
    source's hash as it was when the view was made (a str or a pending one), resolved on the writer thread."""

    __slots__ = ("src", "args", "_hex")

    def __init__(self, src, *args):
        self.src, self.args, self._hex = src, args, None

    def hex(self) -> str:
        if self._hex is None:
            from divtrace.trace.derived_views import view_fingerprint

            op, dtype, src_shape, shape, enc_args, enc_kwargs = self.args
            self._hex = view_fingerprint(op, hex_of(self.src), dtype, src_shape, shape, enc_args, enc_kwargs)
        return self._hex


def hex_of(h) -> str:
    """A value's hash field as its hex: a str as it is, a pending one resolved."""
    return h if type(h) is str else h.hex()


def stats_of(st) -> dict:
    return st if type(st) is dict else st.stats()


class WriterThread:
    """Runs jobs in order on one thread: each lands its batches first (waits for their copies), then writes. The
    first error stops it; `check` raises it on the recording thread."""

    def __init__(self, name: str = "divtrace-writer"):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.busy_seconds = 0.0
        self._running = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, batches: list[Batch], fn, always: bool = False) -> None:
        """Queue `fn` to run after `batches` landed; `always`: run it even after an error (a marker)."""
        self._q.put((batches, fn, always))

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            self._running = True
            if self.error is not None:
                if job[2]:
                    job[1]()
                continue
            t0 = time.perf_counter()
            try:
                for b in job[0]:
                    b.land()
                job[1]()
            except BaseException as e:  # (kept for the recording thread: raised there by check)
                self.error = e
            self.busy_seconds += time.perf_counter() - t0
            self._running = False

    def idle(self) -> bool:
        """Nothing queued and nothing running (a snapshot)."""
        return not self._running and self._q.empty()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def drain(self) -> None:
        """Run every job submitted so far, then stop the thread."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()
