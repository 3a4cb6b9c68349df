"""Reading a trace back: metadata and records eagerly and validated, tensor bytes lazily and checked.

Nothing here trusts the files: a trace may be truncated, hand-edited, corrupted or written by another
version. Every problem is a DivtraceError naming the file (and line). records.jsonl is verified against its
sha256 before it is parsed (from meta.json when the recording closed, else from checksums.jsonl, which also
covers what a killed run left). Tensor bytes are checked against their fingerprint on every load, and
`verify_shards()` checks whole shard files against their sha256 (what bisect needs before "identical").
"""
from __future__ import annotations

import gc
import hashlib
import json
import re
from pathlib import Path

import torch

from divtrace.errors import DivtraceError
from divtrace.fingerprint import HASH_SCHEME, hasher
from divtrace.records import FORMAT_VERSION, contiguous_stride, ModuleCall, ModuleEnter, ModuleExit, OpRecord, TensorValue
from divtrace.trace.files import CHECKSUMS, META, RECORDS, sha256_file

_DTYPES = {}
for _name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
              "complex64", "complex128", "complex32", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
              "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _DTYPES[f"torch.{_name}"] = getattr(torch, _name)

_HEX32 = re.compile(r"[0-9a-f]{32}\Z")
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_SHARD_NAME = re.compile(r"tensors-\d{5,}\.safetensors\Z")


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise DivtraceError(f"unknown dtype {name!r} in trace") from None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _str_or_none(x) -> bool:
    return x is None or isinstance(x, str)


# meta.json fields divtrace itself reads, and the type each must have (others are kept as they are).
_META_FIELDS = {
    "complete": lambda x: isinstance(x, bool), "status": lambda x: isinstance(x, str), "label": _str_or_none,
    "error": _str_or_none, "ops": lambda x: isinstance(x, bool), "settings": lambda x: isinstance(x, dict),
    "module_tree": lambda x: isinstance(x, list) and all(isinstance(p, list) and len(p) == 2
                                                         and all(isinstance(s, str) for s in p) for p in x),
    "warnings": lambda x: isinstance(x, list) and all(isinstance(w, str) for w in x),
    "records": _is_int, "shards": lambda x: isinstance(x, list) and all(isinstance(s, str) for s in x),
    "entry": _str_or_none, "entry_args": lambda x: isinstance(x, dict), "model_class": _str_or_none,
    "torch_version": _str_or_none, "device": _str_or_none, "hash_scheme": lambda x: isinstance(x, str),
    "include": _str_or_none, "exclude": _str_or_none, "unfinished_calls": _is_int,
}


def _checksums_ok(c) -> bool:
    if not isinstance(c, dict) or set(c) != {"records", "shards"}:
        return False
    r, s = c["records"], c["shards"]
    return (isinstance(r, dict) and isinstance(r.get("sha256"), str) and _is_int(r.get("bytes"))
            and isinstance(s, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in s.items()))


