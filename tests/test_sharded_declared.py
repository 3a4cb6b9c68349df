"""Declared layouts for plain tensors: a Megatron-style hand-sharded MLP (plain nn.Linear column- and row-parallel
blocks, an explicit all_reduce) at TP=2 on two gloo ranks, recorded with `layouts=` and bisected against the
one-process MLP with the same weights. Every case is held to ground truth from plain forward hooks (values put
together in the test: megatron_cases.unshard), in full and hash mode; specs that do not fit are one-line errors."""
from __future__ import annotations

import json

import pytest
import torch

import divtrace
from divtrace.errors import DivtraceError
from dist_harness import run_ranks
from megatron_cases import FFN, MODULES, PARAMS, bad_spec_worker, single, worker
from sharded_cases import bits_equal, truth_origin

CASES = [("fp32-full", "full", False), ("fp32-hash", "hash", False), ("plant-full", "full", True),
         ("plant-hash", "hash", True)]
DECLS = {"all": {**PARAMS, **MODULES}, "modules": MODULES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    truth = {}
    for decl, layouts in DECLS.items():
        truth[decl] = run_ranks(worker, 2, str(root / decl), CASES, layouts)[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks
    try:
        singles = {name: single(str(root / "tp1" / name), mode, planted) for name, mode, planted in CASES}
    finally:
        torch.set_num_threads(threads)
    return root, truth, singles


def _expected(truth, singles, name):
    """The hooks' origin: fc2's output (a partial sum on the TP side) is no global value, so it is left out."""
    g, order = truth[name]
    caps_b, _ = singles[name]
    return truth_origin([p for p in order if not p.endswith(".fc2")], g, caps_b)


def _bisect(root, decl, name):
    return divtrace.bisect(str(root / decl / name), str(root / "tp1" / name))


@pytest.mark.gloo
@pytest.mark.parametrize("decl", list(DECLS))
def test_no_planted_difference_gives_what_the_hooks_show(runs, decl):
    root, truth, singles = runs
    expected = _expected(truth[decl], singles, "fp32-full")
    for name in ("fp32-full", "fp32-hash"):
        r = _bisect(root, decl, name)
        if expected is None:
            assert r.verdict == "identical", r.to_dict()
            continue
        assert r.verdict == "diverged" and r.first.module == expected, (r.to_dict()["first"], expected)
        assert r.first.module.endswith(("layers.0", "layers.1")), expected  # the MLP whose reduction differs
        layer = expected.rsplit(".", 1)[-1]
        assert r.first.shards["why"] == (f"layers.{layer}: 2 partial matmuls (in fc2) summed by all_reduce on a, "
                                         f"one matmul over K={FFN} (in fc2) on b"), r.first.shards


@pytest.mark.gloo
@pytest.mark.parametrize("decl", list(DECLS))
def test_planted_difference_in_one_ranks_column_block(runs, decl):
    """Found at fc1, in rank 1's block: by calls in full and hash mode, and by tokens in hash mode (the blocks' row
    partials summed)."""
    root, truth, singles = runs
    assert _expected(truth[decl], singles, "plant-full") == "layers.0.fc1"
    g, _ = truth[decl]["plant-full"]
    caps_b, _ = singles["plant-full"]
    out_a, out_b = g["layers.0.fc1"][1], caps_b["layers.0.fc1"][1]
    half = FFN // 2
    assert bits_equal(out_a[..., :half], out_b[..., :half]) and not bits_equal(out_a[..., half:], out_b[..., half:])
    full, hashed = _bisect(root, decl, "plant-full"), _bisect(root, decl, "plant-hash")
    tokens = divtrace.bisect(str(root / decl / "plant-hash"), str(root / "tp1" / "plant-hash"), align="tokens")
    assert tokens.to_dict()["alignment"] == "tokens"
    for r in (full, hashed, tokens):
        assert r.verdict == "diverged" and r.first.module == "layers.0.fc1", r.to_dict()["first"]
        if decl == "all":  # the weights declared too: the rules carry blocks through every op of fc1
            assert r.first.op == r.first.op_b == "aten.mul.Tensor"  # the planted op, not the matmul before it
        else:  # fc1's own ops are the ranks' own values: the op region spans them, up to the planted op
            assert [o for _, o in r.first.region_a][-1] == [o for _, o in r.first.region_b][-1] == "aten.mul.Tensor"
    assert (hashed.first.op, hashed.first.shards["why"]) == (full.first.op, full.first.shards["why"])
    assert full.first.shards["block_a"] == f"rank 1's block (dim 2: {half}..{2 * half - 1})", full.first.shards
    assert half <= full.first.diff.first_index[-1] < 2 * half


@pytest.mark.gloo
def test_declared_layouts_are_written_with_their_source(runs):
    """Module outputs declared alone get their lines; with the weights declared, the rules give the same values
    their layouts first (src "rule"), and the weights' lines are declared ones."""
    root, _, _ = runs

    def read(decl):
        path = root / decl / "fp32-hash" / "rank-1" / "layouts.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()]

    mods = [x for x in read("modules") if x.get("src") == "declared"]
    assert {x["why"] for x in mods} == {"S(-1)@tp", "P@tp", "R@tp"}
    fc1 = [x for x in mods if x["why"] == "S(-1)@tp"]  # each layer's fc1 output: its rows as partials (rp)
    assert len(fc1) == 2 and all(x.get("rp") == 1 and x["p"] == ["S2"] for x in fc1), fc1
    fc2 = next(x for x in mods if x["why"] == "P@tp")
    assert fc2["p"] == ["P"] and "h" not in fc2  # a partial sum: no partial fingerprint, held back
    declared = [x for x in read("all") if x.get("src") == "declared"]
    assert {x["why"] for x in declared} >= {"S(0)@tp", "S(1)@tp", "R@tp"}
    tp = next(x for x in read("all") if x.get("group") == "tp")
    assert tp["ranks"] == [0, 1] and tp["dims"] == ["tp"]
    w1 = next(x for x in declared if x["why"] == "S(0)@tp" and len(x["g"]) == 2)
    assert w1["p"] == ["S0"] and w1["g"][0] == FFN and w1["o"][0] == FFN // 2 and "h" in w1


@pytest.mark.gloo
def test_a_spec_that_does_not_fit_is_a_one_line_error(tmp_path):
    specs = [{r"layers\.0\.fc1": "S(3)@tp"}, {r"layers\.0\.fc1": "S(-1,63)@tp"}, {r"layers\.0\.fc1": "S(-1,128)@tp"},
             {r"layers\.0\.fc2\.weight": "S(2)@tp"}, {r"layers\.0\.fc1": "S(-1,64)@tp"}]
    got = run_ranks(bad_spec_worker, 2, str(tmp_path), specs)
    for errs in got:
        assert errs[0] == "layers.0.fc1 (output): layout 'S(3)@tp' does not fit its tensor [2, 8, 32]: dim 3 is " \
                          "out of range for 3 dims"
        assert errs[1] == "layers.0.fc1 (output): layout 'S(-1,63)@tp' does not fit its tensor [2, 8, 32]: the " \
                          "global size 63 of dim -1 is not divisible by the 2 ranks of 'tp'"
        assert errs[2] == "layers.0.fc1 (output): layout 'S(-1,128)@tp' does not fit its tensor [2, 8, 32]: dim -1 " \
                          "holds 32, while the global size 128 over 2 ranks of 'tp' gives blocks of 64"
        assert errs[3] == "layers.0.fc2.weight: layout 'S(2)@tp' does not fit its tensor [32, 32]: dim 2 is out " \
                          "of range for 2 dims"
        assert errs[4] is None  # the right global size: recorded
        assert all(e is None or "\n" not in e for e in errs)


@pytest.mark.parametrize("layouts,mesh,msg", [
    ({"fc1": "S(-1"}, None, "layouts['fc1']: cannot parse 'S(-1': expected R, P or S(dim[,global size]), then @group"),
    ({"fc1": "S(-1)@dp"}, {"tp": None}, "layouts['fc1']: 'S(-1)@dp' names the group 'dp', which the mesh does not "
                                        "have (it has: tp; pass mesh={'dp': process group})"),
    ({"fc1": "P"}, {"tp": None, "dp": None}, "layouts['fc1']: 'P' names no group and the mesh has 2 (tp, dp)"),
    ({"fc1": {"outptu": "R"}}, None, "layouts['fc1']: a dict spec has 'output' and/or 'input', got ['outptu']"),
])
def test_a_spec_that_cannot_be_read_is_refused_at_record(tmp_path, layouts, mesh, msg):
    """Outside a process group too: the specs are checked when record() is called (and then ignored there)."""
    from torch import nn

    with pytest.raises(DivtraceError) as e:
        divtrace.record(nn.Linear(2, 2), str(tmp_path / "t"), layouts=layouts, mesh=mesh)
    assert str(e.value).startswith(msg) and "\n" not in str(e.value)
