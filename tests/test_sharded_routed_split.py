"""The op that computed a differing routed row, where the experts take their rows by `rows.split(counts)` (an
aten.split_with_sizes along dim 0: each chunk keeps its rows, offset by the chunk's start) instead of slices: the
MoE layer of tests/moe_cases.py (build(split=True)) at EP=2 (gloo) against EP=1, rank 1's expert 3 computing SiLU
as x * sigmoid(x). Ground truth from plain torch in the test (tests/moe_ops_cases.py: the experts' aten ops logged by
a TorchDispatchMode; the experts' output rows by hooks)."""
from __future__ import annotations

import pytest

import divtrace
from dist_harness import run_ranks
from divtrace.trace.reader import Trace
from moe_cases import EXPERTS
from moe_ops_cases import merge, planted_op, split_worker
from sharded_cases import bits_equal

CASES = [("kernel-full", "full", "kernel"), ("kernel-hash", "hash", "kernel")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_split")
    ep2 = run_ranks(split_worker, 2, str(root / "ep2"), CASES)
    ep1 = run_ranks(split_worker, 1, str(root / "ep1"), [(n, m, None) for n, m, _ in CASES])
    return root, ep2, ep1


def _experts(run_dir, rank: int):
    t = Trace(str(run_dir / f"rank-{rank}"))
    return t, next(c for c in t.calls.values() if c.module == "moe.experts")


@pytest.mark.gloo
@pytest.mark.parametrize("mode", ["full", "hash"])
def test_row_followed_through_split_to_its_op(runs, mode):
    root, ep2, ep1 = runs
    name = f"kernel-{mode}"
    a, b = merge([r[name] for r in ep2]), merge([r[name] for r in ep1])
    differ = sorted(k for k in a["experts"] if not bits_equal(a["experts"][k], b["experts"][k]))
    assert differ and {a["expert_of"][k] for k in differ} == {EXPERTS - 1}
    log_a, log_b = ep2[1][name]["ops"], ep1[0][name]["ops"]
    assert any(op == "aten.split_with_sizes.default" for op, _ in log_a)  # the rows went through the split
    ta, ca = _experts(root / "ep2" / name, 1)
    tb, cb = _experts(root / "ep1" / name, 0)
    assert [ta.rop[i] for i in ca.ops] == [op for op, _ in log_a] and [tb.rop[i] for i in cb.ops] == [o for o, _ in log_b]
    where_a, where_b = planted_op(log_a, "aten.mul.Tensor"), planted_op(log_b, "aten.silu.default")
    assert planted_op(ep2[0][name]["ops"], "aten.mul.Tensor") is None  # rank 0 ran no planted op

    r = divtrace.bisect(str(root / "ep2" / name), str(root / "ep1" / name))
    assert r.verdict == "diverged" and r.first.module == "moe.experts", r.to_dict()["first"]
    op = r.first.shards["op"]
    assert op is not None, r.first.shards
    assert (op["token"], op["slot"]) == differ[0]
    assert (op["rank_a"], op["op_a"], op["index_a"]) == (1, "aten.mul.Tensor", ca.ops[where_a]), op
    assert (op["rank_b"], op["op_b"], op["index_b"]) == (0, "aten.mul.Tensor", cb.ops[where_b]), op
    made_a, made_b = ca.ops[log_a[where_a][1][0]], cb.ops[log_b[where_b][1][0]]
    assert op["inputs"] == [f"input 0 is the output of aten.mul.Tensor #{made_a} on a, of aten.silu.default "
                            f"#{made_b} on b"], op
