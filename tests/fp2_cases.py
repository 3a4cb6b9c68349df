"""Shared cases for the v2 fingerprint tests: values of every dtype, the three implementations side by side, and
shard layouts as torch.chunk and DTensor make them (uneven chunks included)."""
from __future__ import annotations

import contextlib
import math

import torch

from divtrace.trace.hashing import lanes, rows as rows_v2, spec, tensor as tensor_v2

MASK = spec.MASK
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn]


def values(dtype, shape, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return (torch.rand(n, generator=g) > 0.5).reshape(shape)
    if dtype.is_complex:
        return torch.complex(torch.randn(n, generator=g), torch.randn(n, generator=g)).to(dtype).reshape(shape)
    if not dtype.is_floating_point:
        lo, hi = (0, 256) if dtype == torch.uint8 else (-128, 128) if dtype == torch.int8 else (-2**15, 2**15)
        return torch.randint(lo, hi, (n,), generator=g).to(dtype).reshape(shape)
    return (torch.randn(n, generator=g) * 3).to(dtype).reshape(shape)


def unsigned(t: torch.Tensor) -> list[int]:
    return [x & MASK for x in t.tolist()]


@contextlib.contextmanager
def torch_path(matmul: bool = True):
    """Within: the C kernels hidden, so the torch ops run (`matmul=False`: the accelerators' multiply-and-sum)."""
    saved = tensor_v2._native, rows_v2._native, lanes.CPU_MATMUL
    tensor_v2._native = rows_v2._native = None
    lanes.CPU_MATMUL = matmul
    try:
        yield
    finally:
        tensor_v2._native, rows_v2._native, lanes.CPU_MATMUL = saved


def all_paths(fn, *args) -> list[list[int]]:
    """fn(*args) (a v2 fingerprint function) by the C kernel, the torch ops with the CPU's int64 matrix products,
    and the torch ops in the accelerators' form, as unsigned ints."""
    got = [unsigned(fn(*args))]
    for matmul in (True, False):
        with torch_path(matmul):
            got.append(unsigned(fn(*args)))
    return got


def chunk_sizes(n: int, k: int) -> list[int]:
    """torch.chunk's piece sizes along a dim of n (fewer than k pieces when n is small, as DTensor's Shard)."""
    return [c.shape[0] for c in torch.empty(n).chunk(k)] if n else [0]


def cuts(sizes) -> list[tuple[int, int]]:
    out, off = [], 0
    for s in sizes:
        out.append((off, s))
        off += s
    return out


def boxes(shape, dims_and_pieces) -> list[tuple[tuple, tuple]]:
    """(offsets, local shape) of every box when dim d is cut into the given piece sizes, for each (d, sizes)
    (several dims: a 2-D mesh's Shard(d0), Shard(d1))."""
    out = [((0,) * len(shape), tuple(shape))]
    for d, sizes in dims_and_pieces:
        nxt = []
        for off, loc in out:
            for o, s in cuts(sizes):
                nxt.append((off[:d] + (o,) + off[d + 1:], loc[:d] + (s,) + loc[d + 1:]))
        out = nxt
    return out


def take(x: torch.Tensor, off, loc) -> torch.Tensor:
    return x[tuple(slice(o, o + n) for o, n in zip(off, loc))]
