"""Full mode's write path: values copied into reused arenas, shards written on a background thread, big shards
hashed beside the write. Every kept value must load back bit-exact, whatever the timing of the writer."""
from __future__ import annotations

import hashlib
import time

import torch
from safetensors.torch import load_file

import divtrace
import divtrace.trace.writer as w
from divtrace.fingerprint import fingerprint
from divtrace.trace.check import check_trace
from divtrace.trace.reader import Trace


class Mutating(torch.nn.Module):
    """Many mid-size activations, some overwritten in place right after they are recorded, some strided, and a
    few odd dtypes: what the arena must copy exactly at the moment each value is produced."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x):
        for _ in range(6):
            y = self.lin(x)
            y.mul_(0.5)  # in place: the recorded `linear` output must keep its bytes from before
            z = y.t()  # a strided view, copied in logical order
            x = torch.relu(z.t().contiguous()) + 1
        b = (x > 1.2)  # bool
        h = x.to(torch.bfloat16) * 3
        s = x.sum()  # 0-dim
        return x, b, h, s


def _record(path, **kw):
    torch.manual_seed(0)
    m = Mutating()
    inp = torch.randn(128, 64)
    with torch.no_grad(), divtrace.record(m, path, mode="full", **kw) as rec:
        out = m(inp)
    return rec, out


def test_values_survive_arena_reuse_under_a_slow_writer(tmp_path, monkeypatch):
    # A writer slower than the model: were an arena handed back before its shard was on disk, the next values
    # would overwrite bytes still to be written, and the stored tensors would not match their fingerprints.
    real = w.write_shard

    def slow(path, tensors):
        time.sleep(0.05)
        return real(path, tensors)

    monkeypatch.setattr(w, "write_shard", slow)
    rec, out = _record(tmp_path / "t", shard_bytes=96 << 10, flush_records=8)
    t = Trace(tmp_path / "t")
    assert len(t.meta["shards"]) >= 6  # many shards: each arena went round several times
    report = check_trace(t)
    assert report["ok"], report["problems"]
    assert report["tensors"] > 30
    # The outputs as the caller got them, read back from the trace.
    root = [c for c in t.calls.values() if c.module == ""][0]
    got = {k: t.tensor(vid) for k, vid in root.outputs}
    for i, ref in enumerate(out):
        stored = got[f"out.{i}"]
        assert stored.dtype == ref.dtype and stored.shape == ref.shape
        assert torch.equal(stored.view(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8))


def test_in_place_write_after_recording_keeps_the_value_as_produced(tmp_path):
    _record(tmp_path / "t", shard_bytes=1 << 20)
    t = Trace(tmp_path / "t")
    lin = [r for r in t.records if getattr(r, "op", "") in ("aten.addmm.default", "aten.linear.default")]
    assert lin
    mul = [r for r in t.records if getattr(r, "op", "") == "aten.mul_.Tensor"]
    assert mul
    before = t.tensor(lin[0].outputs[0])
    after = t.tensor(mul[0].outputs[0])
    assert torch.equal(after, before * 0.5) and not torch.equal(after, before)


def test_arenas_are_released_at_close(tmp_path):
    rec, _ = _record(tmp_path / "t", shard_bytes=96 << 10, flush_records=8)
    assert rec.writer._arena is None and rec.writer._spare is None and rec.writer._inflight is None


def test_big_shard_hashed_beside_the_write(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3 << 20, generator=g), "b": torch.randint(0, 2, (1000,), generator=g).bool(),
               "c": torch.randn(5000, generator=g).to(torch.bfloat16)}
    arena = w.Arena(1 << 20)
    x = torch.randn(300, 7, generator=g).t()  # strided: copied by torch into the arena
    tensors["d"] = arena.take(x, x.numel() * 4)
    y = torch.arange(1000, dtype=torch.int64)
    tensors["e"] = arena.take(y, 8000)  # contiguous: copied by memmove
    assert sum(v.numel() * v.element_size() for v in tensors.values() if isinstance(v, torch.Tensor)) > w._SHA_BESIDE
    digest, size = w.write_shard(tmp_path / "s.safetensors", tensors)
    data = (tmp_path / "s.safetensors").read_bytes()
    assert size == len(data) and digest == hashlib.sha256(data).hexdigest()
    back = load_file(tmp_path / "s.safetensors")
    assert torch.equal(back["a"], tensors["a"]) and torch.equal(back["b"], tensors["b"])
    assert torch.equal(back["c"].view(torch.int16), tensors["c"].view(torch.int16))
    assert torch.equal(back["d"], x.reshape(-1)) and torch.equal(back["e"], y)


def test_arena_refuses_what_does_not_fit():
    arena = w.Arena(1000)
    assert arena.take(torch.zeros(300), 1200) is None
    a = arena.take(torch.ones(100), 400)
    b = arena.take(torch.ones(100, dtype=torch.float64), 800)
    assert a is not None and b is None  # 400 used, 64-aligned offset 448 + 800 > 1000
    assert a.off == 0 and bytes(a.bytes_view()) == torch.ones(100).numpy().tobytes()


def test_full_and_hash_fingerprints_agree(tmp_path):
    # The arena copy must not change what is fingerprinted: both modes give every module output the same hash,
    # and every stored tensor hashes to its recorded fingerprint.
    torch.manual_seed(0)
    m = Mutating()
    inp = torch.randn(128, 64)
    with torch.no_grad(), divtrace.record(m, tmp_path / "hash", mode="hash"):
        m(inp)
    _record(tmp_path / "full", shard_bytes=96 << 10)
    a, b = Trace(tmp_path / "hash"), Trace(tmp_path / "full")
    ha = [a.values[v].hash for c in a.calls.values() for _, v in c.outputs]
    hb = [b.values[v].hash for c in b.calls.values() for _, v in c.outputs]
    assert ha == hb and len(ha) >= 4
    stored = [vid for vid, v in b.values.items() if v.blob]
    assert len(stored) > 30
    for vid in stored:
        assert fingerprint(b.tensor(vid))[0] == b.values[vid].hash
