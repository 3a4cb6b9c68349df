"""A row-parallel Linear's weight block nudged on one rank: bisect names the local matmul, the rank whose partial sum
differs, and that partial's own mismatched count (docs/sharded.md, "Comparing"; divtrace.compare.shard_pieces).

A row-parallel Linear (torch's RowwiseParallel on a small MLP's second layer; HF's TP plan's o_proj) computes a
partial sum on each rank and all-reduces them. Two TP=2 runs compare those partials rank by rank (a partial sum is
compared only with one laid out the same way). It had said "mismatched 0 of 64" at the origin: the count was taken
from the representative rank's (rank 0's) partial, which is equal when rank 1's block is the one nudged, and no rank
was named. Now `first.shards.partials` lists each rank whose partial differs, its count taken against the other
run's partial of the same rank (full mode), or "differs (hash mode ...)" with no count; the top-level metrics are
that rank's partial's. Against one process (TP=1), there is no partial to compare with: the reduced sum is compared
and `partial` says so, naming no rank.

Ground truth: each rank's partial sum from plain forward hooks in an unrecorded forward (the Partial DTensor a hook
placed before the style's own output hook sees; for HF, which wraps o_proj's forward, the local linear of the
hooked input and weight block, checked to all-reduce to the hooked output bit for bit), and the reduced outputs."""
from __future__ import annotations

import os

import pytest
import torch

import divtrace
from dist_harness import run_ranks
from sharded_cases import IDS, bits_equal, capture, mlp, tiny_llama

pytestmark = pytest.mark.gloo  # multi-process (gloo, 2 ranks): .ci/run's stage of their own

MODES = ("full", "hash")
O_PROJ = "model.layers.0.self_attn.o_proj"


def _nudge(block, ulps: int = 64) -> None:
    """Move one output row of a weight block (every input this rank holds) up by `ulps` ulps (in place): that
    output of the rank's partial sum changes wherever an input is nonzero."""
    with torch.no_grad():
        v = block[3].clone()
        for _ in range(ulps):
            v = torch.nextafter(v, torch.full_like(v, float("inf")))
        block[3] = v


def _x():
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(1))


def mlp_worker(rank, world, root, cases):
    """torch's parallelize_module (ColwiseParallel, then RowwiseParallel) on the MLP; per case (name, the rank whose
    block of the row-parallel weight is nudged, or None): an unrecorded forward with hooks (this rank's partial sum
    of layer 2, the Partial DTensor before RowwiseParallel's all_reduce; the reduced output), then one recorded
    forward per mode into ROOT/NAME-MODE. Every rank returns {name: (its partial, the output)}."""
    from torch.distributed.tensor import DTensor, init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    got = {}
    for name, plant_rank in cases:
        m = mlp()
        parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if plant_rank == rank:
            _nudge(m[2].weight.to_local())
        seen = {}

        def partial(mod, args, out):  # runs before RowwiseParallel's output hook (prepend): the unreduced DTensor
            assert isinstance(out, DTensor) and out.placements[0].is_partial(), out
            seen["partial"] = out.to_local().clone()
        h = m[2].register_forward_hook(partial, prepend=True)
        with torch.no_grad():
            y = m(_x())
        h.remove()
        for mode in MODES:
            with torch.no_grad(), divtrace.record(m, os.path.join(root, f"{name}-{mode}"), mode=mode):
                m(_x())
        got[name] = (seen["partial"], y.clone())
    return got


def llama_worker(rank, world, model_dir, root, cases):
    """HF's TP plan on the tiny Llama; per case (name, the rank whose o_proj block of layer 0 is nudged, or None):
    an unrecorded forward with hooks (o_proj's input, this rank's column block, and its reduced output; the partial
    is the local linear of that input and this rank's weight block), then one recorded forward per mode. Every rank
    returns {name: (its partial, the reduced output)}."""
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    got = {}
    for name, plant_rank in cases:
        m = LlamaForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32).eval()
        w = m.get_submodule(O_PROJ).weight
        block = w.to_local() if isinstance(w, DTensor) else w
        if plant_rank == rank:
            _nudge(block)
        caps, _ = capture(m, IDS)
        x, y = caps[O_PROJ]
        with torch.no_grad():
            part = torch.nn.functional.linear(x, block)
            reduced = part.clone()
            torch.distributed.all_reduce(reduced)
        assert bits_equal(reduced, y), "the recomputed partials do not sum to the hooked output"
        for mode in MODES:
            with torch.no_grad(), divtrace.record(m, os.path.join(root, f"{name}-{mode}"), mode=mode):
                m(torch.tensor(IDS))
        got[name] = (part, y)
    return got


