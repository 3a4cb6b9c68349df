"""first_divergence: where two traces part, localized to the module call and op where it *originates*.

`bisect` pairs the two traces' module calls by path and call number (divtrace.align.calls; by tokens instead:
token_bisect.py), walks down from the first pair that differs to the origin (walker.py), sweeps every aligned call
so "identical" means every compared tensor, compares the final outputs (final_outputs.py) and decides the verdict
(verdict.py).

In: two trace directories (or `Trace`s), an optional path map (divtrace.align.paths) and tolerance. Out: a
BisectResult (results.py).
"""
from __future__ import annotations

import re
import shlex

from divtrace.align.calls import Pairing, folded_pairing
from divtrace.align.paths import PathMap
from divtrace.compare.diffs import Tolerance
from divtrace.compare.final_outputs import final_outputs, final_summary
from divtrace.compare.params import absorbed_entries, compare_parameters
from divtrace.compare.results import BisectResult, Divergence, settings_diff, trace_seen
from divtrace.compare.values import ValueComparator
from divtrace.compare.verdict import INCONCLUSIVE, decide
from divtrace.compare.walker import OriginWalker
from divtrace.errors import DivtraceError
from divtrace.trace.reader import Trace, gc_paused


def _hint(a: Trace, b: Trace, first: Divergence | None) -> str | None:
    if first is None or (a.mode == "full" and b.mode == "full"):
        return None
    inc = "^" + re.escape(first.module) + "$"
    cmds = []
    for t, side in ((a, "a"), (b, "b")):  # both sides: a repro needs the values of each
        entry = t.meta.get("entry")
        args = " ".join(f"--arg {shlex.quote(f'{k}={v}')}" for k, v in (t.meta.get("entry_args") or {}).items())
        target = f"{entry} {args}".strip() if entry else "ENTRY"
        cmds.append(f"divtrace record {target} --mode full --include {shlex.quote(inc)} --out {shlex.quote(str(t.path) + '-full')}")
    return ("value metrics need tensors; re-record the diverging module in full mode: " + " ; ".join(cmds)
            + (" (or in Python: divtrace.record(model, path, mode='full', include=" + repr(inc) + "))"))


def _top_pairs(ta: Trace, pairing: Pairing):
    """Aligned call pairs whose parents are not aligned with each other: the roots of the walk. Usually the two
    roots; when one side was recorded with include= they are the narrowed calls."""
    for ca in sorted(ta.calls.values(), key=lambda c: c.enter_index):
        cb = pairing.partner(ca)
        if cb is None:
            continue
        pa = ta.calls[ca.parent] if ca.parent is not None else None
        pb = pairing.partner(pa) if pa is not None else None
        if pb is None or pb.call_id != cb.parent:
            yield ca, cb


def _outputs_equal(walker, ta: Trace, pairing: Pairing) -> bool:
    """Whether every top call pair's outputs were compared (at least one pair of them) and none differs."""
    tops = list(_top_pairs(ta, pairing))
    return bool(tops) and all(walker.cmp.pairs(ca.outputs, cb.outputs) and walker.out_mismatch(ca, cb) is None
                              for ca, cb in tops)


def _writes_in_place(d) -> bool:
    """Whether the differing op writes into a tensor (`copy_`, `index_put_`, an `add_`): the tensor may be state
    that outlives the run (a KV cache, a buffer the next step reads), so its difference is kept as an origin."""
    return any(op.split(".")[1].endswith("_") for op in (d.op, d.op_b) if op and op.count(".") >= 2)


def _verify_stored(ta: Trace, tb: Trace) -> None:
    """Before calling runs equal (or their differences absorbed): the stored bytes must be what was recorded (a
    corrupted shard must never pass)."""
    for t in (ta, tb):
        verify = getattr(t, "verify_shards", None)
        if verify is not None:
            verify()


def _absorbed_entry(d) -> dict:
    """An `absorbed` entry of a call-aligned result (json.md): where the difference sits."""
    note = ("the op's output differs, every output of the run is equal" if d.kind == "op"
            else "the call's output differs, every output of the run is equal")
    return {"module": d.module, "call": d.call, "kind": "op" if d.kind == "op" else "module", "op": d.op,
            "op_b": d.op_b, "tensor": d.tensor, "note": note}


def _passed_over(walker) -> list[dict]:
    """`absorbed` entries of the children the walk passed over (compare/output_reach.py): each one's own origin,
    whose difference reaches none of the outputs that differ."""
    out, i = [], 0
    while i < len(walker.passed_over):  # (localizing one may pass over more)
        ya, yb = walker.passed_over[i]
        d = walker.localize(ya, yb)
        out.append({**_absorbed_entry(d), "note": "differs, but reaches none of the outputs that differ: they are a "
                    "later call's, whose inputs are equal"})
        i += 1
    return out


