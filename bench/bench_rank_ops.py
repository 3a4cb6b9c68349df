"""Per-forward CPU milliseconds of `record(mode="hash", ops=True)` on a rank of a TP=2 run and on TP=1, against
the plain forward of the same process: bench_sharded.py's model and setup (HF Llama h512 L8 seq256 fp32, HF's TP
plan on 2 gloo ranks, one thread each), only the two configurations, alternated forward by forward, timed by the
process's CPU time (what a shared machine moves least). With --profile, rank 0 (and TP=1) also run cProfile over
a few recorded forwards and print where the recording's time goes.

    python bench/bench_rank_ops.py [--rounds 12] [--profile 3] [--by-op] [--small] [--no-tp1] [--debug-mode] [--floor]

--floor also times, in the same rounds, what any recorder built on a Python dispatch mode pays before it records
anything: `bare_mode` (a TorchDispatchMode that passes every op through, no divtrace) and `passthrough` (divtrace's
block, hooks and module-boundary values with every op passed through unrecorded, params="read").
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]


def _ablate(what: str) -> None:
    """Diagnostics only (what is recorded changes): leave parts of a rank's recording out, to see what they cost.
    "layouts": the values' layouts (record/placements.py hooks as no-ops); "tokens" is record(tokens=False)."""
    if "layouts" in what.split(","):
        from divtrace.record.placements import Placements

        for name in ("op_inputs", "op_outputs", "bind_outputs", "before_value", "after_value"):
            setattr(Placements, name, lambda self, *a, **k: None)
        Placements.shard_rows = lambda self, t, code: None


_SPLIT: dict = {}


def _split() -> None:
    """Diagnostics: thread CPU ms inside some recorder parts (inclusive; outermost call only), per recorded forward."""
    import functools

    from divtrace.record import collectives
    from divtrace.record.collectives import Collectives
    from divtrace.record.module_calls import ModuleCalls
    from divtrace.record.op_records import OpRecorder
    from divtrace.record.placements import Placements
    from divtrace.record.token_rows import TokenRows
    from divtrace.record.values import ValueIdentity
    from divtrace.trace.writer import TraceWriter

    depth = {}

    def wrap(cls, name, label):
        f = getattr(cls, name)

        @functools.wraps(f)
        def g(*a, **k):
            if depth.get(label):
                return f(*a, **k)
            depth[label] = 1
            t0 = time.thread_time()
            try:
                return f(*a, **k)
            finally:
                _SPLIT[label] = _SPLIT.get(label, 0.0) + time.thread_time() - t0
                depth[label] = 0
        setattr(cls, name, g)

    from divtrace.record import token_rows, values
    from divtrace.record.token_store import TokenStoreWriter

    from divtrace.trace import writer as writer_mod
    from divtrace.trace.layouts import LayoutWriter
    from divtrace.trace.side_files import ChecksummedFiles

    for cls, name, label in ((LayoutWriter, "_write", "close: layout lines"),
                             (writer_mod, "_record_line", "close: record lines"),
                             (ChecksummedFiles, "write", "close: side files write"),
                             (TokenStoreWriter, "hand_over", "close: token store hand_over"),
                             (TraceWriter, "_write_meta", "close: meta.json"),
                             (TraceWriter, "_write_records", "close: records write"),
                             (token_rows, "strided_row_fingerprints", "token rows: kernel"),
                             (TokenStoreWriter, "add_rows", "token rows: store"),
                             (ValueIdentity, "_derived_view", "derived views"), (values, "copy_value", "copy_value"),
                             (TraceWriter, "close", "writer.close"), (TraceWriter, "new_value", "new_value (hash)"),
                             (TokenRows, "rows", "token rows"), (ValueIdentity, "produced", "produced"),
                             (ValueIdentity, "vid_of", "vid_of"), (Placements, "op_outputs", "pl.op_outputs"),
                             (Placements, "bind_outputs", "pl.bind_outputs"), (Placements, "op_inputs", "pl.op_inputs"),
                             (Placements, "after_value", "pl.after_value"), (Placements, "shard_rows", "pl.shard_rows"),
                             (ModuleCalls, "enter", "calls.enter"), (ModuleCalls, "exit", "calls.exit"),
                             (Collectives, "outputs", "collectives.outputs"), (collectives, "settle", "settle"),
                             (OpRecorder, "on_op", "on_op (the ops too)"), (OpRecorder, "_encode", "encode args")):
        wrap(cls, name, label)


