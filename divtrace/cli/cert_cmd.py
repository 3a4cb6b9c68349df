"""divtrace cert: is every token of every step of an RL run bitwise the same on the rollout and the trainer?"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from divtrace.cli.output import Output


def _token_text(t: dict) -> str:
    return (f"sequence {t['sequence']} (index {t['sequence_index']}), token {t['token']} (position {t['position']}, "
            f"id {t['id']}): rollout {t['rollout']!r} ({t['rollout_bits']}) vs trainer {t['trainer']!r} "
            f"({t['trainer_bits']}), {t['dtype']}")


def render_cert(o: Output, r, plot: Path | None = None) -> None:
    d = r.to_dict()
    n = len(r.steps)
    if r.verdict == "certified":
        o.passed(f"certified: {d['tokens_equal']} of {d['tokens_compared']} tokens bitwise equal over {n} steps, "
                 "weights equal at every step")
    elif r.verdict == "parts":
        f = r.first
        s = next(x for x in r.steps if x.step == f["step"])
        where = f"; first token: {_token_text(f['token'])}" if f["token"] else "; every token bitwise equal"
        if f["cause"] == "weights":
            o.failed(f"step {f['step']}: the weights differ (version {s.weights['versions']['rollout']!r} on both "
                     f"sides): {', '.join(f['weights_differ'][:8])}" + (" ..." if len(f["weights_differ"]) > 8 else "")
                     + where)
        else:
            o.failed(f"step {f['step']} parts with {'equal' if f['cause'] == 'numerics' else 'unrecorded'} weights"
                     f"{where}")
        if r.running:
            o.line("note: the run is still being written: later steps were not seen")
    else:
        o.inconclusive(f"{r.reason} [{n} steps seen, {d['tokens_equal']} of {d['tokens_compared']} tokens equal]")
    rows = []
    for s in r.steps:
        w = s.weights
        weq = {True: "equal", False: f"DIFFER ({len(w['differ']) + len(w['only_rollout']) + len(w['only_trainer'])})",
               None: "-"}[w.get("equal")]
        rows.append([s.step, s.status + (f" ({s.cause})" if s.cause else ""), f"{s.tokens_equal} / {s.tokens_compared}",
                     s.max_abs_diff, s.kl, weq, f"{w['versions']['rollout']} / {w['versions']['trainer']}",
                     "; ".join(s.notes)])
    o.table("per step (tokens bitwise equal / compared; KL: k3 estimate per token from the sampled tokens)",
            ["step", "status", "equal / compared", "max |dlogprob|", "KL", "weights", "version r / t", "notes"], rows)
    if r.first is not None and r.first["token"]:
        t = r.first["token"]
        o.line(f"first parting token: step {r.first['step']}, {_token_text(t)} "
               f"[{t['where']['rollout']} / {t['where']['trainer']}]")
    if r.replay is not None:
        o.line(f"replay of step {r.replay['step']} saved in {Path(r.ledger) / r.replay['dir']}; to find the op, run:")
        for c in r.replay.get("command") or []:
            o.console.print(f"  {c}", markup=False, highlight=False, soft_wrap=True)  # unwrapped: copy and run it
    elif r.first is not None and r.first["cause"] != "weights":
        o.line("hint: no replay was saved for this step; record both sides of it (divtrace.record) and run "
               "divtrace bisect TRAIN ROLLOUT --align tokens (docs/cert.md, 'From the ledger to the op')")
    if plot is not None:
        o.line(f"wrote {plot}")


def cert(
    ledger: Annotated[Path, typer.Argument(metavar="LEDGER", help="the ledger folder (divtrace.cert.ledger(...))")],
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable result (keys: docs/cert.md)")] = False,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="write a PNG: equal fraction and KL per step")] = None,
):
    """Certify an RL run: every sampled token's logprob bitwise equal on the rollout and the trainer, per step.

    Reads a ledger (per step: the rollout's and the trainer's logprobs of the sampled tokens, and a fingerprint
    of the weights each side used) and prints, per step, the tokens bitwise equal / compared, max |dlogprob|,
    KL and whether the weights matched, then the first step, sequence and token that part. Exit 0 every token of
    every step bitwise equal with equal weights, 1 something parts (even if later steps are missing; equal
    logprobs with unequal weights too, naming the parameters), 2 bad input (a damaged ledger: file and line),
    3 inconclusive (steps or sides missing, stale weight versions, or the run still being written: `running`).

    \b
    Examples:
      divtrace cert runs/ledger
      divtrace cert runs/ledger --json
      divtrace cert runs/ledger --plot cert.png
    """
    from divtrace.cert.verdict import certify

    o = Output(json_out)
    r = certify(ledger)
    if plot is not None:
        _write_plot(r, plot)
    if json_out:
        o.json(r.to_dict())
    else:
        render_cert(o, r, plot)
    return r.exit_code


def _write_plot(r, plot: Path) -> None:
    from divtrace.cert.plot import write_cert_plot
    from divtrace.oserrors import cannot_write

    try:
        write_cert_plot(r, plot)
    except OSError as e:
        raise cannot_write(plot, e, "cannot write the plot") from None
