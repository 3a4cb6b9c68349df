"""strided_row_hashes (the recorder's in-place row fingerprints) gives the numbers the copying path gives, for every
layout and the strided views a model makes: column blocks of a fused output, heads-first transposes, expanded and
size-1 dims, odd byte counts."""
import numpy as np
import pytest
import torch

from divtrace.record import rowhash
from divtrace.trace import token_layout as layout

pytestmark = pytest.mark.skipif(rowhash._rows_bytes is None, reason="the _rows kernel is not built")


def _want(x, code, rows):
    return rowhash.row_hashes(layout.rows_2d(x, code)).astype("<u8").tobytes()


def _views():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 5, 24, generator=g)
    yield "bt", base, 10, True
    yield "bt", base[..., 8:16], 10, True  # a column block (QKV split)
    yield "bt", base[:, 1:4], 6, False  # a slice of the token dim: B and T not at one stride
    yield "bt", base[:1, 1:4], 3, True  # ... unless B is 1
    yield "bt", base[:, :, ::2], 10, False  # strided inside a row
    yield "bt", base.transpose(0, 1).contiguous().transpose(0, 1), 10, False  # B and T swapped in memory
    yield "last2", base[:, 3:], 4, False
    yield "n", base.reshape(10, 24)[:, 4:12], 10, True
    yield "n", torch.randn(10, 1, 6, generator=g).expand(10, 3, 6), 10, False  # expanded inside a row
    yield "n", torch.randn(1, 7, generator=g).expand(10, 7), 10, True  # rows at stride 0
    heads = torch.randn(2, 3, 5, 4, generator=g)  # [B, H, T, d]
    yield "bht", heads, 10, False
    yield "bht", heads.transpose(1, 2).contiguous().transpose(1, 2), 10, True  # [B, T, H, d] in memory
    yield "bt", torch.randn(5, 1, 6, generator=g).transpose(0, 1), 5, True
    yield "bt", torch.randn(4, 1, 6, generator=g), 4, True
    yield "bt", torch.randn(2, 5, 3, 1, 4, generator=g).transpose(3, 4).contiguous().transpose(3, 4), 10, True
    for dt in (torch.bfloat16, torch.float16, torch.int8, torch.bool, torch.float64):
        yield "bt", torch.randn(2, 5, 7, generator=g).to(dt)[..., 1:6], 10, True  # odd and even row byte counts
    yield "bt", torch.randn(2, 5, 0), 10, True  # rows of no bytes


@pytest.mark.parametrize("case", list(_views()), ids=lambda c: f"{c[0]}-{tuple(c[1].shape)}-{c[1].dtype}")
def test_strided_row_hashes_match_the_copying_path(case):
    code, x, rows, in_place = case
    got = rowhash.strided_row_hashes(x, code, rows)
    assert (got is not None) == in_place  # None: left to the copying path
    if got is not None:
        assert got == _want(x, code, rows)


def test_a_changed_row_changes_only_its_fingerprint():
    x = torch.randn(2, 5, 24)[..., 8:16]
    before = np.frombuffer(rowhash.strided_row_hashes(x, "bt", 10), dtype="<u8").copy()
    x[1, 2, 3] += 1
    after = np.frombuffer(rowhash.strided_row_hashes(x, "bt", 10), dtype="<u8")
    assert (before != after).tolist() == [i == 7 for i in range(10)]


def test_an_extension_built_before_row_hashes_bytes_falls_back_to_copying(monkeypatch):
    monkeypatch.setattr(rowhash, "_rows_bytes", None)  # a _rows built from an older _rows.c
    assert rowhash.strided_row_hashes(torch.randn(2, 5, 8), "bt", 10) is None


def test_the_torch_path_takes_a_size_one_dim_with_any_stride(monkeypatch):
    """Regression: the torch path (no _rows extension, any GPU tensor) raised on one row of one element whose
    last dim has a stride other than 1; it must give the kernel's numbers."""
    x = torch.randn(2, 4).t()[:1, :1]  # [1, 1], stride (1, 4)
    want = rowhash.strided_row_hashes(x, "bt", 1)
    monkeypatch.setattr(rowhash, "_native_rows", None)
    assert rowhash.row_hashes(layout.rows_2d(x, "bt")).astype("<u8").tobytes() == want
