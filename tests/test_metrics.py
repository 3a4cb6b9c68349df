import json
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from divtrace.compare.metrics import (
    FLOAT_DTYPES, Tolerance, bitwise_equal, compare_tensors, raw_bits, ulp_distance,
)

INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def from_bits(values, dtype):
    """Build a tensor of `dtype` from raw (unsigned) bit patterns."""
    size = torch.empty((), dtype=dtype).element_size()
    signed = [v - (1 << (8 * size)) if v >= 1 << (8 * size - 1) else v for v in values]
    return torch.tensor(signed, dtype=INT_OF_SIZE[size]).view(dtype)


def flip_bit(t, flat_pos, bit):
    bits = raw_bits(t).clone()
    nbits = bits.element_size() * 8
    mask = -(1 << (nbits - 1)) if bit == nbits - 1 else 1 << bit
    bits.view(-1)[flat_pos] ^= mask
    return bits.view(t.dtype)


# --- raw_bits ---------------------------------------------------------------

def test_raw_bits_shapes_and_dtypes():
    assert raw_bits(torch.tensor(1.0)).dtype == torch.int32
    assert raw_bits(torch.tensor(1.0)).shape == ()
    assert int(raw_bits(torch.tensor(1.0))) == 0x3F800000
    assert raw_bits(torch.tensor([True, False])).tolist() == [1, 0]
    assert raw_bits(torch.zeros(2, 3, dtype=torch.complex64)).shape == (2, 3, 2)
    assert raw_bits(torch.zeros(2, dtype=torch.complex128)).dtype == torch.int64
    assert raw_bits(torch.empty(0, 4, dtype=torch.float16)).shape == (0, 4)
    assert raw_bits(torch.tensor([1.0, 2.0]).expand(3, 2)).shape == (3, 2)
    assert raw_bits(torch.arange(6.0).reshape(2, 3).t()).tolist() == \
        raw_bits(torch.arange(6.0).reshape(2, 3).t().contiguous()).tolist()
    for dt in FLOAT_DTYPES:
        assert raw_bits(torch.ones(3, dtype=dt)).element_size() == torch.ones(1, dtype=dt).element_size()


# --- bitwise basics ---------------------------------------------------------

def test_negative_zero_differs_bitwise_but_zero_ulp():
    a, b = torch.tensor([0.0]), torch.tensor([-0.0])
    assert not bitwise_equal(a, b)
    d = compare_tensors(a, b)
    assert not d.equal and d.mismatched == 1
    assert d.max_ulp == 0 and d.max_abs == 0.0
    assert d.first_a == "0.0" and d.first_b == "-0.0"
    assert d.first_a_bits == "0x00000000" and d.first_b_bits == "0x80000000"
    assert ulp_distance(a, b).tolist() == [0]


def test_nan_payloads():
    n1 = from_bits([0x7FC00000], torch.float32)
    n2 = from_bits([0x7FC00001], torch.float32)
    assert bitwise_equal(n1, n1.clone())
    assert compare_tensors(n1, n1.clone()).equal
    assert not bitwise_equal(n1, n2)
    d = compare_tensors(n1, n2)
    assert not d.equal and d.mismatched == 1 and d.nan_mismatch == 0
    assert d.first_a == "nan" and d.first_b_bits == "0x7fc00001"
    assert ulp_distance(n1, n2).tolist() == [-1]


def test_dtype_differs_same_values():
    d = compare_tensors(torch.ones(3), torch.ones(3, dtype=torch.float64))
    assert not d.equal and d.mismatched is None
    assert d.reason == "dtype differs: torch.float32 vs torch.float64"
    assert d.dtype_a == "torch.float32" and d.dtype_b == "torch.float64"
    assert not bitwise_equal(torch.ones(3), torch.ones(3, dtype=torch.float64))


