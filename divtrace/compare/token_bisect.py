"""Token-aligned bisect: where a rollout and a trainer recompute part, for the tokens both computed, judged by what
users judge by: each token's final value (its logits row or logprob).

1. Pair tokens by content (divtrace.align.tokens): a token of a decode step of a left-padded batch and the same
   token of a right-padded micro-batch of the trainer are one token. Prove the pairing (the embedding rows of equal
   weights must agree) before any verdict; where it fails, exit 2 and no origin.
2. Compare every shared token's final value wherever each side computed it (token_finals): the verdict leads with
   it ("logprobs bitwise identical on N/N tokens" or "differ on K of N").
3. Sweep every paired call's rows, and the rows of ops where both sides ran the same ops (token_sweep): counts per
   module, each token's first differing module, and the absorbed differences (those that reach no output).
4. Explain each token whose final value differs (token_origins): positions first, then one walk per distinct first
   module along differing outputs; the origins with their true counts, the earliest op first.
5. The verdict (divtrace.compare.verdict): diverged when an origin was found; absorbed (exit 4) when every final
   value is equal but something inside differs; identical when nothing differs; inconclusive when a trace stopped,
   the final values could not be compared, or the runs did not do the same work (coverage).

In: two traces with token identity. Out: a `TokenBisectResult`.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from divtrace.align.paths import PathMap
from divtrace.align.tokens import TraceTokens, shared_tokens
from divtrace.align.views import TokenViews
from divtrace.compare.diffs import Tolerance
from divtrace.compare.params import absorbed_entries, compare_parameters
from divtrace.compare.results import BisectResult, Divergence, settings_diff, trace_seen
from divtrace.compare.token_finals import compare_finals, final_values, finals_report, unattributed
from divtrace.compare.token_origins import Origin, find_origins, position_diffs
from divtrace.compare.token_report import absorbed_list, origin_extra, token_desc, token_of
from divtrace.compare.token_sweep import sweep
from divtrace.compare.verdict import decide
from divtrace.errors import DivtraceError


@dataclass
class TokenBisectResult(BisectResult):
    alignment: str = "tokens"
    tokens: dict = field(default_factory=dict)
    origins: list = field(default_factory=list)
    absorbed: list = field(default_factory=list)
    first_extra: dict = field(default_factory=dict)
    first_cells: tuple | None = None  # (root call a, cell a, root call b, cell b) of `first`'s token (for repro)
    # module path -> (forward rank, {token key: differs}) from the sweep, and token key -> (sequence, position):
    # what `bisect --plot` draws as a token x module picture
    module_rows: dict = field(default_factory=dict)
    token_order: dict = field(default_factory=dict)
    token_sides: tuple | None = None  # the two TraceTokens (for repro)
    origin_cells: list = field(default_factory=list)  # first_cells of each of `origins` (repro --at)
    origin_divs: list = field(default_factory=list)  # the Divergence of each of `origins` (None: positions...)

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["alignment"] = "tokens"
        d["tokens"] = self.tokens
        d["origins"] = list(self.origins)
        d["absorbed"] = list(self.absorbed)
        if d["first"] is not None:
            d["first"].update(self.first_extra)
        elif self.origins and self.origins[0].get("kind") in ("positions", "derivation"):
            d["first"] = dict(self.origins[0])
        return d


def token_bisect(ta, tb, *, tol: Tolerance | None = None, path_map: PathMap | None = None,
                 n_next: int = 5) -> TokenBisectResult:
    if tol is not None and tol.active():
        raise DivtraceError("--atol/--rtol/--ulp are not supported with token alignment yet (rows are compared "
                            "bitwise); drop the tolerance, or use --align calls")
    sa, sb = TraceTokens(ta), TraceTokens(tb)
    shared = shared_tokens(sa, sb)
    groups: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)
    for k in shared:
        ra, ca = sa.where[k]
        rb, cb = sb.where[k]
        groups[(ra, rb)].append((k, ca, cb))
    _check_alignment(sa, sb, groups)
    views = TokenViews(sa, sb, path_map)
    sw = sweep(sa, sb, groups, views, tol)
    fin_a, fin_b = final_values(sa), final_values(sb)
    fin = compare_finals(sa, sb, shared, fin_a, fin_b)
    positions = position_diffs(sa, sb, shared)
    # The tokens to explain: those whose final value differs. Where no final value could be compared, those with a
    # differing row anywhere (the verdict then says the finals were not compared).
    explain = list(fin.differ) if fin.compared else [k for k in shared if k in sw.first_module or k in positions]
    found, walked = find_origins(sa, sb, views, explain, sw.first_module, sw.module_rows, positions, fin_a, fin_b,
                                 tol, any_differs=sw.any_differs)
    origins, origin_cells = [], []
    for o in found:
        origins.append(_origin_dict(sa, sb, o))
        origin_cells.append(o.cells)
    real = [o for o in found if o.kind not in ("derivation",)]
    first_o = real[0] if real else None
    first = first_o.d if first_o is not None else None
    first_extra = origins[found.index(first_o)] if first_o is not None and first is not None else {}
    first_extra = {k: v for k, v in first_extra.items() if k not in first.to_dict()} if first is not None else {}

    final_differ = set(fin.differ)
    absorbed = absorbed_list(sw.absorbed, final_differ)
    one_sided, gaps = _coverage(sa, sb, shared, views, fin_a, fin_b)
    loose = {"a": unattributed(sa, fin_a), "b": unattributed(sb, fin_b)}
    tokens = {"shared": len(shared), "only_a": len(sa.where) - len(shared), "only_b": len(sb.where) - len(shared),
              "differing": len(sw.any_differs | final_differ), "final_compared": fin.compared,
              "final_differing": fin.n_differ, "walked": walked,
              "modules": {label: n for label, n in sorted(sw.module_counts().items(),
                                                           key=lambda kv: sw.module_rows[kv[0]][0])},
              "positions_differ": len(positions), "folded_calls": dict(zip("ab", views.folded())),
              "unpaired_calls": gaps, "one_sided": one_sided, "undeclared_finals": loose}
    tokens["not_row_compared"] = {side: sum(((t.meta.get("tokens") or {}).get("compared_whole") or {}).values())
                                  for side, t in (("a", ta), ("b", tb))}
    warnings = _warnings(ta, tb, tokens, fin)
    derivation_only = any(o.kind == "derivation" for o in found) and not real
    internal = len(absorbed) + (len(sw.any_differs - final_differ) if not absorbed else 0)
    params = compare_parameters(ta, tb, path_map)  # (by name: never moves an origin, compare/params.py)
    if not real:  # a weight that differs where no token's output reads it: never "identical"
        absorbed += absorbed_entries(params)
        internal += len(params["differ"]) + len(params.get("replicas") or ())  # (a replica that differs: a finding)
    ver = decide(origin_found=bool(real), within_tolerance=False, final_compared=fin.compared > 0,
                 final_equal=not fin.differ, a=trace_seen(ta, "a", tb), b=trace_seen(tb, "b", ta),
                 calls_compared=len(shared), only_a=tokens["only_a"], only_b=tokens["only_b"], unit="tokens",
                 final_note=_final_note(fin), absorbed=internal if fin.compared and not fin.differ else 0,
                 gaps=_gap_words(one_sided, gaps, loose))
    verdict, reason = ver.verdict, ver.reason
    if derivation_only and verdict == "inconclusive" and not fin.compared == 0:
        reason = ("the logprobs differ only where divtrace derived them from logits (" + _DERIV + "): the derivation, "
                  "not an op of either run; declare each side's own logprobs with rec.final(values, rows, "
                  "kind='logprobs') to compare what each run computed; " + reason)
    if verdict in ("identical", "absorbed"):
        for t in (ta, tb):
            v = getattr(t, "verify_shards", None)
            if v is not None:
                v()
    final = finals_report(sa, sb, fin, fin_a, fin_b, lambda k: token_of(sa, sb, k)) if fin.compared or \
        fin.only_a or fin.only_b else None
    if final is not None and ta.mode == "full" and tb.mode == "full":
        from divtrace.compare.token_final import per_token_logprob_metrics

        logits_a = {k: (f.cid, f.cell, f.vid) for k, f in fin_a.items() if f.kind == "logits"}
        logits_b = {k: (f.cid, f.cell, f.vid) for k, f in fin_b.items() if f.kind == "logits"}
        final.update(per_token_logprob_metrics(sa, sb, groups, ta.label, tb.label, logits_a, logits_b))
        if fin.logprob:
            d = max(abs(a - b) for a, b in fin.logprob.values())
            final["max_abs_logprob_diff"] = max(d, final.get("max_abs_logprob_diff") or 0.0)
    env_keys = ("torch_version", "device", "cuda_device_name")
    sets = settings_diff({**ta.meta.get("settings", {}), **{k: ta.meta.get(k) for k in env_keys}},
                         {**tb.meta.get("settings", {}), **{k: tb.meta.get(k) for k in env_keys}})
    order = {}
    for k in shared:
        ra, ca = sa.where[k]
        g = sa.index.grids[ra]
        order[k] = (g.seq[ca], g.pos[ca])
    return TokenBisectResult(
        verdict=verdict, compared=sw.compared + fin.compared, first=first, next=[], settings=sets, final=final,
        labels=(ta.label, tb.label), paths=(str(ta.path), str(tb.path)),
        metrics_available=ta.mode == "full" and tb.mode == "full", complete=(ta.complete, tb.complete),
        unmatched={"a": len(gaps), "b": len(gaps)}, warnings=warnings, hint=None,
        bitwise_differs=tokens["differing"], tolerance=None, tokens=tokens, origins=origins, absorbed=absorbed,
        first_extra=first_extra, reason=reason, coverage=ver.coverage,
        first_cells=first_o.cells if first_o is not None else None, token_sides=(sa, sb), module_rows=sw.module_rows,
        token_order=order, origin_cells=origin_cells, origin_divs=[o.d for o in found], parameters=params)


_DERIV = "fp32 log_softmax of the logits row, gathered at the next token's id"


def _origin_dict(sa, sb, o: Origin) -> dict:
    """One entry of `origins` (the first is `first`): the Divergence's fields, the token, and the true counts."""
    ra, ca, rb, cb = o.cells
    if o.d is None:
        tok = token_of(sa, sb, o.key)
        if o.kind == "positions":
            pa, pb = o.positions
            text = (f"position ids differ on {len(o.tokens)} tokens: a {pa}.., b {pb}.. (the model computed these "
                    "tokens at other positions: pass the same position_ids to both, e.g. the trainer's "
                    "cumsum of the attention mask over left padding)")
        else:
            text = ("the logprobs differ only where divtrace derived them from logits (" + _DERIV + "): the "
                    "derivation, not an op of either run")
        return {"index": None, "module": "", "call": 0, "op": None, "op_b": None, "kind": o.kind, "cause": o.kind,
                "cause_text": text, "tokens": len(o.tokens), "token": tok, "positions": list(o.positions or ()),
                "tensor": "position ids" if o.kind == "positions" else "logprobs"}
    out = o.d.to_dict()
    out.update(origin_extra(sa, sb, o.d, ra, ca, rb, cb, o.uncompared))
    out["tokens"] = len(o.tokens)
    if o.note:
        out["note"] = o.note
        out["reaches"] = [token_of(sa, sb, k) for k in sorted(o.tokens, key=lambda k: _pos(sa, k))[:3]]
    return out


