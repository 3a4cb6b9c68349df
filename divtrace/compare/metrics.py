"""Bitwise tensor comparison and divergence metrics.

The bitwise verdict is the source of truth; every numeric metric here is only
a description of *how* two tensors differ once we already know they do.
"""
import math
from typing import Optional

import torch

from divtrace.compare.diffs import TensorDiff, Tolerance  # defined without torch; re-exported here

FLOAT_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn",
                 "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)  # the fnuz variants are missing in older torch
)

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INT64_MAX = 2**63 - 1


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """t.contiguous() reinterpreted as a signed int tensor of the same itemsize.

    Complex tensors gain a trailing dimension of 2 (real, imag); bool is viewed
    as uint8. contiguous() materializes expanded / strided views so the view
    below sees one element per logical position.
    """
    t = t.contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_INT_OF_SIZE[t.element_size()])


def _same_device(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return b if b.device == a.device else b.to(a.device)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    # Comparing as integers makes -0.0 != 0.0 and NaN == NaN iff same payload.
    return torch.equal(raw_bits(a), raw_bits(_same_device(a, b)))


def _ulp_from_bits(ia: torch.Tensor, ib: torch.Tensor, nbits: int) -> torch.Tensor:
    """ULP distance between sign-magnitude bit patterns, saturating at int64 max."""
    mag = (1 << (nbits - 1)) - 1

    def key(i: torch.Tensor) -> torch.Tensor:
        # Sign-magnitude -> monotonic integer; both zeros map to 0. Masking
        # (rather than INT_MIN - i) avoids signed overflow for 64-bit inputs.
        i = i.to(torch.int64)
        return torch.where(i < 0, -(i & mag), i)

    ka, kb = key(ia), key(ib)
    if nbits < 64:  # keys of narrower floats are far from int64 limits
        return (ka - kb).abs_()
    opposite = (ka < 0) != (kb < 0)
    ka.abs_()
    kb.abs_()
    # Same sign: |ka| - |kb| cannot overflow. Opposite sign: |ka| + |kb| can
    # exceed int64 for float64, so add only up to the remaining headroom.
    return torch.where(opposite, ka + torch.minimum(kb, _INT64_MAX - ka), (ka - kb).abs_())


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise int64 ULP distance; -1 where either side is NaN."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"ulp_distance needs same dtype/shape, got {a.dtype}{list(a.shape)} "
                         f"vs {b.dtype}{list(b.shape)}")
    if a.dtype not in FLOAT_DTYPES:
        raise TypeError(f"ulp_distance is defined for float dtypes only, got {a.dtype}")
    b = _same_device(a, b)
    dist = _ulp_from_bits(raw_bits(a), raw_bits(b), a.element_size() * 8)
    return dist.masked_fill_(a.isnan() | b.isnan(), -1)


def _hex(row: torch.Tensor, itemsize: int) -> str:
    # One entry per component (two for complex), as unsigned, padded to itemsize.
    width = itemsize * 8
    return ",".join(f"0x{int(v) & ((1 << width) - 1):0{itemsize * 2}x}" for v in row.tolist())


def _value_repr(x: torch.Tensor) -> str:
    """Shortest decimal that round-trips to the same bits in x's own dtype."""
    if x.dtype == torch.bool or not (x.is_floating_point() or x.is_complex()):
        return str(x.item())
    if x.is_complex():
        return repr(complex(x.to(torch.complex128).item()))
    v = x.to(torch.float64).item()
    if not math.isfinite(v):
        return repr(v)  # "nan", "inf", "-inf"
    for p in range(1, 18):
        s = float(f"{v:.{p}g}")
        if bitwise_equal(torch.tensor(s, dtype=torch.float64).to(x.dtype), x):
            return repr(s)
    return repr(v)


def _unravel(flat: int, shape) -> list:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return index[::-1]


