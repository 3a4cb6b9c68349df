"""TraceWriter: streams records and tensor bytes to disk as they are produced.

Records are buffered together with the tensors they define. A flush first writes the pending tensors as one
safetensors shard (atomically), then appends the records to records.jsonl. So every record on disk refers only
to bytes already on disk, and a crash at any moment leaves a readable prefix. Memory stays bounded by
`shard_bytes` because pending tensors are flushed as soon as they exceed it.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from divtrace.errors import DivtraceError
from divtrace.fingerprint import summary_stats, tensor_hash
from divtrace.records import FORMAT_VERSION, TensorValue, record_to_json
from divtrace.trace.files import META, RECORDS, SHARD_GLOB, SHARD_PATTERN, atomic_write_bytes, atomic_write_json


def _json_safe(x):
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return repr(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def prepare_trace_dir(path: Path, overwrite: bool) -> None:
    """Create `path`, refusing to mix with an existing trace or with unrelated files."""
    if path.exists() and not path.is_dir():
        raise DivtraceError(f"{path}: exists and is not a directory")
    if path.is_dir():
        entries = [p for p in path.iterdir()]
        if (path / META).exists():
            if not overwrite:
                raise DivtraceError(f"{path}: already holds a trace (pass overwrite=True / --overwrite to replace it)")
            for p in entries:
                if p.name in (META, RECORDS) or p.match(SHARD_GLOB) or p.name.endswith(".tmp"):
                    p.unlink()
        elif entries:
            raise DivtraceError(f"{path}: directory is not empty and holds no trace; choose a new directory")
    try:
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
                         started=time.time())
        self._shard_bytes = shard_bytes
        self._flush_records = flush_records
        self._pending_records: list[str] = []
        self._pending_tensors: dict[str, torch.Tensor] = {}
        self._pending_nbytes = 0
        self._blobs: dict[str, str] = {}  # blob key -> shard file it lives in
        self._shards: list[str] = []
        self._next_vid = 0
        self.n_records = 0
        self.bytes_written = 0
        atomic_write_json(self.path / META, _json_safe(self.meta))
        self._records_file = open(self.path / RECORDS, "ab")

    # values ---------------------------------------------------------------------------------------------
    def take_vid(self) -> int:
        vid = self._next_vid
        self._next_vid += 1
        return vid

    def new_value(self, t: torch.Tensor, producer: int | None) -> TensorValue:
        """Fingerprint `t` now (and keep a copy of its bytes in full mode), returning its new value."""
        t = t.detach()
        h = tensor_hash(t)
        v = TensorValue(vid=self.take_vid(), dtype=str(t.dtype), shape=list(t.shape), stride=list(t.stride()),
                        hash=h, device=str(t.device), stats=_json_safe(summary_stats(t)), producer=producer,
                        nbytes=t.numel() * t.element_size())
        if self.mode == "full":
            # Content-addressed: views, reshapes and copies of the same bytes share one blob.
            key = f"{str(t.dtype).removeprefix('torch.')}-{t.numel()}-{h}"
            if key not in self._blobs and key not in self._pending_tensors:
                self._pending_tensors[key] = t.to("cpu", copy=True).contiguous().reshape(-1)
                self._pending_nbytes += v.nbytes
            v.blob = key
            v.shard = self._blobs.get(key)  # filled at flush for pending blobs
        return v

    # records --------------------------------------------------------------------------------------------
    def append(self, rec, values: list[TensorValue]) -> None:
        self._pending_records.append((rec, values))
        self.n_records += 1
        if self._pending_nbytes >= self._shard_bytes or len(self._pending_records) >= self._flush_records:
            self.flush()

    def flush(self) -> None:
        shard = None
        if self._pending_tensors:
            shard = SHARD_PATTERN.format(len(self._shards))
            data = st_save(self._pending_tensors)
            atomic_write_bytes(self.path / shard, data)
            self.bytes_written += len(data)
            self._shards.append(shard)
            for key in self._pending_tensors:
                self._blobs[key] = shard
            self._pending_tensors = {}
            self._pending_nbytes = 0
        if self._pending_records:
            lines = []
            for rec, values in self._pending_records:
                for v in values:
                    if v.blob is not None and v.shard is None:
                        v.shard = self._blobs[v.blob]
                lines.append(json.dumps(_json_safe(record_to_json(rec, values)), allow_nan=False))
            data = ("\n".join(lines) + "\n").encode()
            self._records_file.write(data)
            self._records_file.flush()
            self.bytes_written += len(data)
            self._pending_records = []

    def close(self, status: str = "complete", error: str | None = None, **extra) -> None:
        """Flush everything and mark the trace; `status` other than "complete" marks it incomplete."""
        try:
            self.flush()
        finally:
            try:
                os.fsync(self._records_file.fileno())
            finally:
                self._records_file.close()
            self.meta.update(status=status, complete=(status == "complete"), error=error, records=self.n_records,
                             shards=list(self._shards), finished=time.time(), **extra)
            atomic_write_json(self.path / META, _json_safe(self.meta))
