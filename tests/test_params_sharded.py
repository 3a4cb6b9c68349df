"""Parameters compared by name in run directories (2 gloo ranks, HF's TP plan): rank r against rank r where both runs
have the same world size, the local blocks named by their parameter's name; never a TP rank's block against a whole
weight. Truth: each rank's local parameters, compared with torch."""
from __future__ import annotations

import os

import pytest

from dist_harness import run_ranks
from sharded_cases import IDS, single, tiny_llama

pytestmark = pytest.mark.gloo  # a process group (gloo): .ci/run's stage of its own

ROW = 50  # an embedding row no token of IDS looks up (vocab 64)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def worker(rank, world, model_dir, root):
    import torch
    from transformers import LlamaForCausalLM

    import divtrace

    torch.set_num_threads(1)
    assert all(ROW not in row and ROW % 32 not in row for row in IDS)
    out = {}
    for side in ("a", "b"):
        m = LlamaForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32).eval()
        if side == "b":
            with torch.no_grad():
                w = _local(m.model.embed_tokens.weight)
                w[ROW % w.shape[0], 0] += 1.0  # (a vocab-sharded block's row ROW % 32 is unread as well)
        with torch.no_grad(), divtrace.record(m, os.path.join(root, side), mode="full"):
            m(torch.tensor(IDS))
        out[side] = {n: _local(t).detach().clone() for n, t in [*m.named_parameters(), *m.named_buffers()]}
    return out


def test_run_directories_compare_parameters_rank_against_rank(tmp_path):
    import torch

    import divtrace

    model = tiny_llama(str(tmp_path / "model"))
    ranks = run_ranks(worker, 2, model, str(tmp_path / "runs"))
    truth = sorted((n, r) for r, got in enumerate(ranks) for n in got["a"]
                   if not torch.equal(got["a"][n], got["b"][n]))
    assert [n for n, _ in truth] and {n for n, _ in truth} == {"model.embed_tokens.weight"}
    r = divtrace.bisect(tmp_path / "runs" / "a", tmp_path / "runs" / "b")
    d = r.to_dict()
    p = d["parameters"]
    assert r.verdict == "absorbed" and r.exit_code == 4, d["reason"]
    assert sorted((x["name"], x["rank"]) for x in p["differ"]) == truth
    assert all(x["mismatched"] == 1 for x in p["differ"])
    assert p["compared"] == sum(len(got["a"]) for got in ranks) and p["not_compared"] == 0
    names = (tmp_path / "runs" / "a" / "rank-1" / "params.jsonl").read_text()
    assert '"model.layers.0.self_attn.q_proj.weight"' in names  # a sharded parameter's block, by its name

    # a TP=2 run against a one-process run: each name put together in global coordinates (compare/param_global),
    # the planted row of each rank's vocab block named by its rank and its global row
    single(model, str(tmp_path / "one"), "float32", "full")
    r = divtrace.bisect(tmp_path / "runs" / "b", tmp_path / "one")
    p = r.to_dict()["parameters"]
    assert p["how"] == "global" and p["compared"] == len(ranks[0]["b"]) and p["not_compared"] == 0, p["why"]
    [d] = p["differ"]
    assert d["name"] == "model.embed_tokens.weight" and d["ranks"] == [0, 1] and d["mismatched"] == 2
    assert d["rows"] == [ROW % 32, ROW]
