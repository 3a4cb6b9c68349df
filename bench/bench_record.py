"""Recording overhead, full-mode write throughput, bisect scale and bytes per record, as ratios in one run.

Model (issue 2): HF LlamaForCausalLM from config, hidden 512, 8 layers, 8 heads, intermediate 1376,
vocab 32000, sequence 256, batch 1, fp32, torch.set_num_threads(1). Baseline: PyTorch DebugMode with bitwise
tensor hashes (torch.hash_tensor) on the same forward.

    python bench/bench_record.py [--repeats 5] [--json out.json] [--small] [--no-bisect]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import divtrace


def build(small: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if small:
        cfg = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4)
        seq = 64
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=8)
        seq = 256
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1))
    return model, ids


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--small", action="store_true", help="tiny model, for a smoke run")
    ap.add_argument("--no-bisect", action="store_true", help="skip the 100k-record bisect benchmark")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, ids = build(args.small)
    tmp = Path(tempfile.mkdtemp(prefix="divtrace-bench-"))
    res: dict = {"model": "small" if args.small else "llama h512 L8 seq256 fp32", "torch": torch.__version__}

    def plain():
        with torch.no_grad():
            model(ids, use_cache=False)

    def debug_mode():
        from torch.utils._debug_mode import DebugMode

        with torch.no_grad(), DebugMode() as dm, DebugMode.log_tensor_hashes(hash_fn="hash_tensor"):
            model(ids, use_cache=False)
        return dm

    def rec(mode, ops):
        def run():
            out = tmp / f"{mode}-{ops}"
            shutil.rmtree(out, ignore_errors=True)
            with torch.no_grad(), divtrace.record(model, out, mode=mode, ops=ops):
                model(ids, use_cache=False)
        return run

    t_plain = timed(plain, args.repeats)
    t_dbg = timed(debug_mode, args.repeats)
    t_hash_ops = timed(rec("hash", True), args.repeats)
    t_hash_mod = timed(rec("hash", False), args.repeats)
    t_full = timed(rec("full", True), max(1, args.repeats // 2))
    res["seconds"] = {"plain": t_plain, "debug_mode_hash": t_dbg, "hash_ops": t_hash_ops, "hash_modules": t_hash_mod,
                      "full_ops": t_full}
    res["ratio_vs_plain"] = {k: v / t_plain for k, v in res["seconds"].items()}
    print(json.dumps(res["ratio_vs_plain"]), flush=True)

    # Bytes per record in hash mode.
    from divtrace.trace.reader import Trace

    th = Trace(tmp / "hash-True")
    rec_bytes = (tmp / "hash-True" / "records.jsonl").stat().st_size
    res["hash_records"] = len(th.records)
    res["hash_bytes_per_record"] = rec_bytes / max(1, len(th.records))

    # Full-mode write throughput vs safetensors.save_file of the same tensors.
    from safetensors.torch import save_file

    tf = Trace(tmp / "full-True")
    blobs = {}
    for vid, v in tf.values.items():
        if v.blob and v.blob not in blobs:
            blobs[v.blob] = tf.tensor(vid).reshape(-1).clone()
    nbytes = sum(t.numel() * t.element_size() for t in blobs.values())
    t_save = timed(lambda: save_file(blobs, str(tmp / "ref.safetensors")), max(1, args.repeats // 2))
    # divtrace's cost of the same bytes = full recording minus hash recording (the forward and hashing are in both)
    t_write = max(t_full - t_hash_ops, 1e-9)
    res["full_mode"] = {"unique_bytes": nbytes, "safetensors_save_s": t_save, "divtrace_extra_s": t_write,
                        "throughput_vs_safetensors": t_save / t_write}

    # Bisect scale: two synthetic 100k-record hash traces (a 4-deep module tree, 10 ops per call).
    if not args.no_bisect:
        res["bisect_100k"] = bench_bisect(tmp, 100_000)
    shutil.rmtree(tmp, ignore_errors=True)
    txt = json.dumps(res, indent=2)
    print(txt)
    if args.json:
        args.json.write_text(txt + "\n")
    return 0


class _Leaf(torch.nn.Module):
    def forward(self, x):
        for _ in range(9):
            x = x + 1.0
        return x


def bench_bisect(tmp: Path, n_records: int) -> dict:
    """Record two synthetic runs of ~n_records records each, differing only at the very end."""
    n_calls = n_records // 12
    leaves = torch.nn.ModuleList([_Leaf() for _ in range(n_calls)])

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
    for name, bump in (("a", 0.0), ("b", 1.0)):
        root = Root(bump)
        with torch.no_grad(), divtrace.record(root, tmp / f"synth-{name}", mode="hash"):
            root(x)
    import subprocess

    # Peak memory from /proc (VmHWM, in kB): ru_maxrss survives exec and would report this process's peak.
    code = ("import json,re,time,sys;import divtrace.compare.bisect as b;"
            "hwm=lambda: int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1));"
            "m0=hwm();t=time.perf_counter();"
            "r=b.bisect(sys.argv[1],sys.argv[2]);"
            "print(json.dumps([time.perf_counter()-t, hwm(), m0, "
            "r.verdict, r.first.module if r.first else None, r.compared]))")
    p = subprocess.run([sys.executable, "-c", code, str(tmp / "synth-a"), str(tmp / "synth-b")], capture_output=True,
                       text=True, check=True)
    secs, rss, rss0, verdict, module, compared = json.loads(p.stdout)
    from divtrace.trace.reader import Trace

    n = len(Trace(tmp / "synth-a").records)
    return {"records_per_trace": n, "seconds": float(secs), "max_rss_mb": int(rss) / 1024,
            "rss_after_import_mb": int(rss0) / 1024, "bisect_rss_growth_mb": (int(rss) - int(rss0)) / 1024,
            "verdict": verdict, "first_module": module,
            "bytes_per_record": (tmp / "synth-a" / "records.jsonl").stat().st_size / n}


if __name__ == "__main__":
    sys.exit(main())
