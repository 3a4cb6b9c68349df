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

import re
import shlex
from dataclasses import dataclass, field

from divtrace.compare.align import Pairing, PathMap, ValueComparator
from divtrace.compare.metrics import TensorDiff, Tolerance
from divtrace.errors import DivtraceError
from divtrace.records import ModuleCall, OpRecord
from divtrace.settings import settings_diff
from divtrace.trace.reader import Trace

# Ops that only move, alias or select values: never where two computations part, though they can sit in a region.
VALUE_PRESERVING = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "t", "permute", "expand", "unsqueeze",
    "squeeze", "select", "slice", "as_strided", "alias", "detach", "clone", "contiguous", "unfold", "split",
    "split_with_sizes", "chunk", "unbind", "narrow", "flatten", "lift_fresh", "lift_fresh_copy", "repeat", "cat",
    "stack", "index_select", "gather", "embedding", "_to_copy", "copy_", "copy", "expand_as", "view_as",
    "movedim", "diagonal", "fill_", "zeros_like", "empty_like", "new_empty", "new_zeros",
}


def _finfo(name: str):
    import torch

    from divtrace.trace.reader import torch_dtype

    d = torch_dtype(name)
    return torch.finfo(d) if d.is_floating_point else None


def cast_rounds(dtype_in: str, dtype_out: str) -> bool:
    """Whether a cast can change values: to a float with less precision or range, float to int, or int to a
    16-bit-or-narrower float (positions in bf16 round above 256). Widening casts are exact."""
    if dtype_in == dtype_out:
        return False
    fi, fo = _finfo(dtype_in), _finfo(dtype_out)
    if fo is None:
        return fi is not None or dtype_out != "torch.bool"
    if fi is None:
        return dtype_in != "torch.bool" and fo.bits <= 16
    return fo.eps > fi.eps or fo.max < fi.max or fo.tiny > fi.tiny


def is_computing(rec: OpRecord, trace: Trace) -> bool:
    """False for ops that only rearrange values, and for casts that cannot round."""
    parts = rec.op.split(".")
    name = parts[1] if len(parts) >= 2 else rec.op
    if name not in VALUE_PRESERVING:
        return True
    if name in ("_to_copy", "copy_", "copy"):
        dts_in = [trace.values[v].dtype for v in rec.inputs]
        dts_out = [trace.values[v].dtype for v in rec.outputs]
        src = dts_in[-1] if name == "copy_" and len(dts_in) > 1 else (dts_in[0] if dts_in else None)
        return src is not None and any(cast_rounds(src, d) for d in dts_out)
    return False


def constant_derived(trace: Trace, index: int, memo: dict, scope: set | None = None) -> bool:
    """True for ops computed from constants alone (a causal mask from `full`+`triu`, an `arange`): they carry
    no data from the inputs, so they are never where two computations of the data part. With `scope` (the op
    indices of one call's own code) a value from outside it counts as data, which keeps the walk inside the
    call; without, it is iterative anyway: a chain of producers can be as long as the run."""
    stack = [index]
    while stack:
        i = stack[-1]
        if i in memo:
            stack.pop()
            continue
        result, pending = True, []
        for vid in trace.records[i].inputs:
            p = trace.values[vid].producer
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

    def to_dict(self) -> dict:
        d = {"index": self.index, "module": self.module, "call": self.call, "op": self.op, "op_b": self.op_b,
             "kind": self.kind, "cause": self.cause, "tensor": self.tensor, "dtype": self.dtype,
             "shape": self.shape, "numel": self.numel, "module_b": self.module_b, "index_b": self.index_b,
             "region_a": [{"index": i, "op": o} for i, o in self.region_a],
             "region_b": [{"index": i, "op": o} for i, o in self.region_b]}
        m = self.diff.to_dict() if self.diff is not None else {}
        for k in ("reason", "max_abs", "max_ulp", "max_rel", "mismatched", "nan_mismatch", "first_index", "first_a", "first_b",
                  "first_a_bits", "first_b_bits"):
            d[k] = m.get(k)
        d["metrics_available"] = self.diff is not None
        return d


