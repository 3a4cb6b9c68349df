"""--profile: how fast side a, side b and the patch are, and how close to the machine's copy bandwidth.

Each candidate is timed inside one `run_side` call (so its side's settings hold) in blocks of iterations, and the
blocks of the three candidates are interleaved over several rounds so that a noisy neighbour slows all of them
alike. CUDA: CUDA events around each iteration. CPU: perf_counter with torch.set_num_threads(threads) (1 unless the
user asks otherwise) for the duration of the timing. That wall time includes the Python that calls the ops: the
repro's sides call `torch.ops.aten.*` overloads one by one, which costs microseconds per op that a patch written
with tensor methods does not, so at 10-20 us per call it says little about the kernels.

The ratios are therefore taken from kernel time (`kernel_profile`): torch.profiler's device time of the kernels on
CUDA, and on CPU the self time of the leaf ops (an op that calls no other op: the one that runs the kernel; the
dispatcher layers above it, `aten::to` over `aten::_to_copy`, and the Python around them do not count). Side a is
profiled twice in every round; the range of its ratio to itself over the rounds is the noise band: a ratio inside
it is no measurable difference. Ratios are throughputs: "patch: 93% of side b" means the patch does 0.93x the work
per second that side b does.
"""
from __future__ import annotations

import contextlib
import functools
import os
import statistics
import sys
import time

import torch

from divtrace.verify.checks import Side, flatten

ROUNDS = 5


def device_of(inputs: dict) -> torch.device:
    for v in inputs.values():
        if isinstance(v, torch.Tensor) and v.device.type != "cpu":
            return v.device
    return torch.device("cpu")


class _Timer:
    """Per-iteration seconds of fn(*args) on `device`."""

    def __init__(self, device: torch.device, threads: int | None):
        self.cuda = device.type == "cuda"
        self.threads = threads

    def block(self, fn, args, kwargs, iters: int) -> list[float]:
        prev = torch.get_num_threads()
        if self.threads and not self.cuda:
            torch.set_num_threads(self.threads)
        try:
            if self.cuda:
                ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(iters)]
                torch.cuda.synchronize()
                for s, e in ev:
                    s.record()
                    fn(*args, **kwargs)
                    e.record()
                torch.cuda.synchronize()
                return [s.elapsed_time(e) / 1e3 for s, e in ev]
            out = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn(*args, **kwargs)
                out.append(time.perf_counter() - t0)
            return out
        finally:
            torch.set_num_threads(prev)


def _in_side(repro, cand: Side, inputs: dict, body):
    """Run body(fn, args, kwargs) inside run_side, so the side's settings are applied once around all of it."""
    box = {}

    @functools.wraps(cand.fn)
    def wrapped(*args, **kwargs):
        box["v"] = body(cand.fn, args, kwargs)
        return cand.fn(*args, **kwargs)

    repro.run(wrapped, cand.settings_side, inputs)
    return box["v"]


def _stats(ts: list[float]) -> dict:
    ts = sorted(ts)
    q = statistics.quantiles(ts, n=4) if len(ts) >= 4 else [ts[0], statistics.median(ts), ts[-1]]
    med = statistics.median(ts)
    return {"median_s": med, "min_s": ts[0], "p25_s": q[0], "p75_s": q[2],
            "iqr_pct": 100 * (q[2] - q[0]) / med if med else 0.0, "iterations": len(ts)}


def copy_bandwidth(device: torch.device, timer: _Timer, nbytes: int) -> float:
    """GB/s of dst.copy_(src) (read + write counted), a buffer larger than the caches unless the region is bigger."""
    n = max(nbytes, (256 << 20) if device.type == "cuda" else (32 << 20)) // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    timer.block(dst.copy_, (src,), {}, 2)
    med = statistics.median(timer.block(dst.copy_, (src,), {}, 10))
    return 2 * n * 4 / med / 1e9


def _bytes(inputs: dict, out) -> int:
    return sum(v.numel() * v.element_size() for v in inputs.values() if isinstance(v, torch.Tensor)) + sum(
        v.numel() * v.element_size() for _, v in flatten(out) if isinstance(v, torch.Tensor))


def _flops(repro, cand: Side, inputs: dict) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    def body(fn, args, kwargs):
        with FlopCounterMode(display=False) as fc:
            fn(*args, **kwargs)
        return fc.get_total_flops()

    try:
        return int(_in_side(repro, cand, inputs, body))
    except Exception:
        return 0


