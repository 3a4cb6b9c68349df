"""An engine whose attention is its own torch code (no attention op a name tells, here in code HF has no
counterpart for: the fused qkv split, the KV cache, the per-row softmax) reads the K/V rows of the earlier tokens of
a sequence: a token whose own rows are equal up to the attention, and whose attention output differs because an
earlier token's K/V rows differ, has that earlier token's difference as its origin, never the attention's own code.

The engine's layer-0 down_proj scales its output in decode step 3 (of 5) only: the tokens of that step differ there,
and every later token of their sequences only through layer 1's attention over their K/V rows. Regression: bisect
named layer 1's self_attn (its own code, inputs not compared) as a second and third origin for the later tokens.

Ground truth from plain hooks: the modules whose output rows differ per token, their inputs, and the logits rows.
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

import divtrace

sys.path.insert(0, str(Path(__file__).parent))
import engine_model as em  # noqa: E402
import origin_cases as oc  # noqa: E402
import token_cases as tc  # noqa: E402

pytest.importorskip("transformers")

MAP = Path(__file__).parent / "maps" / "engine-hf.yaml"
STEP, STEPS = 3, 5
DOWN = "model.layers.0.mlp.down_proj"
ATTN = "model.layers.1.self_attn"
NORM = "model.layers.1.input_layernorm"


def _plant_in_step(eng, step: int):
    lin = eng.model.layers[0].mlp.down_proj
    real = type(lin).forward
    calls = {"n": -1}
    eng.register_forward_pre_hook(lambda m, a: calls.__setitem__("n", calls["n"] + 1))

    def forward(self, x):
        y = real(self, x)
        return y * (1 + 2 ** -6) if calls["n"] == step else y

    lin.forward = types.MethodType(forward, lin)


@pytest.mark.parametrize("mode", ["hash", "full"])
def test_a_later_decode_token_reached_through_own_code_attention(tmp_path, mode):
    from divtrace.align.paths import PathMap

    ps = tc.prompts()
    hf = oc.llama()
    real = em.Engine.from_hf

    def planted(h, causes=()):
        e = real(h, causes)
        _plant_in_step(e, STEP)
        return e

    em.Engine.from_hf = planted
    try:
        with em.batch_invariant(hf):
            eng = oc.engine(hf, tmp_path / "engine", ps, new_tokens=STEPS, mode=mode)
            train = oc.trainer(hf, tmp_path / "train", eng.seqs, mode=mode)
    finally:
        em.Engine.from_hf = real
    truth = oc.truth(train, eng)
    # the hooks: down_proj differs on the tokens of step 3 only (one per sequence, each the STEP-th sampled one's
    # input row), and each later token whose logits differ has equal rows at layer 1's attention input and a
    # differing attention output: it is reached through the attention over the step-3 token's K/V rows
    stepped = {(i, len(p) + STEP - 1) for i, p in enumerate(ps)}
    assert truth.out_differs[DOWN] == stepped
    later = truth.final_differs - stepped
    assert stepped <= truth.final_differs and later
    for t in later:
        assert t[1] > len(ps[t[0]]) + STEP - 1
        # (the attention's input is the norm's output: the engine's self_attn gets positions first)
        assert t not in truth.out_differs[NORM] and t in truth.out_differs[ATTN], t
        assert t not in truth.out_differs[DOWN]
    d = divtrace.bisect(train.path, eng.path, path_map=PathMap.from_file(MAP)).to_dict()
    assert d["verdict"] == "diverged" and d["final"]["tokens_differing"] == len(truth.final_differs)
    assert {o["module"]: o["tokens"] for o in d["origins"]} == {DOWN: len(truth.final_differs)}, \
        [(o["module"], o["op"], o["tokens"]) for o in d["origins"]]
    o = d["origins"][0]
    assert (o["token"]["seq"]["number"], o["token"]["position"]) in stepped
    assert "through attention" in (o.get("note") or "")