def _pos(sa, k):
    cid, cell = sa.where[k]
    return sa.index.grids[cid].pos[cell]


def _coverage(sa, sb, shared, views, fin_a: dict, fin_b: dict) -> tuple[dict, list]:
    """Tokens only one side fed, beyond the one expected asymmetry (a rollout never feeds back its last sampled
    token, which a trainer recomputes: the last token of a sequence whose predecessor both sides fed), and calls
    left unpaired that nothing compares. A side that declares its final values (rec.final) says which rows are
    its outputs: a token it fed whose logprob it reports nowhere, neither at the token nor at the one before
    (padding generate feeds after a sequence's end), is outside them."""
    shared_set = set(shared)
    one = {}
    for side, tok, fin in (("a", sa, fin_a), ("b", sb, fin_b)):
        last: dict = {}
        for k, (cid, cell) in tok.where.items():
            g = tok.index.grids[cid]
            s = g.seq[cell]
            if g.pos[cell] > last.get(s, (-1, None))[0]:
                last[s] = (g.pos[cell], k)
        prev: dict = {}
        for k, (cid, cell) in tok.where.items():
            g = tok.index.grids[cid]
            prev[(g.seq[cell], g.pos[cell])] = k
        extra = 0
        for k, (cid, cell) in tok.where.items():
            if k in shared_set:
                continue
            g = tok.index.grids[cid]
            s, p = g.seq[cell], g.pos[cell]
            if last.get(s, (None, None))[1] == k and prev.get((s, p - 1)) in shared_set:
                continue  # the last sampled token, recomputed by one side only
            if tok.declared_final and k not in fin and prev.get((s, p - 1)) not in fin:
                continue
            extra += 1
        one[side] = extra
    return one, views.unpaired_gaps()


