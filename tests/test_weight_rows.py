"""A weight is not a token grid: a view of a parameter (`w.t()` inside a linear, a reshape of a weight's local block
on a rank of a TP run) gets no token rows, even when its first dim equals the token count, while the views of
activations made from the tokens keep theirs. Before, an HF Llama with hidden size 16 fed 16 tokens gave each
`t()` of a [16, 16] weight 16 "token rows" (a hash of each weight row) every forward, and a rank of a TP run gave
them to its [256, 512] q/k/v blocks at sequence 256."""
from __future__ import annotations

import json

import torch

import divtrace


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def test_views_of_weights_get_no_token_rows_and_views_of_activations_keep_theirs(tmp_path):
    model = _llama()
    ids = torch.randint(0, 50, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), divtrace.record(model, tmp_path / "t", mode="hash", ops=True):
        model(ids)
    recs = [json.loads(x) for x in (tmp_path / "t" / "records.jsonl").read_text().splitlines()]
    rows = {json.loads(x)[0] for x in (tmp_path / "t" / "rows.jsonl").read_text().splitlines()}
    made = {v["v"] for r in recs if r.get("k") == "o" for v in r.get("V", []) if v.get("p") == r["i"]}
    # ground truth from the model itself: the values whose bytes are a parameter's (same shape as one, read
    # straight from outside the forward: no op of the forward made them)
    params = {tuple(p.shape) for p in model.parameters()}
    weight_views, act_views = [], []
    for r in recs:
        if r.get("k") != "o" or r["op"] not in ("aten.t.default", "aten.view.default"):
            continue
        src, out = r["in"][0], r["out"][0]
        shape = next(v["s"] for v in r["V"] if v["v"] == out)
        if shape[:1] != [16]:
            continue  # (only a first dim equal to the token count could be taken for tokens)
        (act_views if src in made else weight_views).append(out)
        if src not in made:
            src_shape = next(v["s"] for rr in recs for v in rr.get("V", []) if v["v"] == src)
            assert tuple(src_shape) in params, (r["op"], src_shape)
    assert len(weight_views) >= 4  # q, k, v, o projections' weight.t() at least
    assert act_views  # the hidden states flattened for the matmuls
    assert not [v for v in weight_views if v in rows]
    assert all(v in rows for v in act_views)


def test_an_op_handing_back_its_own_input_keeps_its_rows(tmp_path):
    """Regression: `x.to(x.dtype)` under inference mode (vLLM's engine runs so) reaches the recorder as
    `aten.to.dtype`, an aliasing op that returns `x` itself; its value's token rows were lost when the rule above
    looked up its source in the table after the output (the same tensor) had replaced it there."""
    class Cast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 16)

        def forward(self, input_ids):
            x = self.emb(input_ids)
            return x.to(torch.float32) * 2

    m = Cast()
    ids = torch.randint(0, 50, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), divtrace.record(m, tmp_path / "t", mode="hash", ops=True):
        m(input_ids=ids)
    recs = [json.loads(x) for x in (tmp_path / "t" / "records.jsonl").read_text().splitlines()]
    rows = {json.loads(x)[0] for x in (tmp_path / "t" / "rows.jsonl").read_text().splitlines()}
    cast = [r for r in recs if r.get("op") == "aten.to.dtype"]
    assert cast, [r.get("op") for r in recs]  # (the op reached the recorder: else this test tests nothing)
    assert cast[0]["in"][0] in rows and cast[0]["out"][0] in rows
