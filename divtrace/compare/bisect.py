"""first_divergence: where two traces part, localized to the module call and op where it *originates*.

The walk goes down the call tree. At each aligned pair of calls (inputs equal, something differs) the
children are visited in execution order: a child whose inputs already differ means the parent's own code
between its children made the difference; a child that differs with equal inputs is entered. When no child
explains it, the parent's own code is the origin. Inside that code the two sides may run different op
sequences (eager bmm+softmax vs one fused SDPA op), so ops are aligned by value: from the first differing
tensor each side walks back through its producers until it reaches values the other side also has. What is
left is each side's region; its first op that computes (not a view or copy) is where the sequences part.
"""
from __future__ import annotations

import functools
import re
import shlex
from collections import Counter, namedtuple
from dataclasses import dataclass, field
from itertools import chain
from math import prod

from divtrace.compare.align import Pairing, PathMap, ValueComparator
from divtrace.compare.diffs import TensorDiff, Tolerance
from divtrace.compare.verdict import (EXIT_CODES, INCONCLUSIVE, Coverage, TraceSeen, decide, progress,
                                     unseen_of)
from divtrace.errors import DivtraceError
from divtrace.records import ModuleCall, OpRecord
from divtrace.trace.reader import Trace, gc_paused, itemsize

# Ops that only move, alias or select values: never where two computations part, though they can sit in a region.
VALUE_PRESERVING = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "t", "permute", "expand", "unsqueeze",
    "squeeze", "select", "slice", "as_strided", "alias", "detach", "clone", "contiguous", "unfold", "split",
    "split_with_sizes", "chunk", "unbind", "narrow", "flatten", "lift_fresh", "lift_fresh_copy", "repeat", "cat",
    "stack", "index_select", "gather", "embedding", "_to_copy", "copy_", "copy", "expand_as", "view_as",
    "movedim", "diagonal", "fill_", "zeros_like", "empty_like", "new_empty", "new_zeros",
}


_FInfo = namedtuple("_FInfo", "bits eps max tiny")  # the torch.finfo fields cast_rounds reads

# torch.finfo of the floating dtypes, written out so that telling casts apart needs no torch (a hash-trace
# bisect never imports it); tests/test_bisect_scale.py checks every entry against torch.finfo.
_FINFO = {
    "torch.float64": _FInfo(64, 2.220446049250313e-16, 1.7976931348623157e+308, 2.2250738585072014e-308),
    "torch.float32": _FInfo(32, 1.1920928955078125e-07, 3.4028234663852886e+38, 1.1754943508222875e-38),
    "torch.float16": _FInfo(16, 0.0009765625, 65504.0, 6.103515625e-05),
    "torch.bfloat16": _FInfo(16, 0.0078125, 3.3895313892515355e+38, 1.1754943508222875e-38),
    "torch.float8_e4m3fn": _FInfo(8, 0.125, 448.0, 0.015625),
    "torch.float8_e5m2": _FInfo(8, 0.25, 57344.0, 6.103515625e-05),
    "torch.float8_e4m3fnuz": _FInfo(8, 0.125, 240.0, 0.0078125),
    "torch.float8_e5m2fnuz": _FInfo(8, 0.125, 57344.0, 3.0517578125e-05),
    "torch.float8_e8m0fnu": _FInfo(8, 1.0, 1.7014118346046923e+38, 5.877471754111438e-39),
}
# Floating dtypes torch.finfo does not describe (packed fp4): any cast to or from them may round.
_FLOAT_WITHOUT_FINFO = {"torch.float4_e2m1fn_x2"}


def _finfo(name: str):
    itemsize(name)  # DivtraceError for a name that is not a dtype of this torch
    return _FINFO.get(name)


def cast_rounds(dtype_in: str, dtype_out: str) -> bool:
    """Whether a cast can change values: to a float with less precision or range, float to int, or int to a
    16-bit-or-narrower float (positions in bf16 round above 256). Widening casts are exact."""
    if dtype_in == dtype_out:
        return False
    fi, fo = _finfo(dtype_in), _finfo(dtype_out)
    if dtype_in in _FLOAT_WITHOUT_FINFO or dtype_out in _FLOAT_WITHOUT_FINFO:
        return True  # no precision to compare: say it may round (a computing op), never that it cannot
    if fo is None:
        return fi is not None or dtype_out != "torch.bool"
    if fi is None:
        return dtype_in != "torch.bool" and fo.bits <= 16
    return fo.eps > fi.eps or fo.max < fi.max or fo.tiny > fi.tiny


def is_computing(rec: OpRecord, trace: Trace) -> bool:
    """False for ops that only rearrange values, and for casts that cannot round."""
    return _computing(rec.op, rec.inputs, rec.outputs, trace)


