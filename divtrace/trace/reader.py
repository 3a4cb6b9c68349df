"""Reading a trace back: metadata and records eagerly and validated, tensor bytes lazily and checked.

Nothing here trusts the files: a trace may be truncated, hand-edited, corrupted or written by another
version. Every problem is a DivtraceError naming the file (and line). records.jsonl is verified against its
sha256 before it is parsed (from meta.json when the recording closed, else from checksums.jsonl, which also
covers what a killed run left). Tensor bytes are checked against their fingerprint on every load, and
`verify_shards()` checks every stored tensor (what bisect needs before "identical"). Traces written before
shards lost their sha256 (see trace/writer.write_shard) still have their shards checked against it.
"""
from __future__ import annotations

import gc
import hashlib
import json
import re
from array import array
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from itertools import chain
from math import prod
from operator import itemgetter
from pathlib import Path

from divtrace.errors import DivtraceError
from divtrace.records import (FORMAT_VERSION, ModuleCall, ModuleEnter, ModuleExit, OpRecord, TensorValue,
                              contiguous_stride, stats_from_compact)
from divtrace.trace.files import CHECKSUMS, META, RECORDS, sha256_file

try:  # the C reader of records.jsonl (optional: built where a C compiler is; see _read_fast)
    from divtrace._index import index_records as _native_index_records
except ImportError:
    _native_index_records = None

# torch is imported only where tensors are really needed (loading bytes, dtype objects): reading a hash trace
# and bisecting it needs none, and importing torch costs seconds and ~220 MB.

# dtype names (as on disk, without "torch.") -> itemsize. These exist in every torch divtrace supports.
_CORE_DTYPES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
                "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}
# These are accepted only when the running torch has them (checked once per name, which imports torch).
_OPTIONAL_DTYPES = {"complex32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
                    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1, "uint16": 2, "uint32": 4,
                    "uint64": 8}
# short name -> ("torch.<name>", itemsize), or None once a name is known not to be a dtype of this torch.
_DTYPE_INFO: dict = {k: ("torch." + k, n) for k, n in _CORE_DTYPES.items()}

# Fingerprint schemes divtrace.fingerprint accepts, known here without importing it (it imports torch);
# tests/test_bisect_scale.py checks this against fingerprint.hasher. Any other name is asked of
# fingerprint.hasher itself, so a scheme added there is accepted too.
_SCHEMES_KNOWN_WITHOUT_TORCH = frozenset({"lane32-wsum128"})

_HEX32 = re.compile(r"[0-9a-f]{32}\Z")
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_SHARD_NAME = re.compile(r"tensors-\d{5,}\.safetensors\Z")


