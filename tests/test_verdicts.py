"""Issue 22, item 1: the verdict rule. "identical" only for complete, fully seen traces whose final outputs were
compared and are equal; "diverged" whenever an origin is found (an incomplete trace said so); "inconclusive"
(exit 3) otherwise, with a reason that names the trace, its status, how far it got and what to do."""
from __future__ import annotations

import json

import pytest
import torch

import divtrace
from divtrace.compare.verdict import (DIVERGED, IDENTICAL, INCONCLUSIVE, WITHIN_TOLERANCE, TraceSeen, decide,
                                      progress)
from helpers import ROOT
from test_trace_fixtures import Tiny, cli, edit_meta, record_tiny, tiny_input


# -- the rule itself (pure) ----------------------------------------------------------------------------------------

def _seen(side, complete=True, status="complete", unseen=(), prog=None):
    return TraceSeen(side, f"runs/{side}", complete, status, None, prog, list(unseen))


def _decide(**kw):
    args = dict(origin_found=False, within_tolerance=False, final_compared=True, final_equal=True,
                a=_seen("a"), b=_seen("b"), calls_compared=10)
    args.update(kw)
    return decide(**args)


def test_rule_identical_only_when_everything_holds():
    v = _decide()
    assert (v.verdict, v.exit_code) == (IDENTICAL, 0) and v.coverage.final_compared and v.coverage.final_equal
    assert v.coverage.to_dict()["calls_compared"] == 10
    for kw, needle in [
        (dict(b=_seen("b", False, "terminated", prog="stopped in root call 1 of 1 after 4 of the reference's 9 "
                                                      "module calls; last module lin")),
         "trace runs/b is incomplete (status: terminated): stopped in root call 1 of 1 after 4"),
        (dict(a=_seen("a", False, "running (never closed)")), "trace runs/a is incomplete (status: running"),
        (dict(a=_seen("a", unseen=["compiled region model.layers without taps"])),
         "runs/a ran computation divtrace did not see (compiled region model.layers without taps)"),
        (dict(final_compared=False, final_equal=None, final_note="b made 2 root calls"),
         "the final outputs were not compared (b made 2 root calls)"),
    ]:
        v = _decide(**kw)
        assert (v.verdict, v.exit_code) == (INCONCLUSIVE, 3), kw
        assert needle in v.reason, v.reason
    # A tolerance keeps exit 0 only under the same conditions.
    assert _decide(within_tolerance=True).verdict == WITHIN_TOLERANCE
    v = _decide(within_tolerance=True, b=_seen("b", False, "error"))
    assert v.verdict == INCONCLUSIVE and v.exit_code == 3
    assert _decide(within_tolerance=True, a=_seen("a", unseen=["cuda graph replays"])).verdict == INCONCLUSIVE


def test_rule_an_origin_is_a_divergence_even_in_an_incomplete_trace():
    v = _decide(origin_found=True, b=_seen("b", False, "interrupted", prog="stopped in root call 2 of 3"))
    assert (v.verdict, v.exit_code) == (DIVERGED, 1)
    assert "the divergence is real" in v.reason and "runs/b is incomplete (status: interrupted)" in v.reason
    v = _decide(origin_found=True, a=_seen("a", unseen=["cuda graph replays"]), final_compared=False)
    assert v.verdict == DIVERGED


def test_verdict_module_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; import divtrace.compare.verdict; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# -- bisect on real traces ------------------------------------------------------------------------------------------

def _llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    return model, ids


class _Stop(RuntimeError):
    pass


def _record_llama(path, mode, stop_at=None, plant=None):
    """Record the tiny Llama; `stop_at` raises inside that layer's forward (the recording stops there), `plant`
    changes one weight of layer 0's input_layernorm before recording (a real divergence)."""
    model, ids = _llama()
    if plant:
        with torch.no_grad():
            model.model.layers[0].input_layernorm.weight[3] += 0.5
    if stop_at is not None:
        def boom(mod, args):
            raise _Stop("stopped on purpose")

        model.model.layers[stop_at].mlp.register_forward_pre_hook(boom)
    try:
        with torch.no_grad(), divtrace.record(model, path, mode=mode):
            model(input_ids=ids, use_cache=False)
    except _Stop:
        pass
    return path


