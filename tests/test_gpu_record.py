"""Recording on a CUDA GPU at the GPU's speed (issue 31): skipped where no GPU is; `bench/gpu_check.sh` runs them.

- No sync inside divtrace: `torch.cuda.set_sync_debug_mode("error")` is on exactly while divtrace does its own
  bookkeeping on the recording thread (lifecycle.BUSY), less the one allowed read (the root call's input ids and
  positions, TokenRows.begin_root_call), for a forward and a generate, hash and full mode, ops on and off. HF's own
  syncs (generate's stopping criteria, mask checks) run outside that scope. The sync debug mode does not see event
  synchronizes or copies into pageable memory: the writer thread's waits are the former by design, and the test
  checks that every staging buffer is pinned, where a non-blocking copy really is asynchronous.
- The same count as a whole: with the sync debug mode at "warn" for the whole generate, the recorded run makes
  at most the plain run's syncs plus the allowed reads (a few per root call).
- The fingerprints of a GPU recording are the CPU's for the same tensors: every stored tensor of a full-mode GPU
  recording hashes on the CPU (C kernel) to the fingerprint recorded on the GPU, and its token rows to the rows
  recorded; and the device path writes what the host path (every value read back where it is met) writes for the
  same GPU run, statistics' last bits aside.
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

import divtrace
from divtrace.record.device import device_path

sys.path.insert(0, str(Path(__file__).parent))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def llama(dtype=torch.bfloat16, hidden=256, layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).to("cuda", dtype).eval()


def ids(batch=4, length=32):
    return torch.randint(1, 512, (batch, length), device="cuda", generator=torch.Generator("cuda").manual_seed(1))


def forward(m, x):
    m(input_ids=x, attention_mask=torch.ones_like(x))


def generate(m, x):
    m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False, pad_token_id=0)


@pytest.fixture
def scoped_sync_errors(monkeypatch):
    """The sync debug mode at "error" while divtrace's own code runs on this thread (less the allowed read)."""
    from divtrace.record import lifecycle
    from divtrace.record.token_rows import TokenRows

    state = {"allowed": 0, "entered": 0}
    enter, exit_ = lifecycle._Busy.__enter__, lifecycle._Busy.__exit__

    def busy_enter(self):
        enter(self)
        if lifecycle.STATE.busy == 1 and not state["allowed"]:
            state["entered"] += 1
            torch.cuda.set_sync_debug_mode("error")

    def busy_exit(self, *exc):
        if lifecycle.STATE.busy == 1:
            torch.cuda.set_sync_debug_mode("default")
        return exit_(self, *exc)

    begin = TokenRows.begin_root_call

    def begin_root_call(self, *a, **k):
        state["allowed"] += 1
        torch.cuda.set_sync_debug_mode("default")
        try:
            return begin(self, *a, **k)
        finally:
            state["allowed"] -= 1
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(lifecycle._Busy, "__enter__", busy_enter)
    monkeypatch.setattr(lifecycle._Busy, "__exit__", busy_exit)
    monkeypatch.setattr(TokenRows, "begin_root_call", begin_root_call)
    yield state
    torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("run", [forward, generate])
@pytest.mark.parametrize("mode,ops", [("hash", False), ("hash", True), ("full", False)])
def test_no_sync_inside_divtrace(tmp_path, scoped_sync_errors, run, mode, ops):
    m = llama()
    x = ids()
    pinned = []
    from divtrace.trace import device_results

    real = device_results.DeviceBatches._buffer

    def buffer(self, n, is_pinned):
        b = real(self, n, is_pinned)
        pinned.append(b.is_pinned())
        return b

    device_results.DeviceBatches._buffer = buffer
    try:
        with torch.no_grad(), divtrace.record(m, tmp_path / "t", mode=mode, ops=ops):
            run(m, x)
    finally:
        device_results.DeviceBatches._buffer = real
    meta = json.loads((tmp_path / "t" / "meta.json").read_text())
    assert meta["status"] == "complete" and meta["device_path"]["batches"] >= 1
    assert scoped_sync_errors["entered"] > 10 and pinned and all(pinned)
    print(f"\n{run.__name__} {mode} ops={ops}: {meta['device_path']}")
    assert "failed" not in meta["device_path"]["kernels"]  # (a Triton kernel that does not build is said here)


def _syncs(fn) -> int:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(x.message) for x in w)


