"""Sharded runs without a process group: the layout rules on shapes, layouts.jsonl read back, run directories put
together from rank traces (recorded here, one process each rank's, with the `dist` meta a rank writes), and the
refusals: ranks of two runs, a rank in the wrong place, a final output no layout says how to put together."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import divtrace
from divtrace.record.shard_rules import Lay, propagate
from divtrace.trace.layouts import LAYOUTS, read_layouts


def _lay(placements, gshape, offsets):
    return Lay(0, tuple(placements), tuple(gshape), tuple(offsets), "dtensor")


# -- rules --------------------------------------------------------------------------------------------------
def test_a_matmul_with_a_column_block_of_the_weight_is_a_column_block():
    w_t = _lay(["S1"], [64, 128], [0, 64])  # t() of a colwise weight, rank 1's half
    (out,) = propagate("aten.mm.default", False, [], {0: ((6, 64), None), 1: ((64, 64), w_t)}, [(6, 64)])
    assert (out.placements, out.gshape, out.offsets) == (("S1",), (6, 128), (0, 64))


def test_a_matmul_over_a_split_contraction_is_a_partial_sum():
    x = _lay(["S1"], [6, 128], [0, 64])
    w = _lay(["S0"], [128, 32], [64, 0])
    (out,) = propagate("aten.mm.default", False, [], {0: ((6, 64), x), 1: ((64, 32), w)}, [(6, 32)])
    assert out.placements == ("P",) and out.gshape == (6, 32)


def test_views_keep_a_block_where_it_stays_outermost_in_its_group():
    q = _lay(["S2"], [1, 6, 64], [0, 0, 32])  # [B, T, heads * head_dim], rank 1's two heads of four
    (heads,) = propagate("aten.view.default", False, [None, [1, 6, -1, 16]], {0: ((1, 6, 32), q)}, [(1, 6, 2, 16)])
    assert (heads.placements, heads.gshape, heads.offsets) == (("S2",), (1, 6, 4, 16), (0, 0, 2, 0))
    (back,) = propagate("aten.view.default", False, [None, [1, 6, -1]], {0: ((1, 6, 2, 16), heads)}, [(1, 6, 32)])
    assert (back.gshape, back.offsets) == ((1, 6, 64), (0, 0, 32))
    one = _lay(["S2"], [1, 6, 32], [0, 0, 16])  # one head of two per rank: the -1 takes the block
    (h,) = propagate("aten.view.default", False, [None, [1, 6, -1, 16]], {0: ((1, 6, 16), one)}, [(1, 6, 1, 16)])
    assert (h.gshape, h.offsets) == ((1, 6, 2, 16), (0, 0, 1, 0))
    inner = _lay(["S1"], [4, 8], [0, 4])  # a block of the inner dim merged with an outer one: no layout
    assert propagate("aten.view.default", False, [None, [16]], {0: ((4, 4), inner)}, [(16,)]) == [None]


def test_pointwise_ops_keep_a_block_only_against_what_broadcasts_along_it():
    q = _lay(["S1"], [1, 4, 6, 16], [0, 2, 0, 0])
    (out,) = propagate("aten.mul.Tensor", True, [], {0: ((1, 2, 6, 16), q), 1: ((1, 1, 6, 16), None)}, [(1, 2, 6, 16)])
    assert out.gshape == (1, 4, 6, 16)
    # a plain tensor as wide as the block along the sharded dim: which part of it is which rank's cannot be told
    assert propagate("aten.mul.Tensor", True, [], {0: ((1, 2, 6, 16), q), 1: ((1, 2, 6, 16), None)},
                     [(1, 2, 6, 16)]) == [None]


def test_transpose_and_attention_carry_the_head_block():
    q = _lay(["S2"], [1, 6, 4, 16], [0, 0, 2, 0])
    (t,) = propagate("aten.transpose.int", False, [None, 1, 2], {0: ((1, 6, 2, 16), q)}, [(1, 2, 6, 16)])
    assert (t.placements, t.gshape) == (("S1",), (1, 4, 6, 16))
    k = _lay(["S1"], [1, 2, 6, 16], [0, 1, 0, 0])
    out, lse = propagate("aten._scaled_dot_product_flash_attention_for_cpu.default", False, [],
                         {0: ((1, 2, 6, 16), t), 1: ((1, 1, 6, 16), k), 2: ((1, 1, 6, 16), k)},
                         [(1, 2, 6, 16), (1, 2, 6)])
    assert out.gshape == (1, 4, 6, 16) and lse.gshape == (1, 4, 6)


def test_a_cache_concatenation_skips_the_empty_start():
    k = _lay(["S1"], [1, 2, 6, 16], [0, 1, 0, 0])
    (out,) = propagate("aten.cat.default", False, [[None, None], -2], {(0, 0): ((0,), None), (0, 1): ((1, 1, 6, 16), k)},
                       [(1, 1, 6, 16)])
    assert out is not None and out.gshape == (1, 2, 6, 16)


def test_read_layouts_stops_at_a_cut_line(tmp_path):
    lines = [{"M": 0, "shape": [2], "dims": ["tp"], "ranks": [0, 1]},
             {"v": 3, "M": 0, "p": ["S1"], "g": [4, 8], "o": [0, 4], "src": "dtensor", "h": "0" * 32},
             {"c": 5, "kind": "all_reduce", "group": "0", "M": 0, "seq": 0}]
    text = "\n".join(json.dumps(x) for x in lines) + '\n{"v": 9, "M": 0, "p": ["S'
    (tmp_path / LAYOUTS).write_text(text)
    from types import SimpleNamespace

    got = read_layouts(SimpleNamespace(path=tmp_path, meta={}, file_sums=None))  # (a trace written unchecksummed)
    assert list(got.values) == [3] and got.values[3].sharded and list(got.collectives) == [5]
    assert got.meshes[0].coords(1) == (1,)


def test_a_transposed_block_is_fingerprinted_from_a_copy_with_the_same_partial():
    """The recorder copies a transposed weight block before taking its partial (faster to read); the partial is
    the one of the view read in place, and small or untransposed blocks are read as they are."""
    from divtrace.record.placements import _readable
    from divtrace.trace.hashing.tensor import tensor_partial

    w = torch.randn(688, 512, generator=torch.Generator().manual_seed(3))
    x = w.t()  # rank 1's block of a [512, 1376] global value, columns 688..1375
    copy = _readable(x)
    assert copy.is_contiguous() and copy.data_ptr() != x.data_ptr() and torch.equal(copy, x)
    assert torch.equal(tensor_partial(copy, (512, 1376), (0, 688)), tensor_partial(x, (512, 1376), (0, 688)))
    assert _readable(w) is w and _readable(x[:8, :8]) is not None and _readable(x[:8, :8]).data_ptr() == w.data_ptr()


# -- run directories from rank traces -------------------------------------------------------------------------
def _record_rank(run, rank, world, model, x, **dist):
    with torch.no_grad(), divtrace.record(model, run / f"rank-{rank}", mode="hash",
                                          extra_meta={"dist": {"rank": rank, "world_size": world, **dist}}):
        model(x)


@pytest.fixture
def model_and_input():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)), torch.randn(3, 8)


def test_ranks_that_computed_the_same_are_one_replicated_group(tmp_path, model_and_input):
    m, x = model_and_input
    for r in range(2):
        _record_rank(tmp_path / "run", r, 2, m, x)
    with torch.no_grad(), divtrace.record(m, tmp_path / "one", mode="hash"):
        m(x)
    view = divtrace.open_trace(tmp_path / "run")
    assert [g.ranks for g in view.groups] == [[0, 1]]
    assert divtrace.bisect(tmp_path / "run", tmp_path / "one").verdict == "identical"


def test_a_final_output_no_layout_puts_together_is_never_identical(tmp_path, model_and_input):
    """Two ranks with the same input and other weights (each its own piece, no layout): nothing of theirs can be
    compared with the one process's, so the verdict cannot be identical."""
    m, x = model_and_input
    _record_rank(tmp_path / "run", 0, 2, m, x)
    other = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    _record_rank(tmp_path / "run", 1, 2, other, x)
    with torch.no_grad(), divtrace.record(m, tmp_path / "one", mode="hash"):
        m(x)
    r = divtrace.bisect(tmp_path / "run", tmp_path / "one")
    assert r.verdict == "inconclusive" and "final output is each rank's own piece" in r.reason, r.to_dict()


