"""Reading a trace back: metadata and records eagerly, tensor bytes lazily and checked against fingerprints."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from divtrace.errors import DivtraceError
from divtrace.fingerprint import tensor_hash
from divtrace.records import FORMAT_VERSION, RECORD_TYPES, ModuleCall, ModuleEnter, ModuleExit, OpRecord, TensorValue
from divtrace.trace.files import META, RECORDS

_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                                torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32", "uint64",
              "complex32"):
    if hasattr(torch, _name):
        _DTYPES[f"torch.{_name}"] = getattr(torch, _name)


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise DivtraceError(f"unknown dtype {name!r} in trace") from None


def _value_from_json(d: dict, where: str) -> TensorValue:
    try:
        v = TensorValue(**d)
        if not (isinstance(v.vid, int) and isinstance(v.shape, list) and all(isinstance(s, int) and s >= 0 for s in v.shape)
                and isinstance(v.hash, str) and isinstance(v.dtype, str)):
            raise TypeError("bad field types")
        return v
    except TypeError as e:
        raise DivtraceError(f"{where}: malformed tensor value: {e}") from None


def _record_from_json(d: dict, where: str):
    if not isinstance(d, dict) or d.get("kind") not in RECORD_TYPES:
        raise DivtraceError(f"{where}: not a divtrace record (missing or unknown 'kind')")
    d = dict(d)
    values = [_value_from_json(v, where) for v in d.pop("values", [])]
    cls = RECORD_TYPES[d["kind"]]
    try:
        rec = cls(**d)
    except TypeError as e:
        raise DivtraceError(f"{where}: malformed {d['kind']} record: {e}") from None
    if not isinstance(rec.index, int) or not isinstance(rec.call_id, int):
        raise DivtraceError(f"{where}: malformed {d['kind']} record: index and call_id must be integers")
    if isinstance(rec, (ModuleEnter, ModuleExit)):
        field_name = "inputs" if isinstance(rec, ModuleEnter) else "outputs"
        pairs = getattr(rec, field_name)
        if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 and isinstance(p[1], int) for p in pairs):
            raise DivtraceError(f"{where}: malformed {d['kind']} record: {field_name} must be [key, vid] pairs")
        setattr(rec, field_name, [(str(k), v) for k, v in pairs])
    elif not (isinstance(rec.inputs, list) and isinstance(rec.outputs, list) and isinstance(rec.op, str)):
        raise DivtraceError(f"{where}: malformed op record")
    return rec, values


class Trace:
    """A trace directory opened for reading. Tensors are loaded only when asked for (`tensor(vid)`)."""

    def __init__(self, path):
        self.path = Path(path)
        self._check_dir()
        self.meta = self._read_meta()
        self.records: list = []
        self.values: dict[int, TensorValue] = {}
        self.calls: dict[int, ModuleCall] = {}
        self.torn_tail = False
        self._read_records()
        self._shards: dict[str, object] = {}

    # loading ----------------------------------------------------------------------------------------------
    def _check_dir(self) -> None:
        p = self.path
        if not p.exists():
            raise DivtraceError(f"{p}: no such trace directory")
        if not p.is_dir():
            raise DivtraceError(f"{p}: is a file, not a trace directory")
        if not (p / META).exists():
            what = "empty directory" if not any(p.iterdir()) else "directory without meta.json"
            raise DivtraceError(f"{p}: not a divtrace trace ({what})")

    def _read_meta(self) -> dict:
        where = self.path / META
        try:
            meta = json.loads(where.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DivtraceError(f"{where}: unreadable trace metadata: {e}") from None
        if not isinstance(meta, dict) or "format_version" not in meta:
            raise DivtraceError(f"{where}: not divtrace metadata (no format_version)")
        fv = meta["format_version"]
        if not isinstance(fv, int):
            raise DivtraceError(f"{where}: format_version must be an integer, got {fv!r}")
        if fv > FORMAT_VERSION:
            raise DivtraceError(f"{where}: written by a newer divtrace (format_version {fv}, this one reads up to "
                                f"{FORMAT_VERSION}); upgrade divtrace")
        if meta.get("mode") not in ("full", "hash"):
            raise DivtraceError(f"{where}: unknown mode {meta.get('mode')!r}")
        return meta

    def _read_records(self) -> None:
        where = self.path / RECORDS
        try:
            raw = where.read_bytes()
        except OSError as e:
            raise DivtraceError(f"{where}: cannot read records: {e.strerror or e}") from None
        lines = raw.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        elif lines:
            # No newline at the end: the last line was being written when the run died.
            lines.pop()
            self.torn_tail = True
        for n, line in enumerate(lines, 1):
            loc = f"{where}:{n}"
            try:
                d = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise DivtraceError(f"{loc}: corrupt record (not JSON)") from None
            rec, values = _record_from_json(d, loc)
            if rec.index != len(self.records):
                raise DivtraceError(f"{loc}: record index {rec.index}, expected {len(self.records)}")
            for v in values:
                self.values[v.vid] = v
            self._link(rec, loc)
            self.records.append(rec)

    def _link(self, rec, loc: str) -> None:
        vids = ([v for _, v in rec.inputs] if isinstance(rec, ModuleEnter) else
                [v for _, v in rec.outputs] if isinstance(rec, ModuleExit) else rec.inputs + rec.outputs)
        for vid in vids:
            if vid not in self.values:
                raise DivtraceError(f"{loc}: refers to tensor value {vid}, which no earlier record defines")
        if isinstance(rec, ModuleEnter):
            if rec.call_id in self.calls:
                raise DivtraceError(f"{loc}: duplicate module call id {rec.call_id}")
            self.calls[rec.call_id] = ModuleCall(rec.call_id, rec.module, rec.call, rec.parent, rec.index, rec.inputs)
            if rec.parent is not None:
                if rec.parent not in self.calls:
                    raise DivtraceError(f"{loc}: parent call {rec.parent} not found")
                self.calls[rec.parent].children.append(rec.call_id)
        else:
            call = self.calls.get(rec.call_id)
            if call is None:
                raise DivtraceError(f"{loc}: refers to module call {rec.call_id}, which never started")
            if isinstance(rec, ModuleExit):
                call.exit_index, call.outputs = rec.index, rec.outputs
            else:
                call.ops.append(rec.index)

    # queries ----------------------------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return bool(self.meta.get("complete")) and not self.torn_tail

    @property
    def mode(self) -> str:
        return self.meta["mode"]

    @property
    def label(self) -> str:
        return self.meta.get("label") or self.path.name

    def has_bytes(self, vid: int) -> bool:
        return self.values[vid].blob is not None

    def roots(self) -> list[ModuleCall]:
        return [c for c in self.calls.values() if c.parent is None]

    def tensor(self, vid: int) -> torch.Tensor:
        """The recorded value, loaded lazily and checked bit-exactly against its fingerprint."""
        v = self.values[vid]
        if v.blob is None:
            raise DivtraceError(f"{self.path}: value {vid} has no stored bytes (trace recorded with mode='hash')")
        shard = self._open_shard(v.shard, vid)
        try:
            flat = shard.get_tensor(v.blob)
        except Exception:
            raise DivtraceError(f"{self.path / str(v.shard)}: tensor {v.blob} missing or unreadable") from None
        if str(flat.dtype) != v.dtype or flat.numel() != v.numel:
            raise DivtraceError(f"{self.path / v.shard}: tensor {v.blob} has dtype/size {flat.dtype}/{flat.numel()}, "
                                f"the record says {v.dtype}/{v.numel}")
        t = flat.reshape(v.shape)
        if tensor_hash(t) != v.hash:
            raise DivtraceError(f"{self.path / v.shard}: tensor {v.blob} is corrupt (bytes do not match the recorded "
                                "fingerprint)")
        return t

    def _open_shard(self, name, vid):
        if name not in self._shards:
            from safetensors import safe_open

            p = self.path / str(name)
            if not isinstance(name, str) or "/" in name or "\\" in name or name.startswith(".") or not p.is_file():
                raise DivtraceError(f"{self.path}: value {vid} points to missing shard {name!r}")
            try:
                self._shards[name] = safe_open(str(p), framework="pt")
            except Exception as e:
                raise DivtraceError(f"{p}: truncated or corrupt safetensors shard ({type(e).__name__})") from None
        return self._shards[name]


def open_trace(path) -> Trace:
    return Trace(path)
