"""The final value of every shared token, wherever each side computed it, compared like with like.

A token's final value is what its logprob is made of:
- a logits row: the root output's row for the token (`[B, T, V]`, flattened `[N, V]`, or the last cells only,
  HF's `logits_to_keep`), an engine's logits call (meta `engine.logits_module`), or logits declared with
  `rec.final(...)`. The row of the token at position p predicts the token at p + 1;
- a logprob: a root output `[B, T-1]` (or the completion's `[B, K]`) of per-token log-probabilities, or logprobs
  declared with `rec.final(..., kind="logprobs")`; the value at the token at position p is the logprob of the
  token at p + 1 (keyed, like the logits row it comes from, by the token that predicts).
Declared values win over what the root returns: a trace that declares any final value with `rec.final` says which
rows its final values are, and its other rows are none (a rollout declares the sampled tokens' logprobs; the prompt's
logits rows it also computed are no logprobs it reports). Two logits rows, or two logprobs, compare bitwise by their row
fingerprints. A logits row against a logprob is compared after deriving the logprob from the logits by one stated
rule, DERIVATION (this needs the logits' values: full mode); a difference that shows only there is the
derivation's, not an op's.

In: the two traces' tokens (divtrace.align.tokens). Out: `FinalValue`s per token and a `Finals` comparison.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from divtrace.align.tokens import Incomparable, TraceTokens
from divtrace.trace import token_layout as layout

DERIVATION = "fp32 log_softmax of the logits row, gathered at the next token's id"
_NAMED = ("logit", "logprob", "log_prob", "logps")


@dataclass
class FinalValue:
    cid: int  # the call whose grid holds the token (a root call, an engine's logits call, rec.final's call)
    cell: int
    vid: int
    kind: str  # "logits" | "logprobs"
    key: tuple  # the row's (dtype, (elements,), fingerprint)
    target: int | None = None  # logprobs: the id the value is the logprob of, where known
    # logprobs: target id -> value, where one prefix has several continuations in the trace (a GRPO group samples
    # several completions of one prompt: one token key, one logits row, a logprob per continuation)
    alts: dict = field(default_factory=dict)


def _kind_of(key: tuple) -> str:
    return "logits" if key[1][0] > 1 else "logprobs"


def final_values(tok: TraceTokens) -> dict[int, FinalValue]:
    """token key -> its final value in one trace (see the module docstring)."""
    t = tok.trace
    logits_module = (t.meta.get("engine") or {}).get("logits_module")
    out: dict[int, FinalValue] = {}
    declared: dict[int, FinalValue] = {}
    nxt = None
    for cid in sorted(tok.index.grids):
        g = tok.index.grids[cid]
        call = t.calls.get(cid)
        if call is None or call.exit_index is None:
            continue
        if g.final is None and call.module != "" and not (logits_module and call.module.endswith(logits_module)):
            continue
        cands = []
        for name, vid in call.outputs:
            e = tok.index.index.get(vid)
            # (a declared value whose rows were written in its root call already: read there)
            if e is not None and (e[0] == cid or g.final is not None) and e[2] >= 0 and "float" in t.vkey[vid][0]:
                cands.append((name, vid, e[1]))
        if not cands:
            continue
        named = [c for c in cands if any(n in c[0] for n in _NAMED)]
        name, vid, code = (named or cands)[0]
        at = tok.index.index[vid][0]
        for cell, k in enumerate(g.keys):
            if not k:
                continue
            if at == cid:
                key = tok.row_key(vid, cid, cell)
            else:  # rows in the token's root call
                root, root_cell = tok.where.get(k, (None, None))
                key = tok.row_key(vid, root, root_cell) if root == at else None
            if key is None or isinstance(key, Incomparable):
                continue
            kind = g.final or _kind_of(key)
            target = g.next[cell] if g.final == "logprobs" and g.next else None
            if kind == "logprobs" and target is None and g.final is None:  # the next token of the cell's sequence
                nxt = next_ids(tok) if nxt is None else nxt
                target = nxt.get((g.seq[cell], g.pos[cell] + 1))
            fv = FinalValue(cid, cell, vid, kind, key, target) if at == cid else \
                FinalValue(at, tok.where[k][1], vid, kind, key, target)
            into = declared if g.final is not None else out
            have = into.get(k)
            if have is None:
                into[k] = have = fv
            if kind == "logprobs" and target is not None and have.kind == "logprobs":
                have.alts.setdefault(target, fv)
    return declared if declared else out


def unattributed(tok: TraceTokens, finals: dict) -> list[str]:
    """Root calls whose output looks like final values (a float tensor of 2 or more dims) that hold no token rows,
    while some token of the call has no final value: an engine's logits of the last row of each sequence
    (`[num_seqs, vocab]`), which belong to no token divtrace knows until they are declared with rec.final. Their
    logprobs would go uncompared unseen: a coverage gap, in words."""
    t = tok.trace
    out = []
    for cid in sorted(tok.index.grids):
        g = tok.index.grids[cid]
        call = t.calls.get(cid)
        if g.final is not None or call is None or call.module != "" or call.exit_index is None:
            continue
        if all(not k or k in finals for k in g.keys) or any(k in tok.declared_final for k in g.keys if k):
            continue  # (an engine that declares some rows of a call says which rows its final values are)
        for name, vid in call.outputs:
            dtype, shape, _ = t.vkey[vid]
            e = tok.index.index.get(vid)
            if "float" in dtype and len(shape) >= 2 and (e is None or e[0] != cid or e[2] < 0):
                out.append(f"root call {g.root_call}'s {name} {list(shape)}")
                break
    return out


def next_ids(tok: TraceTokens) -> dict:
    """(sequence number, position) -> token id, over the trace's grids: what follows each token."""
    out = {}
    for g in tok.index.grids.values():
        if g.final is None:
            for s, p, i in zip(g.seq, g.pos, g.ids):
                if s >= 0:
                    out[(s, p)] = i
    return out


