"""divtrace repro: a standalone script that reproduces one divergence, with the tensors it needs."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from divtrace.cli.bisect_cmd import MAP_HELP
from divtrace.cli.output import Output


def repro(
    a: Annotated[Path, typer.Argument(metavar="A", help="trace of side a (e.g. training), or a run directory (one trace per rank)")],
    b: Annotated[Path, typer.Argument(metavar="B", help="trace of side b (e.g. inference), or a run directory")],
    out: Annotated[Path, typer.Option("--out", "-o", help="directory to write repro.py and its data into")],
    at: Annotated[Optional[int], typer.Option("--at", help="record index of side a (an op or a module call's "
                                                          "exit) to reproduce instead of the first divergence")] = None,
    map_file: Annotated[Optional[Path], typer.Option("--map", help=MAP_HELP)] = None,
    imports: Annotated[Optional[list[str]], typer.Option("--import", help="module that defines a custom op the "
                                                                          "region calls (repeatable)")] = None,
    overwrite: Annotated[bool, typer.Option(help="replace a repro already in --out")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable summary (the manifest)")] = False,
):
    """Write DIR/repro.py: both sides of the first divergence as plain torch code, on the recorded tensors.

    The script needs only torch and safetensors. `python DIR/repro.py` exits 1 while the sides differ,
    0 once they are bitwise equal, 2 when it cannot run (no torch, a custom op's module missing: the wrong
    interpreter); `--trials N` adds random inputs. The PASSED line names an interpreter that runs it. Before writing, divtrace runs each side
    and checks that it reproduces that side's recorded output bit for bit. Exit 0 written and reproduces,
    1 written but a side does not reproduce (see the FAILED line), 2 bad input (e.g. hash-only traces, an
    --out that cannot be written), 3 no divergence to reproduce and the comparison is inconclusive (a trace
    stopped early: see `divtrace bisect`).

    \b
    Examples:
      divtrace repro runs/train runs/infer --out repro/
      python repro/repro.py --trials 5
      divtrace repro runs/train runs/infer --at 412 --out repro-o_proj/
      divtrace repro runs/train runs/infer --out repro/ --import mykernels.ops
    """
    from divtrace.align.paths import PathMap
    from divtrace.repro.writer import write_repro

    from divtrace.align.shards import open_side

    o = Output(json_out)
    path_map = PathMap.from_file(map_file) if map_file else None
    ta, tb = open_side(a), open_side(b)  # a trace, or a run directory (docs/sharded.md)
    r = write_repro(ta, tb, out, at=at, path_map=path_map, imports=imports or [], overwrite=overwrite)
    m = r.manifest
    for t in (ta, tb):
        if not t.complete:  # what was recorded ran, so the divergence is real; later ones may be missing
            r.warnings.append(f"trace {t.path} is incomplete (status: {t.status}): the divergence reproduced is real, "
                              "but the recording stopped before its end")
    for w in r.warnings:
        o.warn(w)
    if json_out:
        o.json({"out": str(r.out), "reproduces": r.ok, "explanation": r.explanation, "notes": r.notes, **m})
        return r.exit_code
    org = m["origin"]
    o.line(f"wrote {r.out / 'repro.py'} (+ inputs.safetensors, expected.safetensors, manifest.json)")
    o.table("repro of " + f"{org['module'] or '<root>'} call {org['call']}", ["", "side a", "side b"], [
        ["ops (diverging call -> repro)", f"{m['ops']['a']['before']} -> {m['ops']['a']['after']}",
         f"{m['ops']['b']['before']} -> {m['ops']['b']['after']}"],
        ["parting op", org["op_a"] or "-", org["op_b"] or "-"],
        ["output", f"{m['output']['a']['dtype']} {m['output']['a']['shape']}",
         f"{m['output']['b']['dtype']} {m['output']['b']['shape']}"],
        ["replays its recorded output", "yes" if m["fidelity"]["a"] else "NO", "yes" if m["fidelity"]["b"] else "NO"],
    ])
    o.line("inputs: " + ", ".join(f"{i['name']} ({i['role']}, {i['dtype'].removeprefix('torch.')} {i['shape']})"
                                  for i in m["inputs"]))
    diff = [k for k in m["settings"]["a"] if m["settings"]["a"].get(k) != m["settings"]["b"].get(k)]
    if diff:
        o.line("each side runs under its own recorded settings; they differ in: "
               + ", ".join(f"{k} ({m['settings']['a'].get(k)} vs {m['settings']['b'].get(k)})" for k in diff))
    for c in m["custom_ops"]:
        o.line(f"custom op {c['op']}: " + (
            f"the script imports {c['module']} to define it" if c["module"] else
            f"replays only inside the engine that recorded it ({c['engine_only']})" if c.get("engine_only") else
            "NOT aten and its module is unknown (pass --import MODULE)"))
    for n in r.notes:
        o.line(f"note: {n}")
    if r.ok:
        from divtrace.repro.interpreter import run_command

        o.passed(f"both sides reproduce their recorded outputs bitwise; run: {run_command(r.out / 'repro.py')}")
    else:
        bad = [s for s in ("a", "b") if not m["fidelity"][s]]
        o.failed(f"side {' and '.join(bad)} of the repro does NOT reproduce the recorded output; the script was "
                 f"written to {r.out} for inspection but does not show the recorded divergence")
        for e in r.explanation:
            o.line(f"  - {e}")
    return r.exit_code
