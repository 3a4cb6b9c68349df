"""divtrace verify on planted repros (hand-written in the `divtrace repro` layout, see test_verify_fixture.py).

The right fix passes; the unchanged side fails; a fix that is right only at the recorded batch size passes the
recorded inputs and the trials but fails the sweep; a wrong signature is a one-line error; a swept shape the sides
cannot run is SKIPPED and said loudly; the fp64 gate tells an accurate non-bitwise fix from a wrong one.
"""
from __future__ import annotations

import json

import pytest
import torch

from divtrace.cli.app import main
from test_verify_fixture import write_patch, write_repro


@pytest.fixture(scope="module")
def repros(tmp_path_factory):
    d = tmp_path_factory.mktemp("verify")
    return {c: write_repro(d, c) for c in ("rmsnorm_cast", "split_k", "fixed_shape")}


def run_json(capsys, *args):
    capsys.readouterr()
    code = main(["verify", *map(str, args), "--json"])
    return code, json.loads(capsys.readouterr().out)


def by_kind(res, kind):
    return [c for c in res["checks"] if c["kind"] == kind]


@pytest.mark.parametrize("case", ["rmsnorm_cast", "split_k"])
def test_right_fix_passes_every_check(repros, tmp_path, capsys, case):
    patch = write_patch(tmp_path, "rmsnorm_right" if case == "rmsnorm_cast" else "split_k_right")
    code, res = run_json(capsys, repros[case], "--patch", patch, "--side", "b")
    assert code == 0 and res["verdict"] == "passed"
    assert len(by_kind(res, "trial")) == 20  # the default
    sweep = by_kind(res, "sweep")
    assert [c["shapes"]["x"][:2] for c in sweep] == [[1, 16], [2, 16], [5, 16], [2, 31]]
    assert all(c["status"] == "PASSED" for c in res["checks"])
    assert res["profile"] is None and by_kind(res, "reference")


@pytest.mark.parametrize("case,patch", [("rmsnorm_cast", None), ("split_k", None), ("split_k", "split_k_unchanged")])
def test_unchanged_side_fails(repros, tmp_path, capsys, case, patch):
    extra = ["--patch", write_patch(tmp_path, patch), "--side", "b"] if patch else []
    code, res = run_json(capsys, repros[case], *extra, "--trials", "3")
    assert code == 1 and res["verdict"] == "failed"
    rec = by_kind(res, "recorded")[0]
    assert rec["status"] == "FAILED" and rec["mismatched"] > 0 and rec["max_ulp"] >= 1
    assert all(c["status"] == "FAILED" for c in by_kind(res, "trial") + by_kind(res, "sweep"))


def test_summary_counts_only_failures_and_ungated_reference_is_information(repros, tmp_path, capsys):
    """Issue 26 snag 3: `FAILED: verify: 25 check(s) failed (1 recorded, 20 trial, 4 sweep, 4 reference)` while the
    4 reference checks passed; and without --patch, `PASSED: reference ... (not gated)` read as a result."""
    capsys.readouterr()
    assert main(["verify", str(repros["rmsnorm_cast"]), "--trials", "3"]) == 1
    out = capsys.readouterr().out
    lines = [" ".join(x.split()) for x in out.splitlines()]
    assert not any(x.startswith(("PASSED: reference", "FAILED: reference")) for x in lines), out
    assert "info: reference (recorded inputs)" in " ".join(out.split())
    last = " ".join(out.split()).rsplit("FAILED: verify:", 1)[1]
    assert last.strip() == ("8 check(s) failed (1 recorded, 3 trial, 4 sweep); 4 reference not gated "
                            "(information)"), last
    code, res = run_json(capsys, repros["rmsnorm_cast"], "--trials", "3")
    assert {c["status"] for c in by_kind(res, "reference")} == {"INFO"}
    # a patch that fails bitwise but passes the fp64 gate: the reference checks count as passed, not failed
    capsys.readouterr()
    patch = write_patch(tmp_path, "rmsnorm_fp64")
    assert main(["verify", str(repros["rmsnorm_cast"]), "--patch", patch, "--side", "b", "--trials", "2"]) == 1
    last = " ".join(capsys.readouterr().out.split()).rsplit("FAILED: verify:", 1)[1].strip()
    assert last == "7 check(s) failed (1 recorded, 2 trial, 4 sweep); 3 reference passed", last


@pytest.mark.parametrize("case,patch", [("rmsnorm_cast", "rmsnorm_batch_only"), ("split_k", "split_k_batch_only")])
def test_batch_size_only_fix_fails_on_the_sweep(repros, tmp_path, capsys, case, patch):
    code, res = run_json(capsys, repros[case], "--patch", write_patch(tmp_path, patch), "--side", "b", "--trials", "5")
    assert code == 1
    assert by_kind(res, "recorded")[0]["status"] == "PASSED"
    assert all(c["status"] == "PASSED" for c in by_kind(res, "trial"))
    status = {c["shapes"]["x"][0]: c["status"] for c in by_kind(res, "sweep") if c["shapes"]["x"][1] == 16}
    assert status == {1: "FAILED", 2: "PASSED", 5: "FAILED"}


