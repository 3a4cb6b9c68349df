"""What both fingerprint schemes build on (lane32-wsum128 in divtrace.trace.fingerprint, lane-gsum128-v2 here): a
tensor's bytes in logical order, whether the C kernels can read a tensor in place, the per-block weighted lane
sums with torch ops, and the summary statistics."""
from __future__ import annotations

import math
import threading

import torch

from divtrace.trace.records import json_safe

BLOCK = 1024
CPU_ROWS = 256  # blocks per scratch fill on CPU: 2 MiB of int64, stays in cache for the two passes
DEV_ROWS = 1 << 14  # blocks per step on accelerators: a 128 MiB temporary at most
STATS_KIND = {torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4}  # as in _native.c
_LOCAL = threading.local()  # the scratch buffer is per thread: two recorders may run at once


def scratch() -> torch.Tensor:
    """This thread's int64 [CPU_ROWS, BLOCK] buffer for widening lanes on the CPU."""
    buf = getattr(_LOCAL, "scratch", None)
    if buf is None:
        buf = _LOCAL.scratch = torch.empty(CPU_ROWS, BLOCK, dtype=torch.int64)
    return buf


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t` in logical order as a 1-D tensor with stride 1 (a view when `t` is contiguous, else a copy)."""
    t = t.detach()
    if t.is_conj() or t.is_neg():  # a lazy conjugate/negation: the values are the resolved ones
        t = t.resolve_conj().resolve_neg()
    flat = t.contiguous().reshape(-1)
    if flat.numel() <= 1 and flat.stride() != (1,):
        # A one-element tensor counts as contiguous whatever its stride, which byte views refuse.
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat


def block_sums(v: torch.Tensor, w: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """Per block of 1024 lanes of `v` (1-D int lanes), the two sums weighted by the inner weights `w` [2, 1024]:
    int64 of shape (2, blocks), wrapping mod 2**64. `fused` picks the CPU matrix-vector path (default: on CPU);
    both paths compute the same numbers."""
    n = v.numel()
    full, rest = divmod(n, BLOCK)
    fused = v.device.type == "cpu" if fused is None else fused
    out = torch.empty(2, full + (1 if rest else 0), dtype=torch.int64, device=v.device)
    if full:
        m = v[: full * BLOCK].view(full, BLOCK)
        if fused:
            buf = scratch()
            for s in range(0, full, CPU_ROWS):
                c = m[s:s + CPU_ROWS]
                sc = buf[: c.shape[0]]
                sc.copy_(c)  # widen to int64 in a cache-sized buffer
                torch.mv(sc, w[0], out=out[0, s:s + c.shape[0]])
                torch.mv(sc, w[1], out=out[1, s:s + c.shape[0]])
        else:
            for s in range(0, full, DEV_ROWS):
                c = m[s:s + DEV_ROWS].to(torch.int64)
                out[0, s:s + c.shape[0]] = (c * w[0]).sum(1)
                out[1, s:s + c.shape[0]] = (c * w[1]).sum(1)
    if rest:
        tail = v[full * BLOCK:].to(torch.int64)
        out[0, full] = (tail * w[0, :rest]).sum()
        out[1, full] = (tail * w[1, :rest]).sum()
    return out


def native_eligible(t: torch.Tensor) -> bool:
    """Whether the C kernels can read `t` in place: a plain strided CPU tensor, no lazy conjugate/negation bit."""
    return (t.is_cpu and t.layout == torch.strided and not t.is_conj() and not t.is_neg()
            and not t.is_quantized)  # (is_cpu: a sixth of the time of device.type, once per recorded value)


def finish_stats(t: torch.Tensor, st) -> dict:
    """The summary stats (ready for JSON) from what a C kernel gave: its summary dict; None for a dtype it takes
    none of; or its raw tuple (min, max, sum, finite, nan, inf) where some value or the mean is not finite."""
    if type(st) is dict:  # the usual summary, made in C
        return st
    if st is None:
        return json_safe(summary_stats(t)) if t.is_floating_point() else {}
    lo, hi, total, finite, nan, inf = st
    if not finite:  # all NaN/Inf
        return {"min": "nan", "max": "nan", "mean": "nan", "absmax": "nan", "nan": nan, "inf": inf}
    mean = total / finite
    if not math.isfinite(mean):  # the sum of finite values overflowed a double: fp64 near its range
        mean = repr(mean)
    return {"min": lo, "max": hi, "mean": mean, "absmax": max(-lo, hi), "nan": nan, "inf": inf}


def summary_stats(t: torch.Tensor) -> dict:
    """min/max/mean/absmax and NaN/Inf counts for float tensors; NaN-aware but cheap when all finite.
    A summary for people, never compared for equality, so the mean is accumulated in float32 for speed."""
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
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        mean = float(x.sum(dtype=acc)) / x.numel()
    return {"min": lo, "max": hi, "mean": mean, "absmax": max(abs(lo), abs(hi)) if not math.isnan(lo) else math.nan,
            "nan": nan, "inf": inf}