def _single_mlp(root):
    """The same MLP in this process (TP=1): recorded per mode; its output (the truth of the reduced sum) returned."""
    m = mlp()
    with torch.no_grad():
        y = m(_x())
    for mode in MODES:
        with torch.no_grad(), divtrace.record(m, os.path.join(root, f"tp1-{mode}"), mode=mode):
            m(_x())
    return y


@pytest.fixture(scope="module")
def mlp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("row_partial_mlp")
    ranks = run_ranks(mlp_worker, 2, str(root), [("base", None), ("plant1", 1), ("plant0", 0)])
    return root, ranks, _single_mlp(str(root))


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory):
    from sharded_cases import single

    root = tmp_path_factory.mktemp("row_partial_llama")
    model = tiny_llama(str(root / "model"))
    ranks = run_ranks(llama_worker, 2, model, str(root), [("base", None), ("plant1", 1), ("plant0", 0)])
    caps, _ = single(model, str(root / "tp1-full"), "float32", "full")
    return root, ranks, caps[O_PROJ][1]


def _truth(ranks, name, base="base"):
    """Per rank: (elements of its partial that differ from the base run's same-rank partial, the first one's flat
    index, its numel)."""
    out = []
    for r in ranks:
        a, b = r[name][0], r[base][0]
        assert a.shape == b.shape and a.dtype == b.dtype
        idx = (a.view(torch.int32) != b.view(torch.int32)).reshape(-1).nonzero().squeeze(1)
        out.append((idx.numel(), int(idx[0]) if idx.numel() else None, a.numel()))
    return out


def _flat(index, shape) -> int:
    flat = 0
    for i, n in zip(index, shape):
        flat = flat * n + i
    return flat


def _reduced_count(ya, yb) -> int:
    return int((ya.view(torch.int32) != yb.view(torch.int32)).sum())


def _check_per_rank(r, run_a, truth, plant_rank, mode, reduced):
    """The origin is the local matmul; `partials` names exactly the planted rank, with its partial's true count
    (full mode) or none (hash); the top-level metrics are that partial's where the compared value is the partial
    (`metrics_of`), else the reduced sum's (`reduced`: the true count of the reduced outputs' differing elements)."""
    n, first, numel = truth[plant_rank]
    assert n > 0 and truth[1 - plant_rank][0] == 0, truth  # only the planted rank's partial differs (the plant bites)
    d = r.to_dict()["first"]
    assert r.verdict == "diverged" and d["op"] == d["op_b"] == "aten.mm.default", d
    sh = d["shards"]
    got = [{k: e[k] for k in ("rank_a", "rank_b", "kind", "compared", "mismatched", "numel")}
           for e in sh["partials"]]
    full = mode == "full"
    assert got == [{"rank_a": plant_rank, "rank_b": plant_rank, "kind": "partial sum",
                    "compared": "bytes" if full else "hash", "mismatched": n if full else None, "numel": numel}], sh
    e = sh["partials"][0]
    assert e["index_a"] == d["index"] and e["index_b"] == d["index_b"], (e, d)  # the matmul that made each partial
    where = "" if "metrics_of" in sh else f" (the output of aten.mm.default, record {d['index']} on a)"
    if full:
        t = divtrace.open_trace(str(run_a / f"rank-{plant_rank}"))  # the partial as that rank recorded it
        assert t.rop[e["index_a"]] == "aten.mm.default"
        assert _flat(e["first_index"], t.vkey[t.rout[e["index_a"]][0]][1]) == first, (e, first)
        assert sh["partial"] == f"rank {plant_rank}'s partial sum{where}: {n} of {numel} elements mismatched", sh
    else:
        assert e["first_index"] is None
        assert sh["partial"] == f"rank {plant_rank}'s partial sum{where} differs (hash mode: which elements is not stored)"
    if "metrics_of" in sh:  # the compared value is the partial pair: the metrics are the planted rank's partial's
        assert sh["metrics_of"] == f"rank {plant_rank}'s partial sum" and d["tensor"] == "output of aten.mm.default"
        assert d["mismatched"] == (n if full else None) and d["numel"] == numel, d
        if full:
            assert _flat(d["first_index"], d["shape"]) == first, d
    else:  # the compared value is the reduced sum: its own true count
        assert d["tensor"] == "out" and d["mismatched"] == (reduced if full else None), d


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("plant_rank", [1, 0])
def test_mlp_row_parallel_plant_names_the_rank_and_its_partials_count(mlp_runs, plant_rank, mode):
    root, ranks, _ = mlp_runs
    truth = _truth(ranks, f"plant{plant_rank}")
    r = divtrace.bisect(str(root / f"plant{plant_rank}-{mode}"), str(root / f"base-{mode}"))
    assert r.first.module == "2", r.to_dict()["first"]
    reduced = _reduced_count(ranks[0][f"plant{plant_rank}"][1], ranks[0]["base"][1])
    _check_per_rank(r, root / f"plant{plant_rank}-{mode}", truth, plant_rank, mode, reduced)


