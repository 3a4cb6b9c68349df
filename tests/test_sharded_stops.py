"""A rank that stops: the verdict rule over a run directory. TP=2 with a difference planted in layer 0's q_proj
(tests/sharded_cases.stopped_worker): rank 1 is SIGKILLed on entering a module; rank 0's next collective fails.
Killed after the planted op, bisect finds it (diverged, the reason naming the stopped rank); killed before it,
nothing can be claimed (inconclusive, exit 3, naming rank 1). A run directory missing a rank's trace is the same."""
from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import divtrace  # noqa: E402
from dist_harness import run_ranks  # noqa: E402
from sharded_cases import single, stopped_worker, tiny_llama  # noqa: E402

pytestmark = pytest.mark.gloo  # multi-process (gloo, 2 ranks): .ci/run's stage of their own

KILLS = [("after", "model.layers.1"), ("before", "model.layers.0.self_attn")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stops")
    model = tiny_llama(str(root / "model"))
    out = {}
    for name, at in KILLS:
        for mode in ("full", "hash"):
            got = run_ranks(stopped_worker, 2, model, str(root / "tp2"), f"{name}-{mode}", at, mode,
                            timeout_s=20, barrier=False, expect_exit={1: -9})
            out[(name, mode)] = got[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for mode in ("full", "hash"):
            single(model, str(root / "tp1" / mode), "float32", mode, plant=True)
    finally:
        torch.set_num_threads(threads)
    return root, out


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_killed_after_the_divergence_is_diverged_at_it(runs, mode):
    root, outcome = runs
    assert outcome[("after", mode)] != "finished"  # rank 0's collective failed once rank 1 was gone
    r = divtrace.bisect(str(root / "tp2" / f"after-{mode}"), str(root / "tp1" / mode))
    assert r.verdict == "diverged" and r.exit_code == 1, r.to_dict()
    assert r.first.module == "model.layers.0.self_attn.q_proj" and r.first.op == "aten.mul.Tensor"
    assert "rank 1 stopped" in r.reason


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_killed_before_the_divergence_is_inconclusive_naming_the_rank(runs, mode):
    root, _ = runs
    r = divtrace.bisect(str(root / "tp2" / f"before-{mode}"), str(root / "tp1" / mode))
    assert r.verdict == "inconclusive" and r.exit_code == 3, r.to_dict()
    assert "rank 1 stopped" in r.reason and r.first is None


def test_a_missing_rank_is_inconclusive_naming_it(runs, tmp_path):
    """A run directory whose rank-1 trace is gone: nothing of its blocks is compared, nothing claimed."""
    root, _ = runs
    run = tmp_path / "run"
    shutil.copytree(root / "tp2" / "before-hash" / "rank-0", run / "rank-0")
    r = divtrace.bisect(str(run), str(root / "tp1" / "hash"))
    assert r.verdict == "inconclusive" and "rank 1 has no trace" in r.reason, r.to_dict()
    assert "record every rank of the run into it" in r.reason, r.reason
    # Nothing of a TP=2 run can be put together from rank 0 alone, but its calls pair with the one process's: none
    # is counted as "only in a" (every call of both sides was, before)
    assert r.coverage.only_a == 0, r.coverage
