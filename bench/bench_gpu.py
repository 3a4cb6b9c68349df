"""Recording on a GPU (issue 31): the cost of divtrace.record against the plain run, as ratios in one run.

Model: a 0.5B-class HF LlamaForCausalLM from config (no download): hidden 2048, intermediate 5632, 8 layers,
16 heads (4 KV heads), vocab 32000, bf16, SDPA. Two workloads:
- forward: a batch of 4 x 1024 tokens;
- rollout: HF generate of 8 sequences (prompts of 128 tokens) x 64 new tokens, greedy (prefill + KV-cache decode).
Configurations: plain; hash ops=False; hash ops=False tokens=False; hash ops=True; full ops=False (forward only);
and the host path before issue 31 (every value read back where it is met, `device_path(False)`) for hash
ops=False, as the baseline the issue measured. Each configuration runs `--rounds` times in interleaved rounds;
its figure is the FASTEST round, timed from before the `with` block to after it (the trace closed: the writer
thread drained) with the device synchronized at both ends. Full mode also reports the bytes staged, the time the
recording thread waited for staging, and the machine's pinned device-to-host bandwidth measured in the same run
(a 1 GiB copy into pinned memory), against which the recording's copy rate is set.

    python bench/bench_gpu.py [--rounds 6] [--json out.json] [--small]    (needs a CUDA GPU)
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import divtrace
from divtrace.record.device import device_path


SIZES = {  # LlamaConfig fields
    "0.5B": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                 num_attention_heads=16, num_key_value_heads=4),
    "small": dict(vocab_size=1024, hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
}


def build(size: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SIZES[size])
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval(), cfg


def pinned_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-host bytes/s into pinned memory (best of 3)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return nbytes / best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--rollout-rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--small", action="store_true", help="a small model, for a smoke run")
    ap.add_argument("--skip-host-path", action="store_true", help="leave out the slow pre-issue-31 baseline")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    model, cfg = build("small" if args.small else "0.5B")
    g = torch.Generator("cuda").manual_seed(1)
    fwd_ids = torch.randint(1, cfg.vocab_size, (4, 1024), device="cuda", generator=g)
    prompts = torch.randint(1, cfg.vocab_size, (8, 128), device="cuda", generator=g)
    tmp = Path(tempfile.mkdtemp(prefix="divtrace-bench-gpu-"))

    def fwd():
        model(input_ids=fwd_ids, attention_mask=torch.ones_like(fwd_ids))

    def rollout():
        model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=64, min_new_tokens=64,
                       do_sample=False, pad_token_id=0)

    figures: dict = {}

    def timed(name, body, rec=None, host_path=False):
        path = tmp / name
        shutil.rmtree(path, ignore_errors=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            if rec is None:
                body()
            elif host_path:
                with device_path(False), divtrace.record(model, path, **rec):
                    body()
            else:
                with divtrace.record(model, path, **rec):
                    body()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        meta = json.loads((path / "meta.json").read_text()) if rec is not None else {}
        return dt, meta

    configs = {
        "plain": None,
        "hash ops=False": dict(mode="hash", ops=False),
        "hash ops=False tokens=False": dict(mode="hash", ops=False, tokens=False),
        "hash ops=True": dict(mode="hash", ops=True),
    }
    for workload, body, rounds, extra in (("forward 4x1024", fwd, args.rounds, True),
                                          ("rollout 8x64", rollout, args.rollout_rounds, False)):
        runs = dict(configs)
        if extra:
            runs["full ops=False"] = dict(mode="full", ops=False)
        if not extra:
            runs.pop("hash ops=False tokens=False")
        timed("warmup", body)
        for name, rec in runs.items():  # (one untimed run each: kernels and allocator warm, first-use costs paid)
            if rec is not None:
                timed("warmup", body, rec)
        best: dict = {}
        metas: dict = {}
        for r in range(rounds):
            names = list(runs)
            names = names[r % len(names):] + names[:r % len(names)]  # a rotating order
            for name in names:
                dt, meta = timed(name.replace(" ", "_"), body, runs[name])
                if dt < best.get(name, float("inf")):
                    best[name], metas[name] = dt, meta
        if not args.skip_host_path:  # the path before issue 31: one round (it is slow)
            dt, meta = timed("host_path", body, dict(mode="hash", ops=False), host_path=True)
            best["host path (before), hash ops=False"], metas["host path (before), hash ops=False"] = dt, meta
        plain = best["plain"]
        rows = {}
        for name, dt in best.items():
            row = {"seconds": round(dt, 5), "ratio": round(dt / plain, 3)}
            dp = metas.get(name, {}).get("device_path")
            if dp:
                row["device_path"] = dp
            if metas.get(name):
                row["records"] = metas[name].get("records")
            rows[name] = row
        figures[workload] = rows
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
    bw = pinned_bandwidth()
    full = figures["forward 4x1024"].get("full ops=False")
    if full and "device_path" in full:
        extra_s = full["seconds"] - figures["forward 4x1024"]["plain"]["seconds"]
        staged = full["device_path"].get("bytes_staged", 0)
        full["copy_rate_bytes_per_s"] = round(staged / extra_s) if extra_s > 0 else None
        full["pinned_bandwidth_bytes_per_s"] = round(bw)
        full["copy_rate_of_pinned_bandwidth"] = round(staged / extra_s / bw, 3) if extra_s > 0 else None
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "small": args.small,
           "rounds": args.rounds, "rollout_rounds": args.rollout_rounds, "pinned_d2h_GBps": round(bw / 1e9, 2),
           "figures": figures}
    print(json.dumps(out, indent=1))
    for workload, rows in figures.items():
        print(f"\n| {workload} | " + " | ".join(rows) + " |\n|---|" + "---|" * len(rows))
        print("| | " + " | ".join(f"{r['seconds'] * 1e3:.1f} ms ({r['ratio']}x)" for r in rows.values()) + " |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
