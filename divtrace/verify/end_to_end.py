"""verify --runs A_ENTRY B_ENTRY: re-record both runs with the fix in place and bisect them.

It passes only when the full traces are identical: bisect finds every compared record bitwise equal, no module
call is left unpaired, and the final output is bitwise equal with KL exactly 0 (computed here from the two final
outputs in float64, so it is a real figure also for hash-mode traces).

Forward time: the recorder does not store a forward time that means anything (recording slows the forward), so
for `--baseline-a TRACE` the unfixed run is rebuilt from the ENTRY and --arg values that `divtrace record` stored in
TRACE/meta.json, and the fixed and unfixed models' plain forwards (no recording, no_grad) are timed here,
interleaved, with torch.set_num_threads(threads).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from divtrace.errors import DivtraceError
from divtrace.verify.checks import FAILED, PASSED, Check

TIMING_ROUNDS = 5


def _final_tensor(out):
    """The logits/logprobs of a model output: a tensor, `.logits`, a 'logits' key, or the first float tensor."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    items = list(out.values()) if isinstance(out, dict) else list(out) if isinstance(out, (tuple, list)) else []
    if isinstance(out, dict) and isinstance(out.get("logits"), torch.Tensor):
        return out["logits"]
    for v in items:
        t = _final_tensor(v)
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t
    return None


def record_run(entry: str, args: dict, path: Path, mode: str, label: str):
    """Build ENTRY, record one forward into `path`; returns the model's output."""
    from divtrace.record.entry import build_from_entry, run_model
    from divtrace.record import record

    model, inputs = build_from_entry(entry, args)
    try:
        with record(model, path, mode=mode, label=label,
                    extra_meta={"entry": entry, "entry_args": args or {}, "grad_mode": "no_grad"}):
            return run_model(model, inputs)
    except DivtraceError:
        raise
    except Exception as e:
        raise DivtraceError(f"ENTRY {entry} raised {type(e).__name__}: {e}") from None


def _baseline_entry(trace: Path) -> tuple[str, dict]:
    from divtrace.trace.reader import Trace

    meta = Trace(trace).meta
    if not meta.get("entry"):
        raise DivtraceError(f"{trace}/meta.json: no 'entry' (record the unfixed run with `divtrace record ENTRY` so "
                            "verify can rebuild it to time its forward)")
    return meta["entry"], dict(meta.get("entry_args") or {})


def time_forwards(builds: dict, threads: int | None, warmup: int = 1) -> dict:
    """Median forward seconds of each (name -> ENTRY, args), rounds interleaved."""
    from divtrace.record.entry import build_from_entry, run_model

    models = {k: build_from_entry(e, a) for k, (e, a) in builds.items()}
    prev = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        for m, x in models.values():
            for _ in range(warmup):
                run_model(m, x)
        ts = {k: [] for k in models}
        for _ in range(TIMING_ROUNDS):
            for k, (m, x) in models.items():
                t0 = time.perf_counter()
                run_model(m, x)
                ts[k].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(prev)
    return {k: statistics.median(v) for k, v in ts.items()}


