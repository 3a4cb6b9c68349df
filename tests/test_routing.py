"""Routing as values (docs/sharded.md, "Routing (MoE)"): a tiny HF Mixtral, two sides recorded, ground truth from
plain forward hooks on the routers and experts.

(a) a planted near-tie that a bf16 softmax before top-k turns into a tie on side b: bisect names layer 0's router
    as the origin, the flipped token, both experts and the margin cause; full and hash mode, calls and tokens.
(b) routing replay (divtrace.routing): the rollout's ids forced on side b remove the flip, the weight difference
    stays and is named ("expert ids equal on all N tokens, routing weights differ for M").
(c) one expert's kernel computed differently: the experts are the origin, no routing difference is claimed.
"""
from __future__ import annotations

import pytest
import torch

import divtrace
import routing_cases as rc

K = 2


def _run(model, ids, path, mode, replay=None):
    """Record one side; return what plain hooks saw: each layer's router (input, weights, ids) and experts output."""
    seen = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        def gate_hook(mod, args, out, i=i):
            seen[("gate", i)] = (args[0].detach().clone(), out[1].detach().clone(), out[2].detach().clone())

        def experts_hook(mod, args, out, i=i):
            seen[("experts", i)] = out.detach().clone()
        hooks += [layer.mlp.gate.register_forward_hook(gate_hook),
                  layer.mlp.experts.register_forward_hook(experts_hook)]
    try:
        with torch.no_grad():
            if replay is not None:
                with divtrace.routing.replay(model, replay), divtrace.record(model, path, mode=mode):
                    model(input_ids=ids, use_cache=False)
            else:
                with divtrace.record(model, path, mode=mode):
                    model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _bits_differ(x, y) -> list:
    """Rows of two [rows, k] tensors whose bytes differ."""
    return [r for r in range(x.shape[0]) if not torch.equal(x[r].view(-1), y[r].view(-1))]


def _margin(scores_row: torch.Tensor) -> float:
    """Ground truth: last chosen minus first unchosen score, exact (float64)."""
    v = torch.sort(scores_row.double(), descending=True).values
    return float(v[K - 1] - v[K])


@pytest.mark.parametrize("mode", ["full", "hash"])
@pytest.mark.parametrize("align", ["calls", "tokens"])
def test_near_tie_flip_is_named_at_the_router_with_its_margin(tmp_path, mode, align):
    model, ids = rc.mixtral()
    ga = _run(model, ids, tmp_path / "a", mode)
    model, ids = rc.mixtral()
    rc.bf16_router(model.model.layers[0].mlp.gate)
    gb = _run(model, ids, tmp_path / "b", mode)

    x, _, ids_a = ga[("gate", 0)]
    _, _, ids_b = gb[("gate", 0)]
    flipped = [r for r in range(ids_a.shape[0]) if set(ids_a[r].tolist()) != set(ids_b[r].tolist())]
    row = rc.TOKEN[0] * ids.shape[1] + rc.TOKEN[1]
    assert flipped == [row]  # the planted flip, and no other
    # All rows in one product, as the router computes them: a single row's product may take another kernel (a
    # vector-matrix one) and round differently on some CPUs.
    logits = (x.reshape(-1, x.shape[-1]) @ model.model.layers[0].mlp.gate.weight.T)[row]
    margin_a = _margin(torch.softmax(logits.float(), -1))
    margin_b = _margin(torch.softmax(logits.bfloat16(), -1))
    assert margin_b == 0.0 and margin_a > 0

    r = divtrace.bisect(tmp_path / "a", tmp_path / "b", align=align).to_dict()
    f = r["first"]
    assert r["verdict"] == "diverged"
    assert f["module"] == "model.layers.0.mlp.gate"  # the router, not the experts after it
    ro = f["routing"]
    assert ro["choice_differs"] == len(flipped) and ro["tokens"] == ids_a.shape[0]
    weights_differ = _bits_differ(ga[("gate", 0)][1], gb[("gate", 0)][1])
    assert ro["weights_differ"] == len(weights_differ)
    flip = ro["flips"][0]
    assert flip["token"]["position"] == rc.TOKEN[1] and flip["token"]["a"]["batch_row"] == rc.TOKEN[0]
    assert flip["margin_b"] == 0.0 and flip["dtype_b"] == "torch.bfloat16"
    assert "tie at margin 0 on b (top-k over bfloat16 scores)" in ro["why"]
    if mode == "full":
        slot = flip["slot"]
        assert [flip["a"], flip["b"]] == [ids_a[row][slot].item(), ids_b[row][slot].item()]
        assert flip["b"] not in ids_a[row].tolist()
        assert flip["margin_a"] == margin_a
        assert f"a chose {flip['a']}, b chose {flip['b']} at slot {slot}" in ro["why"]
    else:  # hash mode: the margin 0 is proven by its row fingerprint; a's margin is not stored
        assert flip["a"] is None and flip["margin_a"] is None


