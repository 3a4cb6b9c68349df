"""divtrace verify: does a fix hold? Bitwise on the recorded inputs, fresh random trials and a shape sweep; the same
function as an fp64 reference; how fast; and, end to end, whether re-recorded runs come out identical.

`checks` (bitwise), `reference` (fp64 gate), `profile` (timing), `end_to_end` (re-record + bisect); `loading`
imports a repro directory and a patch file. Nothing here imports torch at package import.

In: a repro directory (divtrace.repro) and a patch, or an entry point to re-record both sides of (divtrace.record,
compared by divtrace.compare). Out: a VerifyResult of PASSED / FAILED checks.
"""
from __future__ import annotations

__all__ = ["verify_repro", "verify_runs"]


def __getattr__(name):
    if name == "verify_repro":
        from divtrace.verify.run import verify_repro

        return verify_repro
    if name == "verify_runs":
        from divtrace.verify.end_to_end import verify_runs

        return verify_runs
    raise AttributeError(f"module 'divtrace.verify' has no attribute {name!r}")
