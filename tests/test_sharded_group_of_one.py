"""A process group of one process (gloo). vLLM initializes one for its single worker, and so do some trainers:
recording there writes a plain trace at the path given (not a run directory), unless the model holds DTensors (a
one-rank mesh), which records a run of one rank. Regression: vLLM's rollout went to `rollout/rank-0`, so the
rollout directory held no meta.json and bisect described its origin as a sharded one."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import divtrace
from dist_harness import run_ranks
from sharded_cases import mlp

pytestmark = pytest.mark.gloo  # a process group (gloo): .ci/run's stage of its own


def one_process_worker(rank, world, root):
    from torch.distributed.tensor import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    plain = mlp()
    with torch.no_grad(), divtrace.record(plain, os.path.join(root, "plain"), mode="hash"):
        plain(x)
    m = mlp()
    parallelize_module(m, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)),
                       {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with torch.no_grad(), divtrace.record(m, os.path.join(root, "dtensor"), mode="hash"):
        m(x)
    return True


def test_a_group_of_one_records_a_plain_trace_and_a_one_rank_mesh_a_run(tmp_path):
    assert run_ranks(one_process_worker, 1, str(tmp_path)) == [True]
    plain = tmp_path / "plain"
    meta = json.loads((plain / "meta.json").read_text())
    assert "dist" not in meta and not (plain / "rank-0").exists()
    assert not (plain / "layouts.jsonl").exists()
    run = tmp_path / "dtensor"
    assert not (run / "meta.json").exists()
    rmeta = json.loads((run / "rank-0" / "meta.json").read_text())
    assert rmeta["dist"]["rank"] == 0 and rmeta["dist"]["world_size"] == 1
    # the plain trace against a one-process recording of the same MLP: a plain pair, no sharded description
    again = mlp()
    with torch.no_grad(), divtrace.record(again, tmp_path / "again", mode="hash"):
        again(torch.randn(4, 16, generator=torch.Generator().manual_seed(1)))
    r = divtrace.bisect(plain, tmp_path / "again").to_dict()
    assert r["verdict"] == "identical", r
