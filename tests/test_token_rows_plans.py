"""TokenRows keeps, per (layout code, shape, stride, dtype) of a root call, where a value's token rows lie and how
many there are, and reads copied rows (heads-first blocks) straight to rows.bin's bytes: the bytes must be what the
unkept path (hashing.rows.strided_row_fingerprints, and row_fingerprints of the copy) gives, for every layout and
view, with kept answers met again by other values of the same layout and by values of another stride."""
from __future__ import annotations

import pytest
import torch

from divtrace.record.token_identity import TokenGrid
from divtrace.record.token_rows import TokenRows, _copied_rows
from divtrace.trace import token_layout as layout
from divtrace.trace.hashing import rows as RW

pytestmark = pytest.mark.skipif(RW._native is None, reason="divtrace._native not built (no C compiler at install)")


def _grid(b: int, t: int) -> TokenGrid:
    n = b * t
    return TokenGrid(1, 0, [b, t], list(range(1, n + 1)), [i % t for i in range(n)], list(range(n)),
                     [-1] * n, [i // t for i in range(n)], kv_len=t, source="declared")


def _views(seed: int):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(2, 5, 24, generator=g)
    yield "bt", base
    yield "bt", base[..., 8:16]  # a column block (QKV split): in place
    yield "bt", base[:, 1:4].contiguous()
    yield "bt", base[:, :, ::2]  # strided inside a row: not in place
    yield "bt", base.transpose(0, 1).contiguous().transpose(0, 1)  # B and T swapped in memory
    yield "n", base.reshape(10, 24)[:, 4:12]
    yield "n", torch.randn(1, 7, generator=g).expand(10, 7)  # rows at stride 0
    heads = torch.randn(2, 3, 5, 4, generator=g)  # [B, H, T, d]: copied
    yield "bht", heads
    yield "bht", heads.transpose(1, 2).contiguous().transpose(1, 2)  # [B, T, H, d] in memory: in place
    yield "1t", torch.randn(1, 5, 6, generator=g)
    for dt in (torch.bfloat16, torch.float16, torch.int8, torch.bool, torch.float64):
        yield "bt", torch.randn(2, 5, 7, generator=g).to(dt)[..., 1:6]  # odd and even row byte counts
    yield "bt", torch.randn(2, 5, 0)  # rows of no bytes


def _want(x, code, grid) -> bytes:
    got = RW.strided_row_fingerprints(x, code, layout.row_count(code, grid.shape))
    return got if got is not None else RW.rows_bytes(RW.row_fingerprints(layout.rows_2d(x, code)))


def test_kept_row_layouts_give_the_unkept_bytes():
    grid = _grid(2, 5)
    tr = TokenRows(True, None, [], [])
    tr._layout_grid = grid
    for seed in range(3):  # the second and third rounds meet every kept answer again, with other values
        for code, x in _views(seed):
            got = tr._in_place(x, code, grid)
            if got is None:
                got = _copied_rows(layout.rows_2d(x, code))
            assert got == _want(x, code, grid), (code, x.shape, x.stride(), x.dtype)
    assert tr._plans  # (kept: the rounds above read them back)


def test_a_kept_layout_follows_the_values_bytes():
    grid = _grid(2, 5)
    tr = TokenRows(True, None, [], [])
    x = torch.randn(2, 5, 8)
    before = tr._in_place(x, "bt", grid)
    x[1, 3, 5] += 1.0  # cell (1, 3) is row 8
    after = tr._in_place(x, "bt", grid)
    changed = [i for i in range(10) if before[8 * i:8 * i + 8] != after[8 * i:8 * i + 8]]
    assert changed == [8]
    assert after == _want(x, "bt", grid)


def test_copied_rows_of_non_contiguous_or_empty_blocks_take_the_torch_path():
    for x in (torch.randn(6, 4)[:, ::2], torch.randn(0, 4), torch.randn(3, 0), torch.randn(6, 8).t()):
        assert _copied_rows(x) == RW.rows_bytes(RW.row_fingerprints(x))