def _nothing_to_compare(ta: Trace, tb: Trace, unmatched: dict | None = None) -> BisectResult:
    """The verdict when a trace stopped before anything could be compared (before its first module call was
    written, say): inconclusive, saying why. `unmatched`: the calls the pairing left without a partner, where
    the calls were paired (else every call counts as unpaired)."""
    unmatched = unmatched or {"a": len(ta.calls), "b": len(tb.calls)}
    v = decide(origin_found=False, within_tolerance=False, final_compared=False, final_equal=None,
               a=trace_seen(ta, "a", tb), b=trace_seen(tb, "b", ta), calls_compared=0, only_a=unmatched["a"],
               only_b=unmatched["b"], final_note="nothing was compared")
    assert v.verdict == INCONCLUSIVE, v  # only an incomplete trace gets here
    return BisectResult(
        verdict=v.verdict, reason=v.reason, coverage=v.coverage, compared=0, first=None, next=[], settings=[],
        final=None, labels=(ta.label, tb.label), paths=(str(ta.path), str(tb.path)),
        metrics_available=ta.mode == "full" and tb.mode == "full", complete=(ta.complete, tb.complete),
        unmatched=unmatched, warnings=[w for t in (ta, tb) for w in getattr(t, "warnings", [])])


def bisect(a, b, *, tol: Tolerance | None = None, path_map: PathMap | None = None, n_next: int = 5,
           align: str = "auto") -> BisectResult:
    """Compare two traces (paths or `Trace`s) and localize their first divergence.

    `align`: "calls" pairs module calls by path and call number; "tokens" pairs the tokens both runs computed
    (divtrace.compare.token_bisect: a rollout's prefill and decode steps against a trainer's full-sequence
    micro-batches); "auto" (default) takes tokens when both traces carry token identity and their root calls do
    not already hold the same tokens in the same rows (where they do, the two alignments are the same)."""
    if align not in ("auto", "tokens", "calls"):
        raise DivtraceError(f"align must be 'auto', 'tokens' or 'calls', got {align!r}")
    with gc_paused():  # its caches are many small objects in no cycle (a 100k-record bisect: 0.25 s of collections)
        from divtrace.align.shards import open_side  # a run directory: its ranks' global values (docs/sharded.md)

        ta, tb = open_side(a), open_side(b)
        same_schemes(ta, tb, "hash_scheme")
        if align != "calls":
            from divtrace.align.tokens import token_alignment_needed

            if token_alignment_needed(ta, tb, forced=align == "tokens" or _data_parallel(ta, tb)):
                same_schemes(ta, tb, "row_scheme")
                from divtrace.compare.token_bisect import token_bisect  # (numpy: only where tokens are aligned)

                return _sharded(token_bisect(ta, tb, tol=tol, path_map=path_map, n_next=n_next), ta, tb)
        from divtrace.align.shards.view import raise_if_unpairable

        raise_if_unpairable(ta, tb)
        return _sharded(_bisect(ta, tb, tol, path_map, n_next), ta, tb)  # (the opened sides: a run directory too)


def _data_parallel(ta, tb) -> bool:
    """A side is a data-parallel run (its ranks hold different inputs: groups of their own) and both sides carry
    token identity: its calls pair with nothing by module and call number, so "auto" takes tokens, even where its
    root calls hold the same tokens in the same rows as the other side's (one process running the ranks'
    sequences one at a time)."""
    from divtrace.align.shards.view import RunView

    if not any(isinstance(t, RunView) and len(t.groups) > 1 for t in (ta, tb)):
        return False
    return ta.token_index().has_tokens and tb.token_index().has_tokens


def _sharded(result: BisectResult, ta, tb) -> BisectResult:
    """A side that is a run directory: say how each side computed the origin (divtrace.compare.shard_cause). An
    origin that is an MoE router: what differs about each token's routing (divtrace.compare.routing)."""
    if result.first is not None:
        from divtrace.compare.routing import annotate as routing

        routing(result, ta, tb)
    if getattr(ta, "run", None) is not None or getattr(tb, "run", None) is not None:
        from divtrace.compare.shard_cause import annotate

        annotate(result, ta, tb)
    return result


