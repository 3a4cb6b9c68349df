"""Import a repro directory (`divtrace repro` layout) and a patch file, and check that they fit together.

repro.py is generated code the user chose to run, and the patch is the user's own file: both are imported by
path with importlib and only their functions are called. Nothing else is executed.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from divtrace.errors import DivtraceError

REQUIRED = ("INPUT_NAMES", "side_a", "side_b", "SETTINGS_A", "SETTINGS_B", "load_inputs", "random_inputs", "run_side")
SIDES = ("a", "b")


def import_file(path: Path, what: str):
    """Import one .py file as a fresh module (a unique name, so two repros never share module state)."""
    if not path.is_file():
        raise DivtraceError(f"{path}: no such file ({what})")
    name = f"_divtrace_verify_{abs(hash(str(path.resolve())))}_{len(sys.modules)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise DivtraceError(f"{path}: cannot be imported ({what})")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle-free helpers inside may look themselves up here
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise DivtraceError(f"{path}: importing it raised {type(e).__name__}: {e}") from None
    return module


def param_names(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


@dataclass
class Repro:
    """A loaded repro: its manifest, its module, and how to run each side under that side's settings."""

    path: Path
    manifest: dict
    module: object
    notes: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, path) -> "Repro":
        d = Path(path)
        if not d.is_dir():
            raise DivtraceError(f"{d}: not a directory (expected a repro written by `divtrace repro ... --out DIR`)")
        mf = d / "manifest.json"
        if not mf.is_file():
            raise DivtraceError(f"{d}: no manifest.json (not a divtrace repro directory)")
        try:
            manifest = json.loads(mf.read_text())
        except (OSError, ValueError) as e:
            raise DivtraceError(f"{mf}: not valid JSON: {e}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != "divtrace-repro":
            raise DivtraceError(f"{mf}: format is not 'divtrace-repro'")
        notes = []
        if manifest.get("version") != 1:
            notes.append(f"manifest version {manifest.get('version')!r}; this divtrace knows version 1")
        if not isinstance(manifest.get("inputs"), list):
            raise DivtraceError(f"{mf}: 'inputs' must be a list of input specs")
        try:
            module = import_file(d / "repro.py", "the repro script")
        except DivtraceError as e:  # an error, never "still differs": say which interpreter can run it
            wrote = (manifest.get("python") or {}).get("executable")
            if wrote and wrote != sys.executable:
                raise DivtraceError(f"{e}; divtrace wrote it under {wrote}: verify it with that interpreter's "
                                    "divtrace") from None
            raise
        missing = [n for n in REQUIRED if not hasattr(module, n)]
        if missing:
            raise DivtraceError(f"{d / 'repro.py'}: missing {', '.join(missing)} (not a divtrace repro script?)")
        r = cls(d, manifest, module, notes)
        names = list(module.INPUT_NAMES)
        for s in SIDES:
            got = param_names(r.side_fn(s))
            if got != names:
                raise DivtraceError(f"{d / 'repro.py'}: side_{s} takes {got} but INPUT_NAMES is {names}")
        return r

    @property
    def input_names(self) -> list[str]:
        return list(self.module.INPUT_NAMES)

    def side_fn(self, side: str):
        return getattr(self.module, f"side_{side}")

    def settings(self, side: str) -> dict:
        return getattr(self.module, f"SETTINGS_{side.upper()}")

    def run(self, fn, side: str, inputs: dict):
        """fn under `side`'s settings, on private copies so an in-place op can't leak into the next run."""
        return self.module.run_side(fn, self.settings(side), {k: _clone(v) for k, v in inputs.items()})

    def recorded_inputs(self) -> dict:
        return self.module.load_inputs()

    def random_inputs(self, seed: int, shapes: dict | None = None) -> dict:
        return self.module.random_inputs(seed, shapes=shapes) if shapes else self.module.random_inputs(seed)

    def expected(self) -> dict:
        from safetensors.torch import load_file

        p = self.path / "expected.safetensors"
        return load_file(p) if p.is_file() else {}

    def region(self) -> str:
        o = self.manifest.get("origin") or {}
        mod = o.get("module")
        where = (mod or "<root>") if mod is not None else "?"
        call = f" call {o['call']}" if o.get("call") is not None else ""
        return f"{where}{call}"


def _clone(v):
    import torch

    return v.clone() if isinstance(v, torch.Tensor) else v


def load_patch(spec: str, repro: Repro, side: str):
    """FILE.py:FUNC, with exactly the parameters of the side it replaces."""
    if side not in SIDES:
        raise DivtraceError(f"--side must be a or b, got {side!r}")
    if ":" not in spec:
        raise DivtraceError(f"--patch {spec!r}: expected FILE.py:FUNC")
    file, _, func = spec.rpartition(":")
    if not func.isidentifier():
        raise DivtraceError(f"--patch {spec!r}: {func!r} is not a function name")
    module = import_file(Path(file), f"--patch {spec}")
    fn = getattr(module, func, None)
    if not callable(fn):
        raise DivtraceError(f"{spec}: {file} has no function {func!r}")
    expected = param_names(repro.side_fn(side))
    try:
        got = param_names(fn)
    except (TypeError, ValueError):
        got = None
    if got != expected:
        raise DivtraceError(f"{spec}: signature does not match side_{side} of {repro.path / 'repro.py'}: expected "
                            f"parameters ({', '.join(expected)}), got ({', '.join(got or ['?'])})")
    return fn