def test_the_margin_is_a_recorded_value(tmp_path):
    model, ids = rc.mixtral()
    seen = _run(model, ids, tmp_path / "a", "full")
    t = divtrace.open_trace(tmp_path / "a")
    got = [i for i, op in enumerate(t.rop) if op == "divtrace.topk_margin.default"]
    assert len(got) == len(model.model.layers)
    for layer, i in enumerate(got):
        x = seen[("gate", layer)][0]
        probs = torch.softmax((x.reshape(-1, x.shape[-1]) @ model.model.layers[layer].mlp.gate.weight.T).float(), -1)
        want = torch.tensor([_margin(p) for p in probs], dtype=torch.float64)
        assert torch.equal(t.tensor(t.records[i].outputs[0]), want)


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_replayed_ids_remove_the_flip_and_leave_the_weights(tmp_path, mode):
    model, ids = rc.mixtral()
    with divtrace.routing.capture(model) as rollout:
        ga = _run(model, ids, tmp_path / "a", mode)
    model, ids = rc.mixtral()
    rc.bf16_router(model.model.layers[0].mlp.gate)
    gb = _run(model, ids, tmp_path / "b", mode, replay=rollout.ids())

    for layer in range(2):
        assert torch.equal(ga[("gate", layer)][2], gb[("gate", layer)][2])  # the flip is gone
    weights_differ = _bits_differ(ga[("gate", 0)][1], gb[("gate", 0)][1])
    assert weights_differ  # bf16 softmax weights: other bits

    r = divtrace.bisect(tmp_path / "a", tmp_path / "b").to_dict()
    f = r["first"]
    assert f["module"] == "model.layers.0.mlp.gate"
    ro = f["routing"]
    assert ro["choice_differs"] == 0 and ro["order_differs"] == 0 and ro["flips"] == []
    assert ro["weights_differ"] == len(weights_differ)
    assert ro["own_choice_differs"] == 1  # the router's own top-k still flips; the ids it returns are the replayed
    n = ga[("gate", 0)][2].shape[0]
    assert ro["why"].startswith(f"expert ids equal on all {n} tokens, routing weights differ for "
                                f"{len(weights_differ)}")


def test_replay_leaves_a_planted_weight_difference_named_as_the_weights(tmp_path):
    model, ids = rc.mixtral()
    with divtrace.routing.capture(model) as rollout:
        ga = _run(model, ids, tmp_path / "a", "full")
    model, ids = rc.mixtral()
    rc.weights_other_order(model.model.layers[0].mlp.gate)  # same experts, weights renormalized otherwise
    gb = _run(model, ids, tmp_path / "b", "full", replay=rollout.ids())
    assert torch.equal(ga[("gate", 0)][2], gb[("gate", 0)][2])
    weights_differ = _bits_differ(ga[("gate", 0)][1], gb[("gate", 0)][1])
    assert weights_differ

    r = divtrace.bisect(tmp_path / "a", tmp_path / "b", align="calls").to_dict()
    f = r["first"]
    assert f["module"] == "model.layers.0.mlp.gate" and f["cause"] == "origin"
    assert f["routing"]["why"] == (f"expert ids equal on all {ga[('gate', 0)][2].shape[0]} tokens, routing weights "
                                   f"differ for {len(weights_differ)}")


def test_an_expert_kernel_difference_is_not_a_routing_difference(tmp_path):
    model, ids = rc.mixtral()
    ga = _run(model, ids, tmp_path / "a", "full")
    model, ids = rc.mixtral()
    rc.expert_kernel(model.model.layers[0].mlp.experts)
    gb = _run(model, ids, tmp_path / "b", "full")
    for part in range(3):  # every router output equal, the experts' output not
        assert torch.equal(ga[("gate", 0)][part], gb[("gate", 0)][part])
    assert not torch.equal(ga[("experts", 0)], gb[("experts", 0)])

    for align in ("calls", "tokens"):
        r = divtrace.bisect(tmp_path / "a", tmp_path / "b", align=align).to_dict()
        assert r["first"]["module"] == "model.layers.0.mlp.experts"
        assert r["first"]["routing"] is None
        assert all(o.get("routing") is None for o in r.get("origins", []))