@pytest.fixture(scope="module")
def llama_traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("verdicts")
    return {(name, mode): _record_llama(d / f"{name}-{mode}", mode, **kw)
            for name, kw in (("ref", {}), ("again", {}), ("stopped", {"stop_at": 1}),
                             ("planted_stopped", {"plant": True, "stop_at": 1}))
            for mode in ("full", "hash") if (name, mode) != ("planted_stopped", "hash")}


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_stopped_recording_is_inconclusive_in_both_orders(llama_traces, mode):
    ref, part = llama_traces[("ref", mode)], llama_traces[("stopped", mode)]
    for a, b, side in ((ref, part, "b"), (part, ref, "a")):
        code, out, err = cli("bisect", a, b, "--json")
        r = json.loads(out)
        assert code == 3 and r["verdict"] == "inconclusive" and r["first"] is None, (code, r["verdict"])
        assert f"trace {part} is incomplete (status: error, _Stop: stopped on purpose)" in r["reason"]
        # How far it got: inside the only root call, at layer 1's mlp, and against the reference's call count.
        assert "stopped in root call 1 of 1 after " in r["reason"] and "of the reference's " in r["reason"]
        assert "last module model.layers.1.mlp" in r["reason"] and "re-record it to its end" in r["reason"]
        cov = r["coverage"]
        assert cov["final_compared"] is False and cov["complete"][side] is False and cov["calls_compared"] > 5
        assert cov["only_a" if side == "a" else "only_b"] == 0 and cov["only_b" if side == "a" else "only_a"] > 0
        code, out, err = cli("bisect", a, b)
        assert code == 3 and out.startswith("INCONCLUSIVE: trace ") and "PASSED" not in out, out
        assert "Traceback" not in err


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_complete_identical_pair_still_passes(llama_traces, mode):
    code, out, _ = cli("bisect", llama_traces[("ref", mode)], llama_traces[("again", mode)], "--json")
    r = json.loads(out)
    assert code == 0 and r["verdict"] == "identical" and r["coverage"]["final_compared"] is True
    assert r["coverage"]["final_equal"] is True and r["coverage"]["only_a"] == r["coverage"]["only_b"] == 0
    assert "final outputs were compared" in r["reason"]


def test_origin_in_a_stopped_recording_is_a_divergence(llama_traces):
    ref, part = llama_traces[("ref", "full")], llama_traces[("planted_stopped", "full")]
    code, out, _ = cli("bisect", ref, part, "--json")
    r = json.loads(out)
    assert code == 1 and r["verdict"] == "diverged"
    assert r["first"]["module"] == "model.layers.0.input_layernorm" and r["first"]["cause"] == "origin"
    assert f"trace {part} is incomplete" in r["reason"] and "the divergence is real" in r["reason"]
    code, out, _ = cli("bisect", ref, part)
    assert code == 1 and out.startswith("FAILED: diverged") and "note: the runs diverge" in out


def test_unseen_computation_makes_identical_inconclusive(llama_traces, tmp_path):
    import shutil

    b = shutil.copytree(llama_traces[("again", "hash")], tmp_path / "b")
    edit_meta(b, unseen=["CUDA-graph replays: 3 decode steps"])
    code, out, _ = cli("bisect", llama_traces[("ref", "hash")], b, "--json")
    r = json.loads(out)
    assert code == 3 and r["verdict"] == "inconclusive" and r["coverage"]["unseen"]["b"] == [
        "CUDA-graph replays: 3 decode steps"]
    assert "ran computation divtrace did not see (CUDA-graph replays: 3 decode steps)" in r["reason"]
    # An origin is still an origin.
    code, out, _ = cli("bisect", llama_traces[("planted_stopped", "full")], b, "--json")
    assert code == 1 and json.loads(out)["verdict"] == "diverged"


def test_tolerance_does_not_pass_a_stopped_recording(llama_traces):
    code, out, _ = cli("bisect", llama_traces[("ref", "full")], llama_traces[("stopped", "full")], "--json",
                       "--atol", "1e-3")
    assert code == 3 and json.loads(out)["verdict"] == "inconclusive"


def test_progress_in_words(llama_traces):
    from divtrace.trace.reader import Trace

    ref, part = Trace(llama_traces[("ref", "hash")]), Trace(llama_traces[("stopped", "hash")])
    text = progress(part, ref)
    n_part, n_ref = len(part.calls), len(ref.calls)
    assert text == (f"stopped in root call 1 of 1 after {n_part} of the reference's {n_ref} module calls; last "
                    "module model.layers.1.mlp") and n_part < n_ref


