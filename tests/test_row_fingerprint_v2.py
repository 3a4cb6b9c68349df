"""Scheme row-gsum64-v2 (divtrace.trace.hashing.rows): the C kernel, the torch ops and the plain-Python spec agree;
the partials of a row's column blocks (a shard of any row dim) sum to the row's fingerprint; rows read in place
for every token layout equal the copied rows'; sign flips, -0.0, NaN payloads and every single bit are seen."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from divtrace.trace.hashing import rows as RW, spec
from divtrace.trace import token_layout as layout
from divtrace.record import rowhash
from fp2_cases import DTYPES, all_paths, boxes, chunk_sizes, take, unsigned, values
from native_kernels import kernel  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(RW._native is None, reason="divtrace._native not built (no C compiler at install)")


def _all_paths(rows, row_shape=None, row_offsets=None) -> list[list[int]]:
    return all_paths(RW.row_fingerprints, rows, row_shape, row_offsets)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row", [(1,), (3,), (7,), (64,), (1029,), (3, 5), (2, 3, 700)])
def test_c_torch_and_spec_agree(kernel, dtype, row):
    x = values(dtype, (5, *row), seed=len(row))
    c, t_mm, t_acc = _all_paths(x)
    assert c == t_mm == t_acc
    if x.numel() <= 8000:
        assert c == spec.row_partials(x)
    assert c == unsigned(RW.row_fingerprints(x.transpose(0, -1).contiguous().transpose(0, -1)))  # strided rows


def _check_row_tiling(g: torch.Tensor, tiles):
    """g: [R, *row]; tiles: boxes of the row dims."""
    row_shape = tuple(g.shape[1:])
    full = unsigned(RW.row_fingerprints(g))
    sums = {"c": [0] * g.shape[0], "torch": [0] * g.shape[0], "accel": [0] * g.shape[0]}
    for off, loc in tiles:
        x = take(g, (0, *off), (g.shape[0], *loc))
        c, t_mm, t_acc = _all_paths(x, row_shape, off)
        assert c == t_mm == t_acc, (off, loc)
        if x[:2].numel() <= 64:
            assert c[:2] == spec.row_partials(x[:2], row_shape, off)
        for k, v in zip(sums, (c, t_mm, t_acc)):
            sums[k] = [(a + b) & spec.MASK for a, b in zip(sums[k], v)]
    assert sums["c"] == sums["torch"] == sums["accel"] == full


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.bool])
@pytest.mark.parametrize("row,dim,k", [((4096,), 0, 2), ((1031,), 0, 3), ((8, 130), 0, 3), ((8, 130), 1, 2),
                                       ((3, 4, 257), 2, 3)])
def test_column_blocks_sum_to_the_row_fingerprint(kernel, dtype, row, dim, k):
    g = values(dtype, (4, *row), seed=k)
    _check_row_tiling(g, boxes(row, [(dim, chunk_sizes(row[dim], k))]))


@st.composite
def _row_case(draw):
    nd = draw(st.integers(1, 3))
    row = tuple(draw(st.lists(st.integers(1, 9), min_size=nd, max_size=nd)))
    if draw(st.booleans()):
        row = row[:-1] + (draw(st.integers(1000, 2100)),)
    dtype = draw(st.sampled_from(DTYPES))
    plan = []
    for d in draw(st.lists(st.integers(0, nd - 1), min_size=1, max_size=2, unique=True)):
        points = sorted(draw(st.lists(st.integers(0, row[d]), max_size=3)))
        edges = [0, *points, row[d]]
        plan.append((d, [b - a for a, b in zip(edges, edges[1:])]))
    return dtype, row, plan, draw(st.integers(1, 4)), draw(st.integers(0, 2**16))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_row_case())
def test_property_any_column_tiling_sums_to_the_row_fingerprints(case):
    dtype, row, plan, r, seed = case
    _check_row_tiling(values(dtype, (r, *row), seed), boxes(row, plan))


def test_rows_split_over_ranks_are_the_rows_own_fingerprints():
    g = values(torch.bfloat16, (10, 33), seed=3)
    full = RW.row_fingerprints(g)
    assert torch.equal(torch.cat([RW.row_fingerprints(g[a:b]) for a, b in ((0, 4), (4, 7), (7, 10))]), full)


@pytest.mark.parametrize("code,shape", [("bt", (2, 5, 3, 8)), ("bht", (2, 3, 5, 8)), ("n", (10, 3, 8)),
                                        ("last2", (2, 2, 24))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_rows_read_in_place_for_every_layout(code, shape, dtype):
    x = values(dtype, shape, seed=1)
    if code == "bht":
        x = x.transpose(1, 2).contiguous().transpose(1, 2)  # heads-first view of a [B, T, H, d] buffer
    rows = layout.row_count(code, [shape[0], shape[2] if code == "bht" else shape[1]]) if code != "n" else shape[0]
    got = RW.strided_row_fingerprints(x, code, rows)
    assert got is not None
    assert got == RW.rows_bytes(RW.row_fingerprints(layout.rows_2d(x, code)))
    # a block of each row's first dim, read in place (rows at a stride), against the same block copied
    dims = RW.row_dims(x.shape, code)
    first = {"n": 1, "bht": 1}.get(code, 2)
    n = x.shape[first]
    block = x.narrow(first, 1, n - 2)
    off = (1,) + (0,) * (len(dims) - 1)
    got = RW.strided_row_fingerprints(block, code, rows, dims, off)
    copied = layout.rows_2d(block.contiguous(), code).reshape(rows, n - 2, *dims[1:])
    assert got is not None and got == RW.rows_bytes(RW.row_fingerprints(copied, dims, off))
    if len(dims) > 1:  # a block of an inner row dim leaves gaps in each row: not read in place (the caller copies)
        assert RW.strided_row_fingerprints(x[..., 1:3], code, rows, dims, (0,) * (len(dims) - 1) + (1,)) is None


def test_bytes_forms():
    g = values(torch.float32, (6, 50), seed=2)
    parts = [RW.row_fingerprints(g[:, a:b], (50,), (a,)) for a, b in ((0, 17), (17, 50))]
    assert RW.combine_rows_bytes([RW.rows_bytes(p) for p in parts]) == RW.rows_bytes(RW.row_fingerprints(g))
    assert np.frombuffer(RW.rows_bytes(RW.combine_rows(parts)), "<u8").tolist() == unsigned(RW.row_fingerprints(g))


def test_sign_flips_zero_signs_and_nan_payloads_change_the_row():
    x = values(torch.float32, (4, 64), seed=7)
    y = x.clone()
    y[1] = -y[1]  # a negated row
    y[2, 5], y[2, 9] = -y[2, 5], -y[2, 9]  # two sign flips in one row
    old, new = rowhash.row_hashes(x), rowhash.row_hashes(y)
    # the old scheme (two 32-bit sums of 4-byte lanes) cannot see an even number of sign flips in a row:
    # each adds 2**31 * (odd weight) = 2**31 mod 2**32 to both sums
    assert old[1] == new[1] and old[2] == new[2]
    a, b = RW.row_fingerprints(x).tolist(), RW.row_fingerprints(y).tolist()
    assert a[0] == b[0] and a[3] == b[3] and a[1] != b[1] and a[2] != b[2]
    z = torch.zeros(2, 8, dtype=torch.bfloat16)
    z[1, 3] = -0.0
    f = RW.row_fingerprints(z).tolist()
    assert f[0] != f[1]
    n = torch.full((3, 4), float("nan")).view(torch.int32)
    n[1, 2] += 1
    n[2, 0] = n[2, 0] | (1 << 31)
    assert len(set(RW.row_fingerprints(n.view(torch.float32)).tolist())) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64])
def test_every_single_bit_flip_changes_only_its_row(dtype):
    g = values(dtype, (3, 5), seed=4)
    base = RW.row_fingerprints(g).tolist()
    raw = g.contiguous().view(torch.uint8).reshape(-1)
    per_row = raw.numel() // 3
    for byte in range(raw.numel()):
        for bit in range(8):
            f = raw.clone()
            f[byte] ^= 1 << bit
            got = RW.row_fingerprints(f.view(dtype).reshape(g.shape)).tolist()
            r = byte // per_row
            assert got[r] != base[r] and [v for i, v in enumerate(got) if i != r] == \
                [v for i, v in enumerate(base) if i != r], (byte, bit)
