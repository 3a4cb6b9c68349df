"""The device path of the v2 fingerprints never makes the host wait: run on the CPU under a dispatch mode that
fails on every host read of tensor values, every cross-device copy, every value-dependent shape and every tensor
made from host data (tests/nosync.py), and on `meta` tensors, which hold no values at all, it computes the same
numbers as the C kernel (CPU) and returns int64 tensors on the input's device. The weight tables are built on
the device inside the trap too (first use)."""
from __future__ import annotations

import pytest
import torch

from divtrace.trace.hashing import rows as RW, tensor as T, weights
from fp2_cases import torch_path, values
from nosync import HostReadError, HostReadTrap


def _cases(dev: str):
    """(name, thunk) pairs covering every torch code path: whole values, one run, runs at one block phase, runs at
    different phases, runs starting at different bytes of their lanes, rows whole and in column blocks."""
    def v(dtype, shape, seed=0):
        x = values(dtype, shape, seed)
        return x.to(dev) if dev != "meta" else torch.empty(shape, dtype=dtype, device="meta")

    a, b, c = v(torch.float32, (8, 1024)), v(torch.float32, (8, 300)), v(torch.bfloat16, (8, 301))
    d, e = v(torch.int8, (5, 1030)), v(torch.float64, (3, 7, 5))
    return [
        ("whole fp32", lambda: T.tensor_fingerprint(a)),
        ("whole bf16 odd", lambda: T.tensor_fingerprint(c)),
        ("whole strided", lambda: T.tensor_fingerprint(e.transpose(0, 2))),
        ("Shard(0)", lambda: T.tensor_partial(b[3:], b.shape, (3, 0))),
        ("Shard(1), one phase", lambda: T.tensor_partial(a[:, 512:], a.shape, (0, 512))),
        ("Shard(1), phases differ", lambda: T.tensor_partial(b[:, 100:], b.shape, (0, 100))),
        ("Shard(1), mid-lane bf16", lambda: T.tensor_partial(c[:, 1:150], c.shape, (0, 1))),
        ("Shard(1), mid-lane int8", lambda: T.tensor_partial(d[:, 3:1029], d.shape, (0, 3))),
        ("2-D mesh box", lambda: T.tensor_partial(e[1:, 2:5, 1:], e.shape, (1, 2, 1))),
        ("combine", lambda: T.combine([T.tensor_partial(b[:4], b.shape, (0, 0)),
                                        T.tensor_partial(b[4:], b.shape, (4, 0))])),
        ("rows whole", lambda: RW.row_fingerprints(c)),
        ("rows block bf16", lambda: RW.row_fingerprints(c[:, 3:200], (301,), (3,))),
        ("rows inner block", lambda: RW.row_fingerprints(e[:, :, 1:4], (7, 5), (0, 1))),
        ("combine rows", lambda: RW.combine_rows([RW.row_fingerprints(d[:, :7], (1030,), (0,)),
                                                  RW.row_fingerprints(d[:, 7:], (1030,), (7,))])),
    ]


def _fresh_tables():
    weights._INNER.clear()
    weights._OUTER.clear()


@pytest.mark.parametrize("matmul", [True, False], ids=["cpu-matmul", "accelerator-form"])
def test_cpu_torch_path_reads_nothing_back_and_matches_the_kernel(matmul):
    want = {name: fn().tolist() for name, fn in _cases("cpu")}  # C kernel where built
    _fresh_tables()
    with torch_path(matmul):
        with HostReadTrap():
            got = {name: fn() for name, fn in _cases("cpu")}
    assert {k: v.tolist() for k, v in got.items()} == want
    assert all(v.dtype == torch.int64 for v in got.values())


def test_meta_tensors_hold_no_values_and_still_give_fingerprint_tensors():
    _fresh_tables()
    with HostReadTrap():
        got = {name: fn() for name, fn in _cases("meta")}
    rows = {"rows whole": 8, "rows block bf16": 8, "rows inner block": 3, "combine rows": 5}
    for name, v in got.items():
        assert v.device.type == "meta" and v.dtype == torch.int64, name
        assert tuple(v.shape) == (rows.get(name, 2),), name


@pytest.mark.parametrize("bad", ["item", "float", "bool", "mask", "nonzero", "from host"])
def test_the_trap_catches_what_would_wait(bad):
    x = torch.randn(4, 4)
    fn = {"item": lambda: x.sum().item(), "float": lambda: float(x[0, 0]), "bool": lambda: bool(x[0, 0] > 0),
          "mask": lambda: x[x > 0], "nonzero": lambda: torch.nonzero(x), "from host": lambda: torch.tensor([1, 2])}[bad]
    with pytest.raises(HostReadError):
        with HostReadTrap():
            fn()


@pytest.mark.parametrize("bad", ["to cpu", "tolist", "numpy"])
def test_meta_values_cannot_be_read(bad):
    m = torch.empty(4, device="meta")
    fn = {"to cpu": lambda: m.cpu(), "tolist": lambda: m.tolist(), "numpy": lambda: m.numpy()}[bad]
    with pytest.raises((HostReadError, NotImplementedError, RuntimeError, TypeError)):
        with HostReadTrap():
            fn()
