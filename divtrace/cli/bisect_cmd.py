"""divtrace bisect: the first divergence between two traces, localized to module and op."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from divtrace.cli.output import Output
from divtrace.cli.token_render import origin_words, render_token_parts, token_verdict_line
from divtrace.compare.params import param_line


def _shipped_maps() -> list[str]:
    return sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "maps").glob("*.yaml"))


MAP_HELP = ("YAML file of regex renames of module paths, or the name of a map shipped with divtrace: "
            + ", ".join(_shipped_maps()) + " (docs/vllm.md)")


def render_bisect(o: Output, r) -> None:
    d = r.to_dict()
    la, lb = r.labels
    tokens = d.get("alignment") == "tokens"
    line = param_line(d.get("parameters"))  # which weights differ: first, for a user fixing weight sync
    if tokens:
        token_verdict_line(o, r, d)
    elif r.verdict == "identical":
        o.passed(f"identical: {r.compared} tensor pairs compared, every one bitwise equal (dtype, shape and bytes) "
                 f"[{la} vs {lb}]")
    elif r.verdict == "within_tolerance":
        o.passed(f"within tolerance: {r.compared} tensor pairs compared, {r.bitwise_differs} differ bitwise but "
                 f"all pass {d['tolerance']}")
    elif r.verdict == "absorbed":
        o.passed(f"final outputs identical; {len(r.absorbed)} internal difference(s) absorbed (they reach no output: "
                 f"not origins) [{la} vs {lb}]")
        if line:
            o.line(line)
            line = None
        o.table("absorbed (differ inside, never reach an output; not origins)", ["module", "call", "kind", "op"],
                [[x["module"] or "<root>", "-" if x["call"] is None else x["call"], x["kind"],
                  x["op"] or x.get("name") or "-"] for x in r.absorbed[:12]])
    elif r.verdict == "inconclusive":
        c = r.coverage
        seen = (f"{r.compared} tensor pairs compared over {c.calls_compared} call pairs, all equal" if r.compared
                else "nothing compared")
        o.inconclusive(f"{r.reason} [{la} vs {lb}: {seen}; {c.only_a} calls only in a, {c.only_b} only in b]")
    else:
        o.failed(f"diverged: first divergence originates in {origin_words(r.first)} [cause: {r.first.cause}]")
        if not all(r.complete) or r.coverage.parted:  # the reason says what may be missing past the origin
            o.line(f"note: {r.reason}")
        passed = [x for x in r.absorbed if x["kind"] != "parameter"]
        if passed:  # (calls the walk passed over: their difference reaches none of the outputs that differ)
            o.line(f"absorbed: {len(passed)} earlier difference(s) reach none of the outputs that differ, not the "
                   "origin: " + ", ".join(f"{x['module'] or '<root>'} ({x['op'] or x['kind']})" for x in passed[:4]))
    if line:
        o.line(line)
    for w in r.warnings:
        o.warn(w)
    if r.first is not None:
        f = d["first"]
        rows = [["module", f"{f['module'] or '<root>'} (call {f['call']})"
                 + (f"  [b: {f['module_b']}]" if f["module_b"] not in (None, f["module"]) else "")],
                ["op", f"a: {f['op'] or '-'} (record {f['index']})   b: {f['op_b'] or '-'}"
                 + (f" (record {f['index_b']})" if f["index_b"] is not None else "")
                 if not (f.get("shards") or {}).get("op") else _routed_op_line(f["shards"]["op"])],
                ["cause", f["cause"] + _cause_words(f)],
                ["tensor", f"{f['tensor']}  {f['dtype']} {f['shape']}"]]
        if f.get("inputs_compared") not in (None, "all"):
            rows.append(["inputs not compared", "; ".join(f["inputs_compared"])])
        if f["reason"]:
            rows.append(["differs in", f["reason"]])
        if f["outside_input"]:
            rows.append(["outside input", f["outside_input"]])
        if f.get("routing"):  # an MoE router: each token's expert ids, weights, slot order (docs/sharded.md)
            rows.append(["routing", f["routing"]["why"]])
        if f.get("shards"):  # a side is a sharded run: how each side computed it (docs/sharded.md)
            sh = f["shards"]
            rows.append(["layouts", sh["why"]])
            rows += [[f"block ({s})", sh[f"block_{s}"]] for s in ("a", "b") if sh.get(f"block_{s}")]
            rows += [[f"note ({s})", sh[f"note_{s}"]] for s in ("a", "b") if sh.get(f"note_{s}")]
            if sh.get("partial"):  # which rank's partial sum differs, by how much (or why no rank is named)
                rows.append(["partial sums", sh["partial"]])
        if f["metrics_available"] and f["mismatched"] is not None:
            rows += [["mismatched", f"{f['mismatched']} of {f['numel']} elements" + _piece_words(f)],
                     ["max abs / max rel", f"{f['max_abs']:.6g} / {f['max_rel']:.6g}" if f["max_abs"] is not None else "-"],
                     ["max ULP", f["max_ulp"] if not f.get("sign_flips") else
                      f"{f['max_ulp']} where the signs agree; {f['sign_flips']} sign flips (through zero: "
                      f"{f['max_ulp_raw']})"],
                     ["first mismatch", f"index {f['first_index']}: a={f['first_a']} ({f['first_a_bits']})  "
                                        f"b={f['first_b']} ({f['first_b_bits']})"]]
        elif f.get("reason"):
            rows.append(["metrics", "unavailable (see 'differs in')"])
        elif r.metrics_available:
            rows.append(["metrics", "unavailable for this tensor"])
        else:
            rows.append(["metrics", "unavailable (hash-only trace)"])
        o.table("first divergence", ["field", "value"], rows)
        if f["region_a"] or f["region_b"]:
            o.table("where the op sequences part (each side's ops from the last shared values to the differing tensor)",
                    ["side", "ops"],
                    [["a", ", ".join(x["op"].removeprefix("aten.") for x in f["region_a"]) or "-"],
                     ["b", ", ".join(x["op"].removeprefix("aten.") for x in f["region_b"]) or "-"]])
    if tokens:
        render_token_parts(o, d)
    if r.hint:
        o.line(f"hint: {r.hint}")
    if r.settings:
        o.table("settings that differ", ["setting", la, lb], [[s["name"], s["a"], s["b"]] for s in r.settings])
    if r.next:
        o.table("next diverging records", ["record", "module", "call", "cause", "tensor", "max abs", "max ULP"],
                [[n["index"], n["module"] or "<root>", n["call"], n["cause"], n["tensor"], n["max_abs"], n["max_ulp"]]
                 for n in d["next"]])
    if r.final and not tokens:
        fin = r.final
        o.table("final mismatch (root output " + str(fin.get("tensor")) + ")", ["metric", "value"],
                [["bitwise identical", fin.get("identical")],
                 ["max |dlogprob|", fin.get("max_abs_logprob_diff")],
                 [f"KL({fin.get('kl_direction', 'a||b')}) per position", fin.get("kl")],
                 ["argmax agreement", fin.get("argmax_agreement")]])
        if fin.get("caveat"):
            o.line(f"caveat: {fin['caveat']}")


def _piece_words(f: dict) -> str:
    """" of rank 1's partial sum": whose elements the metrics count, where the value is held as the ranks' pieces
    (the first differing rank's: divtrace.compare.shard_pieces)."""
    got = (f.get("shards") or {}).get("metrics_of")
    return f" of {got}" if got else ""


def bisect(
    a: Annotated[Path, typer.Argument(metavar="A", help="trace of side a (e.g. training), or a run directory (one trace per rank)")],
    b: Annotated[Path, typer.Argument(metavar="B", help="trace of side b (e.g. inference), or a run directory")],
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable result (keys: docs/json.md)")] = False,
    atol: Annotated[Optional[float], typer.Option(help="opt-in absolute tolerance")] = None,
    rtol: Annotated[Optional[float], typer.Option(help="opt-in relative tolerance")] = None,
    ulp: Annotated[Optional[int], typer.Option(help="opt-in tolerance in ULPs")] = None,
    map_file: Annotated[Optional[Path], typer.Option("--map", help=MAP_HELP)] = None,
    next_n: Annotated[int, typer.Option("--next", help="how many further diverging records to list")] = 5,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="write a PNG of where the runs part, per record")] = None,
    html: Annotated[Optional[Path], typer.Option("--html", help="write an HTML report of the same")] = None,
    align: Annotated[Literal["auto", "tokens", "calls"], typer.Option("--align", help="pair by tokens (a rollout's prefill and decode steps "
                                         "against a trainer's micro-batches) or by module calls; auto: tokens when "
                                         "both traces carry token identity and their calls hold different rows")
                     ] = "auto",
):
    """Find the first divergence between two traces: the module and aten op where it originates.

    Comparison is bitwise (dtype, shape and raw bytes; -0.0 != 0.0, NaNs by their bits) unless --atol,
    --rtol or --ulp is given. Exit 0 identical (both traces complete, final outputs compared and equal),
    1 diverged, 2 bad input, 3 inconclusive (a trace stopped early or holds computation divtrace did not see,
    and nothing diverged before: the INCONCLUSIVE line says why and what to do), 4 absorbed
    (every final value bitwise equal, internal differences that never reach them; no origin).

    Traces that carry token identity (HF-style calls, or rec.tokens declarations) are aligned token by token
    when their calls differ. The final values (logits rows, logprobs) are always compared and lead the report
    (`FAILED: logprobs differ on K of N tokens; first divergence originates in ...`); an origin is only a
    difference that reaches a differing final value. The report names the first diverging token, the rows each
    side's op ran over, the batch-size cause where it applies, and every independent origin.

    \b
    Examples:
      divtrace bisect runs/train runs/infer
      divtrace bisect runs/train runs/infer --json
      divtrace bisect runs/train runs/infer --map names.yaml --ulp 2
      divtrace bisect runs/train runs/infer --plot parting.png
      divtrace bisect runs/train runs/rollout --align tokens
      divtrace bisect runs/tp2 runs/tp1     (run directories: one trace per rank, docs/sharded.md)
    """
    from divtrace.align.paths import PathMap
    from divtrace.compare.bisect import bisect as run_bisect
    from divtrace.compare.diffs import Tolerance

    o = Output(json_out)
    tol = Tolerance(atol=atol, rtol=rtol, ulp=ulp)
    path_map = PathMap.from_file(map_file) if map_file else None
    r = run_bisect(a, b, tol=tol, path_map=path_map, n_next=next_n, align=align)
    if plot is not None or html is not None:
        from divtrace.errors import DivtraceError
        from divtrace.oserrors import cannot_write

        tokens = getattr(r, "alignment", "calls") == "tokens"
        if tokens and html is not None:
            raise DivtraceError("--html is not made for a token-aligned bisect yet; use --plot FILE.png (token x "
                                "module), or --align calls")
        try:
            if tokens:
                from divtrace.compare.token_plot import write_token_plot

                write_token_plot(r, plot)
            else:
                from divtrace.compare.plot import write_plots

                write_plots(a, b, r, png=plot, html=html, path_map=path_map)
        except (OSError, DivtraceError) as e:
            err = e if isinstance(e, DivtraceError) else cannot_write(getattr(e, "filename", None) or plot or html,
                                                                     e, "cannot write the plot")
            # A file cut short by a full disk must not pass for the report: remove it and say so.
            bad = next((p for p in (plot, html) if p is not None and str(err).startswith(f"{p}: ")), None)
            if bad is not None and bad.is_file():
                try:
                    bad.unlink()
                    err = DivtraceError(f"{err}; the partial file was removed")
                except OSError:
                    err = DivtraceError(f"{err}; the partial file {bad} is left: remove it")
            raise err from None
    if json_out:
        o.json(r.to_dict())
    else:
        render_bisect(o, r)
        for p in (plot, html):
            if p is not None:
                o.line(f"wrote {p}")
    return r.exit_code


def _routed_op_line(x: dict) -> str:
    """The op that computed the first differing routed row, on its rank (docs/sharded.md, "Routed rows")."""
    return (f"a: {x['op_a']} (record {x['index_a']} on rank {x['rank_a']})   b: {x['op_b']} (record {x['index_b']} on "
            f"rank {x['rank_b']})")


def _cause_words(f: dict) -> str:
    """What the cause rests on. "inputs bitwise equal" only where every input of the parting op was compared
    (token alignment lists those it could not compare: a fused op with no counterpart, a decode step's KV cache)."""
    if f["cause"] != "origin":
        return "  (inputs already differ; could not go further)"
    if f["outside_input"]:
        return "  (an input no recorded op made differs; see below)"
    if f.get("inputs_compared") not in (None, "all"):
        return "  (output differs; not every input could be compared: see below)"
    return "  (inputs bitwise equal, output differs)"
