"""One 64-bit fingerprint per token row (scheme "rowlane-wsum2x32"; the C kernel divtrace/_rows.c, else torch).

A row's raw bytes, row-major, are cut into lanes of 4, 2 or 1 bytes (the widest that divides the row's byte
count), each a signed little-endian integer x[i]; S = sum x[i] * U[i] and T = sum x[i] * V[i] mod 2**32 with two
sets of fixed odd 32-bit weights, then a splitmix64 finalizer of (S << 32 | T) xor a tag of the byte count. Any
change of one lane changes both sums (odd weights are units mod 2**32); two independent 32-bit sums make a
random collision about as likely as one 64-bit sum's. Rows are compared only with rows of the same dtype and row
shape, which the key carries beside it.
"""
from __future__ import annotations

import numpy as np
import torch
from divtrace.trace.hashing.rows import row_layout

try:
    from divtrace import _rows as _native_rows
except ImportError:  # built without a C compiler: torch ops compute the same numbers
    _native_rows = None
# (an extension built from an older _rows.c lacks it: the copying path then, until `setup.py build_ext` runs again)
_rows_bytes = getattr(_native_rows, "row_hashes_bytes", None)

ROW_SCHEME = "rowlane-wsum2x32"
_CHUNK = 4096
_weights = torch.empty(2, 0, dtype=torch.int64)  # U, V: odd 32-bit weights (held as int64 for the torch path)
_packed: dict[int, torch.Tensor] = {}  # lanes -> uint32 [U[:lanes], V[:lanes]] for the C kernel
_M1, _M2, _GOLD = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _weights_for(n: int) -> torch.Tensor:
    """[2, >= n] odd 32-bit weights (as int64); chunk c is drawn from its own seed, so weight i never depends on n."""
    global _weights
    if _weights.shape[1] < n:
        chunks = [_weights]
        for c in range(_weights.shape[1] // _CHUNK, -(-n // _CHUNK)):
            g = torch.Generator().manual_seed(0x70C3 + c)
            chunks.append(torch.randint(0, 2**31, (2, _CHUNK), generator=g, dtype=torch.int64) * 2 + 1)
        _weights = torch.cat(chunks, dim=1)
    return _weights


def _packed_for(lanes: int) -> torch.Tensor:
    """U[:lanes] then V[:lanes] as contiguous uint32 (the C kernel's layout), cached per lane count."""
    w = _packed.get(lanes)
    if w is None:
        u = _weights_for(max(lanes, 1))[:, :lanes]
        w = torch.from_numpy(u.numpy().astype(np.uint32).reshape(-1).copy())
        if len(_packed) < 4096:
            _packed[lanes] = w
    return w


def _mix(s: np.ndarray, rowbytes: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = s ^ (np.uint64(rowbytes) * _GOLD)
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def strided_row_hashes(x: torch.Tensor, code: str, rows: int) -> bytes | None:
    """The row fingerprints of `x`'s token rows for layout `code` (divtrace.trace.token_layout), as rows.bin's bytes
    (little-endian uint64), read in place where `row_layout` allows: no copy, no torch op, no array. The same
    numbers as row_hashes(layout.rows_2d(x, code)). None where the kernel is not built or the rows are not laid
    out so (the caller copies them then)."""
    got = row_layout(x, code, rows) if _rows_bytes is not None else None
    if got is None:
        return None
    if rows == 0:
        return b""
    step, rowbytes = got
    if rowbytes == 0:
        return _mix(np.zeros(rows, dtype=np.uint64), 0).astype("<u8").tobytes()
    lane = 4 if rowbytes % 4 == 0 else 2 if rowbytes % 2 == 0 else 1
    return _rows_bytes(x.data_ptr(), rows, step, rowbytes, _packed_for(rowbytes // lane).data_ptr())


def row_hashes(rows: torch.Tensor) -> np.ndarray:
    """uint64[R] for a 2-D tensor `rows` [R, row elements] (any dtype, any device)."""
    r = rows.shape[0]
    if r == 0:
        return np.zeros(0, dtype=np.uint64)
    x = rows.detach()
    if x.is_conj():
        x = x.resolve_conj()
    if x.is_neg():
        x = x.resolve_neg()
    if x.stride(-1) != 1 or (r > 1 and x.stride(0) != x.shape[1]) or x.storage_offset() % 1:
        x = x.contiguous()
    rowbytes = x.shape[1] * x.element_size()
    if rowbytes == 0:  # rows of no elements: all equal (their dtype and row shape are compared beside)
        return _mix(np.zeros(r, dtype=np.uint64), 0)
    lane = 4 if rowbytes % 4 == 0 else 2 if rowbytes % 2 == 0 else 1
    if _native_rows is not None and x.is_cpu and x.layout == torch.strided:
        x = x.contiguous()
        w = _packed_for(rowbytes // lane)
        out = np.empty(r, dtype=np.uint64)
        _native_rows.row_hashes(x.data_ptr(), r, rowbytes, rowbytes, w.data_ptr(), out.ctypes.data)
        return out
    # A fresh flat copy: a "contiguous" tensor may carry any stride on a size-1 dim, or start at a byte offset
    # that is no multiple of the lane width, and view() refuses both.
    # (clone() keeps a size-1 dim's odd stride, which view() refuses: a fresh dense buffer has stride 1)
    flat = torch.empty(x.numel(), dtype=x.dtype, device=x.device).copy_(x.reshape(-1)).view(torch.uint8)
    lanes = flat.view({4: torch.int32, 2: torch.int16, 1: torch.int8}[lane]).reshape(r, rowbytes // lane).to(torch.int64)
    w = _weights_for(max(rowbytes // lane, 1))[:, : rowbytes // lane].to(lanes.device)
    if lanes.is_cpu:
        st = torch.stack([lanes @ w[0], lanes @ w[1]])
    else:  # no int64 matmul on accelerators; the products wrap mod 2**64 the same way
        st = torch.stack([(lanes * w[0]).sum(1), (lanes * w[1]).sum(1)])
    low = st.cpu().numpy().view(np.uint64) & np.uint64(0xFFFFFFFF)  # (sum mod 2**64) mod 2**32: the 32-bit sums
    return _mix((low[0] << np.uint64(32)) | low[1], rowbytes)