@dataclass
class BisectResult:
    verdict: str  # "identical" | "diverged" | "within_tolerance"
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

    @property
    def exit_code(self) -> int:
        return 1 if self.verdict == "diverged" else 0

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "compared": self.compared,
                "first": self.first.to_dict() if self.first else None,
                "next": [d.to_dict() for d in self.next], "final": self.final, "settings_diff": self.settings,
                "labels": {"a": self.labels[0], "b": self.labels[1]}, "traces": {"a": self.paths[0], "b": self.paths[1]},
                "metrics_available": self.metrics_available,
                "complete": {"a": self.complete[0], "b": self.complete[1]}, "unmatched_calls": self.unmatched,
                "bitwise_differs": self.bitwise_differs, "tolerance": self.tolerance,
                "warnings": self.warnings, "hint": self.hint}


class _Walker:
    def __init__(self, a: Trace, b: Trace, pairing: Pairing, cmp: ValueComparator):
        self.a, self.b, self.pairing, self.cmp = a, b, pairing, cmp
        self._differs: dict[int, bool] = {}
        self._op_mismatch: dict[tuple[int, int], tuple | None] = {}

    # -- tree -----------------------------------------------------------------------------------------------
    def child_pairs(self, ca: ModuleCall, cb: ModuleCall):
        for cid in ca.children:
            child_a = self.a.calls[cid]
            child_b = self.pairing.partner(child_a)
            if child_b is not None and child_b.parent == cb.call_id:
                yield child_a, child_b

    def op_pairs(self, ca: ModuleCall, cb: ModuleCall):
        """Own ops compared position by position, only when both sides ran the same op sequence."""
        ops_a = [self.a.records[i] for i in ca.ops]
        ops_b = [self.b.records[i] for i in cb.ops]
        if [r.op for r in ops_a] != [r.op for r in ops_b]:
            return []
        return [(ra, rb) for ra, rb in zip(ops_a, ops_b) if len(ra.outputs) == len(rb.outputs)]

    def first_op_mismatch(self, ca, cb):
        key = (ca.call_id, cb.call_id)
        if key not in self._op_mismatch:
            self._op_mismatch[key] = next(((ra, rb, va, vb) for ra, rb in self.op_pairs(ca, cb)
                                           for va, vb in zip(ra.outputs, rb.outputs) if not self.cmp.same(va, vb)),
                                          None)
        return self._op_mismatch[key]

    def differs(self, ca: ModuleCall, cb: ModuleCall) -> bool:
        hit = self._differs.get(ca.call_id)
        if hit is None:
            hit = (self.cmp.first_mismatch(ca.inputs, cb.inputs) is not None
                   or self.cmp.first_mismatch(ca.outputs, cb.outputs) is not None
                   or any(self.differs(x, y) for x, y in self.child_pairs(ca, cb))
                   or self.first_op_mismatch(ca, cb) is not None)
            self._differs[ca.call_id] = hit
        return hit

    def localize(self, ca: ModuleCall, cb: ModuleCall) -> Divergence:
        m = self.cmp.first_mismatch(ca.inputs, cb.inputs)
        if m is not None:
            return self._divergence(ca, cb, m[1], m[2], f"input {m[0]}", "propagated")
        for child_a, child_b in self.child_pairs(ca, cb):
            m = self.cmp.first_mismatch(child_a.inputs, child_b.inputs)
            if m is not None:
                return self._own_code(ca, cb, m[1], m[2], f"input {m[0]} of {child_a.module or '<root>'}")
            if self.differs(child_a, child_b):
                return self.localize(child_a, child_b)
        m = self.cmp.first_mismatch(ca.outputs, cb.outputs)
        if m is not None:
            return self._own_code(ca, cb, m[1], m[2], m[0])
        om = self.first_op_mismatch(ca, cb)
        if om is not None:
            ra, rb, va, vb = om
            return self._own_code(ca, cb, va, vb, f"output of {ra.op} #{ra.index}")
        raise AssertionError("localize() called on a pair that does not differ")

    # -- own code -----------------------------------------------------------------------------------------
    def _span_hashes(self, t: Trace, call: ModuleCall) -> set:
        end = call.exit_index if call.exit_index is not None else len(t.records) - 1
        vids = {v for _, v in call.inputs}
        for rec in t.records[call.enter_index:end + 1]:
            if rec.kind == "op":
                vids.update(rec.inputs)
                vids.update(rec.outputs)
            else:
                vids.update(v for _, v in (rec.inputs if rec.kind == "enter" else rec.outputs))
        return {(t.values[v].dtype, tuple(t.values[v].shape), t.values[v].hash) for v in vids}

    @staticmethod
    def region(t: Trace, call: ModuleCall, start: int, known_other: set) -> list[int]:
        """Op records of `call`'s own code between the values both sides share and the value `start`."""
        own = set(call.ops)
        region, seen, todo = set(), set(), [start]
        while todo:
            vid = todo.pop()
            if vid in seen:
                continue
            seen.add(vid)
            val = t.values[vid]
            if val.producer is None or val.producer not in own:
                continue
            if vid != start and (val.dtype, tuple(val.shape), val.hash) in known_other:
                continue
            region.add(val.producer)
            todo.extend(t.records[val.producer].inputs)
        return sorted(region)

    def _own_code(self, ca, cb, va, vb, what) -> Divergence:
        d = self._divergence(ca, cb, va, vb, what, "origin")
        if not (self.a.meta.get("ops") and self.b.meta.get("ops")):
            return d
        reg_a = self.region(self.a, ca, va, self._span_hashes(self.b, cb))
        reg_b = self.region(self.b, cb, vb, self._span_hashes(self.a, ca))
        d.region_a = [(i, self.a.records[i].op) for i in reg_a]
        d.region_b = [(i, self.b.records[i].op) for i in reg_b]
        part_a = self._parting(self.a, reg_a, ca.ops)
        part_b = self._parting(self.b, reg_b, cb.ops)
        if part_a is None and part_b is None:
            return d
        d.kind = "op"
        d.op = self.a.records[part_a].op if part_a is not None else None
        d.op_b = self.b.records[part_b].op if part_b is not None else None
        d.index = part_a if part_a is not None else d.index
        d.index_b = part_b
        if [o for _, o in d.region_a] == [o for _, o in d.region_b] and part_a is not None and part_b is not None:
            # Same code on both sides: the parting op has a counterpart, so report its own difference.
            oa, ob = self.a.records[part_a].outputs, self.b.records[part_b].outputs
            if oa and ob and not self.cmp.same(oa[0], ob[0]):
                d.tensor = f"output of {d.op}"
                self._fill(d, oa[0], ob[0])
        return d

    @staticmethod
    def _parting(t: Trace, region: list[int], own: list[int]) -> int | None:
        memo: dict = {}
        scope = set(own)
        data = [i for i in region if not constant_derived(t, i, memo, scope)]
        return next((i for i in data if is_computing(t.records[i], t)), (data or region or [None])[0])

    def _divergence(self, ca, cb, va, vb, what, cause) -> Divergence:
        d = Divergence(index=ca.exit_index if ca.exit_index is not None else ca.enter_index, module=ca.module,
                       call=ca.call, op=None, op_b=None, kind="module", cause=cause, tensor=what, dtype="",
                       shape=[], numel=0, module_b=cb.module)
        self._fill(d, va, vb)
        return d

    def _fill(self, d: Divergence, va: int, vb: int) -> None:
        val = self.a.values[va]
        d.vid_a, d.vid_b = va, vb
        d.dtype, d.shape, d.numel = val.dtype, val.shape, val.numel
        d.diff = self.cmp.diff(va, vb)


