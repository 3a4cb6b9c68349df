"""Building a trace's compact index (Trace.vkey, rcall, rop, ...: see divtrace/trace/reader.py) from
records.jsonl. Three readers, one result:

- the C reader (divtrace/_index.c, `NATIVE`) reads lines in the writer's exact form without json;
- the fast Python reader (`_index_fast`) parses chunks of lines with json and checks every field;
- the reference reader (divtrace/trace/reference.py) checks and builds record by record and names the first
  bad line in its error.

`_read_records` tries them in this order; each one gives up on what it does not vouch for and the next starts
again, so every error message comes from the reference. tests/test_bisect_scale.py checks all three against
each other on mutated traces."""
from __future__ import annotations

import gc
import json
from contextlib import contextmanager
from itertools import chain
from operator import itemgetter

from divtrace.trace.records import ModuleCall
from divtrace.trace.fields import _DTYPE_INFO, _SHARD_NAME, _dtype_info

try:  # the C reader of records.jsonl (optional: built where a C compiler is; see _read_fast)
    from divtrace._index import index_records as _native_index_records
except ImportError:
    _native_index_records = None


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


class IndexBuilding:
    """Reading records.jsonl into Trace's compact index (a mixin: the state is Trace's)."""

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
