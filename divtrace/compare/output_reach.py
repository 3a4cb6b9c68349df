"""Which child a call's differing outputs come from (call alignment), so the walk enters it and not an earlier child
whose difference cannot reach them.

The call walk (walker.OriginWalker.localize) enters the first child, in execution order, that differs anywhere.
That child's difference may reach no output of the call: with HF's `logits_to_keep=1`, a difference in an earlier
token's row of the decoder's output is never read by lm_head, which reads the last row only, while the logits differ
for lm_head's own reason (another kernel, another weight). Where every differing output of the call is the output of
one later child whose inputs were all compared and are equal, and no op inside that child reads a value that a
recorded op outside it wrote other than through those inputs (a KV cache written in place, say), and every
value it reads from outside with no recorded producer is a named parameter or bitwise equal on both sides (a buffer
an earlier module wrote into through a view, or a kernel torch does not see, carries no record), no earlier
difference can reach those outputs: the walk enters that child, and each earlier child that differs is passed over
(bisect lists it under `absorbed`, never as the origin). Anything less proven keeps the first-in-order rule.

In: an OriginWalker and a pair of calls. Out: the child pair to enter and the earlier differing pairs passed over.
"""
from __future__ import annotations


def reaching_child(walker, ca, cb):
    """(xa, xb, earlier) where the differing outputs of `ca`/`cb` are all the outputs of child pair (xa, xb), whose
    inputs are proven equal, and `earlier` (children before it that differ) is not empty; else None."""
    cmp = walker.cmp
    pairs = cmp.pairs(ca.outputs, cb.outputs)
    if not pairs or len(pairs) != len(ca.outputs) or len(pairs) != len(cb.outputs):
        return None  # (an output left unpaired may differ: not every output was compared)
    bad = [(va, vb) for _, va, vb in pairs if not cmp.same(va, vb)]
    if not bad:
        return None
    kids = list(walker.child_pairs(ca, cb))
    for i, (xa, xb) in enumerate(kids):
        outs_a, outs_b = {v for _, v in xa.outputs}, {v for _, v in xb.outputs}
        if all(va in outs_a and vb in outs_b for va, vb in bad):
            break
    else:
        return None
    earlier = [(ya, yb) for ya, yb in kids[:i] if walker.differs(ya, yb)]
    if not earlier or not _inputs_equal(cmp, xa, xb):
        return None
    outside_a, outside_b = _outside_reads(walker.a, xa), _outside_reads(walker.b, xb)
    if outside_a is None or outside_b is None or outside_a != outside_b:
        return None  # (an earlier op's difference may come in other than through the inputs)
    return xa, xb, earlier


def _inputs_equal(cmp, xa, xb) -> bool:
    """Every input of the two calls paired, compared and bitwise equal (an input on one side only: not proven)."""
    pairs = cmp.pairs(xa.inputs, xb.inputs)
    return (bool(pairs) and len(pairs) == len(xa.inputs) == len(xb.inputs)
            and all(cmp.same(va, vb) for _, va, vb in pairs))


def _outside_reads(t, call) -> set | None:
    """The keys of the values that ops inside `call` read from outside it with no recorded producer, other than its
    inputs and the parameters the trace names (a weight as read: a difference of its own is the call's own reason):
    bytes written in place through a view of a tensor (a buffer an earlier module wrote its output into), or by a
    kernel torch does not see, which may carry an earlier op's difference unless both sides read the same bytes.
    None where an op reads a value an earlier recorded op made (other than through the inputs), or where the ops
    were not recorded or the call did not return: not proven."""
    from divtrace.compare.params import name_of_value

    if not (getattr(t, "meta", None) or {}).get("ops") or call.exit_index is None:
        return None
    rin, vprod = getattr(t, "rin", None), getattr(t, "vprod", None)
    if rin is None or vprod is None:
        return None
    mine, keys = {v for _, v in call.inputs}, set()
    for i in range(call.enter_index + 1, min(call.exit_index, len(rin))):
        for v in rin[i] or ():
            if v in mine:
                continue
            p = vprod.get(v)
            if p is not None:
                if p < call.enter_index:
                    return None
                continue
            named = name_of_value(t, v)
            if named is None or named[0] != "parameter":
                keys.add(t.vkey[v])
    return keys
