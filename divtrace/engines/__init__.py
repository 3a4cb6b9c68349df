"""Engine adapters: `divtrace.record` given an inference engine object rather than a `torch.nn.Module`.

An adapter finds the engine's model, checks that the engine is set up so that recording sees every computation
(refusing with one line naming the setting otherwise), declares each forward's token rows from the engine's
batch, and records the engine's settings in the trace's metadata. Engine packages are imported only when an
engine object is passed (detected by its class's module, without importing the engine).
"""
from __future__ import annotations


def engine_recorder(engine, path, **kwargs):
    """A Recorder for `engine`, or None when it is no engine divtrace knows."""
    mod = type(engine).__module__ or ""
    if mod.split(".")[0] == "vllm" and hasattr(engine, "llm_engine"):
        from divtrace.engines.vllm import VllmRecorder

        return VllmRecorder(engine, path, **kwargs)
    return None