def _computing(op: str, inputs: list, outputs: list, trace: Trace) -> bool:
    parts = op.split(".")
    name = parts[1] if len(parts) >= 2 else op
    if name not in VALUE_PRESERVING:
        return True
    if name in ("_to_copy", "copy_", "copy"):
        key = trace.vkey  # (dtype, shape, hash) per vid
        dts_in = [key[v][0] for v in inputs]
        dts_out = [key[v][0] for v in outputs]
        src = dts_in[-1] if name == "copy_" and len(dts_in) > 1 else (dts_in[0] if dts_in else None)
        return src is not None and any(cast_rounds(src, d) for d in dts_out)
    return False


def _writes(op: str) -> bool:
    """Whether an aten op writes into an argument: an in-place form (`add_`, `copy_`) or an `out=` overload."""
    parts = op.split(".")
    return len(parts) >= 2 and (parts[1].endswith("_") or (len(parts) >= 3 and parts[2].startswith("out")))


def _settings_diff(a: dict, b: dict) -> list[dict]:
    """divtrace.settings.settings_diff, which cannot be imported without torch: the settings whose values
    differ, as [{"name", "a", "b"}] (tests/test_bisect_scale.py checks the two agree)."""
    return [{"name": k, "a": a.get(k), "b": b.get(k)} for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def constant_derived(trace: Trace, index: int, memo: dict, scope: set | None = None) -> bool:
    """True for ops computed from constants alone (a causal mask from `full`+`triu`, an `arange`): they carry
    no data from the inputs, so they are never where two computations of the data part. With `scope` (the op
    indices of one call's own code) a value from outside it counts as data, which keeps the walk inside the
    call; without, it is iterative anyway: a chain of producers can be as long as the run."""
    stack = [index]
    rin, vprod = trace.rin, trace.vprod  # op inputs per record; vid -> producer (produced values only)
    while stack:
        i = stack[-1]
        if i in memo:
            stack.pop()
            continue
        result, pending = True, []
        for vid in rin[i]:
            p = vprod.get(vid)
            if p is None or memo.get(p) is False or (scope is not None and p not in scope):
                result = False
                break
            if p not in memo:
                pending.append(p)
        if result and pending:
            stack.extend(pending)  # producers have lower indices: no cycles
        else:
            memo[i] = result
            stack.pop()
    return memo[index]


@dataclass
class Divergence:
    """One place where the traces differ."""

    index: int  # record index in A: the parting op, or the call's exit record
    module: str
    call: int
    op: str | None  # side A's parting op
    op_b: str | None  # side B's parting op
    kind: str  # "op" | "module"
    cause: str  # "origin" | "propagated"
    tensor: str  # which tensor differs: "out", "input args.0 of model.layers.0.mlp", ...
    dtype: str
    shape: list[int]
    numel: int
    diff: TensorDiff | None = None
    module_b: str | None = None
    index_b: int | None = None
    region_a: list[tuple[int, str]] = field(default_factory=list)
    region_b: list[tuple[int, str]] = field(default_factory=list)
    vid_a: int | None = None  # the differing tensor's value ids (what repro starts from)
    vid_b: int | None = None
    # An input of the region that no recorded op made (a parameter, a buffer, bytes written by a kernel torch
    # does not see) and that the other side does not hold: the output differs although the call's inputs agree.
    outside_input: str | None = None

    def to_dict(self) -> dict:
        d = {"index": self.index, "module": self.module, "call": self.call, "op": self.op, "op_b": self.op_b,
             "kind": self.kind, "cause": self.cause, "tensor": self.tensor, "dtype": self.dtype,
             "shape": self.shape, "numel": self.numel, "module_b": self.module_b, "index_b": self.index_b,
             "region_a": [{"index": i, "op": o} for i, o in self.region_a],
             "region_b": [{"index": i, "op": o} for i, o in self.region_b], "outside_input": self.outside_input}
        m = self.diff.to_dict() if self.diff is not None else {}
        for k in ("reason", "max_abs", "max_ulp", "max_ulp_raw", "sign_flips", "max_rel", "mismatched", "nan_mismatch",
                  "first_index", "first_a", "first_b", "first_a_bits", "first_b_bits"):
            d[k] = m.get(k)
        d["metrics_available"] = self.diff is not None
        return d


@dataclass
class BisectResult:
    verdict: str  # "identical" | "diverged" | "within_tolerance" | "inconclusive" (divtrace.compare.verdict)
    compared: int
    first: Divergence | None
    next: list[Divergence]
    settings: list[dict]
    final: dict | None
    labels: tuple[str, str]
    paths: tuple[str, str]
    metrics_available: bool
    complete: tuple[bool, bool]
    unmatched: dict
    warnings: list[str] = field(default_factory=list)
    hint: str | None = None
    bitwise_differs: int = 0
    tolerance: dict | None = None
    compiled: dict | None = None  # traces recorded inside compiled code: divtrace.compiled.report
    reason: str = ""  # why this verdict (and, when inconclusive, what to do next)
    coverage: Coverage | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "alignment": "calls", "reason": self.reason,
                "coverage": self.coverage.to_dict() if self.coverage else None, "compared": self.compared,
                "first": self.first.to_dict() if self.first else None,
                "next": [d.to_dict() for d in self.next], "final": self.final, "settings_diff": self.settings,
                "labels": {"a": self.labels[0], "b": self.labels[1]}, "traces": {"a": self.paths[0], "b": self.paths[1]},
                "metrics_available": self.metrics_available,
                "complete": {"a": self.complete[0], "b": self.complete[1]}, "unmatched_calls": self.unmatched,
                "bitwise_differs": self.bitwise_differs, "tolerance": self.tolerance,
                "warnings": self.warnings, "hint": self.hint, "compiled": self.compiled}


