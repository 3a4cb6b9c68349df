"""Run the docs' examples as other machines would, and say which documented figures change.

A fresh clone on another machine must pass the docs-drift tests: its CPU (the ISA torch's kernels dispatch to), its
thread count and whether divtrace's C extensions were built change the rounding order of reductions, so some
figures the docs show differ there (tests/docs_output.py lists which may). This machine can play several:

    this machine           torch's defaults here
    ATEN_CPU_CAPABILITY=default, =avx2   torch's CPU kernels without AVX-512 / without any vector ISA
    OMP_NUM_THREADS=1, =2  one and two intra-op threads
    no C extensions        divtrace._native, _index and _rows absent (tests/sim_no_c_extensions.py)

For each, the docs' example blocks run (tests/test_docs_drift.py -k example_blocks_run, which must pass) with
DIVTRACE_DRIFT_DUMP set, and the rollout example (examples/rollout_vs_trainer.py, fp32, not run by the suite) is
recorded and bisected, and so is every planted variant (examples/llama_pair.py bf16, the rollout's bf16 plants).
The report lists, per configuration, every documented figure that came out different, and every planted variant
whose verdict, module or op differs from the first configuration's.

    python scripts/simulate_machines.py [--only NAME ...] [--json report.json] [--check]   (about 2 minutes per configuration)

It exits 1 when the drift tests fail under a configuration; with --check (a stage of .ci/run) also when a planted
variant's verdict, module or ops differ from the first configuration's, or a planted run fails. The unplanted
rollout's origin is the machine's own kernels and may differ (docs/numbers.md): reported, never checked.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import docs_output  # noqa: E402

CONFIGS = {
    "this machine": ({}, []),
    "ATEN_CPU_CAPABILITY=default": ({"ATEN_CPU_CAPABILITY": "default"}, []),
    "ATEN_CPU_CAPABILITY=avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, []),
    "1 thread": ({"OMP_NUM_THREADS": "1"}, []),
    "2 threads": ({"OMP_NUM_THREADS": "2"}, []),
    "no C extensions": ({"PYTHONPATH": str(ROOT / "tests")}, ["-p", "sim_no_c_extensions"]),
}


def _changed_figures(dump: dict) -> list[str]:
    """Every machine-dependent figure of one output block that came out other than the doc shows it."""
    out = []
    where = f"{dump['doc']}:{dump['line']}"
    if dump["lang"] == "json":
        shown = json.loads("\n".join(dump["shown"]))

        def walk(s, r, path):
            if path.lstrip(".") in docs_output.MACHINE_DEPENDENT_JSON:
                if s != r:
                    out.append(f"{where} {path.lstrip('.')}: {s!r} -> {r!r}")
            elif isinstance(s, dict) and isinstance(r, dict):
                for k in s:
                    walk(s[k], r.get(k), f"{path}.{k}")
        walk(shown, dump["json"] or {}, "")
        return out
    real = [docs_output.normal(x) for x in dump["printed"].splitlines()]
    for line in dump["shown"]:
        n = docs_output.normal(line)
        pat = docs_output.shape(n)
        if pat is None or n in real:
            continue
        got = next((r for r in real if pat.fullmatch(r)), None)
        out.append(f"{where} [{docs_output.figures(n)[0].what}]: {n!r} -> {got!r}")
    return out


def _rollout(env: dict, pre: list[str]) -> dict:
    """The README's rollout example (fp32) under this configuration: bisect's verdict and figures."""
    with tempfile.TemporaryDirectory() as d:
        py = [sys.executable, *(["-c", "import sim_no_c_extensions, runpy, sys; sys.argv = sys.argv[1:]; "
                                       "runpy.run_path(sys.argv[0], run_name='__main__')"] if pre else [])]
        subprocess.run([*py, str(ROOT / "examples" / "rollout_vs_trainer.py"), "--out", f"{d}/rl"], env=env,
                       check=True, capture_output=True, timeout=600)
        code = ("import sys, json; sys.argv = ['divtrace', 'bisect', sys.argv[1] + '/train', sys.argv[1] + "
                "'/rollout', '--json']; " + ("import sim_no_c_extensions; " if pre else "")
                + "from divtrace.cli.app import main; sys.exit(main(sys.argv[1:]))")
        p = subprocess.run([sys.executable, "-c", code, f"{d}/rl"], env=env, capture_output=True, text=True,
                           timeout=600)
    r = json.loads(p.stdout)
    f, fin = r.get("first") or {}, r.get("final") or {}
    return {"exit": p.returncode, "verdict": r["verdict"], "module": f.get("module"), "op": f.get("op"),
            "mismatched": f.get("mismatched"), "numel": f.get("numel"), "rows": f.get("rows"),
            "batch_cause": bool(f.get("batch_invariance")), "differing_tokens": r.get("tokens", {}).get("differing"),
            "max_abs_logprob_diff": fin.get("max_abs_logprob_diff"), "kl": fin.get("kl")}


PLANTED = r"""
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1] + "/tests")
sys.path.insert(0, sys.argv[1] + "/examples")
from helpers import record_pair
import divtrace
import rollout_vs_trainer as rl
out = {}
with tempfile.TemporaryDirectory() as d:
    for v in ("rmsnorm_cast", "fp32_residual", "rope_fused", "sdpa", "silu_fused", "split_k", "rope_cache",
              "lm_head_bf16_logsoftmax", "all"):
        a, b = record_pair(Path(d) / v, v, mode="hash")
        f = divtrace.bisect(a, b).to_dict()
        out["llama_pair " + v] = [f["verdict"], (f["first"] or {}).get("module"), (f["first"] or {}).get("op"),
                                  (f["first"] or {}).get("op_b")]
    for v in ("rmsnorm_cast", "split_k_decode"):
        rl.main(["--out", f"{d}/rl-{v}", "--dtype", "bf16", "--variant", v])
        f = divtrace.bisect(f"{d}/rl-{v}/train", f"{d}/rl-{v}/rollout").to_dict()
        out["rollout " + v] = [f["verdict"], f["first"].get("module"), f["first"].get("op"),
                               bool(f["first"].get("batch_invariance"))]
