"""verify on repros that `divtrace repro` really generated from the example pair (rmsnorm_cast, split_k), with the
patches in examples/fixes/: the right fix passes, the unchanged side fails, the batch-size-only fix fails on the
sweep (batch 1 and the larger size) while passing the recorded inputs and the trials, and --profile prints ratios.
"""
from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("divtrace.cli.repro_cmd", reason="divtrace repro is not built yet")

from divtrace.cli.app import main  # noqa: E402
from helpers import ROOT, record_pair  # noqa: E402

FIXES = ROOT / "examples" / "fixes"
PATCH_FILE = {"rmsnorm_cast": FIXES / "rmsnorm_cast_patch.py", "split_k": FIXES / "split_k_patch.py"}


@pytest.fixture(scope="module", params=["rmsnorm_cast", "split_k"])
def generated(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"gen-{request.param}")
    a, b = record_pair(d, request.param)
    out = d / "repro"
    assert main(["repro", str(a), str(b), "--out", str(out)]) == 0
    return out, PATCH_FILE[request.param]


def _run(capsys, *args):
    capsys.readouterr()
    code = main(["verify", *map(str, args), "--json"])
    captured = capsys.readouterr()
    assert code != 2, captured.err  # a signature drift between generator and examples/fixes lands here
    return code, json.loads(captured.out)


def test_generated_repro_still_differs(generated, capsys):
    code, res = _run(capsys, generated[0], "--trials", "3")
    assert code == 1 and res["checks"][0]["status"] == "FAILED"


def test_right_fix_passes(generated, capsys):
    repro, fixes = generated
    code, res = _run(capsys, repro, "--patch", f"{fixes}:side_b", "--side", "b")
    assert code == 0, [c for c in res["checks"] if c["status"] == "FAILED"]
    assert sum(c["kind"] == "trial" and c["status"] == "PASSED" for c in res["checks"]) == 20
    # batch 1, recorded, larger all ran (the generated code keeps the batch symbolic)
    assert [c["status"] for c in res["checks"] if c["kind"] == "sweep"][:3] == ["PASSED"] * 3


def test_batch_size_only_fix_fails_on_the_sweep(generated, capsys):
    repro, fixes = generated
    code, res = _run(capsys, repro, "--patch", f"{fixes}:side_b_batch_only", "--side", "b", "--trials", "5")
    assert code == 1
    assert res["checks"][0]["status"] == "PASSED"
    assert all(c["status"] == "PASSED" for c in res["checks"] if c["kind"] == "trial")
    sweep = [c for c in res["checks"] if c["kind"] == "sweep"]
    assert [c["status"] for c in sweep[:3]] == ["FAILED", "PASSED", "FAILED"]


def test_profile_prints_ratios(generated, capsys):
    repro, fixes = generated
    capsys.readouterr()
    assert main(["verify", str(repro), "--patch", f"{fixes}:side_b", "--side", "b", "--trials", "1",
                 "--profile"]) == 0
    out = capsys.readouterr().out
    assert "patch throughput: " in out and "% of side b (the side it replaces)" in out and "% of side a" in out
    # throughput and time per call, and they agree (time = 1 / throughput)
    m = re.search(r"patch throughput: (\d+)% of side b \(the side it replaces\), (\d+)% of side a; "
                  r"time per call: ([\d.]+)x side b, ([\d.]+)x side a", out)
    assert m, out[-1500:]
    assert float(m.group(3)) == pytest.approx(100 / int(m.group(1)), rel=0.02, abs=0.01)
