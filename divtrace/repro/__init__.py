"""divtrace repro: a standalone script (plain torch + safetensors) that reproduces one divergence.

`write_repro(a, b, out)` picks the region (`region`), writes its code (`codegen`, `harness`) and data, and checks
that each side replays its recorded output bit for bit (`writer`); `inputs` stores the region's inputs and
expected outputs. audit replays recorded ops with this package's code generation (divtrace.audit.replay).

In: two traces and their first divergence (divtrace.compare), or a record index. Out: a repro directory
(repro.py, inputs.safetensors, expected.safetensors, manifest.json) that runs without divtrace, and a ReproResult.
"""
from __future__ import annotations

__all__ = ["write_repro", "ReproResult"]


def __getattr__(name):
    if name in __all__:
        from divtrace.repro import writer

        return getattr(writer, name)
    raise AttributeError(f"module 'divtrace.repro' has no attribute {name!r}")