print(json.dumps(out))
"""


def _planted(env: dict, pre: list[str]) -> dict:
    """Each planted variant (llama_pair bf16, the rollout's bf16 plants): bisect's verdict, module and ops."""
    code = ("import sim_no_c_extensions\n" if pre else "") + PLANTED
    p = subprocess.run([sys.executable, "-c", code, str(ROOT)], env=env, capture_output=True, text=True,
                       timeout=1800)
    if p.returncode:
        return {"error": p.stderr[-2000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def run(name: str, out: Path) -> dict:
    extra_env, args = CONFIGS[name]
    env = dict(os.environ, **extra_env)
    if "PYTHONPATH" in extra_env and os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = extra_env["PYTHONPATH"] + os.pathsep + os.environ["PYTHONPATH"]
    dump = out / re.sub(r"\W+", "_", name)
    env["DIVTRACE_DRIFT_DUMP"] = str(dump)
    probe = ("import torch; " + ("import sim_no_c_extensions; " if args else "")
             + "import divtrace.trace.fingerprint as f; print(torch.backends.cpu.get_cpu_capability(), "
               "torch.get_num_threads(), f.IMPLEMENTATION)")
    cap, threads, impl = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                                        check=True).stdout.split()
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args,
                        "tests/test_docs_drift.py", "-k", "example_blocks_run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1800)
    changed = [c for f in sorted(dump.glob("*.json")) for c in _changed_figures(json.loads(f.read_text()))]
    return {"config": name, "cpu_capability": cap, "threads": int(threads), "fingerprint": impl,
            "drift_tests_pass": p.returncode == 0, "pytest_tail": p.stdout.strip().splitlines()[-1:],
            "doc_figures_changed": changed, "rollout": _rollout(env, args), "planted": _planted(env, args)}


def failures(report: list[dict], check: bool) -> list[str]:
    """What fails the run: drift tests that fail; with check, a planted run that failed or a planted variant whose
    verdict, module or ops differ from the first configuration's (that one is the reference)."""
    out = [f"{r['config']}: drift tests fail" for r in report if not r["drift_tests_pass"]]
    if check and report:
        base = report[0]["planted"]
        for r in report:
            if "error" in r["planted"]:
                out.append(f"{r['config']}: planted variants did not run: {r['planted']['error'][-300:]}")
                continue
            for k in sorted(set(base) | set(r["planted"])):
                if r["planted"].get(k) != base.get(k):
                    out.append(f"{r['config']}: planted {k}: {r['planted'].get(k)} "
                               f"(first configuration: {base.get(k)})")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", choices=list(CONFIGS), help="configurations to run (default: all)")
    ap.add_argument("--json", type=Path, help="write the report here")
    ap.add_argument("--check", action="store_true",
                    help="also fail when a planted variant's verdict, module or ops differ from the first configuration's")
    a = ap.parse_args(argv)
    report = []
    with tempfile.TemporaryDirectory() as d:
        for name in a.only or CONFIGS:
            r = run(name, Path(d))
            report.append(r)
            print(f"== {name}: cpu {r['cpu_capability']}, {r['threads']} thread(s), fingerprints {r['fingerprint']}; "
                  f"drift tests {'PASS' if r['drift_tests_pass'] else 'FAIL'} {r['pytest_tail']}")
            for c in r["doc_figures_changed"]:
                print(f"   changed: {c}")
            print(f"   rollout (fp32): {r['rollout']}")
            base = report[0]["planted"]
            for k, v in r["planted"].items():
                if r is report[0] or v != base.get(k):
                    print(f"   planted {k}: {v}" + ("" if r is report[0] else f" (first configuration: {base.get(k)})"))
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    failed = failures(report, a.check)
    for f in failed:
        print(f"FAILED: {f}")
    if not failed:
        print(f"PASSED: {len(report)} configuration(s): drift tests pass"
              + (", every planted variant gives the first configuration's verdict, module and ops" if a.check else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
