"""A TP=2 run with a rank stopped early, or its rank folder gone, against a complete TP=2 run of the same model and
batch: the verdict rule (docs/sharded.md). On the stopped side a value whose other block is missing is keyed as a
missing block; on the complete side the same value may be a partial sum or a rank's own pieces, also keyed
RankLocal: such a pair is not compared (divtrace.align.shards.keys.uncompared), so nothing differs before the stop
and the verdict is inconclusive (exit 3) naming the rank. (It had been "diverged" at model.embed_tokens with 0
mismatched elements: a missing block was compared with a partial sum, keys that can never be equal.) With a
difference planted before the stop (a v_proj weight block nudged on one rank, the other killed after layer 0), the
origin is proven before the stop: diverged at it. Ground truth from plain hooks in unrecorded forwards
(tests/sharded_cases.py), put together from both ranks' pieces."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # HF's TP plan (from_pretrained(tp_plan=...)) needs it

import divtrace  # noqa: E402
from dist_harness import run_ranks  # noqa: E402
from sharded_cases import bits_equal, tiny_llama, truth_origin  # noqa: E402

pytestmark = pytest.mark.gloo  # multi-process (gloo, 2 ranks): .ci/run's stage of their own

V_PROJ = "model.layers.0.self_attn.v_proj"
KILL_AT = "model.layers.1"  # the last rank SIGKILLs itself on entering it (after layer 0, where the plant is)


def stop_worker(rank, world, model_dir, root, name, modes, plant_rank, kill, flush):
    """HF's TP plan at TP=`world`: rank `plant_rank` (None: no rank) adds 0.01 to one element of its v_proj weight
    block; the ground truth (every module's input and output put together from both ranks, plain hooks) is
    captured in an unrecorded forward; then one recorded forward per mode into ROOT/NAME-MODE, the last rank killed
    on entering KILL_AT if `kill` (records flushed one by one if `flush`, else what the recorder buffered is lost:
    a trace with no records). Rank 0 returns (each mode's outcome, the ground truth, the modules in call order)."""
    import signal

    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM

    from sharded_cases import IDS, capture, unshard_tp

    torch.set_num_threads(1)
    m = LlamaForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32).eval()
    if plant_rank == rank:
        w = m.get_submodule(V_PROJ).weight
        block = w.to_local() if isinstance(w, DTensor) else w
        with torch.no_grad():
            block[0, 0] += 0.01
    caps, order = capture(m, IDS)
    truth = unshard_tp(caps)
    if kill and rank == world - 1:
        m.get_submodule(KILL_AT).register_forward_pre_hook(lambda *a: os.kill(os.getpid(), signal.SIGKILL))
    outcome = {}
    for mode in modes:
        try:
            with torch.no_grad(), divtrace.record(m, os.path.join(root, f"{name}-{mode}"), mode=mode,
                                                  **({"flush_records": 1} if flush else {})):
                m(torch.tensor(IDS))
            outcome[mode] = "finished"
        except Exception as e:  # rank 0's collective, once the last rank is gone
            outcome[mode] = type(e).__name__
    return (outcome, truth, order) if rank == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("missing_rank")
    model = tiny_llama(str(root / "model"))
    got = {}

    def run(name, modes, plant_rank=None, kill=False, flush=False):
        kw = dict(timeout_s=20, barrier=False, expect_exit={1: -9}) if kill else {}
        got[name] = run_ranks(stop_worker, 2, model, str(root), name, modes, plant_rank, kill, flush, **kw)[0]

    run("complete", ("full", "hash"))
    for mode in ("full", "hash"):
        run(f"stopped-{mode}", (mode,), kill=True)  # rank 1 recorded nothing (its trace: 0 records, "running")
    run("planted1", ("full",), plant_rank=1, kill=True, flush=True)  # rank 1's block, rank 1 killed after it
    run("planted0", ("hash",), plant_rank=0, kill=True, flush=True)  # rank 0's block, rank 1 killed after it
    for mode in ("full", "hash"):  # the stopped run with its rank-1 folder removed
        shutil.copytree(root / f"stopped-{mode}-{mode}" / "rank-0", root / f"gone-{mode}" / "rank-0")
    return root, got


def _bisect(a, b):
    return divtrace.bisect(str(a), str(b))


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_a_stopped_rank_against_a_complete_run_is_inconclusive_naming_it(runs, mode):
    root, got = runs
    outcome, truth, order = got[f"stopped-{mode}"]
    ref_outcome, ref_truth, _ = got["complete"]
    assert outcome[mode] != "finished" and ref_outcome == {"full": "finished", "hash": "finished"}
    # Ground truth: the same model and batch, nothing planted: every module's global input and output equal
    assert truth_origin(order, truth, ref_truth) is None
    assert all(bits_equal(x, y) for p in order for x, y in zip(truth[p], ref_truth[p]))
    stopped = root / f"stopped-{mode}-{mode}" / "rank-1"  # what divtrace saw of rank 1: nothing, never closed
    assert (stopped / "records.jsonl").stat().st_size == 0
    assert json.loads((stopped / "meta.json").read_text())["complete"] is False
    r = _bisect(root / f"stopped-{mode}-{mode}", root / f"complete-{mode}")
    assert r.verdict == "inconclusive" and r.exit_code == 3 and r.first is None, r.to_dict()
    assert "rank 1 stopped" in r.reason, r.reason


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_a_missing_rank_folder_against_a_complete_run_is_inconclusive_naming_it(runs, mode):
    root, _ = runs
    gone, complete = root / f"gone-{mode}", root / f"complete-{mode}"
    for a, b in ((gone, complete), (complete, gone)):
        r = _bisect(a, b)
        assert r.verdict == "inconclusive" and r.exit_code == 3 and r.first is None, r.to_dict()
        assert "rank 1 has no trace" in r.reason, r.reason


@pytest.mark.parametrize("name,mode,plant_rank", [("planted1", "full", 1), ("planted0", "hash", 0)])
def test_a_difference_planted_before_the_stop_is_diverged_at_it(runs, name, mode, plant_rank):
    root, got = runs
    outcome, truth, order = got[name]
    _, ref_truth, _ = got["complete"]
    assert outcome[mode] != "finished"
    assert truth_origin(order, truth, ref_truth) == V_PROJ
    out_a, out_b = truth[V_PROJ][1], ref_truth[V_PROJ][1]
    half = out_a.shape[-1] // 2
    mine = slice(plant_rank * half, (plant_rank + 1) * half)
    other = slice((1 - plant_rank) * half, (2 - plant_rank) * half)
    assert not bits_equal(out_a[..., mine], out_b[..., mine]) and bits_equal(out_a[..., other], out_b[..., other])
    r = _bisect(root / f"{name}-{mode}", root / f"complete-{mode}")
    assert r.verdict == "diverged" and r.exit_code == 1, r.to_dict()
    assert r.first.module == V_PROJ, r.to_dict()["first"]
    assert "rank 1 stopped" in r.reason, r.reason