_BY_OP: dict = {}  # op name -> [calls, on_op thread CPU s (inclusive), of which the op's own call]


def _by_op(model) -> None:
    """Diagnostics: OpRecorder.on_op's thread CPU time per aten op, with the op's own call (the kernel: the
    OpOverload call made by on_op itself) timed apart, so on_op's exclusive cost per op kind is the difference.
    An op whose first argument is over a parameter's storage (a weight's local block) is counted as "op (weight)"."""
    import torch
    from torch._ops import OpOverload

    from divtrace.record.op_records import OpRecorder, _op_name

    on_op, call = OpRecorder.on_op, OpOverload.__call__
    cur = [None, 0.0]  # the op on_op runs now (outermost), kernel seconds inside it
    weights = set()
    for p in model.parameters():
        p = getattr(p, "_local_tensor", p)
        weights.add(p.untyped_storage().data_ptr())

    def kind(func, args):
        a = args[0] if args else None
        if type(a) in (torch.Tensor, torch.nn.Parameter) and a.untyped_storage().data_ptr() in weights:
            return _op_name(func) + " (weight)"
        return _op_name(func)

    def timed_call(self, /, *args, **kwargs):
        if self is not cur[0]:
            return call(self, *args, **kwargs)
        cur[0] = None  # (its own call only, once)
        t0 = time.thread_time()
        try:
            return call(self, *args, **kwargs)
        finally:
            cur[1] += time.thread_time() - t0

    def timed_on_op(self, func, args, kwargs):
        if cur[0] is not None:
            return on_op(self, func, args, kwargs)
        cur[0], cur[1] = func, 0.0
        t0 = time.thread_time()
        try:
            return on_op(self, func, args, kwargs)
        finally:
            dt = time.thread_time() - t0
            e = _BY_OP.setdefault(kind(func, args), [0, 0.0, 0.0])
            e[0] += 1
            e[1] += dt
            e[2] += cur[1]
            cur[0] = None

    OpOverload.__call__ = timed_call
    OpRecorder.on_op = timed_on_op


