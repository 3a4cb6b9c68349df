"""Recording overhead, full-mode write throughput and bytes per record, as ratios in one run.

Model (issue 2): HF LlamaForCausalLM from config, hidden 512, 8 layers, 8 heads, intermediate 1376,
vocab 32000, sequence 256, batch 1, fp32, torch.set_num_threads(1). Baseline: PyTorch DebugMode with bitwise
tensor hashes (torch.hash_tensor) on the same forward.

The configurations run in rounds (plain, DebugMode, hash ops, hash modules; then plain, hash ops, full in
rounds of their own), so a slow spell of a shared machine hits them all; each round runs them in the next of
a set of balanced orders (each configuration comes right after each other one equally often: what ran just
before slows a run). Each ratio is the median over rounds of (time / that round's plain forward); every
round's ratio is kept beside it, so the spread is on the record. Before each run that writes, the last run's
files are removed and the page cache is written out (untimed). Full mode's write throughput is save_file's time for the
same tensors, taken in the same round, over the time the recording spent in its write path
(TraceWriter.store_seconds) and over full mode's extra time (full minus hash recording); the shard writer alone
is also timed against save_file. Bisect at scale is bench/bench_bisect.py.

    python bench/bench_record.py [--repeats 16] [--json out.json] [--small]
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


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of n configurations in which each one comes right after each other one equally often (a Williams
    design). A run is slowed by what ran just before it: a plain forward right after a hash ops=True recording
    took 3.4% longer than the next one (median of 8), and ops=False measured 1.09x-1.12x always placed after
    ops=True but 1.04x-1.07x right after the plain forward. A fixed order charges that to one configuration."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        if len(first) % 2:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    orders = [[(x + r) % n for x in first] for r in range(n)]
    return orders + [o[::-1] for o in orders] if n % 2 else orders


def rounds(fns: dict, repeats: int, between=None) -> tuple[dict, dict]:
    """Median seconds of each function, and median ratio to the first one, timed in interleaved rounds (each
    round in the next of the balanced orders; `between`, untimed, before each round, so no round starts right
    after another's last run). Balanced when `repeats` is a multiple of the number of orders (4 for 2 or 4
    functions, 6 for 3)."""
    for fn in fns.values():
        getattr(fn, "setup", lambda: None)()
        fn()  # warm-up
    ts: dict = {k: [] for k in fns}
    names = list(fns)
    orders = balanced_orders(len(names))
    for r in range(repeats):
        if between is not None:
            between()
        for k in (names[i] for i in orders[r % len(orders)]):
            fn = fns[k]
            getattr(fn, "setup", lambda: None)()
            t0 = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t0)
    base = next(iter(fns))
    ratios = {k: statistics.median(t / b for t, b in zip(v, ts[base])) for k, v in ts.items()}
    return {k: statistics.median(v) for k, v in ts.items()}, ratios, ts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=16)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--small", action="store_true", help="tiny model, for a smoke run")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, ids = build(args.small)
    tmp = Path(tempfile.mkdtemp(prefix="divtrace-bench-"))
    from divtrace.trace.fingerprint import IMPLEMENTATION

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

    res["seconds"], res["ratio_vs_plain"], ts = rounds(
        {"plain": plain, "debug_mode_hash": debug_mode, "hash_ops": rec("hash", True),
         "hash_modules": rec("hash", False)}, args.repeats, between=plain)
    # Every round's ratio, sorted: on this VM one run's plain forward ranged 287-434 ms, so the spread says how
    # far one run's median can be trusted (the fastest round is no steadier: one lucky plain round moves it).
    res["round_ratios"] = {k: sorted(round(t / b, 3) for t, b in zip(v, ts["plain"])) for k, v in ts.items()
                           if k != "plain"}
    print(json.dumps({k: round(v, 3) for k, v in res["ratio_vs_plain"].items()}), flush=True)
    # Full mode in rounds of its own (its writes, page cache and writeback, would slow the rounds above), with
    # safetensors.save_file of the same tensors in every round: this VM's disk has slow spells that last
    # seconds, so the write path is set against the save_file of its own round.
    from safetensors.torch import save_file

    from divtrace.trace.reader import Trace
    from divtrace.trace.shards import write_shard

    full_run = rec("full", True)
    full_run.setup()
    full_run()
    tf = Trace(tmp / "full-True")
    shards: dict = {}
    for vid, v in tf.values.items():
        if v.blob and v.blob not in shards.setdefault(v.shard, {}):
            shards[v.shard][v.blob] = tf.tensor(vid).reshape(-1).clone()
    nbytes = sum(t.numel() * t.element_size() for sh in shards.values() for t in sh.values())
    del tf  # (frees its open shard files: a trace is in no reference cycle)

    def save_ref():
        for i, sh in enumerate(shards.values()):
            save_file(sh, str(tmp / f"ref-{i}.safetensors"))

    def save_ours():
        for i, sh in enumerate(shards.values()):
            write_shard(tmp / f"ours-{i}.safetensors", sh)

    save_ref.setup = lambda: settle(*(tmp / f"ref-{i}.safetensors" for i in range(len(shards))))
    save_ours.setup = lambda: settle(*(tmp / f"ours-{i}.safetensors" for i in range(len(shards))))

    full_run.store_seconds.clear()
    fsec, fratio, per_round = rounds({"plain": plain, "hash_ops": rec("hash", True), "full_ops": full_run,
                                      "save_file": save_ref}, args.repeats, between=plain)
    res["seconds"]["full_ops"], res["ratio_vs_plain"]["full_ops"] = fsec["full_ops"], fratio["full_ops"]
    res["full_rounds_s"] = {k: [round(x, 3) for x in v] for k, v in per_round.items()}
    write_path = full_run.store_seconds[1:]  # [0] is the warm-up run
    res["full_rounds_s"]["write_path"] = [round(x, 3) for x in write_path]
    extra = [f - h for f, h in zip(per_round["full_ops"], per_round["hash_ops"])]
    saves = per_round["save_file"]

    # The shard writer alone against save_file: the same tensors, in the trace's own shards, interleaved.
    wsec, _, wrounds = rounds({"save_file": save_ref, "write_shard": save_ours}, max(3, args.repeats))
    res["full_mode"] = {
        "unique_bytes": nbytes, "shards": len(shards), "safetensors_save_s": statistics.median(saves),
        # what full mode costs on top of hash mode (the forward and the hashing are in both), per round
        # (a ratio of medians: the extra time of one round, a difference of two noisy forwards, can be negative)
        "recording_extra_s": statistics.median(extra),
        "recording_vs_safetensors": statistics.median(saves) / max(statistics.median(extra), 1e-9),
        # the write path alone, timed inside the recording (TraceWriter.store_seconds: writing the values' bytes
        # and finishing the shards), without the difference of two noisy forwards
        "write_path_s": statistics.median(write_path),
        "write_path_vs_safetensors": statistics.median(s / max(w, 1e-9) for s, w in zip(saves, write_path)),
        "write_shard_s": wsec["write_shard"],
        "write_shard_vs_safetensors": statistics.median(
            r / o for r, o in zip(wrounds["save_file"], wrounds["write_shard"]))}

    # Bytes per record in hash mode.
    th = Trace(tmp / "hash-True")
    rec_bytes = (tmp / "hash-True" / "records.jsonl").stat().st_size
    res["hash_records"] = len(th.records)
    res["hash_bytes_per_record"] = rec_bytes / max(1, len(th.records))

    shutil.rmtree(tmp, ignore_errors=True)
    txt = json.dumps(res, indent=2)
    print(txt)
    if args.json:
        args.json.write_text(txt + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
