"""Recording on a device without waiting for it: the recorder's side of the trace writer's device path.

A model on a device (CUDA, or any device other than the CPU) is recorded through `TraceWriter.use_device`
(divtrace.trace.device_writer): fingerprints, summary statistics and token-row fingerprints are computed on the
device and come to the host in batches, on a writer thread. Inside the recorded block the host reads nothing
of the device but what token identity needs: the root call's input ids, attention mask and positions, once per
root call (divtrace.record.token_identity).

`DeviceTokenStore` is the token files' writer for that path: rows whose fingerprints are still on the device, and
the rows of provisional values (divtrace.record.values: a value whose identity its bytes decide), get their
offsets in rows.bin on the writer thread, where a provisional value that turns out to be the old one loses its
rows as the CPU path never made them.

`device_path()` (internal, for tests and benches) sends CPU tensors down the same path, so the device path's code
runs on the CPU, where a test can trap every host read it would make; `device_path(False)` keeps a device model
on the host path (every value read back where it is met), the benches' baseline.

In: the Recorder at the start of its block. Out: the trace writer's device path and the token store it uses.
"""
from __future__ import annotations

import contextlib
import json
import threading

from divtrace.record.token_store import TokenStoreWriter

_CHOICE = threading.local()


@contextlib.contextmanager
def device_path(on: bool = True):
    """Internal (tests, benches): within, recordings started on this thread take the device path for CPU tensors
    too (`on`: the device path's code, run where no device is), or never (`on=False`: every value read to the host
    where it is met, as recordings did before the device path; the benches' baseline)."""
    saved = getattr(_CHOICE, "on", None)
    _CHOICE.on = on
    try:
        yield
    finally:
        _CHOICE.on = saved


def forced_device_path():
    """`device_path(True)`."""
    return device_path(True)


def wants_device_path(device: str) -> bool:
    """Whether a recording of a model whose first parameter is on `device` takes the device path."""
    on = getattr(_CHOICE, "on", None)
    return on if on is not None else not device.startswith("cpu")


def attach(writer, token_rows) -> None:
    """Put a recording's writer and token rows on the device path (at the start of the block)."""
    device = writer.use_device(forced=getattr(_CHOICE, "on", None) is True)
    token_rows.device = device
    if token_rows.store is not None:
        old = token_rows.store
        store = token_rows.store = device.token_store = DeviceTokenStore(old.files, device)
        writer.before_flush[:] = [store.hand_over if h == old.hand_over else h for h in writer.before_flush]


class _Entry:
    """One rows.jsonl line to be: `src` is None (rows not compared), the row fingerprints (bytes, a numpy array or
    a PendingRows) or another _Entry whose rows these are (a view holding the same rows)."""

    __slots__ = ("vid", "call_id", "code", "src", "offset", "deleted", "fallback")

    def __init__(self, vid, call_id, code, src):
        self.vid, self.call_id, self.code, self.src = vid, call_id, code, src
        self.offset = -1
        self.deleted = False
        self.fallback = None  # deleted: the old value's entry that a view of it points at instead


class _PendingUsed:
    """A tokens.jsonl positions line whose ids are still on their way from the device."""

    __slots__ = ("call_id", "slot")

    def __init__(self, call_id, slot):
        self.call_id, self.slot = call_id, slot

    def __len__(self) -> int:
        return 24 + 8 * self.slot.length

    def line(self) -> str:
        return json.dumps({"P": self.call_id, "used": self.slot.words().tolist()}, separators=(",", ":"))


