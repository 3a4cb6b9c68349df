"""An attention whose own rows of a token are equal on both sides still reads the K/V rows of the earlier tokens of
its sequence: where one of those differs, the attention is no origin ("inputs bitwise equal", "not
batch-invariant" would be false), the earlier token's difference is.

Side a runs one sequence with layer 1's k_proj output changed on one earlier row only (token x); side b runs the
same sequence in a batch of two, unchanged. Both keep the last token's logits only (`logits_to_keep=1`), so x's
own final value is never compared: the difference at x reaches the output only through the last token's attention
over x's K row. Ground truth from plain forward hooks: k_proj's output differs at row x only, every input and
output row of the last token is equal up to the attention module, whose output row differs, and the last token's
logits differ. bisect must name k_proj (the planted op) at token x, through attention, in full and hash mode.
Before, it named layer 1's attention kernel with its inputs "bitwise equal" and, the batch sizes differing, "not
batch-invariant" (seen first on an FSDP2 bf16 run against one process, a difference absorbed at its own token).
"""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

import divtrace  # noqa: E402
import token_cases as tc  # noqa: E402

X = 2  # the earlier token whose K row differs on side a
SEQ = tc.prompts(lengths=(8, 8), seed=3)


def _plant_row(linear, row: int, scale: float) -> None:
    """The linear's output row `row` (of dim 1) scaled by `scale`, with recorded ops (no in-place write)."""
    real = type(linear).forward

    def forward(self, x):
        y = real(self, x)
        pick = (torch.arange(y.shape[1]) == row).view(1, -1, 1)
        return torch.where(pick, y * scale, y)

    linear.forward = forward.__get__(linear)


def _hooks(model):
    caps, hs = {}, []
    for path, m in model.named_modules():
        def pre(mod, args, kwargs, path=path):
            x = args[0] if args else kwargs.get("hidden_states", kwargs.get("input_ids"))
            caps[path] = [x.detach().clone() if isinstance(x, torch.Tensor) else None, None]

        def post(mod, args, kwargs, out, path=path):
            t = out[0] if isinstance(out, tuple) else getattr(out, "logits", out)
            caps[path][1] = t.detach().clone() if isinstance(t, torch.Tensor) else None
        hs += [m.register_forward_pre_hook(pre, with_kwargs=True), m.register_forward_hook(post, with_kwargs=True)]
    return caps, hs


def _run(model, path, batch, mode):
    caps, hs = _hooks(model)
    try:
        with torch.no_grad(), divtrace.record(model, path, mode=mode):
            model(torch.tensor(batch), logits_to_keep=1)
    finally:
        for h in hs:
            h.remove()
    return caps


def _row(t, b, p):
    return t[b, p].contiguous().view(torch.uint8)


def test_an_attention_over_a_differing_earlier_k_row_is_no_origin(tmp_path):
    torch.set_num_threads(1)
    a_model, b_model = tc.llama(), tc.llama()
    _plant_row(a_model.model.layers[1].self_attn.k_proj, X, 1 + 2 ** -6)
    last = len(SEQ[0]) - 1
    for mode in ("full", "hash"):
        ca = _run(a_model, tmp_path / f"a-{mode}", [SEQ[0]], mode)
        cb = _run(b_model, tmp_path / f"b-{mode}", SEQ, mode)  # sequence 0 is row 0 of b's batch
        # the hooks' truth
        k = "model.layers.1.self_attn.k_proj"
        diff_rows = [p for p in range(last + 1) if not torch.equal(_row(ca[k][1], 0, p), _row(cb[k][1], 0, p))]
        assert diff_rows == [X]
        for m in ("model.layers.1.self_attn.q_proj", k, "model.layers.1.self_attn.v_proj"):
            assert torch.equal(_row(ca[m][0], 0, last), _row(cb[m][0], 0, last))
            assert torch.equal(_row(ca[m][1], 0, last), _row(cb[m][1], 0, last)), m
        attn = "model.layers.1.self_attn"
        assert torch.equal(_row(ca[attn][0], 0, last), _row(cb[attn][0], 0, last))
        assert not torch.equal(_row(ca[attn][1], 0, last), _row(cb[attn][1], 0, last))
        assert not torch.equal(_row(ca[""][1], 0, 0), _row(cb[""][1], 0, 0))  # the last token's logits row
        # divtrace
        d = divtrace.bisect(tmp_path / f"a-{mode}", tmp_path / f"b-{mode}").to_dict()
        assert d["alignment"] == "tokens" and d["verdict"] == "diverged", d.get("reason")
        f = d["first"]
        assert (f["module"], f["token"]["position"]) == (k, X), (f["module"], f["op"], f["token"])
        assert f["op"] in ("aten.mul.Tensor", "aten.where.self"), f["op"]
        assert "through attention" in f["note"] and f"position {last}" in f["note"]
        assert [o["module"] for o in d["origins"]] == [k], [(o["module"], o["op"]) for o in d["origins"]]
        assert "not batch-invariant" not in json.dumps(d["origins"])


def test_an_earlier_layers_difference_at_one_token_is_the_later_tokens_origin(tmp_path):
    """Side a scales layer 0's up_proj output row of token 5 only; b runs the same sequence in a batch of two,
    unchanged. The hooks: token 5 differs from layer 0's MLP on; tokens 6 and 7 first differ at layer 1's attention,
    whose input rows for them are equal: they read token 5's K/V rows, which differ at the attention's input
    already. Their origin is token 5's up_proj, through attention, in bisect and in the tests' own rule
    (origin_truth.Truth.origins: it had named layer 1's attention for them, since token 5's rows differed before
    that module)."""
    import origin_truth as ot

    torch.set_num_threads(1)
    a_model, b_model = tc.llama(), tc.llama()
    up = "model.layers.0.mlp.up_proj"
    _plant_row(a_model.model.layers[0].mlp.up_proj, 5, 1 + 2 ** -6)
    n = len(SEQ[0])
    sides = []
    for name, model, batch in (("a", a_model, [SEQ[0]]), ("b", b_model, SEQ)):
        rows = ot.ModuleRows(model)
        try:
            with torch.no_grad(), divtrace.record(model, tmp_path / name, mode="full"):
                model(torch.tensor(batch))
        finally:
            rows.remove()
        grid = (len(batch), n)
        sides.append((rows, [ot.Layout(grid, [(s, p) for s in range(len(batch)) for p in range(n)])]))
    truth = ot.Truth(*sides[0], *sides[1], final="lm_head")
    assert truth.out_differs[up] == {(0, 5)} and truth.final_differs == {(0, 5), (0, 6), (0, 7)}
    attn = "model.layers.1.self_attn"
    assert truth.in_differs[attn] == {(0, 5)} and truth.out_differs[attn] == {(0, 5), (0, 6), (0, 7)}
    assert truth.origins() == {up: 3}  # (the old rule: {up: 1, attn: 2})
    d = divtrace.bisect(tmp_path / "a", tmp_path / "b").to_dict()
    assert d["alignment"] == "tokens" and d["verdict"] == "diverged", d.get("reason")
    assert {o["module"]: o["tokens"] for o in d["origins"]} == truth.origins(), d["origins"]
    assert "through attention over the K/V rows of the token at position 5" in d["first"]["note"]