def _gap_words(one_sided: dict, gaps: list, loose: dict) -> list[str]:
    out = []
    for side in ("a", "b"):
        if loose[side]:
            out.append(f"{len(loose[side])} root calls of {side} return final values with no token rows "
                       f"({loose[side][0]}, ...): declare which token each row is with rec.final(values, rows) "
                       "so that their logprobs are compared")
    if one_sided["a"] or one_sided["b"]:
        out.append(f"{one_sided['a']} tokens only a fed and {one_sided['b']} only b fed (beyond a rollout's last "
                   "sampled token)")
    if gaps:
        out.append(f"{len(gaps)} module calls left unpaired, whose tensors nothing compares ({', '.join(gaps[:3])}"
                   + (", ..." if len(gaps) > 3 else "") + "; a --map that renames them on one side only?)")
    return out


def _final_note(fin) -> str:
    if fin.not_compared:
        return f"no shared token's final value could be compared ({fin.not_compared[0][1]})"
    if fin.only_a or fin.only_b:
        return ("the final values (logits or logprobs) of the shared tokens were computed by one side only "
                f"({len(fin.only_a)} on a, {len(fin.only_b)} on b)")
    return ("no shared token's final value (logits row or logprob) was recorded with token rows on both sides: an "
            "engine or a fused head that computes them on some rows only declares them with rec.final(values, rows)")


