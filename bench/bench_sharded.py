"""Recording overhead per rank of a tensor-parallel run, against the same forward unrecorded, and the single-process
figures of the same model in the same run (docs/performance.md, "Sharded runs").

Model: bench_record.py's (HF LlamaForCausalLM from config, hidden 512, 8 layers, 8 heads, intermediate 1376, vocab
32000, sequence 256, batch 1, fp32, one thread per process), saved once and loaded with HF's TP plan on 2 gloo
ranks (`from_pretrained(tp_plan="auto")`, needs accelerate). Each rank times plain, hash ops=True, hash ops=False
and full ops=True forwards in bench_record.py's balanced rounds; each ratio is the median over rounds of (time /
that round's plain forward) on that rank. Then one process does the same with the whole model (TP=1). The ranks
run at once on the machine's cores; a collective waits for the slower rank, so a rank's time is the run's. The
same ratios of each process's CPU time (`cpu_ratio_vs_plain`) leave out what a shared machine adds most: waits for
a core, and for the other rank.

    python bench/bench_sharded.py [--repeats 8] [--json out.json] [--small]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]


def _configs(model, ids, tmp: Path, cpu: dict | None = None):
    import torch

    import divtrace

    def settle(p):
        shutil.rmtree(p, ignore_errors=True)
        os.sync()

    def timed(name, fn):  # the process's CPU time of each run too (all its threads: gloo's included)
        def run():
            c0 = time.process_time()
            fn()
            cpu.setdefault(name, []).append(time.process_time() - c0)
        return run if cpu is not None else fn

    def plain():
        with torch.no_grad():
            model(ids, use_cache=False)

    def rec(mode, ops):
        out = tmp / f"{mode}-{ops}"

        def run():
            with torch.no_grad(), divtrace.record(model, out, mode=mode, ops=ops):
                model(ids, use_cache=False)
        run = timed(f"{mode}_{'ops' if ops else 'modules'}", run)
        run.setup = lambda: settle(out)
        return run
    return {"plain": timed("plain", plain), "hash_ops": rec("hash", True), "hash_modules": rec("hash", False),
            "full_ops": rec("full", True)}


def _measure(model, ids, tmp: Path, repeats: int) -> dict:
    from bench_record import rounds

    cpu: dict = {}
    secs, ratios, ts = rounds(_configs(model, ids, tmp, cpu), repeats, between=_configs(model, ids, tmp)["plain"])
    cpu = {k: v[1:] for k, v in cpu.items()}  # (less the warm-up run)
    return {"seconds": {k: round(v, 4) for k, v in secs.items()},
            "ratio_vs_plain": {k: round(v, 3) for k, v in ratios.items()},
            "round_ratios": {k: sorted(round(t / b, 3) for t, b in zip(v, ts["plain"])) for k, v in ts.items()
                             if k != "plain"},
            # CPU time over the same round's plain forward's: what a busy shared machine moves least (time the
            # process waits, for the other rank or for a core, is not in it)
            "cpu_ratio_vs_plain": {k: round(statistics.median(t / b for t, b in zip(v, cpu["plain"])), 3)
                                   for k, v in cpu.items() if k != "plain"}}


def rank_main(rank, world, model_dir, repeats, small):
    import torch
    from transformers import LlamaForCausalLM

    from bench_record import build

    torch.set_num_threads(1)
    model = LlamaForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32).eval()
    _, ids = build(small)
    tmp = Path(tempfile.mkdtemp(prefix=f"divtrace-bench-rank{rank}-"))
    try:
        return _measure(model, ids, tmp, repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="per-rank recording overhead of a TP=2 run, and TP=1 in the same run")
    for flag, kw in (("--repeats", {"type": int, "default": 8}), ("--json", {"type": Path}),
                     ("--small", {"action": "store_true", "help": "tiny model, for a smoke run"})):
        ap.add_argument(flag, **kw)
    args = ap.parse_args(argv)
    import torch

    from bench_record import build
    from dist_harness import run_ranks

    torch.set_num_threads(1)
    model, ids = build(args.small)
    model_dir = tempfile.mkdtemp(prefix="divtrace-bench-model-")
    model.save_pretrained(model_dir)
    res = {"model": "small" if args.small else "llama h512 L8 seq256 fp32", "torch": torch.__version__}
    try:
        ranks = run_ranks(rank_main, 2, model_dir, args.repeats, args.small, timeout_s=600, join_s=7200)
        res["tp2_ranks"] = {str(r): x for r, x in enumerate(ranks)}
        print("TP=2, per rank:", json.dumps({r: x["ratio_vs_plain"] for r, x in res["tp2_ranks"].items()}), flush=True)
        print("TP=2, CPU time:", json.dumps({r: x["cpu_ratio_vs_plain"] for r, x in res["tp2_ranks"].items()}),
              flush=True)
        tmp = Path(tempfile.mkdtemp(prefix="divtrace-bench-single-"))
        res["tp1"] = _measure(model, ids, tmp, args.repeats)
        shutil.rmtree(tmp, ignore_errors=True)
        print("TP=1:", json.dumps(res["tp1"]["ratio_vs_plain"]), "CPU time:", json.dumps(res["tp1"]["cpu_ratio_vs_plain"]),
              flush=True)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
