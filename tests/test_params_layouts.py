"""Parameters compared across layouts (2 gloo ranks): a TP=2 run (HF's TP plan) and an FSDP2 run against one
process, by name, in global coordinates; replicas of one run checked equal to each other. Truth: each rank's own
parameters (its block and the block's global offsets, from the DTensor) against the one process's whole weights,
compared with torch in the test."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

import divtrace  # noqa: E402
from dist_harness import run_ranks  # noqa: E402
from sharded_cases import FSDP_IDS, IDS, bits_equal, capture, single, tiny_llama  # noqa: E402

pytestmark = pytest.mark.gloo  # a process group (gloo): .ci/run's stage of its own

ROW = 50  # a vocab row no token of IDS or FSDP_IDS looks up (vocab 64): rank 1's block of a TP=2 / FSDP2 split


def _truth_of(m) -> dict:
    """name -> (this rank's tensor, its global offsets) of every parameter and buffer."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for n, t in [*m.named_parameters(), *m.named_buffers()]:
        if hasattr(t, "to_local"):
            _, offsets = compute_local_shape_and_global_offset(tuple(t.shape), t.device_mesh, t.placements)
            out[n] = (t.to_local().detach().clone(), [int(o) for o in offsets])
        else:
            out[n] = (t.detach().clone(), [0] * t.dim())
    return out


class Spare(torch.nn.Module):
    """An MLP with a layer its forward never runs (an expert no row was routed to)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(16, 32, bias=False)
        self.down = torch.nn.Linear(32, 16, bias=False)
        self.spare = torch.nn.Linear(16, 32, bias=False)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 2.0, 16))  # (a Replicate DTensor no op reads)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


X = [[0.5 * i - 3.0 for i in range(16)], [0.25 * i for i in range(16)]]


def worker(rank, world, model_dir, root):
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    assert all(ROW not in s for s in IDS) and all(ROW not in s[0] for s in FSDP_IDS)
    truth = {}
    for case in ("clean", "plant", "replica"):
        m = LlamaForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32).eval()
        with torch.no_grad():
            if case == "plant" and rank == 1:  # rank 1's block of the vocab (rows 32-63): the unread row ROW
                w = m.model.embed_tokens.weight.to_local()
                w[ROW - 32, 3] += 1.0
            if case == "replica" and rank == 1:  # a norm weight HF's plan holds whole on every rank
                m.model.norm.weight[5] += 2.0 ** -10
        truth[case] = _truth_of(m)
        for mode in ("full", "hash"):
            with torch.no_grad(), divtrace.record(m, os.path.join(root, f"tp-{case}-{mode}"), mode=mode):
                m(torch.tensor(IDS))
    m = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for layer in m.model.layers:
        fully_shard(layer)
    fully_shard(m)
    with torch.no_grad():
        if rank == 1:  # rank 1's shard (Shard(0): rows 32-63) of the vocab; the forward all-gathers it
            m.model.embed_tokens.weight.to_local()[ROW - 32, 3] += 1.0
    truth["fsdp"] = {n: (t.full_tensor().detach().clone() if hasattr(t, "full_tensor") else t.detach().clone(),
                         [0] * t.dim()) for n, t in [*m.named_parameters(), *m.named_buffers()]}
    for mode in ("full", "hash"):
        with torch.no_grad(), divtrace.record(m, os.path.join(root, f"fsdp-plant-{mode}"), mode=mode):
            m(torch.tensor(FSDP_IDS[rank]))
    with torch.no_grad():  # a weight every token reads, planted in rank 1's shard (layer 0's q_proj, rows 32-63)
        if rank == 1:
            m.model.layers[0].self_attn.q_proj.weight.to_local()[7, 2] += 2.0 ** -8
        with divtrace.record(m, os.path.join(root, "fsdp-read-hash"), mode="hash"):
            m(torch.tensor(FSDP_IDS[rank]))
    truth["fsdp-read-hooks"] = capture(m, FSDP_IDS[rank])[0]  # (plain forward hooks: this rank's sequence)
    # torch's parallelize_module; a DTensor weight no op reads, planted in rank 1's block (global rows 16-31)
    from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    s = Spare()
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(s, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel(), "spare": ColwiseParallel()})
    s.scale = torch.nn.Parameter(distribute_tensor(s.scale.data, mesh, [Replicate()]))
    with torch.no_grad():
        if rank == 1:
            s.spare.weight.to_local()[3, 5] += 1.0
            s.scale.to_local()[4] += 2.0 ** -9  # a replica that differs on rank 1 only
    truth["spare"] = _truth_of(s)
    for mode in ("full", "hash"):
        with torch.no_grad(), divtrace.record(s, os.path.join(root, f"spare-{mode}"), mode=mode):
            s(torch.tensor(X))
    return truth


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("paramlayouts")
    model = tiny_llama(str(root / "model"))
    ranks = run_ranks(worker, 2, model, str(root / "runs"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for mode in ("full", "hash"):  # (params="blocks": whole weights' chunk partials, so hash mode names blocks)
            single(model, str(root / f"one-{mode}"), "float32", mode, params="blocks")
            one2 = single(model, str(root / f"one2-{mode}"), "float32", mode, ids=[s[0] for s in FSDP_IDS],
                          params="blocks")[0]
        single(model, str(root / "one-default-hash"), "float32", "hash")  # (params="all": no chunk partials)
        from transformers import LlamaForCausalLM

        one = LlamaForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        whole = {n: t.detach().clone() for n, t in [*one.named_parameters(), *one.named_buffers()]}
        s = Spare()
        for mode in ("full", "hash"):
            with torch.no_grad(), divtrace.record(s, str(root / f"spare-one-{mode}"), mode=mode, params="blocks"):
                s(torch.tensor(X))
        spare = {n: t.detach().clone() for n, t in s.named_parameters()}
    finally:
        torch.set_num_threads(threads)
    ranks[0]["one2-hooks"] = one2  # (the one process's captures of both sequences: row r is rank r's)
    return root, ranks, whole, spare


def _blocks_truth(ranks, case, whole) -> dict:
    """name -> the ranks whose block (at its global offsets) differs from the one process's weight there."""
    out = {}
    for r, got in enumerate(ranks):
        for n, (t, offsets) in got[case].items():
            w = whole[n][tuple(slice(o, o + k) for o, k in zip(offsets, t.shape))]
            if not (t.dtype == w.dtype and t.shape == w.shape and torch.equal(t.view(torch.uint8) if t.dim() else t,
                                                                                w.view(torch.uint8) if w.dim() else w)):
                out.setdefault(n, []).append(r)
    return out


def _bisect(root, a, b):
    r = divtrace.bisect(str(root / "runs" / a), str(root / b))
    return r, r.to_dict()["parameters"]


def test_tp2_against_one_process_unplanted_compares_every_parameter(runs):
    root, ranks, whole, _ = runs
    assert _blocks_truth(ranks, "clean", whole) == {}
    for mode in ("full", "hash"):
        r, p = _bisect(root, f"tp-clean-{mode}", f"one-{mode}")
        assert p["how"] == "global" and p["why"] is None, p
        assert p["compared"] == p["equal"] == len(whole) and p["not_compared"] == 0
        assert p["differ"] == [] and p["replicas"] == []
        assert not [x for x in r.to_dict()["absorbed"] if x["kind"] == "parameter"]
    # TP=2 against TP=2: rank against rank, as before, every name
    r = divtrace.bisect(str(root / "runs" / "tp-clean-hash"), str(root / "runs" / "tp-clean-full"))
    p = r.to_dict()["parameters"]
    assert r.verdict == "identical" and p["how"] == "ranks" and p["compared"] == p["equal"] == 2 * len(whole)


def test_tp2_plant_in_rank1_vocab_block_is_named_with_rank_and_rows(runs):
    root, ranks, whole, _ = runs
    truth = _blocks_truth(ranks, "plant", whole)
    assert truth == {"model.embed_tokens.weight": [1]}
    got = {}
    for mode in ("full", "hash"):
        r, p = _bisect(root, f"tp-plant-{mode}", f"one-{mode}")
        assert r.verdict != "identical"
        assert p["compared"] == len(whole) and p["equal"] == len(whole) - 1 and p["replicas"] == []
        [d] = p["differ"]
        assert d["name"] == "model.embed_tokens.weight" and d["rank"] == 1 and d["ranks"] == truth[d["name"]]
        assert d["shape"] == list(whole[d["name"]].shape)
        got[mode] = (d["ranks"], d["blocks"])
        assert d["blocks"] == [{"side": "a", "rank": 1, "offsets": [32, 0], "block": [32, 64]}]
        if mode == "full":
            assert d["mismatched"] == 1 and d["rows"] == [ROW]
    assert got["full"] == got["hash"]
    # against the same TP=2 run unplanted: no output reads the row, so absorbed, rank 1 named (as before)
    r = divtrace.bisect(str(root / "runs" / "tp-plant-hash"), str(root / "runs" / "tp-clean-hash"))
    d = r.to_dict()
    assert r.verdict == "absorbed" and r.exit_code == 4, d["reason"]
    assert [(x["name"], x["rank"]) for x in d["parameters"]["differ"]] == [("model.embed_tokens.weight", 1)]


def test_without_chunk_partials_the_whole_weight_is_compared_whole(runs):
    """The one process recorded with the default params ("all": no chunk partials, which cost a read of each weight
    per chunk dim): the TP=2 run's blocks still sum to the weight's fingerprint, so the planted weight differs and
    every other is equal, as with them; only which rank's block differs cannot be told (no block is named)."""
    root, ranks, whole, _ = runs
    assert not any("ch" in json.loads(x) for x in (root / "one-default-hash" / "params.jsonl").read_text().splitlines())
    r, p = _bisect(root, "tp-plant-hash", "one-default-hash")
    assert r.verdict != "identical"
    assert p["compared"] == len(whole) and p["equal"] == len(whole) - 1 and p["replicas"] == []
    [d] = p["differ"]
    assert d["name"] == "model.embed_tokens.weight" and d["blocks"] == []
    from divtrace.compare.params import param_line

    assert "which rank's block differs is not known" in param_line(p), param_line(p)
    r, p = _bisect(root, "tp-clean-hash", "one-default-hash")
    assert p["compared"] == p["equal"] == len(whole) and p["differ"] == []


def test_replica_differing_on_one_rank_is_a_finding_of_its_run(runs):
    root, ranks, whole, _ = runs
    truth = _blocks_truth(ranks, "replica", whole)
    assert truth == {"model.norm.weight": [1]}
    n0, n1 = ranks[0]["replica"]["model.norm.weight"][0], ranks[1]["replica"]["model.norm.weight"][0]
    assert not torch.equal(n0, n1)  # the truth: rank 1's copy differs from rank 0's
    for mode in ("full", "hash"):
        r, p = _bisect(root, f"tp-replica-{mode}", f"one-{mode}")
        [x] = p["replicas"]
        assert (x["side"], x["name"], x["differ"], x["reference"], x["ranks"]) == ("a", "model.norm.weight", [1], 0,
                                                                                  [0, 1])
        [d] = p["differ"]
        assert d["name"] == "model.norm.weight" and d["ranks"] == [1]
        if mode == "full":
            assert d["mismatched"] == 1 and d["rows"] == [5]
        absorbed = [a for a in r.to_dict()["absorbed"] if a["kind"] == "parameter"]
        assert any("replicas differ" in a["note"] and a["rank"] == 1 for a in absorbed) or r.verdict == "diverged"
        from divtrace.compare.params import param_line

        assert "parameter replicas differ: model.norm.weight in a on rank 1" in param_line(p)


def test_fsdp2_plant_against_one_process(runs):
    root, ranks, whole, _ = runs
    full = ranks[0]["fsdp"]["model.embed_tokens.weight"][0]
    assert torch.equal(full, ranks[1]["fsdp"]["model.embed_tokens.weight"][0])  # all-gathered: one value
    bad = (full != whole["model.embed_tokens.weight"]).any(dim=1).nonzero().reshape(-1).tolist()
    assert bad == [ROW]
    others = [n for n, (t, _) in ranks[0]["fsdp"].items() if n != "model.embed_tokens.weight"
              and not torch.equal(t, whole[n])]
    assert others == []
    for mode in ("full", "hash"):
        r, p = _bisect(root, f"fsdp-plant-{mode}", f"one2-{mode}")
        assert p["how"] == "global" and p["compared"] == len(whole) and p["equal"] == len(whole) - 1, p
        [d] = p["differ"]
        assert d["name"] == "model.embed_tokens.weight" and d["ranks"] == [0, 1]  # each rank's gathered copy
        assert d["layout"]["a"] == "copies on 2 ranks" and d["layout"]["b"] == "whole"
        if mode == "full":
            assert d["rows"] == bad and d["mismatched"] == 1
        # each rank's sequence gives the one process's logits bitwise: the row no token reads is absorbed
        assert r.verdict == "absorbed" and r.exit_code == 4, r.reason
        assert [a["name"] for a in r.to_dict()["absorbed"] if a["kind"] == "parameter"] == [d["name"]]


def test_unread_dtensor_block_of_parallelize_module_is_named(runs):
    """torch's parallelize_module: a DTensor weight no op read is fingerprinted at the block's end with its block's
    layout (params.jsonl `lay`), so it is put together with the other rank's block: rank 1 named, both modes."""
    root, ranks, _, spare = runs
    truth = _blocks_truth(ranks, "spare", spare)
    assert truth == {"spare.weight": [1], "scale": [1]}
    n = len(spare)
    for mode in ("full", "hash"):
        r, p = _bisect(root, f"spare-{mode}", f"spare-one-{mode}")
        assert p["how"] == "global" and p["compared"] == n and p["equal"] == n - 2 and p["why"] is None, p
        d, s = sorted(p["differ"], key=lambda x: x["name"], reverse=True)
        assert d["name"] == "spare.weight" and d["rank"] == 1 and d["read"] == {"a": False, "b": False}
        assert d["blocks"] == [{"side": "a", "rank": 1, "offsets": [16, 0], "block": [16, 16]}]
        assert s["name"] == "scale" and s["ranks"] == [1] and s["layout"]["a"] == "blocks of 2 ranks"
        assert s["read"] == {"a": False, "b": False}
        assert [(x["name"], x["differ"]) for x in p["replicas"]] == [("scale", [1])]
        assert r.verdict != "identical"


def test_replicate_dtensor_differing_within_a_run_is_never_identical(runs):
    """Two recordings of one TP=2 run (hash against full: every value equal rank against rank): the Replicate
    DTensor parameter (no op reads it: its layout from params.jsonl `lay`) whose rank 1 copy differs is a finding of
    each run on its own, so the verdict is absorbed, never identical."""
    root, ranks, _, _ = runs
    assert not torch.equal(ranks[0]["spare"]["scale"][0], ranks[1]["spare"]["scale"][0])  # the truth
    r = divtrace.bisect(str(root / "runs" / "spare-hash"), str(root / "runs" / "spare-full"))
    d = r.to_dict()
    p = d["parameters"]
    assert p["how"] == "ranks" and p["differ"] == [] and p["compared"] == p["equal"]
    assert sorted((x["side"], x["name"], x["differ"], x["reference"]) for x in p["replicas"]) == [
        ("a", "scale", [1], 0), ("b", "scale", [1], 0)]
    assert r.verdict == "absorbed" and r.exit_code == 4, d["reason"]
    assert sum("replicas differ in run" in x["note"] for x in d["absorbed"] if x["kind"] == "parameter") == 2


def test_record_cli_params_option(tmp_path):
    entry = tmp_path / "e.py"
    entry.write_text("import torch\ndef build():\n    torch.manual_seed(0)\n"
                     "    m = torch.nn.Sequential(torch.nn.Embedding(16, 4), torch.nn.Linear(4, 4))\n"
                     "    return m, (torch.tensor([[1, 2, 3]]),)\n")

    def cli(*args):
        p = subprocess.run([sys.executable, "-m", "divtrace", *map(str, args)], capture_output=True, text=True,
                           timeout=300)
        return p.returncode, p.stdout + p.stderr

    assert "--params" in cli("record", "--help")[1]
    for opt in ("all", "read", "none"):
        rc, out = cli("record", f"{entry}:build", "--out", tmp_path / opt, "--mode", "hash", "--params", opt)
        assert rc == 0, out
    lines = {o: [json.loads(x) for x in (tmp_path / o / "params.jsonl").read_text().splitlines()]
             if (tmp_path / o / "params.jsonl").exists() else [] for o in ("all", "read", "none")}
    named = {o: {x["name"] for x in ls if "v" in x or "h" in x} for o, ls in lines.items()}
    assert named["all"] == {"0.weight", "1.weight", "1.bias"} and named["read"] == named["all"]
    assert not any("h" in x for x in lines["read"])  # every weight is read: no unread fingerprint either way
    assert lines["none"] == [] and json.loads((tmp_path / "none" / "meta.json").read_text())["params"] == "none"
    p = divtrace.bisect(str(tmp_path / "none"), str(tmp_path / "all")).to_dict()["parameters"]
    assert p["compared"] == 0 and "params='none'" in p["why"]
    rc, out = cli("record", f"{entry}:build", "--out", tmp_path / "bad", "--params", "some")
    assert rc == 2 and "some" in out


def test_fsdp2_read_weight_planted_origin_names_parameter_and_rank(runs):
    """A weight every token reads, planted in rank 1's FSDP2 shard: the origin's outside input is that parameter,
    named with the rank whose trace holds the copy read (each rank all-gathers it); parameters name both ranks."""
    root, _, _, _ = runs
    r = divtrace.bisect(str(root / "runs" / "fsdp-read-hash"), str(root / "one2-hash"))
    d = r.to_dict()
    assert r.verdict == "diverged" and d["first"]["module"] == "model.layers.0.self_attn.q_proj", d["reason"]
    seg = [s.rank for s in r_view(root).segments if s.ibase <= d["first"]["index"] < s.iend]
    assert f"is parameter model.layers.0.self_attn.q_proj.weight on rank {seg[0]} and differs" in \
        d["first"]["outside_input"]
    # (the embedding row planted before stays planted in this model: both differ, on each rank's gathered copy)
    assert [(x["name"], x["ranks"]) for x in d["parameters"]["differ"]] == [
        ("model.embed_tokens.weight", [0, 1]), ("model.layers.0.self_attn.q_proj.weight", [0, 1])]


def r_view(root):
    from divtrace.align.shards import open_side

    return open_side(str(root / "runs" / "fsdp-read-hash"))


def test_fsdp2_read_weight_planted_first_token_and_its_records_are_one_ranks(runs):
    """Both ranks read the weight planted in rank 1's shard, so both sequences' tokens differ from the one process's
    at the same op. The first token named is the first whose logits row differs (hooks: the lowest position, then
    the lower rank), and the origin's records, its rank_call and the parameter's rank are that token's rank's.
    Before: the token was the lowest by (position, content hash) while the records were another walk's: rank 0's
    token with rank 1's records (index, region, "on rank 1")."""
    root, ranks, _, _ = runs
    one = ranks[0]["one2-hooks"]
    differs = {}  # (position, rank) -> (logits row differs, q_proj input row equal, q_proj output row differs)
    for r, got in enumerate(ranks):
        caps = got["fsdp-read-hooks"]
        for p in range(len(FSDP_IDS[r][0])):
            q = "model.layers.0.self_attn.q_proj"
            row = [(caps[m][i][0, p], one[m][i][r, p]) for m, i in (("lm_head", 1), (q, 0), (q, 1))]
            differs[(p, r)] = (not bits_equal(*row[0]), bits_equal(*row[1]), not bits_equal(*row[2]))
    p, rank = min(k for k, v in differs.items() if v[0])  # the first token whose logits row differs
    assert differs[(p, rank)] == (True, True, True) and rank == 0  # (both ranks differ from position 1 on)
    r = divtrace.bisect(str(root / "runs" / "fsdp-read-hash"), str(root / "one2-hash"))
    d = r.to_dict()
    f = d["first"]
    assert f["module"] == "model.layers.0.self_attn.q_proj" and f["cause"] == "origin", d["reason"]
    tok = f["token"]
    assert (tok["position"], tok["a"]["rank"], tok["a"]["rank_call"]) == (p, rank, 0)
    assert tok["seq"]["first_ids"] == FSDP_IDS[rank][0] and tok["b"]["batch_row"] == rank
    seg = next(s for s in r_view(root).segments if s.rank == rank)
    assert all(seg.ibase <= i < seg.iend for i in [f["index"], *(x["index"] for x in f["region_a"])])
    assert seg.trace.rop[f["index"] - seg.ibase] == "aten.mm.default"  # (the rank's own trace, RUN/rank-R)
    assert f"q_proj.weight on rank {rank} and differs" in f["outside_input"]
    assert d["origins"][0]["token"] == tok and d["origins"][0]["tokens"] == sum(v[0] for v in differs.values())
