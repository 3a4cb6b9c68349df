"""The reference reader of records.jsonl: every record checked and built as objects, one by one, and the first
bad line named in the error. The fast readers (divtrace/trace/index.py) accept only what it accepts and hand
anything else to it."""
from __future__ import annotations

import json

from divtrace.errors import DivtraceError
from divtrace.trace.records import ModuleCall, ModuleEnter, ModuleExit, OpRecord, TensorValue, contiguous_stride, \
    stats_from_compact
from divtrace.trace.fields import _HEX32, _SHARD_NAME, _dtype_full, _str_or_none
from divtrace.trace.files import RECORDS


class ReferenceReader:
    """The reference reader of Trace (a mixin: the state is Trace's)."""

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
    # Records are in the compact form of divtrace.trace.records.record_compact. Every field is type-checked with
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
