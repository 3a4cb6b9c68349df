"""Bit-exact fingerprints of tensors.

The raw bytes, read in logical (row-major) order so a view and its contiguous copy agree, are cut into lanes
of at most 32 bits (int32 where the byte count allows, else int16 or int8) and sign-extended to int64. Lane i
gets the weight w[i % 1024] * u[i // 1024] with w and u odd 64-bit constants, and the fingerprint row is the
weighted sum modulo 2**64; two independent rows make 128 bits.

Why this shape:
- every weight is odd, hence a unit mod 2**64: a change in one lane always changes the sum (any one-bit
  flip is detected);
- lanes are at most 32 bits wide, so a lane difference has at most 31 trailing zero bits and still moves at
  least 33 bits of each row. With 64-bit lanes, two sign flips of packed fp32/fp64 elements (2**63 each)
  cancelled exactly, a false "identical";
- the weights are fixed per position (chunked seeds), never drawn for a size, so a tensor hashes the same
  whatever was hashed before it in the process;
- the blocks of 1024 lanes let the CPU use a fused int64 matrix-vector product over a cache-sized scratch
  buffer, and accelerators the same math as multiply + sum with a bounded temporary.

Two implementations compute the same numbers. On CPU tensors the C kernel `divtrace._native` (built at install
when a C compiler is there) reads any strided layout in place and takes the summary statistics in the same
pass; elsewhere (accelerators, or no compiler at install) the torch ops below do it. `IMPLEMENTATION` says
which one this process uses on the CPU, and traces record it.
"""
from __future__ import annotations

import sys

import torch

from divtrace.trace.hashing.base import (BLOCK as _BLOCK, STATS_KIND as _STATS_KIND, block_sums as _block_sums,
                                   finish_stats, flat_bytes, native_eligible, summary_stats)
from divtrace.trace.records import json_safe

try:
    from divtrace import _native
except ImportError:  # built without a C compiler: the torch path computes the same fingerprints
    _native = None

HASH_SCHEME = "lane32-wsum128"  # stored in meta.json: a reader verifies bytes only with the scheme that wrote them
_OUTER_CHUNK = 4096


def _odd(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**62), 2**62, shape, generator=g, dtype=torch.int64) * 2 + 1


