"""The same views of the same weights, met every forward and every recording (`w.t()`, HF's `to_local` views), reuse
what was derived for them (divtrace.trace.derived_views keeps view_fingerprint's answers; record/values.py takes a
view's source once). A weight changed in place between forwards of one recording (an in-place op, a write through
`.data`) and between recordings (a write no recording saw) must give its views new fingerprints: checked against
the weights' bytes as the test held them at each forward."""
from __future__ import annotations

import pytest
import torch

from divtrace.trace import derived_views
from divtrace.trace.check import check_trace
from divtrace.trace.hashing.tensor import hash_with_stats as fingerprint
from divtrace.trace.reader import Trace
from divtrace.trace.records import ModuleEnter, OpRecord
from helpers import hf_llama

import divtrace

PROJ = "model.layers.0.self_attn.q_proj"


def _t_of_proj(trace: Trace) -> list:
    """The `w.t()` records of PROJ's calls, in order: one a forward."""
    calls = {r.call_id for r in trace.records if isinstance(r, ModuleEnter) and r.module.endswith(PROJ)}
    return [r for r in trace.records
            if isinstance(r, OpRecord) and r.call_id in calls and r.op == "aten.t.default"]


def _expected(w: torch.Tensor) -> str:
    """The derived fingerprint of `w.t()` as the key's JSON spells it, the kept answers left out."""
    kept = dict(derived_views._MEMO)
    derived_views._MEMO.clear()
    try:
        return derived_views.view_fingerprint("aten.t.default", fingerprint(w)[0], "torch.float32", list(w.shape),
                                              [w.shape[1], w.shape[0]], [{"$v": 0}], {})
    finally:
        derived_views._MEMO.update(kept)


@pytest.mark.parametrize("mode", ["hash", "full"])
def test_weight_changed_in_place_gets_new_view_fingerprints(tmp_path, mode):
    model, inputs = hf_llama("eager", layers=1)
    w = model.get_submodule(PROJ).weight
    held = []  # the weight's bytes at each forward, as the test saw them
    with torch.no_grad(), divtrace.record(model, tmp_path / "a", mode=mode, ops=True):
        held.append(w.detach().clone())
        model(**inputs)
        model(**inputs)  # unchanged: the same fingerprints again
        held.append(w.detach().clone())
        w.mul_(-0.5)  # an in-place op between forwards: its version moves
        held.append(w.detach().clone())
        model(**inputs)
        w.data.copy_(w.data + 1.0)  # through `.data`: its version does not move (the writes per storage do)
        held.append(w.detach().clone())
        model(**inputs)
    with torch.no_grad():
        w.data[0, 0] += 1.0  # between recordings: no recording sees it
    held.append(w.detach().clone())
    with torch.no_grad(), divtrace.record(model, tmp_path / "b", mode=mode, ops=True):
        model(**inputs)
        model(**inputs)
    held.append(w.detach().clone())

    a, b = Trace(tmp_path / "a"), Trace(tmp_path / "b")
    got = []
    for trace in (a, b):
        report = check_trace(trace)
        assert report["ok"], report["problems"]
        for rec in _t_of_proj(trace):
            src, out = trace.values[rec.inputs[0]], trace.values[rec.outputs[0]]
            assert out.derived
            got.append((trace, src, out))
    assert len(got) == len(held) == 6
    for (trace, src, out), w_then in zip(got, held):
        assert src.hash == fingerprint(w_then)[0]  # the weight as it was at that forward
        assert out.hash == _expected(w_then)
        if mode == "full":
            x = trace.tensor(out.vid)  # rebuilt from the op and the stored weight
            assert torch.equal(x.view(torch.int32), w_then.t().view(torch.int32))
    hashes = [out.hash for _, _, out in got]
    assert hashes[0] == hashes[1] and hashes[4] == hashes[5]
    assert len({hashes[1], hashes[2], hashes[3], hashes[4]}) == 4  # every change: a new fingerprint


def test_kept_answers_are_exact_for_their_arguments():
    """Arguments that compare equal in Python but encode differently (True and 1, 1.0 and 1, a list and an int)
    are kept apart; kwargs, and arguments the key cannot stand for, are not kept at all."""
    vf = derived_views.view_fingerprint
    src = "0" * 32
    base = ("aten.select.int", src, "torch.float32", [4, 4], [4])
    one, true = vf(*base, [{"$v": 1}, 0, 1], {}), vf(*base, [{"$v": 1}, 0, True], {})
    assert one != true and vf(*base, [{"$v": 9}, 0, 1], {}) == one  # (vids are masked)
    derived_views._MEMO.clear()
    assert vf(*base, [{"$v": 1}, 0, True], {}) == true and vf(*base, [{"$v": 1}, 0, 1], {}) == one
    sl = ("aten.slice.Tensor", src, "torch.float32", [4, 4], [4, 2])
    assert vf(*sl, [{"$v": 1}, 1, 0, 2], {}) != vf(*sl, [{"$v": 1}, [1], 0, 2], {})
    n = len(derived_views._MEMO)
    vf(*sl, [{"$v": 1}], {"dim": 1})
    vf(*sl, [{"$v": 1}, 1.0], {})
    assert len(derived_views._MEMO) == n
