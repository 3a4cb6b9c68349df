"""A difference in a token whose own logits are not kept (logits_to_keep=1: only the last token's row) and that no
later token reads (layer 1's MLP, the last layer, at token 5): every compared final value is equal, so the verdict
is `absorbed` (exit 4), and `absorbed` lists the difference. It had said `PASSED: ...; 0 internal differences
absorbed` with an empty `absorbed` while the reason counted 1: no absorb rule covered a call whose output row
differs under a root call whose output holds no row of that token. Ground truth from plain forward hooks. (Seen
first on TP=2 runs; the token sweep is the same for one process.)"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import divtrace  # noqa: E402
import token_cases as tc  # noqa: E402
from test_attention_kv_origin import SEQ, _plant_row, _row, _run  # noqa: E402


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_a_difference_in_an_unkept_row_is_listed_absorbed(tmp_path, mode):
    torch.set_num_threads(1)
    a_model, b_model = tc.llama(), tc.llama()
    up = "model.layers.1.mlp.up_proj"
    _plant_row(a_model.get_submodule(up), 5, 1 + 2 ** -6)
    ca = _run(a_model, tmp_path / "a", [SEQ[0]], mode)  # (logits_to_keep=1)
    cb = _run(b_model, tmp_path / "b", [SEQ[0]], mode)  # (the same batch: its kept logits row is equal)
    n = len(SEQ[0])
    # the hooks: up_proj differs at token 5 only, the final norm too; the kept logits row is equal
    assert [p for p in range(n) if not torch.equal(_row(ca[up][1], 0, p), _row(cb[up][1], 0, p))] == [5]
    assert [p for p in range(n) if not torch.equal(_row(ca["model.norm"][1], 0, p), _row(cb["model.norm"][1], 0, p))] == [5]
    assert torch.equal(_row(ca[""][1], 0, 0), _row(cb[""][1], 0, 0))
    r = divtrace.bisect(tmp_path / "a", tmp_path / "b", align="tokens")
    d = r.to_dict()
    assert d["alignment"] == "tokens" and d["verdict"] == "absorbed" and d["first"] is None, d["reason"]
    got = [(e["module"], e["kind"], e["tokens"], e["tokens_final_differs"]) for e in d["absorbed"]]
    assert ("model", "module", 1, 0) in got, got
    assert "logits_to_keep" in next(e["note"] for e in d["absorbed"] if e["module"] == "model")
