"""The CLI as a user runs it: record ENTRY, show, bisect (--json contract, exit codes, one-line errors)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from divtrace.cli.app import main
from divtrace.trace.records import FORMAT_VERSION
from helpers import EXAMPLE, ROOT, record_model

ENTRY = str(EXAMPLE)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "divtrace", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    for name, extra in (("train", []), ("infer", ["--arg", "variant=sdpa"]), ("same", ["--arg", "variant=none"])):
        entry = f"{ENTRY}:{'training' if name == 'train' else 'inference'}"
        assert main(["record", entry, "--out", str(d / name), "--label", name, *extra]) == 0
    return d


def test_bisect_json_contract(traces, capsys):
    capsys.readouterr()
    assert main(["bisect", str(traces / "train"), str(traces / "infer"), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "diverged" and isinstance(out["compared"], int) and out["compared"] > 0
    first = out["first"]
    for key in ("index", "module", "call", "op", "kind", "cause", "max_abs", "max_ulp", "mismatched", "numel"):
        assert key in first
    assert (first["module"], first["call"], first["kind"], first["cause"]) == ("model.layers.0.self_attn", 0, "op", "origin")
    assert first["op"] == "aten.bmm.default" and first["mismatched"] > 0 and first["max_ulp"] > 0
    assert set(out["final"]) >= {"max_abs_logprob_diff", "kl"} and out["final"]["kl"] > 0


def test_bisect_identical_exit_0(traces, capsys):
    capsys.readouterr()
    assert main(["bisect", str(traces / "train"), str(traces / "same"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "identical" and out["first"] is None and out["final"]["kl"] == 0.0


def test_bisect_rich_report_is_greppable(traces):
    p = run_cli("bisect", traces / "train", traces / "infer")
    assert p.returncode == 1, p.stderr
    assert "FAILED: diverged" in p.stdout and "model.layers.0.self_attn" in p.stdout
    assert "final mismatch" in p.stdout and "next diverging records" in p.stdout
    p = run_cli("bisect", traces / "train", traces / "same")
    assert p.returncode == 0 and "PASSED: identical" in p.stdout


def test_show(traces, capsys):
    capsys.readouterr()
    assert main(["show", str(traces / "train"), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["meta"]["label"] == "train" and s["meta"]["format_version"] == FORMAT_VERSION and s["complete"] is True
    assert s["meta"]["entry"].endswith("llama_pair.py:training") and s["ops"] > 0 and s["stored_bytes"] > 0
    assert {"module": "model.layers.0.self_attn", "class": "Attention", "calls": 1} in s["module_tree"] or any(
        r["module"] == "model.layers.0.self_attn" and r["calls"] == 1 for r in s["module_tree"])
    assert "settings" in s["meta"] and "num_threads" in s["meta"]["settings"]


def _one_line_error(p):
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert len(lines) == 1 and lines[0].startswith("divtrace: error:") and "Traceback" not in p.stderr
    return lines[0]


def test_bad_inputs_one_line_exit_2(traces, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    afile = tmp_path / "file.txt"
    afile.write_text("hello")
    assert "no such trace directory" in _one_line_error(run_cli("bisect", tmp_path / "missing", traces / "train"))
    assert "empty directory" in _one_line_error(run_cli("bisect", empty, traces / "train"))
    assert "is a file" in _one_line_error(run_cli("show", afile))
    assert "ENTRY" in _one_line_error(run_cli("record", "nope.py:f", "--out", tmp_path / "x"))
    assert "already holds a trace" in _one_line_error(run_cli("record", f"{ENTRY}:training", "--out", traces / "train"))


def test_unrelated_models_clear_error(traces, tmp_path):
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    record_model(m, (torch.randn(2, 4),), tmp_path / "other")
    msg = _one_line_error(run_cli("bisect", traces / "train", tmp_path / "other"))
    assert "unrelated models" in msg and "record 0" not in msg


def test_help_has_examples():
    for cmd in ("record", "show", "bisect"):
        p = run_cli(cmd, "--help")
        assert p.returncode == 0 and "Example" in p.stdout and f"divtrace {cmd}" in p.stdout


def test_usage_errors_are_one_line_exit_2():
    """Regression: typer 0.29 bundles its own click, whose usage errors used to surface as 'internal error'."""
    assert "Missing argument" in _one_line_error(run_cli("bisect"))
    assert "No such option" in _one_line_error(run_cli("bisect", "--bogus", "a", "b"))
    p = run_cli()
    assert p.returncode == 0 and "Usage" in p.stdout and "Traceback" not in p.stderr


@pytest.mark.parametrize("durable", [False, True])
def test_record_durable_flag(tmp_path, monkeypatch, durable):
    """`divtrace record --durable` fsyncs the trace at close; without it nothing is fsynced."""
    import os

    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real(fd))
    args = ["record", f"{ENTRY}:training", "--out", str(tmp_path / "t"), "--mode", "hash"]
    assert main(args + (["--durable"] if durable else [])) == 0
    assert (len(synced) >= 4) if durable else synced == []