@contextlib.contextmanager
def _quiet_stderr():
    """Kineto writes profiler_start/stop lines straight to fd 2; keep them off the user's terminal."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def top_ops(repro, cand: Side, inputs: dict, device: torch.device, median_s: float, threads: int | None = None,
            n_iter: int = 5, k: int = 6) -> list[dict]:
    """The ops that take the most self time, as a share of the profiled iterations, and that share of the
    measured median (`self_us_per_iter`): the profiler's own times are inflated by its overhead (per op, and
    more for small ops: a 88 us bmm showed as 7300 us), so they are kept only as `profiled_self_us_per_iter`.
    Profiled under the same thread count as the timing."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])

    def body(fn, args, kwargs):
        prev = torch.get_num_threads()
        if threads and device.type != "cuda":
            torch.set_num_threads(threads)
        try:
            for _ in range(2):
                fn(*args, **kwargs)
            with _quiet_stderr(), profile(activities=acts) as prof:
                for _ in range(n_iter):
                    fn(*args, **kwargs)
                if device.type == "cuda":
                    torch.cuda.synchronize()
        finally:
            torch.set_num_threads(prev)
        return prof.key_averages()

    events = _in_side(repro, cand, inputs, body)
    dev = device.type == "cuda"

    def self_us(e):
        if dev:
            return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        return e.self_cpu_time_total

    rows = sorted((e for e in events if e.key.startswith(("aten::", "cuda", "void", "triton")) or dev),
                  key=self_us, reverse=True)
    total = sum(self_us(e) for e in rows) or 1.0
    return [{"op": e.key, "calls_per_iter": e.count / n_iter, "share_pct": 100 * self_us(e) / total,
             "self_us_per_iter": median_s * 1e6 * self_us(e) / total,
             "profiled_self_us_per_iter": self_us(e) / n_iter} for e in rows[:k] if self_us(e) > 0]


KERNEL_ROUNDS = 7
AGAIN = "side a (again)"  # side a profiled a second time in each round: the noise band


ITER = "divtrace::verify_iteration"  # a record_function range around each profiled call


def _leaf_us(event) -> float:
    """CPU self time of the leaf ops under `event` (named `ns::op`, calling no other such op)."""
    kids = [c for c in event.cpu_children if "::" in c.name and c.name != ITER]
    if not kids:
        return event.self_cpu_time_total if "::" in event.name and event.name != ITER else 0.0
    return sum(_leaf_us(c) for c in kids) + sum(_leaf_us(c) for c in event.cpu_children if "::" not in c.name)


def _kernel_us(events, cuda: bool, iters: int) -> float:
    """Kernel microseconds per call in profiled events: CUDA kernels' device time over the calls, or on CPU the
    median over the calls of the self time of their leaf ops (a median: an interrupt in one call does not count)."""
    if cuda:
        from torch.autograd import DeviceType

        return sum(e.self_device_time_total for e in events
                   if getattr(e, "device_type", None) == DeviceType.CUDA) / iters
    per_call = [_leaf_us(e) for e in events if e.name == ITER]
    return statistics.median(per_call) if per_call else 0.0