_UNSET = object()


class _Walker:
    def __init__(self, a: Trace, b: Trace, pairing: Pairing, cmp: ValueComparator):
        self.a, self.b, self.pairing, self.cmp = a, b, pairing, cmp
        self._differs: dict[int, bool] = {}
        self._op_mismatch: dict[tuple[int, int], tuple | None] = {}
        self._in_mismatch: dict[tuple[int, int], tuple | None] = {}
        self._out_mismatch: dict[tuple[int, int], tuple | None] = {}

    # -- tree -----------------------------------------------------------------------------------------------
    def child_pairs(self, ca: ModuleCall, cb: ModuleCall):
        for cid in ca.children:
            child_a = self.a.calls[cid]
            child_b = self.pairing.partner(child_a)
            if child_b is not None and child_b.parent == cb.call_id:
                yield child_a, child_b

    def _same_ops(self, ca: ModuleCall, cb: ModuleCall) -> bool:
        return len(ca.ops) == len(cb.ops) and \
            list(map(self.a.rop.__getitem__, ca.ops)) == list(map(self.b.rop.__getitem__, cb.ops))

    def first_op_mismatch(self, ca, cb):
        """(index in a, index in b, vid in a, vid in b) of the first differing output of the two calls' own
        ops (when they ran the same sequence, ops whose output counts differ left out), or None."""
        key = (ca.call_id, cb.call_id)
        hit = self._op_mismatch.get(key, _UNSET)
        if hit is _UNSET:
            hit = None
            if self._same_ops(ca, cb):
                outs_a = list(map(self.a.rout.__getitem__, ca.ops))
                outs_b = list(map(self.b.rout.__getitem__, cb.ops))
                if list(map(len, outs_a)) == list(map(len, outs_b)):  # the usual case: one flat pass
                    flat = chain.from_iterable(map(zip, outs_a, outs_b))
                else:
                    flat = chain.from_iterable(zip(x, y) for x, y in zip(outs_a, outs_b) if len(x) == len(y))
                flat = list(flat)
                if self._reordered(flat, ca, cb):
                    return self._op_mismatch.setdefault(key, None)
                m = self.cmp.first_unequal(flat)
                if m is not None:  # the first op pair with that output pair is where it was found
                    ia, ib = next((ia, ib) for ia, ib, x, y in zip(ca.ops, cb.ops, outs_a, outs_b)
                                  if len(x) == len(y) and m in zip(x, y))
                    hit = (ia, ib) + m
            self._op_mismatch[key] = hit
        return hit

    def _reordered(self, flat: list, ca: ModuleCall, cb: ModuleCall) -> bool:
        """Whether position-paired op outputs differ only in order: the same values made by the same op names,
        independent computations run the other way round (RoPE on k before q). Paired by position, a's f(q)
        met b's f(k) and bisect reported an origin between runs whose every tensor was equal. Then the op
        sequences give no pairing, and the values at the call's boundary decide. Not where an op writes in
        place: there the order of the values says which buffer each went into (k and v copied into each
        other's cache are the same values in another order, and a real difference)."""
        ka, kb = self.a.vkey, self.b.vkey
        if len(flat) < 2 or all(ka[va] == kb[vb] for va, vb in flat):
            return False
        if any(_writes(self.a.rop[i]) for i in ca.ops) or any(_writes(self.b.rop[i]) for i in cb.ops):
            return False
        return Counter(ka[va] for va, _ in flat) == Counter(kb[vb] for _, vb in flat)

    def in_mismatch(self, ca: ModuleCall, cb: ModuleCall):
        """cmp.first_mismatch of the two calls' inputs (cached)."""
        return self._first_mismatch(self._in_mismatch, ca, cb, "inputs")

    def out_mismatch(self, ca: ModuleCall, cb: ModuleCall):
        """cmp.first_mismatch of the two calls' outputs (cached)."""
        return self._first_mismatch(self._out_mismatch, ca, cb, "outputs")

    def _first_mismatch(self, cache: dict, ca: ModuleCall, cb: ModuleCall, side: str):
        key = (ca.call_id, cb.call_id)
        hit = cache.get(key, _UNSET)
        if hit is _UNSET:
            hit = cache[key] = self.cmp.first_mismatch(getattr(ca, side), getattr(cb, side))
        return hit

    def differs(self, ca: ModuleCall, cb: ModuleCall) -> bool:
        hit = self._differs.get(ca.call_id)
        if hit is None:
            hit = (self.in_mismatch(ca, cb) is not None
                   or self.out_mismatch(ca, cb) is not None
                   or any(self.differs(x, y) for x, y in self.child_pairs(ca, cb))
                   or self.first_op_mismatch(ca, cb) is not None)
            self._differs[ca.call_id] = hit
        return hit

    def localize(self, ca: ModuleCall, cb: ModuleCall) -> Divergence:
        m = self.in_mismatch(ca, cb)
        if m is not None:
            return self._divergence(ca, cb, m[1], m[2], f"input {m[0]}", "propagated")
        for child_a, child_b in self.child_pairs(ca, cb):
            m = self.in_mismatch(child_a, child_b)
            if m is not None:
                return self._own_code(ca, cb, m[1], m[2], f"input {m[0]} of {child_a.module or '<root>'}",
                                      child=(child_a, child_b))
            if self.differs(child_a, child_b):
                return self.localize(child_a, child_b)
        m = self.out_mismatch(ca, cb)
        if m is not None:
            return self._own_code(ca, cb, m[1], m[2], m[0])
        om = self.first_op_mismatch(ca, cb)
        if om is not None:
            ia, ib, va, vb = om
            return self._own_code(ca, cb, va, vb, f"output of {self.a.rop[ia]} #{ia}")
        raise AssertionError("localize() called on a pair that does not differ")

    # -- own code -----------------------------------------------------------------------------------------
    @staticmethod
    def _root_of(t: Trace, call: ModuleCall) -> ModuleCall:
        while call.parent is not None and call.parent in t.calls:
            call = t.calls[call.parent]
        return call

    @staticmethod
    def _span_hashes(t: Trace, call: ModuleCall) -> set:
        """(dtype, shape, hash) of every value the records of `call`'s span (its enter to its exit) mention."""
        end = call.exit_index if call.exit_index is not None else len(t.rcall) - 1
        vids = {v for _, v in call.inputs}
        rcall, rin, rout, calls = t.rcall, t.rin, t.rout, t.calls
        for i in range(call.enter_index, end + 1):
            ins = rin[i]
            if ins is not None:  # an op
                vids.update(ins)
                vids.update(rout[i])
            else:  # a module call's enter or exit
                c = calls[rcall[i]]
                vids.update(v for _, v in (c.inputs if c.enter_index == i else c.outputs))
        return {t.vkey[v] for v in vids}

    @staticmethod
    def region(t: Trace, call: ModuleCall, start: int, known_other) -> list[int]:
        """Op records of `call`'s own code between the values both sides share and the value `start`.
        `known_other` is the other side's span hashes, or a function returning them (called only if needed)."""
        own = set(call.ops)
        key, vprod, rin = t.vkey, t.vprod, t.rin
        region, seen, todo = set(), set(), [start]
        while todo:
            vid = todo.pop()
            if vid in seen:
                continue
            seen.add(vid)
            producer = vprod.get(vid)
            if producer is None or producer not in own:
                continue
            if vid != start:
                if callable(known_other):
                    known_other = known_other()
                if key[vid] in known_other:
                    continue
            region.add(producer)
            todo.extend(rin[producer])
        return sorted(region)

    def _one_sided(self, ca, cb, va, vb, span_a, span_b, child):
        """(va, vb, what) of the first values of the two calls' own code that the other side never made, when
        the child calls were met in another order (experts summed the other way round): each side's differing
        input went into another call of the same child module on the other side, so the pair that differs is
        a pairing of calls, not a value one side computed differently. None otherwise (a wrong tensor passed
        to a child stays the answer: that input is where the two runs part)."""
        ka, kb = self.a.vkey, self.b.vkey

        def inputs_of(t, module, skip):
            return {t.vkey[v] for c in t.calls.values() if c.module == module and c is not skip for _, v in c.inputs}

        child_a, child_b = child
        if ka[va] not in inputs_of(self.b, child_b.module, child_b) or \
                kb[vb] not in inputs_of(self.a, child_a.module, child_a):
            return None
        oa = next((v for i in ca.ops for v in self.a.rout[i] if ka[v] not in span_b()), None)
        ob = next((v for i in cb.ops for v in self.b.rout[i] if kb[v] not in span_a()), None)
        if oa is None or ob is None:
            return None
        return oa, ob, f"output of {self.a.rop[self.a.vprod[oa]]} #{self.a.vprod[oa]}"

    def _own_code(self, ca, cb, va, vb, what, child=None) -> Divergence:
        ops = self.a.meta.get("ops") and self.b.meta.get("ops")
        # The other side's span hashes cover a whole call (the root's: the whole trace); built only when the
        # walk back from the differing value (or the check for child calls met in another order) looks one up.
        span_b = functools.cache(lambda: self._span_hashes(self.b, cb))
        span_a = functools.cache(lambda: self._span_hashes(self.a, ca))
        moved = self._one_sided(ca, cb, va, vb, span_a, span_b, child) if ops and child else None
        if moved is not None:
            va, vb, what = moved
        d = self._divergence(ca, cb, va, vb, what, "origin")
        if not ops:
            return d
        reg_a = self.region(self.a, ca, va, span_b)
        reg_b = self.region(self.b, cb, vb, span_a)
        d.region_a = [(i, self.a.rop[i]) for i in reg_a]
        d.region_b = [(i, self.b.rop[i]) for i in reg_b]
        # An input no op made (a parameter, a model input such as vLLM's positions) differs only if the other
        # side holds no equal value anywhere in its root call: HF's self_attn never sees the position ids its
        # model turned into cos/sin before, yet they are equal.
        root_b = functools.cache(lambda: self._span_hashes(self.b, self._root_of(self.b, cb)))
        root_a = functools.cache(lambda: self._span_hashes(self.a, self._root_of(self.a, ca)))
        d.outside_input = (self._outside_input(self.a, ca, reg_a, root_b, "a", "b")
                           or self._outside_input(self.b, cb, reg_b, root_a, "b", "a"))
        part_a = self._parting(self.a, reg_a, ca.ops)
        part_b = self._parting(self.b, reg_b, cb.ops)
        if part_a is None and part_b is None:
            return d
        d.kind = "op"
        d.op = self.a.rop[part_a] if part_a is not None else None
        d.op_b = self.b.rop[part_b] if part_b is not None else None
        d.index = part_a if part_a is not None else d.index
        d.index_b = part_b
        if [o for _, o in d.region_a] == [o for _, o in d.region_b] and part_a is not None and part_b is not None:
            # Same code on both sides: the parting op has a counterpart, so report its own difference.
            oa, ob = self.a.rout[part_a], self.b.rout[part_b]
            if oa and ob and not self.cmp.same(oa[0], ob[0]):
                d.tensor = f"output of {d.op}"
                self._fill(d, oa[0], ob[0])
        return d

    @staticmethod
    def _outside_input(t: Trace, call: ModuleCall, region: list[int], other_span, side: str, other: str):
        """The first input of `region` that no recorded op made and that is not among the other side's values
        (of its root call's span), said in words; None when there is none."""
        call_inputs = {v for _, v in call.inputs}
        for i in region:
            for pos, vid in enumerate(t.rin[i]):
                if vid not in t.vprod and vid not in call_inputs and t.vkey[vid] not in other_span():
                    return (f"input {pos} of {t.rop[i]} (record {i}, side {side}) was made by no recorded op (a "
                            "parameter or buffer, or bytes written by a kernel torch does not see) and differs: "
                            f"side {other} holds no equal value")
        return None

    @staticmethod
    def _parting(t: Trace, region: list[int], own: list[int]) -> int | None:
        memo: dict = {}
        scope = set(own)
        data = [i for i in region if not constant_derived(t, i, memo, scope)]
        return next((i for i in data if _computing(t.rop[i], t.rin[i], t.rout[i], t)), (data or region or [None])[0])

    def _divergence(self, ca, cb, va, vb, what, cause) -> Divergence:
        d = Divergence(index=ca.exit_index if ca.exit_index is not None else ca.enter_index, module=ca.module,
                       call=ca.call, op=None, op_b=None, kind="module", cause=cause, tensor=what, dtype="",
                       shape=[], numel=0, module_b=cb.module)
        self._fill(d, va, vb)
        return d

    def _fill(self, d: Divergence, va: int, vb: int) -> None:
        dtype, shape, _ = self.a.vkey[va]
        d.vid_a, d.vid_b = va, vb
        d.dtype, d.shape, d.numel = dtype, list(shape), prod(shape)
        d.diff = self.cmp.diff(va, vb)