@dataclass
class Finals:
    """The comparison of the shared tokens' final values."""

    equal: list = field(default_factory=list)  # token keys
    differ: list = field(default_factory=list)
    only_a: list = field(default_factory=list)  # a final value on one side only (prompt rows under logits_to_keep)
    only_b: list = field(default_factory=list)
    not_compared: list = field(default_factory=list)  # (key, why): a derivation that needs values, another target
    derived: set = field(default_factory=set)  # keys compared through DERIVATION
    logprob: dict = field(default_factory=dict)  # key -> (logprob a, logprob b) where derived or declared logprobs
    # sampled tokens: a key counts once per continuation compared (a GRPO group's shared prompt: one per completion)
    n_equal: int = 0
    n_differ: int = 0

    @property
    def compared(self) -> int:
        return self.n_equal + self.n_differ


def compare_finals(sa: TraceTokens, sb: TraceTokens, shared: list, fin_a: dict, fin_b: dict) -> Finals:
    out = Finals()
    cache: dict = {}
    for k in shared:
        fa, fb = fin_a.get(k), fin_b.get(k)
        if fa is None or fb is None:
            if fa is not None:
                out.only_a.append(k)
            elif fb is not None:
                out.only_b.append(k)
            continue
        if fa.kind == fb.kind == "logprobs" and (len(fa.alts) > 1 or len(fb.alts) > 1):
            pairs = [(fa.alts[t], fb.alts[t]) for t in sorted(set(fa.alts) & set(fb.alts))]
            if not pairs:
                out.not_compared.append((k, f"the logprobs are of other tokens (ids {sorted(fa.alts)[:4]} and "
                                            f"{sorted(fb.alts)[:4]})"))
                continue
        elif fa.kind == "logprobs" and fb.kind == "logits" and len(fa.alts) > 1:
            pairs = [(x, fb) for _, x in sorted(fa.alts.items())]
        elif fb.kind == "logprobs" and fa.kind == "logits" and len(fb.alts) > 1:
            pairs = [(fa, x) for _, x in sorted(fb.alts.items())]
        else:
            pairs = [(fa, fb)]
        verdict = None
        for xa, xb in pairs:  # every continuation both sides hold; the token differs if one of them does
            one = _compare_one(sa, sb, xa, xb, k, out, cache)
            if one is None or isinstance(one, str):
                verdict = verdict or one
                continue
            if one:
                out.n_equal += 1
            else:
                out.n_differ += 1
                if verdict != "differ":
                    fin_a[k], fin_b[k] = xa, xb  # the walk starts from the first pair that differs
            verdict = "differ" if not one else (verdict if verdict == "differ" else "equal")
        if verdict == "differ":
            out.differ.append(k)
        elif verdict == "equal":
            out.equal.append(k)
        else:
            out.not_compared.append((k, verdict or "no final value to compare"))
    return out