def test_the_report_prints_the_routing_line_and_replay_refuses_bad_input(tmp_path):
    import subprocess
    import sys

    model, ids = rc.mixtral()
    _run(model, ids, tmp_path / "a", "hash")
    model, ids = rc.mixtral()
    rc.bf16_router(model.model.layers[0].mlp.gate)
    _run(model, ids, tmp_path / "b", "hash")
    p = subprocess.run([sys.executable, "-m", "divtrace", "bisect", str(tmp_path / "a"), str(tmp_path / "b")],
                       capture_output=True, text=True, env={**__import__("os").environ, "COLUMNS": "400"})
    assert p.returncode == 1
    line = next(x for x in p.stdout.splitlines() if "routing" in x and "router top-k" in x)
    assert "expert choice differs for 1 of 24 tokens" in line and "tie at margin 0 on b" in line

    with pytest.raises(divtrace.DivtraceError, match="no module 'model.nope'"):
        with divtrace.routing.replay(model, {"model.nope": torch.zeros(24, 2, dtype=torch.long)}):
            pass
    gate = "model.layers.0.mlp.gate"
    with pytest.raises(divtrace.DivtraceError, match="the ids given have shape"):
        with torch.no_grad(), divtrace.routing.replay(model, {gate: torch.zeros(3, 2, dtype=torch.long)}):
            model(input_ids=ids, use_cache=False)
    with pytest.raises(divtrace.DivtraceError, match="called 2 times"):
        with torch.no_grad(), divtrace.routing.replay(model, {gate: [torch.zeros(24, 2, dtype=torch.long)]}):
            model(input_ids=ids, use_cache=False)
            model(input_ids=ids, use_cache=False)


@pytest.mark.parametrize("mode", ["hash", "full"])
def test_the_margin_is_made_without_host_reads_on_the_device_path(tmp_path, monkeypatch, mode):
    """The device path (what a GPU takes), forced on the CPU under traps for host reads in divtrace's bookkeeping:
    the margins cost no read, and the trace is the CPU path's, margins included."""
    from test_device_path import record, trapped

    model, ids = rc.mixtral()
    run = lambda m: m(input_ids=ids, use_cache=False)
    record(model, tmp_path / "cpu", run, device=False, mode=mode)
    trap, caught = trapped(monkeypatch)
    with trap:
        record(model, tmp_path / "dev", run, device=True, mode=mode)
    assert caught == [] and trap.checked > 100
    # (not the whole trace: the experts' own empty_like buffers hold whatever memory held)
    margins = []
    for side in ("cpu", "dev"):
        t = divtrace.open_trace(tmp_path / side)
        margins.append([t.values[t.records[i].outputs[0]].hash for i, op in enumerate(t.rop)
                        if op == "divtrace.topk_margin.default"])
    assert len(margins[0]) == len(model.model.layers) and margins[0] == margins[1]


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_one_tie_broken_two_ways_is_the_top_k_itself(tmp_path, mode):
    """Both sides score in bf16 (equal scores, the planted tie on both); b's top-k breaks ties the other way."""
    model, ids = rc.mixtral()
    rc.bf16_router(model.model.layers[0].mlp.gate)
    ga = _run(model, ids, tmp_path / "a", mode)
    model, ids = rc.mixtral()
    rc.bf16_router_other_ties(model.model.layers[0].mlp.gate)
    gb = _run(model, ids, tmp_path / "b", mode)
    ids_a, ids_b = ga[("gate", 0)][2], gb[("gate", 0)][2]
    flipped = [r for r in range(ids_a.shape[0]) if set(ids_a[r].tolist()) != set(ids_b[r].tolist())]
    row = rc.TOKEN[0] * ids.shape[1] + rc.TOKEN[1]
    assert row in flipped

    for align in ("calls", "tokens"):
        f = divtrace.bisect(tmp_path / "a", tmp_path / "b", align=align).to_dict()["first"]
        assert f["module"] == "model.layers.0.mlp.gate" and f["cause"] == "origin"
        assert f["op"] == "aten.topk.default"  # its input is equal on both sides: the top-k is the origin
        ro = f["routing"]
        assert ro["choice_differs"] == len(flipped)
        flip = next(x for x in ro["flips"] if x["token"]["position"] == rc.TOKEN[1]
                    and x["token"]["a"]["batch_row"] == rc.TOKEN[0])
        assert flip["margin_a"] == 0.0 and flip["margin_b"] == 0.0
        assert flip["cause"] == "tie broken differently at margin 0 (top-k over bfloat16 scores on both)"
