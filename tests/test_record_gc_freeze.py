"""The recorder leaves the objects that exist when a block starts out of garbage collection until it ends
(`gc.freeze`, record/recorder.py freeze_gc): what it records is the same, a caller's own freeze is left alone, and
cyclic garbage of older objects is freed once the block ends."""
from __future__ import annotations

import gc
import weakref

import torch

import divtrace
from divtrace.trace.reader import Trace


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class _Cycle:
    def __init__(self):
        self.me = self


def _record(tmp_path, name, model, x, inside=None):
    with torch.no_grad(), divtrace.record(model, tmp_path / name, mode="hash", ops=True) as rec:
        model(x)
        if inside is not None:
            inside(rec)
    return Trace(tmp_path / name)


def test_a_block_freezes_the_gc_for_its_length_and_records_the_same(tmp_path):
    torch.manual_seed(0)
    model, x = _Net().eval(), torch.randn(3, 8)
    seen = []
    assert gc.get_freeze_count() == 0
    frozen = _record(tmp_path, "frozen", model, x, lambda rec: seen.append(gc.get_freeze_count()))
    assert seen[0] > 0 and gc.get_freeze_count() == 0
    gc.disable()  # a caller who runs with the GC off: nothing frozen
    try:
        unfrozen = _record(tmp_path, "off", model, x, lambda rec: seen.append(gc.get_freeze_count()))
    finally:
        gc.enable()
    assert seen[1] == 0
    # the same records and values either way, the output's fingerprint that of the output computed here
    from divtrace.trace.hashing.tensor import hash_with_stats

    with torch.no_grad():
        want = hash_with_stats(model(x))[0]
    for t in (frozen, unfrozen):
        assert t.complete and any(v.hash == want for v in t.values.values())
    assert [(r.index, type(r).__name__) for r in frozen.records] == [(r.index, type(r).__name__)
                                                                      for r in unfrozen.records]
    assert [v.hash for v in frozen.values.values()] == [v.hash for v in unfrozen.values.values()]


def test_a_callers_freeze_is_left_alone(tmp_path, monkeypatch):
    """Neither frozen again nor unfrozen by the block. (Not the freeze count's exact value: a frozen object freed by
    its reference count while the block runs, an entry a cache drops, lowers it; a clean clone's CI saw 3 fewer.)"""
    model, x = _Net().eval(), torch.randn(3, 8)
    gc.freeze()
    calls = []
    try:
        before = gc.get_freeze_count()
        for name in ("freeze", "unfreeze"):
            real = getattr(gc, name)
            monkeypatch.setattr(gc, name, lambda real=real, name=name: calls.append(name) or real())
        seen = []
        _record(tmp_path, "t", model, x, lambda rec: seen.append(gc.get_freeze_count()))
        assert calls == [] and 0 < seen[0] <= before  # nothing frozen on top of the caller's, nothing unfrozen
        assert 0 < gc.get_freeze_count() <= before  # the caller's freeze holds after the block
    finally:
        monkeypatch.undo()
        gc.unfreeze()


def test_older_cyclic_garbage_is_freed_after_the_block(tmp_path):
    model, x = _Net().eval(), torch.randn(3, 8)
    holder = {"cycle": _Cycle()}
    ref = weakref.ref(holder["cycle"])

    def drop(rec):
        del holder["cycle"]  # garbage now, but frozen with the objects that existed at the start
        gc.collect()

    _record(tmp_path, "t", model, x, drop)
    gc.collect()
    assert ref() is None


def test_an_error_in_the_block_unfreezes_too(tmp_path):
    model, x = _Net().eval(), torch.randn(3, 8)
    try:
        with torch.no_grad(), divtrace.record(model, tmp_path / "t", mode="hash", ops=True):
            model(x)
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0
    assert Trace(tmp_path / "t").status == "error"
