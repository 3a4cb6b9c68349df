"""What every repro writer shares (divtrace.repro.writer, and .shards for sharded runs): the files of a repro
directory, the result, the out directory made ready, the settings a side runs under, and the script's own check
that each side reproduces its recorded output."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from divtrace.errors import DivtraceError
from divtrace.record.settings import APPLICABLE
from divtrace.trace.reader import Trace

FILES = ("repro.py", "inputs.safetensors", "expected.safetensors", "manifest.json")
SETTINGS_KNOWN = {"float32_matmul_precision", "num_threads", "cuda_matmul_allow_tf32", "cudnn_allow_tf32",
                  "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction"}


@dataclass
class ReproResult:
    out: Path
    manifest: dict
    fidelity: dict  # {"a": {"ok", "error"}, "b": ...}
    explanation: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r["ok"] for r in self.fidelity.values())

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1


def _settings(t: Trace) -> dict:
    rec = t.meta.get("settings") or {}
    return {k: rec[k] for k in APPLICABLE if k in SETTINGS_KNOWN and isinstance(rec.get(k), (bool, int, str))}


def _load(path: Path, src: str) -> dict:
    """Execute repro.py's text as a module (never as __main__): its functions, as the file defines them."""
    ns = {"__name__": "_divtrace_repro_check", "__file__": str(path)}
    exec(compile(src, str(path), "exec"), ns)
    return ns


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise DivtraceError(f"{out}: exists and is not a directory")
    if out.is_dir():
        extra = [p.name for p in out.iterdir() if p.name not in FILES and p.name != "__pycache__"]
        ours = [p.name for p in out.iterdir() if p.name in FILES]
        if extra:
            raise DivtraceError(f"{out}: directory is not empty ({', '.join(sorted(extra)[:5])}); choose a new --out")
        if ours and not overwrite:
            raise DivtraceError(f"{out}: already holds a repro; pass --overwrite to replace it")
    out.mkdir(parents=True, exist_ok=True)


def _check(path: Path, src: str) -> tuple[dict | None, dict]:
    """Run the script's own fidelity check on this source text."""
    try:
        ns = _load(path, src)
        return ns, ns["fidelity"]()
    except Exception as e:
        err = f"the script fails to load: {type(e).__name__}: {e}"
        return None, {"a": {"ok": False, "error": err}, "b": {"ok": False, "error": err}}
