"""Call alignment names as origin only a difference that reaches the outputs that differ (hunt 4, TP=2 against TP=1
with `logits_to_keep=1`): a nudge at token 5 of the last layer's up_proj changes the decoder's output in row 5 only,
which lm_head, reading the last row, never sees; the logits differ for lm_head's own reason. The call walk entered
the first differing child (the decoder) and named up_proj. Now lm_head is the origin and up_proj is listed as
absorbed. Ground truth from plain forward hooks on both sides; HF LlamaForCausalLM, one process."""
from __future__ import annotations

import pytest
import torch

import divtrace
from helpers import hf_llama

POS = 5  # the token whose up_proj row differs on b (not the last: logits_to_keep=1 keeps only the last)


def _run(model, ids, path, mode, nudge_up: bool, nudge_head: bool):
    """Record one forward (logits_to_keep=1) of `model`, planted as asked; return what plain hooks saw."""
    seen = {}
    up = model.model.layers[-1].mlp.up_proj
    hooks = []

    def plant(mod, args, out):
        out = out.clone()
        out[:, POS] = out[:, POS] * (1 + 2 ** -6)
        return out

    if nudge_up:
        hooks.append(up.register_forward_hook(plant))
    hooks.append(up.register_forward_hook(lambda m, a, o: seen.__setitem__("up", o.detach().clone())))
    hooks.append(model.model.register_forward_hook(
        lambda m, a, o: seen.__setitem__("decoder", o.last_hidden_state.detach().clone())))
    hooks.append(model.lm_head.register_forward_hook(
        lambda m, a, o: seen.update(head_in=a[0].detach().clone(), head_out=o.detach().clone())))
    w = model.lm_head.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            if nudge_head:
                w[3, 7] += 2.0 ** -4
            with divtrace.record(model, path, mode=mode):
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        with torch.no_grad():
            w.copy_(saved)
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_a_difference_lm_head_never_reads_is_absorbed_and_lm_head_is_the_origin(tmp_path, mode, capsys):
    model, inputs = hf_llama("eager", layers=2)
    ids = inputs["input_ids"][:1]
    a = _run(model, ids, tmp_path / "a", mode, nudge_up=False, nudge_head=False)
    b = _run(model, ids, tmp_path / "b", mode, nudge_up=True, nudge_head=True)
    # Ground truth: up_proj differs in row POS only, the decoder's output too; lm_head's input (the last row) is
    # equal and its output differs
    rows = (a["up"] != b["up"]).any(-1)[0]
    assert rows.nonzero().flatten().tolist() == [POS]
    assert (a["decoder"] != b["decoder"]).any(-1)[0].nonzero().flatten().tolist() == [POS]
    assert torch.equal(a["head_in"], b["head_in"]) and not torch.equal(a["head_out"], b["head_out"])

    r = divtrace.bisect(str(tmp_path / "a"), str(tmp_path / "b"), align="calls")
    d = r.to_dict()
    assert r.verdict == "diverged" and d["first"]["module"] == "lm_head", d["first"]
    assert d["first"]["cause"] == "origin"
    assert [x["module"] for x in d["absorbed"]] == ["model.layers.1.mlp.up_proj"], d["absorbed"]
    assert "reaches none of the outputs that differ" in d["absorbed"][0]["note"]
    from divtrace.cli.app import main

    capsys.readouterr()
    assert main(["bisect", str(tmp_path / "a"), str(tmp_path / "b"), "--align", "calls"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "absorbed: 1 earlier difference(s) reach none of the outputs that differ, not the origin: " \
           "model.layers.1.mlp.up_proj" in out, out[:2000]


def test_a_difference_that_reaches_the_logits_is_still_the_origin(tmp_path):
    """The same plant at the last token (which lm_head reads): up_proj stays the origin, nothing passed over."""
    global POS
    model, inputs = hf_llama("eager", layers=2)
    ids = inputs["input_ids"][:1]
    old, POS = POS, ids.shape[1] - 1
    try:
        _run(model, ids, tmp_path / "a", "hash", nudge_up=False, nudge_head=False)
        b = _run(model, ids, tmp_path / "b", "hash", nudge_up=True, nudge_head=True)
    finally:
        POS = old
    assert b["up"] is not None
    d = divtrace.bisect(str(tmp_path / "a"), str(tmp_path / "b"), align="calls").to_dict()
    assert d["first"]["module"] == "model.layers.1.mlp.up_proj" and d["absorbed"] == [], (d["first"], d["absorbed"])
