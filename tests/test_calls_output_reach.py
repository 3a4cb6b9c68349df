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


class _Norm(torch.nn.Module):
    """Writes its output in place into a buffer it shares with the head, through a view of it (no op's output is
    the buffer's new value: the trace records it as bytes from outside, with no producer)."""

    def __init__(self, owner):
        super().__init__()
        self.owner = [owner]
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        self.owner[0].buf[: x.shape[0]].copy_(y)
        return y


class _Head(torch.nn.Module):
    """Reads the rows it is given (its only input: indices) from that buffer."""

    def __init__(self, owner):
        super().__init__()
        self.owner = [owner]
        self.lin = torch.nn.Linear(16, 32, bias=False)

    def forward(self, idx):
        return self.lin(self.owner[0].buf.index_select(0, idx))


class _BufModel(torch.nn.Module):
    def __init__(self, registered: bool):
        super().__init__()
        torch.manual_seed(0)
        if registered:
            self.register_buffer("buf", torch.zeros(8, 16))
        else:
            self.buf = torch.zeros(8, 16)  # (a plain attribute: no name in the trace)
        self.layer = torch.nn.Linear(16, 16)
        self.norm = _Norm(self)
        self.head = _Head(self)

    def forward(self, x, idx):
        self.norm(self.layer(x))
        return self.head(idx)


@pytest.mark.parametrize("mode,registered", [("full", False), ("hash", True)])
def test_a_difference_reaching_the_head_through_a_buffer_written_in_place_is_the_origin(tmp_path, mode, registered):
    """Every differing output (the logits) is the head's, whose input (the row indices) is equal on both sides; but
    the head reads the buffer the norm wrote in place, so the layer's planted weight reaches it. Before: the walk
    entered the head, named its index_select (the buffer as an outside input) and listed layer and norm as absorbed.
    Now the head's outside reads (the buffer, which differs) keep the first-in-order rule: layer is the origin."""
    x, idx = torch.linspace(-2, 2, 6 * 16).reshape(6, 16), torch.tensor([5])
    seen = {}
    for side in ("a", "b"):
        m = _BufModel(registered)
        with torch.no_grad():
            if side == "b":
                m.layer.weight[2, 3] += 2.0 ** -6
        hooks = [mod.register_forward_hook(lambda mod, a, o, n=n, s=side: seen.__setitem__((s, n), (a, o)))
                 for n, mod in m.named_modules() if n]
        with torch.no_grad(), divtrace.record(m, str(tmp_path / side), mode=mode):
            m(x, idx)
        for h in hooks:
            h.remove()

    def equal(n, i):
        a, b = seen[("a", n)][i], seen[("b", n)][i]
        a, b = (a,) if isinstance(a, torch.Tensor) else a, (b,) if isinstance(b, torch.Tensor) else b
        return all(torch.equal(p, q) for p, q in zip(a, b))
    # Ground truth (plain hooks): layer's input equal, its output not (the origin); the head's input equal, its
    # output not (reached through the buffer)
    assert equal("layer", 0) and not equal("layer", 1) and not equal("norm", 1)
    assert equal("head", 0) and not equal("head", 1)
    d = divtrace.bisect(str(tmp_path / "a"), str(tmp_path / "b"), align="calls").to_dict()
    assert d["verdict"] == "diverged" and d["first"]["module"] == "layer" and d["first"]["cause"] == "origin", \
        (d["first"], d["absorbed"])
    assert d["absorbed"] == []