class Trace:
    """A trace directory opened for reading. Tensors are loaded only when asked for (`tensor(vid)`)."""

    def __init__(self, path):
        self.path = Path(path)
        self._check_dir()
        self.meta = self._read_meta()
        self._full = self.meta["mode"] == "full"
        self._hash = hasher(self.meta["hash_scheme"])
        self.records: list = []
        self.values: dict[int, TensorValue] = {}
        self.calls: dict[int, ModuleCall] = {}
        self.torn_tail = False  # bytes after the last whole, verified flush were dropped
        self.verified = True  # records.jsonl matched a recorded sha256
        self.warnings: list[str] = []
        self._shard_sums: dict[str, str] = {}
        self._open: set[int] = set()  # calls entered and not exited
        self._call_keys: set[tuple[str, int]] = set()
        self._call_counts: dict[str, int] = {}
        self._read_records()
        self._shards: dict[str, object] = {}
        self._shards_verified = False

    # loading ----------------------------------------------------------------------------------------------
    def _check_dir(self) -> None:
        p = self.path
        try:
            if not p.exists():
                raise DivtraceError(f"{p}: no such trace directory")
            if not p.is_dir():
                raise DivtraceError(f"{p}: is a file, not a trace directory")
            if not (p / META).is_file():
                what = "empty directory" if not any(p.iterdir()) else "directory without meta.json"
                raise DivtraceError(f"{p}: not a divtrace trace ({what})")
        except OSError as e:
            raise DivtraceError(f"{p}: cannot read trace directory: {e.strerror or e}") from None

    def _read_meta(self) -> dict:
        where = self.path / META
        try:
            meta = json.loads(where.read_bytes())
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise DivtraceError(f"{where}: unreadable trace metadata ({type(e).__name__})") from None
        if not isinstance(meta, dict) or "format_version" not in meta:
            raise DivtraceError(f"{where}: not divtrace metadata (no format_version)")
        fv = meta["format_version"]
        if not _is_int(fv):
            raise DivtraceError(f"{where}: format_version must be an integer, got {fv!r}"[:300])
        if fv > FORMAT_VERSION:
            raise DivtraceError(f"{where}: written by a newer divtrace (format_version {fv}, this one reads up to "
                                f"{FORMAT_VERSION}); upgrade divtrace")
        if fv < 1:
            raise DivtraceError(f"{where}: format_version {fv} is not a divtrace format")
        if meta.get("mode") not in ("full", "hash"):
            raise DivtraceError(f"{where}: unknown mode {meta.get('mode')!r}"[:300])
        for k, ok in _META_FIELDS.items():
            if k in meta and not ok(meta[k]):
                raise DivtraceError(f"{where}: field {k!r} is malformed (edited by hand?)")
        if "hash_scheme" not in meta:
            raise DivtraceError(f"{where}: no hash_scheme: written by an early development version of divtrace "
                                "whose fingerprints cannot be verified; record it again")
        if hasher(meta["hash_scheme"]) is None:
            raise DivtraceError(f"{where}: fingerprint scheme {meta['hash_scheme']!r} is unknown to this divtrace "
                                f"(it knows {HASH_SCHEME!r}); upgrade divtrace"[:300])
        if "checksums" in meta and not _checksums_ok(meta["checksums"]):
            raise DivtraceError(f"{where}: field 'checksums' is malformed (edited by hand?)")
        if meta.get("complete") is True and ("checksums" not in meta or meta.get("status") != "complete"):
            raise DivtraceError(f"{where}: marked complete but lacks what a finished recording writes (status, "
                                "checksums): edited by hand?")
        return meta

    def _verified_records(self) -> bytes:
        """The bytes of records.jsonl that a recorded sha256 vouches for."""
        where = self.path / RECORDS
        try:
            raw = where.read_bytes()
        except OSError as e:
            raise DivtraceError(f"{where}: cannot read records: {e.strerror or e}") from None
        sums = self.meta.get("checksums")
        if sums is not None:  # the recording closed: the whole file is accounted for
            self._shard_sums = dict(sums["shards"])
            want = sums["records"]
            if len(raw) != want["bytes"]:
                raise DivtraceError(f"{where}: {len(raw)} bytes, but the recording closed it at {want['bytes']} "
                                    "(truncated or edited)")
            if hashlib.sha256(raw).hexdigest() != want["sha256"]:
                raise DivtraceError(f"{where}: contents do not match the sha256 recorded in meta.json (edited or "
                                    "corrupted)")
            return raw
        checkpoints = self._read_checksums_file()
        if checkpoints is None:
            self.verified = False
            self.warnings.append(f"{self.path}: no checksums (meta.json unfinished and {CHECKSUMS} missing): "
                                 "records are not verified")
            return raw
        best = max((c for c in checkpoints if c[0] <= len(raw)), default=(0, hashlib.sha256(b"").hexdigest()))
        if hashlib.sha256(raw[:best[0]]).hexdigest() != best[1]:
            raise DivtraceError(f"{where}: the first {best[0]} bytes do not match their sha256 in {CHECKSUMS} "
                                "(edited or corrupted)")
        if best[0] < len(raw):
            self.torn_tail = True  # a write the run did not finish
        return raw[:best[0]]

    def _read_checksums_file(self):
        where = self.path / CHECKSUMS
        try:
            raw = where.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise DivtraceError(f"{where}: cannot read: {e.strerror or e}") from None
        lines = raw.split(b"\n")
        last_whole = lines.pop()  # b"" when the file ends with a newline; else a line the run did not finish
        del last_whole
        checkpoints = []
        for n, line in enumerate(lines, 1):
            try:
                d = json.loads(line)
            except (ValueError, RecursionError):
                raise DivtraceError(f"{where}:{n}: corrupt line (not JSON)") from None
            if isinstance(d, dict) and set(d) == {"records", "sha256"} and _is_int(d["records"]) \
                    and isinstance(d["sha256"], str):
                checkpoints.append((d["records"], d["sha256"]))
            elif isinstance(d, dict) and set(d) == {"shard", "sha256", "bytes"} and isinstance(d["shard"], str) \
                    and isinstance(d["sha256"], str):
                self._shard_sums[d["shard"]] = d["sha256"]
            else:
                raise DivtraceError(f"{where}:{n}: not a checksum line")
        return checkpoints

    def _read_records(self) -> None:
        # Building hundreds of thousands of small objects triggers the cyclic GC over and over (it was most of
        # the load time); none of them form cycles, so it is paused while reading.
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._read_records_unpaused()
        finally:
            if was_enabled:
                gc.freeze()  # keep them out of later collections too: re-scanning a million records costs seconds
                gc.enable()

    def _read_records_unpaused(self) -> None:
        where = self.path / RECORDS
        raw = self._verified_records()
        lines = raw.split(b"\n")
        if lines[-1] == b"":
            lines.pop()
        else:
            # No newline at the end (only possible without checksums): the line was being written.
            lines.pop()
            self.torn_tail = True
        parsed = None
        if getattr(self, "verified", True):
            # Bytes a checksum vouches for are lines divtrace wrote, one object each: one parse for the whole
            # file is several times faster than one per line. Anything else goes line by line, so a bad line is
            # named.
            try:
                parsed = json.loads(b"[" + b",".join(lines) + b"]")
            except (ValueError, RecursionError):
                parsed = None
        if parsed is not None and len(parsed) != len(lines):
            parsed = None
        for n, line in enumerate(lines, 1):
            loc = f"{where}:{n}"
            if parsed is not None:
                d, parsed[n - 1] = parsed[n - 1], None  # let each parsed line go once used: halves the peak
            else:
                try:
                    d = json.loads(line)
                except (ValueError, RecursionError):
                    raise DivtraceError(f"{loc}: corrupt record (not JSON)") from None
            try:
                self._add(d, loc)
            except DivtraceError:
                raise
            except Exception as e:  # any shape of nonsense a hand edit can produce is still a clean error
                raise DivtraceError(f"{loc}: malformed record ({type(e).__name__})") from None
        want = self.meta.get("records")
        if "checksums" in self.meta and want is not None and want != len(self.records):
            raise DivtraceError(f"{self.path / META}: says {want} records, {RECORDS} holds {len(self.records)}")

    # validation -----------------------------------------------------------------------------------------
    # Records are in the compact form of divtrace.records.record_compact. Every field is type-checked with
    # plain `type(x) is ...` tests (this loop runs once per record, so it is kept lean); anything else a hand
    # edit can produce (a missing key, a wrong container) raises here and becomes one "malformed record" line.
    def _value(self, d, producer_ok, loc: str) -> TensorValue:
        vid, short, shape, h = d["v"], d["d"], d["s"], d["h"]
        full_name = "torch." + short if type(short) is str else None
        dtype = _DTYPES.get(full_name)
        if type(vid) is not int or vid < 0 or dtype is None or type(shape) is not list:
            raise DivtraceError(f"{loc}: malformed tensor value {vid!r}"[:300])
        n = 1
        for x in shape:
            if type(x) is not int or x < 0:
                raise DivtraceError(f"{loc}: malformed tensor value {vid}: bad shape"[:300])
            n *= x
        if type(h) is not str or _HEX32.match(h) is None:
            raise DivtraceError(f"{loc}: malformed tensor value {vid}: bad hash"[:300])
        stride = d.get("t")
        if stride is None:
            stride = contiguous_stride(shape)
        elif type(stride) is not list or len(stride) != len(shape) or any(type(x) is not int for x in stride):
            raise DivtraceError(f"{loc}: malformed tensor value {vid}: bad stride"[:300])
        producer = d.get("p")
        if producer is not None and producer != producer_ok:
            raise DivtraceError(f"{loc}: tensor value {vid} names producer {producer!r}, not this record"[:300])
        device = d.get("dev", "cpu")
        m = d.get("m")
        if m is not None:
            lo, hi, mean, nan, inf = m
            absmax = max(abs(lo), abs(hi)) if type(lo) in (int, float) and type(hi) in (int, float) else "nan"
            stats = {"min": lo, "max": hi, "mean": mean, "absmax": absmax, "nan": nan, "inf": inf}
        else:
            stats = d.get("M", {})
        blob, shard = d.get("b"), d.get("f")
        if type(device) is not str or type(stats) is not dict:
            raise DivtraceError(f"{loc}: malformed tensor value {vid}"[:300])
        if self._full:
            if type(blob) is not str or type(shard) is not str or _SHARD_NAME.match(shard) is None:
                raise DivtraceError(f"{loc}: tensor value {vid} has no valid stored bytes in a full-mode trace")
        elif blob is not None or shard is not None:
            raise DivtraceError(f"{loc}: tensor value {vid} points to stored bytes in a hash-mode trace")
        return TensorValue(vid, full_name, shape, stride, h, device, stats, producer, blob, shard, n * dtype.itemsize)

    @staticmethod
    def _pairs(pairs, loc: str, what: str) -> list[tuple[str, int]]:
        if type(pairs) is not list:
            raise DivtraceError(f"{loc}: malformed record: {what} must be [key, vid] pairs")
        out = []
        for p in pairs:
            if type(p) is not list or len(p) != 2 or type(p[0]) is not str or type(p[1]) is not int:
                raise DivtraceError(f"{loc}: malformed record: {what} must be [key, vid] pairs")
            out.append((p[0], p[1]))
        return out

    def _add(self, d, loc: str) -> None:
        if type(d) is not dict or d.get("k") not in ("e", "x", "o"):
            raise DivtraceError(f"{loc}: not a divtrace record (missing or unknown 'k')")
        kind, index, call_id = d["k"], d["i"], d["c"]
        if type(index) is not int or type(call_id) is not int:
            raise DivtraceError(f"{loc}: malformed record: index and call_id must be integers")
        if index != len(self.records):
            raise DivtraceError(f"{loc}: record index {index}, expected {len(self.records)}")
        new = {}
        raw_values = d.get("V", ())
        if type(raw_values) not in (list, tuple):
            raise DivtraceError(f"{loc}: malformed record: values must be a list")
        for vd in raw_values:
            if type(vd) is not dict:
                raise DivtraceError(f"{loc}: malformed tensor value (not an object)")
            v = self._value(vd, index if kind == "o" else None, loc)
            if v.vid in self.values or v.vid in new:
                raise DivtraceError(f"{loc}: tensor value {v.vid} defined twice")
            new[v.vid] = v
        if kind == "e":
            module, call, parent = d["m"], d["n"], d.get("p")
            if type(module) is not str or type(call) is not int or call < 0 or not (parent is None or type(parent) is int):
                raise DivtraceError(f"{loc}: malformed enter record")
            rec = ModuleEnter(index, call_id, module, call, parent, self._pairs(d["in"], loc, "inputs"))
            used = [v for _, v in rec.inputs]
        elif kind == "x":
            err = d.get("err")
            if not _str_or_none(err):
                raise DivtraceError(f"{loc}: malformed exit record")
            rec = ModuleExit(index, call_id, self._pairs(d["out"], loc, "outputs"), err)
            used = [v for _, v in rec.outputs]
        else:
            op, args, kwargs, out = d["op"], d["a"], d.get("kw", {}), d["o"]
            if type(op) is not str or type(args) is not list or type(kwargs) is not dict:
                raise DivtraceError(f"{loc}: malformed op record")
            inputs, outputs = d["in"], d["out"]
            if type(inputs) is not list or type(outputs) is not list or any(type(x) is not int for x in inputs + outputs):
                raise DivtraceError(f"{loc}: malformed op record")
            rec = OpRecord(index, call_id, op, args, kwargs, inputs, outputs, out)
            used = inputs
            for vid in outputs:
                v = new.get(vid)
                if v is None or v.producer != index:
                    raise DivtraceError(f"{loc}: op output {vid} is not a value this op produced")
        values = self.values
        for vid in used:
            if vid not in values and vid not in new:
                raise DivtraceError(f"{loc}: refers to tensor value {vid}, which no record defines")
        for v in new.values():
            if v.producer is not None and v.vid not in rec.outputs:
                raise DivtraceError(f"{loc}: a value names this op as producer but is not among its outputs")
        self._link(rec, loc)
        values.update(new)
        self.records.append(rec)

    def _link(self, rec, loc: str) -> None:
        if isinstance(rec, ModuleEnter):
            if rec.call_id in self.calls:
                raise DivtraceError(f"{loc}: duplicate module call id {rec.call_id}")
            if rec.parent is not None and rec.parent not in self._open:
                raise DivtraceError(f"{loc}: parent call {rec.parent} is not a running module call")
            if rec.call != self._call_counts.get(rec.module, 0):
                raise DivtraceError(f"{loc}: {rec.module or '<root>'} call {rec.call} out of order (expected call "
                                    f"{self._call_counts.get(rec.module, 0)})"[:300])
            self._call_counts[rec.module] = rec.call + 1
            self.calls[rec.call_id] = ModuleCall(rec.call_id, rec.module, rec.call, rec.parent, rec.index, rec.inputs)
            self._open.add(rec.call_id)
            if rec.parent is not None:
                self.calls[rec.parent].children.append(rec.call_id)
            return
        if rec.call_id not in self._open:
            state = "already returned" if rec.call_id in self.calls else "never started"
            raise DivtraceError(f"{loc}: refers to module call {rec.call_id}, which {state}")
        call = self.calls[rec.call_id]
        if isinstance(rec, ModuleExit):
            call.exit_index, call.outputs = rec.index, rec.outputs
            self._open.discard(rec.call_id)
        else:
            call.ops.append(rec.index)

    # queries ----------------------------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return bool(self.meta.get("complete")) and not self.torn_tail

    @property
    def status(self) -> str:
        """meta's status, spelled out when the recording never closed (killed, or still running)."""
        s = self.meta.get("status", "?")
        if s == "running":
            return "running (never closed: the recording process was killed or is still running)"
        return s

    @property
    def mode(self) -> str:
        return self.meta["mode"]

    @property
    def label(self) -> str:
        return self.meta.get("label") or self.path.name

    @property
    def hash_scheme(self) -> str:
        return self.meta["hash_scheme"]

    def has_bytes(self, vid: int) -> bool:
        return self.values[vid].blob is not None

    def roots(self) -> list[ModuleCall]:
        return [c for c in self.calls.values() if c.parent is None]

    def tensor(self, vid: int) -> torch.Tensor:
        """The recorded value, loaded lazily and checked bit-exactly against its fingerprint."""
        v = self.values[vid]
        if v.blob is None:
            raise DivtraceError(f"{self.path}: value {vid} has no stored bytes (trace recorded with mode='hash')")
        where = self.path / v.shard
        shard = self._open_shard(v.shard, vid)
        try:
            flat = shard.get_tensor(v.blob)
        except Exception:
            raise DivtraceError(f"{where}: tensor {v.blob} missing or unreadable") from None
        dtype = torch_dtype(v.dtype)
        if flat.dtype == torch.uint8 and dtype != torch.uint8 and flat.dim() == 1 \
                and flat.numel() == v.numel * dtype.itemsize:
            flat = flat.view(dtype)  # a dtype safetensors cannot hold, stored as raw bytes
        if flat.dtype != dtype or flat.numel() != v.numel or flat.dim() != 1:
            raise DivtraceError(f"{where}: tensor {v.blob} has dtype/size {flat.dtype}/{flat.numel()}, "
                                f"the record says {v.dtype}/{v.numel}")
        t = flat.reshape(v.shape)
        if self._hash(t) != v.hash:
            raise DivtraceError(f"{where}: tensor {v.blob} is corrupt (bytes do not match the recorded "
                                "fingerprint)")
        return t

    def _open_shard(self, name, vid):
        if name not in self._shards:
            from safetensors import safe_open

            p = self.path / str(name)
            if not isinstance(name, str) or _SHARD_NAME.match(name) is None or not p.is_file():
                raise DivtraceError(f"{self.path}: value {vid} points to missing shard {name!r}")
            try:
                self._shards[name] = safe_open(str(p), framework="pt")
            except Exception as e:
                raise DivtraceError(f"{p}: truncated or corrupt safetensors shard ({type(e).__name__})") from None
        return self._shards[name]

    # integrity --------------------------------------------------------------------------------------------
    def shard_problems(self) -> list[str]:
        """Every problem with the stored bytes: a shard missing, not matching its sha256, or lacking a tensor
        a record points to. Shards with no recorded sha256 (checksums.jsonl lost) are checked tensor by tensor
        against the fingerprints instead. Streams each file once; no tensor is deserialized when sums exist."""
        by_shard: dict[str, list[int]] = {}
        for vid, v in self.values.items():
            if v.shard is not None:
                by_shard.setdefault(v.shard, []).append(vid)
        problems = []
        for name in sorted(by_shard):
            p = self.path / name
            if not p.is_file():
                problems.append(f"{p}: shard missing ({len(by_shard[name])} tensor values point to it)")
                continue
            want = self._shard_sums.get(name)
            if want is None:
                problems += self._check_tensors(by_shard[name])
                continue
            try:
                got = sha256_file(p)
            except OSError as e:
                problems.append(f"{p}: cannot read: {e.strerror or e}")
                continue
            if got != want:
                problems.append(f"{p}: contents do not match the recorded sha256 (truncated, edited or corrupted)")
                continue
            try:
                keys = set(self._open_shard(name, by_shard[name][0]).keys())
            except DivtraceError as e:
                problems.append(str(e))
                continue
            missing = sorted({self.values[vid].blob for vid in by_shard[name]} - keys)
            if missing:
                problems.append(f"{p}: has no tensor {missing[0]}, which a record points to")
        return problems

    def _check_tensors(self, vids: list[int]) -> list[str]:
        problems, seen = [], set()
        for vid in vids:
            if self.values[vid].blob in seen:
                continue
            seen.add(self.values[vid].blob)
            try:
                self.tensor(vid)
            except DivtraceError as e:
                problems.append(str(e))
        return problems

    def verify_shards(self) -> None:
        """Raise DivtraceError (naming the file) unless every stored byte is what the recording wrote. Bisect
        calls it before it reports "identical", which it otherwise decides from fingerprints alone."""
        if self._shards_verified:
            return
        problems = self.shard_problems()
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise DivtraceError(problems[0] + more)
        self._shards_verified = True


def open_trace(path) -> Trace:
    return Trace(path)
