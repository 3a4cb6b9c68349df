"""The device path (divtrace.record.device, divtrace.trace.device_writer), proven on the CPU.

The device path's code runs on CPU tensors here (`forced_device_path`, with the C kernels hidden so the torch ops
that run on accelerators compute the fingerprints). It must
- write what the CPU path writes for the same run: records.jsonl line for line with only the summary statistics'
  last bits free, rows.jsonl, rows.bin, tokens.jsonl and the shards byte for byte, whether a value's identity
  came from its version counter or had to wait for its bytes (provisional values, renumbered on the writer thread);
- never read a device value on the recording thread: a dispatch-level trap (tests/nosync.py: scalar reads,
  nonzero, masks, cross-device copies, tensors from host data) and guards on `.tolist()`, `.numpy()`, `.cpu()`,
  `.to(cpu)` and `.item()` fail the recording at the first read, scoped to divtrace's own bookkeeping (the model's
  and HF generate's own reads are theirs) less the one allowed read, the root call's input ids and positions.
The controls show the traps catch the CPU path and a read slipped into the device path.
"""
from __future__ import annotations

import importlib.util
import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import divtrace
from divtrace.errors import DivtraceError
from divtrace.record.device import forced_device_path
from fp2_cases import torch_path
from nosync import HostReadError, HostReadTrap, RecorderScope, python_reads

FILES = ("rows.jsonl", "rows.bin", "tokens.jsonl")


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


IDS = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(1))


def generate(m):
    m.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=4, do_sample=False, pad_token_id=0)


def forward(m):
    m(input_ids=IDS, attention_mask=torch.ones_like(IDS))


def record(m, path, run, *, device: bool, mode="hash", ops=True, inference=False, **kw):
    ctx = torch.inference_mode() if inference else torch.no_grad()
    if not device:
        with divtrace.record(m, path, mode=mode, ops=ops, **kw), ctx:
            run(m)
        return
    with forced_device_path(), torch_path(False):
        with divtrace.record(m, path, mode=mode, ops=ops, **kw), ctx:
            run(m)


def lines_without_stats(path: Path) -> list:
    out = []
    for line in (path / "records.jsonl").read_text().splitlines():
        r = json.loads(line)
        for v in r.get("V", ()):
            v.pop("m", None)
        out.append(r)
    return out


def stats(path: Path) -> list:
    return [(v.get("d"), v.get("m")) for line in (path / "records.jsonl").read_text().splitlines()
            for v in json.loads(line).get("V", ())]


def assert_same_trace(a: Path, b: Path) -> dict:
    """b (device path) writes what a (CPU path) wrote; the device path's meta figures."""
    assert lines_without_stats(a) == lines_without_stats(b)
    for name in FILES:
        assert (a / name).exists() == (b / name).exists(), name
        if (a / name).exists():
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    shards = sorted(p.name for p in a.glob("*.safetensors"))
    assert shards == sorted(p.name for p in b.glob("*.safetensors"))
    for name in shards:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    for (dt, x), (_, y) in zip(stats(a), stats(b)):  # summary stats: for people, the mean's last bits may differ
        if x == y:
            continue
        assert x[:2] == y[:2] and x[3:] == y[3:], (dt, x, y)
        assert math.isclose(x[2], y[2], rel_tol=1e-6, abs_tol=1e-6 * max(abs(x[0]), abs(x[1]))), (dt, x, y)
    ma, mb = (json.loads((p / "meta.json").read_text()) for p in (a, b))
    assert sorted(ma["warnings"]) == sorted(mb["warnings"]) and ma["records"] == mb["records"]
    assert ma.get("tokens") == mb.get("tokens") and ma["status"] == mb["status"] == "complete"
    assert "device_path" not in ma
    return mb["device_path"]


CASES = [("hash", True, False), ("hash", False, False), ("hash", True, True), ("hash", False, True),
         ("full", True, False), ("full", False, True)]


@pytest.mark.parametrize("mode,ops,inference", CASES,
                         ids=[f"{m}-{'ops' if o else 'modules'}{'-inference' if i else ''}" for m, o, i in CASES])
