"""divtrace record: run ENTRY under `divtrace.record` into a trace directory."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from divtrace.cli.output import Output
from divtrace.errors import DivtraceError


def record(
    entry: Annotated[str, typer.Argument(metavar="ENTRY", help="path/file.py:function or pkg.module:function returning (model, inputs)")],
    out: Annotated[Path, typer.Option("--out", "-o", help="trace directory to create")],
    mode: Annotated[Literal["full", "hash"], typer.Option(help="full (tensors) or hash (bit-exact fingerprints only)")] = "full",
    no_ops: Annotated[bool, typer.Option("--no-ops", help="record module boundaries only, not aten ops")] = False,
    compiled: Annotated[Optional[bool], typer.Option("--compiled/--no-compiled", help="record inside torch.compile'd "
                        "code at module boundaries (default: when ENTRY returns a compiled model; --compiled on a "
                        "model that is not compiled is refused; --no-compiled records its eager code op by op; "
                        "see docs/compiled.md)")] = None,
    include: Annotated[Optional[str], typer.Option(help="regex over module paths: record only these (and their children)")] = None,
    exclude: Annotated[Optional[str], typer.Option(help="regex over module paths: skip these subtrees")] = None,
    label: Annotated[Optional[str], typer.Option(help="run label, e.g. train or infer (default: directory name)")] = None,
    arg: Annotated[Optional[list[str]], typer.Option("--arg", help="key=value passed to the ENTRY function (repeatable)")] = None,
    grad_mode: Annotated[Literal["no_grad", "inference", "grad"], typer.Option(
        help="the autograd mode the forward runs under (torch.no_grad, torch.inference_mode, grad enabled)")] = "no_grad",
    params: Annotated[Optional[Literal["all", "blocks", "read", "none"]], typer.Option(
        "--params", help="which parameters and buffers to name in the trace, so bisect compares the two runs' weights "
        "by name: all (those ops read, and those none read fingerprinted at the end: the default with ops), read "
        "(only those ops read: the default with --no-ops), none (no names: bisect compares no parameters), blocks (as "
        "all, and in hash mode each whole weight's chunk fingerprints, so bisect names which rank's block differs "
        "against a sharded run; one more read of each weight per chunk dim)")] = None,
    overwrite: Annotated[bool, typer.Option(help="replace a trace already in --out")] = False,
    durable: Annotated[bool, typer.Option(help="fsync the trace at close, so it survives an OS crash right after")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable summary")] = False,
):
    """Record one run of ENTRY (every module call and aten op) into a trace.

    ENTRY's function returns (model, inputs); divtrace runs model(*inputs), or model(**inputs) for a dict,
    under torch.no_grad() by default. Record each side in its own process. While it records, DIR holds a
    lock naming the process: a second record into DIR is refused (a lock left by a killed process is not).
    Exit 0 recorded, 2 bad input or an --out that cannot be written (one line: the path and the reason),
    130 interrupted or terminated (the line says whether a partial trace was left, marked incomplete).

    \b
    Examples:
      divtrace record examples/llama_pair.py:training --out runs/train --arg dtype=bf16
      divtrace record examples/llama_pair.py:inference --out runs/infer --arg variant=sdpa --mode hash
      divtrace record mypkg.debug:build_engine_side --out runs/infer --include '^model\\.layers\\.0\\.' --mode full
    """
    import time

    from divtrace.record.entry import parse_args, record_entry
    from divtrace.trace.reader import Trace
    from divtrace.trace.directory import check_not_busy

    o = Output(json_out)
    kwargs = parse_args(arg)
    check_not_busy(out)  # say so before building the model, which can take minutes
    t0 = time.time()
    try:
        elapsed = record_entry(entry, out, args=kwargs, mode=mode, ops=False if no_ops else None, include=include,
                               exclude=exclude, label=label or out.name, overwrite=overwrite, grad_mode=grad_mode,
                               durable=durable, compiled=compiled, params=params)
    except DivtraceError:
        raise
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the recorder already closed the trace and marked it
        from divtrace.cli.output import error

        what = "terminated (SIGTERM)" if type(e).__name__ == "RecordingTerminated" else "interrupted"
        error(f"{what}; {_what_was_left(out, t0)}")
        return 130
    except Exception as e:
        raise DivtraceError(f"ENTRY {entry} raised {type(e).__name__}: {e}; {_what_was_left(out, t0)}") from None
    t = Trace(out)
    n_ops = sum(1 for r in t.records if r.kind == "op")
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    summary = {"trace": str(out), "records": len(t.records), "ops": n_ops, "module_calls": len(t.calls),
               "values": len(t.values), "bytes": size, "mode": t.mode, "forward_seconds": elapsed,
               "complete": t.complete}
    if json_out:
        o.json(summary)
    else:
        o.line(f"recorded {len(t.records)} records ({n_ops} ops, {len(t.calls)} module calls) into {out} "
               f"[{t.mode} mode, {size / 1e6:.2f} MB, forward {elapsed:.3f} s]")
    return 0


def _what_was_left(out: Path, t0: float) -> str:
    """What a recording stopped early left in `out`, said truly: a trace this run started (marked incomplete),
    or nothing (it stopped while the model was being built, before the recording began)."""
    import json

    try:
        meta = json.loads((out / "meta.json").read_text())
        started = meta.get("started")
        if isinstance(started, (int, float)) and started >= t0:
            return f"the partial trace in {out} is marked incomplete (status: {meta.get('status')})"
    except (OSError, ValueError):
        pass
    return f"it stopped before the recording began: nothing was written to {out}"