def same_schemes(ta: Trace, tb: Trace, which: str) -> None:
    """Fingerprints of two schemes never compare: two traces written by divtrace versions that fingerprint
    differently are refused (bad input, naming both), rather than every value reading as different."""
    if which == "hash_scheme":
        sa, sb = ta.meta.get("hash_scheme"), tb.meta.get("hash_scheme")
    else:
        sa, sb = ((t.meta.get("tokens") or {}).get("row_scheme") for t in (ta, tb))
    if sa and sb and sa != sb:
        what = "fingerprint" if which == "hash_scheme" else "token row fingerprint"
        raise DivtraceError(f"{ta.path} and {tb.path} were recorded with different {what} schemes ({sa} vs {sb}: "
                            "different divtrace versions), so their fingerprints cannot be compared; record both "
                            "with one divtrace version")


def _bisect(a, b, tol: Tolerance | None, path_map: PathMap | None, n_next: int) -> BisectResult:
    ta = a if isinstance(a, Trace) else Trace(a)
    tb = b if isinstance(b, Trace) else Trace(b)
    for t in (ta, tb):
        if not t.calls and t.complete:
            raise DivtraceError(f"{t.path}: the trace holds no module calls (was the recorded model called inside "
                                "the record block?)")
    if not ta.calls or not tb.calls:  # a recording that stopped before its first call was written
        return _nothing_to_compare(ta, tb)
    pairing = Pairing(ta, tb, path_map)
    nonroot = lambda keys: {k for k in keys if k[0] != ""}
    if not pairing.common or (nonroot(pairing.by_key_a) and nonroot(pairing.by_key_b)
                              and not nonroot(pairing.common)):
        raise DivtraceError(
            f"{ta.path} and {tb.path} share no module calls: they look like traces of unrelated models "
            f"({ta.meta.get('model_class')}, {len(ta.calls)} calls vs {tb.meta.get('model_class')}, {len(tb.calls)} "
            "calls); if the two stacks name modules differently, pass --map FILE")
    cmp = ValueComparator(ta, tb, tol)
    # A call with no partner (a module one side has and the other writes inline, an engine's extra submodule)
    # is folded into its parent: its ops count as the parent's own code on both sides, where the walk by value
    # meets them.
    fa, fb, _ = folded_pairing(ta, tb, pairing)
    walker = OriginWalker(fa, fb, pairing, cmp)
    warnings = [f"trace {t.path} is incomplete (status: {getattr(t, 'status', t.meta.get('status'))}"
                + (f", {t.meta['error']}" if t.meta.get("error") else "") + "): only what ran before it stopped is compared"
                for t in (ta, tb) if not t.complete]
    warnings += [w for t in (ta, tb) for w in getattr(t, "warnings", [])]
    warnings += [f"{t.path} (recording): {w}" for t in (ta, tb) for w in t.meta.get("warnings") or []
                 if isinstance(w, str)]
    if ta.meta.get("ops") and tb.meta.get("ops") and ta.meta.get("view_key") != tb.meta.get("view_key"):
        warnings.append(f"the traces derive strided views' fingerprints differently (view_key {ta.meta.get('view_key')} "
                        f"vs {tb.meta.get('view_key')}: recorded by different divtrace versions); views inside a "
                        "module may compare unequal where their bytes are equal; module inputs and outputs are "
                        "unaffected: record both sides with one version to compare them")
    aligned = [(ca, cb) for ca in sorted(ta.calls.values(), key=lambda c: c.enter_index)
               if (cb := pairing.partner(ca)) is not None]
    first = None
    for ra, rb in _top_pairs(fa, pairing):
        if walker.differs(ra, rb):
            first = walker.localize(ra, rb)
            break
    # Sweep every aligned call (and same-sequence ops) so "identical" really means every compared tensor.
    diverging_calls = []
    for ca, cb in aligned:
        if walker.out_mismatch(ca, cb) is not None:
            diverging_calls.append((ca, cb))
        walker.in_mismatch(ca, cb)
        walker.first_op_mismatch(ca, cb)
    nxt = []
    for ca, cb in sorted(diverging_calls, key=lambda p: p[0].exit_index or 0):
        if len(nxt) >= n_next:
            break
        if first is not None and ((ca.module, ca.call) == (first.module, first.call)
                                  or (ca.exit_index or 0) <= first.index):
            continue
        m = walker.out_mismatch(ca, cb)
        cause = "propagated" if walker.in_mismatch(ca, cb) is not None else "origin"
        if cause == "origin" and first is not None and ca.enter_index < first.index < (ca.exit_index or 0):
            cause = "contains"  # an ancestor of the origin: its output differs because of what runs inside it
        d = walker.divergence(ca, cb, m[1], m[2], m[0], cause)
        nxt.append(d)
    if first is None and cmp.bitwise_differs and cmp.tol is None:
        # Differences the tree walk could not reach (calls that pair up under different parents): report the
        # earliest differing call rather than ever calling the runs identical.
        first = nxt.pop(0) if nxt else None
        warnings.append("the call trees of the two traces do not nest the same way; the first divergence is the "
                        "earliest differing call, not localized further")
    if not cmp.compared and not (ta.complete and tb.complete):
        return _nothing_to_compare(ta, tb, pairing.unmatched())  # stopped before any tensor pair was compared
    if not cmp.compared:
        # "identical" over no pair at all would be a claim about nothing (every tensor skipped when recording,
        # meta tensors, say): refuse rather than pass.
        raise DivtraceError(f"{ta.path} vs {tb.path}: no tensor of one trace has a counterpart in the other, so "
                            "nothing was compared; were the tensors skipped when recording? (see `divtrace show`)")
    unmatched = pairing.unmatched()
    if unmatched["a"] or unmatched["b"]:
        roots = [sum(1 for c in t.calls.values() if c.module == "") for t in (ta, tb)]
        warnings.append(f"{unmatched['a']} module calls only in a and {unmatched['b']} only in b were not compared"
                        + (f" (a called the root {roots[0]} times, b {roots[1]})" if roots[0] != roots[1] else "")
                        + "; if the stacks name modules differently, pass --map FILE")
    if first is None and cmp.bitwise_differs:
        verdict = "within_tolerance" if cmp.tol is not None else "diverged"
    else:
        verdict = "diverged" if first is not None else "identical"
    if verdict in ("identical", "within_tolerance"):
        # The verdict so far rests on the fingerprints in records.jsonl; before calling the runs equal, make sure
        # the stored bytes are what was recorded (a corrupted shard must never pass as identical).
        _verify_stored(ta, tb)
    if verdict == "diverged" and first is None:
        raise DivtraceError(f"{ta.path} vs {tb.path}: tensors differ but no aligned module call differs; "
                            "cannot localize (please report this)")
    final_compared, final_equal, final_note, final_local = final_outputs(ta, tb, pairing, walker)
    absorbed = _passed_over(walker)
    if (first is not None and first.cause != "propagated" and cmp.tol is None and final_compared and final_equal
            and _outputs_equal(walker, fa, pairing) and not any(map(_writes_in_place, (first, *nxt)))):
        # Every output of every top call was compared and is bitwise equal: what differs inside reaches no output
        # (a value the next op rounds away, a weight element no output row reads). Not an origin, as under token
        # alignment: absorbed, listed.
        absorbed += [_absorbed_entry(d) for d in (first, *nxt)]
        first, nxt = None, []
        _verify_stored(ta, tb)  # (as for identical)
    params = compare_parameters(ta, tb, path_map)  # (by name: never moves the origin, compare/params.py)
    if first is None:
        absorbed += absorbed_entries(params)  # a weight that differs where no output reads it: never "identical"
    v = decide(origin_found=first is not None, within_tolerance=verdict == "within_tolerance",
               final_compared=final_compared, final_equal=final_equal, a=trace_seen(ta, "a", tb),
               b=trace_seen(tb, "b", ta), calls_compared=len(aligned), only_a=unmatched["a"], only_b=unmatched["b"],
               final_note=final_note, final_local=final_local, absorbed=len(absorbed))
    env_keys = ("torch_version", "device", "cuda_device_name")
    sets = settings_diff({**ta.meta.get("settings", {}), **{k: ta.meta.get(k) for k in env_keys}},
                         {**tb.meta.get("settings", {}), **{k: tb.meta.get(k) for k in env_keys}})
    from divtrace.compare.compiled_report import annotate

    compiled, compiled_hint = annotate(ta, tb, first)
    hint = _hint(ta, tb, first)
    hint = "; ".join(h for h in (compiled_hint, hint) if h) or None
    return BisectResult(
        verdict=v.verdict, reason=v.reason, coverage=v.coverage, compared=cmp.compared, first=first, next=nxt,
        settings=sets,
        final=final_summary(ta, tb, pairing, cmp), labels=(ta.label, tb.label), paths=(str(ta.path), str(tb.path)),
        metrics_available=cmp.values_available, complete=(ta.complete, tb.complete), unmatched=unmatched,
        warnings=warnings, hint=hint, bitwise_differs=cmp.bitwise_differs, compiled=compiled,
        tolerance=None if cmp.tol is None else {"atol": cmp.tol.atol, "rtol": cmp.tol.rtol, "ulp": cmp.tol.ulp},
        absorbed=absorbed, parameters=params)


first_divergence = bisect