def _warnings(ta, tb, tokens, fin) -> list[str]:
    warnings = []
    if tokens["only_a"] or tokens["only_b"]:
        warnings.append(f"{tokens['only_a']} tokens only in a and {tokens['only_b']} only in b were not compared "
                        f"({tokens['shared']} shared; a rollout never feeds back its last sampled token, which a "
                        "trainer recomputes)")
    if fin.only_a or fin.only_b:
        warnings.append(f"final values on one side only: {len(fin.only_a)} tokens on a, {len(fin.only_b)} on b (not "
                        "compared; prompt rows under logits_to_keep, or a trainer that scores the completion only)")
    for t in (ta, tb):
        if not t.complete:
            warnings.append(f"trace {t.path} is incomplete (status: {t.meta.get('status')}): only what ran before it "
                            "stopped is compared")
        warnings += [f"{t.path} (recording): {w}" for w in t.meta.get("warnings") or [] if isinstance(w, str)]
        warnings += [w for w in getattr(t, "warnings", []) if w not in warnings]  # what reading it found
    return warnings


def _check_alignment(sa: TraceTokens, sb: TraceTokens, groups: dict) -> None:
    """Exit 2 ("token alignment is wrong") where paired rows disagree where they must agree: the first embedding
    lookup of identical weights gives each token's row from its id alone. (Position ids that differ are no
    alignment error: the model computed the token at another position, which is a cause, see token_origins.)"""
    ga, gb = sa.index.grids, sb.index.grids
    for (ra, rb), toks in groups.items():
        emb_a, emb_b = _embedding(sa, ra), _embedding(sb, rb)
        if emb_a is None or emb_b is None:
            continue
        (wa, oa), (wb, ob) = emb_a, emb_b
        if sa.trace.vkey[wa] != sb.trace.vkey[wb]:
            continue  # different embedding weights: a real difference, reported as a divergence
        for key, ca, cb in toks:
            ka, kb = sa.row_key(oa, ra, ca), sb.row_key(ob, rb, cb)
            if ka is not None and kb is not None and ka != kb:
                t = token_desc(sa, ra, ca)
                raise DivtraceError(
                    f"token alignment is wrong: layout: the embedding lookup gives different rows for the token at "
                    f"position {t['position']} (id {t['id']}, sequence {t['seq']['first_ids']}...) on a (root call "
                    f"{ga[ra].root_call}, row {ca}) and b (root call {gb[rb].root_call}, row {cb}) although the "
                    "embedding weights are bitwise equal: the rows paired are not the same token (ids or token "
                    "layout declared wrong)")


def _embedding(tok: TraceTokens, root_cid: int):
    """(weight vid, output vid) of the first embedding lookup of a root call that has token rows, or None."""
    t = tok.trace
    for c in sorted(tok.root_calls(root_cid).values(), key=lambda c: c.enter_index):
        for i in c.ops:
            if t.rop[i] == "aten.embedding.default" and t.rin[i] and t.rout[i]:
                out = t.rout[i][0]
                if out in tok.index.index:
                    return t.rin[i][0], out
                return None
    return None


