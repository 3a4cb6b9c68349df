"""The keys a run view gives values that have no global value to compare (divtrace.align.shards).

A value of a run is keyed, like a value of a trace, by (dtype, shape, fingerprint) of its global value. Some
values of a sharded run have none that divtrace can vouch for:
- a rank's own piece whose place in the whole no layout says (head-split tensors of plain tensor-parallel code
  the rules could not follow; rows of data split over ranks);
- a partial sum before its reduction;
- a block whose other blocks are missing (a rank that stopped early, or never ran).

Such a value gets a `RankLocal` key, of one of two sorts (its kind, `key[2][0]`):
- it holds the pieces themselves, each rank's key in mesh or group order: a partial sum (`partial`, after its
  placements) and a rank's own pieces (`local`). Two keys of one such kind laid out the same way on both sides (the
  same placements, as many pieces, each of the same shape) are compared, piece by piece: unequal pieces are a
  difference. Any other pair with one of them is not compared.
- it only names the value by where it is (a rank, a value id): `missing` (a rank of its mesh has no block of it:
  stopped before it, or no trace), `unaligned` (past where the group's ranks part or stop), `untiled`, `unrouted`
  (the blocks do not make the global value), `unverified` (a one-rank group whose partner may be a missing rank).
  Nothing of its bytes is in the key, so it is never compared, with anything, and it equals nothing but itself:
  the same value id in two runs is no evidence that the values are equal.

Comparisons skip a pair that is not compared (neither equal nor different), and a RankLocal value counts as a value
the other side does not have when the walker retraces where two runs part (so the parting region reaches back to
values both have).

`ReplicaMismatch` keys a value whose replicas (ranks that must hold the same bytes) differ: it equals nothing,
so the walker reports it where it first appears.
"""
from __future__ import annotations


# Kinds whose key holds the ranks' pieces -> where the pieces start in key[2] (before them: the layout, after the kind)
_PIECES = {"partial": 2, "local": 1}


class RankLocal(tuple):
    """(dtype, local shape, (kind, [layout], per-rank keys...) or (kind, where...)): see the module docstring. A key
    that holds pieces is equal only to an equal RankLocal; one that names a place (or holds a piece it does not know),
    only to itself: equal keys are always a pair `uncompared` lets through."""

    __slots__ = ()

    def __eq__(self, other):
        if self is other:
            return True
        return type(other) is RankLocal and self.layout() is not None and tuple.__eq__(self, other)

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return tuple.__hash__(self) ^ 0x5A4D

    @property
    def kind(self) -> str:
        return self[2][0]

    def layout(self) -> tuple | None:
        """(kind, its layout, each piece's shape) of a key that holds pieces; None for one that names a place, or
        where a rank's piece is unknown (no counterpart on that rank)."""
        start = _PIECES.get(self[2][0])
        if start is None:
            return None
        pieces = self[2][start:]
        if any(p is None for p in pieces):
            return None
        return self[2][:start], tuple(tuple(p[1]) for p in pieces)

    def pieces(self) -> tuple:
        """Each rank's key of a key that holds pieces, in mesh or group order (as the run's plan lists the ranks);
        () for one that names a place."""
        start = _PIECES.get(self[2][0])
        return () if start is None else tuple(self[2][start:])


class ReplicaMismatch(tuple):
    """(dtype, shape, description): a value whose replicas disagree; equal to nothing."""

    __slots__ = ()

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    def __hash__(self):
        return id(self)

    @property
    def note(self) -> str:
        return self[2]


def uncompared(ka, kb) -> bool:
    """Whether a pair of keys is left out of a comparison: a side has no global value to compare, and the pair is not
    two keys holding the same kind of pieces laid out the same way (module docstring). A missing block, a value
    past a stop or a parting, on either side, is never compared."""
    la, lb = type(ka) is RankLocal, type(kb) is RankLocal
    if not (la or lb):
        return False
    if la != lb:
        return True
    layout = ka.layout()
    return layout is None or layout != kb.layout()
