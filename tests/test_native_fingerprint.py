"""The C kernel computes the fingerprint every trace relies on: it must give exactly the torch path's (and the
plain-Python reference's) numbers, on every layout and dtype, with every vector kernel this CPU runs."""
from __future__ import annotations

import math
import shutil
import sysconfig

import pytest
import torch

from divtrace.trace import fingerprint as fp
from divtrace.trace.records import json_safe
from native_kernels import kernel, native_kernels  # noqa: F401 (kernel: a fixture)

pytestmark = pytest.mark.skipif(fp._native is None, reason="divtrace._native not built (no C compiler at install)")


def test_built_where_a_compiler_is():
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}) on this machine")
    assert fp.IMPLEMENTATION == "native"
    assert fp._native.use_isa(None) in ("avx512", "avx2", "generic")


def _torch_hash(t):
    return fp.tensor_hash(t.contiguous(), fused=True)


def _values(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return (torch.rand(n, generator=g) > 0.5).reshape(shape)
    if not dtype.is_floating_point and not dtype.is_complex:
        return torch.randint(-100, 100, (n,), generator=g).to(dtype).reshape(shape)
    return (torch.randn(n, generator=g) * 3).to(dtype).reshape(shape)


LAYOUTS = {
    "contiguous": lambda x: x,
    "transposed": lambda x: x.transpose(0, 1),
    "permuted": lambda x: x.permute(2, 0, 1),
    "step": lambda x: x[:, ::2],
    "offset": lambda x: x[1:],
    "expanded": lambda x: x[:1].expand(3, -1, -1),
    "row": lambda x: x[1, :, 0],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8,
                                   torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.uint8])
@pytest.mark.parametrize("shape", [(3, 5, 7), (5, 64, 33), (4, 300, 130)])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_matches_the_torch_path_on_every_layout(kernel, dtype, shape, layout):
    x = LAYOUTS[layout](_values(dtype, shape, hash((layout, shape)) % 1000))
    assert fp.tensor_hash(x) == _torch_hash(x)
    if x.numel() < 2000:
        assert fp.tensor_hash(x) == fp.reference_hash(x)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 1023, 1024, 1025, 4097, 70_001])
@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32, torch.float64])
def test_lane_widths_and_block_edges(kernel, n, dtype):
    # odd byte counts give 1- and 2-byte lanes; 70,001 fp32 elements cross the 64 KiB staging buffer
    x = _values(dtype, (n,), n)
    assert fp.tensor_hash(x) == _torch_hash(x)
    strided = _values(dtype, (n, 2), n + 1)[:, 1]  # the staged (gathered) path, same lengths
    assert fp.tensor_hash(strided) == _torch_hash(strided)
    if n <= 4097:
        assert fp.tensor_hash(x) == fp.reference_hash(x)


def test_scalars_and_empty(kernel):
    for x in (torch.tensor(1.5), torch.tensor(-0.0), torch.tensor(7, dtype=torch.int64), torch.zeros(0),
              torch.zeros(3, 0, 2), torch.arange(512.0).view(2, 256)[:, 0:1][0]):
        assert fp.tensor_hash(x) == _torch_hash(x) == fp.reference_hash(x)
    assert fp.tensor_hash(torch.tensor(0.0)) != fp.tensor_hash(torch.tensor(-0.0))


def test_every_flipped_bit_is_seen_in_every_block(kernel):
    x = torch.randn(3 * 1024 + 5, generator=torch.Generator().manual_seed(3))
    base = fp.tensor_hash(x)
    raw = x.view(torch.int32)
    for i in (0, 1, 1023, 1024, 2047, 3000, 3 * 1024 + 4):
        for bit in range(32):
            y = raw.clone()
            y[i] ^= (1 << bit) if bit < 31 else -(1 << 31)
            assert fp.tensor_hash(y.view(torch.float32)) != base, (i, bit)


def _torch_stats(x):
    return json_safe(fp.summary_stats(x.contiguous()))


