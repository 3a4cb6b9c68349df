"""A functional collective's result is read once: the recorder waits for it and fingerprints it where the collective
is recorded, so the `_wrap_tensor_autograd` DTensor puts around it and the user's `wait_tensor`, which hand back
that very tensor untouched, are recorded with its value's fingerprint, not by reading its bytes
again (HF's TP plan gathers the logits this way: 32 MB a forward twice over at a 32000 vocabulary)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_harness import run_ranks

pytestmark = pytest.mark.gloo  # multi-process (gloo, 2 ranks): .ci/run's stage of their own


def _worker(rank, world, out):
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    import divtrace
    from divtrace.trace.writer import TraceWriter

    class Gather(torch.nn.Module):
        def forward(self, input_ids):
            x = torch.nn.functional.one_hot(input_ids, 12).float() * (rank + 1)  # [1, 6, 12]: token rows
            g = fc.all_gather_single(x * 2, 0, dist.group.WORLD)  # [2, 6, 12]
            w = fc.wait_tensor(g)
            self.got = w.clone()
            return w + 0

    reads = []
    new_value = TraceWriter.new_value

    def counted(self, t, *a, **k):
        if tuple(t.shape) == (2, 6, 12):
            reads.append(k.get("producer"))
        return new_value(self, t, *a, **k)

    TraceWriter.new_value = counted
    ids = torch.tensor([[1, 4, 2, 9, 3, 5]])
    m = Gather()
    with torch.no_grad(), divtrace.record(m, out, mode="hash", ops=True):
        m(ids)
    TraceWriter.new_value = new_value
    from divtrace.trace.hashing.tensor import hash_with_stats

    return reads, hash_with_stats(m.got)[0]  # (ground truth: the fingerprint of the bytes the wait handed back)


def test_a_waited_collective_result_is_not_read_again(tmp_path):
    run = tmp_path / "tp2"
    got = run_ranks(_worker, 2, str(run))
    for rank in (0, 1):
        recs = [json.loads(x) for x in (Path(run) / f"rank-{rank}" / "records.jsonl").read_text().splitlines()]
        ops = {r["op"]: r for r in recs if r.get("k") == "o"}
        gather = ops["_c10d_functional.all_gather_into_tensor.default"]
        wait = ops["_c10d_functional.wait_tensor.default"]
        wrap = ops["_c10d_functional._wrap_tensor_autograd.default"]
        hashes = {v["v"]: v["h"] for r in recs for v in r.get("V", [])}
        # the gather's result read once (by the gather's own record), the wait's the same value's bytes
        reads, truth = got[rank]
        assert [p for p in reads if p in (gather["i"], wrap["i"], wait["i"])] == [gather["i"]], reads
        assert hashes[wait["out"][0]] == hashes[wrap["out"][0]] == hashes[gather["out"][0]] == truth
        add = ops["aten.add.Tensor"]
        assert add["in"][0] == wait["out"][0]
    import divtrace

    r = divtrace.bisect(str(run), str(run))
    assert r.verdict == "identical", r.to_dict()
