"""divtrace verify: does a fix hold? Bitwise on recorded, random and swept-shape inputs, as the same function (fp64
gate), how fast (--profile), and end to end (--runs)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from divtrace.cli.output import Output
from divtrace.errors import DivtraceError


def _t(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"


def _shapes(m: dict) -> str:
    """`x [2, 16, 128], w [128]`: each input's name, then its shape."""
    shapes = m.get("shapes") or {}
    return ", ".join(f"{k} [{', '.join(map(str, v))}]" for k, v in shapes.items()) if shapes else "-"


def _row(c: dict) -> list:
    return [c["name"], c["kind"], c["status"],
            f"{c['mismatched']}/{c['numel']}" if c.get("mismatched") is not None else "-", c.get("max_ulp"),
            _shapes(c), c["detail"]]


SHOWN_TRIALS = 3  # failing trials listed one by one; the rest are counted


def render_checks(o: Output, res: dict) -> None:
    checks = res["checks"]
    trials = [c for c in checks if c["kind"] == "trial"]
    bad_trials = [c for c in trials if c["status"] != "PASSED"]
    ok = len(trials) - len(bad_trials)
    seeds = ", ".join(str(c["seed"]) for c in bad_trials[:10]) + (", ..." if len(bad_trials) > 10 else "")
    trial_text = f"{ok} of {len(trials)} random trials bitwise equal"
    if bad_trials:
        trial_text += f" (failing seeds: {seeds})"
    rows = []
    for c in checks:
        if c["kind"] == "trial":
            if c is trials[0]:
                rows.append([f"trials seeds {trials[0]['seed']}-{trials[-1]['seed']}", "trial",
                             "PASSED" if not bad_trials else "FAILED", "-", "-", _shapes(c), trial_text])
                rows += [_row(t) for t in bad_trials[:SHOWN_TRIALS]]
        elif c["kind"] != "reference":
            rows.append(_row(c))
    o.table("bitwise checks", ["check", "kind", "status", "mismatched", "max ULP", "shapes", "detail"], rows)
    ref = [c for c in checks if c["kind"] == "reference"]
    if ref:
        o.table("fp64 reference (max abs error; gate: err_patch <= 2 * max(err_a, err_b) + floor; floor = 2 ULPs "
                "of the output's largest value, what rounding the result alone can cost: docs/numbers.md)",
                ["inputs", "status", "err a", "err b", "err patch", "floor", "bound"],
                [[c["name"].removeprefix("reference "), c["status"], c.get("err_a"), c.get("err_b"), c.get("err_patch"),
                  c.get("floor"), c.get("bound")] for c in ref])
    agree = (res.get("reference") or {}).get("sides_fp64_agreement", {})
    if agree.get("same_function") is False:
        o.line(f"note: side a's and side b's code disagree in fp64 too (max relative gap {agree['max_rel_gap']:.3g}): "
               "they may not compute the same function")
    for c in checks:
        if c["kind"] == "trial" and c not in bad_trials[:SHOWN_TRIALS]:
            continue
        text = f"{c['name']}: {c['detail']}"
        if c["status"] == "PASSED":
            o.passed(text)
        elif c["status"] == "FAILED":
            o.failed(text)
        elif c["status"] == "INFO":  # a figure with no gate: not a result, so no PASSED/FAILED word
            o.line(f"info: {text}")
        else:
            o.line(f"SKIPPED: {text}")
    if trials:
        (o.passed if not bad_trials else o.failed)(f"trials: {trial_text}")
    for w in res.get("warnings") or []:
        o.warn(w)  # once, on stderr (as every command's warnings)


