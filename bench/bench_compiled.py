"""Recording a torch.compile'd model (record(compiled=True): module taps inside the compiled code, hash mode) against
its unrecorded compiled forward, after compilation; the extra compile time is reported on its own.

Model: the one of bench/bench_record.py (HF LlamaForCausalLM from config, hidden 512, 8 layers, 8 heads,
intermediate 1376, vocab 32000, sequence 256, batch 1, fp32), torch.set_num_threads(1).

A recording drops Dynamo's compiled code when it starts and when it ends (the taps go in, then out again), so
recorded and unrecorded forwards cannot alternate call by call without recompiling each time. The run is: the
unrecorded compiled forward (phase A), one recording block holding the recorded forwards (phase B; its first
call compiles the tapped model: the extra compile time), the unrecorded forward again (phase C, recompiled first).
The ratio is median(B) / median(A + C); every timing is kept in the JSON. The recorded logits are checked bitwise
against the unrecorded ones.

    python bench/bench_compiled.py [--repeats 10] [--json out.json] [--small]
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
    c = torch.compile(model)
    res: dict = {"model": "small" if a.small else "llama-512x8-seq256", "repeats": a.repeats}
    with torch.no_grad():
        res["compile_plain_s"] = timed(lambda: c(ids))
        ref = c(ids).logits
        phase_a = [timed(lambda: c(ids)) for _ in range(a.repeats)]
        with tempfile.TemporaryDirectory() as d:
            with divtrace.record(c, Path(d) / "t", mode="hash", compiled=True) as rec:
                out = {}
                res["compile_recorded_s"] = timed(lambda: out.setdefault("x", c(ids).logits))
                phase_b = [timed(lambda: c(ids)) for _ in range(a.repeats)]
            meta = json.loads((Path(d) / "t" / "meta.json").read_text())
        res["recorded_equals_unrecorded"] = bool(torch.equal(out["x"], ref))
        res["compile_after_s"] = timed(lambda: c(ids))
        phase_c = [timed(lambda: c(ids)) for _ in range(a.repeats)]
    plain = statistics.median(phase_a + phase_c)
    res.update({"plain_forward_s": plain, "recorded_forward_s": statistics.median(phase_b),
                "ratio": statistics.median(phase_b) / plain,
                "extra_compile_s": res["compile_recorded_s"] - res["compile_plain_s"],
                "phase_a": phase_a, "phase_b": phase_b, "phase_c": phase_c,
                "taps_run": meta["compiled"]["taps_run"], "graphs": meta["compiled"].get("graphs_compiled"),
                "graph_breaks": len(meta["compiled"].get("graph_breaks") or []), "unseen": meta["unseen"],
                "recorder_warnings": rec.warnings})
    print(f"compiled forward {plain * 1e3:.1f} ms; recorded (module taps, hash) {res['recorded_forward_s'] * 1e3:.1f} ms "
          f"= {res['ratio']:.3f}x; compile {res['compile_plain_s']:.1f} s plain, {res['compile_recorded_s']:.1f} s "
          f"with taps; recorded logits bitwise equal: {res['recorded_equals_unrecorded']}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
