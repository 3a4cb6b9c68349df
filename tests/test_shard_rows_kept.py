"""A rank's token-row partials of a block are kept for the values that reshape it (record/placements.py
`_block_row_bytes` with `kept`): a value whose rows hold the same bytes as an earlier value's (`same_as`, which
TokenRows gives where token_layout.same_rows says so) takes that value's partials only where its rows' bytes lie at the
same global places; the bytes must be what reading it gives (the path without `kept`)."""
from __future__ import annotations

import pytest
import torch

from divtrace.record import placements
from divtrace.record.shard_rules import Lay
from divtrace.trace.hashing import rows as hr

pytestmark = pytest.mark.skipif(hr._native is None, reason="divtrace._native not built")


def _lay(gshape, offsets):
    return Lay(0, (f"S{len(gshape) - 1}",), tuple(gshape), tuple(offsets), "rule")


def _no_read(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("read again")

    monkeypatch.setattr(placements, "_plan_row_bytes", fail)


def test_a_reshape_of_a_block_takes_its_partials(monkeypatch):
    g = torch.Generator().manual_seed(0)
    mm = torch.randn(12, 8, generator=g)  # a matmul's [B*T, N] block: columns 8..15 of 16
    kept: dict = {}
    want_mm = placements._block_row_bytes(mm, _lay((12, 16), (0, 8)), "n")
    assert placements._block_row_bytes(mm, _lay((12, 16), (0, 8)), "n", kept, 5) == want_mm
    view = mm.view(1, 12, 8)  # [B, T, N]
    heads = mm.view(1, 12, 2, 4)  # [B, T, H, d]: heads 2..3 of 4
    want_view = placements._block_row_bytes(view, _lay((1, 12, 16), (0, 0, 8)), "bt")
    want_heads = placements._block_row_bytes(heads, Lay(0, ("S2",), (1, 12, 4, 4), (0, 0, 2, 0), "rule"), "bt")
    assert want_view == want_heads == want_mm  # (the same bytes at the same global places)
    _no_read(monkeypatch)
    assert placements._block_row_bytes(view, _lay((1, 12, 16), (0, 0, 8)), "bt", kept, 6, 5) == want_view
    assert placements._block_row_bytes(heads, Lay(0, ("S2",), (1, 12, 4, 4), (0, 0, 2, 0), "rule"), "bt", kept, 7,
                                       6) == want_heads
    assert set(kept) == {5, 6, 7}
    wider = _lay((1, 12, 24), (0, 0, 8))  # (the same places of a longer row: a row's partial depends on them only)
    assert placements._block_row_bytes(view, wider, "bt", kept, 8, 5) == want_view


def test_other_global_places_are_read():
    g = torch.Generator().manual_seed(1)
    mm = torch.randn(12, 8, generator=g)
    kept: dict = {}
    placements._block_row_bytes(mm, _lay((12, 16), (0, 8)), "n", kept, 5)
    # the same bytes as the first columns (another rank's block), or at other places of a wider row: other partials
    for lay in (_lay((1, 12, 16), (0, 0, 0)), _lay((1, 12, 24), (0, 0, 16))):
        want = placements._block_row_bytes(mm.view(1, 12, 8), lay, "bt")
        assert placements._block_row_bytes(mm.view(1, 12, 8), lay, "bt", kept, 6, 5) == want
        assert want != kept[5][1]
    # an unknown value, or none: read
    x = torch.randn(1, 12, 8, generator=g)
    want = placements._block_row_bytes(x, _lay((1, 12, 16), (0, 0, 8)), "bt")
    assert placements._block_row_bytes(x, _lay((1, 12, 16), (0, 0, 8)), "bt", kept, 9, 42) == want
