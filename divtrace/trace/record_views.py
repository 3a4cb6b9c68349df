"""Trace.records and Trace.values, the objects of a trace's records and values. The reference reader builds
them all while reading; after the fast readers (divtrace/trace/index.py), each is built from the verified bytes
of records.jsonl the first time it is asked for, through the views `_Records` and `_Values`."""
from __future__ import annotations

import json
import re
from array import array
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from itertools import chain
from math import prod

from divtrace.trace.records import ModuleEnter, ModuleExit, OpRecord, TensorValue, contiguous_stride, stats_from_compact
from divtrace.trace.fields import _DTYPE_INFO
from divtrace.trace.index import gc_paused


class RecordViews:
    """Trace.records and Trace.values (a mixin: the state is Trace's)."""

    @property
    def records(self):
        """Every record, in execution order: a list-like sequence (ModuleEnter, ModuleExit, OpRecord)."""
        return self._records_list if self._records_list is not None else _Records(self)

    @property
    def values(self):
        """vid -> TensorValue, a read-only mapping."""
        return self._values_dict if self._values_dict is not None else _Values(self)

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


class _Records(Sequence):
    """Trace.records of the fast reader: each record is built from the verified bytes when first asked for."""

    __slots__ = ("_t", "_cache")

    def __init__(self, t):  # the Trace (the reader imports this module, not the other way round)
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

    def __init__(self, t):  # the Trace (the reader imports this module, not the other way round)
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