@contextmanager
def gc_paused():
    """The cyclic GC off for the block, as it was after. Reading a trace and bisecting build and drop
    hundreds of thousands of small objects, which would trigger collection after collection (most of the load
    time once); none of them form cycles, so refcounting frees them all the same."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _dtype_info(short):
    """("torch.<short>", itemsize) when `short` names a dtype this torch has, else None."""
    try:
        return _DTYPE_INFO[short]
    except KeyError:
        pass
    except TypeError:  # unhashable: not a name
        return None
    if type(short) is not str or short not in _OPTIONAL_DTYPES:
        return None
    import torch

    info = ("torch." + short, _OPTIONAL_DTYPES[short]) if isinstance(getattr(torch, short, None), torch.dtype) else None
    _DTYPE_INFO[short] = info
    return info


def _dtype_full(name):
    """("torch.<x>", itemsize) for a field-form dtype name ("torch.float32"), else None."""
    if type(name) is not str or not name.startswith("torch."):
        return None
    return _dtype_info(name[6:])


def torch_dtype(name: str):
    """The torch.dtype for a field-form name ("torch.bfloat16"); imports torch."""
    if _dtype_full(name) is None:
        raise DivtraceError(f"unknown dtype {name!r} in trace")
    import torch

    return getattr(torch, name[6:])


def itemsize(name: str) -> int:
    """Bytes per element of a field-form dtype name, without importing torch."""
    info = _dtype_full(name)
    if info is None:
        raise DivtraceError(f"unknown dtype {name!r} in trace")
    return info[1]


def _hasher(scheme):
    """fingerprint.hasher(scheme); imports torch."""
    from divtrace.fingerprint import hasher

    return hasher(scheme)


def _scheme_known(scheme) -> bool:
    return scheme in _SCHEMES_KNOWN_WITHOUT_TORCH or _hasher(scheme) is not None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _str_or_none(x) -> bool:
    return x is None or isinstance(x, str)


# meta.json fields divtrace itself reads, and the type each must have (others are kept as they are).
_META_FIELDS = {
    "complete": lambda x: isinstance(x, bool), "status": lambda x: isinstance(x, str), "label": _str_or_none,
    "error": _str_or_none, "ops": lambda x: isinstance(x, bool), "settings": lambda x: isinstance(x, dict),
    "module_tree": lambda x: isinstance(x, list) and (not x or (set(map(type, x)) == {list} and set(map(len, x)) == {2}
                                                                and set(map(type, chain.from_iterable(x))) == {str})),
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
    """A trace directory opened for reading. Tensors are loaded only when asked for (`tensor(vid)`).

    `records` (a sequence of ModuleEnter/ModuleExit/OpRecord) and `values` (vid -> TensorValue) build their
    objects from the verified bytes the first time each is asked for; `calls` are built when reading. What
    bisect reads at scale is the compact index, filled for every record when the trace is opened:

    - `vkey[vid]`: (dtype, shape, hash), the shape a tuple; two values are bitwise equal iff their keys are
      equal;
    - `vprod[vid]`: for a value an op produced, that op's record index (`producer(vid)`), which is also the
      record that defines it; `vsrc[vid]`: for any other value, the record that defines it;
    - per record: `rcall` (its call_id); for op records `rop` (op name), `rin` (input vids) and `rout` (output
      vids), tuples, None for module enter/exit records (which of the two: `calls[rcall[i]].enter_index == i`);
    - `vblob[vid]`: (blob, shard) of each value with stored bytes (full mode);
    - `vderived`: values whose hash is derived from their producing view op's input (divtrace.views); in full
      mode their bytes are rebuilt from that op.

    Every field of every record is validated when the trace is opened, whichever reader builds this. The index
    is tuples of ints and strings, which the cyclic GC stops scanning (the C reader untracks them as it builds
    them; CPython untracks the Python readers' in its first collections), so no later collection in the
    process walks a million of them.
    """

    def __init__(self, path):
        self.path = Path(path)
        self._check_dir()
        self.meta = self._read_meta()
        self._full = self.meta["mode"] == "full"
        self.torn_tail = False  # bytes after the last whole, verified flush were dropped
        self.verified = True  # records.jsonl matched a recorded sha256
        self.read_fast = False  # the fast reader built the index (see _read_fast)
        self.read_native = False  # ... and it was the C one
        self.warnings: list[str] = []
        self._shard_sums: dict[str, str] = {}
        self._reset()
        self._read_records()
        self._shards: dict[str, object] = {}
        self._shards_verified = False

    def _reset(self) -> None:
        # The fast reader's records and values are built when asked for, into these caches, through views
        # (_Records, _Values) made on each access: a view refers to the trace, the trace not to its views, so
        # a trace nobody refers to is freed at once (the index is kept out of the cyclic GC, see _read_records).
        self._record_cache: dict[int, object] = {}
        self._value_cache: dict[int, TensorValue] = {}
        self._records_list: list | None = None  # the reference reader's records and values, built whole
        self._values_dict: dict | None = None
        self.calls: dict[int, ModuleCall] = {}
        self.vkey: dict[int, tuple] = {}
        self.vprod: dict[int, int] = {}
        self.vsrc: dict[int, int] = {}
        self.vblob: dict[int, tuple[str, str]] = {}
        self.vderived: set[int] = set()
        self._real_keys: dict[int, tuple] = {}
        self.rcall: list[int] = []
        self.rop: list = []
        self.rin: list = []
        self.rout: list = []
        self._open: set[int] = set()  # calls entered and not exited
        self._call_counts: dict[str, int] = {}
        self._body = b""  # the verified whole lines of records.jsonl, which records and values are built from
        self._chunks: list[tuple[int, int]] = []  # (first record, byte offset) of each chunk parsed (verified)
        self._line_starts = None  # offset of each line in _body (unverified: parsed line by line)

    @property
    def records(self):
        """Every record, in execution order: a list-like sequence (ModuleEnter, ModuleExit, OpRecord)."""
        return self._records_list if self._records_list is not None else _Records(self)

    @property
    def values(self):
        """vid -> TensorValue, a read-only mapping."""
        return self._values_dict if self._values_dict is not None else _Values(self)

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
        if not _scheme_known(meta["hash_scheme"]):
            from divtrace.fingerprint import HASH_SCHEME

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
        # Not gc.freeze() after the read either: that moves every object of the process out of the GC's reach
        # for good, so cyclic garbage made of any of them (a model the caller drops later) was never freed. The
        # index's tuples are untracked instead.
        with gc_paused():
            self._read_records_unpaused()

    def _read_records_unpaused(self) -> None:
        raw = self._verified_records()
        if not (self.FAST and self._read_fast(raw)):
            # Something the fast reader does not vouch for: start again with the reference reader, which
            # names the first bad line (or accepts what the fast reader was merely unsure of).
            self._reset()
            self.read_fast = False
            self._records_list, self._values_dict = [], {}
            self._defined_at: dict[int, int] = {}
            self._read_reference(raw)
            self._index_objects()
        want = self.meta.get("records")
        if "checksums" in self.meta and want is not None and want != len(self.records):
            raise DivtraceError(f"{self.path / META}: says {want} records, {RECORDS} holds {len(self.records)}")

    # Two readers, one result. `_read_reference` checks and builds record by record (`_add`, `_value`,
    # `_link`) and names the first bad line in its error. `_read_fast` makes the same checks on the whole file
    # (some batched at the end) and fills only the compact index; records and values are built from the
    # verified bytes when asked for. It only ever accepts what the reference accepts, and gives up (False) on
    # anything else, malformed or merely unusual, so every error comes from the reference.
    # tests/test_bisect_scale.py checks the two against each other on mutated traces. FAST = False reads with
    # the reference alone.
    #
    # Before both, the C reader divtrace._index (NATIVE) tries: it builds the same index from the bytes without
    # json (5-10x faster), accepts only lines in the writer's exact form, and gives up on anything else, after
    # which the Python fast reader starts again. tests/test_bisect_scale.py checks all three against each other.
    FAST = True
    NATIVE = True
    _CHUNK = 1 << 15  # bytes of records.jsonl parsed at once (about 150 lines): small enough to stay in cache

    def _read_fast(self, raw: bytes) -> bool:
        cut = raw.rfind(b"\n") + 1
        body = raw[:cut] if cut != len(raw) else raw
        ok = False
        if self.NATIVE and _native_index_records is not None:
            ok = self._index_native(body)
            self.read_native = ok
            if not ok:
                self._reset()
        try:
            ok = ok or self._index_fast(self._parsed_chunks(body))
        except Exception:  # not JSON, a missing key, an unhashable dtype...: the reference says which line
            return False
        if ok:
            self._body = body
            if cut != len(raw):
                self.torn_tail = True  # no newline at the end (only possible without checksums): being written
        self.read_fast = ok
        return ok

    def _index_native(self, body: bytes) -> bool:
        """The index built by the C reader; False (the index partly filled) when a line is not in the writer's
        exact form. Every line then is one record, so the chunks are those _parsed_chunks would have parsed."""
        looked_up = set()
        while True:
            try:
                ok = _native_index_records(body, self._full, _DTYPE_INFO, self.vkey, self.vsrc, self.vprod,
                                           self.vblob, self.vderived, self.calls, self._open, self._call_counts,
                                           self.rcall, self.rop, self.rin, self.rout, ModuleCall)
            except Exception:  # out of memory, or anything unforeseen: the Python readers decide
                return False
            if type(ok) is not str:
                break
            # A dtype this process has not looked up yet (float8, uint16...: asking imports torch): once known
            # to be one, read again from the start.
            if ok in looked_up or _dtype_info(ok) is None:
                return False
            looked_up.add(ok)
            self._reset()
        if ok and self.verified:
            self._chunks = [(first, start) for first, start, _, _ in self._chunk_spans(body)]
        return ok

    def _chunk_spans(self, body: bytes):
        """(first record, start, stop, lines) of each chunk of whole lines that verified bytes are parsed in."""
        size, first, start, end = self._CHUNK, 0, 0, len(body)
        while start < end:
            stop = body.find(b"\n", min(start + size, end - 1)) + 1
            lines = body.count(b"\n", start, stop)
            yield first, start, stop, lines
            first += lines
            start = stop

    def _parsed_chunks(self, body: bytes):
        """The lines of `body` parsed, in order, as lists of consecutive lines; raises ValueError unless every
        line is one JSON document. Verified bytes are parsed a chunk of lines at a time (one json.loads per
        chunk is several times faster than one per line), unverified ones line by line."""
        if not self.verified:
            yield [json.loads(line) for line in body.split(b"\n")[:-1]]
            return
        loads, chunks = json.loads, []
        for first, start, stop, lines in self._chunk_spans(body):
            chunks.append((first, start))
            parsed = loads(self._chunk_text(body, start, stop))
            if len(parsed) != lines:
                raise ValueError("not one JSON document per line")
            yield parsed
        self._chunks = chunks

    @staticmethod
    def _chunk_text(body: bytes, start: int, stop: int) -> bytes:
        """The lines body[start:stop] (each ending in a newline) as one JSON array."""
        return b"[" + body[start:stop - 1].replace(b"\n", b",") + b"]"

    def _index_fast(self, chunks) -> bool:
        """Validate every record as `_add` does and fill the compact index; False at anything `_add` might
        reject. The checks mirror `_value`, `_add` and `_link`, field by field (a record or value that is not
        a dict fails at its first lookup: a list has no .get, ["v"] of a list or string raises); the hashes,
        shapes and strides are checked in one pass at the end."""
        full = self._full
        vkey, vsrc, vprod, vblob, vderived = self.vkey, self.vsrc, self.vprod, self.vblob, self.vderived
        calls, open_, counts = self.calls, self._open, self._call_counts
        rcall, rop, rin, rout = (x.append for x in (self.rcall, self.rop, self.rin, self.rout))
        info_of = _DTYPE_INFO.get
        shard_ok = _SHARD_NAME.match
        module_call = ModuleCall
        op_names: dict[str, str] = {}  # one string per op name
        strides = []  # explicit strides, checked in one pass at the end (as hashes and shapes, from vkey)
        no_values = ()
        n = 0
        for d in chain.from_iterable(chunks):
            kind, index, call_id = d.get("k"), d["i"], d["c"]
            if type(index) is not int or type(call_id) is not int or index != n:
                return False
            n += 1
            raw_values = d.get("V", no_values)
            produced = 0
            if raw_values is not no_values:
                if type(raw_values) is not list:
                    return False
                for vd in raw_values:
                    vid, short, shape, h = vd["v"], vd["d"], vd["s"], vd["h"]
                    info = info_of(short) or _dtype_info(short)
                    if (info is None or type(vid) is not int or vid < 0 or type(shape) is not list
                            or type(h) is not str or len(h) != 32 or vid in vkey):
                        return False
                    # The usual hash-mode values hold v, d, s, h and m, plus p when an op produced them: the
                    # optional keys need not be looked up one by one then.
                    nk = len(vd)
                    if nk == 5 and "m" in vd:
                        stride = producer = device = blob = shard = derived = None
                        m = vd["m"]
                    elif nk == 6 and "p" in vd and "m" in vd:
                        stride = device = blob = shard = derived = None
                        producer, m = vd["p"], vd["m"]
                    else:
                        stride, producer, device, m = vd.get("t"), vd.get("p"), vd.get("dev", "cpu"), vd.get("m")
                        blob, shard, derived = vd.get("b"), vd.get("f"), vd.get("r")
                        if type(device) is not str:
                            return False
                        if derived is not None:
                            if derived != 1 or type(derived) is not int or producer is None or blob is not None \
                                    or shard is not None:
                                return False
                            vderived.add(vid)
                    if stride is not None:
                        if type(stride) is not list or len(stride) != len(shape):
                            return False
                        strides.append(stride)
                    if producer is None:
                        vsrc[vid] = index
                    elif type(producer) is not int or producer != index or kind != "o":
                        return False
                    else:
                        vprod[vid] = index
                        produced += 1
                    if m is not None:
                        if type(m) is not list or len(m) != 5:
                            return False
                    elif type(vd.get("M", {})) is not dict:
                        return False
                    if full and derived is None:
                        if type(blob) is not str or type(shard) is not str or shard_ok(shard) is None:
                            return False
                        vblob[vid] = (blob, shard)
                    elif blob is not None or shard is not None:
                        return False
                    vkey[vid] = (info[0], tuple(shape), h)
            rcall(call_id)
            if kind == "o":
                op, args, kwargs, inputs, outputs = d["op"], d["a"], d.get("kw", {}), d["in"], d["out"]
                if ("o" not in d or type(op) is not str or type(args) is not list or type(kwargs) is not dict
                        or type(inputs) is not list or type(outputs) is not list or call_id not in open_):
                    return False
                for vid in inputs:
                    if type(vid) is not int or vid not in vkey:
                        return False
                for vid in outputs:
                    # an op's outputs are values it produced (defined here, naming it as producer)
                    if type(vid) is not int or vprod.get(vid) != index:
                        return False
                # ... and every value it produced is among them: the outputs are exactly those values
                if produced != (len(outputs) if len(outputs) < 2 else len(set(outputs))):
                    return False
                calls[call_id].ops.append(index)
                rop(op_names.setdefault(op, op))
                rin(tuple(inputs))
                rout(tuple(outputs))
                continue
            if kind == "e":
                module, call, parent, items = d["m"], d["n"], d.get("p"), d["in"]
                if (type(module) is not str or type(call) is not int or call < 0 or type(items) is not list
                        or call_id in calls or call != counts.get(module, 0)
                        or (parent is not None and (type(parent) is not int or parent not in open_))):
                    return False
            elif kind == "x":
                err, items = d.get("err"), d["out"]
                if (err is not None and type(err) is not str) or type(items) is not list or call_id not in open_:
                    return False
            else:
                return False
            pairs = []
            for p in items:
                if type(p) is not list or len(p) != 2:
                    return False
                key, vid = p
                if type(key) is not str or type(vid) is not int or vid not in vkey:
                    return False
                pairs.append((key, vid))
            if kind == "e":
                counts[module] = call + 1
                calls[call_id] = module_call(call_id, module, call, parent, index, pairs)
                open_.add(call_id)
                if parent is not None:
                    calls[parent].children.append(call_id)
            else:
                c = calls[call_id]
                c.exit_index, c.outputs = index, pairs
                open_.discard(call_id)
            rop(None)
            rin(None)
            rout(None)
        # The batched checks: every hash is 32 lowercase hex digits (the lengths were checked above), every
        # shape entry a non-negative int, every stride entry an int.
        if "".join(map(itemgetter(2), vkey.values())).encode("ascii").translate(None, b"0123456789abcdef"):
            return False  # (a non-ASCII hash raises UnicodeEncodeError: also not accepted)
        dims = list(chain.from_iterable(map(itemgetter(1), vkey.values())))
        if dims and (set(map(type, dims)) != {int} or min(dims) < 0):
            return False
        return set(map(type, chain.from_iterable(strides))) <= {int}

    def _index_objects(self) -> None:
        """The compact index of records and values the reference reader built."""
        for rec in self.records:
            op = rec.kind == "op"
            self.rcall.append(rec.call_id)
            self.rop.append(rec.op if op else None)
            self.rin.append(tuple(rec.inputs) if op else None)
            self.rout.append(tuple(rec.outputs) if op else None)
        for vid, v in self.values.items():
            self.vkey[vid] = (v.dtype, tuple(v.shape), v.hash)
            if v.producer is not None:
                self.vprod[vid] = v.producer
            else:
                self.vsrc[vid] = self._defined_at[vid]
            if v.blob is not None:
                self.vblob[vid] = (v.blob, v.shard)
            if v.derived:
                self.vderived.add(vid)

    # building records and values from the verified bytes (fast reader) --------------------------------------
    def _parsed_around(self, index: int) -> tuple[int, list]:
        """(first record, parsed records) of the piece of records.jsonl holding record `index`, parsed exactly
        as it was when validated: the same chunk of lines (verified), or the line itself (unverified). (A
        record is not always its line alone: two half-lines of a hand edit can make one record in a chunk.)"""
        body = self._body
        if not self.verified:
            starts = self._line_starts
            if starts is None:
                starts = self._line_starts = array("q", [0])
                starts.extend(m.end() for m in re.finditer(b"\n", body))
            return index, [json.loads(body[starts[index]:starts[index + 1] - 1])]
        k = bisect_right(self._chunks, (index, len(body))) - 1
        first, start = self._chunks[k]
        stop = self._chunks[k + 1][1] if k + 1 < len(self._chunks) else len(body)
        return first, json.loads(self._chunk_text(body, start, stop))

    def _build_all(self) -> None:
        """Every record and value as objects (iterating over all of them): one parse of the whole file."""
        with gc_paused():
            built = self._record_cache
            for index, d in enumerate(chain.from_iterable(self._parsed_chunks(self._body))):
                if index not in built:
                    self._build(index, d)

    def _build(self, index: int, d: dict | None = None):
        """Record `index` and the values it defines, as objects (cached); without `d`, every record parsed
        with it too."""
        if d is None:
            first, parsed = self._parsed_around(index)
            built = self._record_cache
            for i, d in enumerate(parsed, first):
                if i not in built:
                    self._build(i, d)
            return built[index]
        cache = self._value_cache
        for vd in d.get("V", ()):
            info = _DTYPE_INFO[vd["d"]]
            shape, stride = vd["s"], vd.get("t")
            if stride is None:
                stride = contiguous_stride(shape)
            stats = stats_from_compact(vd)
            vid = vd["v"]
            if vid not in cache:
                cache[vid] = TensorValue(vid, info[0], shape, stride, vd["h"], vd.get("dev", "cpu"), stats,
                                         vd.get("p"), vd.get("b"), vd.get("f"), prod(shape) * info[1],
                                         vd.get("r") is not None)
        k, call_id = d["k"], d["c"]
        if k == "o":
            rec = OpRecord(index, call_id, d["op"], d["a"], d.get("kw", {}), d["in"], d["out"], d["o"])
        elif k == "e":
            rec = ModuleEnter(index, call_id, d["m"], d["n"], d.get("p"), [(a, b) for a, b in d["in"]])
        else:
            rec = ModuleExit(index, call_id, [(a, b) for a, b in d["out"]], d.get("err"))
        self._record_cache[index] = rec
        return rec

    def producer(self, vid: int) -> int | None:
        """Index of the op record that produced value `vid`; None when it came from outside."""
        if vid not in self.vkey:
            raise KeyError(vid)
        return self.vprod.get(vid)

    def _read_reference(self, raw: bytes) -> None:
        where = self.path / RECORDS
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

    # validation -----------------------------------------------------------------------------------------
    # Records are in the compact form of divtrace.records.record_compact. Every field is type-checked with
    # plain `type(x) is ...` tests (this loop runs once per record, so it is kept lean); anything else a hand
    # edit can produce (a missing key, a wrong container) raises here and becomes one "malformed record" line.
    def _value(self, d, producer_ok, loc: str) -> TensorValue:
        vid, short, shape, h = d["v"], d["d"], d["s"], d["h"]
        full_name = "torch." + short if type(short) is str else None
        dtype = _dtype_full(full_name)
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
        stats = stats_from_compact(d)
        blob, shard, derived = d.get("b"), d.get("f"), d.get("r")
        if type(device) is not str or type(stats) is not dict:
            raise DivtraceError(f"{loc}: malformed tensor value {vid}"[:300])
        if derived is not None:
            if derived != 1 or type(derived) is not int or producer is None or blob is not None or shard is not None:
                raise DivtraceError(f"{loc}: tensor value {vid}: malformed derived-view mark (r)"[:300])
        elif self._full:
            if type(blob) is not str or type(shard) is not str or _SHARD_NAME.match(shard) is None:
                raise DivtraceError(f"{loc}: tensor value {vid} has no valid stored bytes in a full-mode trace")
        elif blob is not None or shard is not None:
            raise DivtraceError(f"{loc}: tensor value {vid} points to stored bytes in a hash-mode trace")
        return TensorValue(vid, full_name, shape, stride, h, device, stats, producer, blob, shard, n * dtype[1],
                           derived is not None)

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
        for vid in new:
            self._defined_at[vid] = index

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
        """Whether the trace can give `vid`'s bytes: stored, or (full mode) rebuilt from a view op."""
        if vid not in self.vkey:
            raise KeyError(vid)
        return vid in self.vblob or (self._full and vid in self.vderived)

    def real_key(self, vid: int) -> tuple:
        """`vkey[vid]`, with the real fingerprint of the bytes where the recorded one is derived from a view op
        (full mode; the bytes are rebuilt once and the key kept)."""
        if vid not in self.vderived or not self._full:
            return self.vkey[vid]
        key = self._real_keys.get(vid)
        if key is None:
            dtype, shape, _ = self.vkey[vid]
            key = self._real_keys[vid] = (dtype, shape, self._hash(self.tensor(vid)))
        return key

    def roots(self) -> list[ModuleCall]:
        return [c for c in self.calls.values() if c.parent is None]

    def _hash(self, t) -> str:
        """The fingerprint function of this trace's hash_scheme (imports torch on first use)."""
        h = self.__dict__.get("_hash_fn")
        if h is None:
            h = self._hash_fn = _hasher(self.meta["hash_scheme"])
        return h(t)

    def tensor(self, vid: int):
        """The recorded value (a torch.Tensor), loaded lazily and checked bit-exactly against its fingerprint."""
        import torch

        v = self.values[vid]
        if v.derived and self._full:
            return self._rebuilt(vid, v)
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

    def derived_problem(self, vid: int) -> str | None:
        """Why the derived-view value `vid` cannot be rebuilt from its producing op, or None: the op must be a
        view divtrace derives, with one input, and the recorded fingerprint must be the one derived from them."""
        from divtrace.views import DERIVABLE_VIEWS, rebuildable, view_fingerprint

        v = self.values[vid]
        rec = self.records[v.producer]
        where = f"{self.path}: value {vid} (derived from record {v.producer}, {rec.op})"
        if rec.op not in DERIVABLE_VIEWS or not rebuildable(rec.args, rec.kwargs) or len(set(rec.inputs)) != 1:
            return f"{where}: not a view divtrace rebuilds"
        src = self.values[rec.inputs[0]]
        if view_fingerprint(rec.op, src.hash, src.dtype, src.shape, v.shape, rec.args, rec.kwargs) != v.hash:
            return f"{where}: corrupt (its fingerprint is not the one derived from the op and its input)"
        return None

    def _rebuilt(self, vid: int, v: TensorValue):
        """A view value of a full-mode trace, rebuilt by applying its recorded view op to the input's bytes (and
        a view of a view from the first stored value up, in a loop: chains can be long)."""
        from divtrace.views import rebuild_view

        chain = [vid]
        while self.values[chain[-1]].derived:
            problem = self.derived_problem(chain[-1])
            if problem:
                raise DivtraceError(problem)
            chain.append(self.records[self.values[chain[-1]].producer].inputs[0])
            if len(chain) > len(self.vderived) + 1:
                raise DivtraceError(f"{self.path}: value {vid}: its views form a cycle (edited by hand?)")
        t = self.tensor(chain.pop())
        for link in reversed(chain):
            lv = self.values[link]
            rec = self.records[lv.producer]
            try:
                t = rebuild_view(rec.op, rec.args, rec.kwargs, t)
            except (RuntimeError, ValueError, IndexError, TypeError) as e:
                raise DivtraceError(f"{self.path}: value {link}: cannot rebuild it with {rec.op} "
                                    f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
            if torch_dtype(lv.dtype) != t.dtype or list(t.shape) != lv.shape:
                raise DivtraceError(f"{self.path}: value {link}: {rec.op} rebuilt dtype/shape {t.dtype}/"
                                    f"{list(t.shape)}, the record says {lv.dtype}/{lv.shape}")
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
    def shard_has_sha256(self, name: str) -> bool:
        """Whether the shard carries a sha256 (traces written before shards lost it)."""
        return name in self._shard_sums

    def shard_problems(self) -> list[str]:
        """Every problem with the stored bytes: a shard missing, or a tensor a record points to missing or not
        matching its fingerprint. Shards of older traces that carry a sha256 are checked against it instead
        (a stream of each file; no tensor deserialized)."""
        by_shard: dict[str, list[int]] = {}
        for vid, (_, shard) in self.vblob.items():
            by_shard.setdefault(shard, []).append(vid)
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
            missing = sorted({self.vblob[vid][0] for vid in by_shard[name]} - keys)
            if missing:
                problems.append(f"{p}: has no tensor {missing[0]}, which a record points to")
        return problems

    def _check_tensors(self, vids: list[int]) -> list[str]:
        problems, seen = [], set()
        for vid in vids:
            if self.vblob[vid][0] in seen:
                continue
            seen.add(self.vblob[vid][0])
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


class _Records(Sequence):
    """Trace.records of the fast reader: each record is built from the verified bytes when first asked for."""

    __slots__ = ("_t", "_cache")

    def __init__(self, t: Trace):
        self._t, self._cache = t, t._record_cache

    def __len__(self) -> int:
        return len(self._t.rcall)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self._t.rcall)
        j = i + n if i < 0 else i  # a non-int raises TypeError here, as a list would
        if not 0 <= j < n:
            raise IndexError("record index out of range")
        rec = self._cache.get(j)
        return rec if rec is not None else self._t._build(j)

    def __iter__(self):
        if len(self._cache) < len(self._t.rcall):
            self._t._build_all()
        return iter(self[i] for i in range(len(self._t.rcall)))

    def __eq__(self, other):
        if not isinstance(other, (Sequence, _Records)) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(x == y for x, y in zip(self, other))

    __hash__ = None

    def __repr__(self) -> str:
        return f"<{len(self)} records of {self._t.path}>"


class _Values(Mapping):
    """Trace.values of the fast reader: each TensorValue is built from the verified bytes when first asked for."""

    __slots__ = ("_t", "_cache")

    def __init__(self, t: Trace):
        self._t, self._cache = t, t._value_cache

    def __getitem__(self, vid) -> TensorValue:
        v = self._cache.get(vid)
        if v is None:
            t = self._t
            index = t.vprod.get(vid)
            t._build(t.vsrc[vid] if index is None else index)  # KeyError for a value not defined, as a dict
            v = self._cache[vid]
        return v

    def __contains__(self, vid) -> bool:
        return vid in self._t.vkey

    def __iter__(self):
        return iter(self._t.vkey)

    def __len__(self) -> int:
        return len(self._t.vkey)

    def items(self):
        if len(self._cache) < len(self._t.vkey):
            self._t._build_all()
        return super().items()

    def values(self):
        if len(self._cache) < len(self._t.vkey):
            self._t._build_all()
        return super().values()

    def __repr__(self) -> str:
        return f"<{len(self)} tensor values of {self._t.path}>"
