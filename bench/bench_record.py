"""Recording overhead, full-mode write throughput and bytes per record, as ratios in one run.

Model (issue 2): HF LlamaForCausalLM from config, hidden 512, 8 layers, 8 heads, intermediate 1376,
vocab 32000, sequence 256, batch 1, fp32, torch.set_num_threads(1). Baseline: PyTorch DebugMode with bitwise
tensor hashes (torch.hash_tensor) on the same forward.

The configurations run in rounds (plain, DebugMode, hash ops, hash modules, then again; then plain, hash ops,
full in rounds of their own), so a slow spell of a shared machine hits them all; each ratio is the median
over rounds of (time / that round's plain forward). Before each run that writes, the last run's files are
removed and the page cache is written out (untimed). Full mode's write throughput is save_file's time for the
same tensors over full mode's extra time (full minus hash recording, same round), and over the time the
recording spent in its write path (TraceWriter.store_seconds); the shard writer alone is also timed against
save_file. Bisect at scale is bench/bench_bisect.py.

    python bench/bench_record.py [--repeats 7] [--json out.json] [--small]
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


def rounds(fns: dict, repeats: int) -> tuple[dict, dict]:
    """Median seconds of each function, and median ratio to the first one, timed in interleaved rounds."""
    for fn in fns.values():
        getattr(fn, "setup", lambda: None)()
        fn()  # warm-up
    ts: dict = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            getattr(fn, "setup", lambda: None)()
            t0 = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t0)
    base = next(iter(fns))
    ratios = {k: statistics.median(t / b for t, b in zip(v, ts[base])) for k, v in ts.items()}
    return {k: statistics.median(v) for k, v in ts.items()}, ratios, ts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--small", action="store_true", help="tiny model, for a smoke run")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, ids = build(args.small)
    tmp = Path(tempfile.mkdtemp(prefix="divtrace-bench-"))
    from divtrace.fingerprint import IMPLEMENTATION

    res: dict = {"model": "small" if args.small else "llama h512 L8 seq256 fp32", "torch": torch.__version__,
                 "hash_impl": IMPLEMENTATION}

    def settle(*paths):
        """Untimed, before each run that writes: remove the last run's files and write out every dirty page,
        so no run pays for the writeback of the one before (on the project's VM the disk takes ~270 MB/s
        and a few GB of dirty pages throttled whichever run came next, by up to 3x)."""
        for p in paths:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        os.sync()

    def plain():
        with torch.no_grad():
            model(ids, use_cache=False)

    def debug_mode():
        from torch.utils._debug_mode import DebugMode

        with torch.no_grad(), DebugMode() as dm, DebugMode.log_tensor_hashes(hash_fn="hash_tensor"):
            model(ids, use_cache=False)
        return dm

    def rec(mode, ops):
        out = tmp / f"{mode}-{ops}"

        def run():
            with torch.no_grad(), divtrace.record(model, out, mode=mode, ops=ops) as r:
                model(ids, use_cache=False)
            run.store_seconds.append(r.writer.store_seconds)
        run.setup = lambda: settle(out)
        run.store_seconds = []
        return run

    res["seconds"], res["ratio_vs_plain"], _ = rounds(
        {"plain": plain, "debug_mode_hash": debug_mode, "hash_ops": rec("hash", True),
         "hash_modules": rec("hash", False)}, args.repeats)
    print(json.dumps({k: round(v, 3) for k, v in res["ratio_vs_plain"].items()}), flush=True)
    # Full mode in rounds of its own: its writes (page cache, writeback) would slow the rounds above.
    full_run = rec("full", True)
    fsec, fratio, per_round = rounds({"plain": plain, "hash_ops": rec("hash", True), "full_ops": full_run},
                                     args.repeats)
    res["seconds"]["full_ops"], res["ratio_vs_plain"]["full_ops"] = fsec["full_ops"], fratio["full_ops"]
    res["full_rounds_s"] = {k: [round(x, 3) for x in v] for k, v in per_round.items()}

    # Bytes per record in hash mode.
    from divtrace.trace.reader import Trace

    th = Trace(tmp / "hash-True")
    rec_bytes = (tmp / "hash-True" / "records.jsonl").stat().st_size
    res["hash_records"] = len(th.records)
    res["hash_bytes_per_record"] = rec_bytes / max(1, len(th.records))

    # Full-mode write throughput vs safetensors.save_file of the same tensors, two ways:
    # - recording: what full mode costs on top of hash mode (the forward and the hashing are in both), per round;
    # - shard writer alone: the same tensors, in the trace's own shards, written synchronously by write_shard
    #   against save_file of those shards, in interleaved rounds.
    from safetensors.torch import save_file
    from divtrace.trace.writer import write_shard

    tf = Trace(tmp / "full-True")
    shards: dict = {}
    for vid, v in tf.values.items():
        if v.blob and v.blob not in shards.setdefault(v.shard, {}):
            shards[v.shard][v.blob] = tf.tensor(vid).reshape(-1).clone()
    nbytes = sum(t.numel() * t.element_size() for sh in shards.values() for t in sh.values())
    extra = [f - h for f, h in zip(per_round["full_ops"], per_round["hash_ops"])]

    def save_ref():
        for i, sh in enumerate(shards.values()):
            save_file(sh, str(tmp / f"ref-{i}.safetensors"))

    def save_ours():
        for i, sh in enumerate(shards.values()):
            write_shard(tmp / f"ours-{i}.safetensors", sh)

    save_ref.setup = lambda: settle(*(tmp / f"ref-{i}.safetensors" for i in range(len(shards))))
    save_ours.setup = lambda: settle(*(tmp / f"ours-{i}.safetensors" for i in range(len(shards))))

    wsec, _, wrounds = rounds({"save_file": save_ref, "write_shard": save_ours}, max(3, args.repeats))
    t_save = wsec["save_file"]
    res["full_mode"] = {
        "unique_bytes": nbytes, "shards": len(shards), "safetensors_save_s": t_save,
        "recording_extra_s": statistics.median(extra),
        "recording_vs_safetensors": t_save / max(statistics.median(extra), 1e-9),
        # the write path alone, timed inside the recording (TraceWriter.store_seconds: writing the values' bytes
        # and finishing the shards), without the difference of two noisy forwards; [1:] drops the warm-up run
        "write_path_s": statistics.median(full_run.store_seconds[1:]),
        "write_path_vs_safetensors": t_save / max(statistics.median(full_run.store_seconds[1:]), 1e-9),
        "write_shard_s": wsec["write_shard"],
        "write_shard_vs_safetensors": statistics.median(
            r / o for r, o in zip(wrounds["save_file"], wrounds["write_shard"]))}

    shutil.rmtree(tmp, ignore_errors=True)
    txt = json.dumps(res, indent=2)
    print(txt)
    if args.json:
        args.json.write_text(txt + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