def test_shape_differs_same_bytes():
    a = torch.arange(6.0).reshape(2, 3)
    b = torch.arange(6.0).reshape(3, 2)
    assert not bitwise_equal(a, b)
    d = compare_tensors(a, b)
    assert not d.equal and d.reason == "shape differs: [2, 3] vs [3, 2]"
    assert d.shape_a == [2, 3] and d.shape_b == [3, 2] and d.within_tolerance is None
    assert compare_tensors(a, b, Tolerance(atol=1e9)).within_tolerance is False


LOW_BIT_CASES = [  # dtype, bits of 1.5
    ("float64", 0x3FF8000000000000), ("float32", 0x3FC00000), ("float16", 0x3E00),
    ("bfloat16", 0x3FC0), ("float8_e4m3fn", 0x3C), ("float8_e5m2", 0x3E),
    ("float8_e4m3fnuz", 0x44), ("float8_e5m2fnuz", 0x42),
]


@pytest.mark.parametrize("name,one_five", LOW_BIT_CASES)
def test_single_low_mantissa_flip(name, one_five):
    if not hasattr(torch, name):
        pytest.skip(f"torch has no {name}")
    dt = getattr(torch, name)
    a = torch.tensor([[1.0, 2.0, 3.0], [0.5, 1.5, -2.0]]).to(dt)
    b = flip_bit(a, 4, 0)
    d = compare_tensors(a, b)
    width = a.element_size() * 2
    assert not d.equal and d.reason is None
    assert d.mismatched == 1 and d.max_ulp == 1 and d.nan_mismatch == 0
    assert d.first_index == [1, 1]
    assert d.first_a_bits == f"0x{one_five:0{width}x}"
    assert d.first_b_bits == f"0x{one_five + 1:0{width}x}"
    assert d.first_a == "1.5"
    # first_b is a decimal that converts back to exactly b's element
    assert bitwise_equal(torch.tensor(float(d.first_b), dtype=torch.float64).to(dt), b[1, 1])
    assert d.max_abs == pytest.approx(abs(float(b[1, 1].double()) - 1.5))
    assert d.max_abs > 0
    assert ulp_distance(a, b).tolist() == [[0, 0, 0], [0, 1, 0]]


def test_shortest_repr_fp32():
    a = torch.tensor([1.5])
    d = compare_tensors(a, flip_bit(a, 0, 0))
    assert d.first_b == "1.5000001"


@pytest.mark.parametrize("dt", FLOAT_DTYPES)
def test_ulp_across_zero(dt):
    size = torch.empty((), dtype=dt).element_size()
    sign = 1 << (8 * size - 1)
    a, b = from_bits([1], dt), from_bits([sign | 1], dt)
    assert float(a.double()) > 0 > float(b.double())
    assert ulp_distance(a, b).tolist() == [2]
    d = compare_tensors(a, b)
    assert d.max_ulp_raw == 2 and d.sign_flips == 1 and d.max_ulp == 0  # a flip is not a same-sign ULP distance


def test_inf_vs_finite():
    a = torch.tensor([math.inf, 1.0])
    b = torch.tensor([torch.finfo(torch.float32).max, 1.0])
    d = compare_tensors(a, b)
    assert d.max_abs == math.inf and d.max_rel == math.inf
    assert d.max_ulp == 1 and d.mismatched == 1
    assert d.first_a == "inf"
    assert compare_tensors(torch.tensor([1.0]), torch.tensor([-math.inf])).max_rel == math.inf
    js = json.dumps(d.to_dict(), allow_nan=False)
    assert json.loads(js)["max_abs"] == "inf"
    # equal infinities contribute nothing (inf - inf would be NaN)
    e = compare_tensors(torch.tensor([math.inf, 1.0]), torch.tensor([math.inf, 2.0]))
    assert e.max_abs == 1.0


