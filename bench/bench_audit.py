"""`divtrace audit` time against the plain forward it audits, as a ratio in one run (issue 19: at most 20x).

Model (as bench_record.py): HF LlamaForCausalLM from config, hidden 512, 8 layers, 8 heads, intermediate 1376,
vocab 32000, sequence 256, batch 1, fp32, SDPA attention, torch.set_num_threads(1). The forward is recorded once
in full mode with ops; the audit (trace opened, every computing op re-run: twice, each row alone, in splits and
padded) is timed against the median plain forward of the same process, measured before and after it, in wall
time and in CPU time (one thread: a shared machine's load inflates the wall times, not the CPU times).

    python bench/bench_audit.py [--small] [--repeats 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import divtrace
from divtrace.audit import audit

sys.path.insert(0, str(Path(__file__).parent))
from bench_record import build  # noqa: E402  (the same bench model)


def forward_seconds(model, ids, repeats: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each plain forward."""
    out = []
    with torch.no_grad():
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            model(input_ids=ids, use_cache=False)
            out.append((time.perf_counter() - t0, time.process_time() - c0))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a tiny model (a smoke run)")
    p.add_argument("--repeats", type=int, default=5, help="plain forwards before and after the audit")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, ids = build(args.small)
    forward_seconds(model, ids, 1)  # warm-up
    before = forward_seconds(model, ids, args.repeats)
    with tempfile.TemporaryDirectory(prefix="divtrace-bench-audit-") as tmp:
        path = Path(tmp) / "trace"
        with torch.no_grad(), divtrace.record(model, path, mode="full", ops=True):
            model(input_ids=ids, use_cache=False)
        t0, c0 = time.perf_counter(), time.process_time()
        r = audit(path)
        audit_s, audit_cpu = time.perf_counter() - t0, time.process_time() - c0
    after = forward_seconds(model, ids, args.repeats)
    plain = statistics.median(w for w, _ in before + after)
    plain_cpu = statistics.median(c for _, c in before + after)
    res = {"model": "small" if args.small else "bench (hidden 512, 8 layers, seq 256, fp32)",
           "plain_forward_s": round(plain, 4), "audit_s": round(audit_s, 3), "ratio": round(audit_s / plain, 2),
           # CPU time (one thread): what a busy shared machine does not inflate
           "plain_forward_cpu_s": round(plain_cpu, 4), "audit_cpu_s": round(audit_cpu, 3),
           "cpu_ratio": round(audit_cpu / plain_cpu, 2),
           "replay_s": round(r.seconds, 3), "headline": r.headline(), "audited": len(r.audited),
           "not_audited": len(r.not_audited), "findings": len(r.findings), "threads": torch.get_num_threads()}
    print(json.dumps(res, indent=2))
    print(f"audit / plain forward: {res['ratio']}x wall, {res['cpu_ratio']}x CPU time (limit 20x)")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
