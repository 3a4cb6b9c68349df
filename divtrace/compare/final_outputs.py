"""The final outputs of two runs: whether the last root calls' outputs were compared and are equal (what the
verdict rests on), and the summary of their logits (`final` in bisect's result: KL, largest logprob difference,
argmax agreement; computed with torch only where values are stored, divtrace.compare.final).

In: two traces, their call pairing and the walker's comparisons. Out: the `final` part of a BisectResult and the
final-output facts the verdict (verdict.py) takes.
"""
from __future__ import annotations

import re

from divtrace.align.calls import Pairing
from divtrace.compare.values import ValueComparator
from divtrace.compare.walker import OriginWalker
from divtrace.trace.reader import Trace


def final_summary(a: Trace, b: Trace, pairing: Pairing, cmp: ValueComparator) -> dict | None:
    roots = [c for c in a.calls.values() if c.module == "" and c.exit_index is not None]
    if not roots:
        return None
    ra = max(roots, key=lambda c: c.exit_index)
    rb = pairing.partner(ra)
    if rb is None:
        return None
    pairs = [p for p in cmp.pairs(ra.outputs, rb.outputs) if not cmp.uncompared(p[1], p[2])]  # (not compared)
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


def final_outputs(ta: Trace, tb: Trace, pairing: Pairing,
                  walker: OriginWalker) -> tuple[bool, bool | None, str | None, bool]:
    """(compared, equal, why not compared, local) for the final outputs: the last top-level call of each side (the
    root's last call; with include= the last narrowed call) must have returned, pair with the other side's, and
    hold at least one tensor paired with one of the other's that both hold as a whole. `local`: they pair, but a
    run directory's side holds each of them only as its ranks' own pieces (its ranks part before it, or no layout
    says how the pieces make the whole: that side's `parted` or `unseen` says which), so nothing was compared."""
    last = {}
    for side, t in (("a", ta), ("b", tb)):
        tops = [c for c in t.calls.values() if c.parent is None]
        c = max(tops, key=lambda c: c.enter_index)
        if c.exit_index is None:
            return False, None, (f"the last root call of {side} ({c.module or '<root>'} call {c.call}) never "
                                 "returned"), False
        last[side] = (c, len(tops))
    (ca, na), (cb, nb) = last["a"], last["b"]
    partner = pairing.partner(ca)
    if partner is None or partner.call_id != cb.call_id:
        return False, None, (f"the last root calls do not pair up: a's is {ca.module or '<root>'} call {ca.call} "
                             f"(of {na}), b's is {cb.module or '<root>'} call {cb.call} (of {nb})"), False
    pairs = walker.cmp.pairs(ca.outputs, cb.outputs)
    if not pairs:
        return False, None, (f"the output of {ca.module or '<root>'} call {ca.call} holds no tensor on both sides "
                             "to compare"), False
    if all(walker.cmp.uncompared(va, vb) for _, va, vb in pairs):
        return False, None, (f"the output of {ca.module or '<root>'} call {ca.call} is, on a run directory's side, "
                             "its ranks' own pieces, not a global value to compare"), True
    return True, walker.out_mismatch(ca, cb) is None, None, False
