"""CPU microseconds a recorded op costs: a module whose forward runs many tiny ops (the per-op bookkeeping, not the
kernels, is what is timed): adds, muls, views of parameters (`w.t()`, `view`), a matmul, in hash mode with
ops=True, against the same forward unrecorded.

    python bench/bench_op_cost.py [--ops 400] [--rounds 9] [--loop N (for a sampling profiler)]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=400, help="loop iterations of the forward (5 ops each)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--loop", type=int, default=0)
    ap.add_argument("--gc", action="store_true", help="leave the garbage collector on (off by default: its "
                    "collections land wherever an allocation crosses a threshold, and a big heap makes them long)")
    args = ap.parse_args(argv)
    import torch

    import divtrace

    torch.set_num_threads(1)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 16))
            self.b = torch.nn.Parameter(torch.randn(16))

        def forward(self, x):
            for _ in range(args.ops):
                wt = self.w.t()                       # a view of a parameter, met every forward
                x = torch.nn.functional.linear(x, self.w, self.b) * 0.5
                x = x @ wt.view(16, 16)
                x = x + 1.0
            return x

    m = M().eval()
    x = torch.randn(2, 16)
    tmp = Path(tempfile.mkdtemp(prefix="divtrace-opcost-"))

    def plain():
        with torch.no_grad():
            m(x)

    def rec():
        shutil.rmtree(tmp / "t", ignore_errors=True)
        with torch.no_grad(), divtrace.record(m, tmp / "t", mode="hash", ops=True, tokens=False):
            m(x)

    import gc

    if not args.gc:
        gc.disable()
    try:
        plain(), rec()
        if args.loop:
            for _ in range(args.loop):
                rec()
            return 0
        t: dict = {"plain": [], "rec": []}
        for r in range(args.rounds):
            for name, fn in ((("plain", plain), ("rec", rec)) if r % 2 == 0 else (("rec", rec), ("plain", plain))):
                c0 = time.process_time()
                fn()
                t[name].append(time.process_time() - c0)
        from divtrace.trace.reader import Trace

        from divtrace.trace.records import OpRecord

        n_ops = sum(1 for r in Trace(tmp / "t").records if isinstance(r, OpRecord))
        per = [1e6 * (a - b) for a, b in zip(t["rec"], t["plain"])]
        n = n_ops
        print(f"ops recorded {n_ops}; plain {1e3 * statistics.median(t['plain']):.1f} ms, recorded "
              f"{1e3 * statistics.median(t['rec']):.1f} ms; per op {statistics.median(per) / n:.1f} us "
              f"({min(per) / n:.1f}-{max(per) / n:.1f})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
