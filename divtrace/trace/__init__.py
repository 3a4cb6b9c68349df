"""On-disk traces: `TraceWriter` streams records and tensors, `Trace` reads them back lazily."""
from divtrace.trace.reader import Trace, open_trace

__all__ = ["Trace", "TraceWriter", "open_trace"]


def __getattr__(name):
    # The writer imports torch; reading (and bisecting) a hash trace needs none, so it is loaded on first use.
    if name == "TraceWriter":
        from divtrace.trace.writer import TraceWriter

        return TraceWriter
    raise AttributeError(f"module 'divtrace.trace' has no attribute {name!r}")
