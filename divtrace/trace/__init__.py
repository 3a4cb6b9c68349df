"""On-disk traces: `TraceWriter` streams records and tensors, `Trace` reads them back lazily.

The format's own pieces live here too: the record types (records.py), the value fingerprint (fingerprint.py),
derived-view fingerprints (derived_views.py), token layouts (token_layout.py) and the token files' reading
(token_store.py). Writing: writer.py, over the trace directory (directory.py) and full mode's shards (shards.py).
Reading: reader.py, over meta.py, index.py, reference.py, integrity.py, record_views.py and tensors.py.

In: records and tensors from the recorder (divtrace.record), or a trace directory to read. Out: a trace directory
(docs/trace-format.md), and `Trace` objects (`divtrace.open_trace`) that alignment and comparison read. Reading
a hash trace imports no torch.
"""
from divtrace.trace.reader import Trace, open_trace

__all__ = ["Trace", "TraceWriter", "open_trace"]


def __getattr__(name):
    # The writer imports torch; reading (and bisecting) a hash trace needs none, so it is loaded on first use.
    if name == "TraceWriter":
        from divtrace.trace.writer import TraceWriter

        return TraceWriter
    raise AttributeError(f"module 'divtrace.trace' has no attribute {name!r}")
