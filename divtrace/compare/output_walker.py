"""The walk that explains a differing output: descend from the root along *differing outputs* only.

For one token whose final value differs, at a pair of calls whose output differs: visit the children in
execution order and take the first whose output differs. Entered when its inputs are equal (for the token); if
its inputs already differ, the parent's own code between its children made them differ. Where no child's output
differs, the parent's own code is the origin. A child whose output is equal is never entered, whatever differs
inside it: such a difference is absorbed (the sweep lists it apart), never an origin.

Also here: whether every input of a parting op was compared for the token, which a cause such as "not
batch-invariant" needs before it is claimed.

In: two token views (divtrace.align.tokens) with their pairing and comparator. Out: a `Divergence` (results.py).
"""
from __future__ import annotations

from divtrace.align.tokens import Incomparable
from divtrace.compare.results import Divergence
from divtrace.compare.walker import OriginWalker


class OutputWalker(OriginWalker):
    """OriginWalker that follows differing outputs down the call tree (see the module docstring)."""

    def localize_output(self, ca, cb, target: tuple[int, int, str] | None = None) -> Divergence:
        """The origin of a differing output of `ca`/`cb` (their inputs equal). `target` (va, vb, what): the value
        pair that differs where the calls' own outputs are not compared for the token (the root of an engine whose
        final rows are declared apart, a fused head's logprobs)."""
        while True:
            nxt = None
            for child_a, child_b in self.child_pairs(ca, cb):
                if self.out_mismatch(child_a, child_b) is None and not self._uncompared_but_differs(child_a, child_b):
                    continue
                m = self.in_mismatch(child_a, child_b)
                if m is not None:
                    return self._own_code(ca, cb, m[1], m[2], f"input {m[0]} of {child_a.module or '<root>'}",
                                          child=(child_a, child_b))
                nxt = (child_a, child_b)
                break
            if nxt is None:
                m = self.out_mismatch(ca, cb)
                if m is not None:
                    return self._own_code(ca, cb, m[1], m[2], m[0])
                if target is not None:
                    return self._own_code(ca, cb, target[0], target[1], target[2])
                raise AssertionError("localize_output() called on a pair whose output does not differ")
            ca, cb = nxt
            target = None

    def _uncompared_but_differs(self, ca, cb) -> bool:
        """The calls' outputs were not compared (no pair of them: a tuple against a tensor, one side's structure),
        but a call inside them has a compared output that differs: the walk goes in there."""
        if self.cmp.pairs(ca.outputs, cb.outputs):
            return False
        return any(self.out_mismatch(x, y) is not None or self._uncompared_but_differs(x, y)
                   for x, y in self.child_pairs(ca, cb))

    def output_differs(self, ca, cb) -> bool:
        return self.out_mismatch(ca, cb) is not None or any(
            self.out_mismatch(x, y) is not None for x, y in self.child_pairs(ca, cb))

    def uncompared_inputs(self, d: Divergence) -> list[str]:
        """The inputs of `d`'s parting op (the same op on both sides) that were not compared for this token, in
        words: an input compared means both sides' values at that argument have the token's row (of one length), or
        are whole values (a weight) bitwise equal. A decode step's whole KV cache against a trainer's per-token
        K rows, or a broadcast value laid out otherwise, is not compared. Empty when every input was."""
        if d.kind != "op" or d.op is None or d.op_b is None or d.index is None or d.index_b is None:
            return ["the parting ops' inputs (no op on one side)"]
        ins_a, ins_b = self.a.rin[d.index], self.b.rin[d.index_b]
        if len(ins_a) != len(ins_b):
            return [f"the inputs of {d.op} ({len(ins_a)} on a, {len(ins_b)} on b)"]
        out = []
        for pos, (va, vb) in enumerate(zip(ins_a, ins_b)):
            ka, kb = self.a.vkey[va], self.b.vkey[vb]
            if isinstance(ka, Incomparable) or isinstance(kb, Incomparable):
                out.append(f"input {pos} of {d.op} (cross-token or ambiguous on one side: no token rows)")
            elif _is_row_key(ka) and _is_row_key(kb):
                if ka[1] != kb[1]:
                    out.append(f"input {pos} of {d.op} (token rows of {ka[1][0]} and {kb[1][0]} elements)")
            elif _is_row_key(ka) or _is_row_key(kb):
                out.append(f"input {pos} of {d.op} (token rows on one side only)")
            elif ka != kb:
                out.append(f"input {pos} of {d.op} ({ka[0].removeprefix('torch.')} {list(ka[1])} on a, "
                           f"{kb[0].removeprefix('torch.')} {list(kb[1])} on b: no token rows, not equal as a whole)")
        return out


def _is_row_key(key) -> bool:
    """A token row's key is (dtype, (elements,), int fingerprint); a whole value's is (dtype, shape, hex str)."""
    return len(key) == 3 and isinstance(key[2], int)
