"""divtrace show: what a trace holds."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Annotated

import typer

from divtrace.cli.output import Output


def trace_summary(t) -> dict:
    calls = Counter(c.module for c in t.calls.values())
    ops = Counter(op for op in t.rop if op is not None)  # the compact index: no record objects built
    files = {p.name: p.stat().st_size for p in t.path.iterdir() if p.is_file() and not p.name.startswith(".")}
    meta = {k: v for k, v in t.meta.items() if k not in ("module_tree",)}
    return {"path": str(t.path), "meta": meta, "complete": t.complete, "status": getattr(t, "status", None),
            "warnings": list(getattr(t, "warnings", [])), "records": len(t.records),
            "ops": sum(ops.values()), "module_calls": len(t.calls), "values": len(t.values),
            "stored_bytes": sum(files.values()), "files": files,
            "module_tree": [{"module": m, "class": c, "calls": calls.get(m, 0)} for m, c in t.meta.get("module_tree", [])],
            "top_ops": ops.most_common(15)}


def show(
    trace: Annotated[Path, typer.Argument(metavar="TRACE", help="trace directory")],
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    check: Annotated[bool, typer.Option("--check", help="verify every stored tensor against its fingerprint and "
                                                        "every token file against its checksum")] = False,
):
    """Show a trace: run metadata, record count, the module tree with call counts, sizes.

    \b
    Examples:
      divtrace show runs/train
      divtrace show runs/train --json
      divtrace show runs/train --check
    """
    from divtrace.trace.reader import Trace
    from divtrace.trace.check import check_trace

    o = Output(json_out)
    t = Trace(trace)
    check_result = check_trace(t) if check else None  # (first: reading the token files may add a warning)
    s = trace_summary(t)
    if check_result is not None:
        s["check"] = check_result
    if json_out:
        o.json(s)
    else:
        m = t.meta
        o.line(f"trace {t.path}  label={t.label}  mode={t.mode}  format_version={m.get('format_version')}  "
               f"status={getattr(t, 'status', m.get('status'))}{'' if t.complete else '  (INCOMPLETE)'}")
        o.line(f"torch {m.get('torch_version')}  device {m.get('device')}  hashing {m.get('hash_impl', '?')}  "
               f"model {m.get('model_class')}  "
               f"entry {m.get('entry') or '-'}")
        o.line(f"{s['records']} records: {s['ops']} ops, {s['module_calls']} module calls, {s['values']} values; "
               f"{s['stored_bytes'] / 1e6:.2f} MB on disk")
        o.table("settings", ["setting", "value"], [[k, v] for k, v in sorted(m.get("settings", {}).items())])
        o.table("module tree", ["module", "class", "calls"],
                [[r["module"] or "<root>", r["class"], r["calls"]] for r in s["module_tree"]])
        o.table("most frequent ops", ["op", "count"], [list(x) for x in s["top_ops"]])
        for w in list(m.get("warnings") or []) + list(getattr(t, "warnings", [])):
            o.warn(w)
        if check_result is not None:
            if check_result["ok"]:
                views = check_result["views"]
                tok = check_result["tokens"]
                o.passed(f"{check_result['tensors']} stored tensors match their fingerprints"
                         + (f"; {views} views stored as their op agree with their fingerprints" if views else "")
                         + (f"; token files: {tok['grids']} grids, {tok['rows']} row fingerprints of "
                            f"{tok['values_with_rows']} values " + ("match their sha256 and their records" if
                                                                    tok["verified"] else "agree with their records "
                                                                    "(unverified: no checksums)") if tok else ""))
            else:
                o.failed(f"{len(check_result['problems'])} problems: {check_result['problems'][0]}")
    return 0 if check_result is None or check_result["ok"] else 1
