"""The sweep: every paired module call's inputs and outputs, and the outputs of the ops of calls that ran the same op
sequence on both sides, compared row by row for every shared token, vectorized over the tokens of a pair of root
calls.

What it gives the token bisect:
- per module (label: path, and " #n" for its n-th call in a root call), which tokens' output rows differ there:
  the counts people read, and the picture `bisect --plot` draws;
- per token, its first differing module (the differing call that exits first): the tokens to walk are chosen by
  it, one group per distinct first module, so every origin is walked, not only the first tokens by position;
- the absorbed differences: an op whose output row differs inside a call whose output row is equal for that
  token; a call whose input rows differ but whose output rows do not (a fused add+norm's inputs); a call whose
  output differs inside a parent whose output does not, or inside a root call whose output holds no row of that
  token (logits_to_keep). None of them reaches that token's output.

In: the two traces' tokens, the token groups (pairs of root calls and the cells of each token), the folded views
(divtrace.align.views). Out: a `Sweep`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from divtrace.align.tokens import TraceTokens
from divtrace.align.views import TokenViews
from divtrace.compare.values import TokenComparator, uninitialized_values


@dataclass
class Sweep:
    compared: int = 0  # row pairs compared
    module_rows: dict = field(default_factory=dict)  # label -> (forward rank, {token key: output differs})
    first_module: dict = field(default_factory=dict)  # token key -> (exit record of a, label) of its first difference
    any_differs: set = field(default_factory=set)  # token keys with some differing row (input, output or op)
    absorbed: dict = field(default_factory=dict)  # (label, kind, op a, op b) -> set of token keys
    ops_compared: int = 0  # calls whose own ops were compared row by row

    def module_counts(self) -> dict:
        """Per module label, the tokens whose output rows differ there."""
        return {label: sum(row.values()) for label, (_, row) in self.module_rows.items() if any(row.values())}


def compare_rows(sa: TraceTokens, sb: TraceTokens, va: int, vb: int, ra: int, rb: int, cells_a, cells_b, skip=None):
    """(tokens whose rows differ, valid mask) for one value pair, or None when the values have no comparable rows.
    `skip`: tokens that branch on either side, whose per-continuation rows are compared as final values only."""
    xa = sa.rows_at(va, ra, cells_a, skip)
    xb = sb.rows_at(vb, rb, cells_b, skip)
    if xa is None or xb is None or tuple(xa[1]) != tuple(xb[1]):
        return None
    valid = xa[3] & xb[3]
    neq = (xa[2] != xb[2]) if xa[0] == xb[0] else np.ones(len(valid), dtype=bool)
    neq &= valid
    return neq, valid


def sweep(sa: TraceTokens, sb: TraceTokens, groups: dict, views: TokenViews, tol=None) -> Sweep:
    out = Sweep()
    # Buffers allocated without being written (vLLM allocates each linear's output so, then a kernel fills it): their
    # bytes are whatever the allocator gave, nothing to compare
    undef_a, undef_b = uninitialized_values(sa.trace), uninitialized_values(sb.trace)
    for (ra, rb), toks in groups.items():
        va, vb, pairing = views.pair(ra, toks[0][1], rb, toks[0][2])
        cmp = TokenComparator(va, vb, tol)
        keys = [k for k, _, _ in toks]
        cells_a = np.array([c for _, c, _ in toks], dtype=np.int64)
        cells_b = np.array([c for _, _, c in toks], dtype=np.int64)
        n = len(toks)
        branch = sa.branching | sb.branching
        skip = np.array([k in branch for k in keys], dtype=bool) if branch else None
        order = sa.order(ra)
        pairs = [(ca, cb) for ca in sorted(va.calls.values(), key=lambda c: c.enter_index)
                 if (cb := pairing.partner(ca)) is not None]
        status = {}  # call id of a -> (output differs, output compared) masks
        any_bad = np.zeros(n, dtype=bool)

        def rows(items_a, items_b):
            bad, seen = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
            for _, xa, xb in cmp.pairs(items_a, items_b):
                got = compare_rows(sa, sb, xa, xb, ra, rb, cells_a, cells_b, skip)
                if got is not None:
                    bad |= got[0]
                    seen |= got[1]
                    out.compared += int(got[1].sum())
            return bad, seen

        for ca, cb in pairs:
            out_bad, out_seen = rows(ca.outputs, cb.outputs)
            in_bad, _ = rows(ca.inputs, cb.inputs)
            status[ca.call_id] = (out_bad, out_seen)
            any_bad |= out_bad | in_bad
            label = ca.module + (f" #{ca.call}" if ca.call else "")
            equal_out = out_seen & ~out_bad
            if out_seen.any():
                rank, row = out.module_rows.setdefault(label, (order.get((ca.module, ca.call), 0), {}))
                for k, d, s in zip(keys, out_bad, out_seen):
                    if s:
                        row[k] = row.get(k, False) or bool(d)
                exit_at = ca.exit_index if ca.exit_index is not None else ca.enter_index
                for i in np.nonzero(out_bad)[0]:
                    k = keys[i]
                    got = out.first_module.get(k)
                    if got is None or exit_at < got[0]:
                        out.first_module[k] = (exit_at, label)
            _absorb(out, (label, "inputs", None, None), in_bad & equal_out, keys)
            if ca.parent is not None and ca.parent in status:
                p_bad, p_seen = status[ca.parent]
                _absorb(out, (label, "module", None, None), out_bad & p_seen & ~p_bad, keys)
                if p_seen.any() and va.calls[ca.parent].parent is None:  # a root whose output holds no row of
                    # these tokens (logits_to_keep: a prompt's rows): their difference reaches no output either
                    _absorb(out, (label, "unkept", None, None), out_bad & ~p_seen, keys)
            if _same_ops(va, vb, ca, cb):
                out.ops_compared += 1
                seen_op = np.zeros(n, dtype=bool)  # the first differing op of the call, per token, is the one listed
                for ia, ib in zip(ca.ops, cb.ops):
                    oa, ob = va.rout[ia], vb.rout[ib]
                    if len(oa) != len(ob):
                        continue
                    op_bad = np.zeros(n, dtype=bool)
                    for xa, xb in zip(oa, ob):
                        if xa in undef_a and xb in undef_b:
                            continue
                        got = compare_rows(sa, sb, xa, xb, ra, rb, cells_a, cells_b, skip)
                        if got is not None:
                            op_bad |= got[0]
                            out.compared += int(got[1].sum())
                    any_bad |= op_bad
                    _absorb(out, (label, "op", va.rop[ia], vb.rop[ib]), op_bad & equal_out & ~seen_op, keys)
                    seen_op |= op_bad
        out.any_differs.update(k for k, d in zip(keys, any_bad) if d)
    return out


def _absorb(out: Sweep, entry: tuple, mask, keys) -> None:
    if mask.any():
        out.absorbed.setdefault(entry, set()).update(keys[i] for i in np.nonzero(mask)[0])


def _same_ops(va, vb, ca, cb) -> bool:
    return len(ca.ops) == len(cb.ops) and [va.rop[i] for i in ca.ops] == [vb.rop[i] for i in cb.ops]
