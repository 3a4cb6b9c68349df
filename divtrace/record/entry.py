"""ENTRY resolution for `divtrace record` and `verify --runs`: `path/file.py:function` or `pkg.mod:function`.

Only the named file or module is imported and only the named function is called; nothing else is executed.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

import torch

from divtrace.errors import DivtraceError


def parse_args(pairs: list[str] | None) -> dict:
    """`--arg key=value` pairs; values are YAML scalars (1, 0.5, true, bf16)."""
    import yaml

    out = {}
    for p in pairs or []:
        if "=" not in p:
            raise DivtraceError(f"--arg {p!r}: expected key=value")
        k, v = p.split("=", 1)
        if not k.isidentifier():
            raise DivtraceError(f"--arg {p!r}: {k!r} is not a valid argument name")
        try:
            out[k] = yaml.safe_load(v) if v else ""
        except yaml.YAMLError:
            out[k] = v
    return out


def load_entry(entry: str, what: str = "ENTRY", classes: bool = False):
    """The function named by ENTRY (`what` names the option in messages; `classes`: a class is accepted too, as a
    factory whose instances are what is wanted, such as `contextlib:nullcontext` for `audit --under`)."""
    if ":" not in entry:
        raise DivtraceError(f"{what} {entry!r}: expected path/file.py:function or pkg.module:function")
    target, _, func_name = entry.rpartition(":")
    if not func_name.isidentifier() or (func_name.startswith("__") and func_name.endswith("__")):
        # Dunder names reach module machinery (__class__, __loader__), never a function the user wrote.
        raise DivtraceError(f"{what} {entry!r}: {func_name!r} is not a function name")
    try:
        module = _import(target, entry, what)
    except SyntaxError as e:  # the file (or a module it imports) is not Python: one line naming where
        raise DivtraceError(f"{what} {entry!r}: {e.filename}:{e.lineno}: {e.msg}") from None
    fn = getattr(module, func_name, None)
    if not callable(fn) or (isinstance(fn, type) and not classes) or inspect.ismodule(fn):
        raise DivtraceError(f"{what} {entry!r}: {target} has no function {func_name!r}")
    return fn


def _import(target: str, entry: str, what: str):
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target)
        if not path.is_file():
            raise DivtraceError(f"{what} {entry!r}: no such file {path}")
        mod_name = f"_divtrace_entry_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise DivtraceError(f"{what} {entry!r}: cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        sys.path.insert(0, str(path.resolve().parent))
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.resolve().parent))
        return module
    if not target or target.startswith("."):  # `:fn`, `.mod:fn`: neither a file nor an absolute module name
        raise DivtraceError(f"{what} {entry!r}: expected path/file.py:function or pkg.module:function")
    try:
        return importlib.import_module(target)
    except ImportError as e:
        raise DivtraceError(f"{what} {entry!r}: cannot import module {target!r}: {e}") from None


def build_from_entry(entry: str, args: dict | None = None):
    """Call ENTRY's function; it must return (model, inputs) with inputs a tuple/list or a dict."""
    fn = load_entry(entry)
    try:
        result = fn(**(args or {}))
    except TypeError as e:
        raise DivtraceError(f"ENTRY {entry!r}: calling it with {args or {}} failed: {e}") from None
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise DivtraceError(f"ENTRY {entry!r}: must return (model, inputs) with model a torch.nn.Module")
    model, inputs = result
    if not isinstance(inputs, (tuple, list, dict)):
        inputs = (inputs,)
    return model, inputs


GRAD_MODES = ("no_grad", "inference", "grad")


def run_model(model, inputs, grad_mode: str = "no_grad"):
    ctx = {"no_grad": torch.no_grad, "inference": torch.inference_mode, "grad": torch.enable_grad}[grad_mode]
    with ctx():
        return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def record_entry(entry: str, out, *, args: dict | None = None, mode: str = "full", ops: bool | None = None,
                 include=None, exclude=None, label=None, overwrite=False, grad_mode="no_grad", durable=False,
                 compiled: bool | None = None, params: str | None = None):
    """Build the model from ENTRY and record one forward into `out`. Returns the forward's wall time (s)."""
    import time

    from divtrace.record import record

    if grad_mode not in GRAD_MODES:
        raise DivtraceError(f"--grad-mode must be one of {', '.join(GRAD_MODES)}, got {grad_mode!r}")
    model, inputs = build_from_entry(entry, args)
    rec = record(model, out, mode=mode, ops=ops, label=label, include=include, exclude=exclude, overwrite=overwrite,
                 extra_meta={"entry": entry, "entry_args": args or {}, "grad_mode": grad_mode}, durable=durable,
                 compiled=compiled, params=params)
    with rec:
        t0 = time.perf_counter()
        run_model(model, inputs, grad_mode)
        elapsed = time.perf_counter() - t0
    return elapsed
