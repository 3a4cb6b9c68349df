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
        from divtrace.record.engines.vllm import VllmRecorder

        return VllmRecorder(engine, path, **kwargs)
    return None


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
