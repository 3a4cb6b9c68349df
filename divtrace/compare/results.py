"""What a bisect returns: `Divergence` (one place where the traces differ) and `BisectResult` (the verdict and
everything that goes with it; `--json` is its `to_dict`), and the parts of a result both bisects fill the same
way (what each trace's recording saw, the settings that differ).

In: what the walker (walker.py) and the bisects (bisect.py, token_bisect.py) found. Out: results for the CLI's
output layer and the library's callers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from divtrace.compare.diffs import TensorDiff
from divtrace.compare.verdict import EXIT_CODES, Coverage, TraceSeen, progress, unseen_of
from divtrace.trace.reader import Trace


def settings_diff(a: dict, b: dict) -> list[dict]:
    """divtrace.record.settings.settings_diff, which cannot be imported without torch: the settings whose values
    differ, as [{"name", "a", "b"}] (tests/test_bisect_scale.py checks the two agree)."""
    return [{"name": k, "a": a.get(k), "b": b.get(k)} for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def trace_seen(t: Trace, side: str, other: Trace) -> TraceSeen:
    """What the verdict rule needs to know of trace `t` (the other trace measures how far it got)."""
    run = t.meta.get("run") if isinstance(t.meta.get("run"), dict) else {}
    missing = [r for r in run.get("missing") or [] if isinstance(r, int)]
    status = getattr(t, "status", t.meta.get("status", "?"))
    if t.complete:
        how_far = None
    elif missing and "stopped (" not in status:  # every rank there finished: how far it got is not the question
        held = len(run.get("ranks") or [])
        how_far = (f"{held} of its {run.get('world_size')} ranks {'holds' if held == 1 else 'hold'} a trace, so no "
                   "value that needs the missing ranks' blocks was compared")
    else:
        how_far = progress(t, other)
    return TraceSeen(side, str(t.path), t.complete, status,
                     t.meta.get("error") if isinstance(t.meta.get("error"), str) else None,
                     how_far, unseen_of(t.meta), missing, [str(x) for x in t.meta.get("parted") or []])


@dataclass
class Divergence:
    """One place where the traces differ."""

    index: int  # record index in A: the parting op, or the call's exit record
    module: str
    call: int
    op: str | None  # side A's parting op
    op_b: str | None  # side B's parting op
    kind: str  # "op" | "module"
    cause: str  # "origin" | "propagated"
    tensor: str  # which tensor differs: "out", "input args.0 of model.layers.0.mlp", ...
    dtype: str
    shape: list[int]
    numel: int
    diff: TensorDiff | None = None
    module_b: str | None = None
    index_b: int | None = None
    region_a: list[tuple[int, str]] = field(default_factory=list)
    region_b: list[tuple[int, str]] = field(default_factory=list)
    vid_a: int | None = None  # the differing tensor's value ids (what repro starts from)
    vid_b: int | None = None
    # An input of the region that no recorded op made (a parameter, a buffer, bytes written by a kernel torch
    # does not see) and that the other side does not hold: the output differs although the call's inputs agree.
    outside_input: str | None = None
    # Where a side is a sharded run: how each side computed the value, in words (divtrace.compare.shard_cause)
    shards: dict | None = None
    # Where the origin is an MoE router: each token's expert ids, weights and slot order compared, and the cause
    # of a flipped choice (divtrace.compare.routing)
    routing: dict | None = None

    def to_dict(self) -> dict:
        d = {"index": self.index, "module": self.module, "call": self.call, "op": self.op, "op_b": self.op_b,
             "kind": self.kind, "cause": self.cause, "tensor": self.tensor, "dtype": self.dtype,
             "shape": self.shape, "numel": self.numel, "module_b": self.module_b, "index_b": self.index_b,
             "region_a": [{"index": i, "op": o} for i, o in self.region_a],
             "region_b": [{"index": i, "op": o} for i, o in self.region_b], "outside_input": self.outside_input}
        m = self.diff.to_dict() if self.diff is not None else {}
        for k in ("reason", "max_abs", "max_ulp", "max_ulp_raw", "sign_flips", "max_rel", "mismatched", "nan_mismatch",
                  "first_index", "first_a", "first_b", "first_a_bits", "first_b_bits"):
            d[k] = m.get(k)
        d["metrics_available"] = self.diff is not None
        d["shards"] = self.shards
        d["routing"] = self.routing
        return d


@dataclass
class BisectResult:
    verdict: str  # "identical" | "diverged" | "within_tolerance" | "inconclusive" (divtrace.compare.verdict)
    compared: int
    first: Divergence | None
    next: list[Divergence]
    settings: list[dict]
    final: dict | None
    labels: tuple[str, str]
    paths: tuple[str, str]
    metrics_available: bool
    complete: tuple[bool, bool]
    unmatched: dict
    warnings: list[str] = field(default_factory=list)
    hint: str | None = None
    bitwise_differs: int = 0
    tolerance: dict | None = None
    compiled: dict | None = None  # traces recorded inside compiled code: divtrace.compare.compiled_report
    reason: str = ""  # why this verdict (and, when inconclusive, what to do next)
    coverage: Coverage | None = None
    absorbed: list = field(default_factory=list)  # differences that reach no output (verdict "absorbed")
    parameters: dict | None = None  # the runs' parameters compared by name (divtrace.compare.params)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "alignment": "calls", "reason": self.reason,
                "coverage": self.coverage.to_dict() if self.coverage else None, "compared": self.compared,
                "first": self.first.to_dict() if self.first else None,
                "next": [d.to_dict() for d in self.next], "final": self.final, "settings_diff": self.settings,
                "labels": {"a": self.labels[0], "b": self.labels[1]}, "traces": {"a": self.paths[0], "b": self.paths[1]},
                "metrics_available": self.metrics_available,
                "complete": {"a": self.complete[0], "b": self.complete[1]}, "unmatched_calls": self.unmatched,
                "bitwise_differs": self.bitwise_differs, "tolerance": self.tolerance,
                "warnings": self.warnings, "hint": self.hint, "compiled": self.compiled,
                "absorbed": list(self.absorbed), "parameters": self.parameters}
