"""Engine adapters: `divtrace.record` given an inference engine object rather than a `torch.nn.Module`.

An adapter finds the engine's model, checks that the engine is set up so that recording sees every computation
(refusing with one line naming the setting otherwise), declares each forward's token rows from the engine's
batch, and records the engine's settings in the trace's metadata. Engine packages are imported only when an
engine object is passed (detected by its class's module, without importing the engine).

In: an engine object and `record()`'s arguments. Out: a Recorder for it (an adapter subclasses
divtrace.record.recorder.Recorder), or None. This module is the registry: adapters depend on the recorder and
register here (`register`); the recorder never imports an adapter. The adapters that ship with divtrace
(`vllm`) are registered below and imported when an object of their engine is passed.
"""
from __future__ import annotations

from typing import Callable

# engine package (the top-level module of the engine object's class) -> [(accepts(engine), factory(engine, path,
# **record kwargs) -> Recorder)]
_ADAPTERS: dict[str, list[tuple[Callable, Callable]]] = {}


def register(package: str, accepts: Callable, factory: Callable) -> None:
    """Make `record(engine, path, ...)` use `factory(engine, path, **kwargs)` for an engine object whose class
    lives in `package` and for which `accepts(engine)` holds."""
    _ADAPTERS.setdefault(package, []).append((accepts, factory))


def engine_recorder(engine, path, **kwargs):
    """A Recorder for `engine`, or None when it is no engine divtrace knows."""
    package = (type(engine).__module__ or "").split(".")[0]
    for accepts, factory in _ADAPTERS.get(package, ()):
        if accepts(engine):
            return factory(engine, path, **kwargs)
    return None


def _vllm(llm, path, **kwargs):
    from divtrace.record.engines.vllm import VllmRecorder  # (torch and the adapter: only for a vllm.LLM)

    return VllmRecorder(llm, path, **kwargs)


register("vllm", lambda llm: hasattr(llm, "llm_engine"), _vllm)


# The module whose import registers an engine's compiled kernels as torch ops (what a repro script imports to
# replay one of them outside the engine), by the op's namespace; keyed by the engine's name in meta.json.
CUSTOM_OP_MODULES = {
    "vllm": {"_C": "vllm._custom_ops", "_C_cache_ops": "vllm._custom_ops", "_C_utils": "vllm._custom_ops",
             "_C_cpu": "vllm._custom_ops", "_moe_C": "vllm._custom_ops"},
}


def custom_op_module(meta: dict, op: str) -> str | None:
    """The module that defines custom op `op` ("ns.name.overload") of the engine a trace's meta names, or None."""
    engine = meta.get("engine")
    if not isinstance(engine, dict):
        return None
    return CUSTOM_OP_MODULES.get(engine.get("name"), {}).get(op.split(".")[0])
