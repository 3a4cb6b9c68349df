"""Token-aligned bisect: where a rollout and a trainer recompute part, for the tokens both computed.

1. Pair tokens by content (divtrace.align.tokens): a token of a decode step of a left-padded batch and
   the same token of a right-padded micro-batch of the trainer are one token.
2. Prove the pairing before any verdict: the position ids fed to the model, and the rows of the first
   embedding lookup (where its weights are equal on both sides), must agree for every shared token; else the
   token alignment is wrong (exit 2) and no origin is named.
3. Sweep: every paired module call's output rows, for every shared token, vectorized over tokens; the root
   output's rows (the logits) decide "identical".
4. Walk: for the first differing tokens of each sequence, bisect's walker on the two traces seen through that
   token (TokenView): the innermost module whose inputs are equal for the token while its output differs, and
   the first op inside it, by value. The earliest origin in forward order (then by position) is `first`; each
   distinct one is in `origins`.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from divtrace.align.calls import Pairing
from divtrace.align.paths import PathMap
from divtrace.align.tokens import TokenView, TraceTokens, shared_tokens
from divtrace.compare.diffs import Tolerance
from divtrace.compare.op_kinds import VALUE_PRESERVING
from divtrace.compare.results import BisectResult, Divergence, settings_diff, trace_seen
from divtrace.compare.values import TokenComparator
from divtrace.compare.verdict import INCONCLUSIVE, decide
from divtrace.compare.walker import OriginWalker
from divtrace.errors import DivtraceError
from divtrace.trace import token_layout as layout

MAX_WALKS = 48


@dataclass
class TokenBisectResult(BisectResult):
    alignment: str = "tokens"
    tokens: dict = field(default_factory=dict)
    origins: list = field(default_factory=list)
    first_extra: dict = field(default_factory=dict)
    first_cells: tuple | None = None  # (root call a, cell a, root call b, cell b) of `first`'s token (for repro)
    # module path -> (forward rank, {token key: differs}) from the sweep, and token key -> (sequence, position):
    # what `bisect --plot` draws as a token x module picture
    module_rows: dict = field(default_factory=dict)
    token_order: dict = field(default_factory=dict)
    token_sides: tuple | None = None  # the two TraceTokens (for repro)

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["alignment"] = "tokens"
        d["tokens"] = self.tokens
        d["origins"] = list(self.origins)
        if d["first"] is not None:
            d["first"].update(self.first_extra)
        return d


def _token_desc(tok: TraceTokens, cid: int, cell: int) -> dict:
    g = tok.index.grids[cid]
    s = g.seq[cell]
    key = g.keys[cell]
    return {"position": g.pos[cell], "id": g.ids[cell],
            "seq": {"id": f"{key:016x}"[:8], "number": s, "first_ids": tok.index.first_ids.get(s, [])}}


def _where(tok: TraceTokens, cid: int, cell: int) -> dict:
    g = tok.index.grids[cid]
    out = {"call": g.root_call, "row": cell}
    if len(g.shape) == 2:
        out["batch_row"], out["col"] = divmod(cell, g.shape[1])
    return out


def _check_alignment(sa: TraceTokens, sb: TraceTokens, groups: dict) -> None:
    """Exit 2 ("token alignment is wrong") where paired rows disagree where they must agree."""
    ga, gb = sa.index.grids, sb.index.grids
    for (ra, rb), toks in groups.items():
        for key, ca, cb in toks:
            fa, fb = ga[ra].fed[ca], gb[rb].fed[cb]
            if fa >= 0 and fb >= 0 and fa != fb:
                t = _token_desc(sa, ra, ca)
                raise DivtraceError(
                    f"token alignment is wrong: positions: the token at position {t['position']} of sequence "
                    f"{t['seq']['first_ids']}... was fed position id {fa} on a (root call {ga[ra].root_call}, row {ca}) "
                    f"and {fb} on b (root call {gb[rb].root_call}, row {cb}); the token rows were declared with the "
                    "wrong positions, or the two runs number positions differently")
        emb_a, emb_b = _embedding(sa, ra), _embedding(sb, rb)
        if emb_a is None or emb_b is None:
            continue
        (wa, oa), (wb, ob) = emb_a, emb_b
        if sa.trace.vkey[wa] != sb.trace.vkey[wb]:
            continue  # different embedding weights: a real difference, reported as a divergence
        for key, ca, cb in toks:
            ka, kb = sa.row_key(oa, ra, ca), sb.row_key(ob, rb, cb)
            if ka is not None and kb is not None and ka != kb:
                t = _token_desc(sa, ra, ca)
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


def final_rows(tok: TraceTokens) -> dict[int, tuple[int, int, int]]:
    """token key -> (grid call id, cell, vid) of the value holding that token's final logits: the logits output
    of the last call with a token grid that holds the token (a root call's output, or an engine's logits call,
    named in meta `engine.logits_module`)."""
    t = tok.trace
    logits_module = (t.meta.get("engine") or {}).get("logits_module")
    out: dict[int, tuple[int, int, int]] = {}
    for cid in sorted(tok.index.grids):
        call = t.calls.get(cid)
        if call is None or call.exit_index is None:
            continue
        if call.module != "" and not (logits_module and call.module.endswith(logits_module)):
            continue
        key = _final_key(tok, call)
        if key is None:
            continue
        g = tok.index.grids[cid]
        for cell, k in enumerate(g.keys):
            if k:
                out[k] = (cid, cell, key[1])
    return out


def _final_key(tok: TraceTokens, root) -> tuple[str, int] | None:
    """The call output that holds the logits (or logprobs), with token rows."""
    cands = []
    for key, vid in root.outputs:
        e = tok.index.index.get(vid)
        dtype = tok.trace.vkey[vid][0]
        if e is not None and e[2] >= 0 and ("float" in dtype):
            cands.append((key, vid))
    pref = [c for c in cands if "logit" in c[0] or "logprob" in c[0] or "log_prob" in c[0]]
    return (pref or cands or [None])[0]


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

    # -- sweep: module outputs and the final rows, per shared token -------------------------------------------
    differs: dict[int, bool] = {}
    final_diff: dict[int, bool] = {}
    module_rows: dict = {}
    compared = 0
    final_compared = 0
    for (ra, rb), toks in groups.items():
        va, vb = TokenView(sa, ra, toks[0][1]), TokenView(sb, rb, toks[0][2])
        pairing = Pairing(va, vb, path_map)
        cmp = TokenComparator(va, vb, tol)
        cells_a = np.array([c for _, c, _ in toks], dtype=np.int64)
        cells_b = np.array([c for _, _, c in toks], dtype=np.int64)
        bad = np.zeros(len(toks), dtype=bool)
        order = sa.order(ra)
        for call_a in va.calls.values():
            call_b = pairing.partner(call_a)
            if call_b is None:
                continue
            mod_bad, seen = np.zeros(len(toks), dtype=bool), False
            for _, xa, xb in cmp.pairs(call_a.outputs, call_b.outputs):
                got = _compare_rows(sa, sb, xa, xb, ra, rb, cells_a, cells_b)
                if got is not None:
                    neq, n = got
                    bad |= neq
                    mod_bad |= neq
                    compared += n
                    seen = True
            if seen:
                label = call_a.module + (f" #{call_a.call}" if call_a.call else "")
                rank, row = module_rows.setdefault(label, (order.get((call_a.module, call_a.call), 0), {}))
                for (k, _, _), d in zip(toks, mod_bad):
                    row[k] = row.get(k, False) or bool(d)
        for (k, _, _), d in zip(toks, bad):
            differs[k] = bool(d)
    # The final outputs: each shared token's logits row, wherever each side computed it (the root's output; an
    # engine's logits call after its forward, which has a token grid of its own).
    fin_a, fin_b = final_rows(sa), final_rows(sb)
    for k in shared:
        xa, xb = fin_a.get(k), fin_b.get(k)
        if xa is None or xb is None:
            continue
        ka, kb = sa.row_key(xa[2], xa[0], xa[1]), sb.row_key(xb[2], xb[0], xb[1])
        if not TokenComparator.comparable(ka, kb):
            continue
        final_compared += 1
        final_diff[k] = ka != kb
        differs[k] = differs.get(k, False) or final_diff[k]

    # -- walk the first differing tokens of each sequence -------------------------------------------------------
    ga = sa.index.grids
    pos_of = {k: ga[sa.where[k][0]].pos[sa.where[k][1]] for k in shared}
    seq_of = {k: ga[sa.where[k][0]].seq[sa.where[k][1]] for k in shared}
    diff_keys = sorted((k for k in shared if differs.get(k)), key=lambda k: pos_of[k])
    picked, per_seq = [], set()
    for k in diff_keys:
        if seq_of[k] not in per_seq:
            per_seq.add(seq_of[k])
            picked.append(k)
    for k in diff_keys:
        if len(picked) >= MAX_WALKS:
            break
        if k not in picked:
            picked.append(k)
    picked = picked[:MAX_WALKS]
    found = []
    for k in picked:
        ra, ca = sa.where[k]
        rb, cb = sb.where[k]
        va, vb = TokenView(sa, ra, ca), TokenView(sb, rb, cb)
        cmp = TokenComparator(va, vb, tol)
        walker = OriginWalker(va, vb, Pairing(va, vb, path_map), cmp)
        if not walker.differs(va.root, vb.root):
            continue
        d = walker.localize(va.root, vb.root)
        rank = sa.order(ra).get((d.module, d.call), 1 << 30)
        op_rank = d.index if d.kind == "op" else (1 << 30)
        op_rank -= va.calls[ra].enter_index if op_rank < (1 << 30) else 0
        # an origin before a propagation (a token whose inputs already differ says less), then forward order
        found.append(((d.cause != "origin", rank, op_rank, pos_of[k]), k, d, ra, ca, rb, cb))
    found.sort(key=lambda f: f[0])

    # -- report ------------------------------------------------------------------------------------------------
    first = None
    first_extra: dict = {}
    first_cells = None
    origins = []
    if found:
        _, k, first, ra, ca, rb, cb = found[0]
        first_cells = (ra, ca, rb, cb)
        first_extra = _first_extra(sa, sb, first, ra, ca, rb, cb)
        seen = {}
        for _, kk, d, ra_, ca_, rb_, cb_ in found:
            sig = (d.module, d.call, d.op, d.op_b, d.cause)
            if sig in seen:
                seen[sig]["tokens"] += 1
                continue
            o = d.to_dict()
            o.update(_first_extra(sa, sb, d, ra_, ca_, rb_, cb_))
            o["tokens"] = 1
            seen[sig] = o
            origins.append(o)
    n_diff = sum(1 for k in shared if differs.get(k))
    final_bad = sum(1 for v in final_diff.values() if v)
    tokens = {"shared": len(shared), "only_a": len(sa.where) - len(shared), "only_b": len(sb.where) - len(shared),
              "differing": n_diff, "final_compared": final_compared, "final_differing": final_bad,
              "walked": len(picked)}
    warnings = []
    # values whose token rows cannot be compared row by row: attention scores and 4-D masks (they lay the other
    # tokens out per call), ambiguous shapes; counted, not warned of (every decode step has them)
    tokens["not_row_compared"] = {side: sum(((t.meta.get("tokens") or {}).get("compared_whole") or {}).values())
                                  for side, t in (("a", ta), ("b", tb))}
    if tokens["only_a"] or tokens["only_b"]:
        warnings.append(f"{tokens['only_a']} tokens only in a and {tokens['only_b']} only in b were not compared "
                        f"({len(shared)} shared; a rollout never feeds back its last sampled token, which a trainer "
                        "recomputes)")
    for t in (ta, tb):
        if not t.complete:
            warnings.append(f"trace {t.path} is incomplete (status: {t.meta.get('status')}): only what ran before it "
                            "stopped is compared")
        warnings += [f"{t.path} (recording): {w}" for w in t.meta.get("warnings") or [] if isinstance(w, str)]
        warnings += [w for w in getattr(t, "warnings", []) if w not in warnings]  # what reading it found
    # The verdict rule (divtrace.compare.verdict): the final outputs are each shared token's logits row.
    ver = decide(origin_found=first is not None, within_tolerance=False, final_compared=final_compared > 0,
               final_equal=not final_bad, a=trace_seen(ta, "a", tb), b=trace_seen(tb, "b", ta),
               calls_compared=len(shared), only_a=tokens["only_a"], only_b=tokens["only_b"], unit="tokens",
               final_note="no shared token's logits were recorded with token rows on both sides")
    verdict, reason = ver.verdict, ver.reason
    if first is None and n_diff and verdict != INCONCLUSIVE:
        # (final logits all equal, yet some module row differs: never identical; nothing localized it either)
        verdict, reason = INCONCLUSIVE, (
            f"{n_diff} shared tokens differ in some module's output, but no module whose inputs are equal for such a "
            "token was found (the difference enters through values that cannot be compared row by row, such as "
            "attention scores); compare with --align calls where the runs share their calls")
    if verdict == "identical":
        for t in (ta, tb):
            v = getattr(t, "verify_shards", None)
            if v is not None:
                v()
    final = _final_summary(sa, sb, groups, final_diff, ta, tb, fin_a, fin_b) if final_compared else None
    env_keys = ("torch_version", "device", "cuda_device_name")
    sets = settings_diff({**ta.meta.get("settings", {}), **{k: ta.meta.get(k) for k in env_keys}},
                          {**tb.meta.get("settings", {}), **{k: tb.meta.get(k) for k in env_keys}})
    metrics = ta.mode == "full" and tb.mode == "full"
    return TokenBisectResult(
        verdict=verdict, compared=compared, first=first, next=[], settings=sets, final=final,
        labels=(ta.label, tb.label), paths=(str(ta.path), str(tb.path)), metrics_available=metrics,
        complete=(ta.complete, tb.complete), unmatched={"a": 0, "b": 0}, warnings=warnings, hint=None,
        bitwise_differs=n_diff, tolerance=None, tokens=tokens, origins=origins, first_extra=first_extra,
        reason=reason, coverage=ver.coverage, first_cells=first_cells, token_sides=(sa, sb), module_rows=module_rows,
        token_order={k: (seq_of[k], pos_of[k]) for k in shared})


def _compare_rows(sa, sb, va, vb, ra, rb, cells_a, cells_b, with_valid=False):
    """(tokens whose rows differ, how many were compared[, valid]) for one value pair, or None when the values
    have no comparable rows."""
    xa = sa.rows_at(va, ra, cells_a)
    xb = sb.rows_at(vb, rb, cells_b)
    if xa is None or xb is None or tuple(xa[1]) != tuple(xb[1]):
        return None
    valid = xa[3] & xb[3]
    neq = (xa[2] != xb[2]) if xa[0] == xb[0] else np.ones(len(valid), dtype=bool)
    neq &= valid
    n = int(valid.sum())
    return (neq, n, valid) if with_valid else (neq, n)


def _first_extra(sa, sb, d: Divergence, ra, ca, rb, cb) -> dict:
    out = {"token": {**_token_desc(sa, ra, ca), "a": _where(sa, ra, ca), "b": _where(sb, rb, cb)}}
    rows = {"a": None, "b": None}
    for side, tok, root, idx in (("a", sa, ra, d.index if d.kind == "op" else None),
                                 ("b", sb, rb, d.index_b if d.kind == "op" else None)):
        if idx is None:
            continue
        outs = tok.trace.rout[idx] if idx < len(tok.trace.rout) else None
        if not outs:
            continue
        e = tok.index.index.get(outs[0])
        if e is not None and e[0] == root:
            rows[side] = layout.row_count(e[1], tok.index.grids[root].shape) if e[2] >= 0 else None
    out["rows"] = rows
    # Only where both sides part at the same op and run the same computing ops: another op (a cast where the other
    # multiplies) or another algorithm (mm against slice, mm, mm, add: split-K) is another computation, whatever
    # the batch sizes.
    if d.cause == "origin" and d.op is not None and d.op == d.op_b and rows["a"] and rows["b"] and \
            rows["a"] != rows["b"] and _computing_ops(d.region_a) == _computing_ops(d.region_b):
        op = d.op or d.op_b
        out["batch_invariance"] = {
            "batch_invariant": False, "rows": rows,
            "note": f"{op} ran over {rows['a']} rows on a and {rows['b']} on b: the token's input rows are equal and "
                    "its output row differs, so the kernel's result depends on the batch size (not batch-invariant)"}
    return out


def _computing_ops(region: list[tuple[int, str]]) -> list[str]:
    """A region's op names without the ops that only rearrange values (views, slices); casts are kept."""
    keep = {"_to_copy", "copy_", "copy"}
    return [op for _, op in region if (op.split(".") + [""])[1] not in VALUE_PRESERVING - keep]


def _final_summary(sa, sb, groups, final_diff, ta, tb, fin_a, fin_b) -> dict:
    out = {"tensor": "per-token logits", "identical": not any(final_diff.values()),
           "tokens_compared": len(final_diff), "tokens_differing": sum(final_diff.values())}
    first_bad = None
    for (ra, rb), toks in groups.items():
        for k, ca, cb in toks:
            if final_diff.get(k):
                t = _token_desc(sa, ra, ca)
                if first_bad is None or t["position"] < first_bad["position"]:
                    first_bad = {**t, "a": _where(sa, ra, ca), "b": _where(sb, rb, cb)}
    out["first_differing_token"] = first_bad
    if ta.mode == "full" and tb.mode == "full":
        from divtrace.compare.token_final import per_token_logprob_metrics

        out.update(per_token_logprob_metrics(sa, sb, groups, ta.label, tb.label, fin_a, fin_b))
    return out
