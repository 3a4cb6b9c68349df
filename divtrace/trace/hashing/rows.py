"""Per-token-row fingerprints, scheme "row-gsum64-v2" (see `divtrace.trace.hashing.spec`): one 64-bit sum per row, of
its 32-bit lanes rotated left by one bit and weighted by the tensor scheme's W_0 at their position in the GLOBAL
row. A rank holding a column block of each row (a shard of any of the row's dims) gives partial row fingerprints
that sum (mod 2**64) across ranks to the rows'; a rank holding whole rows gives the rows' fingerprints.

CPU tensors go through the C kernel (divtrace._native), others through torch ops with no host sync (an int64
tensor [R] on the device; `rows_bytes` makes rows.bin's bytes later, on the host).
"""
from __future__ import annotations

import math
import sys
from array import array

import numpy as np
import torch

from divtrace.trace.hashing.base import native_eligible
from divtrace.trace.hashing import ROW_SCHEME, weights
from divtrace.trace.hashing.boxes import Runs, box
from divtrace.trace.hashing.lanes import RunLanes, dot_last, lane_index, rotl1, stream_bytes
from divtrace.trace.hashing.spec import BLOCK
from divtrace.trace.memo import bounded_put

try:
    from divtrace import _native
except ImportError:  # built without a C compiler: torch ops compute the same numbers
    _native = None
if _native is not None and (sys.byteorder != "little" or not hasattr(_native, "row_fingerprints2")):
    _native = None


def _takes_run_stride() -> bool:
    """Whether the extension's row_fingerprints2 takes a run stride (not one built before it): asked with no rows."""
    try:
        _native.row_fingerprints2(0, 0, 0, 0, b"", 0, 0)
    except TypeError:
        return False
    return True


_RUN_STRIDE = _native is not None and _takes_run_stride()
_HEADS: dict[tuple, tuple | None] = {}  # heads_row_fingerprints' plans, by (shape, stride, itemsize, rows, row block)

__all__ = ["ROW_SCHEME", "row_fingerprints", "strided_row_fingerprints", "combine_rows", "rows_bytes",
           "combine_rows_bytes", "row_dims"]
_STARTS: dict[tuple, tuple[Runs, bytes]] = {}
_FIRST_BYTE = array("q", [0]).tobytes()
_WEIGHTS: dict[tuple, torch.Tensor] = {}  # (device, runs, itemsize) -> W_0 of each lane of a row's block [1, lanes]  # the one run of a whole row starts at its byte 0


def _runs(local_dims, row_shape, row_offsets, itemsize: int) -> tuple[Runs, bytes]:
    """The runs of a row's local block and their global byte starts (int64, for the C kernel), cached."""
    key = (tuple(local_dims), None if row_shape is None else tuple(row_shape),
           None if row_offsets is None else tuple(row_offsets), itemsize)
    got = _STARTS.get(key)
    if got is None:
        if row_shape is None:
            if row_offsets is not None:
                raise TypeError("row_offsets given without row_shape")
            row_shape = local_dims
        runs = box(local_dims, row_shape, row_offsets)
        starts = array("q", [s * itemsize for s in runs.starts()] if runs.run else []).tobytes()
        got = (runs, starts)
        if len(_STARTS) < 4096:
            _STARTS[key] = got
    return got


def row_runs(local_dims, row_shape, row_offsets, itemsize: int) -> tuple[Runs, bytes]:
    """(the runs of a row's local block `local_dims` in the global row `row_shape` at `row_offsets`, their global
    byte starts as int64 bytes): kept per arguments. Raises where the block does not fit."""
    return _runs(local_dims, row_shape, row_offsets, itemsize)