def _close(a, b):
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return a == b or abs(a - b) <= 1e-5 * max(1.0, abs(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("case", ["plain", "nan", "inf", "all_nan", "signed_zero", "transposed", "tail"])
def test_stats_match_the_torch_path(kernel, dtype, case):
    x = torch.randn(37, 41, generator=torch.Generator().manual_seed(5)).to(dtype)
    if case == "nan":
        x[3, 4] = math.nan
        x[30, 1] = math.nan
    elif case == "inf":
        x[0, 0], x[5, 5], x[6, 6] = math.inf, -math.inf, math.nan
    elif case == "all_nan":
        x = torch.full((5, 7), math.nan, dtype=dtype)
    elif case == "signed_zero":
        x = torch.tensor([-0.0, 0.0] * 40, dtype=dtype)
    elif case == "transposed":
        x = x.t()
    elif case == "tail":
        x = x.reshape(-1)[:19]
    h, stats = fp.fingerprint(x)
    assert h == _torch_hash(x)
    want = _torch_stats(x)
    assert set(stats) == set(want)
    for k in ("min", "max", "nan", "inf", "absmax"):
        assert stats[k] == want[k] or (isinstance(want[k], float) and math.isnan(want[k])), (k, stats, want)
    assert _close(stats["mean"], want["mean"]), (stats, want)


def _summary_in_python(x, stats: bool):
    """What fingerprint.py made of the kernel's raw tuple before the summary was built in C (503b314 and older)."""
    n = x.numel() * x.element_size()
    lane = 4 if n % 4 == 0 else 2 if n % 2 == 0 else 1
    u = fp._WEIGHTS.outer_all(-(-n // lane // fp._BLOCK))
    kind = fp._STATS_KIND.get(x.dtype, 0) if stats else 0
    h0, h1, st = fp._native.fingerprint(x.data_ptr(), x.element_size(), x.shape, x.stride(), u.data_ptr(),
                                        u.stride(0), u.shape[1], kind)
    h = f"{h0:016x}{h1:016x}"
    if st is None:
        return h, None
    lo, hi, total, finite, nan, inf = st
    if not finite:
        return h, {"min": "nan", "max": "nan", "mean": "nan", "absmax": "nan", "nan": nan, "inf": inf}
    mean = total / finite
    return h, {"min": lo, "max": hi, "mean": mean if math.isfinite(mean) else repr(mean), "absmax": max(-lo, hi),
               "nan": nan, "inf": inf}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])
def test_the_summary_made_in_c_is_the_one_python_made(kernel, dtype):
    """fingerprint_summary formats the hash and builds the stats dict in C; it must give exactly what the
    Python code did from the raw tuple: the same floats (signed zeros included), counts and key order."""
    if fp._native is None:
        pytest.skip("divtrace._native was not built")
    g = torch.Generator().manual_seed(11)
    cases = [torch.randn(37, 41, generator=g), torch.tensor([-0.0, 0.0] * 9), torch.tensor([-0.0] * 5),
             torch.tensor([0.0, -0.0]), torch.full((6,), math.nan), torch.tensor([1.0, math.inf, -2.0]),
             torch.tensor([-3.0, -1.0]), torch.tensor([1e-40, -1e-42, 5e-45]), torch.randn(3, 700, generator=g).t(),
             torch.full((64,), 1.7e308, dtype=torch.float64), torch.randn(5, generator=g)[:3]]
    for x in cases:
        x = x.to(dtype) if x.dtype != torch.float64 or dtype != torch.float32 else x
        for stats in (True, False):
            want = _summary_in_python(x, stats)
            got = fp._native_pass(x, stats)
            if want[1] is None and stats:  # no stats kind (an integer dtype): Python's own summary, as before
                assert got[0] == want[0] and got[1] == {}
                continue
            assert repr(got) == repr(want), (x, stats)  # repr: -0.0 vs 0.0, NaN, key order


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_half_precision_value_converts_exactly(kernel, dtype):
    # Each row holds 32 copies of one bit pattern, so the vector loops see it: min == max == the value.
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    rows = bits.view(dtype).reshape(-1, 1).expand(-1, 32).contiguous()
    want = rows[:, 0].float().tolist()
    for i in range(0, rows.shape[0], 97):  # a spread of patterns: normals, subnormals, both zeros, Inf, NaN
        _, stats = fp.fingerprint(rows[i])
        w = want[i]
        if math.isnan(w):
            assert stats["nan"] == 32 and stats["min"] == "nan"
        elif math.isinf(w):
            assert stats["inf"] == 32 and stats["min"] == "nan"
        else:
            assert stats["min"] == stats["max"] == w and math.copysign(1, stats["min"]) == math.copysign(1, w), i
    _, stats = fp.fingerprint(rows.reshape(-1))
    finite = rows[:, 0].float()[torch.isfinite(rows[:, 0].float())]
    assert stats["min"] == finite.min().item() and stats["max"] == finite.max().item()
    assert stats["nan"] == 32 * int(torch.isnan(rows[:, 0].float()).sum())
    assert stats["inf"] == 32 * 2


def test_fp64_sum_overflow_is_not_a_nan(kernel):
    x = torch.full((64,), 1.7e308, dtype=torch.float64)
    _, stats = fp.fingerprint(x)
    assert stats["nan"] == stats["inf"] == 0 and stats["min"] == stats["max"] == 1.7e308
    assert stats["mean"] == "inf"  # the sum of finite values overflows; stored as strict-JSON text


def test_kernels_agree_with_each_other():
    kernels = native_kernels()
    if len(kernels) < 2:
        pytest.skip("one kernel on this CPU")
    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).t()
    got = set()
    for k in kernels:
        fp._native.use_isa(k)
        h, st = fp.fingerprint(x)
        got.add((h, st["min"], st["max"], st["nan"], st["inf"], round(st["mean"], 5)))  # sums: another order
    fp._native.use_isa(None)
    assert len(got) == 1, got