def verify_runs(entry_a: str, entry_b: str, *, args_a: dict | None = None, args_b: dict | None = None,
                out: Path | None = None, mode: str = "hash", baseline_a: Path | None = None,
                baseline_b: Path | None = None, threads: int | None = 1) -> dict:
    from divtrace.compare.bisect import bisect
    from divtrace.compare.final import logprob_mismatch

    if mode not in ("hash", "full"):
        raise DivtraceError(f"--mode must be hash or full, got {mode!r}")
    baselines = {s: _baseline_entry(Path(b)) for s, b in (("a", baseline_a), ("b", baseline_b)) if b is not None}
    tmp = None
    if out is None:
        tmp = tempfile.TemporaryDirectory(prefix="divtrace-verify-")
        root = Path(tmp.name)
    else:
        root = Path(out)
        for s in ("a", "b"):
            if (root / s / "meta.json").exists():
                raise DivtraceError(f"{root / s}: already holds a trace (choose another --out)")
    try:
        outs = {s: record_run(e, a or {}, root / s, mode, f"fixed-{s}")
                for s, e, a in (("a", entry_a, args_a), ("b", entry_b, args_b))}
        r = bisect(root / "a", root / "b")
        checks = []
        unpaired = sum(r.unmatched.values())
        d = r.to_dict()
        m = {"compared": r.compared, "unmatched_calls": r.unmatched, "first": d["first"], "verdict": r.verdict,
             "reason": r.reason, "coverage": d["coverage"], "parameters": d.get("parameters")}
        if r.verdict == "identical" and not unpaired:
            checks.append(Check("traces", "end_to_end", PASSED,
                                f"every one of {r.compared} compared tensors bitwise equal, every module call "
                                "paired", m))
        elif r.verdict == "inconclusive":  # never a pass: what ran was not all seen, or a run stopped early
            checks.append(Check("traces", "end_to_end", FAILED, f"INCONCLUSIVE: {r.reason}", m))
        elif r.verdict == "identical":
            checks.append(Check("traces", "end_to_end", FAILED, f"compared records agree but {r.unmatched['a']} calls "
                                f"are only in a and {r.unmatched['b']} only in b", m))
        elif r.first is None:  # absorbed: every output equal, but something inside (a weight, say) differs
            from divtrace.compare.params import param_line

            what = param_line(d.get("parameters")) or f"{len(r.absorbed)} internal difference(s)"
            checks.append(Check("traces", "end_to_end", FAILED, f"{r.verdict}: every final output bitwise equal, but "
                                f"{what} (bisect the two traces for where)", m))
        else:
            f = r.first
            checks.append(Check("traces", "end_to_end", FAILED, f"diverged: first in {f.module or '<root>'} call "
                                f"{f.call} op {f.op or '-'} (a) / {f.op_b or '-'} (b) [{f.cause}]", m))
        fa, fb = (_final_tensor(outs[s]) for s in ("a", "b"))
        if fa is None or fb is None:
            checks.append(Check("final output", "end_to_end", FAILED, "no floating output tensor to compare", {}))
        else:
            from divtrace.verify.checks import compare_outputs

            same = compare_outputs(fa, fb)
            fin = logprob_mismatch(fa, fb, "a", "b") if fa.shape == fb.shape else {"kl": None}
            fm = {"kl": fin.get("kl"), "max_abs_logprob_diff": fin.get("max_abs_logprob_diff"),
                  "bitwise_equal": same["equal"], "mismatched": same.get("mismatched")}
            ok = same["equal"] and fin.get("kl") == 0.0
            checks.append(Check("final output", "end_to_end", PASSED if ok else FAILED,
                                f"bitwise equal, KL {fm['kl']!r}" if ok else
                                f"{same.get('reason') or 'differs'}; KL {fm['kl']!r}", fm))
        timing = {}
        for s, entry, args in (("a", entry_a, args_a), ("b", entry_b, args_b)):
            if s not in baselines:
                continue
            t = time_forwards({"fixed": (entry, args or {}), "unfixed": baselines[s]}, threads)
            timing[s] = {"fixed_s": t["fixed"], "unfixed_s": t["unfixed"], "ratio": t["fixed"] / t["unfixed"],
                         "baseline": str(baseline_a if s == "a" else baseline_b), "unfixed_entry": baselines[s][0],
                         "unfixed_args": baselines[s][1], "threads": threads}
        return {"verdict": "passed" if all(c.status == PASSED for c in checks) else "failed",
                "checks": [c.to_dict() for c in checks], "traces": {"a": str(root / "a"), "b": str(root / "b")},
                "kept": tmp is None, "bisect": d, "timing": timing or None}
    finally:
        if tmp is not None:
            tmp.cleanup()