def test_ulp_saturates_float64():
    a = torch.tensor([-math.inf, -1.0], dtype=torch.float64)
    b = torch.tensor([math.inf, 1.0], dtype=torch.float64)
    assert ulp_distance(a, b).tolist() == [2**63 - 1, 2 * 0x3FF0000000000000]
    d = compare_tensors(a, b)
    assert d.max_ulp_raw == 2**63 - 1 and d.sign_flips == 2 and d.max_ulp == 0
    f = ulp_distance(torch.tensor([-math.inf]), torch.tensor([math.inf]))
    assert f.tolist() == [2 * 0x7F800000]


def test_ulp_distance_errors_and_nan():
    with pytest.raises(ValueError):
        ulp_distance(torch.ones(2), torch.ones(3))
    with pytest.raises(ValueError):
        ulp_distance(torch.ones(2), torch.ones(2, dtype=torch.float16))
    with pytest.raises(TypeError):
        ulp_distance(torch.ones(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32))
    r = ulp_distance(torch.tensor([math.nan, 1.0, 1.0]), torch.tensor([1.0, math.nan, 1.0]))
    assert r.dtype == torch.int64 and r.tolist() == [-1, -1, 0]
    d = compare_tensors(torch.tensor([math.nan, 1.0]), torch.tensor([1.0, 1.0]))
    assert d.nan_mismatch == 1 and d.max_abs == 0.0 and d.max_ulp == 0


def test_max_rel_denominator():
    """max_rel is |a - b| / max(|a|, |b|): symmetric, 1 against an exact zero, 2 for opposite signs."""
    d = compare_tensors(torch.tensor([100.0, 1.0]), torch.tensor([100.5, 1.0]))
    assert d.max_rel == pytest.approx(0.5 / 100.5)
    assert compare_tensors(torch.tensor([100.5]), torch.tensor([100.0])).max_rel == pytest.approx(0.5 / 100.5)
    z = compare_tensors(torch.tensor([1.0]), torch.tensor([0.0]))
    assert z.max_rel == pytest.approx(1.0)
    h = compare_tensors(torch.tensor([1.0], dtype=torch.float16), torch.tensor([0.0], dtype=torch.float16))
    assert h.max_rel == pytest.approx(1.0)
    tiny = torch.finfo(torch.bfloat16).tiny
    near_zero = compare_tensors(torch.tensor([1e-3, 3 * tiny], dtype=torch.bfloat16),
                                torch.tensor([1e-3, -tiny], dtype=torch.bfloat16))
    assert near_zero.max_rel == pytest.approx(4 / 3, rel=1e-2)  # was |a - b| / |b| = 4 (1e35 for |b| ~ 1e-38)
    assert compare_tensors(torch.tensor([0.0]), torch.tensor([-0.0])).max_rel == 0.0  # no 0/0


def test_ulp_across_zero_is_a_sign_flip():
    """A tiny value that changes sign is a sign flip, not ~30000 ULP; the old figure stays as max_ulp_raw."""
    a = torch.tensor([1.0, 1e-4, 0.5], dtype=torch.bfloat16)
    b = torch.tensor([1.0, -1e-4, 0.5], dtype=torch.bfloat16)
    b[2] = torch.tensor(0.50390625, dtype=torch.bfloat16)
    d = compare_tensors(a, b)
    assert d.mismatched == 2 and d.sign_flips == 1
    assert d.max_ulp == 1
    assert d.max_ulp_raw > 28000  # through zero: every bf16 between -1e-4 and 1e-4
    only_flip = compare_tensors(torch.tensor([1e-4], dtype=torch.bfloat16), torch.tensor([-1e-4], dtype=torch.bfloat16))
    assert only_flip.sign_flips == 1 and only_flip.max_ulp == 0 and only_flip.max_ulp_raw > 28000
    # a zero agrees with both signs: 0 vs -x is a ULP distance (from zero), not a flip; -0.0 vs 0.0 is neither
    zero = compare_tensors(torch.tensor([0.0, 0.0]), torch.tensor([-0.0, -torch.finfo(torch.float32).tiny]))
    assert zero.sign_flips == 0 and zero.max_ulp == zero.max_ulp_raw == 2 ** 23
    equal = compare_tensors(a, a.clone())
    assert equal.sign_flips == 0 and equal.max_ulp_raw == 0
    assert compare_tensors(torch.tensor([1, 2]), torch.tensor([1, 3])).sign_flips is None  # ints: no ULP at all


