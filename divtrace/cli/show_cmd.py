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


def run_summary(view) -> dict:
    """A run directory: its ranks (status, records, layouts, collectives), groups and meshes."""
    run = view.run
    ranks = []
    for r in range(run.world_size):
        t = run.traces.get(r)
        if t is None:
            ranks.append({"rank": r, "present": False})
            continue
        lay = run.layouts[r]
        ranks.append({"rank": r, "present": True, "status": t.status, "complete": t.complete, "records": len(t.rcall),
                      "layouts": len(lay.values), "blocks": sum(1 for v in lay.values.values() if v.sharded),
                      "collectives": len(lay.collectives)})
    meshes = {(tuple(m.shape), tuple(m.dims), tuple(m.ranks), m.group) for lay in run.layouts.values()
              for m in lay.meshes.values()}
    return {"path": str(view.path), "run": True, "world_size": run.world_size, "complete": view.complete,
            "status": view.status, "groups": [g.ranks for g in view.groups], "ranks": ranks,
            "meshes": [{"shape": list(s), "dims": list(d), "ranks": list(r), "group": g} for s, d, r, g in sorted(
                meshes, key=str)], "replicas_differ": list(view.findings),
            "parted": [str(x) for x in view.meta.get("parted") or []]}


def _show_run(o: Output, view, check: bool, json_out: bool) -> int:
    from divtrace.trace.check import check_trace

    s = run_summary(view)
    checks = {r: check_trace(t) for r, t in view.run.traces.items()} if check else None
    if checks is not None:
        s["check"] = {str(r): c for r, c in checks.items()}
    if json_out:
        o.json(s)
    else:
        o.line(f"run {view.path}  world size {s['world_size']}  groups {s['groups']}  status={s['status']}"
               + ("" if view.complete else "  (INCOMPLETE)"))
        o.table("ranks", ["rank", "status", "records", "values with a layout", "blocks", "collectives"],
                [[x["rank"], x.get("status", "no trace"), x.get("records", "-"), x.get("layouts", "-"),
                  x.get("blocks", "-"), x.get("collectives", "-")] for x in s["ranks"]])
        o.table("meshes and groups", ["shape", "dims", "ranks", "group"],
                [[m["shape"], m["dims"], m["ranks"], m["group"] or "-"] for m in s["meshes"]])
        for f in s["replicas_differ"]:
            o.warn(f)
        for p in s["parted"]:  # (bisect: coverage.parted; nothing past it can be compared)
            o.warn(f"{p}: past that record their values cannot be put together, so bisect compares nothing there")
        if checks is not None:
            bad = {r: c for r, c in checks.items() if not c["ok"]}
            if bad:
                r, c = next(iter(bad.items()))
                o.failed(f"rank {r}: {len(c['problems'])} problems: {c['problems'][0]}")
            else:
                o.passed(f"every rank's stored tensors match their fingerprints "
                         f"({sum(c['tensors'] for c in checks.values())} tensors)")
    return 0 if checks is None or all(c["ok"] for c in checks.values()) else 1


def show(
    trace: Annotated[Path, typer.Argument(metavar="TRACE", help="trace directory, or a run directory (RUN/rank-K)")],
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    check: Annotated[bool, typer.Option("--check", help="verify every stored tensor against its fingerprint and "
                                                        "every token file against its checksum")] = False,
):
    """Show a trace: run metadata, record count, the module tree with call counts, sizes. A run directory (one
    trace per rank: docs/sharded.md) shows its ranks, their status and layouts, and the meshes they use.

    \b
    Examples:
      divtrace show runs/train
      divtrace show runs/train --json
      divtrace show runs/train --check
      divtrace show runs/tp2
    """
    from divtrace.trace.reader import Trace
    from divtrace.trace.check import check_trace
    from divtrace.trace.run import is_run_dir

    o = Output(json_out)
    if is_run_dir(trace):
        from divtrace.align.shards import open_side

        return _show_run(o, open_side(trace), check, json_out)
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