def test_device_path_writes_what_the_cpu_path_writes(tmp_path, mode, ops, inference):
    m = llama()
    record(m, tmp_path / "cpu", generate, device=False, mode=mode, ops=ops, inference=inference)
    record(m, tmp_path / "dev", generate, device=True, mode=mode, ops=ops, inference=inference)
    figures = assert_same_trace(tmp_path / "cpu", tmp_path / "dev")
    assert figures["batches"] >= 1 and figures["batch_waits"] == 0
    if inference and not ops:  # no version counters and no dispatch mode: every value met again waits for its bytes
        assert figures["provisional"] > 50 and figures["provisional_dropped"] == figures["provisional"]


class Scratch(torch.nn.Module):
    """Identity decided by bytes: a fresh buffer written behind torch's back (numpy), in-place ops that change
    their input and one that does not, an output met again as the next call's input."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.inner = torch.nn.Identity()

    def forward(self, x, raw=False):
        buf = torch.zeros(4, 8)
        if raw:
            buf.numpy()[0, 0] = 7.0  # a kernel torch does not see
        y = self.inner(buf)
        y = self.inner(buf + 0)
        h = self.lin(x)
        h.add_(0)  # version moves, bytes stay
        h = self.inner(h)
        h.mul_(2)  # version moves, bytes change
        h = self.inner(h)
        return h + y.sum()


@pytest.mark.parametrize("ops", [True, False])
@pytest.mark.parametrize("inference", [False, True])
def test_identity_by_bytes_is_settled_as_on_the_cpu(tmp_path, ops, inference):
    def run(m):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
        out = m(x)
        out = m(out, raw=True)
        m(out)

    torch.manual_seed(0)
    m = Scratch()
    record(m, tmp_path / "cpu", run, device=False, ops=ops, inference=inference)
    record(m, tmp_path / "dev", run, device=True, ops=ops, inference=inference)
    figures = assert_same_trace(tmp_path / "cpu", tmp_path / "dev")
    assert figures["provisional"] > figures["provisional_dropped"] > 0  # both outcomes were met
    warnings = json.loads((tmp_path / "dev" / "meta.json").read_text())["warnings"]
    assert any("without a torch op" in w for w in warnings) == ops  # (without the mode no buffer is fresh)


def trapped(monkeypatch):
    """A scoped dispatch trap and Python guards for divtrace's bookkeeping on this thread."""
    scope = RecorderScope(monkeypatch)
    caught = python_reads(monkeypatch, scope)
    return HostReadTrap(when=scope), caught


@pytest.mark.parametrize("run", [forward, generate])
@pytest.mark.parametrize("mode,ops", [("hash", True), ("hash", False), ("full", True)])
def test_the_device_path_reads_nothing_inside_the_block(tmp_path, monkeypatch, run, mode, ops):
    from divtrace.trace import device_results
    from divtrace.trace.hashing import weights

    m = llama()
    record(m, tmp_path / "cpu", run, device=False, mode=mode, ops=ops)
    for cache in (device_results._FILLS, device_results._TABLES, device_results._TABLE_VIEWS, weights._INNER,
                  weights._OUTER):
        cache.clear()  # (built inside the block, on first use: under the traps too)
    trap, caught = trapped(monkeypatch)
    with trap:  # (below divtrace's own dispatch mode: it sees what divtrace runs and what the model runs)
        record(m, tmp_path / "dev", run, device=True, mode=mode, ops=ops)
    assert caught == [] and trap.checked > 100  # divtrace's own ops were looked at, and none read
    assert_same_trace(tmp_path / "cpu", tmp_path / "dev")


def test_the_traps_catch_the_cpu_paths_reads(tmp_path, monkeypatch):
    m = llama()
    trap, caught = trapped(monkeypatch)
    with pytest.raises(HostReadError), trap, torch_path(False):  # the CPU path's torch ops: hex via .tolist()
        record(m, tmp_path / "cpu", forward, device=False)
    assert caught == ["tolist"]


@pytest.mark.parametrize("read", ["item", "float", "nonzero", "cpu", "numpy"])
def test_the_traps_catch_a_read_slipped_into_the_device_path(tmp_path, monkeypatch, read):
    from divtrace.trace.device_writer import DeviceWriting

    pending = DeviceWriting.pending
    do = {"item": lambda t: t.sum().item(), "float": lambda t: float(t.reshape(-1)[0]),
          "nonzero": lambda t: torch.nonzero(t), "cpu": lambda t: t.cpu(), "numpy": lambda t: t.numpy()}[read]

    def reading(self, t):
        do(t.detach())
        return pending(self, t)

    monkeypatch.setattr(DeviceWriting, "pending", reading)
    trap, _ = trapped(monkeypatch)
    with pytest.raises(HostReadError), trap:
        record(llama(), tmp_path / "dev", forward, device=True)
    meta = json.loads((tmp_path / "dev" / "meta.json").read_text())
    assert meta["status"] == "error" and "HostReadError" in meta["error"]  # closed, the writer thread drained


