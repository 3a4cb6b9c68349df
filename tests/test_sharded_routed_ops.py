"""Inside an expert-parallel origin (docs/sharded.md "Routed rows"): the op, on the rank where it ran, that computed
the first differing routed row, and the combine's order of summing each token's slots. The MoE layer of
tests/moe_cases.py at EP=2 (gloo) against EP=1, held to ground truth taken with plain torch in the test
(tests/moe_ops_cases.py: the experts' aten ops logged by a TorchDispatchMode, the combine's inputs by hooks)."""
from __future__ import annotations

import pytest

import divtrace
from dist_harness import run_ranks
from divtrace.trace.reader import Trace
from moe_cases import EXPERTS, TOPK
from moe_ops_cases import combine_in_order, flipped_worker, merge, planted_op, worker
from sharded_cases import bits_equal

CASES = [("kernel-full", "full", "kernel"), ("kernel-hash", "hash", "kernel"), ("combine-full", "full", "combine"),
         ("combine-hash", "hash", "combine")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_ops")
    ep2 = run_ranks(worker, 2, str(root / "ep2"), CASES)
    ep1 = run_ranks(worker, 1, str(root / "ep1"), [(n, m, None) for n, m, _ in CASES])
    run_ranks(flipped_worker, 2, str(root / "flipped"), CASES[:2])
    return root, {n: (ep2, ep1) for n, _, _ in CASES}


def _experts_ops(run_dir, rank: int) -> list:
    t = Trace(str(run_dir / f"rank-{rank}"))
    return next(c for c in t.calls.values() if c.module == "moe.experts").ops


@pytest.mark.gloo
@pytest.mark.parametrize("mode", ["full", "hash"])
def test_planted_kernel_named_at_its_op_on_its_rank(runs, mode):
    """Rank 1's expert 3 multiplies x * sigmoid(x) by `up` where the 1-rank run multiplies silu(x): bisect names
    that mul, on rank 1 with its record index there, against the 1-rank run's mul of expert 3, and says its input
    0 was made by another op on each side. Ground truth: the ops each rank's experts ran (dispatch log)."""
    root, got = runs
    name = f"kernel-{mode}"
    ep2, ep1 = got[name]
    a, b = merge([r[name] for r in ep2]), merge([r[name] for r in ep1])
    differ = sorted(k for k in a["experts"] if not bits_equal(a["experts"][k], b["experts"][k]))
    assert differ and {a["expert_of"][k] for k in differ} == {EXPERTS - 1}
    # which rank ran the planted op, and where in its experts call; the 1-rank run's counterpart
    where = {r: planted_op(ep2[r][name]["ops"], "aten.mul.Tensor") for r in (0, 1)}
    assert where[0] is None and where[1] is not None
    on_b = planted_op(ep1[0][name]["ops"], "aten.silu.default")
    ops_a, ops_b = _experts_ops(root / "ep2" / name, 1), _experts_ops(root / "ep1" / name, 0)
    assert len(ops_a) == len(ep2[1][name]["ops"]) and len(ops_b) == len(ep1[0][name]["ops"])

    r = divtrace.bisect(str(root / "ep2" / name), str(root / "ep1" / name))
    assert r.verdict == "diverged" and r.first.module == "moe.experts", r.to_dict()["first"]
    op = r.first.shards["op"]
    assert op is not None, r.first.shards
    assert (op["token"], op["slot"]) == differ[0]
    assert (op["rank_a"], op["op_a"], op["index_a"]) == (1, "aten.mul.Tensor", ops_a[where[1]]), op
    assert (op["rank_b"], op["op_b"], op["index_b"]) == (0, "aten.mul.Tensor", ops_b[on_b]), op
    made_a = ops_a[ep2[1][name]["ops"][where[1]][1][0]]  # the record that made its input 0 on each side
    made_b = ops_b[ep1[0][name]["ops"][on_b][1][0]]
    assert op["inputs"] == [f"input 0 is the output of aten.mul.Tensor #{made_a} on a, of aten.silu.default "
                            f"#{made_b} on b"], op
    # full mode compares the row's bytes; hash mode the whole values, which hold the same rows in the same order
    assert op["compared"] == ("row" if mode == "full" else "value")
    assert f"computed at aten.mul.Tensor (record {op['index_a']} on rank 1 of a; " in r.first.shards["why"]
    assert "op_note" not in r.first.shards


@pytest.mark.gloo
def test_planted_kernel_named_in_the_report(runs, capsys):
    from divtrace.cli.app import main

    root, got = runs
    code = main(["bisect", str(root / "ep2" / "kernel-hash"), str(root / "ep1" / "kernel-hash")])
    out = capsys.readouterr().out
    assert code == 1
    assert "op aten.mul.Tensor on rank 1 of a (record" in " ".join(out.split()), out


@pytest.mark.gloo
@pytest.mark.parametrize("mode", ["full", "hash"])
def test_combine_order_named_where_it_reproduces_each_side(runs, mode):
    """The EP side sums each token's slots in rank order (its experts' ranks, then experts), the 1-rank side in
    routing order. Ground truth (hooks): each order, recomputed from the combine's own inputs, gives its side's
    output bit for bit at every token, the other does not. Full mode names both orders; hash mode (no bytes)
    keeps the words that say the order or the kernel differs."""
    root, got = runs
    name = f"combine-{mode}"
    ep2, ep1 = got[name]
    a, b = merge([r[name] for r in ep2]), merge([r[name] for r in ep1])
    tokens = sorted(a["combine"])
    per_rank = EXPERTS // 2

    def rank_order(t):
        return sorted(range(TOPK), key=lambda s: (a["expert_of"][(t, s)] // per_rank, a["expert_of"][(t, s)], s))

    routing = list(range(TOPK))
    assert all(bits_equal(combine_in_order(a["back"], a["weights"], t, rank_order(t)), a["combine"][t]) for t in tokens)
    assert all(bits_equal(combine_in_order(b["back"], b["weights"], t, routing), b["combine"][t]) for t in tokens)
    assert not all(bits_equal(combine_in_order(a["back"], a["weights"], t, routing), a["combine"][t]) for t in tokens)
    assert all(bits_equal(a["weights"][t], b["weights"][t]) for t in tokens)
    differ = [t for t in tokens if not bits_equal(a["combine"][t], b["combine"][t])]

    r = divtrace.bisect(str(root / "ep2" / name), str(root / "ep1" / name))
    assert r.verdict == "diverged" and r.first.module == "moe.combine", r.to_dict()["first"]
    sh = r.first.shards
    assert [x["token"] for x in sh["rows"]] == differ
    if mode == "full":
        c = sh["combine"]
        assert (c["order_a"], c["order_b"], c["tokens"]) == ("rank order", "routing order", len(tokens)), c
        assert "routing order" not in c["orders_a"] and c["orders_b"] == ["routing order"]
        assert sh["why"] == (f"combine: combine order differs: a sums slots in rank order, b in routing order (each "
                             "order, recomputed from the equal routed rows and routing weights, gives its side's "
                             f"output bit for bit at all {len(tokens)} tokens); its output differs at tokens "
                             f"{differ}"), sh["why"]
    else:
        assert sh["combine"] is None and sh["combine_note"] == "hash mode: no bytes to recompute the sums from"
        assert sh["why"].startswith(f"combine: combines routed rows that are equal on a and b, and its output "
                                    f"differs at tokens {differ}: the order in which a token's slots are summed, "
                                    "or the sum's kernel, differs (a: sort, ")


@pytest.mark.gloo
@pytest.mark.parametrize("mode", ["full", "hash"])
def test_op_not_named_where_the_rows_are_not_followed(runs, mode):
    """The EP side's experts flip each expert's rows before computing them (aten.flip: no rule follows its rows):
    the module and rows are still named, the op is not, and the note says why, listing rank 1's ops on the row."""
    root, got = runs
    name = f"kernel-{mode}"
    r = divtrace.bisect(str(root / "flipped" / name), str(root / "ep1" / name))
    assert r.verdict == "diverged" and r.first.module == "moe.experts", r.to_dict()["first"]
    sh = r.first.shards
    ref = divtrace.bisect(str(root / "ep2" / name), str(root / "ep1" / name)).first.shards
    assert sh["rows"] == ref["rows"]
    t, s = sh["rows"][0]["token"], sh["rows"][0]["slot"]
    assert sh["op"] is None and sh["op_note"].startswith(f"rank 1 of a and rank 0 of b run other ops on row (token "
                                                         f"{t}, slot {s}) (a: slice #"), sh
    assert sh["why"].endswith(f"; the op is not named: {sh['op_note']}")