def test_recorded_generate_syncs_no_more_than_plain_plus_the_token_reads(tmp_path):
    m = llama()
    x = ids()
    with torch.no_grad():
        generate(m, x)  # warm up
        plain = _syncs(lambda: generate(m, x))

        def recorded():
            with divtrace.record(m, tmp_path / "t", mode="hash", ops=True, overwrite=True):
                generate(m, x)

        rec = _syncs(recorded)
    root_calls = 8
    print(f"\nsyncs: plain generate {plain}, recorded {rec} ({root_calls} root calls)")
    assert rec <= plain + 4 * root_calls + 2


def test_gpu_fingerprints_are_the_cpu_fingerprints_of_the_same_bytes(tmp_path):
    from divtrace.trace import token_layout
    from divtrace.trace.hashing.rows import row_fingerprints, rows_bytes
    from divtrace.trace.hashing.tensor import hash_with_stats
    from divtrace.trace.reader import Trace

    m = llama()
    x = ids()
    with torch.no_grad(), divtrace.record(m, tmp_path / "t", mode="full", ops=True):
        generate(m, x)
    tr = Trace(tmp_path / "t")
    checked = rows_checked = 0
    for vid, v in tr.values.items():
        if v.blob is None or v.derived:
            continue
        t = tr.tensor(vid)  # (the reader checks the stored bytes against the fingerprint too)
        assert hash_with_stats(t.contiguous(), stats=False)[0] == v.hash, vid  # the CPU's C kernel
        checked += 1
    rows = (tmp_path / "t" / "rows.bin").read_bytes()
    for line in (tmp_path / "t" / "rows.jsonl").read_text().splitlines():
        vid, call, code, off = json.loads(line)
        v = tr.values[vid]
        if off < 0 or v.blob is None or v.derived:
            continue
        got = rows_bytes(row_fingerprints(token_layout.rows_2d(tr.tensor(vid), code)))
        assert got == rows[8 * off: 8 * off + len(got)], vid
        rows_checked += 1
    assert checked > 50 and rows_checked > 10


@pytest.mark.parametrize("ops", [True, False])
def test_device_path_writes_what_the_host_path_writes_for_the_same_gpu_run(tmp_path, ops):
    from test_device_path import assert_same_trace

    m = llama(torch.float32)
    x = ids()
    torch.backends.cuda.matmul.allow_tf32 = False
    for name, on in (("host", False), ("dev", None)):
        ctx = device_path(on) if on is not None else torch.no_grad()
        with ctx, torch.no_grad(), divtrace.record(m, tmp_path / name, mode="hash", ops=ops):
            generate(m, x)
    meta = json.loads((tmp_path / "dev" / "meta.json").read_text())
    assert "device_path" in meta
    assert_same_trace(tmp_path / "host", tmp_path / "dev")


def test_torch_ops_and_triton_kernels_agree_on_the_gpu(monkeypatch):
    """The device path's two ways (device_kernels' Triton passes and device_results' torch ops) against the host's
    C kernel, on CUDA tensors of every dtype and a few layouts, NaN and infinities included."""
    import importlib.util
    import math

    from divtrace.trace import device_kernels, device_results as D
    from divtrace.trace.hashing.rows import row_fingerprints
    from divtrace.trace.hashing.tensor import hash_with_stats, tensor_fingerprint
    from fp2_cases import values

    ways = ["torch"] + (["triton"] if importlib.util.find_spec("triton") is not None else [])
    for way in ways:
        monkeypatch.setattr(device_kernels, "available", (lambda t: True) if way == "triton" else (lambda t: False))
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int64):
            for shape in ((7,), (3, 1000), (4, 4096), (2, 3, 2048), (1 << 21, 3)):
                x = values(dtype, shape, 2)
                if dtype.is_floating_point:
                    x.view(-1)[1], x.view(-1)[5] = float("nan"), float("inf")
                b = D.DeviceBatches()
                with torch.no_grad():
                    p = D.PendingValue(b.add(D.device_words(x.cuda(), tensor_fingerprint, True)), x.numel(),
                                       x.is_floating_point())
                    r = D.PendingRows(b.add(D.row_words(x.cuda().reshape(shape[0], -1), row_fingerprints)))
                for batch in b.seal():
                    batch.land()
                h, st = hash_with_stats(x)
                assert p.hex() == h, (way, dtype, shape)
                assert r.bytes() == row_fingerprints(x.reshape(shape[0], -1)).numpy().tobytes(), (way, dtype, shape)
                if st:
                    got = p.stats()
                    assert all(got[k] == st[k] for k in ("min", "max", "nan", "inf")), (way, dtype, shape, got, st)
                    assert math.isclose(got["mean"], st["mean"], rel_tol=1e-6, abs_tol=1e-9), (way, got, st)
    print(f"\nkernels: {device_kernels.status()}")