def _int_absdiff(sa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """|a - b| as float64 for integer/bool tensors without int64 overflow."""
    if sa.dtype == torch.uint64:  # little arithmetic support; float64 is close enough
        return (sa.to(torch.float64) - sb.to(torch.float64)).abs_()
    ia, ib = sa.to(torch.int64), sb.to(torch.int64)
    if sa.dtype != torch.int64:
        return (ia - ib).abs_().to(torch.float64)  # narrower ints cannot overflow int64
    # Same-sign differences are exact in int64; opposite-sign ones are large
    # enough that float64 rounding is irrelevant, and float cannot overflow.
    opposite = (ia < 0) != (ib < 0)
    same = (ia - torch.where(opposite, ia, ib)).abs_().to(torch.float64)
    return torch.where(opposite, (ia.to(torch.float64) - ib.to(torch.float64)).abs_(), same)


def _float_absdiff(fa: torch.Tensor, fb: torch.Tensor) -> torch.Tensor:
    """|a - b| in float64, 0 where values are equal (inf - inf would be NaN)."""
    if fa.is_complex():
        # Per component, so (inf+1j) vs (inf+2j) is 1 rather than NaN.
        d = _float_absdiff(torch.view_as_real(fa), torch.view_as_real(fb))
        return torch.hypot(d[..., 0], d[..., 1])
    return (fa - fb).abs_().masked_fill_(fa == fb, 0.0)


def _max(t: torch.Tensor, floor):
    return max(t.max().item(), floor) if t.numel() else floor


def compare_tensors(a: torch.Tensor, b: torch.Tensor, tol: Optional[Tolerance] = None) -> TensorDiff:
    tol_on = tol is not None and tol.active()
    diff = TensorDiff(equal=False, dtype_a=str(a.dtype), dtype_b=str(b.dtype),
                      shape_a=list(a.shape), shape_b=list(b.shape), numel=a.numel())
    if a.dtype != b.dtype:
        diff.reason = f"dtype differs: {a.dtype} vs {b.dtype}"
    elif a.shape != b.shape:
        diff.reason = f"shape differs: {list(a.shape)} vs {list(b.shape)}"
    if diff.reason is not None:
        diff.within_tolerance = False if tol_on else None
        return diff

    is_float = a.dtype in FLOAT_DTYPES
    a = a.contiguous()
    b = _same_device(a, b).contiguous()
    ra, rb = raw_bits(a), raw_bits(b)
    if torch.equal(ra, rb):  # fast path: the common case in a bitwise tool
        diff.equal, diff.mismatched, diff.max_abs, diff.max_rel = True, 0, 0.0, 0.0
        diff.max_ulp = diff.max_ulp_raw = 0 if is_float else None
        diff.sign_flips = 0 if is_float else None
        diff.within_tolerance = True if tol_on else None
        return diff

    # Work only on the mismatching elements: identical bits contribute zero to
    # every metric and always pass tolerance, so this bounds the temporaries.
    ra, rb = ra.reshape(a.numel(), -1), rb.reshape(a.numel(), -1)
    idx = (ra != rb).any(dim=1).nonzero().squeeze(1)
    first = int(idx[0])
    diff.mismatched = idx.numel()
    # Everything differs (e.g. a shifted run): use views instead of gathering.
    sel = idx if diff.mismatched < a.numel() else slice(None)
    sa, sb = a.reshape(-1)[sel], b.reshape(-1)[sel]
    diff.first_index = _unravel(first, a.shape)
    diff.first_a, diff.first_b = _value_repr(sa[0]), _value_repr(sb[0])
    itemsize = ra.element_size()
    diff.first_a_bits, diff.first_b_bits = _hex(ra[first], itemsize), _hex(rb[first], itemsize)

    if a.is_floating_point() or a.is_complex():
        wide = torch.complex128 if a.is_complex() else torch.float64
        fa, fb = sa.to(wide), sb.to(wide)
        nan_a, nan_b = fa.isnan(), fb.isnan()
        any_nan = nan_a | nan_b
        absdiff = _float_absdiff(fa, fb).masked_fill_(any_nan, 0.0)
        tiny = torch.finfo(a.dtype).tiny  # complex dtypes report their component's
        diff.nan_mismatch = int((nan_a ^ nan_b).sum())
    else:
        fb = sb.to(torch.float64)
        absdiff = _int_absdiff(sa, sb)
        any_nan = None
        tiny = 1.0  # integers: relative error against |b|, but never divide by 0
    absb = fb.abs()
    diff.max_abs = float(_max(absdiff, 0.0))
    # Relative to the larger magnitude of the pair, max(|a|, |b|): symmetric in a and b and bounded (1 where
    # one side is 0, 2 where the signs are opposite), so a value near zero cannot blow it up to 1e35 the way
    # |a - b| / |b| does. An infinite difference is infinitely relative; checking it up front also keeps
    # inf / inf = NaN out of the division.
    if diff.max_abs == math.inf:
        diff.max_rel = math.inf
    else:
        absa = (fa if a.is_floating_point() or a.is_complex() else sa.to(torch.float64)).abs()
        diff.max_rel = float(_max(absdiff / torch.maximum(absa, absb).clamp(min=tiny), 0.0))

    ulp = None
    if is_float:
        ia, ib = ra[sel, 0], rb[sel, 0]
        ulp = _ulp_from_bits(ia, ib, itemsize * 8).masked_fill_(any_nan, -1)
        diff.max_ulp_raw = int(_max(ulp, 0))
        # A pair of non-zero values of opposite sign is a sign flip: its ULP distance counts every float between
        # them, through zero (about 2 * 16000 for two tiny bf16 values), which says nothing about the error.
        # Flips are counted on their own; max_ulp is over the pairs whose signs agree (a zero agrees with both).
        flips = ((ia < 0) != (ib < 0)) & (fa != 0) & (fb != 0) & ~any_nan
        diff.sign_flips = int(flips.sum())
        diff.max_ulp = int(_max(ulp.masked_fill(flips, -1), 0))

    if tol_on:
        ok = torch.zeros(idx.numel(), dtype=torch.bool, device=a.device)
        if tol.atol is not None or tol.rtol is not None:
            close = absdiff <= (tol.atol or 0.0) + (tol.rtol or 0.0) * absb
            if any_nan is not None:  # float/complex
                # rtol * inf would let anything be "close" to an infinity.
                close = torch.where(fa.isinf() | fb.isinf(), fa == fb, close)
            ok |= close
        if tol.ulp is not None and ulp is not None:
            ok |= ulp <= tol.ulp  # the raw distance: a sign flip passes only between neighbours of zero  # the -1 of NaN pairs is settled by the NaN rule below
        # Non-float dtypes have no ULP notion: with only a ulp tolerance they
        # must match exactly, which ok=False for every mismatch expresses.
        if any_nan is not None:
            ok = torch.where(any_nan, nan_a & nan_b, ok)  # NaN positions must agree
        diff.within_tolerance = bool(ok.all())
    return diff
