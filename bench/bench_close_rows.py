"""Thread-CPU ms per recorded forward inside two parts of a rank's `record(mode="hash", ops=True)`: the trace
writer's close (TraceWriter.close: record lines, layout lines, token files, checksums, meta.json) and the token rows
(TokenRows.rows, the sharded rows of placements included), on both ranks of bench_rank_ops.py's TP=2 run and on
TP=1. Only these two entry points are timed (outermost calls), so no per-record or per-value wrapper inflates them
as bench_rank_ops.py --profile 1's split does; the whole recorded forward's thread CPU is given beside them.

    python bench/bench_close_rows.py [--forwards 8] [--small] [--no-tp1]

Compare trees by running it with PYTHONPATH=TREE for each, alternated in the same minutes.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]


def _timed(parts: dict) -> None:
    from divtrace.record.token_rows import TokenRows
    from divtrace.trace.writer import TraceWriter

    for cls, name, label in ((TraceWriter, "close", "close"), (TokenRows, "rows", "token rows")):
        f = getattr(cls, name)

        def g(*a, _f=f, _label=label, **k):
            if parts["depth"]:
                return _f(*a, **k)
            parts["depth"] = 1
            t0 = time.thread_time()
            try:
                return _f(*a, **k)
            finally:
                parts[_label] += time.thread_time() - t0
                parts["depth"] = 0
        setattr(cls, name, g)


def _measure(model, ids, forwards: int) -> dict:
    import torch

    import divtrace

    tmp = Path(tempfile.mkdtemp(prefix="divtrace-close-rows-"))
    parts = {"close": 0.0, "token rows": 0.0, "depth": 0}
    _timed(parts)

    def rec():
        shutil.rmtree(tmp / "t", ignore_errors=True)
        with torch.no_grad(), divtrace.record(model, tmp / "t", mode="hash", ops=True):
            model(ids, use_cache=False)

    try:
        rec(), rec()  # warm-up
        out: dict = {"close": [], "token rows": [], "whole recorded forward": []}
        for _ in range(forwards):
            c0, r0, t0 = parts["close"], parts["token rows"], time.thread_time()
            rec()
            out["whole recorded forward"].append(time.thread_time() - t0)
            out["close"].append(parts["close"] - c0)
            out["token rows"].append(parts["token rows"] - r0)
        return {k: {"median": round(1e3 * statistics.median(v), 2), "min": round(1e3 * min(v), 2),
                    "max": round(1e3 * max(v), 2)} for k, v in out.items()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def rank_main(rank, world, model_dir, forwards):
    import torch
    from transformers import LlamaForCausalLM

    from bench_record import build

    torch.set_num_threads(1)
    model = LlamaForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32).eval()
    _, ids = build(small=model.config.num_hidden_layers == 2)
    return _measure(model, ids, forwards)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forwards", type=int, default=8)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--no-tp1", action="store_true")
    args = ap.parse_args(argv)
    import torch

    from bench_record import build
    from dist_harness import run_ranks

    torch.set_num_threads(1)
    model, ids = build(args.small)
    res: dict = {}
    model_dir = tempfile.mkdtemp(prefix="divtrace-close-rows-model-")
    model.save_pretrained(model_dir)
    try:
        ranks = run_ranks(rank_main, 2, model_dir, args.forwards, timeout_s=600, join_s=3600)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    for r, x in enumerate(ranks):
        res[f"rank{r}"] = x
    if not args.no_tp1:
        res["tp1"] = _measure(model, ids, args.forwards)
    for k, x in res.items():
        print(k, json.dumps(x))
    return 0


if __name__ == "__main__":
    sys.exit(main())