def _final(a: Trace, b: Trace, pairing: Pairing, cmp: ValueComparator) -> dict | None:
    from divtrace.compare.final import logprob_mismatch

    roots = [c for c in a.calls.values() if c.module == "" and c.exit_index is not None]
    if not roots:
        return None
    ra = max(roots, key=lambda c: c.exit_index)
    rb = pairing.partner(ra)
    if rb is None:
        return None
    pairs = cmp.pairs(ra.outputs, rb.outputs)
    cands = [(k, va, vb) for k, va, vb in pairs if a.values[va].dtype.startswith("torch.float")
             or a.values[va].dtype.startswith("torch.bfloat")]
    cands = [p for p in cands if len(a.values[p[1]].shape) >= 2 and a.values[p[1]].shape[-1] > 1]
    if not cands:
        return None
    pref = [p for p in cands if re.search(r"logit|logprob|log_prob", p[0])]
    key, va, vb = (pref or cands)[0]
    out = {"tensor": key, "identical": a.values[va].same_bits(b.values[vb])}
    if cmp.values_available:
        out.update(logprob_mismatch(a.tensor(va), b.tensor(vb), a.label, b.label))
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


def bisect(a, b, *, tol: Tolerance | None = None, path_map: PathMap | None = None, n_next: int = 5) -> BisectResult:
    """Compare two traces (paths or `Trace`s) and localize their first divergence."""
    ta = a if isinstance(a, Trace) else Trace(a)
    tb = b if isinstance(b, Trace) else Trace(b)
    for t in (ta, tb):
        if not t.calls:
            raise DivtraceError(f"{t.path}: the trace holds no module calls (was the recorded model called inside "
                                "the record block?)")
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
    first = None
    for ra, rb in _top_pairs(ta, pairing):
        if walker.differs(ra, rb):
            first = walker.localize(ra, rb)
            break
    # Sweep every aligned call (and same-sequence ops) so "identical" really means every compared tensor.
    diverging_calls = []
    for ca in sorted(ta.calls.values(), key=lambda c: c.enter_index):
        cb = pairing.partner(ca)
        if cb is None:
            continue
        if cmp.first_mismatch(ca.outputs, cb.outputs) is not None:
            diverging_calls.append((ca, cb))
        cmp.first_mismatch(ca.inputs, cb.inputs)
        walker.first_op_mismatch(ca, cb)
    nxt = []
    for ca, cb in sorted(diverging_calls, key=lambda p: p[0].exit_index or 0):
        if len(nxt) >= n_next:
            break
        if first is not None and ((ca.module, ca.call) == (first.module, first.call)
                                  or (ca.exit_index or 0) <= first.index):
            continue
        m = cmp.first_mismatch(ca.outputs, cb.outputs)
        cause = "propagated" if cmp.first_mismatch(ca.inputs, cb.inputs) is not None else "origin"
        d = walker._divergence(ca, cb, m[1], m[2], m[0], cause)
        nxt.append(d)
    if first is None and cmp.bitwise_differs and cmp.tol is None:
        # Differences the tree walk could not reach (calls that pair up under different parents): report the
        # earliest differing call rather than ever calling the runs identical.
        first = nxt.pop(0) if nxt else None
        warnings.append("the call trees of the two traces do not nest the same way; the first divergence is the "
                        "earliest differing call, not localized further")
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
    env_keys = ("torch_version", "device", "cuda_device_name")
    sets = settings_diff({**ta.meta.get("settings", {}), **{k: ta.meta.get(k) for k in env_keys}},
                         {**tb.meta.get("settings", {}), **{k: tb.meta.get(k) for k in env_keys}})
    return BisectResult(
        verdict=verdict, compared=cmp.compared, first=first, next=nxt, settings=sets,
        final=_final(ta, tb, pairing, cmp), labels=(ta.label, tb.label), paths=(str(ta.path), str(tb.path)),
        metrics_available=cmp.values_available, complete=(ta.complete, tb.complete), unmatched=pairing.unmatched(),
        warnings=warnings, hint=_hint(ta, tb, first), bitwise_differs=cmp.bitwise_differs,
        tolerance=None if cmp.tol is None else {"atol": cmp.tol.atol, "rtol": cmp.tol.rtol, "ulp": cmp.tol.ulp})


first_divergence = bisect