def test_ulp_tolerance_keeps_the_raw_distance():
    """--ulp N compares the raw distance: a flip between the two smallest subnormals (2 ULP) passes --ulp 2,
    a flip of 1e-4 does not (it passes an --atol that covers it)."""
    sub = torch.tensor([1], dtype=torch.int32).view(torch.float32)
    d = compare_tensors(sub, -sub, Tolerance(ulp=2))
    assert d.sign_flips == 1 and d.within_tolerance is True
    a, b = torch.tensor([1e-4], dtype=torch.bfloat16), torch.tensor([-1e-4], dtype=torch.bfloat16)
    assert compare_tensors(a, b, Tolerance(ulp=2)).within_tolerance is False
    assert compare_tensors(a, b, Tolerance(ulp=2, atol=1e-3)).within_tolerance is True


# --- non-float dtypes -------------------------------------------------------

def test_int_tensors():
    a = torch.tensor([1, 2, 3], dtype=torch.int32)
    b = torch.tensor([1, 5, 3], dtype=torch.int32)
    d = compare_tensors(a, b)
    assert d.mismatched == 1 and d.max_abs == 3.0 and d.max_ulp is None
    assert d.first_index == [1] and d.first_a == "2" and d.first_b == "5"
    assert d.first_a_bits == "0x00000002" and d.first_b_bits == "0x00000005"
    n = compare_tensors(torch.tensor([-1], dtype=torch.int16), torch.tensor([0], dtype=torch.int16))
    assert n.first_a_bits == "0xffff" and n.max_abs == 1.0
    big = compare_tensors(torch.tensor([-2**63, 2**62]), torch.tensor([2**63 - 1, 2**62 + 1]))
    assert big.max_abs == pytest.approx(2.0**64) and big.mismatched == 2
    assert compare_tensors(a, a.clone()).equal


def test_bool_tensors():
    d = compare_tensors(torch.tensor([True, False]), torch.tensor([True, True]))
    assert d.mismatched == 1 and d.first_index == [1]
    assert d.first_a == "False" and d.first_b == "True"
    assert d.first_a_bits == "0x00" and d.first_b_bits == "0x01" and d.max_ulp is None


def test_complex_tensors():
    a = torch.tensor([1 + 2j, 3 + 4j], dtype=torch.complex64)
    b = torch.tensor([1 + 2j, 3 + 7j], dtype=torch.complex64)
    d = compare_tensors(a, b)
    assert d.mismatched == 1 and d.first_index == [1] and d.max_abs == 3.0
    assert d.max_ulp is None and d.first_b == "(3+7j)"
    assert d.first_a_bits == "0x40400000,0x40800000"
    assert compare_tensors(a.to(torch.complex128), a.to(torch.complex128)).equal
    # infinite components: equal ones contribute 0 instead of inf - inf = NaN
    inf_a = torch.complex(torch.tensor([math.inf, math.inf]), torch.tensor([0.0, 1.0]))
    inf_b = torch.complex(torch.tensor([math.inf, math.inf]), torch.tensor([-0.0, 2.0]))
    e = compare_tensors(inf_a, inf_b)
    assert e.mismatched == 2 and e.max_abs == 1.0 and e.nan_mismatch == 0
    nan_c = torch.complex(torch.tensor([math.nan]), torch.tensor([1.0]))
    f = compare_tensors(nan_c, torch.tensor([1 + 1j], dtype=torch.complex64), Tolerance(atol=10.0))
    assert f.nan_mismatch == 1 and f.within_tolerance is False


# --- shapes and layouts -----------------------------------------------------

