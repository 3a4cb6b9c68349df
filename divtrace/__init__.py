"""divtrace: find where an inference run and a training run of the same model first diverge, bit for bit.

record -> trace -> compare/bisect -> repro -> verify. Heavy pieces are imported lazily so `import divtrace`
stays light.
"""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["record", "routed", "open_trace", "bisect", "DivtraceError", "__version__"]

# `divtrace.record` is this function, not the package divtrace/record/ it lives in: importing the package here
# (light: it imports torch only when record() runs) lets Python set its attribute on divtrace now, once, and the
# name is then bound to the function. So code imports from the package with `from divtrace.record import x`,
# never `import divtrace.record.x as y` (which would look the attribute up and find the function).
from divtrace.record import record  # noqa: E402


def __getattr__(name):
    if name == "open_trace":  # a trace directory, or a run directory (one trace per rank) seen as one trace
        from divtrace.align.shards.open import open_side

        return open_side
    if name == "bisect":
        from divtrace.compare.bisect import bisect

        return bisect
    if name == "routed":  # the routing of expert-parallel rows (docs/sharded.md, "Routed rows")
        from divtrace.record import routed

        return routed
    if name == "routing":  # routing replay for MoE routers (divtrace/routing.py)
        import importlib

        return importlib.import_module("divtrace.routing")
    if name == "DivtraceError":
        from divtrace.errors import DivtraceError

        return DivtraceError
    raise AttributeError(f"module 'divtrace' has no attribute {name!r}")
