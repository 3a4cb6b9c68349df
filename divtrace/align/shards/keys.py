"""The keys a run view gives values that have no global value to compare (divtrace.align.shards).

A value of a run is keyed, like a value of a trace, by (dtype, shape, fingerprint) of its global value. Some
values of a sharded run have none that divtrace can vouch for:
- a rank's own piece whose place in the whole no layout says (head-split tensors of plain tensor-parallel code
  the rules could not follow; rows of data split over ranks);
- a partial sum before its reduction;
- a block whose other blocks are missing (a rank that stopped early, or never ran).

Such a value gets a `RankLocal` key: comparisons skip it unless the other side holds an equal `RankLocal` key
(the same layout on both sides, piece for piece), and it counts as a value the other side does not have when the
walker retraces where two runs part (so the parting region reaches back to values both have).

`ReplicaMismatch` keys a value whose replicas (ranks that must hold the same bytes) differ: it equals nothing,
so the walker reports it where it first appears.
"""
from __future__ import annotations


class RankLocal(tuple):
    """(dtype, local shape, (kind, per-rank keys...)): see the module docstring. Equal only to an equal
    RankLocal."""

    __slots__ = ()

    def __eq__(self, other):
        return type(other) is RankLocal and tuple.__eq__(self, other)

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return tuple.__hash__(self) ^ 0x5A4D

    @property
    def kind(self) -> str:
        return self[2][0]


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
    """Whether a pair of keys is left out of a comparison: one side has no global value to compare."""
    return (type(ka) is RankLocal) != (type(kb) is RankLocal)
