"""An engine that declares the right positions (rec.tokens) but computes one sequence at positions shifted by one:
the cause is the positions, said as such, never a rotary lookup "origin" in the attention.

vLLM passes positions by position below its root (`self.model(input_ids, positions, ...)`, `layer(positions,
hidden, residual)`): divtrace reads the positions a model uses from the first module input named
`position_ids`/`positions`, passed by keyword or by position. Regression: only keyword inputs were read, so the
engine's shifted positions were never seen, and bisect named the attention's cos/sin lookup (`aten.index.Tensor`)
for the shifted sequence's tokens.

Ground truth from plain hooks: the positions the engine's rotary embeddings get, against the ones it declared,
and the logits rows of both sides.
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


def _shift_sequence_one(eng):
    """The engine's forward computes sequence 1's rows at positions + 1 (what it declared is untouched)."""
    real = type(eng).forward

    def forward(self, input_ids, positions):
        own = [i for i, sl, _ in em.Engine.current for _ in range(sl.stop - sl.start)]
        shifted = torch.tensor([p + 1 if o == 1 else p for p, o in zip(positions.tolist(), own)])
        return real(self, input_ids, shifted)

    eng.forward = types.MethodType(forward, eng)


@pytest.mark.parametrize("mode", ["hash", "full"])
def test_positions_an_engine_uses_by_position_are_the_cause(tmp_path, mode):
    from divtrace.align.paths import PathMap

    ps = tc.prompts()
    hf = oc.llama(dtype=torch.bfloat16)
    with em.batch_invariant(hf):
        eng = em.Engine.from_hf(hf)
        _shift_sequence_one(eng)
        rows = oc.ot.ModuleRows(eng)
        seen = []  # the hooks' truth: the positions layer 0's rotary embedding used, per step, against the declared
        rope = eng.model.layers[0].self_attn.rotary_emb
        h = rope.register_forward_pre_hook(lambda m, a: seen.append(a[0].tolist()))
        with divtrace.record(eng, tmp_path / "engine", mode=mode) as rec:
            seqs = em.generate(eng, ps, 4, rec=rec)
        h.remove()
        rows.remove()
        side = oc.Side(tmp_path / "engine", rows, oc.ot.engine_layouts(ps, 4), seqs)
        train = oc.trainer(hf, tmp_path / "train", seqs, mode=mode)
    declared = list(range(len(ps[0]))) + list(range(len(ps[1])))
    assert seen[0] == list(range(len(ps[0]))) + [p + 1 for p in range(len(ps[1]))] != declared
    truth = oc.truth(train, side)
    assert truth.final_differs and {s for s, _ in truth.final_differs} == {1}  # sequence 0's logprobs are equal
    n_shifted = len(seqs[1]) - 1  # sequence 1's tokens both sides fed (the engine never feeds its last one)
    d = divtrace.bisect(train.path, side.path, path_map=PathMap.from_file(MAP)).to_dict()
    assert d["verdict"] == "diverged"
    f = d["first"]
    assert f["kind"] == "positions" and f["tokens"] == n_shifted, (f["kind"], f["module"], f.get("op"))
    assert f"position ids differ on {n_shifted} tokens: a 0.., b 1.." in f["cause_text"], f["cause_text"]
    assert [o["kind"] for o in d["origins"]] == ["positions"], [(o["module"], o["op"]) for o in d["origins"]]
