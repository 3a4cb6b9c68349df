"""Token rows of a [B, H, T, d] tensor stored heads first, read in place one head at a time
(hashing.rows.heads_row_fingerprints: the C kernel's run stride), must be the rows of its [B, T, H, d] copy as the
recorder took them before (strided_row_fingerprints of the copy, "bt"), whole rows and blocks of the global row:
local heads, a slice of each head's elements, views with gaps, other dtypes. Layouts it does not read are None."""
from __future__ import annotations

import pytest
import torch

from divtrace.trace.hashing import rows as hr

pytestmark = pytest.mark.skipif(not hr._RUN_STRIDE, reason="the C kernel is not built (or has no run stride)")


def _copied(x, row_shape, row_offsets):
    return hr.strided_row_fingerprints(x.transpose(1, 2).contiguous(), "bt", x.shape[0] * x.shape[2], row_shape,
                                       row_offsets)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32])
@pytest.mark.parametrize("b,h,t,d,gh,off", [
    (1, 4, 16, 8, 8, 4),  # the upper half of the heads (rank 1 of 2)
    (1, 4, 16, 8, 8, 0),
    (2, 3, 5, 6, 9, 3),  # batch > 1, a middle block
    (1, 1, 7, 4, 2, 1),
    (2, 4, 1, 8, 4, 0),  # one token: whole rows
])
def test_blocks_of_heads_match_the_copy(dtype, b, h, t, d, gh, off):
    x = (torch.randn(b, h, t, d, generator=_gen(1)) * 100).to(dtype)
    got = hr.heads_row_fingerprints(x, b * t, [gh, d], [off, 0])
    assert got is not None and got == _copied(x, [gh, d], [off, 0])
    whole = hr.heads_row_fingerprints(x, b * t)  # (whole rows: the recorder's TP=1 case)
    assert whole is not None and whole == _copied(x, None, None)


def test_views_with_gaps_and_sliced_heads():
    base = torch.randn(2, 6, 9, 16, generator=_gen(2))
    x = base[:, 1:5, :, :8]  # heads 1..4 of 6, the first half of each head's elements (a slice of the last dim)
    assert hr.heads_row_fingerprints(x, 2 * 9, [6, 8], [1, 0]) == _copied(x, [6, 8], [1, 0])
    y = base[:, 2:4, :, 8:]  # heads cut inside their elements in the global row: runs of half a head
    assert hr.heads_row_fingerprints(y, 2 * 9, [4, 16], [1, 8]) == _copied(y, [4, 16], [1, 8])
    z = base.transpose(0, 0)[:, :, ::2, :]  # every other token: rows at twice the stride
    assert hr.heads_row_fingerprints(z, 2 * 5, [12, 16], [6, 0]) == _copied(z, [12, 16], [6, 0])
    e = torch.randn(1, 1, 7, 4, generator=_gen(3)).expand(1, 3, 7, 4)  # (GQA's repeated heads: stride 0)
    assert hr.heads_row_fingerprints(e, 7, [6, 4], [3, 0]) == _copied(e, [6, 4], [3, 0])
    f = torch.randn(1, 2, 5, 3, 4, generator=_gen(4))  # a head of more than one dim
    assert hr.heads_row_fingerprints(f, 5, [4, 3, 4], [2, 0, 0]) == _copied(f, [4, 3, 4], [2, 0, 0])


def test_layouts_it_does_not_read():
    x = torch.randn(2, 4, 8, 6, generator=_gen(5))
    assert hr.heads_row_fingerprints(x.transpose(2, 3), 2 * 6, [8, 8], [4, 0]) is None  # a head's elements strided
    b_gap = torch.randn(2, 4, 10, 6, generator=_gen(6))[:, :, :8]  # batches not a whole T apart: one call each
    assert hr.heads_row_fingerprints(b_gap, 2 * 8, [8, 6], [0, 0]) == _copied(b_gap, [8, 6], [0, 0])
    assert hr.heads_row_fingerprints(x, 3, [8, 6], [4, 0]) is None  # not B * T rows
    assert hr.heads_row_fingerprints(x[0, 0], 8, [6], [0]) is None  # fewer than 3 dims


def test_block_row_bytes_reads_local_heads_in_place(monkeypatch):
    """placements._block_row_bytes on a [B, H, T, d] block of local heads gives the copy's bytes, with no copy."""
    from divtrace.record import placements
    from divtrace.record.shard_rules import Lay

    x = torch.randn(1, 4, 16, 8, generator=_gen(7))
    lay = Lay(0, ("S1",), (1, 8, 16, 8), (0, 4, 0, 0), "rule")
    want = _copied(x, [8, 8], [4, 0])

    def no_copy(*a, **k):
        raise AssertionError("copied")

    monkeypatch.setattr(torch.Tensor, "contiguous", no_copy)
    assert placements._block_row_bytes(x, lay, "bht") == want
