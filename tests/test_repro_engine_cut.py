"""A token repro of an engine side whose region holds kernels that replay only inside the engine (vLLM's
attention, its oneDNN matmuls) is cut at the engine's parting op (divtrace/repro/narrow.py): a standalone script
that replays the engine's RoPE kernel alone against the trainer's rotate-half ops, and fails.

The engine here is an HF Llama running the custom ops of tests/fake_engine_ops.py (an in-place RoPE with one
rounding, an attention kernel its trace declares unreplayable), each sequence on its own; the trainer is the plain
HF Llama recomputing both sequences in one right-padded batch. tests/test_vllm_integration.py does the same
against vLLM itself.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import divtrace
from divtrace.repro import write_repro
from fake_engine_ops import UNREPLAYABLE, engine_side
from token_cases import llama, prompts, trainer

ROTARY = "divtrace_fake_engine.rotary_.default"
ATTENTION = "divtrace_fake_engine.attention.default"


def _engine(model, path, seqs, unreplayable=True, **kernels):
    meta = {"engine": {"name": "fake-engine", "unreplayable_ops": UNREPLAYABLE if unreplayable else {}}}
    with engine_side(model, **kernels), torch.no_grad(), \
            divtrace.record(model, path, label="engine", extra_meta=meta):
        for s in seqs:
            model(input_ids=torch.tensor([s]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("engine_cut")
    model = llama()
    seqs = prompts((10, 14))
    # One thread, as in the rest of the suite: with two, this CPU's fp32 matmul (an AMD EPYC) split the trainer's
    # micro-batch of 2 otherwise than the engine's single sequence, and q_proj parted before the planted kernels
    # (a real origin, but not what these tests plant); the file alone then failed where the suite passed.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer(model, d / "train", seqs, micro_batch=2)
        _engine(model, d / "engine", seqs)
        _engine(model, d / "engine_replayable", seqs, unreplayable=False)
        _engine(model, d / "engine_attention", seqs, rope=False, attention="attention_fp64")
    finally:
        torch.set_num_threads(threads)
    return d


def test_bisect_names_the_engine_rope_kernel(runs):
    r = divtrace.bisect(runs / "train", runs / "engine")
    assert r.alignment == "tokens" and r.verdict == "diverged"
    assert r.first.module == "model.layers.0.self_attn" and r.first.op_b == ROTARY


def test_a_custom_op_that_writes_its_arguments_reads_them_as_produced(runs):
    """torch.library.custom_op bumps the version of the arguments it writes before the dispatch mode sees the op:
    the recorder must still read them as the values the earlier ops produced (regression: the transposed query
    became a new value with no producer, and a repro took it as a parameter)."""
    from divtrace.trace.reader import Trace

    t = Trace(runs / "engine")
    rec = next(r for r in t.records if r.kind == "op" and r.op == ROTARY)
    assert rec.out == {"$writes": [0, 1]}
    for vid in rec.inputs[:2]:
        p = t.values[vid].producer
        assert p is not None and t.records[p].op == "aten.transpose.int"


def test_repro_is_cut_at_the_engine_parting_op_and_fails_standalone(runs, tmp_path):
    r = write_repro(runs / "train", runs / "engine", tmp_path / "r")
    assert r.ok, r.explanation
    m = r.manifest
    ops_b = [divtrace_op for divtrace_op in (r.manifest["ops"]["b"]["records"])]
    from divtrace.trace.reader import Trace

    tb = Trace(runs / "engine")
    names_b = [tb.records[i].op for i in ops_b]
    assert ROTARY in names_b and ATTENTION not in names_b, names_b
    assert any(f"cut at the output of its parting op {ROTARY}" in w for w in m["warnings"]), m["warnings"]
    assert m["origin"]["op_b"] == ROTARY and m["keep_recorded"]
    src = (tmp_path / "r" / "repro.py").read_text()
    assert "attention.default(" not in src and "import_module('fake_engine_ops')" in src
    # standalone: a fresh interpreter, no divtrace, the engine's op module found where it was recorded from
    p = subprocess.run([sys.executable, "-I", str(tmp_path / "r" / "repro.py"), "--trials", "3"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert p.returncode == 1 and "FAILED: side_a and side_b differ" in p.stdout, p.stdout + p.stderr
    # random trials vary the token's shared query row only: the two kernels still part in the last bits there
    rows = [ln for ln in p.stdout.splitlines() if ln.strip().startswith("random seed=")]
    assert len(rows) == 3 and all(" NO " in ln for ln in rows), p.stdout


def test_no_cut_where_the_engine_region_replays(runs, tmp_path):
    r = write_repro(runs / "train", runs / "engine_replayable", tmp_path / "r")
    assert r.ok, r.explanation
    assert not any("cut at the output" in w for w in r.manifest["warnings"])
    assert not r.manifest["keep_recorded"]


def test_no_cut_where_the_divergence_starts_at_an_engine_only_kernel(runs, tmp_path):
    """HF's RoPE on both sides, another attention kernel on the engine's: the runs part at that kernel itself, so
    there is nothing to cut before it; the repro says the kernel replays only inside the engine."""
    att = "divtrace_fake_engine.attention_fp64.default"
    r = divtrace.bisect(runs / "train", runs / "engine_attention")
    assert r.first.module == "model.layers.0.self_attn" and r.first.op_b == att
    rep = write_repro(runs / "train", runs / "engine_attention", tmp_path / "r")
    assert any(f"the divergence starts at {att} itself (reads the engine's KV cache" in w
               for w in rep.manifest["warnings"]), rep.manifest["warnings"]
    assert not rep.manifest["keep_recorded"]
    p = subprocess.run([sys.executable, "-m", "divtrace", "repro", str(runs / "train"), str(runs / "engine_attention"),
                        "--out", str(tmp_path / "cli")], capture_output=True, text=True, timeout=300)
    assert f"custom op {att}: replays only inside the engine that recorded it" in " ".join(p.stdout.split()), p.stdout
