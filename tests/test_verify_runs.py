"""verify --runs: re-record the example pair with a fix in place; pass only if the traces are identical, KL exactly 0.

The fixes are the ones in examples/fixes/: rmsnorm_fixed rebinds every RMSNorm instance's forward to the training
cast order; rmsnorm_batch_only does so only at batch 2, so it holds at the example's batch size and not at 3.
"""
from __future__ import annotations

import json


from divtrace.cli.app import main
from helpers import EXAMPLE, ROOT

TRAIN = f"{EXAMPLE}:training"
INFER = f"{EXAMPLE}:inference"
FIXES = ROOT / "examples" / "fixes"


def runs(capsys, *args):
    capsys.readouterr()
    code = main(["verify", "--runs", *map(str, args), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_control_pair_passes(capsys):
    code, res = runs(capsys, TRAIN, INFER, "--arg-b", "variant=none")
    assert code == 0 and res["verdict"] == "passed"
    kinds = {c["name"]: c for c in res["checks"]}
    assert kinds["traces"]["status"] == "PASSED" and kinds["traces"]["compared"] > 100
    assert kinds["final output"]["kl"] == 0.0 and kinds["final output"]["bitwise_equal"]


def test_unfixed_variant_fails_where_bisect_says(capsys):
    code, res = runs(capsys, TRAIN, INFER, "--arg-b", "variant=rmsnorm_cast")
    assert code == 1 and res["verdict"] == "failed"
    traces, final = res["checks"]
    assert traces["status"] == "FAILED" and traces["first"]["module"] == "model.layers.0.input_layernorm"
    assert final["status"] == "FAILED" and final["kl"] > 0


def test_fixed_entry_passes_and_reports_forward_time(tmp_path, capsys):
    base = tmp_path / "unfixed"
    assert main(["record", INFER, "--arg", "variant=rmsnorm_cast", "--mode", "hash", "--out", str(base)]) == 0
    capsys.readouterr()
    code = main(["verify", "--runs", TRAIN, f"{FIXES / 'rmsnorm_fixed.py'}:inference", "--baseline-b", str(base),
                 "--out", str(tmp_path / "e2e")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "PASSED: traces:" in out and "PASSED: final output: bitwise equal, KL 0.0" in out
    assert "forward time, run b:" in out and "fixed/unfixed =" in out
    assert (tmp_path / "e2e" / "a" / "meta.json").exists() and (tmp_path / "e2e" / "b" / "meta.json").exists()


def test_batch_only_fix_fails_at_another_batch_size(capsys):
    entry = f"{FIXES / 'rmsnorm_batch_only.py'}:inference"
    assert runs(capsys, TRAIN, entry)[0] == 0
    code, res = runs(capsys, TRAIN, entry, "--arg-a", "batch=3", "--arg-b", "batch=3")
    assert code == 1 and res["checks"][0]["first"]["module"] == "model.layers.0.input_layernorm"


def test_runs_bad_input(tmp_path, capsys):
    capsys.readouterr()
    assert main(["verify", "--runs", TRAIN, "nofile.py:inference"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["verify", "--arg-a", "x=1"]) == 2
    (tmp_path / "notrace").mkdir()
    assert main(["verify", "--runs", TRAIN, INFER, "--arg-b", "variant=none", "--baseline-b",
                 str(tmp_path / "notrace")]) == 2
