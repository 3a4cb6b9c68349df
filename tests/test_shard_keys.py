"""Which pairs of run-view keys are compared (divtrace.align.shards.keys): a key holding pieces (a partial sum, a
rank's own pieces) is compared only with a key of the same kind laid out the same way; a key that only names a
place (a missing block, a value past a stop or a parting, blocks that do not tile, a value a missing rank may hold
the rest of) is compared with nothing, and equal to nothing but itself. Keys built here by hand, as plan.py builds
them."""
from __future__ import annotations

from divtrace.align.shards.keys import RankLocal, uncompared

F32 = "float32"
SHAPE = (2, 8, 64)
WHOLE = (F32, SHAPE, "a" * 32)
OTHER = (F32, SHAPE, "b" * 32)


def piece(h, shape=SHAPE, dtype=F32):
    return (dtype, shape, h * 32)


def partial(*pieces, placements=("P",)):
    return RankLocal((F32, SHAPE, ("partial", placements) + pieces))


def local(*pieces):
    return RankLocal((F32, pieces[0][1], ("local",) + pieces))


PLACES = [RankLocal((F32, SHAPE, ("missing", 1, 7))), RankLocal((F32, SHAPE, ("unaligned", 0, 7))),
          RankLocal((F32, SHAPE, ("untiled", 7))), RankLocal((F32, SHAPE, ("unrouted", 7))),
          RankLocal((F32, SHAPE, ("unverified", 0, 7)))]


def test_a_place_is_compared_with_nothing_and_equals_only_itself():
    held = [WHOLE, partial(piece("a"), piece("b")), local(piece("a", (2, 8, 32)), piece("b", (2, 8, 32)))]
    for k in PLACES:
        copy = RankLocal(tuple(k))  # the same value id in another run: no evidence of equal values
        assert k == k and k != copy and not (k == copy)
        assert uncompared(k, copy) and uncompared(copy, k)
        for other in held + [p for p in PLACES if p is not k]:
            assert uncompared(k, other) and uncompared(other, k), (k, other)
            assert k != other and other != k


def test_a_missing_block_against_a_partial_sum_is_not_compared():
    """The pair that made a stopped TP=2 run "diverged" at its embedding against a complete one."""
    assert uncompared(RankLocal((F32, SHAPE, ("missing", 1, 3))), partial(piece("a"), piece("b")))
    assert uncompared(RankLocal((F32, SHAPE, ("unverified", 0, 3))), local(piece("a"), piece("b")))


def test_pieces_laid_out_the_same_way_are_compared_piece_by_piece():
    a = partial(piece("a"), piece("b"))
    assert not uncompared(a, partial(piece("a"), piece("b"))) and a == partial(piece("a"), piece("b"))
    differs = partial(piece("a"), piece("c"))  # rank 1's partial sum differs: a difference
    assert not uncompared(a, differs) and a != differs
    half = (2, 8, 32)
    la = local(piece("a", half), piece("b", half))
    assert not uncompared(la, local(piece("a", half), piece("c", half)))
    assert la != local(piece("a", half), piece("c", half)) and la == local(piece("a", half), piece("b", half))
    assert not uncompared(la, local(piece("a", half, "bfloat16"), piece("b", half)))  # another dtype: a difference


def test_pieces_laid_out_otherwise_are_not_compared():
    a = partial(piece("a"), piece("b"))
    assert uncompared(a, partial(piece("a"), piece("b"), piece("c"), piece("d")))  # 2 ranks against 4
    assert uncompared(a, partial(piece("a"), piece("b"), placements=("R", "P")))
    assert uncompared(a, local(piece("a"), piece("b")))  # a partial sum against a rank's own pieces
    assert uncompared(local(piece("a", (2, 8, 32)), piece("b", (2, 8, 32))),
                      local(piece("a", (2, 8, 16)), piece("b", (2, 8, 16))))
    unknown = local(piece("a"), None)  # no counterpart on rank 1: its piece unseen
    assert uncompared(unknown, local(piece("a"), None)) and uncompared(unknown, local(piece("a"), piece("b")))
    assert unknown != local(piece("a"), None)


def test_a_global_value_against_a_rank_local_key_is_not_compared_and_two_global_values_are():
    assert not uncompared(WHOLE, OTHER) and not uncompared(WHOLE, WHOLE)
    for k in PLACES + [partial(piece("a"), piece("b"))]:
        assert uncompared(WHOLE, k) and uncompared(k, WHOLE)