def _final(a: Trace, b: Trace, pairing: Pairing, cmp: ValueComparator) -> dict | None:
    roots = [c for c in a.calls.values() if c.module == "" and c.exit_index is not None]
    if not roots:
        return None
    ra = max(roots, key=lambda c: c.exit_index)
    rb = pairing.partner(ra)
    if rb is None:
        return None
    pairs = cmp.pairs(ra.outputs, rb.outputs)
    ka, kb = a.vkey, b.vkey  # (dtype, shape, hash)
    cands = [(k, va, vb) for k, va, vb in pairs if ka[va][0].startswith("torch.float")
             or ka[va][0].startswith("torch.bfloat")]
    cands = [p for p in cands if len(ka[p[1]][1]) >= 2 and ka[p[1]][1][-1] > 1]
    if not cands:
        return None
    pref = [p for p in cands if re.search(r"logit|logprob|log_prob", p[0])]
    key, va, vb = (pref or cands)[0]
    out = {"tensor": key, "identical": ka[va] == kb[vb]}
    if cmp.values_available:
        from divtrace.compare.final import logprob_mismatch  # imports torch: only where there are values

        out.update(logprob_mismatch(a.tensor(va), b.tensor(vb), a.label, b.label, name=key))
    else:
        out.update({"max_abs_logprob_diff": None, "kl": None, "argmax_agreement": None})
    return out