def render_profile(o: Output, res: dict) -> None:
    if res.get("profile_skipped"):
        o.line(res["profile_skipped"])
    p = res.get("profile")
    if not p:
        return
    from divtrace.verify.profile import kernel_ratios, ratios

    th = f", {p['threads']} thread(s)" if p.get("threads") else ""
    if not p.get("bitwise_passed", True):
        o.line("note: profiled although the bitwise checks FAILED (--force-profile)")
    c, k = p["candidates"], p["kernel"]
    o.table(f"profile ({p['device']}{th}; kernel: {k['measure']}, {k['rounds']} interleaved rounds; wall: "
            f"{p['timer']}, {p['rounds']} rounds)",
            ["candidate", "kernel", "kernel min", "wall median", "wall IQR %", "iterations", "GB/s", "% of copy bw",
             "GFLOP/s"],
            [[name, _t(v["kernel_median_s"]), _t(k["candidates"][name]["min_us"] * 1e-6), _t(v["median_s"]),
              f"{v['iqr_pct']:.1f}", v["iterations"], f"{v['gb_per_s']:.3g}",
              f"{v['pct_of_copy_bw']:.1f}" if v["pct_of_copy_bw"] is not None else "-",
              f"{v['gflop_per_s']:.3g}" if v["gflop_per_s"] else "-"] for name, v in c.items()])
    o.line(f"copy bandwidth measured in this run: {p['copy_bw_gb_per_s']:.3g} GB/s; region moves {p['bytes_moved']} "
           f"bytes ({p['bytes_rule']}); flops: {p['flops_rule']}; GB/s and GFLOP/s are per kernel time")
    patched = res.get("side") if res.get("patch") else None
    # Throughput (work per second) and time per call, both said: "215%" alone reads either way.
    rs = kernel_ratios(k, patched)
    if patched:
        (who, a1, r1), (_, a2, r2) = rs
        o.line(f"{who} kernel throughput: {r1:.0f}% of {a1}, the side it replaces (time per call {100 / r1:.2f}x); "
               f"{r2:.0f}% of {a2} ({100 / r2:.2f}x)")
    else:
        who, a1, r1 = rs[0]
        o.line(f"{who} kernel throughput: {r1:.0f}% of {a1} (time per call {100 / r1:.2f}x)")
    band = k.get("noise_band_pct")
    if band:
        o.line(f"noise band: {band[0]:.0f}%-{band[1]:.0f}% (side a against itself, same rounds): a ratio inside it is "
               "no measurable difference")
    walls = ", ".join(f"{100 / r:.2f}x {a}" for _, a, r in ratios(c, patched))
    o.line(f"wall time per call, kernels plus the Python that calls them: {rs[0][0]} {walls}")
    rows = [[name, e["op"], f"{e['calls_per_iter']:g}", f"{e['self_us_per_iter']:.1f}", f"{e['share_pct']:.0f}"]
            for name, v in c.items() for e in v.get("top_ops", [])[:5]]
    if rows:
        o.table("torch.profiler top ops (self time; us/iter = the op's share of the profiled time x the wall median)",
                ["candidate", "op", "calls/iter", "self us/iter", "share %"],
                rows)


def render_runs(o: Output, e2e: dict) -> None:
    for c in e2e["checks"]:
        (o.passed if c["status"] == "PASSED" else o.failed)(f"{c['name']}: {c['detail']}")
    for s, t in (e2e.get("timing") or {}).items():
        o.line(f"forward time, run {s}: fixed {_t(t['fixed_s'])} vs unfixed {_t(t['unfixed_s'])}: fixed/unfixed = "
               f"{t['ratio']:.2f}x (unfixed rebuilt from {t['baseline']}; {t['threads']} thread(s))")
    if e2e.get("kept"):
        o.line(f"traces kept in {e2e['traces']['a']} and {e2e['traces']['b']}")


