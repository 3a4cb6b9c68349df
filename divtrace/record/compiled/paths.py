"""Module paths without torch.compile's wrappers, and where a model is compiled.

`torch.compile(module)` returns an OptimizedModule that holds the module as `_orig_mod`, so `named_modules()` of a
compiled model prefixes every path with `_orig_mod.` (and a compiled submodule puts `._orig_mod` in the middle).
divtrace strips it **at record time**: the wrapper is not a module call of its own (its `_orig_mod` takes its
place and its path), so a compiled and an eager model of the same code record the same paths and align without
`--map`. Only an attribute that really is an OptimizedModule's `_orig_mod` is stripped; a user module that happens
to be named `_orig_mod` keeps its name.
"""
from __future__ import annotations


def is_wrapper(m) -> bool:
    """Whether `m` is torch.compile's OptimizedModule (checked by name: importing torch._dynamo costs seconds)."""
    return type(m).__name__ == "OptimizedModule" and hasattr(m, "_orig_mod")


def unwrap(m):
    while is_wrapper(m):
        m = m._orig_mod
    return m


def recorded_modules(model) -> list:
    """(path, module) like `model.named_modules()`, each torch.compile wrapper replaced by the module it wraps
    (under the wrapper's path). The first entry is the root ("")."""
    out, seen = [], set()
    root = unwrap(model)
    stack = [("", root)]
    while stack:
        p, mod = stack.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        out.append((p, mod))
        kids = []
        for name, child in mod._modules.items():
            if child is None:
                continue
            kids.append((f"{p}.{name}" if p else name, unwrap(child)))
        stack.extend(reversed(kids))
    return out


def compiled_regions(model) -> list[dict]:
    """Where `model` is torch.compile'd: [{"path", "how", "backend", "options"}] for each wrapper
    (torch.compile(module)) and each module compiled in place (module.compile())."""
    regions = []
    root = model

    def visit(m, path):
        if is_wrapper(m):
            regions.append({"path": path, "how": "torch.compile(module)", **backend_of(getattr(m, "dynamo_ctx", None))})
        inner = unwrap(m)
        fn = getattr(inner, "_compiled_call_impl", None)
        if fn is not None:
            regions.append({"path": path, "how": "module.compile()", **backend_of(fn)})

    stack = [("", root)]
    seen = set()
    while stack:
        p, m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        visit(m, p)
        inner = unwrap(m)
        for name, child in reversed(list(inner._modules.items())):
            if child is not None:
                stack.append((f"{p}.{name}" if p else name, child))
    return regions


def backend_of(obj) -> dict:
    """The compiler a compiled callable uses and the options it was given (mode="max-autotune" is options),
    found by walking the wrappers torch.compile puts around it. {"backend": None, "options": {}} when it cannot
    be told."""
    seen, todo = set(), [(obj, 0)]
    while todo:
        o, depth = todo.pop()
        if o is None or id(o) in seen or depth > 8:
            continue
        seen.add(id(o))
        if type(o).__name__ == "_TorchCompileInductorWrapper":
            return {"backend": getattr(o, "compiler_name", "inductor"), "options": dict(getattr(o, "config", {}) or {})}
        for a in ("callback", "_torchdynamo_orig_backend", "_torchdynamo_orig_callable"):
            nxt = getattr(o, a, None)
            if nxt is not None:
                todo.append((nxt, depth + 1))
        for cell in getattr(o, "__closure__", None) or ():
            try:
                todo.append((cell.cell_contents, depth + 1))
            except ValueError:
                pass
        if callable(o) and depth > 0 and not hasattr(o, "_torchdynamo_orig_backend") and \
                type(o).__name__ == "function" and getattr(o, "__module__", "").startswith("torch._dynamo.backends"):
            return {"backend": o.__name__, "options": {}}
    return {"backend": None, "options": {}}
