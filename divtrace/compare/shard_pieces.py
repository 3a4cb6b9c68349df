"""A value that both runs hold only as their ranks' pieces, laid out the same way, told apart rank by rank.

A partial sum before its reduction (a row-parallel Linear's local matmul) and the ranks' own pieces of a value no
layout puts together are keyed by every rank's piece (divtrace.align.shards.keys.RankLocal), and compared piece by
piece. Where such a pair differs, some ranks' pieces differ and the others may not: the run view's bytes of the
value are its representative rank's (rank 0's) piece, so a count taken from them says "0 mismatched" when rank 1's
partial is the one that differs. Here each piece is compared with the other side's piece in the same place (the
same position in the mesh or group), so the count is that piece's own, and the ranks are named.

Where only one side holds partial sums (TP=2 against one process), there is no per-rank counterpart: the reduced sum
is what was compared, and that is all that is said (`one_sided`).

In: two traces or run views (divtrace.align.shards.view.RunView) and a pair of value ids. Out: the differing pieces
(`differing`), the pair's TensorDiff (`pair_diff`), and `first.shards`' `partials`, `partial` and `metrics_of`
(`describe`).
"""
from __future__ import annotations

from math import prod

from divtrace.align.shards.keys import RankLocal

_KIND = {"partial": "partial sum", "local": "piece"}


def plan_of_value(t, vid):
    """The unshard plan of value `vid` of `t` (a run view), or None (a one-process trace, a token view's rows)."""
    plan_of = getattr(t, "plan_of", None)
    if plan_of is None or vid is None:
        return None
    try:
        return plan_of(vid)[2]
    except KeyError:
        return None


def differing(ta, tb, va, vb) -> list | None:
    """(rank on a, (its trace, vid), rank on b, (its trace, vid)) of each piece of the pair whose key differs from
    the other side's in the same place; None where (va, vb) is not two run values held as pieces of one kind laid out
    the same way (the only such pairs that are compared: keys.uncompared)."""
    pa, pb = plan_of_value(ta, va), plan_of_value(tb, vb)  # (None for a one-process trace, and for a token view's rows)
    if pa is None or pb is None or pa.pieces is None or pb.pieces is None:
        return None
    ka, kb = ta.vkey[va], tb.vkey[vb]
    if type(ka) is not RankLocal or type(kb) is not RankLocal or ka.layout() is None or ka.layout() != kb.layout():
        return None
    if not len(pa.pieces) == len(pb.pieces) == len(ka.pieces()) == len(kb.pieces()):
        return None
    out = []
    for (ra, qa), (rb, qb), xa, xb in zip(pa.pieces, pb.pieces, ka.pieces(), kb.pieces()):
        if xa != xb:
            out.append((ra, (ta.run.traces[ra], qa), rb, (tb.run.traces[rb], qb)))
    return out


def kind_of(ta, va) -> str:
    """"partial sum" or "piece": what each rank holds of run value `va` (a key that holds pieces)."""
    return _KIND.get(ta.vkey[va][2][0], "piece")


def _bytes(piece) -> bool:
    t, q = piece
    return t.has_bytes(q)


def piece_diffs(pieces: list, tol=None) -> list | None:
    """A TensorDiff per differing piece (from `differing`), or None where a side holds no bytes for one (hash mode)."""
    if not all(_bytes(a) and _bytes(b) for _, a, _, b in pieces):
        return None
    from divtrace.compare.metrics import compare_tensors

    return [compare_tensors(a[0].tensor(a[1]), b[0].tensor(b[1]), tol) for _, a, _, b in pieces]


def pair_diff(ta, tb, va, vb, tol=None):
    """(True, TensorDiff or None) for a pair held as pieces on both sides with some piece differing: the first
    differing piece's metrics (None without bytes), within the tolerance only where every differing piece is;
    (False, None) for any other pair (the caller compares the values as it does any other). A token view (token
    alignment) compares such a value whole, as its trace does (a partial sum has no token rows): its trace's pieces
    are then the ones compared."""
    ba, bb = getattr(ta, "trace", ta), getattr(tb, "trace", tb)
    pieces = differing(ba, bb, va, vb)
    if not pieces or (ba is not ta and ta.vkey[va] != ba.vkey[va]) or (bb is not tb and tb.vkey[vb] != bb.vkey[vb]):
        return False, None  # (not pieces; or a token's row of the value, not the whole value)
    diffs = piece_diffs(pieces, tol)
    if diffs is None:
        return True, None
    first = diffs[0]
    if first.within_tolerance is not None:
        first.within_tolerance = all(d.matches() for d in diffs)
    return True, first