def verify(
    repro_dir: Annotated[Optional[Path], typer.Argument(metavar="REPRO_DIR",
                                                        help="repro directory written by `divtrace repro`")] = None,
    patch: Annotated[Optional[str], typer.Option(help="FILE.py:FUNC with the same parameters as side_a/side_b")] = None,
    side: Annotated[Optional[Literal["a", "b"]], typer.Option(help="the side the patch replaces")] = None,
    trials: Annotated[int, typer.Option(help="fresh random input sets at the recorded shapes")] = 20,
    profile: Annotated[bool, typer.Option("--profile", help="time a, b and the patch once the checks pass")] = False,
    force_profile: Annotated[bool, typer.Option("--force-profile", help="profile even when the checks fail")] = False,
    threads: Annotated[int, typer.Option(help="CPU threads while timing (0: leave torch's setting)")] = 1,
    runs: Annotated[Optional[tuple[str, str]], typer.Option(help="A_ENTRY B_ENTRY: re-record both, bisect")] = None,
    arg_a: Annotated[Optional[list[str]], typer.Option("--arg-a", help="key=value for A_ENTRY (repeatable)")] = None,
    arg_b: Annotated[Optional[list[str]], typer.Option("--arg-b", help="key=value for B_ENTRY (repeatable)")] = None,
    baseline_a: Annotated[Optional[Path], typer.Option(help="unfixed trace of run a: forward-time ratio")] = None,
    baseline_b: Annotated[Optional[Path], typer.Option(help="unfixed trace of run b: forward-time ratio")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="keep the --runs traces here (DIR/a, DIR/b)")] = None,
    mode: Annotated[Literal["hash", "full"], typer.Option(help="--runs recording mode")] = "hash",
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable result")] = False,
):
    """Check a fix on a repro (bitwise, random trials, a shape sweep, an fp64 gate), or end to end with --runs.

    The patch (--patch FILE.py:FUNC, with side_a's and side_b's parameters) replaces --side a or b and must be
    bitwise equal to the other side on the recorded inputs, on --trials random inputs and on a shape sweep (batch
    1, the recorded size, a larger one, another sequence length), and as accurate as the sides against an fp64
    reference. Without --patch, verify checks side b against side a: it fails (exit 1) while the sides differ.

    A swept shape the original side cannot run is SKIPPED, not FAILED. The patch runs under the settings of the
    side it replaces. --profile times a, b and the patch once the checks pass. --runs re-records two ENTRYs (as in
    `divtrace record`) and passes only if the traces are identical and the final KL is exactly 0.
    Exit 0 every check holds, 1 something differs, 2 bad input.

    \b
    Examples:
      divtrace verify repro/
      divtrace verify repro/ --patch fix.py:side_b --side b --trials 50
      divtrace verify repro/ --patch fix.py:side_b --side b --profile --json
      divtrace verify --runs examples/llama_pair.py:training examples/fixes/rmsnorm_fixed.py:inference
      divtrace verify --runs train.py:build infer.py:build --arg-b variant=fixed --baseline-b runs/infer
    """
    from divtrace.record.entry import parse_args

    o = Output(json_out)
    if repro_dir is None and not runs:
        raise DivtraceError("verify: give a repro DIR, or --runs A_ENTRY B_ENTRY")
    if not runs and (arg_a or arg_b or baseline_a or baseline_b or out):
        raise DivtraceError("--arg-a/--arg-b/--baseline-a/--baseline-b/--out go with --runs")
    result = {"verdict": "passed", "checks": [], "reference": None, "profile": None}
    if repro_dir is not None:
        from divtrace.verify.run import verify_repro

        r = verify_repro(repro_dir, patch=patch, side=side, trials=trials, profile=profile or force_profile,
                         force_profile=force_profile, threads=threads or None)
        result = r.to_dict()
        if not json_out:
            what = (f"patch {patch} replaces side {side}, checked against side {'b' if side == 'a' else 'a'}"
                    if patch else "side b checked against side a (no patch)")
            o.line(f"verify {r.repro}: region {r.region}; {what}")
            for n in r.notes:
                o.line(f"note: {n}")
            render_checks(o, result)
            render_profile(o, result)
    elif patch or side or profile:
        raise DivtraceError("--patch/--side/--profile need a repro DIR")
    if runs:
        from divtrace.verify.end_to_end import verify_runs

        e2e = verify_runs(runs[0], runs[1], args_a=parse_args(arg_a), args_b=parse_args(arg_b), out=out, mode=mode,
                          baseline_a=baseline_a, baseline_b=baseline_b, threads=threads or None)
        result["checks"] = result["checks"] + e2e["checks"]
        result["end_to_end"] = e2e
        if e2e["verdict"] != "passed":
            result["verdict"] = "failed"
        if not json_out:
            o.line(f"verify --runs: a = {runs[0]} {' '.join(arg_a or [])}".rstrip()
                   + f"; b = {runs[1]} {' '.join(arg_b or [])}".rstrip() + f" [{mode} mode]")
            render_runs(o, e2e)
    ok = result["verdict"] == "passed"
    if json_out:
        o.json(result)
    else:
        (o.passed if ok else o.failed)(summary_line(result["checks"], ok))
    return 0 if ok else 1


def summary_line(checks: list[dict], ok: bool) -> str:
    """The last line's text (after PASSED: / FAILED:): the checks that held, per kind, or only the checks that
    failed, per kind; SKIPPED checks and informational figures (INFO: no gate) are named apart."""
    kinds = ("recorded", "trial", "sweep", "reference", "end_to_end")

    def count(status):
        n = {k: sum(c["kind"] == k and c["status"] == status for c in checks) for k in kinds}
        return ", ".join(f"{v} {k}" for k, v in n.items() if v)

    extra = "".join(f"; {what} {why}" for what, why in ((count("SKIPPED"), "skipped"),
                                                        (count("INFO"), "not gated (information)")) if what)
    if ok:
        return f"verify: every check holds ({count('PASSED')}{extra})"
    bad = sum(c["status"] == "FAILED" for c in checks)
    held = count("PASSED")
    return f"verify: {bad} check(s) failed ({count('FAILED')})" + (f"; {held} passed" if held else "") + extra
