"""Kernels torch does not see (Triton launched directly, a C extension writing through a raw pointer) write into
buffers without moving their version counter. A buffer made by an allocating op (empty, zeros, full, ...) is
therefore re-read when it is used again: the trace must hold what the kernel wrote, never the buffer as it was
allocated, and bisect must not call the op that reads it an origin with equal inputs. Here numpy writes through
the buffer's memory, as such a kernel would."""
from __future__ import annotations

import json

import pytest
import torch

from divtrace.trace.hashing.tensor import hash_with_stats as fingerprint  # the scheme traces are written in
from divtrace.trace.reader import Trace
from helpers import record_model
from test_trace_fixtures import cli


class RawKernel(torch.nn.Module):
    def __init__(self, value: float, view: bool = False):
        super().__init__()
        self.value, self.view = value, view

    def forward(self, x):
        o = torch.zeros(2, 3)
        seen = o.t() if self.view else o  # a view taken before the kernel writes sees what it writes
        o.numpy()[:] = self.value  # the "kernel": no torch op, no version bump
        return seen * x


def _mul(t: Trace):
    return next(r for r in t.records if r.kind == "op" and r.op == "aten.mul.Tensor")


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("mode", ["full", "hash"])
def test_bytes_written_behind_torch_are_recorded(tmp_path, mode, view):
    x = torch.ones(3, 2) if view else torch.ones(2, 3)
    with pytest.warns(UserWarning, match="changed without a torch op"):
        record_model(RawKernel(2.5, view), (x,), tmp_path / "t", mode=mode)
    t = Trace(tmp_path / "t")
    inp = _mul(t).inputs[0]
    want = torch.full((2, 3), 2.5)
    want = want.t() if view else want
    assert t.vkey[inp][2] == fingerprint(want)[0]  # not the zeros it was allocated as
    assert t.values[inp].producer is None  # no recorded op made these bytes
    if mode == "full":
        assert torch.equal(t.tensor(inp), want)
    assert any("changed without a torch op" in w for w in t.meta["warnings"])


def test_a_fresh_buffer_read_unchanged_keeps_its_value(tmp_path):
    class Bias(torch.nn.Module):
        def forward(self, x):
            b = torch.zeros(3)
            return (x + b) * 2 + b

    record_model(Bias(), (torch.ones(3),), tmp_path / "t", mode="hash")
    t = Trace(tmp_path / "t")
    (zeros,) = [r for r in t.records if r.kind == "op" and r.op == "aten.zeros.default"]
    adds = [r for r in t.records if r.kind == "op" and r.op == "aten.add.Tensor"]
    assert [r.inputs[1] for r in adds] == [zeros.outputs[0]] * 2 and not t.meta.get("warnings")


def test_bisect_names_the_input_no_op_made(tmp_path):
    x = torch.ones(2, 3)
    for name, value in (("a", 2.0), ("b", 3.0)):
        with pytest.warns(UserWarning):
            record_model(RawKernel(value), (x,), tmp_path / name, mode="full")
    code, out, err = cli("bisect", tmp_path / "a", tmp_path / "b", "--json")
    r = json.loads(out)
    assert code == 1 and r["first"]["op"] == "aten.mul.Tensor"
    assert r["first"]["outside_input"].startswith("input 0 of aten.mul.Tensor")
    assert any("changed without a torch op" in w for w in r["warnings"])
    code, out, err = cli("bisect", tmp_path / "a", tmp_path / "b")
    assert "an input no recorded op made differs" in out and "inputs bitwise equal" not in out
