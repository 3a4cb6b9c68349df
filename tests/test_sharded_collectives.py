"""torch's parallelize_module on a 2-layer MLP (DTensors flow through the layers), two gloo ranks: recording moves
no tensor bytes between ranks (every collective in a recorded forward is the model's own, the same calls and bytes
as without divtrace), and the run, in hash mode as in full mode, bisects against the one-process MLP to what the
hooks say."""
from __future__ import annotations

import torch

import divtrace
from dist_harness import run_ranks
from sharded_cases import bits_equal, capture_mlp, mlp, parallel_mlp_worker, truth_origin

import pytest

pytestmark = pytest.mark.gloo  # multi-process (gloo, 2 ranks): .ci/run's stage of their own


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlp")
    got, rank1 = run_ranks(parallel_mlp_worker, 2, str(root / "tp2"))
    got = (*got, rank1)
    m = mlp()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for mode in ("hash", "full"):
            with torch.no_grad(), divtrace.record(m, str(root / "tp1" / mode), mode=mode):
                m(x)
        hooks = {}

        def hook(path):
            def f(mod, args, out):
                hooks[path] = (args[0].clone(), out.clone())
            return f
        hs = [mod.register_forward_hook(hook(p)) for p, mod in m.named_modules()]
        with torch.no_grad():
            m(x)
        for h in hs:
            h.remove()
    finally:
        torch.set_num_threads(threads)
    return root, got, hooks


def test_recording_moves_no_tensor_bytes_between_ranks(run):
    _, (plain_calls, plain_bytes, rec_calls, rec_bytes, *_), _ = run
    assert plain_calls and plain_bytes  # the model's own all_reduce
    assert rec_calls == plain_calls * 2 and rec_bytes == plain_bytes * 2  # two recorded forwards, nothing more


def test_parallelize_module_run_bisects_to_the_hooks_origin(run):
    root, (_, _, _, _, caps, order, *_), hooks = run
    expected = truth_origin(order, caps, hooks)
    for mode in ("hash", "full"):
        r = divtrace.bisect(str(root / "tp2" / mode), str(root / "tp1" / mode))
        if expected is None:
            assert r.verdict == "identical" and bits_equal(caps[""][1], hooks[""][1]), r.to_dict()
        else:
            assert r.verdict == "diverged" and r.first.module == expected, (r.to_dict()["first"], expected)


def test_dtensor_values_record_their_placements(run):
    from divtrace.trace.layouts import read_layouts

    root, _, _ = run
    lays = read_layouts(divtrace.open_trace(root / "tp2" / "hash" / "rank-1"))
    kinds = {(tuple(v.placements), v.src) for v in lays.values.values()}
    assert (("S0",), "dtensor") in kinds or (("S0",), "param") in kinds  # the colwise weight, rows split
    assert any(p == ("P",) for p, _ in kinds)  # the rowwise matmul's partial sums
    assert any(c.kind == "all_reduce" and c.seq == 0 for c in lays.collectives.values())
    mesh = next(m for m in lays.meshes.values() if m.dims == ["tp"])
    assert mesh.ranks == [0, 1] and mesh.coords(1) == (1,)


def test_replicas_that_differ_are_a_finding_of_their_own(run):
    """A Replicate DTensor whose ranks hold other bytes: the run against itself is not identical; the first value
    declared replicated is where the walker stops, and the finding names the ranks."""
    root, _, _ = run
    r = divtrace.bisect(str(root / "tp2" / "replicas"), str(root / "tp2" / "replicas"))
    assert r.verdict == "diverged", r.to_dict()
    assert "replicas differ: ranks [1] hold other bytes than rank 0" in r.first.shards["note_a"]
    assert any("replicas differ" in w for w in r.warnings)


def test_recording_into_a_directory_holding_one_trace_is_refused(run):
    _, got, _ = run
    assert "holds a single-process trace" in got[6]


def test_collectives_are_ops_with_their_group_order_and_results(run):
    """reduce_scatter, all_to_all, all_gather, all_reduce (c10d) and a functional all_reduce: each an op record
    whose outputs are what the collective gave (waited for where recorded), with its kind, group, order and
    reduction (c10d's ReduceOp read as the functional one's name); a reduce_scatter's blocks put together are the
    reduced value. (Recorded twice, the second with overwrite: its layouts.jsonl
    replaces the first's, under the new recording's checksums.)"""
    from divtrace.align.shards import open_side
    from divtrace.trace.hashing.tensor import tensor_hash
    from divtrace.trace.layouts import read_layouts

    root, got, _ = run
    outs = {0: got[7], 1: got[8]}
    run_dir = root / "tp2" / "collectives"
    for rank in (0, 1):
        t = divtrace.open_trace(run_dir / f"rank-{rank}")
        lays = read_layouts(t)
        seen = sorted(lays.collectives.values(), key=lambda c: c.index)
        assert [c.kind for c in seen] == ["reduce_scatter", "all_to_all", "all_gather", "all_reduce", "all_reduce"]
        assert [c.op for c in seen] == ["sum", None, None, "sum", "max"]  # c10d's ReduceOp read, as the functional's
        assert [c.seq for c in seen] == [0, 1, 2, 3, 4] and all(lays.meshes[c.mesh].ranks == [0, 1] for c in seen)
        assert bits_equal(t.tensor(t.rout[seen[4].index][0]), outs[rank]["mx"])
        by_kind = {c.kind: t.rout[c.index] for c in seen[:4]}
        assert bits_equal(t.tensor(by_kind["reduce_scatter"][0]), outs[rank]["rs"])
        assert bits_equal(t.tensor(by_kind["all_to_all"][0]), outs[rank]["a2a"])
        assert [bits_equal(t.tensor(v), p) for v, p in zip(by_kind["all_gather"], outs[rank]["gathered"].chunk(2))] \
            == [True, True]
    view = open_side(run_dir)
    rs_vid = view.rout[next(c.index for c in view.run.layouts[0].collectives.values()
                            if c.kind == "reduce_scatter")][0]
    whole = torch.cat([outs[0]["rs"], outs[1]["rs"]])
    assert view.vkey[rs_vid][1:] == (tuple(whole.shape), tensor_hash(whole))


