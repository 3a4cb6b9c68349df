"""The walker: where, inside two aligned runs, a difference originates. `OriginWalker` walks down the call tree of
two traces (or two token views of them) from a pair of calls that differ.

At each aligned pair of calls (inputs equal, something differs) the children are visited in execution order: a
child whose inputs already differ means the parent's own code between its children made the difference; a child
that differs with equal inputs is entered. When no child explains it, the parent's own code is the origin. Inside
that code the two sides may run different op sequences (eager bmm+softmax vs one fused SDPA op), so ops are
aligned by value: from the first differing tensor each side walks back through its producers until it reaches
values the other side also has. What is left is each side's region; its first op that computes (not a view or
copy) is where the sequences part.

In: two traces (divtrace.trace, or align.tokens' TokenViews), their call pairing (divtrace.align.calls) and a
value comparator (values.py). Out: a `Divergence` (results.py) per question asked; both bisects use it.
"""
from __future__ import annotations

import functools
from collections import Counter
from itertools import chain
from math import prod

from divtrace.align.calls import Pairing
from divtrace.compare.op_kinds import computing, constant_derived, writes_in_place
from divtrace.compare.output_reach import reaching_child
from divtrace.compare.params import name_of_value
from divtrace.compare.results import Divergence
from divtrace.compare.values import ValueComparator
from divtrace.trace.reader import Trace
from divtrace.trace.records import ModuleCall

_UNSET = object()


class OriginWalker:
    """Localizes the origin of a difference between two aligned traces; caches what it compares."""

    def __init__(self, a: Trace, b: Trace, pairing: Pairing, cmp: ValueComparator):
        self.a, self.b, self.pairing, self.cmp = a, b, pairing, cmp
        self._differs: dict[int, bool] = {}
        self._op_mismatch: dict[tuple[int, int], tuple | None] = {}
        self._in_mismatch: dict[tuple[int, int], tuple | None] = {}
        self._out_mismatch: dict[tuple[int, int], tuple | None] = {}
        self.passed_over: list = []  # earlier children whose difference reaches no differing output (output_reach)

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
        if any(writes_in_place(self.a.rop[i]) for i in ca.ops) or any(writes_in_place(self.b.rop[i]) for i in cb.ops):
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
            return self.divergence(ca, cb, m[1], m[2], f"input {m[0]}", "propagated")
        reach = reaching_child(self, ca, cb)
        if reach is not None:  # the differing outputs come from a later child whose inputs are equal
            self.passed_over += reach[2]
            return self.localize(reach[0], reach[1])
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
        whole = getattr(t, "trace", None) or getattr(t, "_trace", t)  # calls folded away are the trace's still
        for i in range(call.enter_index, end + 1):
            ins = rin[i]
            if ins is not None:  # an op
                vids.update(ins)
                vids.update(rout[i])
            else:  # a module call's enter or exit
                c = calls.get(rcall[i]) or whole.calls[rcall[i]]
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
        d = self.divergence(ca, cb, va, vb, what, "origin")
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
        part_a = self._parting(self.a, reg_a, ca, va)
        part_b = self._parting(self.b, reg_b, cb, vb)
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
        """The first input of `region` that no recorded op made and that differs from the other side's values (of
        its root call's span), said in words; None when there is none. "Differs" needs a counterpart: a value of
        the same dtype and shape on the other side that is not bitwise equal. A value the other side holds in no
        such form (vLLM's cos/sin cache, HF's cos and sin made per call) is not compared, so nothing is claimed,
        and an empty tensor (a fresh KV cache) holds nothing to differ."""
        call_inputs = {v for _, v in call.inputs}
        for i in region:
            for pos, vid in enumerate(t.rin[i]):
                if vid in t.vprod or vid in call_inputs:
                    continue
                key = t.vkey[vid]
                if len(key) < 3 or 0 in tuple(key[1]) or key in other_span():
                    continue
                if any(k[0] == key[0] and tuple(k[1]) == tuple(key[1]) for k in other_span() if len(k) >= 3):
                    named = name_of_value(t, vid)
                    what = (f"is {named[0]} {named[1]}" if named is not None else
                            "has no recorded producer (a parameter or buffer, bytes written by a kernel torch does "
                            "not see, or a tensor an op wrote in place through a view of it, as an attention writing "
                            "into its output buffer)")
                    return (f"input {pos} of {t.rop[i]} (record {i}, side {side}) {what} and differs: "
                            f"side {other} holds values of its dtype and shape, none bitwise equal to it")
        return None

    @staticmethod
    def _parting(t: Trace, region: list[int], call, value) -> int | None:
        own = call.ops
        memo: dict = {}
        scope = set(own)
        data = [i for i in region if not constant_derived(t, i, memo, scope)]
        if not region and own and value not in t.vprod and any(v == value for _, v in call.outputs):
            # The differing output was made by no op of the call (an engine adapter's derived output, such as vLLM's
            # q block of its fused qkv_proj): the call's own computing op that ran last made what it derives from.
            # (A differing child input no op made, a model input passed on, stays the input.)
            last = [i for i in own if computing(t.rop[i], t.rin[i], t.rout[i], t)]
            return last[-1] if last else None
        return next((i for i in data if computing(t.rop[i], t.rin[i], t.rout[i], t)), (data or region or [None])[0])

    def divergence(self, ca, cb, va, vb, what, cause) -> Divergence:
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