def _compare_one(sa, sb, fa: FinalValue, fb: FinalValue, k: int, out: Finals, cache: dict):
    """True (bitwise equal) / False (differ) for one pair of final values, or why they cannot be compared."""
    if fa.kind == fb.kind:
        if fa.kind == "logprobs" and fa.target is not None and fb.target is not None and fa.target != fb.target:
            return f"the logprobs are of other tokens (ids {fa.target} and {fb.target})"
        return fa.key == fb.key
    if "nxt" not in cache:
        cache["nxt"] = (next_ids(sa), next_ids(sb))
    got = _derived_pair(sa, sb, fa, fb, k, *cache["nxt"], cache)
    if isinstance(got, str):
        return got
    la, lb = got
    out.derived.add(k)
    same = _same_bits(la, lb)
    if k not in out.logprob or not same:
        out.logprob[k] = (float(la), float(lb))
    return same


def _same_bits(x, y) -> bool:
    return x.dtype == y.dtype and x.reshape(-1).view(_int_of(x)).tolist() == y.reshape(-1).view(_int_of(y)).tolist()


def _int_of(x):
    import torch

    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[x.element_size()]


def _derived_pair(sa, sb, fa: FinalValue, fb: FinalValue, key: int, nxt_a: dict, nxt_b: dict, cache: dict):
    """(logprob on a, logprob on b) as 0-d tensors, one of them derived from logits by DERIVATION; or why not."""
    import torch

    sides = []
    target = fa.target if fa.kind == "logprobs" else fb.target
    for tok, fv, nxt in ((sa, fa, nxt_a), (sb, fb, nxt_b)):
        if not tok.trace.has_bytes(fv.vid):
            return f"deriving logprobs from logits needs the values: record both sides in full mode"
        if target is None:
            cid, cell = tok.where[key]
            g = tok.index.grids[cid]
            target = nxt.get((g.seq[cell], g.pos[cell] + 1))
        sides.append((tok, fv))
    if target is None:
        return "the token after this one is in neither trace, so no logprob can be taken from its logits"
    vals = []
    for tok, fv in sides:
        x = cache.get((id(tok), fv.vid))
        if x is None:
            x = cache[(id(tok), fv.vid)] = tok.trace.tensor(fv.vid)
        g = tok.index.grids[fv.cid]
        code = tok.index.index[fv.vid][1]
        row = layout.row_of(x, code, g.shape, fv.cell)
        if fv.kind == "logits":
            flat = row.reshape(-1)
            if not 0 <= target < flat.numel():
                return f"the next token's id {target} is outside the logits row of {flat.numel()}"
            row = torch.log_softmax(flat.float(), dim=-1)[target]
        vals.append(row.reshape(()))
    la, lb = vals
    dtype = (lb if fa.kind == "logits" else la).dtype  # compared in the logprob side's dtype
    return la.to(dtype), lb.to(dtype)


def finals_report(sa, sb, fin: Finals, fin_a: dict, fin_b: dict, describe) -> dict:
    """bisect --json's `final` under token alignment (RL metrics added by the caller in full mode)."""
    kinds = {fin_a[k].kind for k in fin.equal + fin.differ} | {fin_b[k].kind for k in fin.equal + fin.differ}
    tensor = ("per-token logits" if kinds == {"logits"} else "per-token logprobs" if kinds == {"logprobs"}
              else "per-token logits and logprobs")
    first_bad = None
    for k in fin.differ:
        t = describe(k)
        if first_bad is None or (t["seq"]["number"], t["position"]) < (first_bad["seq"]["number"], first_bad["position"]):
            first_bad = t
    out = {"tensor": tensor, "identical": not fin.differ and fin.compared > 0, "tokens_compared": fin.compared,
           "tokens_differing": fin.n_differ, "tokens_equal": fin.n_equal,
           "only_a": len(fin.only_a), "only_b": len(fin.only_b), "not_compared": len(fin.not_compared),
           "not_compared_why": sorted({w for _, w in fin.not_compared})[:3],
           "derived": bool(fin.derived), "derivation": DERIVATION if fin.derived else None,
           "first_differing_token": first_bad}
    if fin.logprob:
        d = [abs(a - b) for a, b in fin.logprob.values()]
        out["max_abs_logprob_diff_declared"] = max(d)
    return out