def describe(ta, tb, d) -> dict:
    """`first.shards`' `partials` (each rank whose piece differs, with its own count where the bytes are stored),
    `partial` (in words) and `metrics_of` (whose elements the top-level metrics count) for a divergence whose value
    both sides hold as pieces; where its value is the reduced sum, the same for the partial sums its parting regions
    made, if both sides made them laid out the same way; where only one side's region made partial sums, `partial`
    alone (the reduced sum is compared, no rank is named); {} otherwise."""
    ta, tb = getattr(ta, "trace", ta), getattr(tb, "trace", tb)  # (a token view's records are its trace's)
    pieces = differing(ta, tb, d.vid_a, d.vid_b)
    if pieces:
        out = _per_rank(ta, tb, d.vid_a, d.vid_b, pieces, "")
        out["metrics_of"] = f"rank {pieces[0][0]}'s {kind_of(ta, d.vid_a)}"
        return out
    pa, pb = _region_partial(ta, d.region_a), _region_partial(tb, d.region_b)
    if pa is not None and pb is not None:
        # The walker compared the reduced sum (the regions differ: a weight block one side's op read as a fresh
        # value); the partial sums before it still pair, rank by rank, and say which rank's differs.
        pieces = differing(ta, tb, pa, pb)
        if not pieces:
            return {}
        i = ta.vprod.get(pa)
        return _per_rank(ta, tb, pa, pb, pieces, f" (the output of {ta.rop[i]}, record {i} on a)")
    return one_sided(ta, tb, d, pa, pb)


def _per_rank(ta, tb, va, vb, pieces: list, where: str) -> dict:
    kind = kind_of(ta, va)
    diffs = piece_diffs(pieces)
    entries, words = [], []
    for i, (ra, a, rb, _) in enumerate(pieces):
        diff = diffs[i] if diffs is not None else None
        numel = prod(a[0].vkey[a[1]][1])
        whose = f"rank {ra}'s {kind}" + (f" (rank {rb}'s on b)" if rb != ra else "") + where
        entry = {"rank_a": ra, "rank_b": rb, "kind": kind, "index_a": ta.vprod.get(va), "index_b": tb.vprod.get(vb)}
        if diff is None:
            entry.update(compared="hash", mismatched=None, numel=numel, first_index=None)
            words.append(f"{whose} differs (hash mode: which elements is not stored)")
        else:
            entry.update(compared="bytes", mismatched=diff.mismatched, numel=numel, first_index=diff.first_index)
            words.append(f"{whose}: {diff.mismatched} of {numel} elements mismatched")
        entries.append(entry)
    return {"partials": entries, "partial": "; ".join(words)}


def _region_partial(t, region) -> int | None:
    """The first value an op of `region` made that is a run's partial sum (laid out `P`, its ranks' pieces known)."""
    for i, _ in region:
        for v in (t.rout[i] or ()) if i < len(t.rout) else ():
            vp = plan_of_value(t, v)
            if (vp is not None and vp.layout is not None and vp.layout[0] and vp.layout[0][0].startswith("P")
                    and vp.pieces is not None):
                return v
    return None


def one_sided(ta, tb, d, pa, pb) -> dict:
    """Where one side's parting region made partial sums (`pa` or `pb`) and the other's made none (TP=2 against one
    process): what is proven is that the reduced sums differ; no rank's partial has a counterpart to compare with."""
    if (pa is None) == (pb is None):
        return {}
    side, other, t, v = ("a", "b", ta, pa) if pa is not None else ("b", "a", tb, pb)
    n = len(plan_of_value(t, v).pieces)
    return {"partial": f"partial sums of {n} ranks on {side}, none on {other}: the reduced sum ({d.tensor}) is "
                       f"compared, not a rank's partial, so no rank is named and no per-rank count is given"}
