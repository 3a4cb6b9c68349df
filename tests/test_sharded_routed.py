"""Routed rows (expert parallelism): a Mixtral-style MoE layer with its experts split over 2 gloo ranks by
all_to_all (tests/moe_cases.py), recorded with `T@ep` layouts and the routing declared by `divtrace.routed`, bisected
against the same layer on a process group of one (all experts local). A planted expert-kernel difference (on rank
1's expert) and a planted combine-order difference (slots summed in rank order) are each found at their module and
at their (token, slot) rows or tokens, in full and hash mode, held to ground truth from plain forward hooks."""
from __future__ import annotations

import json

import pytest
import torch

import divtrace
from divtrace.errors import DivtraceError
from dist_harness import run_ranks
from moe_cases import EXPERTS, TOPK, undeclared_worker, worker
from moe_ops_cases import merge
from sharded_cases import bits_equal

CASES = [("none-full", "full", None), ("none-hash", "hash", None), ("kernel-full", "full", "kernel"),
         ("kernel-hash", "hash", "kernel"), ("combine-full", "full", "combine"), ("combine-hash", "hash", "combine")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    ep2 = run_ranks(worker, 2, str(root / "ep2"), CASES)
    ep1 = run_ranks(worker, 1, str(root / "ep1"), [(n, m, None) for n, m, _ in CASES])
    truth = {n: (merge([r[n] for r in ep2], ()), merge([r[n] for r in ep1], ())) for n, _, _ in CASES}
    return root, truth


def _bisect(root, name):
    return divtrace.bisect(str(root / "ep2" / name), str(root / "ep1" / name))


def _differ(a: dict, b: dict) -> list:
    assert a.keys() == b.keys()
    return sorted(k for k in a if not bits_equal(a[k], b[k]))


@pytest.mark.gloo
@pytest.mark.parametrize("name", ["none-full", "none-hash"])
def test_experts_split_by_all_to_all_equal_one_rank(runs, name):
    root, truth = runs
    a, b = truth[name]
    assert not _differ(a["experts"], b["experts"]) and not _differ(a["combine"], b["combine"])
    assert bits_equal(a["out"], b["out"])
    r = _bisect(root, name)
    assert r.verdict == "identical", r.to_dict()


@pytest.mark.gloo
@pytest.mark.parametrize("mode", ["full", "hash"])
def test_planted_expert_kernel_found_at_its_rows(runs, mode):
    """Rank 1's expert computes SiLU otherwise: the experts' routed input rows are equal (hooks), their output rows
    differ at the (token, slot) rows of that expert; bisect names the experts and exactly those rows, with the
    expert and rank that computed each."""
    root, truth = runs
    a, b = truth[f"kernel-{mode}"]
    assert not _differ(a["experts_in"], b["experts_in"])
    rows = _differ(a["experts"], b["experts"])
    assert rows and {a["expert_of"][k] for k in rows} == {EXPERTS - 1}
    r = _bisect(root, f"kernel-{mode}")
    assert r.verdict == "diverged" and r.first.module == "moe.experts", r.to_dict()["first"]
    got = r.first.shards["rows"]
    assert [(x["token"], x["slot"]) for x in got] == rows
    assert all((x["expert_a"], x["rank_a"], x["rank_b"]) == (EXPERTS - 1, 1, 0) for x in got), got
    t, s = rows[0]
    assert r.first.shards["why"].startswith(f"experts: routed rows computed on 2 ranks on a, 1 on b; the rows that "
                                            f"differ: (token {t}, slot {s}: expert {EXPERTS - 1} on rank 1 of a)")
    assert r.first.shards["op"]["rank_a"] == 1  # the op on that rank (tests/test_sharded_routed_ops.py)
    if mode == "full":  # the first differing element lies in the first differing row (token * top_k + slot)
        assert r.first.shards["block_a"] == f"rank 1's routed row (token {t}, slot {s})"
        assert r.first.diff.first_index[0] == t * TOPK + s


@pytest.mark.gloo
@pytest.mark.parametrize("mode", ["full", "hash"])
def test_planted_combine_order_found_at_its_tokens(runs, mode):
    """The EP side sums each token's slots in rank order, the 1-rank side in routing order: the combine's routed
    input rows are equal (hooks), its output differs at the tokens whose slot order is not their experts' order."""
    root, truth = runs
    a, b = truth[f"combine-{mode}"]
    assert not _differ(a["experts"], b["experts"]) and not _differ(a["back"], b["back"])
    tokens = _differ(a["combine"], b["combine"])
    assert tokens
    r = _bisect(root, f"combine-{mode}")
    assert r.verdict == "diverged" and r.first.module == "moe.combine", r.to_dict()["first"]
    got = r.first.shards["rows"]
    assert [x["token"] for x in got] == tokens
    half = len(a["combine"]) // 2
    assert all(x["rank_a"] == (x["token"] >= half) for x in got), got
    assert [o for _, o in r.first.region_a][0] == "aten.sort.stable"  # the rank order: the slots sorted by expert
    if mode == "full":  # the orders are named (tests/test_sharded_routed_ops.py holds them to ground truth)
        assert r.first.diff.first_index[0] == tokens[0]
        assert r.first.shards["why"].startswith("combine: combine order differs: a sums slots in rank order, b in "
                                                "routing order"), r.first.shards
    else:
        assert r.first.shards["why"].startswith(f"combine: combines routed rows that are equal on a and b, and its "
                                                f"output differs at tokens {tokens}: the order in which a token's "
                                                "slots are summed, or the sum's kernel, differs (a: sort, "), \
            r.first.shards


@pytest.mark.gloo
def test_routed_layout_lines(runs):
    """Each rank writes its routed rows' table: (token, slot, expert) per row, whose global rows cover every
    (token, slot) once over the ranks; the 1-rank run is a run of one rank (rank-0)."""
    root, _ = runs
    seen = []
    for rank in (0, 1):
        lines = [json.loads(x) for x in (root / "ep2" / "none-hash" / f"rank-{rank}" / "layouts.jsonl").read_text()
                 .splitlines()]
        routed = [x for x in lines if x.get("p") == ["T"]]  # the experts' input and output, the combine's input
        assert len(routed) == 3 and all(x["k"] == TOPK and len(x["rt"]) == len(x["rh"]) for x in routed)
        ins = routed[0]  # the experts' input: this rank's experts only
        assert {e for _, _, e in ins["rt"]} <= set(range(rank * EXPERTS // 2, (rank + 1) * EXPERTS // 2))
        seen += [t * TOPK + s for t, s, _ in ins["rt"]]
    assert sorted(seen) == list(range(routed[0]["g"][0]))
    assert (root / "ep1" / "none-hash" / "rank-0" / "layouts.jsonl").exists()


@pytest.mark.gloo
def test_a_routed_side_without_its_routing_is_a_one_line_error(tmp_path):
    got = run_ranks(undeclared_worker, 2, str(tmp_path / "ep2"))
    for e in got:
        assert e is not None and e.startswith("moe.experts (input): layout 'T@ep': no routing was declared for this "
                                              "tensor of [") and "\n" not in e, e
        assert e.endswith("(call divtrace.routed(rows, tokens=..., slots=..., n_tokens=..., top_k=...) before the "
                          "module runs)"), e


def test_routing_that_does_not_fit_is_a_one_line_error(tmp_path):
    from torch import nn

    rows = torch.zeros(3, 4)
    with divtrace.record(nn.Linear(4, 4), str(tmp_path / "t")) as rec:
        for kw, msg in [(dict(tokens=[0, 1], slots=[0, 1, 0]), "divtrace.routed: 2 tokens for a tensor of 3 rows"),
                        (dict(tokens=[0, 1, 5], slots=[0, 1, 0]), "divtrace.routed: a token outside [0, 4)"),
                        (dict(tokens=[0, 0, 1], slots=[1, 1, 0]), "divtrace.routed: a (token, slot) is given to "
                                                                  "two rows")]:
            with pytest.raises(DivtraceError) as e:
                rec.routed(rows, n_tokens=4, top_k=2, **kw)
            assert str(e.value).startswith(msg) and "\n" not in str(e.value)
    divtrace.routed(rows, tokens=[0, 1, 2], slots=[0, 0, 0], n_tokens=4, top_k=2)  # outside a recording: nothing


@pytest.mark.gloo
@pytest.mark.parametrize("plant", ["kernel", "combine"])
def test_repro_puts_routed_rows_in_place(runs, tmp_path, plant):
    """The repro replays side a's region on both simulated ranks and puts each rank's routed rows (or token rows) at
    their global rows: both sides reproduce their recorded outputs bit for bit, and the script fails while they
    differ, first at the row bisect named."""
    import subprocess
    import sys

    from divtrace.repro.writer import write_repro

    root, _ = runs
    a, b = root / "ep2" / f"{plant}-full", root / "ep1" / f"{plant}-full"
    r = divtrace.bisect(str(a), str(b))
    out = tmp_path / "repro"
    res = write_repro(str(a), str(b), out)
    assert res.ok, res.fidelity
    m = json.loads((out / "manifest.json").read_text())
    assert m["ranks"]["a"] == [0, 1] and m["origin"]["module"] == r.first.module
    if plant == "kernel":
        assert "rank 1's routed rows" in (out / "repro.py").read_text()
    p = subprocess.run([sys.executable, str(out / "repro.py")], capture_output=True, text=True)
    assert p.returncode == 1, p.stdout + p.stderr
    first = r.first.diff.first_index
    assert f"[{first[0]}, {first[1]}]" in p.stdout, p.stdout