def test_zero_dim_and_empty():
    d = compare_tensors(torch.tensor(1.0), torch.tensor(2.0))
    assert d.first_index == [] and d.numel == 1 and d.shape_a == [] and d.max_ulp == 2**23
    assert compare_tensors(torch.tensor(1.0), torch.tensor(1.0)).equal
    e = compare_tensors(torch.empty(0, 3), torch.empty(0, 3), Tolerance(ulp=0))
    assert e.equal and e.mismatched == 0 and e.numel == 0 and e.within_tolerance is True
    assert not compare_tensors(torch.empty(0, 3), torch.empty(3, 0)).equal


def test_non_contiguous_and_expanded():
    base = torch.arange(6.0).reshape(2, 3)
    t = base.t()
    assert compare_tensors(t, t.contiguous()).equal
    changed = t.contiguous()
    changed[2, 0] = 99.0
    d = compare_tensors(t, changed)
    assert d.mismatched == 1 and d.first_index == [2, 0] and d.first_a == "2.0"
    ex = torch.tensor([1.0, 2.0]).expand(3, 2)
    full = ex.contiguous()
    full[2, 1] = 5.0
    d = compare_tensors(ex, full)
    assert d.mismatched == 1 and d.first_index == [2, 1] and d.max_abs == 3.0
    assert bitwise_equal(ex, ex.contiguous())


# --- tolerance --------------------------------------------------------------

def test_tolerance_active():
    assert not Tolerance().active()
    assert Tolerance(atol=0.0).active() and Tolerance(ulp=0).active()
    assert compare_tensors(torch.ones(2), torch.zeros(2)).within_tolerance is None


def test_atol_rtol():
    a = torch.tensor([1.0, 2.0], dtype=torch.float64)
    b = torch.tensor([1.0, 2.001], dtype=torch.float64)
    assert compare_tensors(a, b, Tolerance(atol=1e-2)).within_tolerance is True
    d = compare_tensors(a, b, Tolerance(atol=1e-4))
    assert d.within_tolerance is False and not d.matches()
    ok = compare_tensors(a, b, Tolerance(atol=1e-2))
    assert not ok.equal and ok.matches()
    x, y = torch.tensor([100.0]), torch.tensor([100.5])
    assert compare_tensors(x, y, Tolerance(rtol=0.01)).within_tolerance is True
    assert compare_tensors(x, y, Tolerance(rtol=0.001)).within_tolerance is False
    # rtol is relative to b
    assert compare_tensors(torch.tensor([0.0]), torch.tensor([1.0]), Tolerance(rtol=0.5)).within_tolerance is False
    assert compare_tensors(torch.tensor([1.0]), torch.tensor([0.0]), Tolerance(rtol=2.0)).within_tolerance is False
    both = Tolerance(atol=0.1, rtol=0.01)
    assert compare_tensors(torch.tensor([100.0]), torch.tensor([101.0]), both).within_tolerance is True
    assert compare_tensors(torch.tensor([99.8]), torch.tensor([101.0]), both).within_tolerance is False
    # infinities only pass when equal, even with a huge rtol
    assert compare_tensors(torch.tensor([1.0]), torch.tensor([math.inf]), Tolerance(rtol=1.0)).within_tolerance is False
    assert compare_tensors(torch.tensor([math.inf, 1.0]), torch.tensor([math.inf, 1.5]),
                           Tolerance(atol=1.0)).within_tolerance is True
    assert compare_tensors(torch.tensor([3], dtype=torch.int32), torch.tensor([4], dtype=torch.int32),
                           Tolerance(atol=1)).within_tolerance is True


