"""On-disk traces: `TraceWriter` streams records and tensors, `Trace` reads them back lazily."""
from divtrace.trace.reader import Trace, open_trace
from divtrace.trace.writer import TraceWriter

__all__ = ["Trace", "TraceWriter", "open_trace"]
