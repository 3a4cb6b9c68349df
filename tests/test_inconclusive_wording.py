"""Issue 33, item 6: the wording of every inconclusive reason, checked word for word against what is true.

`decide` (divtrace.compare.verdict) makes every inconclusive reason of bisect, repro and verify --runs from one
clause per cause; `progress` says how far a stopped trace got. Each clause is checked whole here, and `progress`
on real stopped recordings, its counts computed from the traces with plain code. (The token-aligned reasons of a
killed rollout against a trainer: tests/test_token_kills.py; audit's: tests/test_audit_inconclusive.py.)
"""
from __future__ import annotations

import pytest
import torch

import divtrace
from divtrace.compare.verdict import INCONCLUSIVE, TraceSeen, decide, progress
from divtrace.trace.reader import Trace
from test_trace_fixtures import Tiny, tiny_input

RERECORD = "re-record it to its end (a run that finishes closes its trace as complete) and compare again"


def _seen(side, complete=True, status="complete", error=None, prog=None, unseen=()):
    return TraceSeen(side, f"runs/{side}", complete, status, error, prog, list(unseen))


def _reason(**kw):
    args = dict(origin_found=False, within_tolerance=False, final_compared=True, final_equal=True,
                a=_seen("a"), b=_seen("b"), calls_compared=10)
    args.update(kw)
    v = decide(**args)
    assert v.verdict == INCONCLUSIVE and v.exit_code == 3
    return v.reason


def test_every_clause_of_decide_word_for_word():
    assert _reason(b=_seen("b", False, "terminated", "SIGTERM", "stopped in root call 1 of 2 after 3 of the "
                                                                  "reference's 8 module calls; last module lin")) == (
        "trace runs/b is incomplete (status: terminated, SIGTERM): stopped in root call 1 of 2 after 3 of the "
        f"reference's 8 module calls; last module lin, and no divergence was found before it stopped; {RERECORD}")
    assert _reason(a=_seen("a", unseen=["CUDA-graph replays: 3 decode steps"])) == (
        "trace runs/a ran computation divtrace did not see (CUDA-graph replays: 3 decode steps): what was compared "
        "may not be what ran; record it eagerly (no torch.compile regions without taps, no CUDA-graph replays) to "
        "compare every step")
    assert _reason(final_compared=False, final_equal=None, final_note="b made 2 root calls") == (
        "the final outputs were not compared (b made 2 root calls); make both runs make the same calls (or pass "
        "--map FILE where the stacks name modules differently)")
    assert _reason(final_compared=False, final_equal=None) == (
        "the final outputs were not compared (no final output pair); make both runs make the same calls (or pass "
        "--map FILE where the stacks name modules differently)")
    assert _reason(final_equal=False) == (
        "the final outputs differ but no divergence was localized (please report this)")
    # Causes together: each clause once, "; "-joined, incomplete traces first.
    both = _reason(a=_seen("a", False, "running"), b=_seen("b", unseen=["x"]))
    assert both.split("; ")[0] == "trace runs/a is incomplete (status: running), and no divergence was found before " \
                                  "it stopped" and "trace runs/b ran computation divtrace did not see (x)" in both


def _run(path, calls: int, stop_in: int | None = None, stop_after: int | None = None, model=None):
    """`calls` root calls of the tiny model; an exception inside root call `stop_in` (1-based: the trace closes
    with status error inside it) or between root call `stop_after` and the next."""
    model = model or Tiny()

    class Stop(Exception):
        pass

    def boom(m, a):
        raise Stop("stopped on purpose")

    try:
        with torch.no_grad(), divtrace.record(model, path, mode="hash"):
            for i in range(1, calls + 1):
                if i == stop_in:
                    h = model.act.register_forward_pre_hook(boom)
                try:
                    model(tiny_input(i))
                finally:
                    if i == stop_in:
                        h.remove()
                if i == stop_after:
                    raise Stop("between calls")
    except Stop:
        pass
    return Trace(path)


class Wide(torch.nn.Module):
    """Another model (other modules, other calls): not the same work as Tiny's."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 16)
        self.extra = torch.nn.Linear(16, 16)
        self.act = torch.nn.GELU()
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.act(self.extra(self.lin(x))))


def _truth(t):
    calls = sorted(t.calls.values(), key=lambda c: c.enter_index)
    roots = [c for c in calls if c.parent is None]
    open_ = [c for c in calls if c.exit_index is None]
    return roots, calls, (open_[-1] if open_ else calls[-1]).module or "<root>"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("wording")
    return {"ref": _run(d / "ref", 3), "in2": _run(d / "in2", 3, stop_in=2),
            "after1": _run(d / "after1", 3, stop_after=1), "wide": _run(d / "wide", 1, model=Wide()),
            "wide_in1": _run(d / "wide_in1", 1, stop_in=1, model=Wide())}


def test_progress_against_the_same_work(runs):
    ref = runs["ref"]
    ref_roots, ref_calls, _ = _truth(ref)
    t = runs["in2"]
    roots, calls, last = _truth(t)
    # The stop was inside root call 2: it returned with an error, and it holds fewer calls than the reference's.
    assert len(roots) == 2 and len(calls) < 2 * len(ref_calls) // 3
    assert progress(t, ref) == (f"stopped in root call 2 of {len(ref_roots)} after {len(calls)} of the reference's "
                                f"{len(ref_calls)} module calls; last module {last}")
    t = runs["after1"]
    roots, calls, last = _truth(t)
    assert len(roots) == 1 and roots[0].exit_index is not None
    assert progress(t, ref) == (f"stopped after root call 1 of {len(ref_roots)} after {len(calls)} of the "
                                f"reference's {len(ref_calls)} module calls; last module {last}")
    # Measured against a trace that is itself incomplete: said so.
    assert progress(runs["after1"], runs["in2"]).startswith(
        f"stopped after root call 1 of 2 after {len(calls)} of the other trace's (itself incomplete) ")


def test_progress_against_other_work_says_only_what_is_true(runs):
    """A stopped Tiny run against one Wide forward: its calls are not the other's first calls, so no "k of N".
    Root call 2 of "in2" returned (raising: the status says so), so it stopped after it; with no reference to
    measure against, "in" is said only of a root call that never returned."""
    wide_roots, wide_calls, _ = _truth(runs["wide"])
    for name, where in (("in2", "after its root call 2"), ("after1", "after its root call 1")):
        t = runs[name]
        roots, calls, last = _truth(t)
        assert progress(t, runs["wide"]) == (
            f"stopped {where} after {len(calls)} module calls; last module {last} (the reference holds 1 root call "
            f"and {len(wide_calls)} module calls, not these: how far it got cannot be measured against it)")
    # ... and the other way round, against a stopped trace.
    roots, calls, last = _truth(runs["wide_in1"])
    assert progress(runs["wide_in1"], runs["in2"]) == (
        f"stopped after its root call 1 after {len(calls)} module calls; last module {last} (the other trace (itself "
        f"incomplete) holds 2 root calls and {len(runs['in2'].calls)} module calls, not these: how far it got "
        "cannot be measured against it)")


def test_progress_of_a_trace_with_no_call(tmp_path, runs):
    t = _run(tmp_path / "none", 0)
    assert not t.calls
    assert progress(t, runs["ref"]) == (f"stopped before its first module call was written (the reference's "
                                        f"{len(runs['ref'].calls)} module calls)")