def test_ulp_tolerance_and_either_criterion():
    a = torch.tensor([1.0])
    b = flip_bit(a, 0, 1)  # two ULPs above 1.0
    assert compare_tensors(a, b, Tolerance(ulp=2)).within_tolerance is True
    assert compare_tensors(a, b, Tolerance(ulp=1)).within_tolerance is False
    assert compare_tensors(a, b, Tolerance(ulp=0, atol=1e-3)).within_tolerance is True  # via atol
    big = torch.tensor([1e30])
    big_b = flip_bit(big, 0, 0)
    assert compare_tensors(big, big_b, Tolerance(atol=1e-3)).within_tolerance is False
    assert compare_tensors(big, big_b, Tolerance(atol=1e-3, ulp=1)).within_tolerance is True  # via ulp
    assert compare_tensors(torch.tensor([0.0]), torch.tensor([-0.0]), Tolerance(ulp=0)).within_tolerance is True
    # ints have no ULP notion: only exact match passes a ulp-only tolerance
    i = torch.tensor([1], dtype=torch.int32)
    assert compare_tensors(i, i + 1, Tolerance(ulp=5)).within_tolerance is False


def test_nan_positions_and_tolerance():
    a = torch.tensor([math.nan, 1.0])
    assert compare_tensors(a, torch.tensor([1.0, 1.0]), Tolerance(atol=math.inf)).within_tolerance is False
    assert compare_tensors(a, torch.tensor([1.0, 1.0]), Tolerance(ulp=10**9)).within_tolerance is False
    other_nan = torch.cat([from_bits([0x7FC00001], torch.float32), torch.tensor([1.0])])
    d = compare_tensors(a, other_nan, Tolerance(atol=0.0))
    assert not d.equal and d.within_tolerance is True and d.nan_mismatch == 0
    assert compare_tensors(a, a.clone(), Tolerance(atol=0.0)).within_tolerance is True


def test_to_dict_json_safe():
    d = compare_tensors(torch.tensor([1.0, math.nan]), torch.tensor([math.inf, 1.0]), Tolerance(atol=1.0))
    out = json.loads(json.dumps(d.to_dict(), allow_nan=False))
    assert out["max_abs"] == "inf" and out["nan_mismatch"] == 1 and out["first_index"] == [0]
    assert out["within_tolerance"] is False and out["equal"] is False


def test_large_tensor_single_mismatch():
    a = torch.randn(8 * 1024 * 1024, generator=torch.Generator().manual_seed(0))
    b = a.clone()
    assert compare_tensors(a, b).equal
    b[-1] = torch.nextafter(b[-1], torch.tensor(math.inf))
    d = compare_tensors(a, b)
    assert d.mismatched == 1 and d.max_ulp == 1 and d.first_index == [a.numel() - 1]


# --- property ---------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       shape=st.lists(st.integers(1, 5), min_size=0, max_size=3),
       seed=st.integers(0, 2**31 - 1), data=st.data())
def test_single_bit_flip_property(dtype, shape, seed, data):
    g = torch.Generator().manual_seed(seed)
    nbits = 32 if dtype == torch.float32 else 16
    itype = torch.int32 if dtype == torch.float32 else torch.int16
    # random raw bits cover NaNs, infinities, subnormals and signed zeros
    a = torch.randint(-2**(nbits - 1), 2**(nbits - 1), shape, generator=g, dtype=itype).view(dtype)
    pos = data.draw(st.integers(0, max(a.numel() - 1, 0)))
    bit = data.draw(st.integers(0, nbits - 1))
    b = flip_bit(a, pos, bit)
    assert bitwise_equal(a, a.clone())
    assert not bitwise_equal(a, b)
    d = compare_tensors(a, b)
    assert not d.equal and d.mismatched == 1
    expect = []
    for size in reversed(shape):
        expect.append(pos % size)
        pos //= size
    assert d.first_index == expect[::-1]


@pytest.mark.parametrize("dt", [torch.float64, torch.float32, torch.int64, torch.complex128])
def test_inputs_not_mutated(dt):
    a = (torch.arange(12, dtype=torch.float64) - 6).to(dt).reshape(3, 4)
    b = (a * 3).to(dt)
    a0, b0 = a.clone(), b.clone()
    compare_tensors(a, b, Tolerance(atol=1.0, rtol=0.1, ulp=3))
    if dt.is_floating_point:
        ulp_distance(a, b)
    assert bitwise_equal(a, a0) and bitwise_equal(b, b0)