def test_sigkilled_trace_compared_with_itself_is_inconclusive(tmp_path):
    """A trace whose meta.json still says `running` (SIGKILL, or a recording still going) is incomplete: the
    same prefix on both sides is not "identical"."""
    t = record_tiny(tmp_path / "t", mode="hash")
    edit_meta(t, status="running", complete=False, checksums=None, records=None)
    code, out, _ = cli("bisect", t, t, "--json")
    r = json.loads(out)
    assert code == 3 and "status: running" in r["reason"]


def test_repro_without_an_origin_is_refused_with_the_reason(llama_traces, tmp_path):
    code, out, err = cli("repro", llama_traces[("ref", "full")], llama_traces[("stopped", "full")], "--out",
                         tmp_path / "r")
    assert code == 3 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "no divergence found to reproduce" in err and "is incomplete" in err and not (tmp_path / "r").exists()
    code, _, err = cli("repro", llama_traces[("ref", "full")], llama_traces[("again", "full")], "--out",
                       tmp_path / "r")
    assert code == 2 and "nothing to reproduce" in err


def test_repro_of_an_origin_in_a_stopped_recording_warns(llama_traces, tmp_path):
    code, out, err = cli("repro", llama_traces[("ref", "full")], llama_traces[("planted_stopped", "full")],
                         "--out", tmp_path / "r")
    assert code == 0 and (tmp_path / "r" / "repro.py").is_file(), err
    err = " ".join(err.split())  # rich wraps warnings
    assert "is incomplete (status: error)" in err and "the divergence reproduced is real" in err


def test_verify_runs_never_passes_an_inconclusive_pair(tmp_path):
    """verify --runs re-records both sides; when one holds unseen computation the pair cannot pass."""
    from divtrace.verify import end_to_end

    entry = tmp_path / "e.py"
    entry.write_text("import torch\ndef build():\n    torch.manual_seed(0)\n"
                     "    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()), (torch.randn(2, 4),)\n")
    real = end_to_end.record_run

    def record_run(e, args, out, mode, label):
        res = real(e, args, out, mode, label)
        if out.name == "b":  # as a compiled run's trace would say
            edit_meta(out, unseen=["compiled region without taps: <root>"])
        return res

    end_to_end.record_run, saved = record_run, real
    try:
        res = end_to_end.verify_runs(f"{entry}:build", f"{entry}:build", out=tmp_path / "o")
    finally:
        end_to_end.record_run = saved
    traces = next(c for c in res["checks"] if c["name"] == "traces")
    assert res["verdict"] == "failed" and traces["status"] == "FAILED"
    assert traces["detail"].startswith("INCONCLUSIVE: ") and "did not see" in traces["detail"]


def test_json_doc_lists_the_coverage_keys(llama_traces):
    from test_docs_drift import _documented_keys

    code, out, _ = cli("bisect", llama_traces[("ref", "hash")], llama_traces[("again", "hash")], "--json")
    keys = _documented_keys(ROOT / "docs" / "json.md")
    assert set(json.loads(out)["coverage"]) == keys["`coverage`"]


def test_empty_incomplete_trace_says_why(tmp_path):
    """A recording that stopped before its first call reached the disk (a full disk at the start): bisect used to
    ask "was the recorded model called inside the record block?"."""
    ref = record_tiny(tmp_path / "ref", mode="hash")
    part = record_tiny(tmp_path / "part", mode="hash")
    (part / "records.jsonl").write_bytes(b"")
    (part / "checksums.jsonl").write_bytes(b"")
    edit_meta(part, status="error", complete=False, error="write failed: no space left on device", records=0,
              checksums=None)
    code, out, err = cli("bisect", ref, part, "--json")
    r = json.loads(out)
    assert code == 3 and r["verdict"] == "inconclusive" and r["compared"] == 0
    assert "no space left on device" in r["reason"] and "stopped before its first module call" in r["reason"]
    assert "inside the record block" not in out + err
    code, out, err = cli("bisect", ref, part)
    assert code == 3 and out.startswith("INCONCLUSIVE: ") and "nothing compared" in out and "all equal" not in out
    m = Tiny()
    with torch.no_grad():
        m(tiny_input())  # outside the block: a complete trace with no call stays bad input
    with divtrace.record(m, tmp_path / "empty", mode="hash"):
        pass
    code, _, err = cli("bisect", ref, tmp_path / "empty")
    assert code == 2 and "inside the record block" in err