def test_layouts_are_written_under_the_traces_checksums(run, tmp_path):
    """layouts.jsonl goes out with the records, under their checksums, and is read as untrusted: edited afterwards,
    cut short, or holding a line that is not a layout line, the run is a damaged trace (exit 2, one line naming the
    file), never unsharded from layouts the recording did not write. A killed recording's layouts are cut back to
    what its last checkpoint vouches for (lines a kill left beyond it are not read)."""
    import json
    import shutil

    from divtrace.trace.layouts import LAYOUTS, read_layouts
    from test_trace_fixtures import cli, edit_meta

    root, _, _ = run
    src = root / "tp2" / "hash"
    whole = read_layouts(divtrace.open_trace(src / "rank-1"))
    assert whole.values and whole.collectives

    def copy(name):
        shutil.copytree(src, tmp_path / name)
        return tmp_path / name, tmp_path / name / "rank-1" / LAYOUTS

    def damaged(run_dir, *needles):
        with pytest.raises(divtrace.DivtraceError, match="damaged trace: .*layouts.jsonl") as e:
            divtrace.open_trace(run_dir)
        code, _, err = cli("show", run_dir)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert all(n in str(e.value) and n in err for n in needles), (str(e.value), err)

    run_dir, path = copy("edited")
    meta = json.loads((run_dir / "rank-1" / "meta.json").read_text())
    assert meta["file_checksums"][LAYOUTS]["bytes"] == path.stat().st_size
    path.write_text(path.read_text().replace('"S0"', '"S1"', 1))
    damaged(run_dir, "sha256")

    run_dir, path = copy("cut")
    path.write_bytes(path.read_bytes()[:-10])
    damaged(run_dir, "truncated")

    # A killed recording: meta.json as it stands while the run is on (no final checksums), and bytes a kill left
    # after the last checkpoint (a torn half line) are cut back; the layouts read are the whole run's.
    run_dir, path = copy("killed")
    rank = run_dir / "rank-1"
    edit_meta(rank, status="running", complete=False, checksums=None, records=None, shards=None,
              file_checksums={n: None for n in meta["file_checksums"]})
    path.write_bytes(path.read_bytes() + b'{"v": 99, "M": 0, "p": ["S')
    got = read_layouts(divtrace.open_trace(rank))
    assert got == whole
    path.write_bytes(path.read_bytes()[:-40])  # less than the checkpoint vouches for: damaged, not cut back
    damaged(run_dir, "truncated")


def test_a_layout_line_that_is_not_one_is_a_damaged_trace(tmp_path):
    """Read as untrusted (here a trace with no checksums over the file): every line must be a whole layout, mesh or
    collective line; a malformed one is named by its line, never skipped or read as the end of the file."""
    import json
    from types import SimpleNamespace

    from divtrace.trace.layouts import LAYOUTS, read_layouts

    good = [{"M": 0, "shape": [2], "dims": ["tp"], "ranks": [0, 1]},
            {"v": 3, "M": 0, "p": ["S1"], "g": [4, 8], "o": [0, 4], "src": "dtensor", "h": "0" * 32}]
    bad = [{"v": 4, "M": 0, "p": ["Q"], "g": [4], "o": [0]}, {"c": 5, "kind": "all_reduce", "M": 0, "seq": "0"},
           {"M": 1, "shape": [2], "dims": ["tp"], "ranks": [0]}, [1, 2], {"x": 1}]
    trace = SimpleNamespace(path=tmp_path, meta={"complete": True}, file_sums=None)
    for line in bad:
        (tmp_path / LAYOUTS).write_text("\n".join(json.dumps(x) for x in [*good, line]) + "\n")
        with pytest.raises(divtrace.DivtraceError, match=f"damaged trace: .*{LAYOUTS}:3: "):
            read_layouts(trace)
    (tmp_path / LAYOUTS).write_text("\n".join(json.dumps(x) for x in good) + "\n{not json\n")
    with pytest.raises(divtrace.DivtraceError, match=f"{LAYOUTS}:3: corrupt line"):
        read_layouts(trace)


def test_the_device_path_writes_the_layouts_the_cpu_path_writes(run):
    """A rank recorded on the device path (forced on the CPU: the code a GPU runs, each block's partial fingerprint
    sent to the host with the path's batches and written by its writer thread) writes the layouts the CPU path
    writes, under the checksums, and the two runs are identical."""
    from divtrace.trace.layouts import read_layouts

    root, _, _ = run
    for rank in (0, 1):
        cpu = read_layouts(divtrace.open_trace(root / "tp2" / "hash" / f"rank-{rank}"))
        dev_trace = divtrace.open_trace(root / "tp2" / "device" / f"rank-{rank}")
        assert dev_trace.meta.get("device_path") and "layouts.jsonl" in dev_trace.meta["file_checksums"]
        dev = read_layouts(dev_trace)

        def lines(lays):
            return sorted((tuple(v.placements), tuple(v.global_shape), tuple(v.offsets), v.src, v.partial or "")
                          for v in lays.values.values())
        assert lines(dev) == lines(cpu) and any(v.partial for v in dev.values.values())
    r = divtrace.bisect(str(root / "tp2" / "device"), str(root / "tp2" / "hash"))
    assert r.verdict == "identical", r.to_dict()
