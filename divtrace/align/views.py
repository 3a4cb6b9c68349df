"""Two token views of one pair of root calls made ready to walk: the path map applied, calls paired, and the
calls that have no partner folded into their nearest paired ancestor (an engine's extra submodules, a module one
side writes inline), once per pair of root calls.

In: the two traces' tokens (tokens.py), a path map (paths.py). Out: `TokenViews.pair(...)`: (view a, view b,
pairing) for one token, sharing the folded call tree of its root calls.
"""
from __future__ import annotations

from divtrace.align.calls import Pairing, fold_unpaired
from divtrace.align.tokens import TokenView, TraceTokens


class TokenViews:
    """Folded, paired token views per pair of root calls (cached), and what the folding did."""

    def __init__(self, sa: TraceTokens, sb: TraceTokens, path_map=None):
        self.sa, self.sb, self.path_map = sa, sb, path_map
        self._groups: dict = {}  # (root a, root b) -> (pairing, folded calls a, folded calls b, folded a/b)

    def pair(self, ra: int, ca: int, rb: int, cb: int):
        va, vb = TokenView(self.sa, ra, ca), TokenView(self.sb, rb, cb)
        got = self._groups.get((ra, rb))
        if got is None:
            pairing = Pairing(va, vb, self.path_map)
            paired_a = {cid for cid, c in va.calls.items() if pairing.partner(c) is not None}
            paired_b = {pairing.partner(va.calls[cid]).call_id for cid in paired_a}
            fa, na = fold_unpaired(va.calls, paired_a, getattr(va, "hidden_calls", ()))
            fb, nb = fold_unpaired(vb.calls, paired_b, getattr(vb, "hidden_calls", ()))
            gaps = _broken_pairs(va.calls, vb.calls, paired_a, paired_b)
            got = self._groups[(ra, rb)] = (pairing, fa, fb, (na, nb), gaps)
        pairing, fa, fb, _, _ = got
        va.calls, vb.calls = fa, fb
        return va, vb, pairing

    def folded(self) -> tuple[int, int]:
        """Calls folded into their parents, per side, summed over the pairs of root calls walked or swept."""
        return (sum(g[3][0] for g in self._groups.values()), sum(g[3][1] for g in self._groups.values()))

    def unpaired_gaps(self) -> list[str]:
        """Module calls that one side's path and call number would pair, left unpaired (a --map that renames one
        side's modules away): nothing compares their tensors, so they are a coverage gap."""
        out = []
        for g in self._groups.values():
            out += [x for x in g[4] if x not in out]
        return out


def _broken_pairs(calls_a: dict, calls_b: dict, paired_a: set, paired_b: set) -> list[str]:
    """Unpaired calls of a whose own (unmapped) path and call number an unpaired call of b has too."""
    free_b = {(c.module, c.call) for cid, c in calls_b.items() if cid not in paired_b}
    return [f"{c.module or '<root>'} call {c.call}" for cid, c in calls_a.items()
            if cid not in paired_a and (c.module, c.call) in free_b and c.module != "<final>"]