def _kernel_block(repro, cand: Side, inputs: dict, device: torch.device, threads: int | None, iters: int) -> float:
    """Kernel microseconds per call of `cand` over `iters` profiled calls, inside its side's settings."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def body(fn, args, kwargs):
        prev = torch.get_num_threads()
        if threads and not cuda:
            torch.set_num_threads(threads)
        try:
            fn(*args, **kwargs)
            with _quiet_stderr(), profile(activities=acts) as prof:
                for _ in range(iters):
                    with record_function(ITER):
                        fn(*args, **kwargs)
                if cuda:
                    torch.cuda.synchronize()
        finally:
            torch.set_num_threads(prev)
        return _kernel_us(prof.events(), cuda, iters)

    return _in_side(repro, cand, inputs, body)


def kernel_profile(repro, cands: list[Side], inputs: dict, device: torch.device, threads: int | None,
                   est: dict, rounds: int = KERNEL_ROUNDS, block_s: float = 0.01) -> dict:
    """Kernel time per call of each candidate over interleaved rounds, side a twice per round (the noise band)."""
    order = cands + [Side(AGAIN, cands[0].fn, cands[0].settings_side)]
    per = {c.label: [] for c in order}
    for r in range(rounds):
        for c in order[r % len(order):] + order[:r % len(order)]:  # rotate: no candidate always runs first
            iters = int(min(30, max(5, block_s / est[cands[0].label if c.label == AGAIN else c.label])))
            per[c.label].append(_kernel_block(repro, c, inputs, device, threads, iters))
    band = [100 * x / y for x, y in zip(per[AGAIN], per["side a"]) if x > 0 and y > 0]
    measure = ("device time of the CUDA kernels (torch.profiler)" if device.type == "cuda" else
               "CPU self time of the leaf ops, the ops that run the kernels (torch.profiler)")
    return {"measure": measure, "rounds": rounds,
            "candidates": {k: {"median_us": statistics.median(v), "min_us": min(v), "per_round_us": v}
                           for k, v in per.items()},
            "noise_band_pct": [min(band), max(band)] if band else None}


def kernel_ratios(kernel: dict, patched_side: str | None) -> list[tuple[str, str, float]]:
    """(who, against, throughput percent): the median over the rounds of t_against / t_who, each round's pair
    measured close together in time."""
    per = {k: v["per_round_us"] for k, v in kernel["candidates"].items()}

    def pct(who, against):
        rs = [100 * a / w for w, a in zip(per[who], per[against]) if w > 0 and a > 0]
        return statistics.median(rs) if rs else float("nan")

    if patched_side:
        other = "b" if patched_side == "a" else "a"
        return [("patch", f"side {patched_side}", pct("patch", f"side {patched_side}")),
                ("patch", f"side {other}", pct("patch", f"side {other}"))]
    return [("side b", "side a", pct("side b", "side a"))]


def profile_candidates(repro, cands: list[Side], inputs: dict, *, threads: int | None = 1, warmup: int = 3,
                       min_block_s: float = 0.02, max_iters: int = 200) -> dict:
    """Timings of each candidate on `inputs`, throughput ratios and achieved bandwidth/flops."""
    device = device_of(inputs)
    timer = _Timer(device, threads)
    est = {}
    for c in cands:  # warm-up; its timings size the blocks
        ts = _in_side(repro, c, inputs, lambda fn, a, k: timer.block(fn, a, k, warmup))
        est[c.label] = max(min(ts), 1e-7)
    times = {c.label: [] for c in cands}
    for r in range(ROUNDS):
        for c in cands[r % len(cands):] + cands[:r % len(cands)]:  # rotate: no candidate always runs first
            iters = int(min(max_iters, max(2, min_block_s / est[c.label])))
            times[c.label] += _in_side(repro, c, inputs, lambda fn, a, k, n=iters: timer.block(fn, a, k, n))
    stats = {label: _stats(ts) for label, ts in times.items()}
    out0 = repro.run(cands[0].fn, cands[0].settings_side, inputs)
    nbytes = _bytes(inputs, out0)
    bw = copy_bandwidth(device, timer, nbytes)
    kernel = kernel_profile(repro, cands, inputs, device, threads, est)
    for c in cands:
        s = stats[c.label]
        s["kernel_median_s"] = kernel["candidates"][c.label]["median_us"] * 1e-6
        t = s["kernel_median_s"] if s["kernel_median_s"] > 0 else s["median_s"]  # (no kernel seen: wall time)
        s["flops"] = _flops(repro, c, inputs)
        s["gb_per_s"] = nbytes / t / 1e9  # per kernel time: what the kernels achieve
        s["gflop_per_s"] = s["flops"] / t / 1e9 if s["flops"] else None
        s["pct_of_copy_bw"] = 100 * s["gb_per_s"] / bw if bw else None
        try:
            s["top_ops"] = top_ops(repro, c, inputs, device, s["median_s"], threads)
        except Exception as e:  # the profiler is a nicety; a build without it must not fail verify
            s["top_ops"] = []
            s["top_ops_error"] = f"{type(e).__name__}: {e}"
    return {"device": str(device), "timer": "cuda events" if device.type == "cuda" else "perf_counter",
            "kernel": kernel,
            "threads": None if device.type == "cuda" else (threads or torch.get_num_threads()),
            "rounds": ROUNDS, "bytes_moved": nbytes, "bytes_rule": "inputs read once + outputs written once",
            "flops_rule": "torch.utils.flop_counter (matmul/attention/conv flops; elementwise ops count 0)",
            "copy_bw_gb_per_s": bw, "candidates": stats}


def ratios(stats: dict, patched_side: str | None) -> list[tuple[str, str, float]]:
    """(who, against, throughput percent) of the wall time per call: t_against / t_who."""
    med = {k: v["median_s"] for k, v in stats.items()}
    if patched_side:
        other = "b" if patched_side == "a" else "a"
        return [("patch", f"side {patched_side}", 100 * med[f"side {patched_side}"] / med["patch"]),
                ("patch", f"side {other}", 100 * med[f"side {other}"] / med["patch"])]
    return [("side b", "side a", 100 * med["side a"] / med["side b"])]
