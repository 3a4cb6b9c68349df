"""Heads tensors whose shape fits two token layouts ([B, H, T, d] with B == H == T: 4 prompts of 4 tokens on a model
with 4 heads) get their layout from the op that made them (divtrace/record/token_provenance.py), so bisect compares
the ops between the projections and the attention output per token and names the attention, not the region's
first op.

Regression (seen on an AMD EPYC, TRL's 4 equal-length prompts on a 4-head model): the rollout's prefill had no
token rows for q, k, v after their head views, the rotary ops and the attention output; bisect named the rotary
multiply (`aten.mul.Tensor`, "not every input could be compared") for what the attention did. Planted here on any
CPU: side b's layer 0 attention scales its scores by another factor (HF's `scaling`, real model code). Ground
truth from plain hooks: q/k/v projections equal for the shared tokens, o_proj's input differs.
"""
from __future__ import annotations

import pytest
import torch

import divtrace
from token_cases import llama, prompts


def _run(path, seqs, mode, plant=False):
    model = llama(hidden=64)  # 4 heads of 16
    if plant:
        model.model.layers[0].self_attn.scaling *= 1.0 + 2.0 ** -10
    attn = model.model.layers[0].self_attn
    seen = {}
    hooks = [getattr(attn, n).register_forward_hook(lambda m, a, out, n=n: seen.__setitem__(n, out.detach().clone()))
             for n in ("q_proj", "k_proj", "v_proj")]
    hooks.append(attn.o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("o_in", a[0].detach().clone())))
    ids = torch.tensor(seqs)
    with torch.no_grad(), divtrace.record(model, path, mode=mode, label="b" if plant else "a"):
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("mode", ["hash", "full"])
def test_the_attention_is_named_where_the_heads_shape_is_ambiguous(tmp_path, mode):
    full = prompts((10, 10, 10, 10), seed=3)
    a = _run(tmp_path / "a", full, mode)  # a trainer: whole sequences, T = 10
    b = _run(tmp_path / "b", [s[:4] for s in full], mode, plant=True)  # a prefill: B = H = T = 4
    for n in ("q_proj", "k_proj", "v_proj"):  # the truth: the projections agree on the shared tokens ...
        assert torch.equal(a[n][:, :4], b[n]), n
    assert not torch.equal(a["o_in"][:, :4], b["o_in"])  # ... and the attention output does not

    r = divtrace.bisect(tmp_path / "a", tmp_path / "b", align="tokens")
    assert r.verdict == "diverged"
    f = r.first
    assert f.module == "model.layers.0.self_attn"
    assert "scaled_dot_product" in (f.op or "") and "scaled_dot_product" in (f.op_b or ""), (f.op, f.op_b)
