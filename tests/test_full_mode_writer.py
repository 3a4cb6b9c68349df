"""Full mode's write path: each value's bytes go into the open shard when the value is produced (`ShardFile`:
data first, header at the end). Every stored value must load back bit-exact, with any safetensors reader."""
from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import divtrace
import divtrace.trace.shards as w
from divtrace.errors import DivtraceError
from divtrace.trace.hashing.tensor import hash_with_stats as fingerprint  # the scheme traces are written in
from divtrace.trace.check import check_trace
from divtrace.trace.reader import Trace


class Mutating(torch.nn.Module):
    """Many mid-size activations, some overwritten in place right after they are recorded, some strided, and a
    few odd dtypes: what the shard writer must take exactly at the moment each value is produced."""

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


def _outputs_match(t, out):
    root = [c for c in t.calls.values() if c.module == ""][0]
    got = {k: t.tensor(vid) for k, vid in root.outputs}
    for i, ref in enumerate(out):
        stored = got[f"out.{i}"]
        assert stored.dtype == ref.dtype and stored.shape == ref.shape
        assert torch.equal(stored.view(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("first_room", [256, 16 << 10])
def test_header_room_overflow_finishes_the_shard_early(tmp_path, monkeypatch, first_room):
    # A header room that fills after a few tensors: the shard is finished as it is and the next one gets more
    # room. Records written after their shard; every shard a plain safetensors file.
    monkeypatch.setattr(w, "_FIRST_ROOM", first_room)
    rec, out = _record(tmp_path / "t", flush_records=10**6)
    t = Trace(tmp_path / "t")
    shards = t.meta["shards"]
    assert (len(shards) >= 3) == (first_room == 256), shards
    report = check_trace(t)
    assert report["ok"], report["problems"]
    assert report["tensors"] > 30
    _outputs_match(t, out)
    for name in shards:
        raw = (tmp_path / "t" / name).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])  # padded with spaces: still JSON
        assert n % 8 == 0 and raw[8:8 + n].rstrip(b" ").endswith(b"}")
        assert max(e["data_offsets"][1] for e in header.values()) == len(raw) - 8 - n
        load_file(tmp_path / "t" / name)
    assert not list((tmp_path / "t").glob(".*.tmp"))


def test_small_shards_and_flushes(tmp_path):
    rec, out = _record(tmp_path / "t", shard_bytes=96 << 10, flush_records=8)
    t = Trace(tmp_path / "t")
    assert len(t.meta["shards"]) >= 6
    assert check_trace(t)["ok"]
    _outputs_match(t, out)


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


def test_mixed_shard_loads_back(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 7, generator=g).t()  # strided: written in logical order
    z = torch.randn(4, generator=g, dtype=torch.float64).to(torch.complex128).conj()  # a lazy conjugate
    tensors = {"a": torch.randn(3 << 20, generator=g), "b": torch.randint(0, 2, (1000,), generator=g).bool(),
               "c": torch.randn(5000, generator=g).to(torch.bfloat16), "d": x, "e": torch.arange(1000),
               "f": torch.zeros(0), "g": z}
    size = w.write_shard(tmp_path / "s.safetensors", tensors)
    assert size == (tmp_path / "s.safetensors").stat().st_size
    back = load_file(tmp_path / "s.safetensors")
    assert torch.equal(back["a"], tensors["a"]) and torch.equal(back["b"], tensors["b"])
    assert torch.equal(back["c"].view(torch.int16), tensors["c"].view(torch.int16))
    assert torch.equal(back["d"], x.reshape(-1)) and torch.equal(back["e"], tensors["e"])
    assert back["f"].numel() == 0
    assert torch.equal(back["g"].view(torch.complex128), z.resolve_conj())  # U8: no safetensors complex dtype


def test_full_and_hash_fingerprints_agree(tmp_path):
    # Writing the bytes must not change what is fingerprinted: both modes give every module output the same
    # hash, and every stored tensor hashes to its recorded fingerprint.
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


def test_disk_full_while_a_value_is_written(tmp_path, monkeypatch):
    # The failure comes from inside the forward (the value's bytes are written when produced): one-line error,
    # the shard being filled removed, the trace readable and marked "error" with what was flushed before.
    real = os.pwrite
    calls = {"n": 0, "fail_after": None}

    def pwrite(fd, data, offset):
        calls["n"] += 1
        if calls["fail_after"] is not None and calls["n"] > calls["fail_after"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    _record(tmp_path / "count", shard_bytes=96 << 10, flush_records=8)  # how many writes a whole run makes
    assert calls["n"] > 20
    calls.update(fail_after=calls["n"] // 2, n=0)  # fail halfway through the forward
    with pytest.raises(DivtraceError) as info:
        _record(tmp_path / "t", shard_bytes=96 << 10, flush_records=8)
    monkeypatch.undo()
    msg = str(info.value)
    assert "no space left on device" in msg and "\n" not in msg
    t = Trace(tmp_path / "t")
    assert t.meta["status"] == "error" and not t.complete and len(t.records) >= 8
    assert check_trace(t)["problems"] == [f"{tmp_path / 't'}: trace is incomplete (status: error)"]
    assert not list((tmp_path / "t").glob(".*.tmp"))


def test_check_reads_each_stored_tensor_once(tmp_path, monkeypatch):
    # Shards without a sha256 have their tensors checked by shard_problems; check_trace must not read them again.
    _record(tmp_path / "t", shard_bytes=96 << 10)
    t = Trace(tmp_path / "t")
    reads = []
    real = Trace.tensor
    monkeypatch.setattr(Trace, "tensor", lambda self, vid: reads.append(vid) or real(self, vid))
    report = check_trace(t)
    assert report["ok"], report["problems"]
    assert len(reads) == report["tensors"] == len({b for b, _ in t.vblob.values()})


def test_write_path_time_is_counted_in_full_mode_only(tmp_path):
    # bench/bench_record.py reports write throughput from TraceWriter.store_seconds.
    rec, _ = _record(tmp_path / "f", shard_bytes=1 << 20)
    assert rec.writer.store_seconds > 0
    torch.manual_seed(0)
    m = Mutating()
    with torch.no_grad(), divtrace.record(m, tmp_path / "h", mode="hash") as rec:
        m(torch.randn(128, 64))
    assert rec.writer.store_seconds == 0


@pytest.mark.parametrize("key", ["float32-4096-" + "0f" * 16, "x", "a.b-c_d", "", "ünï", 'q"uote', "a b", "tab\t"])
def test_header_entry_length_matches_its_json(key):
    # The room left for a shard's header is counted without encoding each entry (a plain blob key's length is
    # summed); any other key falls back to the JSON encoder. finish() asserts the total too.
    for entry in ({"dtype": "F32", "shape": [4096], "data_offsets": [0, 16384]},
                  {"dtype": "U8", "shape": [7], "data_offsets": [123456789, 123456796]},
                  {"dtype": "BF16", "shape": [0], "data_offsets": [5, 5]}):
        assert w._entry_len(key, entry) == len(w._ENCODE({key: entry})) - 2
