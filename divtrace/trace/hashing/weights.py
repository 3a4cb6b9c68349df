"""The v2 weights as torch tensors on any device, made there by the formula of `spec` (int64 ops only: no host
copy, so building them never waits for the device). Cached per device."""
from __future__ import annotations

import torch

from divtrace.trace.hashing.spec import BLOCK, GOLDEN, MASK, SEED_U, SEED_W


def i64(x: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    x &= MASK
    return x - (1 << 64) if x >> 63 else x


_M1, _M2 = i64(0xBF58476D1CE4E5B9), i64(0x94D049BB133111EB)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """spec.mix64 on an int64 tensor (products wrap mod 2**64; shifts are made logical by masking)."""
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _M1
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _M2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def stream(seed: int, k: torch.Tensor) -> torch.Tensor:
    """mix64(seed + (k + 1) * GOLDEN) | 1 for an int64 tensor of indices k."""
    return mix64(k * i64(GOLDEN) + i64(seed + GOLDEN)) | 1


_INNER: dict[str, torch.Tensor] = {}
_OUTER: dict[str, torch.Tensor] = {}


def inner(device) -> torch.Tensor:
    """w: int64 [2, 1024]."""
    key = str(device)
    w = _INNER.get(key)
    if w is None:
        j = torch.arange(BLOCK, dtype=torch.int64, device=device)
        w = _INNER[key] = torch.stack([stream(SEED_W[0], j), stream(SEED_W[1], j)])
    return w


def outer(blocks: int, device) -> torch.Tensor:
    """u: int64 [2, blocks] (a view of a cached table that grows by doubling)."""
    key = str(device)
    u = _OUTER.get(key)
    if u is None or u.shape[1] < blocks:
        n = max(blocks, 4096, 2 * (0 if u is None else u.shape[1]))
        q = torch.arange(n, dtype=torch.int64, device=device)
        u = _OUTER[key] = torch.stack([stream(SEED_U[0], q), stream(SEED_U[1], q)])
    return u[:, :blocks]


def lane_weights(idx: torch.Tensor, blocks: int, sums: int = 2) -> torch.Tensor:
    """W_r(i) for the global lane indices `idx` (int64, any shape, every index below `blocks` * 1024, a bound the
    caller knows from the shapes: reading the largest index would wait for the device): [sums, *idx.shape]."""
    w = inner(idx.device)[:sums]
    u = outer(blocks, idx.device)[:sums]
    return w[:, idx & (BLOCK - 1)] * u[:, idx >> 10]
