"""hash_and_partial: a block's own fingerprint and statistics and its partial of the global value from one read (the
C kernel's fingerprint2_pair) equal the two separate kernels (fingerprint2_summary, fingerprint2), the torch ops
and the plain-Python spec, on every kernel this CPU runs."""
from __future__ import annotations

import pytest
import torch

from divtrace.trace.hashing import spec, tensor as T
from fp2_cases import boxes, chunk_sizes, take, torch_path, values
from native_kernels import kernel  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(T._native is None or not T._PAIR, reason="divtrace._native not built")


def _separate(x, gshape, offsets):
    h, st = T.hash_with_stats(x)
    return h, st, T.partial_hex(x, gshape, offsets)


def _check(x, gshape, offsets, reference: bool):
    got = T.hash_and_partial(x, gshape, offsets)
    assert got == _separate(x, gshape, offsets)
    assert T.hash_and_partial(x, gshape, offsets, stats=False) == (got[0], None, got[2])
    with torch_path():  # (no C kernel: the two the torch way)
        h, st, p = T.hash_and_partial(x, gshape, offsets)
    assert (h, p) == (got[0], got[2])
    if st and got[1]:  # (the torch ops' mean sums in another order)
        assert st.pop("mean") == pytest.approx(got[1]["mean"], rel=1e-5, abs=1e-6)
        assert st == {k: v for k, v in got[1].items() if k != "mean"}
    if reference:
        assert got[0] == spec.to_hex(*spec.tensor_partial(x))
        assert got[2] == spec.to_hex(*spec.tensor_partial(x, gshape, offsets))
    return got


# (global shape, cuts: (dim, pieces) per mesh dim, how each block is viewed)
VIEWS = {
    "contiguous": lambda b: b.contiguous(),
    "in place": lambda b: b,  # a slice of the global tensor: strided where the cut is not along dim 0
    "transposed": lambda b: b.contiguous().t().contiguous().t() if b.dim() == 2 else b.transpose(0, -1).contiguous()
    .transpose(0, -1),  # the same values, column-major in memory
}
CASES = [
    ((6, 37), [(1, 3)]),  # uneven chunks of the last dim, rows of odd length
    ((6, 37), [(0, 4)]),
    ((5, 7, 9), [(2, 2)]),
    ((5, 7, 9), [(1, 3), (2, 2)]),  # a 2-D mesh's block
    ((4099,), [(0, 3)]),  # 1-D, uneven, crossing a block of 1024 lanes
    ((3, 1, 4100), [(2, 2)]),  # a dim of size 1
    ((2, 5), [(1, 8)]),  # more pieces than columns: empty blocks
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8,
                                   torch.uint8, torch.int64, torch.bool])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("view", sorted(VIEWS))
def test_pair_equals_the_two_kernels_and_the_spec(kernel, dtype, case, view):
    gshape, cuts = CASES[case]
    g = values(dtype, gshape, seed=case)
    blocks = boxes(gshape, [(d, chunk_sizes(gshape[d], k)) for d, k in cuts])
    parts = []
    for off, loc in blocks:
        x = VIEWS[view](take(g, off, loc))
        assert tuple(x.shape) == tuple(loc)
        got = _check(x, gshape, off, reference=x.numel() < 3000)
        parts.append(got[2])
        if x.numel() == 0:
            assert got[0] == got[2] == "0" * 32
    assert T.combine_hex(parts) == T.tensor_hash(g)  # (the blocks tile the value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pair_of_a_big_strided_block_and_non_finite_values(kernel, dtype):
    """Blocks past the kernel's 64 KiB staging and 16 KiB pieces, read in place through strides; NaN and infinity
    (the exact statistics' second pass must not add to the sums again)."""
    g = values(dtype, (96, 1000), seed=5)
    g[3, 7], g[50, 900], g[95, 999] = float("nan"), float("inf"), -float("inf")
    for off, loc in boxes(g.shape, [(1, [333, 667])]):
        x = take(g, off, loc)
        got = _check(x, g.shape, off, reference=False)
        assert got[1]["nan"] + got[1]["inf"] >= 1
        assert _check(x.t(), (1000, 96), off[::-1], reference=False)[2] != got[2]  # (the same bytes elsewhere)
    x = take(g, (8, 0), (40, 1000))[:, ::3]  # a step: each element its own run
    gx = g[:, ::3]
    _check(x, gx.shape, (8, 0), reference=False)
    h, st, p = T.hash_and_partial(x, gx.shape, (8, 0))
    assert p == T.partial_hex(gx[8:48].contiguous(), gx.shape, (8, 0))


def test_a_block_that_does_not_fit_raises_as_the_partial_does():
    x = values(torch.float32, (4, 5))
    for gshape, off in (((4, 8), (0, 4)), ((4,), (0,)), ((4, 5, 1), (0, 0, 0))):
        with pytest.raises(Exception) as want:
            T.tensor_partial(x, gshape, off)
        with pytest.raises(type(want.value)):
            T.hash_and_partial(x, gshape, off)


def test_whole_value_pair():
    x = values(torch.bfloat16, (3, 333), seed=2)
    h, st, p = T.hash_and_partial(x, None, None)
    assert (h, st) == T.hash_with_stats(x) and p == h