def row_fingerprints(rows: torch.Tensor, row_shape=None, row_offsets=None) -> torch.Tensor:
    """int64 [R] on `rows`' device: the fingerprint of each row of `rows` ([R, *row dims], any layout), or with
    `row_shape` (the global row dims) and `row_offsets`, each row's partial for the block it holds. `combine_rows`
    sums the partials of the blocks of a row into its fingerprint."""
    r = rows.shape[0]
    local = tuple(rows.shape[1:])
    es = rows.element_size()
    runs, starts = _runs(local, row_shape, row_offsets, es)
    if r == 0 or runs.run == 0:
        return torch.zeros(r, dtype=torch.int64, device=rows.device)
    if _native is not None and native_eligible(rows):
        got = row_layout(rows, "n", r)
        if got is None:
            rows = rows.contiguous()
            got = row_layout(rows, "n", r)
        out = torch.empty(r, dtype=torch.int64)
        _native.row_fingerprints2(rows.data_ptr(), r, got[0], runs.run * es, starts, out.data_ptr())
        return out
    rl = RunLanes(stream_bytes(rows).reshape(r, runs.n_runs, runs.run * es), runs, es)
    key = (str(rows.device), runs, es)
    w = _WEIGHTS.get(key)
    if w is None:  # W_0 of every lane of the row's block: a function of the layout only, kept (layers repeat it)
        blocks = -(-math.prod(row_shape if row_shape is not None else local) * es // 4) // BLOCK + 1
        w = weights.lane_weights(lane_index(rl), blocks, sums=1).reshape(1, -1)
        if len(_WEIGHTS) >= 256:
            _WEIGHTS.clear()
        _WEIGHTS[key] = w
    return dot_last(rotl1(rl.lanes).reshape(r, -1), w)[0]


def row_dims(shape, code: str) -> tuple[int, ...]:
    """The dims of one token row of a tensor of `shape` in layout `code` (divtrace.trace.token_layout), in row order."""
    if code == "bht":
        return (shape[1], *shape[3:])
    return tuple(shape[1:]) if code == "n" else tuple(shape[2:])


def strided_row_fingerprints(x: torch.Tensor, code: str, rows: int, row_shape=None, row_offsets=None) -> bytes | None:
    """rows.bin's bytes (little-endian uint64) of `x`'s token rows for layout `code`, read in place by the C kernel
    (as tokens.rowhash.strided_row_hashes for the old scheme); `row_shape`/`row_offsets` as in row_fingerprints,
    in row order (`row_dims`). None where the kernel is not built or the rows are not laid out so."""
    if _native is None or x.is_quantized:
        return None
    got = row_layout(x, code, rows)  # (checks the rest of what native_eligible does)
    if got is None:
        return None
    if row_shape is None and row_offsets is None:  # whole rows: one run from byte 0 (the recorder's common call)
        return _native.row_fingerprints2(x.data_ptr(), rows, got[0], got[1], _FIRST_BYTE, 0)
    runs, starts = _runs(row_dims(x.shape, code), row_shape, row_offsets, x.element_size())
    if rows == 0 or runs.run == 0:
        return bytes(8 * rows)
    return _native.row_fingerprints2(x.data_ptr(), rows, got[0], runs.run * x.element_size(), starts, 0)


def heads_row_fingerprints(x: torch.Tensor, rows: int, row_shape=None, row_offsets=None) -> bytes | None:
    """strided_row_fingerprints(x, "bht", ...) of a [B, H, T, *d] tensor whose rows are not in place (a block of local
    heads, or all heads, stored heads first): each head's trailing elements a run, read in place one head's stride
    apart, so no [B, T, H, d] copy is made. The runs of the row's block (`row_dims`' order, heads outermost) are cut at
    the heads into runs of one head each, at their global byte starts: the row's sum is the same (each lane weighted
    by its global place). None where the kernel does not read `x` so (the caller copies)."""
    if not _RUN_STRIDE or x.is_quantized or not x.is_cpu or x.layout != torch.strided or x.is_conj() or x.is_neg() \
            or x.dim() < 3:
        return None
    shape, stride, es = x.shape, x.stride(), x.element_size()
    key = (shape, stride, es, rows, None if row_shape is None else tuple(row_shape),
           None if row_offsets is None else tuple(row_offsets))
    plan = _HEADS.get(key, False)
    if plan is False:  # (a function of the layout only: every layer repeats a few)
        plan = _heads_plan(shape, stride, es, rows, row_shape, row_offsets)
        bounded_put(_HEADS, key, plan)
    if plan is None:
        return None
    step, head_bytes, starts, head_step, batch_step = plan
    if not rows or not head_bytes:
        return bytes(8 * rows)
    ptr = x.data_ptr()
    if batch_step is None:  # (one step between all rows)
        return _native.row_fingerprints2(ptr, rows, step, head_bytes, starts, 0, head_step)
    t = shape[2]  # (each batch's tokens at one step, the batches apart: one call per batch, rows in order)
    return b"".join(_native.row_fingerprints2(ptr + i * batch_step, t, step, head_bytes, starts, 0, head_step)
                    for i in range(shape[0]))


def _heads_plan(shape, stride, es: int, rows: int, row_shape, row_offsets) -> tuple | None:
    """(row step, bytes of a head's run, global byte starts of the heads' runs, head step, batch step or None where
    all rows are one step apart) in bytes, or None."""
    b, h, t = shape[0], shape[1], shape[2]
    if rows != b * t:
        return None
    elems = 1
    for d in range(len(shape) - 1, 2, -1):  # a head's own elements: row-major without gaps
        if shape[d] != 1:
            if stride[d] != elems:
                return None
            elems *= shape[d]
    batch_step = None
    if t == 1:
        step = stride[0]
    elif b == 1 or stride[0] == stride[2] * t:
        step = stride[2]
    else:
        step, batch_step = stride[2], stride[0] * es
    runs, starts = _runs(row_dims(shape, "bht"), row_shape, row_offsets, es)
    head_bytes = elems * es
    if rows == 0 or runs.run == 0 or head_bytes == 0:
        return step * es, 0, b"", 0, None
    run_bytes = runs.run * es
    if run_bytes % head_bytes or runs.n_runs * run_bytes != h * head_bytes:
        return None  # (a block cut inside a head's elements)
    per = run_bytes // head_bytes
    heads = array("q", [s + j * head_bytes for s in array("q", starts) for j in range(per)])
    return step * es, head_bytes, heads.tobytes(), stride[1] * es, batch_step


def combine_rows(partials) -> torch.Tensor:
    """The row fingerprints of rows whose column blocks gave `partials` (int64 [R] tensors, or one [k, R]): their
    sum mod 2**64."""
    if not isinstance(partials, torch.Tensor):
        partials = torch.stack(list(partials))
    return partials.sum(0)


def rows_bytes(fps: torch.Tensor) -> bytes:
    """rows.bin's bytes of an int64 [R] tensor of row fingerprints (reads it to the host)."""
    return fps.cpu().numpy().view(np.uint64).astype("<u8", copy=False).tobytes()


def combine_rows_bytes(parts) -> bytes:
    """`combine_rows` on rows.bin byte strings of equal length."""
    arrays = [np.frombuffer(p, dtype="<u8") for p in parts]
    total = np.zeros_like(arrays[0])
    for a in arrays:
        total += a  # (unsigned array addition wraps mod 2**64)
    return total.astype("<u8", copy=False).tobytes()


def row_layout(x: torch.Tensor, code: str, rows: int) -> tuple[int, int] | None:
    """(byte step between rows, bytes per row) where `x`'s token rows for layout `code` (divtrace.trace.token_layout)
    can be read in place: each row's bytes contiguous, the rows at one stride (a column block of a fused output, a
    [B, T, H, d] view of a [B, H, T, d] tensor), `rows` of them (or none). None otherwise (the caller copies)."""
    if not x.is_cpu or x.layout != torch.strided or x.is_conj() or x.is_neg() or rows < 0:
        return None
    shape, stride = x.shape, x.stride()
    if code == "bht":
        if len(shape) < 3:
            return None
        shape = (shape[0], shape[2], shape[1], *shape[3:])
        stride = (stride[0], stride[2], stride[1], *stride[3:])
    lead = 1 if code == "n" else 2
    if len(shape) < lead:
        return None
    elems = 1
    for d in range(len(shape) - 1, lead - 1, -1):  # each row's own dims: row-major without gaps
        n = shape[d]
        if n != 1:
            if stride[d] != elems:
                return None
            elems *= n
    if lead == 1 or shape[1] == 1:
        step = stride[0]
    elif shape[0] == 1 or stride[0] == stride[1] * shape[1]:
        step = stride[1]
    else:
        return None
    if rows != 0 and rows != shape[0] * (shape[1] if lead == 2 else 1):
        return None
    es = x.element_size()
    return step * es, elems * es
