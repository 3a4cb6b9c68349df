"""What a comparison asks for (Tolerance) and what it finds (TensorDiff): plain data, no torch, so a bisect of
hash-only traces never imports it. The tensor math that fills a TensorDiff is in divtrace.compare.metrics."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from divtrace.errors import DivtraceError


@dataclass
class Tolerance:
    atol: Optional[float] = None
    rtol: Optional[float] = None
    ulp: Optional[int] = None

    def __post_init__(self):
        for name in ("atol", "rtol", "ulp"):
            v = getattr(self, name)
            if v is not None and not v >= 0:  # NaN too (inf stays: any finite difference passes, NaN still not)
                raise DivtraceError(f"--{name} must be a number >= 0, got {v}")

    def active(self) -> bool:
        return self.atol is not None or self.rtol is not None or self.ulp is not None


@dataclass
class TensorDiff:
    equal: bool
    dtype_a: str
    dtype_b: str
    shape_a: list
    shape_b: list
    numel: int
    reason: Optional[str] = None
    mismatched: Optional[int] = None
    max_abs: Optional[float] = None
    max_rel: Optional[float] = None
    max_ulp: Optional[int] = None  # over the pairs whose signs agree (see sign_flips)
    max_ulp_raw: Optional[int] = None  # over every pair, sign flips counted through zero (what max_ulp was)
    sign_flips: Optional[int] = None  # non-zero pairs of opposite sign
    nan_mismatch: int = 0
    first_index: Optional[list] = None
    first_a: Optional[str] = None
    first_b: Optional[str] = None
    first_a_bits: Optional[str] = None
    first_b_bits: Optional[str] = None
    within_tolerance: Optional[bool] = None

    def matches(self) -> bool:
        return self.equal or bool(self.within_tolerance)

    def to_dict(self) -> dict:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, float) and not math.isfinite(v):
                d[k] = "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        return d