def _hint(a: Trace, b: Trace, first: Divergence | None) -> str | None:
    if first is None or (a.mode == "full" and b.mode == "full"):
        return None
    inc = "^" + re.escape(first.module) + "$"
    cmds = []
    for t, side in ((a, "a"), (b, "b")):  # both sides: a repro needs the values of each
        entry = t.meta.get("entry")
        args = " ".join(f"--arg {shlex.quote(f'{k}={v}')}" for k, v in (t.meta.get("entry_args") or {}).items())
        target = f"{entry} {args}".strip() if entry else "ENTRY"
        cmds.append(f"divtrace record {target} --mode full --include {shlex.quote(inc)} --out {shlex.quote(str(t.path) + '-full')}")
    return ("value metrics need tensors; re-record the diverging module in full mode: " + " ; ".join(cmds)
            + (" (or in Python: divtrace.record(model, path, mode='full', include=" + repr(inc) + "))"))


def _top_pairs(ta: Trace, pairing: Pairing):
    """Aligned call pairs whose parents are not aligned with each other: the roots of the walk. Usually the two
    roots; when one side was recorded with include= they are the narrowed calls."""
    for ca in sorted(ta.calls.values(), key=lambda c: c.enter_index):
        cb = pairing.partner(ca)
        if cb is None:
            continue
        pa = ta.calls[ca.parent] if ca.parent is not None else None
        pb = pairing.partner(pa) if pa is not None else None
        if pb is None or pb.call_id != cb.parent:
            yield ca, cb