def test_run_directories_that_do_not_hold_together_are_refused(tmp_path, model_and_input):
    m, x = model_and_input
    run = tmp_path / "run"
    _record_rank(run, 0, 2, m, x)
    _record_rank(run, 1, 3, m, x)
    with pytest.raises(divtrace.DivtraceError, match="ranks of runs of different sizes"):
        divtrace.open_trace(run)
    shutil.rmtree(run / "rank-1")
    shutil.copytree(run / "rank-0", run / "rank-1")  # rank 0's trace in rank 1's place
    with pytest.raises(divtrace.DivtraceError, match="records rank 0 but lies in rank-1"):
        divtrace.open_trace(run)
    shutil.rmtree(run / "rank-1")
    _record_rank(run, 3, 2, m, x)  # left by a bigger run
    with pytest.raises(divtrace.DivtraceError, match="rank-3 lies outside the run's world of 2"):
        divtrace.open_trace(run)


def test_a_run_missing_a_rank_says_which(tmp_path, model_and_input):
    m, x = model_and_input
    _record_rank(tmp_path / "run", 0, 2, m, x)
    with torch.no_grad(), divtrace.record(m, tmp_path / "one", mode="hash"):
        m(x)
    view = divtrace.open_trace(tmp_path / "run")
    assert view.run.missing == [1] and not view.complete and "rank 1 has no trace" in view.status
    r = divtrace.bisect(tmp_path / "run", tmp_path / "one")
    assert r.verdict == "inconclusive" and "rank 1 has no trace" in r.reason
    # What to do is record the missing rank: rank 0 finished, so "how far it got" and "re-record it to its end"
    # (a stopped recording's words) do not apply (a new user's report: the line read "stopped after root call 1 of
    # 1 after 4 of the reference's 4 module calls")
    assert "record every rank of the run into it (RUN/rank-K, rank 1 included)" in r.reason, r.reason
    assert "1 of its 2 ranks holds a trace" in r.reason and "stopped" not in r.reason, r.reason
