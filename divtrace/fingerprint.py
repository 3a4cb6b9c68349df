"""Bit-exact fingerprints of tensors.

The hash is a position-weighted sum of the raw bytes, read as 64-bit lanes (narrower where the byte count
does not divide), with odd weights, modulo 2**64. Flipping any single bit changes one lane by +-2**k, which
an odd weight maps to a non-zero change mod 2**64, so a one-bit difference is always detected. A second,
independent set of weights makes the fingerprint 128 bits, so unrelated tensors collide with probability
about 2**-128. Values are read in logical (row-major) order, so a view and its contiguous copy agree.
"""
from __future__ import annotations

import math

import torch

_LANES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


class _Weights:
    """Cached odd weights per device, grown on demand (deterministic, so traces agree across processes)."""

    def __init__(self) -> None:
        self._w: dict[str, torch.Tensor] = {}
        self._scratch: dict[str, torch.Tensor] = {}

    def get(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(device)
        w = self._w.get(key)
        if w is None or w.shape[1] < n:
            size = max(n, 1 << 16, 0 if w is None else 2 * w.shape[1])
            g = torch.Generator().manual_seed(0x5EED)
            w = (torch.randint(-(2**62), 2**62, (2, size), generator=g, dtype=torch.int64) * 2 + 1).to(device)
            self._w[key] = w
            self._scratch[key] = torch.empty(size, dtype=torch.int64, device=device)
        return w[:, :n], self._scratch[key][:n]


_WEIGHTS = _Weights()


def lanes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of `t` in logical order as a flat integer tensor, as wide as the byte count allows."""
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    nbytes = flat.numel() * flat.element_size()
    for width in (8, 4, 2, 1):
        if width >= flat.element_size() and nbytes % width == 0:
            try:
                return flat.view(torch.uint8).view(_LANES[width]) if width != flat.element_size() else flat.view(_LANES[width])
            except RuntimeError:
                continue
    return flat.view(torch.uint8).to(torch.int64)


def tensor_hash(t: torch.Tensor) -> str:
    """128-bit hex fingerprint of the raw bytes, dtype and shape not included (see `fingerprint`)."""
    v = lanes(t)
    n = v.numel()
    if n == 0:
        return "0" * 32
    w, scratch = _WEIGHTS.get(n, v.device)
    parts = []
    for row in w:
        torch.mul(v, row, out=scratch)
        parts.append(int(scratch.sum().item()) & 0xFFFFFFFFFFFFFFFF)
    return f"{parts[0]:016x}{parts[1]:016x}"


def summary_stats(t: torch.Tensor) -> dict:
    """min/max/mean/absmax and NaN/Inf counts for float tensors; NaN-aware but cheap when all finite."""
    if not (t.is_floating_point() and t.numel()):
        return {}
    x = t.detach()
    if x.element_size() == 1:  # fp8 has few kernels
        x = x.float()
    lo, hi = torch.aminmax(x)
    lo, hi = float(lo), float(hi)
    nan = inf = 0
    if not (math.isfinite(lo) and math.isfinite(hi)):
        nan = int(torch.isnan(x).sum())
        inf = int(torch.isinf(x).sum())
        finite = x[torch.isfinite(x)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.numel() else (math.nan, math.nan)
        mean = float(finite.double().mean()) if finite.numel() else math.nan
    else:
        mean = float(x.sum(dtype=torch.float64)) / x.numel()
    return {"min": lo, "max": hi, "mean": mean, "absmax": max(abs(lo), abs(hi)) if not math.isnan(lo) else math.nan,
            "nan": nan, "inf": inf}
