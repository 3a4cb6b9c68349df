"""divtrace audit: every recorded op that is not batch-invariant or not deterministic."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from divtrace.cli.output import Output


def _progress():
    """A progress line on a terminal's stderr, at most every second (a large model's audit takes minutes)."""
    last = [time.monotonic()]

    def show(k: int, n: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 1.0 or k + 1 == n:
            last[0] = now
            sys.stderr.write(f"\rdivtrace audit: op {k + 1} of {n}" + ("\n" if k + 1 == n else ""))
            sys.stderr.flush()

    return show


def _yes_no(v) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def _shapes(shapes, dtypes) -> str:
    return ", ".join(f"{d}{list(s)}" for s, d in zip(shapes, dtypes))


def _spans(xs: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out) or "-"


def _tokens_line(tokens: list[dict]) -> str:
    pos = sorted({x["position"] for x in tokens if x["position"] is not None})
    if pos:
        seqs = {x["seq"] for x in tokens}
        return f"positions {_spans(pos)}" + (f" in {len(seqs)} sequences" if None not in seqs else "")
    return f"slots {_spans(sorted({x['slot'] for x in tokens}))} of every sequence"


def render_audit(o: Output, r) -> None:
    d = r.to_dict()
    o.line(r.headline())
    o.line(f"trace {d['trace']} ({d['label']}), replayed on {d['device']}"
           + (f" under {d['under']}" if d["under"] else "")
           + f": {d['audited']} audited, {d['not_audited']} not audited")
    for w in d["warnings"]:
        o.warn(w)
    for f in d["findings"]:
        what = " and ".join(w for w, bad in (("NOT BATCH-INVARIANT", f["batch_invariant"] is False),
                                              ("NOT DETERMINISTIC", f["deterministic"] is False)) if bad)
        o.line(f"{what}: {f['op']} in {f['module'] or '<root>'} ({f['module_class']}) x{f['count']}  "
               f"inputs {_shapes(f['shapes'], f['dtypes'])}")
        if f["rows_checked_at"]:
            o.line(f"    rows differ at M={f['rows_differ_at']} (checked M={f['rows_checked_at']}); "
                   f"{f['rows_differing']} of {f['n_rows']} rows; max ULP {f['max_ulp']}; "
                   f"{100 * f['time_share']:.1f}% of the replay time")
            if f["tokens"]:
                o.line("    tokens reached: " + _tokens_line(f["tokens"]))
        else:
            o.line(f"    {f['why'] or ''}; {100 * f['time_share']:.1f}% of the replay time")
        for n in f["notes"]:
            o.line(f"    note: {n}")
    if d["clean"]:
        o.table("batch-invariant and deterministic (rows bitwise equal alone, in splits and padded)",
                ["op", "count", "first in"],
                [[c["op"] + (f"  ({c['constant']} from constants: determinism only)" if c["constant"] else ""),
                  c["count"], c["first"] or "<root>"] for c in d["clean"]])
    if d["not_audited_ops"]:
        o.table("not audited (never counted as clean)", ["module (first)", "op", "count", "why"],
                [[n["module"] or "<root>", n["op"], n["count"], n["why"]] for n in d["not_audited_ops"]])
    if r.verdict == "findings":
        o.failed(f"findings: {len(d['findings'])} op groups ({r.not_invariant} ops not batch-invariant, "
                 f"{r.not_deterministic} not deterministic)")
    elif r.verdict == "inconclusive":
        o.inconclusive(r.reason)
    else:
        o.passed(f"clean: {d['audited']} ops batch-invariant and deterministic"
                 + (f"; {d['not_audited']} not audited" if d["not_audited"] else ""))


def audit(
    trace: Annotated[Path, typer.Argument(metavar="TRACE",
                                          help="full-mode trace directory (divtrace record --mode full)")],
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable result (see docs/audit.md)")] = False,
    under: Annotated[Optional[str], typer.Option(
        "--under", metavar="MODULE:FACTORY",
        help="a function or class (path/file.py:fn or pkg.mod:fn) returning a context manager entered around "
             "each op's replays, e.g. a batch-invariant mode")] = None,
    device: Annotated[Optional[str], typer.Option(help="replay on this device instead of the recorded one")] = None,
    plot: Annotated[Optional[Path], typer.Option(
        "--plot", help="write a PNG: each op's worst ULP, findings' time share")] = None,
):
    """Audit every recorded op: is it batch-invariant, is it deterministic, what does it cost.

    Each computing op of a full-mode trace is re-run from its recorded inputs: twice the same call (the same
    bytes?), then each row of its row dim (tokens) alone, in halves of the batch, in a batch one smaller, and
    padded into a batch of 2M+1, each compared bitwise with the same row of the recorded batch. Ops that cannot
    be re-run (random, collectives) or whose rows cannot be told are listed as not audited. The first line is
    `AUDIT: N ops, K not batch-invariant, D not deterministic`. Exit 0 clean, 1 findings, 2 bad input (an --under
    factory that cannot be loaded, called or entered: one line naming it), 3 inconclusive (no op could be
    audited: nothing audited is never clean).

    \b
    Examples:
      divtrace record examples/llama_pair.py:training --out runs/train --mode full
      divtrace audit runs/train
      divtrace audit runs/train --json
      divtrace audit runs/train --under my_overrides.py:batch_invariant_mode --plot audit.png
    """
    from divtrace.audit import audit as run_audit

    o = Output(json_out)
    r = run_audit(trace, under=under, device=device, progress=_progress() if sys.stderr.isatty() else None)
    if plot is not None:
        from divtrace.audit.plot import write_plot

        write_plot(r, plot)
    if json_out:
        o.json(r.to_dict())
    else:
        render_audit(o, r)
        if plot is not None:
            o.line(f"wrote {plot}")
    return r.exit_code
