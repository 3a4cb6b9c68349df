"""Run as a script under TRITON_INTERPRET=1 (tests/test_device_path.py does, where Triton is installed): the device
path's Triton kernels (divtrace.trace.device_kernels), interpreted on the CPU, against the C kernel, value by value,
then a whole recording through them against the CPU path's. Prints "ok" and what the kernels were."""
from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from divtrace.trace import device_kernels as K, device_results as D  # noqa: E402
from divtrace.trace.hashing import weights  # noqa: E402
from divtrace.trace.hashing.rows import row_fingerprints  # noqa: E402
from divtrace.trace.hashing.tensor import hash_with_stats  # noqa: E402
from fp2_cases import values  # noqa: E402


def values_and_rows() -> None:
    outer = lambda b: weights.outer(b, "cpu")  # noqa: E731
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int64, torch.uint8):
        for shape in ((4,), (5, 8), (1024,), (2, 2048), (3, 4096 * 3 + 4), (9000, 2)):
            x = values(dtype, shape, 5)
            if dtype.is_floating_point and x.numel() > 8:
                x.view(-1)[3], x.view(-1)[7] = float("nan"), float("-inf")
            st = dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
            w = K.value_words(x, weights.inner("cpu"), outer, st)
            b = D.DeviceBatches()
            p = D.PendingValue(b.add(w), x.numel(), x.is_floating_point())
            for batch in b.seal():
                batch.land()
            h, s = hash_with_stats(x)
            assert p.hex() == h, (dtype, shape)
            if st:
                g = p.stats()
                assert all(g[k] == s[k] for k in ("min", "max", "nan", "inf", "absmax")), (dtype, shape, g, s)
                assert math.isclose(g["mean"], s["mean"], rel_tol=1e-9, abs_tol=1e-12), (g, s)
            if x.dim() == 2 and (x.shape[1] * x.element_size()) % 4 == 0:
                r = K.row_words(x, weights.inner("cpu")[0], outer)
                assert r.tolist() == row_fingerprints(x).tolist(), (dtype, shape)


def recording() -> None:
    from test_device_path import assert_same_trace, generate, llama, record

    m = llama()
    with tempfile.TemporaryDirectory() as d:
        record(m, Path(d) / "cpu", generate, device=False)
        record(m, Path(d) / "dev", generate, device=True)
        figures = assert_same_trace(Path(d) / "cpu", Path(d) / "dev")
        assert figures["kernels"] == "triton", figures


if __name__ == "__main__":
    K._CPU_INTERPRETED["on"] = True
    values_and_rows()
    recording()
    print("ok", K.status())