class _Weights:
    def __init__(self) -> None:
        self._inner: dict[str, torch.Tensor] = {}
        self._outer: dict[str, torch.Tensor] = {}

    def inner(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._inner:
            self._inner[key] = _odd((2, _BLOCK), 0x5EED).to(device)
        return self._inner[key]

    def outer(self, blocks: int, device) -> torch.Tensor:
        key = str(device)
        have = self._outer.get(key)
        if have is None or have.shape[1] < blocks:
            n0 = 0 if have is None else have.shape[1] // _OUTER_CHUNK
            n1 = -(-max(blocks, 1) // _OUTER_CHUNK)
            new = [_odd((2, _OUTER_CHUNK), 0xB10C0000 + c).to(device) for c in range(n0, n1)]
            have = torch.cat(([have] if have is not None else []) + new, dim=1)
            self._outer[key] = have
        return have[:, :blocks]

    def outer_all(self, blocks: int) -> torch.Tensor:
        """The whole CPU outer-weight table, at least `blocks` wide (no slice: the native kernel takes a pointer)."""
        have = self._outer.get("cpu")
        if have is None or have.shape[1] < blocks:
            self.outer(blocks, "cpu")
            have = self._outer["cpu"]
        return have


_WEIGHTS = _Weights()
ZERO_HASH = "0" * 32  # the fingerprint of no bytes
if _native is not None and sys.byteorder != "little":
    _native = None  # lanes are little-endian integers; the torch path reads them the same on any machine
if _native is not None:
    _native.set_weights(_WEIGHTS.inner("cpu").contiguous().data_ptr())  # the kernel keeps its own copy
IMPLEMENTATION = "native" if _native is not None else "torch"
_OUTER_PTR: tuple = (None, 0, 0, -1)  # (CPU outer-weight table, its data_ptr, stride(0), width) for the kernel
_LANE_DTYPES = ((4, torch.int32), (2, torch.int16), (1, torch.int8))


def lanes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of `t` in logical order as a flat int32/int16/int8 tensor (widest that divides)."""
    flat = flat_bytes(t)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1) if flat.dtype != torch.complex32 else flat.view(torch.float16)
    raw = flat.view(torch.uint8) if flat.element_size() > 1 else flat
    nbytes = raw.numel()
    for width, dt in _LANE_DTYPES:
        if nbytes % width == 0:
            if flat.element_size() == width:
                return flat.view(dt)
            if raw.storage_offset() % width:  # a slice starting mid-lane (bf16 x[1:]): views refuse it
                raw = raw.clone()
            return raw.view(dt)
    raise AssertionError("unreachable: width 1 always divides")


def block_sums(v: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """Per block of 1024 lanes, the two inner weighted sums of this scheme: int64 (2, blocks), wrapping mod 2**64
    (divtrace.trace.hashing.base.block_sums with these weights)."""
    return _block_sums(v, _WEIGHTS.inner(v.device), fused)


def tensor_hash(t: torch.Tensor, fused: bool | None = None) -> str:
    """128-bit hex fingerprint of the raw bytes; dtype and shape are not included (TensorValue holds them).
    `fused` forces the torch path (its CPU matrix-vector form or, False, the accelerator form); by default a
    CPU tensor goes through the native kernel when it is built."""
    if fused is None:
        got = _native_pass(t, stats=False)
        if got is not None:
            return got[0]
    v = lanes(t)
    if v.numel() == 0:
        return ZERO_HASH
    sums = block_sums(v, fused)
    h = (sums * _WEIGHTS.outer(sums.shape[1], v.device)).sum(1).tolist()
    return f"{h[0] & 0xFFFFFFFFFFFFFFFF:016x}{h[1] & 0xFFFFFFFFFFFFFFFF:016x}"


def reference_hash(t: torch.Tensor) -> str:
    """The same fingerprint in plain Python integers (slow; tests check the torch kernels against it)."""
    v = lanes(t).tolist()
    if not v:
        return ZERO_HASH
    w = _WEIGHTS.inner("cpu").tolist()
    u = _WEIGHTS.outer(-(-len(v) // _BLOCK), "cpu").tolist()
    rows = [sum(x * w[r][i % _BLOCK] * u[r][i // _BLOCK] for i, x in enumerate(v)) % 2**64 for r in (0, 1)]
    return f"{rows[0]:016x}{rows[1]:016x}"


def hasher(scheme):
    """The hash function (tensor -> hex) for a trace's `meta["hash_scheme"]`, or None when this divtrace does not
    know it. Every scheme a divtrace once wrote stays here, so old traces still read and verify."""
    if scheme == HASH_SCHEME:
        return tensor_hash
    from divtrace.trace.hashing import TENSOR_SCHEME

    if scheme == TENSOR_SCHEME:
        from divtrace.trace.hashing.tensor import tensor_hash as tensor_hash_v2

        return tensor_hash_v2
    return None


def _native_pass(t: torch.Tensor, stats: bool):
    """(hash, stats or None) from the native kernel in one read of `t` in place, or None when it cannot read
    `t` (not built, not a plain strided CPU tensor, a lazy conjugate/negation bit)."""
    if _native is None or not native_eligible(t):
        return None
    n = t.numel()
    if n == 0:
        return ZERO_HASH, ({} if stats else None)
    es = t.element_size()
    nbytes = n * es
    lane = 4 if nbytes % 4 == 0 else 2 if nbytes % 2 == 0 else 1
    blocks = -(-nbytes // lane // _BLOCK)
    global _OUTER_PTR
    u = _OUTER_PTR
    if u[3] < blocks:  # (the table's address, stride and width, kept between calls: it grows rarely)
        w = _WEIGHTS.outer_all(blocks)
        u = _OUTER_PTR = (w, w.data_ptr(), w.stride(0), w.shape[1])
    kind = _STATS_KIND.get(t.dtype, 0) if stats else 0
    h, st = _native.fingerprint_summary(t.data_ptr(), es, t.shape, t.stride(), u[1], u[2], u[3], kind)
    return h, (finish_stats(t, st) if stats else None)


def fingerprint(t: torch.Tensor) -> tuple[str, dict]:
    """(hash, stats) of `t`'s logical bytes: one pass in place with the native kernel, else one contiguous
    read with torch ops. The stats are ready for JSON (non-finite values as strings)."""
    got = _native_pass(t, stats=True)
    if got is not None:
        return got
    flat = flat_bytes(t)
    if flat.numel() == 0:
        return ZERO_HASH, {}
    return tensor_hash(flat, fused=flat.device.type == "cpu"), json_safe(summary_stats(flat))


_DTYPE_NAMES: dict = {}


def dtype_name(dtype: torch.dtype) -> str:
    """`str(dtype)`, memoized (it runs for every recorded value)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name
