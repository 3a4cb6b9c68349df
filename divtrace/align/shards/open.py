"""What a command that takes a trace opens: a trace directory as a Trace, a run directory as a RunView."""
from __future__ import annotations

from divtrace.trace.reader import Trace
from divtrace.trace.run import RunDir, is_run_dir


def open_side(x):
    """`x` if it is already a Trace (or a RunView); else the trace or run directory at path `x`."""
    if isinstance(x, Trace):
        return x
    if is_run_dir(x):
        return open_run(x)
    return Trace(x)


def open_run(path):
    from divtrace.align.shards.plan import build_plan
    from divtrace.align.shards.view import RunView

    run = RunDir(path)
    groups, findings, _ = build_plan(run)
    return RunView(run, groups, findings)