def test_bounded_staging_waits_and_says_so(tmp_path, monkeypatch):
    from divtrace.trace import device_results, device_writer

    m = llama()
    record(m, tmp_path / "cpu", generate, device=False, mode="full", flush_records=7, shard_bytes=8 << 10)
    real_batches, real_staging = device_results.DeviceBatches.__init__, device_writer.Staging.__init__
    monkeypatch.setattr(device_results.DeviceBatches, "__init__",
                        lambda self, words=64, ring=2: real_batches(self, words, ring))
    monkeypatch.setattr(device_writer.Staging, "__init__", lambda self, limit, th: real_staging(self, 16 << 10, th))
    record(m, tmp_path / "dev", generate, device=True, mode="full", flush_records=7, shard_bytes=8 << 10)
    figures = assert_same_trace(tmp_path / "cpu", tmp_path / "dev")
    assert figures["batch_buffers"] <= 2 and figures["batches"] > 20
    # (over the limit by at most one value, the 32 KiB embedding, where nothing queued could free room)
    assert figures["staging_waits"] > 0 and figures["staging_peak_bytes"] <= 48 << 10 < figures["bytes_staged"]
    assert figures["staging_wait_seconds"] >= 0


def test_a_failed_write_on_the_writer_thread_stops_the_recording(tmp_path, monkeypatch):
    import errno
    import os

    from divtrace.trace import writer as W

    real = os.write
    state = {"records": 0}

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("records.jsonl"):
            state["records"] += 1
            if state["records"] == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(W.os, "write", write)
    m = llama()
    with pytest.raises(DivtraceError, match="no space left"):
        record(m, tmp_path / "dev", generate, device=True, flush_records=20)
    meta = json.loads((tmp_path / "dev" / "meta.json").read_text())
    assert meta["status"] == "error" and "no space left" in meta["error"]
    from divtrace.trace.reader import Trace

    assert len(Trace(tmp_path / "dev").records) == meta["records"] > 0  # the lines before it, whole


def test_pending_rows_and_values_read_back_as_the_kernels_give_them():
    """The writer thread's conversions: int64 words to hex and rows.bin bytes, stats as the C kernel's dict."""
    from divtrace.trace.device_results import DeviceBatches, PendingRows, PendingValue, device_words
    from divtrace.trace.hashing.rows import row_fingerprints, rows_bytes
    from divtrace.trace.hashing.tensor import hash_with_stats, tensor_fingerprint

    x = torch.randn(5, 33, dtype=torch.float32)
    x[1, 2], x[3, 4] = float("nan"), float("-inf")
    b = DeviceBatches(words=16)
    with torch_path(False):
        p = PendingValue(b.add(device_words(x, tensor_fingerprint, stats=True)), x.numel(), True)
        r = PendingRows(b.add(row_fingerprints(x)))
    for batch in b.seal():
        batch.land()
    h, st = hash_with_stats(x)
    assert p.hex() == h and r.bytes() == rows_bytes(row_fingerprints(x))
    got = p.stats()
    assert {k: got[k] for k in ("min", "max", "absmax", "nan", "inf")} == \
        {k: st[k] for k in ("min", "max", "absmax", "nan", "inf")}
    assert math.isclose(got["mean"], st["mean"], rel_tol=1e-9)
    allbad = torch.tensor([float("nan"), float("inf")])
    with torch_path(False):
        q = PendingValue(b.add(device_words(allbad, tensor_fingerprint, stats=True)), 2, True)
    for batch in b.seal():
        batch.land()
    assert q.stats() == hash_with_stats(allbad)[1]
    assert np.frombuffer(r.bytes(), "<u8").shape == (5,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8,
                                   torch.int64, torch.bool])