class DeviceTokenStore(TokenStoreWriter):
    """The token files' writer on the device path: what it is handed is resolved by the trace writer's thread and
    added to the checksummed files there, with the records of the same flush (device_writer.DeviceWriting)."""

    def __init__(self, files, device):
        super().__init__(files)
        self._device = device
        self._entries: list[_Entry] = []
        self._marks: dict[int, tuple] = {}  # provisional vid -> (keep its rows if dropped, the old value's entry)
        self._handed: list[tuple] = []  # (entries, token lines) handed over, for the next flush's job
        self.pending_bytes = 0  # about what the handed-over lines take (a flush comes when it is large)

    def provisional(self, vid: int, old_vid: int, keep: bool) -> None:
        """`vid` is a provisional value standing for `old_vid`'s bytes (divtrace.record.values): if they turn out
        the old ones, its rows are kept as `old_vid`'s (`keep`: the CPU path would hash them now) or dropped."""
        cur = self.current.get(old_vid)
        self._marks[vid] = (keep, cur[1] if cur is not None else None)

    def add_rows(self, vid: int, call_id: int, code: str, hashes) -> None:
        e = _Entry(vid, call_id, code, hashes)
        self._entries.append(e)
        self.rowed.add(vid)
        if hashes is not None:
            self.current[vid] = (code, e)

    def add_rows_ref(self, vid: int, call_id: int, code: str, offset) -> None:
        e = _Entry(vid, call_id, code, offset)  # (here `current` holds entries, so `offset` is the target's)
        self._entries.append(e)
        self.rowed.add(vid)
        self.current[vid] = (code, e)

    def add_used(self, call_id: int, used) -> None:
        import torch

        if not self._device.takes(used):
            return super().add_used(call_id, used)
        with torch.no_grad():  # queued for the host like row fingerprints; the line is made on the writer thread
            self._tokens.append(_PendingUsed(call_id, self._device.batches.add(used.reshape(-1).to(torch.int64))))

    def hand_over(self) -> None:
        """(recording thread) Keep what was made since the last hand-over for the next flush's writer job."""
        if self._entries or self._tokens:
            self.pending_bytes += sum(32 + (8 * len(e.src) if e.src is not None and type(e.src) is not _Entry else 0)
                                      for e in self._entries) + sum(len(x) + 1 for x in self._tokens)
            self._handed.append((self._entries, self._tokens))
            self._entries, self._tokens = [], []

    def take_handed(self) -> list:
        out, self._handed = self._handed, []
        self.pending_bytes = 0
        return out

    def close(self) -> dict:
        self.hand_over()
        self._device.flush_and_wait()  # (the summary's counts are the writer thread's)
        return super().close()

    # writer thread ----------------------------------------------------------------------------------------
    def write_handed(self, parts: list) -> None:
        """Resolve handed-over entries (offsets in rows.bin, provisional values settled) and add their lines to the
        checksummed files, as TokenStoreWriter.hand_over adds the CPU path's."""
        ren = self._device.renumbering
        final = ren.final
        for entries, tokens in parts:
            bins, index = [], []
            for e in entries:
                mark = self._marks.pop(e.vid, None)
                if mark is not None and e.vid in ren.alias and not mark[0]:
                    e.deleted, e.fallback = True, mark[1]  # its bytes were the old value's: the CPU path made no rows
                    continue
                src = e.src
                if src is None:
                    index.append(f'[{final(e.vid)},{e.call_id},"{e.code}",-1]')
                    self.unrowed[e.code] = self.unrowed.get(e.code, 0) + 1
                    continue
                if type(src) is _Entry:
                    target = src
                    while target is not None and target.deleted:
                        target = target.fallback
                    if target is not None:
                        e.offset = target.offset
                        index.append(f'[{final(e.vid)},{e.call_id},"{e.code}",{e.offset}]')
                        self.shared += 1
                        continue
                    src = _rows_of(src)  # the rows it pointed at were dropped, with nothing to stand for them
                data = src.bytes() if hasattr(src, "slot") else src if type(src) is bytes else \
                    src.astype("<u8", copy=False).tobytes()
                e.src, e.offset = data, self.rows
                index.append(f'[{final(e.vid)},{e.call_id},"{e.code}",{self.rows}]')
                bins.append(data)
                self.rows += len(data) >> 3
                self.values += 1
            tokens = [x if type(x) is str else x.line() for x in tokens]
            self.add_parts(bins, index, tokens)


def _rows_of(e: _Entry):
    """The row fingerprints an entry holds or points at (resolved on the writer thread)."""
    while type(e.src) is _Entry:
        e = e.src
    return e.src
