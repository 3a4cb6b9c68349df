"""Tensor parallelism, two gloo ranks on the CPU: an HF Llama at TP=2 (HF's own TP plan) against TP=1, recorded with
divtrace on each rank into a run directory and bisected against the one-process trace. Every case is held to the
ground truth of tests/sharded_cases.py (plain hooks, values put together in the test), in full and hash mode."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # HF's TP plan (from_pretrained(tp_plan=...)) needs it

import divtrace  # noqa: E402
from dist_harness import run_ranks  # noqa: E402
from sharded_cases import IDS, bits_equal, single, tiny_llama, tp_worker, truth_origin  # noqa: E402

pytestmark = pytest.mark.gloo  # multi-process (gloo, 2 ranks): .ci/run's stage of their own

CASES = [("fp32-full", "float32", "full", False), ("fp32-hash", "float32", "hash", False),
         ("bf16-full", "bfloat16", "full", False), ("bf16-hash", "bfloat16", "hash", False),
         ("plant-full", "float32", "full", True), ("plant-hash", "float32", "hash", True)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    model = tiny_llama(str(root / "model"))
    (truth,) = run_ranks(tp_worker, 2, model, str(root / "tp2"), CASES)[:1]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: a matmul may round otherwise with another thread count
    try:
        singles = {name: single(model, str(root / "tp1" / name), dtype, mode, plant)
                   for name, dtype, mode, plant in CASES}
        single(model, str(root / "tp1" / "plant-first-seq"), "float32", "full", True, ids=IDS[:1])  # another batch
    finally:
        torch.set_num_threads(threads)
    return root, truth, singles


def _bisect(root, name):
    return divtrace.bisect(str(root / "tp2" / name), str(root / "tp1" / name))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tp2_against_tp1_finds_the_hooks_origin(runs, dtype):
    root, truth, singles = runs
    g, order = truth[f"{dtype}-full"]
    caps_b, _ = singles[f"{dtype}-full"]
    expected = truth_origin(order, g, caps_b)
    r = _bisect(root, f"{dtype}-full")
    if expected is None:
        assert r.verdict == "identical", r.to_dict()
        return
    assert r.verdict == "diverged"
    assert r.first.module == expected, (r.first.module, expected)
    leaf = expected.rsplit(".", 1)[-1]
    if leaf in ("o_proj", "down_proj"):  # a rowwise layer: its partial sums, reduced, against one matmul
        assert r.first.shards["why"].startswith(f"{leaf}: 2 partial matmuls summed by all_reduce on a, one matmul "
                                                "over K="), r.first.shards


@pytest.mark.parametrize("name", ["fp32-full", "fp32-hash", "bf16-full"])
def test_every_module_output_is_the_hooks_global_value(runs, name):
    """The run view's key of each module's output is the fingerprint of the global value the hooks put together
    (blocks concatenated, replicas checked): unsharding by layouts and partial fingerprints is exact."""
    from divtrace.align.shards import open_side
    from divtrace.trace.hashing.tensor import tensor_hash

    root, truth, _ = runs
    g, _ = truth[name.replace("hash", "full")]
    view = open_side(str(root / "tp2" / name))
    checked = 0
    for c in view.calls.values():
        outs = dict(c.outputs)
        vid = outs.get("out", outs.get("out.0", outs.get("out.logits")))
        if vid is None or c.module not in g or g[c.module][1] is None:
            continue
        key = view.vkey[vid]
        assert type(key) is tuple, (c.module, key)  # a global value, not a rank's own piece
        assert key[1] == tuple(g[c.module][1].shape) and key[2] == tensor_hash(g[c.module][1]), c.module
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize("name", ["fp32", "bf16", "plant"])
def test_hash_mode_and_token_alignment_give_full_modes_origin(runs, name):
    """Hash mode (partial fingerprints summed) and token alignment (row partials summed) find what full mode
    finds by calls."""
    root, _, _ = runs
    full = _bisect(root, f"{name}-full")
    for other in (_bisect(root, f"{name}-hash"),
                  divtrace.bisect(str(root / "tp2" / f"{name}-hash"), str(root / "tp1" / f"{name}-hash"),
                                  align="tokens")):
        assert other.verdict == full.verdict
        if full.first is not None:
            assert (other.first.module, other.first.op, other.first.op_b) == (full.first.module, full.first.op,
                                                                               full.first.op_b)
            assert other.first.shards["why"] == full.first.shards["why"]
            d = other.to_dict()
            if d.get("alignment") == "tokens":  # every origin says how each side computed it, as `first` does
                assert d["origins"][0]["shards"] == d["first"]["shards"] == other.first.shards


def test_planted_difference_in_one_ranks_column_block(runs):
    root, truth, singles = runs
    g, order = truth["plant-full"]
    caps_b, _ = singles["plant-full"]
    assert truth_origin(order, g, caps_b) == "model.layers.0.self_attn.q_proj"
    out_a, out_b = g["model.layers.0.self_attn.q_proj"][1], caps_b["model.layers.0.self_attn.q_proj"][1]
    half = out_a.shape[-1] // 2
    assert bits_equal(out_a[..., :half], out_b[..., :half]) and not bits_equal(out_a[..., half:], out_b[..., half:])
    for name in ("plant-full", "plant-hash"):
        r = _bisect(root, name)
        assert r.verdict == "diverged" and r.first.module == "model.layers.0.self_attn.q_proj", r.to_dict()["first"]
        assert r.first.op == r.first.op_b == "aten.mul.Tensor"  # the planted op, not the matmul before it
    r = _bisect(root, "plant-full")
    assert r.first.shards["block_a"] == f"rank 1's block (dim 2: {half}..{2 * half - 1})", r.first.shards
    assert r.first.shards["why"] == "q_proj: mul on 2 blocks of dim 2, one per rank on a, mul on b"
    first = r.first.diff.first_index
    assert half <= first[-1] < 2 * half


def test_a_run_against_itself_is_identical(runs):
    root, _, _ = runs
    r = divtrace.bisect(str(root / "tp2" / "fp32-full"), str(root / "tp2" / "fp32-hash"))
    assert r.verdict == "identical", r.to_dict()


@pytest.mark.parametrize("name", ["fp32-full", "plant-full"])
def test_repro_runs_each_sides_shards_on_simulated_ranks(runs, tmp_path, name):
    """The repro of a sharded origin replays side a's region on both ranks in one process (no process group), its
    collectives done by the script, and returns the global value: both sides reproduce their recorded outputs bit
    for bit, the script fails while they differ, and verify passes a fix (side a computed as side b computes)."""
    import json
    import subprocess
    import sys

    from divtrace.repro.writer import write_repro
    from divtrace.verify import verify_repro

    root, _, _ = runs
    r = divtrace.bisect(str(root / "tp2" / name), str(root / "tp1" / name))
    if r.first is None:
        pytest.skip("the runs are identical on this machine: nothing to reproduce")
    out = tmp_path / "repro"
    res = write_repro(str(root / "tp2" / name), str(root / "tp1" / name), out)
    assert res.ok, res.fidelity
    m = json.loads((out / "manifest.json").read_text())
    assert m["ranks"] == {"a": [0, 1], "b": []} and m["origin"]["module"] == r.first.module
    src = (out / "repro.py").read_text()
    assert "(rank 0)" in src and "(rank 1)" in src and "torch.distributed" not in src
    p = subprocess.run([sys.executable, str(out / "repro.py")], capture_output=True, text=True)
    assert p.returncode == 1, p.stdout + p.stderr
    assert not verify_repro(out, trials=2).passed
    fix = tmp_path / "fix.py"
    params = ", ".join(i["name"] for i in m["inputs"])
    fix.write_text(f"import importlib.util\n"
                   f"spec = importlib.util.spec_from_file_location('r', {str(out / 'repro.py')!r})\n"
                   f"r = importlib.util.module_from_spec(spec); spec.loader.exec_module(r)\n"
                   f"def like_b({params}):\n    return r.side_b({params})\n")
    assert verify_repro(out, patch=f"{fix}:like_b", side="a", trials=2).passed


def test_repro_of_a_token_aligned_divergence_runs_each_side_at_its_own_batch(runs, tmp_path):
    """TP=2 on two sequences against one process that ran only the first: bisect pairs their tokens and finds the
    planted op; the repro runs side a's region on its 2 simulated ranks at its batch of 2 and side b at its batch
    of 1, each returning the token's row of its global output: both reproduce their recorded rows bit for bit,
    and the script fails while they differ."""
    import json
    import subprocess
    import sys

    from divtrace.repro.writer import write_repro

    root, _, _ = runs
    a, b = root / "tp2" / "plant-full", root / "tp1" / "plant-first-seq"
    r = divtrace.bisect(str(a), str(b))
    d = r.to_dict()
    assert d["alignment"] == "tokens" and r.verdict == "diverged", d
    assert (r.first.module, r.first.op) == ("model.layers.0.self_attn.q_proj", "aten.mul.Tensor"), d["first"]
    out = tmp_path / "repro"
    res = write_repro(str(a), str(b), out)
    assert res.ok, res.fidelity
    m = json.loads((out / "manifest.json").read_text())
    assert m["ranks"] == {"a": [0, 1], "b": []} and set(m["token_rows"]) == {"a", "b"}
    assert m["token_rows"]["a"][0] == m["token_rows"]["b"][0] == 0  # the first sequence on both sides
    src = (out / "repro.py").read_text()
    assert "(rank 1)" in src and "the token's row" in src and "torch.distributed" not in src
    assert [i["shape"][0] for i in m["inputs"]] == [2, 2, 1]  # each side's region at its own batch
    p = subprocess.run([sys.executable, str(out / "repro.py")], capture_output=True, text=True)
    assert p.returncode == 1, p.stdout + p.stderr
