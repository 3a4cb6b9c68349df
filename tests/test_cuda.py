"""Real CUDA checks: they skip where no GPU is (CI); run them on a GPU machine with `pytest tests/test_cuda.py -s`.

- cuBLAS picks its kernel by problem size: a decode step's matmul (M = 2 rows) and the trainer's micro-batch
  (M = 40) may round differently. Token-aligned bisect must name the op, the token and the rows, or say identical.
- SDPA flash against math attention on the same batch: bisect must name layer 0's self_attn.
- Row fingerprints computed on the GPU (torch path) equal those computed on the CPU.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import divtrace
from divtrace.compare.bisect import bisect

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
sys.path.insert(0, str(Path(__file__).parent))
import token_cases as tc  # noqa: E402


def _show(name, d):
    f = d["first"]
    print(f"\n[{name}] verdict {d['verdict']} alignment {d.get('alignment')} tokens {d.get('tokens')}")
    if f:
        print(f"[{name}] first {f['module']} call {f['call']} op {f['op']} / {f['op_b']} cause {f['cause']} "
              f"rows {f.get('rows')} token {json.dumps(f.get('token'))} batch {f.get('batch_invariance')}")
        for o in d.get("origins", []):
            print(f"[{name}]   origin {o['module']} {o['op']} tokens {o['tokens']}")


def test_row_fingerprints_on_the_gpu_equal_the_cpu():
    from divtrace.record import rowhash

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        x = (torch.randn(33, 257, generator=g) * 30).to(dtype)
        assert (rowhash.row_hashes(x.cuda()) == rowhash.row_hashes(x)).all(), dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_rollout_against_trainer(tmp_path, dtype):
    m_roll, m_train = tc.llama(dtype).cuda(), tc.llama(dtype).cuda()
    roll, train = tmp_path / "rollout", tmp_path / "train"
    ids, mask = tc.left_padded(tc.prompts())
    with torch.no_grad(), divtrace.record(m_roll, roll, mode="hash", label="rollout"):
        out = m_roll.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=4, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
    seqs = [p + out[i, ids.shape[1]:].tolist() for i, p in enumerate(tc.prompts())]
    with torch.no_grad(), divtrace.record(m_train, train, mode="hash", label="train"):
        ids2, mask2 = tc.right_padded(seqs)
        m_train(input_ids=ids2.cuda(), attention_mask=mask2.cuda(), position_ids=tc.positions(mask2).cuda())
    d = bisect(train, roll).to_dict()
    _show(f"cuda rollout {dtype}", d)
    assert d["alignment"] == "tokens" and d["tokens"]["shared"] == 34
    assert d["verdict"] in ("identical", "diverged")
    if d["verdict"] == "diverged":
        f = d["first"]
        assert f["cause"] == "origin" and f["token"]["position"] >= 0 and f["rows"]["a"] and f["rows"]["b"]


def test_cuda_flash_against_math_attention(tmp_path):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    m = tc.llama(torch.bfloat16).cuda()
    ids, mask = tc.right_padded([p[:12] for p in tc.prompts()])
    ids = ids.cuda()
    for name, backend in (("math", SDPBackend.MATH), ("flash", SDPBackend.FLASH_ATTENTION)):
        with torch.no_grad(), sdpa_kernel(backend), divtrace.record(m, tmp_path / name, mode="hash", label=name):
            m(input_ids=ids)
    d = bisect(tmp_path / "math", tmp_path / "flash").to_dict()
    _show("flash vs math", d)
    assert d["verdict"] == "diverged"
    assert d["first"]["module"] == "model.layers.0.self_attn" and d["first"]["cause"] == "origin"
    assert "flash" in (d["first"]["op_b"] or "") or "flash" in (d["first"]["op"] or "")
