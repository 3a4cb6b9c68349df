"""The fingerprint is what "identical" rests on: it must see every difference, whatever else ran before."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from divtrace.trace.fingerprint import reference_hash, tensor_hash


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16, torch.int8,
                                   torch.int64, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
@pytest.mark.parametrize("n", [0, 1, 3, 1023, 1024, 2049])
def test_torch_kernels_match_the_python_reference(dtype, n):
    g = torch.Generator().manual_seed(n)
    if dtype == torch.bool:
        x = torch.rand(n, generator=g) > 0.5
    elif not dtype.is_floating_point and not dtype.is_complex:
        x = torch.randint(-100, 100, (n,), generator=g).to(dtype)
    else:
        x = torch.randn(n, generator=g).to(dtype)
    h = tensor_hash(x)
    assert h == tensor_hash(x, fused=False) == reference_hash(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_even_number_of_sign_flips_is_seen(dtype):
    # With 64-bit lanes, two sign flips (2**63 each, odd weights) cancelled mod 2**64: a false "identical".
    x = torch.randn(64).to(dtype)
    for i, j in [(0, 2), (1, 3), (5, 7), (0, 1), (10, 50)]:
        y = x.clone()
        y[i], y[j] = -y[i], -y[j]
        assert tensor_hash(x) != tensor_hash(y), (i, j)
    z = torch.zeros(16, dtype=dtype)
    assert tensor_hash(z) != tensor_hash(-z)  # -0.0 vs 0.0


def test_every_single_bit_flip_is_seen():
    x = torch.randn(40, dtype=torch.float64)
    base = tensor_hash(x)
    raw = x.view(torch.uint8)
    for byte in range(raw.numel()):
        for bit in range(8):
            y = raw.clone()
            y[byte] ^= 1 << bit
            assert tensor_hash(y.view(torch.float64)) != base


def test_hash_does_not_depend_on_what_was_hashed_before():
    code = ("import torch\nfrom divtrace.trace.fingerprint import tensor_hash\n"
            "x = torch.arange(5000, dtype=torch.float64)\n{pre}print(tensor_hash(x))\n")
    outs = [subprocess.run([sys.executable, "-c", code.format(pre=pre)], capture_output=True, text=True,
                           check=True).stdout for pre in ("", "tensor_hash(torch.zeros(3_000_000))\n")]
    assert outs[0] == outs[1]


def test_layout_does_not_matter_but_order_does():
    w = torch.randn(300, 70)
    assert tensor_hash(w.t()) == tensor_hash(w.t().contiguous())
    assert tensor_hash(w.t().contiguous().view(300, 70)) != tensor_hash(w)
    e = torch.randn(1, 70).expand(5, 70)
    assert tensor_hash(e) == tensor_hash(e.contiguous())
    one = torch.arange(512.).view(2, 256)[:, 0:1][0]  # one element, stride 256
    assert tensor_hash(one) == reference_hash(one.clone())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8, torch.bool])
def test_slice_starting_mid_lane(dtype):
    # x[1:] of a 2-byte dtype starts 2 bytes into a 4-byte lane: the torch path raised on the int32 view.
    x = torch.randn(4, 9).to(dtype)[1:]
    assert x.storage_offset() and x.is_contiguous()
    assert tensor_hash(x, fused=True) == tensor_hash(x, fused=False) == reference_hash(x) == tensor_hash(x.clone())
