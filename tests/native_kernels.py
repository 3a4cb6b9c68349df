"""The C fingerprint kernels this CPU runs (divtrace._native: avx512, avx2, generic), and a fixture that runs a
test once with each: they must all compute the same numbers."""
from __future__ import annotations

import pytest

try:
    from divtrace import _native
except ImportError:
    _native = None


def native_kernels() -> list[str]:
    if _native is None:
        return []
    have = []
    for name in ("avx512", "avx2", "generic"):
        try:
            _native.use_isa(name)
            have.append(name)
        except ValueError:
            pass
    _native.use_isa(None)
    return have


@pytest.fixture(params=native_kernels() or ["none"])
def kernel(request):
    if _native is None:
        pytest.skip("divtrace._native not built")
    _native.use_isa(request.param)
    yield request.param
    _native.use_isa(None)