def _seen(t: Trace, side: str, other: Trace) -> TraceSeen:
    """What the verdict rule needs to know of trace `t` (the other trace measures how far it got)."""
    return TraceSeen(side, str(t.path), t.complete, getattr(t, "status", t.meta.get("status", "?")),
                     t.meta.get("error") if isinstance(t.meta.get("error"), str) else None,
                     None if t.complete else progress(t, other), unseen_of(t.meta))


def _final_outputs(ta: Trace, tb: Trace, pairing: Pairing, walker: _Walker) -> tuple[bool, bool | None, str | None]:
    """(compared, equal, why not compared) for the final outputs: the last top-level call of each side (the
    root's last call; with include= the last narrowed call) must have returned, pair with the other side's, and
    hold at least one tensor paired with one of the other's."""
    last = {}
    for side, t in (("a", ta), ("b", tb)):
        tops = [c for c in t.calls.values() if c.parent is None]
        c = max(tops, key=lambda c: c.enter_index)
        if c.exit_index is None:
            return False, None, f"the last root call of {side} ({c.module or '<root>'} call {c.call}) never returned"
        last[side] = (c, len(tops))
    (ca, na), (cb, nb) = last["a"], last["b"]
    partner = pairing.partner(ca)
    if partner is None or partner.call_id != cb.call_id:
        return False, None, (f"the last root calls do not pair up: a's is {ca.module or '<root>'} call {ca.call} "
                             f"(of {na}), b's is {cb.module or '<root>'} call {cb.call} (of {nb})")
    if not walker.cmp.pairs(ca.outputs, cb.outputs):
        return False, None, (f"the output of {ca.module or '<root>'} call {ca.call} holds no tensor on both sides "
                             "to compare")
    return True, walker.out_mismatch(ca, cb) is None, None