def test_patch_for_side_a(repros, tmp_path, capsys):
    """--side a: the patch replaces side a and must equal side b (here: side b's own split-K code)."""
    code, res = run_json(capsys, repros["split_k"], "--patch", write_patch(tmp_path, "split_k_unchanged"),
                         "--side", "a", "--trials", "3")
    assert code == 0 and res["side"] == "a"
    assert res["checks"][0]["detail"] == "patch bitwise equal to side b"


def test_text_report_is_greppable(repros, tmp_path, capsys):
    capsys.readouterr()
    assert main(["verify", str(repros["split_k"]), "--patch", write_patch(tmp_path, "split_k_batch_only"),
                 "--side", "b", "--trials", "2"]) == 1
    out = capsys.readouterr().out
    assert "bitwise checks" in out and "fp64 reference" in out
    assert "PASSED: recorded inputs: patch bitwise equal to side a" in out
    assert "FAILED: sweep x dim 0 = 1:" in out and "FAILED: sweep x dim 0 = 5 (larger):" in out
    assert "PASSED: trials: 2 of 2 random trials bitwise equal" in out
    assert out.rstrip().splitlines()[-1].startswith("FAILED: verify:")


def test_wrong_signature_is_a_clear_error(repros, tmp_path, capsys):
    patch = write_patch(tmp_path, "rmsnorm_bad_signature")
    capsys.readouterr()
    assert main(["verify", str(repros["rmsnorm_cast"]), "--patch", patch, "--side", "b"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and patch in err
    assert "expected parameters (x, w), got (x, weight)" in err


@pytest.mark.parametrize("args,msg", [
    (["--side", "b"], "--side needs --patch"),
    (["--patch", "nofile.py:fix", "--side", "b"], "nofile.py: no such file"),
    (["--patch", "PATCH", "--side", "c"], "'c' is not one of 'a', 'b'"),
    (["--patch", "PATCH"], "--side a or --side b"),
])
def test_bad_options(repros, tmp_path, capsys, args, msg):
    args = [write_patch(tmp_path, "rmsnorm_right") if a == "PATCH" else a for a in args]
    capsys.readouterr()
    assert main(["verify", str(repros["rmsnorm_cast"]), *args]) == 2
    assert msg in capsys.readouterr().err


def test_not_a_repro_dir(tmp_path, capsys):
    capsys.readouterr()
    assert main(["verify", str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    assert main(["verify"]) == 2


def test_hard_coded_shapes_are_skipped_and_said_loudly(repros, tmp_path, capsys):
    patch = write_patch(tmp_path, "rmsnorm_right")
    code, res = run_json(capsys, repros["fixed_shape"], "--patch", patch, "--side", "b", "--trials", "2")
    assert code == 0
    status = [c["status"] for c in by_kind(res, "sweep")]
    assert status == ["SKIPPED", "PASSED", "SKIPPED", "SKIPPED"]
    assert "cannot run here" in by_kind(res, "sweep")[0]["detail"]
    assert "NOT checked" in res["sweep_warning"]
    capsys.readouterr()
    main(["verify", str(repros["fixed_shape"]), "--patch", patch, "--side", "b", "--trials", "1"])
    cap = capsys.readouterr()
    assert "SKIPPED: sweep x dim 0 = 1:" in cap.out
    # the warning is said once, on stderr, not again on stdout
    assert cap.err.count("warning: shape sweep:") == 1 and "shape sweep: every" not in cap.out


def test_patch_that_breaks_where_the_side_runs_fails(repros, tmp_path, capsys):
    p = tmp_path / "brittle.py"
    p.write_text("import torch\n\n\ndef fix(x, w):\n    x = x.reshape(2, 16, 128)\n"
                 "    return torch.nn.functional.linear(x, w)\n")
    code, res = run_json(capsys, repros["split_k"], "--patch", f"{p}:fix", "--side", "b", "--trials", "1")
    assert code == 1
    s = by_kind(res, "sweep")[0]
    assert s["status"] == "FAILED" and "the patch raised where side b runs" in s["detail"]


def test_fp64_gate_tells_accurate_from_wrong(repros, tmp_path, capsys):
    # one rounding at the end: more accurate than either side, so bitwise different but inside the gate
    code, res = run_json(capsys, repros["rmsnorm_cast"], "--patch", write_patch(tmp_path, "rmsnorm_fp64"),
                         "--side", "b", "--trials", "2")
    assert code == 1 and by_kind(res, "recorded")[0]["status"] == "FAILED"
    ref = by_kind(res, "reference")
    assert ref and all(c["status"] == "PASSED" for c in ref)
    assert all(c["err_patch"] <= min(c["err_a"], c["err_b"]) for c in ref)
    # a plausible wrong fix: 10% off
    p = tmp_path / "wrong.py"
    p.write_text("import torch\n\n\ndef fix(x, w):\n    xf = x.float()\n"
                 "    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)\n"
                 "    return (w * x_hat.to(torch.bfloat16)) * 1.1\n")
    code, res = run_json(capsys, repros["rmsnorm_cast"], "--patch", f"{p}:fix", "--side", "b", "--trials", "2")
    ref = by_kind(res, "reference")
    assert code == 1 and ref and all(c["status"] == "FAILED" for c in ref)
    assert "2 * max(err_a, err_b) + floor" in ref[0]["detail"] and ref[0]["err_patch"] > ref[0]["bound"]
    assert res["reference"]["sides_fp64_agreement"]["same_function"] is True


def test_float64_mode_takes_the_roundings_out():
    from divtrace.verify.reference import Float64Mode

    x = torch.randn(4, 64).to(torch.bfloat16)
    outside = torch.zeros(4, 64, dtype=torch.float32)  # made outside the mode: in-place writes must land
    with Float64Mode():
        y = (x.double().float() * 3).to(torch.bfloat16) / 7
        s = torch.softmax(y, -1, dtype=torch.float32)
        z = torch.zeros(3, dtype=torch.bfloat16)
        outside.add_(x)
    assert y.dtype == s.dtype == z.dtype == torch.float64
    assert torch.equal(y, x.double() * 3 / 7)
    assert torch.equal(outside, x.float())


def test_profile_prints_ratios(repros, tmp_path, capsys):
    capsys.readouterr()
    code = main(["verify", str(repros["split_k"]), "--patch", write_patch(tmp_path, "split_k_right"), "--side", "b",
                 "--trials", "1", "--profile"])
    out = capsys.readouterr().out
    assert code == 0
    assert "% of side b, the side it replaces" in out and "% of side a" in out
    assert "GB/s" in out and "copy bandwidth measured in this run" in out and "top ops" in out
    code, res = run_json(capsys, repros["split_k"], "--patch", write_patch(tmp_path, "split_k_right"), "--side", "b",
                         "--trials", "1", "--profile")
    p = res["profile"]
    assert set(p["candidates"]) == {"side a", "side b", "patch"} and p["timer"] == "perf_counter" and p["threads"] == 1
    assert set(p["kernel"]["candidates"]) == {"side a", "side b", "patch", "side a (again)"}
    assert all(c["kernel_median_s"] > 0 for c in p["candidates"].values()) and p["kernel"]["noise_band_pct"]
    for c in p["candidates"].values():
        assert {"median_s", "iqr_pct", "gb_per_s", "gflop_per_s", "top_ops"} <= set(c) and c["flops"] > 0
        # the profiler table agrees with the median: each op's us/iter is its share of the median, so the
        # listed ops never add up to more than one iteration (the profiler's own figure is kept apart)
        assert c["top_ops"]
        for op in c["top_ops"]:
            assert op["self_us_per_iter"] == pytest.approx(op["share_pct"] / 100 * c["median_s"] * 1e6)
            assert op["profiled_self_us_per_iter"] > 0
        assert sum(op["self_us_per_iter"] for op in c["top_ops"]) <= c["median_s"] * 1e6 * 1.0001


def test_profile_waits_for_the_bitwise_checks(repros, tmp_path, capsys):
    capsys.readouterr()
    assert main(["verify", str(repros["split_k"]), "--trials", "1", "--profile"]) == 1
    assert "not profiled: the bitwise checks FAILED" in capsys.readouterr().out
    assert main(["verify", str(repros["split_k"]), "--trials", "1", "--force-profile"]) == 1
    out = capsys.readouterr().out
    assert "side b kernel throughput: " in out and "% of side a (time per call " in out
    assert "profiled although" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_profile_uses_cuda_events(tmp_path, capsys):
    d = write_repro(tmp_path, "split_k", device="cuda")
    code, res = run_json(capsys, d, "--patch", write_patch(tmp_path, "split_k_right"), "--side", "b", "--trials", "3",
                         "--profile")
    assert code == 0 and res["profile"]["timer"] == "cuda events" and res["profile"]["device"].startswith("cuda")
    code, res = run_json(capsys, d, "--patch", write_patch(tmp_path, "split_k_batch_only"), "--side", "b",
                         "--trials", "3")
    assert code == 1 and any(c["status"] == "FAILED" for c in by_kind(res, "sweep"))
