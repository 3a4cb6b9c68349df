"""What bisect says about traces recorded inside compiled code (meta["compiled"]): where it had to stop (no
op-level records on a compiled side), the Inductor kernel that computed the diverging module output, and the
next step. Reads only the traces' JSON (no torch)."""
from __future__ import annotations

import shlex


def _side(t) -> dict | None:
    c = t.meta.get("compiled")
    return c if isinstance(c, dict) and c.get("recorded") == "compiled" else None


def annotate(ta, tb, first) -> tuple[dict | None, str | None]:
    """({"a": ..., "b": ..., "stopped_at_module", "kernel"}, hint) for a bisect of `ta` and `tb` whose first
    divergence is `first` (a Divergence or None); (None, None) when neither trace was recorded inside compiled
    code."""
    ca, cb = _side(ta), _side(tb)
    if ca is None and cb is None:
        return None, None
    info = {"a": "compiled" if ca else "eager", "b": "compiled" if cb else "eager",
            "graph_breaks": {s: len(c.get("graph_breaks") or []) for s, c in (("a", ca), ("b", cb)) if c},
            "stopped_at_module": False, "kernel": None}
    if first is None:
        return info, None
    kernels = {}
    for s, c in (("a", ca), ("b", cb)):
        if c:
            module = first.module if s == "a" else (first.module_b or first.module)
            per = (c.get("kernels") or {}).get(module) or {}
            key = first.tensor if first.tensor in per else next(iter(per), None)
            if key is not None and first.tensor in per:
                kernels[s] = {"module": module, "tensor": key, **per[key]}
    info["kernel"] = kernels or None
    parts = []
    if first.kind == "module":
        info["stopped_at_module"] = True
        sides = " and ".join(s for s, c in (("a", ca), ("b", cb)) if c)
        parts.append(f"bisect stops at module {first.module or '<root>'}: side {sides} was recorded inside compiled "
                     "code, which has no op-level records (Inductor fuses the ops into kernels)")
    for s, k in kernels.items():
        what = f"kernel {k['kernel']}"
        if k.get("source_nodes") or k.get("aten"):
            what += f" (FX nodes {', '.join(k.get('source_nodes') or [])}; aten {', '.join(k.get('aten') or [])})"
        parts.append(f"on side {s} its {k['tensor']} was computed by {what}")
    if first.kind == "module" and first.cause == "origin":
        parts.append("next: divtrace repro " + " ".join(shlex.quote(str(t.path)) for t in (ta, tb))
                     + " --out DIR writes the module's eager code against the same code under torch.compile, run on "
                     "the recorded inputs (needs full-mode traces)")
    return info, "; ".join(parts) if parts else None