def _nothing_to_compare(ta: Trace, tb: Trace) -> BisectResult:
    """The verdict when a trace stopped before anything could be compared (before its first module call was
    written, say): inconclusive, saying why."""
    v = decide(origin_found=False, within_tolerance=False, final_compared=False, final_equal=None,
               a=_seen(ta, "a", tb), b=_seen(tb, "b", ta), calls_compared=0, only_a=len(ta.calls),
               only_b=len(tb.calls), final_note="nothing was compared")
    assert v.verdict == INCONCLUSIVE, v  # only an incomplete trace gets here
    return BisectResult(
        verdict=v.verdict, reason=v.reason, coverage=v.coverage, compared=0, first=None, next=[], settings=[],
        final=None, labels=(ta.label, tb.label), paths=(str(ta.path), str(tb.path)),
        metrics_available=ta.mode == "full" and tb.mode == "full", complete=(ta.complete, tb.complete),
        unmatched={"a": len(ta.calls), "b": len(tb.calls)},
        warnings=[w for t in (ta, tb) for w in getattr(t, "warnings", [])])


def bisect(a, b, *, tol: Tolerance | None = None, path_map: PathMap | None = None, n_next: int = 5,
           align: str = "auto") -> BisectResult:
    """Compare two traces (paths or `Trace`s) and localize their first divergence.

    `align`: "calls" pairs module calls by path and call number; "tokens" pairs the tokens both runs computed
    (divtrace.compare.token_bisect: a rollout's prefill and decode steps against a trainer's full-sequence
    micro-batches); "auto" (default) takes tokens when both traces carry token identity and their root calls do
    not already hold the same tokens in the same rows (where they do, the two alignments are the same)."""
    if align not in ("auto", "tokens", "calls"):
        raise DivtraceError(f"align must be 'auto', 'tokens' or 'calls', got {align!r}")
    with gc_paused():  # its caches are many small objects in no cycle (a 100k-record bisect: 0.25 s of collections)
        if align != "calls":
            from divtrace.compare.token_align import token_alignment_needed

            ta = a if isinstance(a, Trace) else Trace(a)
            tb = b if isinstance(b, Trace) else Trace(b)
            if token_alignment_needed(ta, tb, forced=align == "tokens"):
                from divtrace.compare.token_bisect import token_bisect  # (numpy: only where tokens are aligned)

                return token_bisect(ta, tb, tol=tol, path_map=path_map, n_next=n_next)
            a, b = ta, tb
        return _bisect(a, b, tol, path_map, n_next)


