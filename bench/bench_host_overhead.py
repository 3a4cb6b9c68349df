"""Host time of recording per module call and per op (issue 31's bookkeeping targets), on the CPU, for the CPU
path and for the device path's code run on the CPU (`device_path(True)`, the accelerators' torch ops).

A Llama small enough that its compute is negligible (hidden 32, 4 layers, 8 tokens, one thread), called `--calls`
times in one recorded block, so what a recording adds is the recorder's own host time: per module call,
(hash ops=False - plain) / module calls; per op, (hash ops=True - hash ops=False) / ops recorded. Opening and
closing the trace (an empty block, timed in the same rounds) is taken off both. The configurations run interleaved, `--rounds` times, and each
figure is the median over rounds. On the device path the figure includes the device ops it enqueues: each costs
the host a dispatch here, a launch on a GPU (their count per recorded value is reported beside it).

    python bench/bench_host_overhead.py [--rounds 30] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import divtrace
from divtrace.record.device import device_path

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from fp2_cases import torch_path  # noqa: E402  (the C kernels hidden: the accelerators' torch ops)


def build():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval(), torch.randint(1, 64, (1, 8), generator=torch.Generator().manual_seed(1))


class _CountBusyOps(TorchDispatchMode):
    """Counts the aten ops divtrace itself runs (inside its bookkeeping), below divtrace's own mode."""

    def __init__(self):
        super().__init__()
        from divtrace.record.lifecycle import STATE

        self.state, self.ops = STATE, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.state.busy:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=10, help="forwards per recorded block")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, ids = build()
    tmp = Path(tempfile.mkdtemp(prefix="divtrace-bench-host-"))

    def run(path=None, dev=None, calls=None, **rec):
        calls = args.calls if calls is None else calls
        if path is None:
            with torch.no_grad():
                for _ in range(calls):
                    model(input_ids=ids)
            return
        shutil.rmtree(path, ignore_errors=True)
        ops = torch_path(False) if dev else contextlib.nullcontext()
        with ops, torch.no_grad(), device_path(dev), divtrace.record(model, path, **rec):
            for _ in range(calls):
                model(input_ids=ids)

    configs = {"plain": {}, "empty block": dict(mode="hash", ops=False, calls=0)}
    for dev, name in ((None, "cpu path"), (True, "device path")):
        configs[f"{name}, hash ops=False"] = dict(dev=dev, mode="hash", ops=False)
        configs[f"{name}, hash ops=True"] = dict(dev=dev, mode="hash", ops=True)
    times: dict = {k: [] for k in configs}
    for name, kw in configs.items():  # warm up
        run(tmp / "w" if kw else None, **kw)
    for r in range(args.rounds):
        names = list(configs)
        for name in names[r % len(names):] + names[:r % len(names)]:
            kw = configs[name]
            t0 = time.perf_counter()
            run(tmp / "t" if kw else None, **kw)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    counts = {}
    for dev, name in ((None, "cpu path"), (True, "device path")):
        for ops in (False, True):
            counter = _CountBusyOps()
            with counter:
                run(tmp / "c", dev=dev, mode="hash", ops=ops, calls=1)
            lines = [json.loads(x) for x in (tmp / "c" / "records.jsonl").read_text().splitlines()]
            counts[(name, ops)] = dict(calls=sum(r["k"] == "e" for r in lines), ops=sum(r["k"] == "o" for r in lines),
                                       values=sum(len(r.get("V", ())) for r in lines), busy_ops=counter.ops)
    out = {"calls per block": args.calls, "plain_ms": round(med["plain"] * 1e3, 3),
           "empty_block_ms": round(med["empty block"] * 1e3, 3), "paths": {}}
    k = args.calls
    for name in ("cpu path", "device path"):
        m0, m1 = med[f"{name}, hash ops=False"], med[f"{name}, hash ops=True"]
        c0, c1 = counts[(name, False)], counts[(name, True)]
        out["paths"][name] = {
            "hash ops=False ms": round(m0 * 1e3, 3), "hash ops=True ms": round(m1 * 1e3, 3),
            "us per module call": round((m0 - med["empty block"] - med["plain"]) / (k * c0["calls"]) * 1e6, 1),
            "us per op": round((m1 - m0) / (k * c1["ops"]) * 1e6, 1),
            "module calls": c0["calls"], "ops": c1["ops"], "values ops=False": c0["values"],
            "values ops=True": c1["values"],
            "device ops per value (ops=False)": round(c0["busy_ops"] / max(c0["values"], 1), 1),
            "device ops per value (ops=True)": round(c1["busy_ops"] / max(c1["values"], 1), 1)}
    shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(out, indent=1)
    if args.json:
        args.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
