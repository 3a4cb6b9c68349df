"""With ops=True the dispatch mode is pushed only while a module call of the recorded model is open (ops between
calls are never recorded, and an engine runs as many of them as the model). Writes made between calls are then not
counted, and inference tensors have no version counter of their own: a known inference tensor used again in a
later call must be checked by its bytes, never taken for the value it was."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

import divtrace
from divtrace.fingerprint import fingerprint
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
            assert _get_current_dispatch_mode() is None  # no call open: the mode is out of the way
            buf.mul_(2)  # between calls, unseen by the recorder
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


def test_the_mode_stays_below_a_mode_pushed_inside_the_block(tmp_path):
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    m = Scale()
    with divtrace.record(m, tmp_path / "t", mode="hash", ops=True):
        m(torch.ones(3))
        with Count():
            m(torch.ones(3))  # divtrace's mode pushed above Count for this call, and popped after it
            assert isinstance(_get_current_dispatch_mode(), Count)
            torch.ones(2) + 1
    t = Trace(tmp_path / "t")
    assert [r.op for r in t.records if r.kind == "op"] == ["aten.mul.Tensor"] * 2
    assert "aten.mul.Tensor" in seen and "aten.add.Tensor" in seen