def _bisect(a, b, tol: Tolerance | None, path_map: PathMap | None, n_next: int) -> BisectResult:
    ta = a if isinstance(a, Trace) else Trace(a)
    tb = b if isinstance(b, Trace) else Trace(b)
    for t in (ta, tb):
        if not t.calls and t.complete:
            raise DivtraceError(f"{t.path}: the trace holds no module calls (was the recorded model called inside "
                                "the record block?)")
    if not ta.calls or not tb.calls:  # a recording that stopped before its first call was written
        return _nothing_to_compare(ta, tb)
    pairing = Pairing(ta, tb, path_map)
    nonroot = lambda keys: {k for k in keys if k[0] != ""}
    if not pairing.common or (nonroot(pairing.by_key_a) and nonroot(pairing.by_key_b)
                              and not nonroot(pairing.common)):
        raise DivtraceError(
            f"{ta.path} and {tb.path} share no module calls: they look like traces of unrelated models "
            f"({ta.meta.get('model_class')}, {len(ta.calls)} calls vs {tb.meta.get('model_class')}, {len(tb.calls)} "
            "calls); if the two stacks name modules differently, pass --map FILE")
    cmp = ValueComparator(ta, tb, tol)
    walker = _Walker(ta, tb, pairing, cmp)
    warnings = [f"trace {t.path} is incomplete (status: {getattr(t, 'status', t.meta.get('status'))}"
                + (f", {t.meta['error']}" if t.meta.get("error") else "") + "): only what ran before it stopped is compared"
                for t in (ta, tb) if not t.complete]
    warnings += [w for t in (ta, tb) for w in getattr(t, "warnings", [])]
    warnings += [f"{t.path} (recording): {w}" for t in (ta, tb) for w in t.meta.get("warnings") or []
                 if isinstance(w, str)]
    if ta.meta.get("ops") and tb.meta.get("ops") and ta.meta.get("view_key") != tb.meta.get("view_key"):
        warnings.append(f"the traces derive strided views' fingerprints differently (view_key {ta.meta.get('view_key')} "
                        f"vs {tb.meta.get('view_key')}: recorded by different divtrace versions); views inside a "
                        "module may compare unequal where their bytes are equal; module inputs and outputs are "
                        "unaffected: record both sides with one version to compare them")
    aligned = [(ca, cb) for ca in sorted(ta.calls.values(), key=lambda c: c.enter_index)
               if (cb := pairing.partner(ca)) is not None]
    first = None
    for ra, rb in _top_pairs(ta, pairing):
        if walker.differs(ra, rb):
            first = walker.localize(ra, rb)
            break
    # Sweep every aligned call (and same-sequence ops) so "identical" really means every compared tensor.
    diverging_calls = []
    for ca, cb in aligned:
        if walker.out_mismatch(ca, cb) is not None:
            diverging_calls.append((ca, cb))
        walker.in_mismatch(ca, cb)
        walker.first_op_mismatch(ca, cb)
    nxt = []
    for ca, cb in sorted(diverging_calls, key=lambda p: p[0].exit_index or 0):
        if len(nxt) >= n_next:
            break
        if first is not None and ((ca.module, ca.call) == (first.module, first.call)
                                  or (ca.exit_index or 0) <= first.index):
            continue
        m = walker.out_mismatch(ca, cb)
        cause = "propagated" if walker.in_mismatch(ca, cb) is not None else "origin"
        d = walker._divergence(ca, cb, m[1], m[2], m[0], cause)
        nxt.append(d)
    if first is None and cmp.bitwise_differs and cmp.tol is None:
        # Differences the tree walk could not reach (calls that pair up under different parents): report the
        # earliest differing call rather than ever calling the runs identical.
        first = nxt.pop(0) if nxt else None
        warnings.append("the call trees of the two traces do not nest the same way; the first divergence is the "
                        "earliest differing call, not localized further")
    if not cmp.compared and not (ta.complete and tb.complete):
        return _nothing_to_compare(ta, tb)  # a recording that stopped before any tensor pair could be compared
    if not cmp.compared:
        # "identical" over no pair at all would be a claim about nothing (every tensor skipped when recording,
        # meta tensors, say): refuse rather than pass.
        raise DivtraceError(f"{ta.path} vs {tb.path}: no tensor of one trace has a counterpart in the other, so "
                            "nothing was compared; were the tensors skipped when recording? (see `divtrace show`)")
    unmatched = pairing.unmatched()
    if unmatched["a"] or unmatched["b"]:
        roots = [sum(1 for c in t.calls.values() if c.module == "") for t in (ta, tb)]
        warnings.append(f"{unmatched['a']} module calls only in a and {unmatched['b']} only in b were not compared"
                        + (f" (a called the root {roots[0]} times, b {roots[1]})" if roots[0] != roots[1] else "")
                        + "; if the stacks name modules differently, pass --map FILE")
    if first is None and cmp.bitwise_differs:
        verdict = "within_tolerance" if cmp.tol is not None else "diverged"
    else:
        verdict = "diverged" if first is not None else "identical"
    if verdict in ("identical", "within_tolerance"):
        # The verdict so far rests on the fingerprints in records.jsonl; before calling the runs equal, make sure
        # the stored bytes are what was recorded (a corrupted shard must never pass as identical).
        for t in (ta, tb):
            verify = getattr(t, "verify_shards", None)
            if verify is not None:
                verify()
    if verdict == "diverged" and first is None:
        raise DivtraceError(f"{ta.path} vs {tb.path}: tensors differ but no aligned module call differs; "
                            "cannot localize (please report this)")
    final_compared, final_equal, final_note = _final_outputs(ta, tb, pairing, walker)
    v = decide(origin_found=first is not None, within_tolerance=verdict == "within_tolerance",
               final_compared=final_compared, final_equal=final_equal, a=_seen(ta, "a", tb), b=_seen(tb, "b", ta),
               calls_compared=len(aligned), only_a=unmatched["a"], only_b=unmatched["b"], final_note=final_note)
    env_keys = ("torch_version", "device", "cuda_device_name")
    sets = _settings_diff({**ta.meta.get("settings", {}), **{k: ta.meta.get(k) for k in env_keys}},
                         {**tb.meta.get("settings", {}), **{k: tb.meta.get(k) for k in env_keys}})
    from divtrace.compiled.report import annotate

    compiled, compiled_hint = annotate(ta, tb, first)
    hint = _hint(ta, tb, first)
    hint = "; ".join(h for h in (compiled_hint, hint) if h) or None
    return BisectResult(
        verdict=v.verdict, reason=v.reason, coverage=v.coverage, compared=cmp.compared, first=first, next=nxt,
        settings=sets,
        final=_final(ta, tb, pairing, cmp), labels=(ta.label, tb.label), paths=(str(ta.path), str(tb.path)),
        metrics_available=cmp.values_available, complete=(ta.complete, tb.complete), unmatched=unmatched,
        warnings=warnings, hint=hint, bitwise_differs=cmp.bitwise_differs, compiled=compiled,
        tolerance=None if cmp.tol is None else {"atol": cmp.tol.atol, "rtol": cmp.tol.rtol, "ulp": cmp.tol.ulp})


first_divergence = bisect
