"""Routing under expert parallelism (docs/sharded.md, "Routing (MoE)"): the MoE layer of tests/moe_cases.py with
its router (`moe.router`, a `Gate`: no HF *Router class) routing each rank's share of the tokens, declared
`S(0)@ep`, and its experts split over 2 gloo ranks by all_to_all, against the same layer on one rank (and on 2).

(a) a near-tie planted in the gate's weights by construction (one token's k-th and (k+1)-th experts equal in bf16,
    ordered in float32): float32 softmax on one side, bf16 on the other; bisect names the router, the token, and the
    cause "tie at margin 0 on b (top-k over bfloat16 scores)" from the top-k margins recorded on the ranks, in full
    and hash mode;
(b) routing replay under EP: the 1-rank run's expert ids (divtrace.routing.capture, by regex) forced on the 2-rank
    side's routers (each rank its tokens' rows: divtrace.routing.replay): the flip is gone, the weight difference
    stays and is named;
(c) hash mode moves no tensor bytes: the recorded forward's collectives are the plain forward's, bytes and all.
Ground truth from plain forward hooks on the router, in the test."""
from __future__ import annotations

import json

import pytest
import torch

import divtrace
from dist_harness import run_ranks
from moe_cases import TIE_TOKEN, TOPK, routing_worker

MODES = ("full", "hash")


def _merge(per_rank, name):
    out = {}
    for caps in per_rank:
        for k in ("x", "logits", "w", "ids"):
            out.setdefault(k, {}).update(caps[name][k])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eprouting")
    ep1 = run_ranks(routing_worker, 1, str(root / "ep1"),
                    [(f"{c}-{m}", m, r) for m in MODES for c, r in (("flip", "bf16"), ("rollout", "fp32"))])
    ep2 = run_ranks(routing_worker, 2, str(root / "ep2"),
                    [(f"{c}-{m}", m, r) for m in MODES for c, r in (("flip", "fp32"), ("bf16", "bf16"))])
    forced = {f"replay-{c}-{m}": ep1[0][f"rollout-{m}"]["captured"]["moe.router"][0]
              for m in MODES for c in ("bf16", "renorm")}
    replays = (("bf16", "bf16"), ("renorm", "fp32-renorm"))
    got = run_ranks(routing_worker, 2, str(root / "ep2"),
                    [(f"replay-{c}-{m}", m, r) for m in MODES for c, r in replays], forced)
    for rank in (0, 1):
        ep2[rank].update(got[rank])
    return root, ep1, ep2


def _margins(logits: torch.Tensor, dtype) -> float:
    """Ground truth: the last chosen minus first unchosen score of a router's logits row, softmax in `dtype`,
    exact (float64)."""
    v = torch.sort(torch.softmax(logits.to(dtype), -1).double(), descending=True).values
    return float(v[TOPK - 1] - v[TOPK])


def _flipped(a, b) -> list:
    return sorted(t for t in a["ids"] if set(a["ids"][t].tolist()) != set(b["ids"][t].tolist()))


def _weights_differ(a, b) -> list:
    return sorted(t for t in a["w"] if not torch.equal(a["w"][t].view(torch.int32), b["w"][t].view(torch.int32)))


@pytest.mark.gloo
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("other", ["ep1", "ep2"])
def test_near_tie_flip_found_at_the_router_and_its_token(runs, mode, other):
    """a: EP=2, float32 softmax; b: bf16 softmax at EP=1 (or EP=2). The planted token, and only it, flips (hooks);
    bisect names the router and that token, with b's margin 0 (a tie in bf16) and, in full mode, a's margin."""
    root, ep1, ep2 = runs
    a = _merge(ep2, f"flip-{mode}")
    b = _merge(ep1, f"flip-{mode}") if other == "ep1" else _merge(ep2, f"bf16-{mode}")
    assert _flipped(a, b) == [TIE_TOKEN]
    assert _margins(a["logits"][TIE_TOKEN], torch.bfloat16) == 0.0
    margin_a = _margins(a["logits"][TIE_TOKEN], torch.float32)
    assert margin_a > 0

    side_b = root / other / (f"flip-{mode}" if other == "ep1" else f"bf16-{mode}")
    r = divtrace.bisect(str(root / "ep2" / f"flip-{mode}"), str(side_b)).to_dict()
    f = r["first"]
    assert r["verdict"] == "diverged" and f["module"] == "moe.router", f
    ro = f["routing"]
    assert ro["tokens"] == len(a["ids"]) and ro["choice_differs"] == 1
    assert ro["weights_differ"] == len(_weights_differ(a, b))
    flip = ro["flips"][0]
    assert flip["token"] == {"call": 0, "row": TIE_TOKEN}
    assert flip["margin_b"] == 0.0 and flip["dtype_b"] == "torch.bfloat16" and flip["dtype_a"] == "torch.float32"
    assert "tie at margin 0 on b (top-k over bfloat16 scores)" in ro["why"], ro["why"]
    if mode == "full":
        ia, ib = a["ids"][TIE_TOKEN].tolist(), b["ids"][TIE_TOKEN].tolist()
        assert [flip["a"], flip["b"]] == [ia[flip["slot"]], ib[flip["slot"]]] and flip["b"] not in ia
        assert flip["margin_a"] == margin_a
    else:  # hash mode: the tie is proven by its row fingerprint; which experts, and a's margin, are not stored
        assert flip["a"] is None and flip["margin_a"] is None