@pytest.mark.parametrize("mode", MODES)
def test_mlp_row_parallel_plant_against_one_process_names_no_rank(mlp_runs, mode):
    """TP=2 against TP=1: no partial on b to compare rank 1's with; the reduced sum is compared, its count the true
    count of the reduced sums' differing elements, and no rank or per-rank count is claimed."""
    root, ranks, y1 = mlp_runs
    y2 = ranks[0]["plant1"][1]
    assert bits_equal(y2, ranks[1]["plant1"][1])
    n = int((y2.view(torch.int32) != y1.view(torch.int32)).sum())
    assert n > 0
    r = divtrace.bisect(str(root / f"plant1-{mode}"), str(root / f"tp1-{mode}"))
    d = r.to_dict()["first"]
    assert r.verdict == "diverged" and d["module"] == "2" and d["op"] == "aten.mm.default" and d["tensor"] == "out", d
    sh = d["shards"]
    assert "partials" not in sh and "rank 1" not in sh["partial"], sh
    assert sh["partial"] == ("partial sums of 2 ranks on a, none on b: the reduced sum (out) is compared, not a "
                             "rank's partial, so no rank is named and no per-rank count is given")
    assert d["mismatched"] == (n if mode == "full" else None), d


@pytest.mark.parametrize("mode", MODES)
def test_the_report_prints_the_rank_and_never_a_false_zero(mlp_runs, mode):
    from test_trace_fixtures import cli

    root, ranks, _ = mlp_runs
    n, _, numel = _truth(ranks, "plant1")[1]
    code, out, _ = cli("bisect", root / f"plant1-{mode}", root / f"base-{mode}")
    flat = " ".join(out.split())
    assert code == 1
    if mode == "full":
        assert f"partial sums │ rank 1's partial sum: {n} of {numel} elements mismatched" in flat, out
        assert f"mismatched │ {n} of {numel} elements of rank 1's partial sum" in flat, out
    else:
        assert "partial sums │ rank 1's partial sum differs (hash mode: which elements is not stored)" in flat, out
        assert " mismatched │" not in flat, out
    assert f"0 of {numel}" not in flat, out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("plant_rank", [1, 0])
def test_llama_o_proj_plant_names_the_rank_and_its_partials_count(llama_runs, plant_rank, mode):
    """HF's TP plan: one rank's block of layer 0's o_proj weight nudged; o_proj's local matmul is the origin, that
    rank's partial named with its own count (the HF path runs aten.mm under linear)."""
    root, ranks, _ = llama_runs
    truth = _truth(ranks, f"plant{plant_rank}")
    r = divtrace.bisect(str(root / f"plant{plant_rank}-{mode}"), str(root / f"base-{mode}"))
    assert r.first.module == O_PROJ, r.to_dict()["first"]
    reduced = _reduced_count(ranks[0][f"plant{plant_rank}"][1], ranks[0]["base"][1])
    _check_per_rank(r, root / f"plant{plant_rank}-{mode}", truth, plant_rank, mode, reduced)


@pytest.mark.parametrize("mode", MODES)
def test_llama_o_proj_plant_by_tokens(llama_runs, mode):
    """Token alignment compares a partial sum whole (it has no token rows): the same rank and count as by calls (it
    had said 0 mismatched there too)."""
    root, ranks, _ = llama_runs
    r = divtrace.bisect(str(root / f"plant1-{mode}"), str(root / f"base-{mode}"), align="tokens")
    assert r.to_dict()["alignment"] == "tokens" and r.first.module == O_PROJ, r.to_dict()["first"]
    reduced = _reduced_count(ranks[0]["plant1"][1], ranks[0]["base"][1])
    _check_per_rank(r, root / f"plant1-{mode}", _truth(ranks, "plant1"), 1, mode, reduced)


def test_llama_o_proj_plant_against_one_process(llama_runs):
    root, ranks, y1 = llama_runs
    y2 = ranks[0]["plant1"][1]
    n = int((y2.view(torch.int32) != y1.view(torch.int32)).sum())
    r = divtrace.bisect(str(root / "plant1-full"), str(root / "tp1-full"))
    d = r.to_dict()["first"]
    assert r.verdict == "diverged" and d["module"] == O_PROJ and d["tensor"] == "out", d
    assert "partials" not in d["shards"] and d["shards"]["partial"].startswith("partial sums of 2 ranks on a, none on b")
    assert n > 0 and d["mismatched"] == n, (n, d)
