"""Parameters compared by name: a weight that differs where no output of this batch reads it is never "identical".

Regression: two runs whose embedding differed in a row no token of the batch looks up (the RL weight-sync bug that
bites at the next step) bisected as `PASSED: identical` (exit 0) under both alignments: parameters are op inputs
from outside, never compared, and the trace did not say which value was which parameter. Now each trace names them
(params.jsonl) and bisect compares them by name (`parameters` in the JSON, a `parameters differ:` line): absorbed
(exit 4) where every output is equal, listed beside the origin where the runs diverged, never a difference where
names do not pair (a fused qkv_proj against q/k/v). Every truth here is computed with torch on the two models.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import divtrace

sys.path.insert(0, str(Path(__file__).parent))
import token_cases as tc  # noqa: E402

pytest.importorskip("transformers")

IDS = torch.tensor([[5, 9, 3, 7, 12, 11, 4, 20]])


def _cli(*args):
    p = subprocess.run([sys.executable, "-m", "divtrace", *map(str, args)], capture_output=True, text=True,
                       timeout=300)
    return p.returncode, p.stdout, p.stderr


def _named(m) -> dict:
    """name -> tensor of every parameter and buffer, as torch names them."""
    return {**dict(m.named_parameters()), **dict(m.named_buffers())}


def _differing(ma, mb) -> list[str]:
    na, nb = _named(ma), _named(mb)
    return sorted(n for n in na.keys() & nb.keys() if not torch.equal(na[n], nb[n]))


def _pair(seed_b_change=None, layers: int = 2):
    a = tc.llama(layers=layers)
    b = tc.llama(layers=layers)
    if seed_b_change is not None:
        with torch.no_grad():
            seed_b_change(b)
    return a, b


def _record(m, path, mode, ids=IDS, **kw):
    with torch.no_grad(), divtrace.record(m, path, mode=mode, **kw):
        return m(ids).logits


def _row_unread(b, row=50):
    b.model.embed_tokens.weight[row, 3] += 1.0


# -- 1. a weight no output reads: absorbed, named ----------------------------------------------------------------
@pytest.mark.parametrize("mode", ["full", "hash"])
def test_an_embedding_row_no_token_reads_is_absorbed_by_calls(tmp_path, mode):
    a, b = _pair(_row_unread)
    assert 50 not in IDS.tolist()[0]
    la, lb = _record(a, tmp_path / "a", mode), _record(b, tmp_path / "b", mode)
    truth = _differing(a, b)
    assert truth == ["model.embed_tokens.weight"] and torch.equal(la, lb)  # the outputs are bitwise equal

    r = divtrace.bisect(tmp_path / "a", tmp_path / "b", align="calls")
    d = r.to_dict()
    assert r.verdict == "absorbed" and r.exit_code == 4 and r.first is None, d["reason"]
    p = d["parameters"]
    assert [x["name"] for x in p["differ"]] == truth
    assert p["compared"] == len(_named(a)) and p["not_compared"] == 0 and p["why"] is None
    mism = int((a.model.embed_tokens.weight != b.model.embed_tokens.weight).sum())
    assert p["differ"][0]["mismatched"] == (mism if mode == "full" else None)
    assert [x["name"] for x in d["absorbed"] if x["kind"] == "parameter"] == truth
    rc, out, err = _cli("bisect", tmp_path / "a", tmp_path / "b", "--align", "calls")
    assert rc == 4, out + err
    assert "PASSED: final outputs identical; 1 internal difference(s) absorbed" in out
    assert "parameters differ: 1 of" in out and "model.embed_tokens.weight" in out
    rc, out, _ = _cli("bisect", tmp_path / "a", tmp_path / "b", "--json")
    assert rc == 4 and json.loads(out)["parameters"]["differ"][0]["name"] == truth[0]


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_an_embedding_row_no_token_reads_is_absorbed_by_tokens(tmp_path, mode):
    """A rollout (generate, KV cache) against a trainer's recompute whose embedding differs in a row that no token
    of any sequence is: absorbed under token alignment too."""
    import engine_model as em

    a = tc.llama()
    with em.batch_invariant(a):  # (each row alone, in one order: the two batchings give the same bits)
        seqs = tc.rollout(a, tmp_path / "a", tc.prompts(), mode=mode)
    row = next(i for i in range(3, tc.VOCAB) if all(i not in s for s in seqs))
    b = tc.llama()
    with torch.no_grad():
        b.model.embed_tokens.weight[row, 0] += 1.0
    with em.batch_invariant(b):
        tc.trainer(b, tmp_path / "b", seqs, mode=mode)
    truth = _differing(a, b)
    assert truth == ["model.embed_tokens.weight"]

    r = divtrace.bisect(tmp_path / "a", tmp_path / "b", align="tokens")
    d = r.to_dict()
    assert d["alignment"] == "tokens" and r.verdict == "absorbed" and r.exit_code == 4, d["reason"]
    assert d["tokens"]["final_differing"] == 0 and d["tokens"]["final_compared"] > 0
    assert [x["name"] for x in d["parameters"]["differ"]] == truth
    assert [x["name"] for x in d["absorbed"] if x["kind"] == "parameter"] == truth
    rc, out, err = _cli("bisect", tmp_path / "a", tmp_path / "b", "--align", "tokens")
    assert rc == 4 and "parameters differ: 1 of" in out and truth[0] in out, out + err


# -- 2. a weight that reaches the output: the origin stays the walk's, the parameter is listed ------------------
@pytest.mark.parametrize("mode", ["full", "hash"])
def test_a_nudged_linear_weight_diverges_at_the_same_origin_and_is_listed(tmp_path, mode, monkeypatch):
    def nudge(b):
        b.model.layers[1].mlp.down_proj.weight[0, 0] += 0.5

    a, b = _pair(nudge)
    la, lb = _record(a, tmp_path / "a", mode), _record(b, tmp_path / "b", mode)
    truth = _differing(a, b)
    assert truth == ["model.layers.1.mlp.down_proj.weight"] and not torch.equal(la, lb)

    r = divtrace.bisect(tmp_path / "a", tmp_path / "b", align="calls")
    d = r.to_dict()
    assert r.verdict == "diverged" and r.exit_code == 1
    assert r.first.module == "model.layers.1.mlp.down_proj" and r.first.cause == "origin"
    assert [x["name"] for x in d["parameters"]["differ"]] == truth
    assert not [x for x in d["absorbed"] if x["kind"] == "parameter"]
    # the input that differs is named as the parameter it is (the weight the origin's `t` reads), by calls and by
    # tokens; a value from outside with no name keeps the general words
    assert f"is parameter {truth[0]} and differs" in d["first"]["outside_input"], d["first"]["outside_input"]
    tok = divtrace.bisect(tmp_path / "a", tmp_path / "b", align="tokens").to_dict()["first"]
    assert f"is parameter {truth[0]} and differs" in tok["outside_input"], tok["outside_input"]
    # the same bisect without parameter comparison names the same origin, op and tensor
    import divtrace.compare.bisect as bis

    monkeypatch.setattr(bis, "compare_parameters", lambda *a, **k: {"differ": []})
    plain = divtrace.bisect(tmp_path / "a", tmp_path / "b", align="calls").to_dict()["first"]
    assert {k: d["first"][k] for k in ("module", "call", "op", "op_b", "index", "tensor", "cause")} == \
        {k: plain[k] for k in ("module", "call", "op", "op_b", "index", "tensor", "cause")}
    monkeypatch.undo()
    rc, out, err = _cli("bisect", tmp_path / "a", tmp_path / "b", "--align", "calls")
    assert rc == 1 and out.startswith("FAILED: diverged") and f"parameters differ: 1 of" in out and truth[0] in out


# -- 3. nothing planted: identical, every parameter compared -----------------------------------------------------
@pytest.mark.parametrize("align", ["calls", "tokens"])
def test_no_plant_is_identical_with_every_parameter_compared(tmp_path, align):
    a, b = _pair()
    _record(a, tmp_path / "a", "hash")
    _record(b, tmp_path / "b", "hash")
    assert _differing(a, b) == []
    r = divtrace.bisect(tmp_path / "a", tmp_path / "b", align=align)
    p = r.to_dict()["parameters"]
    assert r.verdict == "identical" and r.exit_code == 0, r.reason
    assert p["compared"] == p["equal"] == len(_named(a)) and p["differ"] == [] and p["not_compared"] == 0
    rc, out, _ = _cli("bisect", tmp_path / "a", tmp_path / "b", "--align", align)
    assert rc == 0 and "parameters" not in out  # (nothing to say: no line)


def test_params_read_names_only_what_ops_read(tmp_path):
    """params="read": the weights no op read (HF's unused original_inv_freq buffer) are not in the trace."""
    a, b = _pair()
    _record(a, tmp_path / "a", "hash", params="read")
    _record(b, tmp_path / "b", "hash", params="read")
    p = divtrace.bisect(tmp_path / "a", tmp_path / "b").to_dict()["parameters"]
    assert p["compared"] == len(_named(a)) - 1 and p["differ"] == []
    with pytest.raises(divtrace.DivtraceError, match="params must be"):
        divtrace.record(a, tmp_path / "c", params="some")


# -- 4. an old trace without names -------------------------------------------------------------------------------
def _strip_names(trace: Path) -> None:
    """Make a trace look as divtrace wrote it before parameters were named: no params.jsonl, not in meta.json."""
    meta = json.loads((trace / "meta.json").read_text())
    meta["file_checksums"].pop("params.jsonl")
    (trace / "meta.json").write_text(json.dumps(meta))
    (trace / "params.jsonl").unlink()


def test_an_old_trace_without_names_is_identical_and_says_parameters_were_not_compared(tmp_path):
    a, b = _pair()
    _record(a, tmp_path / "a", "hash")
    _record(b, tmp_path / "b", "hash")
    _strip_names(tmp_path / "b")
    r = divtrace.bisect(tmp_path / "a", tmp_path / "b")
    p = r.to_dict()["parameters"]
    assert r.verdict == "identical" and p["compared"] == 0 and p["differ"] == []
    assert p["not_compared"] == len(_named(a)) and "a trace holds no parameter names" in p["why"]
    rc, out, _ = _cli("bisect", tmp_path / "a", tmp_path / "b")
    assert rc == 0 and "parameters not compared: a trace holds no parameter names" in out


def test_a_damaged_names_file_is_bad_input(tmp_path):
    a, b = _pair()
    _record(a, tmp_path / "a", "hash")
    _record(b, tmp_path / "b", "hash")
    f = tmp_path / "b" / "params.jsonl"
    f.write_bytes(f.read_bytes().replace(b"embed_tokens", b"embed_tokenz", 1))
    rc, _, err = _cli("bisect", tmp_path / "a", tmp_path / "b")
    assert rc == 2 and "params.jsonl" in err and "do not match" in err
    rc, out, _ = _cli("show", tmp_path / "b", "--check")
    assert rc == 1 and "params.jsonl" in out


# -- 5. a vLLM-style engine (fused qkv_proj, gate_up_proj) against HF ---------------------------------------------
def test_fused_projections_against_hf_are_not_compared_never_different(tmp_path):
    import engine_model as em
    import origin_cases as oc

    ps = tc.prompts()
    hf = oc.llama()
    with em.batch_invariant(hf):
        eng = oc.engine(hf, tmp_path / "engine", ps, mode="hash")
        oc.trainer(hf, tmp_path / "train", eng.seqs, mode="hash")
    engine = em.Engine.from_hf(hf)
    na, nb = _named(hf), _named(engine)
    both = {n for n in na.keys() & nb.keys() if na[n].shape == nb[n].shape and na[n].dtype == nb[n].dtype}
    assert any("qkv_proj" in n for n in nb) and not any("qkv_proj" in n for n in na)
    assert all(torch.equal(na[n], nb[n]) for n in both)  # the weights the engine shares with HF, by name, are HF's

    from divtrace.align.paths import PathMap

    r = divtrace.bisect(tmp_path / "train", tmp_path / "engine",
                        path_map=PathMap.from_file(Path(__file__).parent / "maps" / "engine-hf.yaml"))
    d = r.to_dict()
    p = d["parameters"]
    assert p["differ"] == [] and not [x for x in d["absorbed"] if x["kind"] == "parameter"]
    assert p["compared"] == len(both) and p["only_a"] == len(na.keys() - nb.keys())
    assert p["only_b"] == len(nb.keys() - na.keys()) and p["not_compared"] > 0 and "only in a" in p["why"]
    assert r.verdict != "diverged"


# -- the recorder: unread weights, replaced parameters, tied weights ----------------------------------------------
class Experts(torch.nn.Module):
    """Two experts; every token is routed to expert 0 (an MoE expert no token of the batch reaches: expert 1)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 4)
        self.head_tied = self.head  # (one module, two paths: its weight is named once)

    def forward(self, x):
        return self.head(self.experts[0](x))


@pytest.mark.parametrize("params,verdict", [(None, "absorbed"), ("all", "absorbed"), ("read", "identical")])
def test_an_unrouted_expert_is_compared_where_unread_weights_are_fingerprinted(tmp_path, params, verdict):
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    ma, mb = Experts().eval(), Experts().eval()
    with torch.no_grad():
        mb.experts[1].weight[0, 0] += 1.0
    for m, side in ((ma, "a"), (mb, "b")):
        with torch.no_grad(), divtrace.record(m, tmp_path / side, mode="full", params=params):
            m(x)
    truth = _differing(ma, mb)
    assert truth == ["experts.1.weight"]
    r = divtrace.bisect(tmp_path / "a", tmp_path / "b")
    p = r.to_dict()["parameters"]
    assert r.verdict == verdict, r.reason
    if verdict == "absorbed":
        assert [x["name"] for x in p["differ"]] == truth and p["differ"][0]["read"] == {"a": False, "b": False}
        assert p["differ"][0]["mismatched"] is None  # (no bytes of a weight no op read: its fingerprint only)
        assert p["compared"] == len(_named(ma))
    else:
        assert p["compared"] == 4 and p["differ"] == []  # experts.0 and head: what the ops read
    names = [json.loads(line)["name"] for line in (tmp_path / "a" / "params.jsonl").read_text().splitlines()]
    assert "head_tied.weight" not in names and len(names) == len(set(names))


def test_unread_weights_on_a_device_are_read_back_once_with_the_kernels_fingerprints(tmp_path, monkeypatch):
    """Unread weights on a device are fingerprinted by torch ops there and read to the host in one go (one wait for
    the device at the block's end, not one per parameter): forced here on CPU tensors, the lines hold the same
    fingerprints as the C kernel's, and the hexes are read once."""
    from divtrace.record import param_names
    from divtrace.trace.hashing import tensor as hashing_tensor

    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    m = Experts().eval()
    for side in ("host", "device"):
        if side == "device":
            reads = []
            real = hashing_tensor.hexes
            monkeypatch.setattr(param_names, "_read_on_host", lambda t: False)
            monkeypatch.setattr(hashing_tensor, "hexes", lambda fps: reads.append(len(fps)) or real(fps))
        with torch.no_grad(), divtrace.record(m, tmp_path / side, mode="hash", params="blocks"):
            m(x)
    lines = {s: [json.loads(x) for x in (tmp_path / s / "params.jsonl").read_text().splitlines()]
             for s in ("host", "device")}
    unread = [d for d in lines["device"] if "h" in d]
    chunks = sum(len(c[1]) for d in lines["device"] if "ch" in d for c in d["ch"])  # (hash mode: chunk partials,
    assert len(unread) >= 2 and chunks and reads == [len(unread) + chunks]  # in the same one read)
    assert lines["device"] == lines["host"]


def test_a_parameter_replaced_inside_the_block_is_named(tmp_path):
    """A parameter replaced between two calls (`module.weight = nn.Parameter(...)`, a weight sync) is a new tensor
    the name map did not hold: it is named all the same, and its two values compare in recording order."""
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    for side, delta in (("a", 0.0), ("b", 1.0)):
        m = Experts().eval()
        with torch.no_grad(), divtrace.record(m, tmp_path / side, mode="hash"):
            m(x)
            m.head.weight = torch.nn.Parameter(m.head.weight.detach() + delta, requires_grad=False)
            m(x)
    lines = [json.loads(s) for s in (tmp_path / "b" / "params.jsonl").read_text().splitlines()]
    assert [d["name"] for d in lines if "v" in d].count("head.weight") == 2
    r = divtrace.bisect(tmp_path / "a", tmp_path / "b", align="calls")
    assert r.verdict == "diverged"  # (the second call's output differs)
    (p,) = r.to_dict()["parameters"]["differ"]
    assert p["name"] == "head.weight" and p["value"] == 1


def test_a_killed_recording_keeps_the_names_its_checkpoints_vouch_for(tmp_path):
    """The names are written with the records under the same checksums: a recording killed mid-forward (os._exit,
    no close) leaves names that a reader cuts back to what the checkpoints vouch for, each naming a recorded value."""
    script = f"""
import os, sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
import divtrace, token_cases as tc
m = tc.llama()
m.model.layers[1].register_forward_hook(lambda *a: os._exit(0))
with torch.no_grad(), divtrace.record(m, {str(tmp_path / "k")!r}, mode="hash", flush_records=3):
    m(torch.tensor([[5, 9, 3, 7]]))
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    from divtrace.trace.param_names import read_param_names
    from divtrace.trace.reader import Trace

    t = Trace(tmp_path / "k")
    names = read_param_names(t)
    assert not t.complete and names is not None
    assert "model.layers.0.self_attn.q_proj.weight" in names.values and "lm_head.weight" not in names.values
    assert all(v.vid in t.vkey for vals in names.values.values() for v in vals)
