"""With ops=True the dispatch mode stays pushed for the whole record block, between module calls too.

Popping it between calls (ops there are never recorded, and an engine runs as many of them as the model) was
tried and reverted: a dispatch mode the user enters inside the block then sat *below* divtrace's, so the trace
held the op the model called with what the user's mode returned (a patched kernel's result recorded as aten's),
and a mode entered between calls and exited inside one popped divtrace's for the rest of the recording. These
tests pin the behaviour: writes between calls are counted (inference tensors have no version counter), the
user's mode sits above divtrace's, and a reused buffer written by kernels torch does not see is never taken
for the value it was.
"""
from __future__ import annotations

import ctypes

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import divtrace
from divtrace.trace.hashing.tensor import hash_with_stats as fingerprint  # the scheme traces are written in
from divtrace.trace.reader import Trace


class Scale(torch.nn.Module):
    def forward(self, x):
        return x * 3


def _root_inputs(t: Trace) -> list[int]:
    return [c.inputs[0][1] for c in t.roots()]


def test_an_inference_tensor_written_between_calls_is_a_new_value(tmp_path):
    m = Scale()
    with torch.inference_mode():
        buf = torch.ones(2, 4)  # an engine's persistent buffer: no version counter
        with divtrace.record(m, tmp_path / "t", mode="hash", ops=True):
            m(buf)
            buf.mul_(2)  # between calls: no op is recorded there, but the write is counted
            m(buf)
            m(buf)  # unchanged since the last call: the same value again
    t = Trace(tmp_path / "t")
    first, second, third = _root_inputs(t)
    assert first != second and second == third
    assert t.vkey[first][2] == fingerprint(torch.ones(2, 4))[0]
    assert t.vkey[second][2] == fingerprint(torch.full((2, 4), 2.0))[0]
    assert t.values[second].producer is None  # made by no recorded op
    # the ops inside each call read the value the call received
    muls = [r for r in t.records if r.kind == "op" and r.op == "aten.mul.Tensor"]
    assert [r.inputs[0] for r in muls] == [first, second, third]


def test_an_op_output_written_between_calls_is_a_new_value(tmp_path):
    m = Scale()
    with torch.inference_mode():
        with divtrace.record(m, tmp_path / "t", mode="hash", ops=True):
            y = m(torch.ones(3))
            y.add_(1)  # the output of call 0, changed before call 1 reads it
            m(y)
    t = Trace(tmp_path / "t")
    out0 = t.roots()[0].outputs[0][1]
    in1 = _root_inputs(t)[1]
    assert in1 != out0
    assert t.vkey[in1][2] == fingerprint(torch.full((3,), 4.0))[0]


class Patched(TorchDispatchMode):
    """A user's mode that patches a kernel: aten.mul.Tensor's result, then + 1e-3."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        out = func(*args, **(kwargs or {}))
        return out + 1e-3 if func is torch.ops.aten.mul.Tensor else out


def test_a_mode_entered_inside_the_block_sits_above_divtraces(tmp_path):
    """divtrace records what runs below the user's mode: the patched mul is aten.mul then aten.add, each output
    what that op made (regression: with divtrace's mode pushed per call above it, the trace said aten.mul made
    the patched result), and the user's mode never sees divtrace's own bookkeeping ops."""
    m = Scale()
    with divtrace.record(m, tmp_path / "t", mode="full", ops=True):
        mode, x = Patched(), torch.ones(3)
        with mode:
            m(x)
    t = Trace(tmp_path / "t")
    ops = [r for r in t.records if r.kind == "op"]
    assert [r.op for r in ops] == ["aten.mul.Tensor", "aten.add.Tensor"]
    assert torch.equal(t.tensor(ops[0].outputs[0]), t.tensor(ops[0].inputs[0]) * 3)
    assert mode.seen == ["aten.mul.Tensor"]


def test_a_mode_entered_between_calls_and_left_inside_one_keeps_recording(tmp_path):
    """Regression: a mode entered between calls and exited inside a call popped divtrace's mode instead of its
    own; nothing was recorded after it."""
    class Exits(torch.nn.Module):
        def forward(self, x, mode=None):
            y = x * 3
            if mode is not None:
                mode.__exit__(None, None, None)
            return y

    m = Exits()
    with divtrace.record(m, tmp_path / "t", mode="hash", ops=True):
        m(torch.ones(3))
        mode = Patched()
        mode.__enter__()
        m(torch.ones(3), mode)
        m(torch.ones(3))
        m(torch.ones(3))
    t = Trace(tmp_path / "t")
    assert [r.op for r in t.records if r.kind == "op"] == ["aten.mul.Tensor"] * 2 + ["aten.add.Tensor"] + \
        ["aten.mul.Tensor"] * 2


def _raw_write(t: torch.Tensor, value: float) -> None:
    """Fill a float32 tensor without any torch op (a kernel torch does not see: a raw Triton or C write)."""
    n = t.numel()
    src = (ctypes.c_float * n)(*([float(value)] * n))
    ctypes.memmove(t.data_ptr(), src, n * 4)


class Workspace(torch.nn.Module):
    """A buffer made once and reused by every call, filled by raw writes before each use."""

    def __init__(self, delta: float):
        super().__init__()
        self.buf = None
        self.delta = delta

    def forward(self, x, k):
        if self.buf is None:
            self.buf = torch.empty(4)
        _raw_write(self.buf, 10 * k + 1)
        a = self.buf * x
        _raw_write(self.buf, 10 * k + 2 + (self.delta if k == 1 else 0))
        return a, self.buf


def test_raw_writes_into_a_reused_buffer_never_make_differing_runs_identical(tmp_path):
    """Two runs that differ only in what a raw write puts into the reused buffer in call 1 (the buffer is an
    output): bisect must find the difference (regression: the value id of the buffer's earlier bytes was kept and
    bisect said PASSED identical)."""
    for name, delta in (("a", 0.0), ("b", 5.0)):
        m = Workspace(delta)
        with torch.inference_mode(), divtrace.record(m, tmp_path / name, mode="hash", ops=True):
            for k in range(2):
                m(torch.ones(4), k)
    r = divtrace.bisect(tmp_path / "a", tmp_path / "b")
    assert r.verdict == "diverged"
    t = Trace(tmp_path / "a")
    for c, k in zip(t.roots(), range(2)):  # every recorded fingerprint is of the bytes the call returned
        assert t.vkey[c.outputs[1][1]][2] == fingerprint(torch.full((4,), 10.0 * k + 2))[0]


def test_a_weight_changed_through_data_between_calls_is_a_new_value(tmp_path):
    """Regression: `.data` has a version counter of its own, so a weight updated through it between forwards (an
    EMA, a weight sync, an old-style optimizer step) kept its old value id and fingerprint."""
    lin = torch.nn.Linear(4, 4, bias=False)
    w0 = lin.weight.detach().clone()
    with torch.no_grad(), divtrace.record(lin, tmp_path / "t", mode="hash", ops=True):
        lin(torch.ones(1, 4))
        lin.weight.data.mul_(2)
        lin(torch.ones(1, 4))
    t = Trace(tmp_path / "t")
    w = [r.inputs[0] for r in t.records if r.kind == "op" and r.op == "aten.t.default"]
    assert w[0] != w[1]
    assert t.vkey[w[0]][2] == fingerprint(w0)[0] and t.vkey[w[1]][2] == fingerprint(w0 * 2)[0]
