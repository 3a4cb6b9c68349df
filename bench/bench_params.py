"""What naming and fingerprinting parameters costs a recording (record's `params=`), as ratios in one run.

bench_record.py's model (HF Llama h512 L8, sequence 256, fp32, one thread), hash mode, in interleaved balanced
rounds (bench_record.rounds): the plain forward; ops=True with params="all" (the default there: names, and the
weights no op read fingerprinted at the block's end) and with params="read" (names only); ops=False with
params="read" (the default there: no op is recorded, so nothing is named) and with params="all" (every weight
fingerprinted at the block's end: the upper bound of what "all" costs, as if no op read any weight). Also the time
to fingerprint every weight alone (hash_with_stats, no stats), against the plain forward.

`--no-params` runs the same rounds without passing `params=` (for a divtrace that has no such option: the base
of a before/after comparison, run as its own process).

    python bench/bench_params.py [--repeats 8] [--json out.json] [--small] [--no-params]
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

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_record import build, rounds  # noqa: E402

import divtrace  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--no-params", action="store_true", help="never pass params= (a divtrace without it)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, ids = build(args.small)
    tmp = Path(tempfile.mkdtemp(prefix="divtrace-bench-params-"))

    def plain():
        with torch.no_grad():
            model(ids, use_cache=False)

    def rec(ops, params):
        out = tmp / f"{ops}-{params}"
        kw = {} if params is None else {"params": params}

        def run():
            with torch.no_grad(), divtrace.record(model, out, mode="hash", ops=ops, **kw):
                model(ids, use_cache=False)
        run.setup = lambda: shutil.rmtree(out, ignore_errors=True)
        return run

    if args.no_params:
        fns = {"plain": plain, "hash_ops": rec(True, None), "hash_modules": rec(False, None)}
    else:
        fns = {"plain": plain, "hash_ops (all)": rec(True, "all"), "hash_ops (read)": rec(True, "read"),
               "hash_modules (read)": rec(False, "read"), "hash_modules (all)": rec(False, "all")}
    secs, ratios, ts = rounds(fns, args.repeats, between=plain)
    from divtrace.trace.hashing.tensor import hash_with_stats

    weights = [t.detach() for t in [*model.parameters(), *model.buffers()]]
    hs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for w in weights:
            hash_with_stats(w, stats=False)
        hs.append(time.perf_counter() - t0)
    res = {"ratio_vs_plain": {k: round(v, 3) for k, v in ratios.items()},
           "seconds": {k: round(v, 4) for k, v in secs.items()},
           "round_ratios": {k: sorted(round(t / b, 3) for t, b in zip(v, ts["plain"])) for k, v in ts.items()
                            if k != "plain"},
           "weights_bytes": sum(w.numel() * w.element_size() for w in weights),
           "fingerprint_all_weights_s": round(statistics.median(hs), 4),
           "fingerprint_all_weights_vs_plain": round(statistics.median(hs) / secs["plain"], 3)}
    print(json.dumps(res, indent=1))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
