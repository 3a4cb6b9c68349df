"""Recording a torch.compile'd model (record(compiled=True): module taps inside the compiled code, hash mode) against
its unrecorded compiled forward, after compilation; the extra compile time is reported on its own.

Model: the one of bench/bench_record.py (HF LlamaForCausalLM from config, hidden 512, 8 layers, 8 heads,
intermediate 1376, vocab 32000, sequence 256, batch 1, fp32), torch.set_num_threads(1).

A recording drops Dynamo's compiled code when it starts (the taps go in) and when it ends, so the unrecorded
baseline is a second compiled copy of the same model (a deep copy: same weights, no hooks, so no taps in its
graph), run inside the same recording block: both compile there (the tapped one's extra compile time is the
difference of their first calls), then each round runs the two forwards, in alternating order, and the ratio is
the median over rounds of recorded / unrecorded, so a slow spell of the shared machine hits both. Every timing is
kept in the JSON. The recorded logits are checked bitwise against the copy's unrecorded ones.

    python bench/bench_compiled.py [--repeats 10] [--json out.json] [--small]
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import divtrace  # noqa: E402
from bench_record import build  # noqa: E402


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, ids = build(a.small)
    twin = copy.deepcopy(model)
    c, plain = torch.compile(model), torch.compile(twin)
    res: dict = {"model": "small" if a.small else "llama-512x8-seq256", "repeats": a.repeats}
    rounds = []
    with torch.no_grad(), tempfile.TemporaryDirectory() as d:
        with divtrace.record(c, Path(d) / "t", mode="hash", compiled=True) as rec:
            res["compile_plain_s"] = timed(lambda: plain(ids))
            out = {}
            res["compile_recorded_s"] = timed(lambda: out.setdefault("x", c(ids).logits))
            ref = plain(ids).logits
            for r in range(a.repeats):
                if r % 2:
                    tr, tp = timed(lambda: c(ids)), timed(lambda: plain(ids))
                else:
                    tp, tr = timed(lambda: plain(ids)), timed(lambda: c(ids))
                rounds.append({"plain": tp, "recorded": tr, "ratio": tr / tp})
        meta = json.loads((Path(d) / "t" / "meta.json").read_text())
    res["recorded_equals_unrecorded"] = bool(torch.equal(out["x"], ref))
    plain_s = statistics.median(x["plain"] for x in rounds)
    res.update({"plain_forward_s": plain_s, "recorded_forward_s": statistics.median(x["recorded"] for x in rounds),
                "ratio": statistics.median(x["ratio"] for x in rounds),
                "extra_compile_s": res["compile_recorded_s"] - res["compile_plain_s"], "rounds": rounds,
                "taps_run": meta["compiled"]["taps_run"], "graphs": meta["compiled"].get("graphs_compiled"),
                "graph_breaks": len(meta["compiled"].get("graph_breaks") or []), "unseen": meta["unseen"],
                "recorder_warnings": rec.warnings})
    plain = plain_s
    print(f"compiled forward {plain * 1e3:.1f} ms; recorded (module taps, hash) {res['recorded_forward_s'] * 1e3:.1f} ms "
          f"= {res['ratio']:.3f}x; compile {res['compile_plain_s']:.1f} s plain, {res['compile_recorded_s']:.1f} s "
          f"with taps; recorded logits bitwise equal: {res['recorded_equals_unrecorded']}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
