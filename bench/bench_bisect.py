"""Bisect at scale (issue 2): two synthetic hash traces of >= 100,000 records each that differ only at the very
end (the worst case: everything is compared), bisected in fresh processes through the CLI and the library.

Target: each under 2 s wall and under 500 MB peak RSS (VmHWM of the whole process, imports included).

    python bench/bench_bisect.py [--records 100000] [--repeats 3] [--json out.json] [--keep DIR]

The synthetic model: a root calls N leaf modules in turn; each leaf runs 9 `add` ops (11 records per leaf
call: enter, 9 ops, exit), and the root ends with one more `add` (plus its own enter and exit). Side b's final
add uses another constant, so the two traces are bitwise equal in every record but the last op and the
root's exit. Wall time is measured around the whole child process (interpreter start, imports, reading both
traces, bisect, printing), peak RSS from the child's own /proc/self/status VmHWM at exit.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORDS_PER_LEAF = 11  # enter, 9 ops, exit
ROOT_RECORDS = 3  # the root's enter, its final add, its exit

# Runs as `python -c CODE` in a fresh process: the library call; prints [verdict, module, compared, VmHWM kB].
_LIB = r"""
import json, re, sys
from divtrace.compare.bisect import bisect
r = bisect(sys.argv[1], sys.argv[2])
hwm = int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))
print(json.dumps({"verdict": r.verdict, "module": r.first.module if r.first else None, "compared": r.compared,
                  "op": r.first.op if r.first else None, "torch_imported": "torch" in sys.modules, "hwm_kb": hwm}))
"""

# The CLI, run exactly as `divtrace bisect A B --json` does, plus a VmHWM/torch report on stderr at exit.
_CLI = r"""
import atexit, json, re, sys
def _report():
    hwm = int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))
    sys.stderr.write("\nBENCH " + json.dumps({"hwm_kb": hwm, "torch_imported": "torch" in sys.modules}) + "\n")
atexit.register(_report)
sys.argv = ["divtrace"] + sys.argv[1:]
from divtrace.cli.app import run
run()
"""


def leaves_for(n_records: int) -> int:
    """Leaf calls that make a synthetic trace of at least n_records records."""
    return max(1, -(-(n_records - ROOT_RECORDS) // RECORDS_PER_LEAF))


def build_traces(out: Path, n_records: int) -> tuple[Path, Path]:
    """Record the two synthetic hash traces (>= n_records records each) under `out`."""
    import torch

    import divtrace

    n_leaves = leaves_for(n_records)

    class Leaf(torch.nn.Module):
        def forward(self, x):
            for _ in range(9):
                x = x + 1.0
            return x

    leaves = torch.nn.ModuleList([Leaf() for _ in range(n_leaves)])

    class Root(torch.nn.Module):
        def __init__(self, bump):
            super().__init__()
            self.leaves = leaves
            self.bump = bump

        def forward(self, x):
            for leaf in self.leaves:
                x = leaf(x)
            return x + self.bump

    x = torch.zeros(4)
    paths = []
    for name, bump in (("a", 0.0), ("b", 1.0)):
        p = out / f"synth-{name}"
        shutil.rmtree(p, ignore_errors=True)
        root = Root(bump)
        with torch.no_grad(), divtrace.record(root, p, mode="hash", label=name):
            root(x)
        paths.append(p)
    return paths[0], paths[1]


def count_records(path: Path) -> int:
    with open(path / "records.jsonl", "rb") as f:
        return sum(1 for _ in f)


def run_child(argv: list[str]) -> tuple[float, float, subprocess.CompletedProcess]:
    """(wall seconds, CPU seconds (user + system), the finished process) of one fresh child."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), p


def bench_cli(a: Path, b: Path) -> dict:
    secs, cpu, p = run_child([sys.executable, "-c", _CLI, "bisect", str(a), str(b), "--json"])
    if p.returncode not in (0, 1):
        raise RuntimeError(f"CLI bisect failed (exit {p.returncode}): {p.stderr.strip()[-2000:]}")
    rep = json.loads(p.stderr.rsplit("BENCH ", 1)[1])
    res = json.loads(p.stdout)
    first = res.get("first") or {}
    return {"seconds": secs, "cpu_seconds": cpu, "peak_rss_mb": rep["hwm_kb"] / 1024, "exit": p.returncode,
            "verdict": res["verdict"],
            "module": first.get("module"), "op": first.get("op"), "compared": res["compared"],
            "torch_imported": rep["torch_imported"]}


def bench_lib(a: Path, b: Path) -> dict:
    secs, cpu, p = run_child([sys.executable, "-c", _LIB, str(a), str(b)])
    if p.returncode != 0:
        raise RuntimeError(f"library bisect failed (exit {p.returncode}): {p.stderr.strip()[-2000:]}")
    res = json.loads(p.stdout)
    return {"seconds": secs, "cpu_seconds": cpu, "peak_rss_mb": res.pop("hwm_kb") / 1024, **res}


def summarize(runs: list[dict]) -> dict:
    out = dict(runs[-1])
    secs = [r["seconds"] for r in runs]
    rss = [r["peak_rss_mb"] for r in runs]
    out.update(seconds=statistics.median(secs), seconds_min=min(secs), seconds_max=max(secs),
               cpu_seconds=statistics.median(r["cpu_seconds"] for r in runs), peak_rss_mb=max(rss), runs=len(runs),
               all_seconds=secs)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000, help="at least this many records per trace")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per variant (median time, max RSS)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--keep", type=Path, help="build (or reuse) the traces in this directory and keep them")
    args = ap.parse_args(argv)

    tmp = args.keep or Path(tempfile.mkdtemp(prefix="divtrace-bench-bisect-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        a, b = tmp / "synth-a", tmp / "synth-b"
        t0 = time.perf_counter()
        if not (args.keep and (a / "meta.json").is_file() and (b / "meta.json").is_file()
                and count_records(a) >= args.records):
            a, b = build_traces(tmp, args.records)
        build_s = time.perf_counter() - t0
        n_a, n_b = count_records(a), count_records(b)
        cli = summarize([bench_cli(a, b) for _ in range(args.repeats)])
        lib = summarize([bench_lib(a, b) for _ in range(args.repeats)])
        res = {"records_per_trace": [n_a, n_b], "bytes_per_record": (a / "records.jsonl").stat().st_size / n_a,
               "build_seconds": build_s, "cli": cli, "library": lib,
               "target": {"seconds": 2.0, "peak_rss_mb": 500},
               "met": all(r["seconds"] < 2.0 and r["peak_rss_mb"] < 500 for r in (cli, lib))}
    finally:
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"bisect of two hash traces of {n_a:,} / {n_b:,} records (differ only at the end), "
          f"{args.repeats} fresh processes each")
    print(f"{'':10} {'wall s (median)':>16} {'min-max':>13} {'CPU s':>6} {'peak RSS MB':>12} {'torch':>6}  verdict")
    for name, r in (("CLI --json", cli), ("library", lib)):
        print(f"{name:10} {r['seconds']:16.2f} {r['seconds_min']:6.2f}-{r['seconds_max']:<6.2f} {r['cpu_seconds']:6.2f} "
              f"{r['peak_rss_mb']:12.0f} {'yes' if r['torch_imported'] else 'no':>6}  {r['verdict']} at "
              f"{r['module'] or '<root>'} {r['op']}, {r['compared']} compared")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"(load average {load:.2f} on {os.cpu_count()} cores while measuring; wall time includes interpreter "
          "start and imports)")
    res["load_average"] = load
    print(f"target: under 2 s and under 500 MB each: {'met' if res['met'] else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