def test_the_lean_device_fingerprint_is_the_schemes(monkeypatch, dtype):
    """device_results.whole_fingerprint (a table of every lane's weight, or block sums past it) against the C
    kernel: whole lanes, a slice starting mid-lane, sizes around the table and the block, strided values."""
    from divtrace.trace import device_results as D
    from divtrace.trace.hashing.tensor import hash_with_stats, tensor_fingerprint, to_hex
    from fp2_cases import values

    monkeypatch.setattr(D, "_TABLE_LANES", 1 << 12)
    monkeypatch.setattr(D, "_TABLES", {})
    for shape in ((3,), (5, 7), (1024,), (2, 2048), (4097,), (3, 4096 * 3), (0,)):
        x = values(dtype, shape, 3) if shape != (0,) else torch.empty(0, dtype=dtype)
        for t in (x, x[1:] if x.shape[0] > 1 else x, x.t() if x.dim() == 2 else x):
            with torch_path(False):
                got = to_hex(D.whole_fingerprint(t, tensor_fingerprint))
            assert got == hash_with_stats(t, stats=False)[0], (shape, t.stride())


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_the_triton_kernels_interpreted_on_the_cpu():
    """device_kernels' fused passes, in Triton's interpreter, give the C kernel's fingerprints, rows and stats,
    and a recording through them writes the CPU path's trace (on a GPU: tests/test_gpu_record.py)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    got = subprocess.run([sys.executable, str(Path(__file__).parent / "triton_interpreted.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert got.returncode == 0 and got.stdout.split()[:2] == ["ok", "triton"], got.stderr[-3000:]


def test_a_value_shows_its_hex_hash_only_with_its_blob(tmp_path, monkeypatch):
    """Regression: the writer thread put the hex hash on a full-mode value before its blob, and an alias the
    recording thread copied from it in between (copy_value) kept the hash without the blob (a bounded-staging run
    under load lost 'b' on an `_unsafe_view`). The blob must be set while the hash is still pending."""
    from divtrace.trace import device_writer

    store = device_writer.DeviceWriting._store
    seen = []

    def checked(self, v, hx, staged):
        seen.append(type(v.hash) is not str)  # (the hex is not published yet)
        return store(self, v, hx, staged)

    monkeypatch.setattr(device_writer.DeviceWriting, "_store", checked)
    record(llama(), tmp_path / "dev", forward, device=True, mode="full")
    assert seen and all(seen)


def test_declared_finals_and_positions_used_write_what_the_cpu_path_writes(tmp_path):
    """Issue 28's token lines on the device path: the positions a model uses (HF's own arange where none are
    passed; a `P` line, queued for the host rather than read inside the block) and rec.final's declared values
    (a value rowed in its root call already is not rowed again) make the files the CPU path makes."""
    m = llama()

    def run(rec):
        out = m(input_ids=IDS, attention_mask=torch.ones_like(IDS))
        last = out.logits[:, -1]
        rec.final(torch.log_softmax(last.float(), -1)[:, 3], rows=rec.last_rows(), kind="logprobs", targets=[3, 3])
        rec.final(out.logits.reshape(-1, out.logits.shape[-1]))  # every cell: rows the root call has already

    _record_both_paths(m, tmp_path, run)
    lines = [json.loads(x) for x in (tmp_path / "dev" / "tokens.jsonl").read_text().splitlines()]
    assert [x["used"] for x in lines if "P" in x] == [list(range(6)) * 2]
    assert sum(1 for x in lines if x.get("src", "").startswith("final:")) == 2


def test_an_engines_declared_finals_write_what_the_cpu_path_writes(tmp_path):
    """A vLLM-style engine (tests/engine_model.py: flattened batch, logits on the last row of each sequence,
    declared with rec.final): a decode step's logits are rows of the root call already, which rec.final must not
    row again on the device path either."""
    import engine_model as em
    import token_cases as tc

    eng = em.Engine.from_hf(tc.llama(), ())
    _record_both_paths(eng, tmp_path, lambda rec: em.generate(eng, tc.prompts(), 3, rec=rec))


def _record_both_paths(model, tmp_path, run):
    """`run(rec)` recorded on the CPU path (tmp_path/cpu) and the device path (tmp_path/dev): the same files."""
    for side, dev in (("cpu", False), ("dev", True)):
        with contextlib.ExitStack() as stack:
            if dev:
                stack.enter_context(forced_device_path())
                stack.enter_context(torch_path(False))
            rec = stack.enter_context(divtrace.record(model, tmp_path / side, mode="hash"))
            stack.enter_context(torch.no_grad())
            run(rec)
    assert_same_trace(tmp_path / "cpu", tmp_path / "dev")