def _measure(model, ids, rounds: int, profile: int, ablate: str = "", by_op: bool = False,
             debug_mode: bool = False, floor: bool = False) -> dict:
    import torch

    import divtrace

    _ablate(ablate)
    tokens = "tokens" not in ablate.split(",")

    tmp = Path(tempfile.mkdtemp(prefix="divtrace-rank-ops-"))

    def plain():
        with torch.no_grad():
            model(ids, use_cache=False)

    def rec():
        shutil.rmtree(tmp / "t", ignore_errors=True)
        with torch.no_grad(), divtrace.record(model, tmp / "t", mode="hash", ops=True, tokens=tokens):
            model(ids, use_cache=False)

    import gc

    gc_s = [0.0, 0.0]  # (start, total) thread CPU seconds inside garbage collections

    def on_gc(phase, info):
        if phase == "start":
            gc_s[0] = time.thread_time()
        else:
            gc_s[1] += time.thread_time() - gc_s[0]

    gc.callbacks.append(on_gc)
    def dbg():  # (--debug-mode: PyTorch's DebugMode with bitwise hashes, bench_record.py's reference, on the same
        # forward: what another per-op recorder costs here)
        from torch.utils._debug_mode import DebugMode

        with torch.no_grad(), DebugMode(), DebugMode.log_tensor_hashes(hash_fn="hash_tensor"):
            model(ids, use_cache=False)

    from torch.utils._python_dispatch import TorchDispatchMode

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def bare():  # (--floor: a dispatch mode that records nothing)
        with torch.no_grad(), PassThrough():
            model(ids, use_cache=False)

    from divtrace.record.op_records import OpRecorder

    def passthrough():  # (--floor: divtrace's block with every op passed through unrecorded)
        on_op = OpRecorder.on_op
        OpRecorder.on_op = lambda self, func, args, kwargs: func(*args, **kwargs)
        try:
            shutil.rmtree(tmp / "p", ignore_errors=True)
            with torch.no_grad(), divtrace.record(model, tmp / "p", mode="hash", ops=True, params="read"):
                model(ids, use_cache=False)
        finally:
            OpRecorder.on_op = on_op

    def empty():  # the block's own fixed cost: entered and left with no forward inside
        shutil.rmtree(tmp / "e", ignore_errors=True)
        with torch.no_grad(), divtrace.record(model, tmp / "e", mode="hash", ops=True):
            pass

    try:
        plain(), rec(), plain(), rec()  # warm-up
        empty()
        e_cpu = []
        for _ in range(5):
            c0 = time.process_time()
            empty()
            e_cpu.append(time.process_time() - c0)
        configs = [("plain", plain), ("hash_ops", rec)] + ([("debug_mode", dbg)] if debug_mode else []) + (
            [("bare_mode", bare), ("passthrough", passthrough)] if floor else [])
        if debug_mode:
            dbg()  # (warm-up)
        if floor:
            bare(), passthrough()  # (warm-up)
        cpu: dict = {k: [] for k, _ in configs}
        gcs: dict = {k: [] for k, _ in configs}
        thread: dict = {k: [] for k, _ in configs}  # this thread's CPU only (gloo's threads, which poll while
        # waiting for the other rank, left out)
        for r in range(rounds):
            order = configs[r % len(configs):] + configs[:r % len(configs)]  # (rotated: each one first in turn)
            for name, fn in order:
                c0, g0, t0 = time.process_time(), gc_s[1], time.thread_time()
                fn()
                cpu[name].append(time.process_time() - c0)
                thread[name].append(time.thread_time() - t0)
                gcs[name].append(gc_s[1] - g0)
        out = {k: {"median_ms": round(1e3 * statistics.median(v), 1), "min_ms": round(1e3 * min(v), 1),
                   "max_ms": round(1e3 * max(v), 1)} for k, v in cpu.items()}
        extra = [1e3 * (h - p) for h, p in zip(cpu["hash_ops"], cpu["plain"])]
        out["extra_ms"] = {"median": round(statistics.median(extra), 1), "min": round(min(extra), 1),
                           "max": round(max(extra), 1)}
        out["empty_block_ms"] = round(1e3 * statistics.median(e_cpu), 1)
        out["gc_ms"] = {k: {"median": round(1e3 * statistics.median(v), 1), "max": round(1e3 * max(v), 1),
                            "mean": round(1e3 * statistics.mean(v), 1)} for k, v in gcs.items()}
        out["extra_ms"]["mean"] = round(statistics.mean(extra), 1)
        t_extra = [1e3 * (h - p) for h, p in zip(thread["hash_ops"], thread["plain"])]
        out["thread"] = {"plain_ms": round(1e3 * statistics.median(thread["plain"]), 1),
                         "extra_ms": {"median": round(statistics.median(t_extra), 1), "min": round(min(t_extra), 1),
                                      "max": round(max(t_extra), 1)},
                         "ratio": round(statistics.median(h / p for h, p in zip(thread["hash_ops"], thread["plain"])), 3)}
        out["cpu_ratio"] = round(statistics.median(h / p for h, p in zip(cpu["hash_ops"], cpu["plain"])), 3)
        if debug_mode:
            out["debug_mode"] = {
                "thread_ratio": round(statistics.median(d / p for d, p in zip(thread["debug_mode"], thread["plain"])), 3),
                "cpu_ratio": round(statistics.median(d / p for d, p in zip(cpu["debug_mode"], cpu["plain"])), 3)}
        for k in ("bare_mode", "passthrough") if floor else ():
            out[k] = {"thread_ratio": round(statistics.median(d / p for d, p in zip(thread[k], thread["plain"])), 3),
                      "cpu_ratio": round(statistics.median(d / p for d, p in zip(cpu[k], cpu["plain"])), 3)}
        if by_op:  # (--by-op: on_op per aten op, over 6 recorded forwards)
            _by_op(model)
            for _ in range(6):
                rec()
            rows = sorted(((k, n / 6, 1e3 * (a - b) / 6, 1e3 * b / 6) for k, (n, a, b) in _BY_OP.items()),
                          key=lambda r: -r[2])
            out["by_op"] = {"ms_per_forward (on_op less the op's own call)": round(sum(r[2] for r in rows), 1),
                            "ops_per_forward": round(sum(r[1] for r in rows), 1),
                            "kernel_ms_per_forward": round(sum(r[3] for r in rows), 1),
                            "ops": [[k, round(n, 1), round(x, 2), round(kern, 2)] for k, n, x, kern in rows]}
        elif profile == 1:  # (--profile 1: the split, over 6 recorded forwards)
            _split()
            t0 = time.thread_time()
            for _ in range(6):
                rec()
            out["split_ms"] = {k: round(1e3 * v / 6, 1) for k, v in sorted(_SPLIT.items(), key=lambda kv: -kv[1])}
            out["split_ms"]["whole recorded forward"] = round(1e3 * (time.thread_time() - t0) / 6, 1)
            t0 = time.thread_time()
            for _ in range(6):
                plain()
            out["split_ms"]["plain forward"] = round(1e3 * (time.thread_time() - t0) / 6, 1)
        elif profile < 0:  # (for a sampling profiler attached from outside: -N recorded forwards, nothing timed)
            for _ in range(-profile):
                rec()
        elif profile:
            pr = cProfile.Profile(time.thread_time)  # (CPU time of this thread: waits at collectives left out)
            pr.enable()
            for _ in range(profile):
                rec()
            pr.disable()
            s = io.StringIO()
            st = pstats.Stats(pr, stream=s)
            st.sort_stats("tottime").print_stats(35)
            st.sort_stats("cumulative").print_stats(45)
            out["profile"] = s.getvalue()
        return out
    finally:
        gc.callbacks.remove(on_gc)
        shutil.rmtree(tmp, ignore_errors=True)