@pytest.mark.gloo
def test_the_report_prints_the_routing_line_for_run_directories(runs):
    import os
    import subprocess
    import sys

    root, _, _ = runs
    p = subprocess.run([sys.executable, "-m", "divtrace", "bisect", str(root / "ep2" / "flip-hash"),
                        str(root / "ep1" / "flip-hash")], capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "400"})
    assert p.returncode == 1, p.stdout + p.stderr
    line = next(x for x in p.stdout.splitlines() if "routing" in x and "router top-k" in x)
    assert f"expert choice differs for 1 of 12 tokens; call 0 row {TIE_TOKEN}" in line, line
    assert "tie at margin 0 on b (top-k over bfloat16 scores)" in line, line


@pytest.mark.gloo
@pytest.mark.parametrize("mode", MODES)
def test_the_margin_is_recorded_on_each_rank_as_a_block_of_the_routers_rows(runs, mode):
    """Each rank's margin follows its router's rows: a block of dim 0 of the [tokens] margin, its rows'
    fingerprints beside it; put together (full mode) it is the hooks' margins of every token."""
    root, _, ep2 = runs
    a = _merge(ep2, f"flip-{mode}")
    for rank in (0, 1):
        d = root / "ep2" / f"flip-{mode}" / f"rank-{rank}"
        t = divtrace.open_trace(d)
        got = [i for i, op in enumerate(t.rop) if op == "divtrace.topk_margin.default"]
        assert len(got) == 1
        vid = t.records[got[0]].outputs[0]
        lines = [json.loads(x) for x in (d / "layouts.jsonl").read_text().splitlines()]
        line = next(x for x in lines if x.get("v") == vid)
        n = len(a["ids"])
        assert line["p"] == ["S0"] and line["g"] == [n] and line["o"] == [rank * n // 2] and len(line["rh"]) == n // 2
        if mode == "full":
            want = [_margins(a["logits"][tok], torch.float32) for tok in range(rank * n // 2, (rank + 1) * n // 2)]
            assert t.tensor(vid).tolist() == want


@pytest.mark.gloo
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["bf16", "renorm"])
def test_replayed_ids_remove_the_flip_and_leave_the_weights(runs, mode, case):
    """The 1-rank run's ids (captured by regex) forced on the 2-rank side: every token's ids equal (hooks), the
    weights not (bf16 scores, or the weights renormalized otherwise); bisect says exactly that."""
    root, ep1, ep2 = runs
    a, b = _merge(ep1, f"rollout-{mode}"), _merge(ep2, f"replay-{case}-{mode}")
    assert not [t for t in a["ids"] if not torch.equal(a["ids"][t], b["ids"][t])]
    differ = _weights_differ(a, b)
    assert differ
    r = divtrace.bisect(str(root / "ep1" / f"rollout-{mode}"), str(root / "ep2" / f"replay-{case}-{mode}")).to_dict()
    f = r["first"]
    assert r["verdict"] == "diverged" and f["module"] == "moe.router", f
    ro = f["routing"]
    assert ro["choice_differs"] == 0 and ro["order_differs"] == 0 and ro["flips"] == []
    assert ro["weights_differ"] == len(differ)
    assert ro["own_choice_differs"] == (1 if case == "bf16" else 0)  # the bf16 top-k still flips, under the replay
    assert ro["why"].startswith(f"expert ids equal on all {len(a['ids'])} tokens, routing weights differ for "
                                f"{len(differ)}"), ro["why"]


@pytest.mark.gloo
def test_hash_mode_moves_no_tensor_bytes(runs):
    """Every rank's recorded forward (hash mode, margins and rows included) hands the collectives what the plain
    forward does: the same calls, the same bytes."""
    _, _, ep2 = runs
    for caps in ep2:
        for name in ("flip-hash", "bf16-hash", "replay-bf16-hash", "replay-renorm-hash"):
            plain_calls, plain_bytes, rec_calls, rec_bytes = caps[name]["calls"]
            assert rec_calls == plain_calls and rec_bytes == plain_bytes and plain_calls


def test_an_outputs_spec_is_accepted_and_bad_keys_are_named(tmp_path):
    """`"outputs"` is a spec key (every tensor of a module's output); a dict with another key is a one-line
    DivtraceError when record(...) is called (outside a process group too, where the specs are checked)."""
    from torch import nn

    m = nn.Sequential(nn.Linear(4, 4))
    with divtrace.record(m, str(tmp_path / "ok"), layouts={r"0": {"input": "S(0)", "outputs": "S(0)"}}):
        m(torch.zeros(2, 4))
    with pytest.raises(divtrace.DivtraceError) as e:
        with divtrace.record(m, str(tmp_path / "t"), layouts={r"0": {"outs": "S(0)"}}):
            pass
    msg = "a dict spec has 'output' and/or 'input', got ['outs'] (or 'outputs': every tensor of a tuple output)"
    assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)