def rank_main(rank, world, model_dir, rounds, profile, ablate="", by_op=False, tp2_seq=0, debug_mode=False,
              floor=False):
    import torch
    from transformers import LlamaForCausalLM

    from bench_record import build

    torch.set_num_threads(1)
    model = LlamaForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32).eval()
    _, ids = build(small=model.config.num_hidden_layers == 2)
    if tp2_seq:  # (the same work per rank as one process at bench_record's sequence: twice its tokens at TP=2)
        ids = torch.randint(0, model.config.vocab_size, (1, tp2_seq), generator=torch.Generator().manual_seed(1))
    out = _measure(model, ids, rounds, profile, ablate, by_op, debug_mode, floor)  # (both ranks run the same forwards: collectives pair them)
    if rank:
        out.pop("profile", None)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--profile", type=int, default=0, help="recorded forwards profiled on rank 0 (and TP=1); -N: N more recorded forwards, for py-spy")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--no-tp1", action="store_true")
    ap.add_argument("--no-tp2", action="store_true")
    ap.add_argument("--by-op", action="store_true", help="diagnostics: on_op's CPU ms per forward by aten op "
                    "(exclusive of the op's own call), with call counts: [op, calls, ms, op's own ms]")
    ap.add_argument("--tp2-seq", type=int, default=0, help="the ranks' sequence length (default: bench_record's, "
                    "256); 512 gives a rank about the single process's work at 256")
    ap.add_argument("--debug-mode", action="store_true", help="also time PyTorch's DebugMode with bitwise hashes "
                    "(bench_record.py's reference) on the same forwards: what another per-op recorder costs per rank")
    ap.add_argument("--floor", action="store_true", help="also time a pass-through dispatch mode (no divtrace) and "
                    "divtrace's block with every op passed through: what a per-op Python recorder pays first")
    ap.add_argument("--ablate", default="", help="diagnostics: parts left out, comma-separated: layouts, tokens")
    args = ap.parse_args(argv)
    import torch

    from bench_record import build
    from dist_harness import run_ranks

    torch.set_num_threads(1)
    model, ids = build(args.small)
    res: dict = {}
    if not args.no_tp2:
        model_dir = tempfile.mkdtemp(prefix="divtrace-rank-ops-model-")
        model.save_pretrained(model_dir)
        try:
            ranks = run_ranks(rank_main, 2, model_dir, args.rounds, args.profile, args.ablate, args.by_op, args.tp2_seq, args.debug_mode, args.floor, timeout_s=600, join_s=7200)
        finally:
            shutil.rmtree(model_dir, ignore_errors=True)
        for r, x in enumerate(ranks):
            prof = x.pop("profile", None)
            if prof:
                print(f"--- rank {r} profile ---\n{prof}")
            res[f"rank{r}"] = x
    if not args.no_tp1:
        x = _measure(model, ids, args.rounds, args.profile, args.ablate, args.by_op, args.debug_mode, args.floor)
        prof = x.pop("profile", None)
        if prof:
            print(f"--- TP=1 profile ---\n{prof}")
        res["tp1"] = x
    for k, x in res.items():
        print(k, json.dumps(x))
    return 0


if __name__ == "__main__":
    sys.exit(main())
