"""Routing as values: where an origin is an MoE router, what differs about each token's routing, in words.

A router (a module call whose own code runs an `aten.topk`) hands its experts three things per token: the expert
ids, their routing weights, and the order of both (the slot). For every token both runs computed, its ids row,
weights row and the router's own top-k choice are compared (row fingerprints, so hash mode works; with stored
values also which experts), and where the two runs chose different experts, the top-k margin the recorder kept
(divtrace.record.topk_margin: last chosen minus first unchosen score, exact) says whether it was a tie: margin 0
on a side is a tie in the dtype its top-k saw. Only what the values prove is said: a margin is named where it was
stored (full mode) or where its row fingerprint is that of an exact zero (hash mode); never guessed.

In: a BisectResult and the two traces. Out: `routing` ({"why", counts, "flips"}) on each origin whose module is a
router (`first.routing`, and the token origins' dicts).
"""
from __future__ import annotations

import math

from divtrace.compare.router_rows import router_parts, token_rows, whole_rows
_MAX_FLIPS = 5


def _pow2(x: float) -> str:
    if x == 0:
        return "0"
    return f"{x:.3g} (2^{math.log2(abs(x)):.1f})"


def _short(dtype: str | None) -> str:
    return (dtype or "?").removeprefix("torch.")


def _margin_words(ma, mb, da: str, db: str) -> str | None:
    """The cause of one flipped choice, from the two margins (None: not proven)."""
    if ma == 0 and mb == 0:
        over = f"{_short(da)} scores on both" if da == db else f"{_short(da)} scores on a, {_short(db)} on b"
        return f"tie broken differently at margin 0 (top-k over {over})"
    for s, m, o, mo, d, do in (("a", ma, "b", mb, da, db), ("b", mb, "a", ma, db, da)):
        if m == 0:
            tail = f", margin {_pow2(mo)} on {o} ({_short(do)} scores)" if mo is not None else ""
            return f"tie at margin 0 on {s} (top-k over {_short(d)} scores){tail}"
    if ma is not None and mb is not None:
        return (f"near-tie: margin {_pow2(ma)} on a ({_short(da)} scores), {_pow2(mb)} on b ({_short(db)} scores)")
    return None


def compare_rows(rows: list) -> dict:
    """`rows`: (token description, _Row of a, _Row of b) for every token both sides routed. The routing summary."""
    n = len(rows)
    choice, order, weights, own, flips = 0, 0, 0, 0, []
    hashed = False
    for desc, ra, rb in rows:
        ids_differ = ra.key("ids") != rb.key("ids")
        own_differ = ra.key("chosen") != rb.key("chosen")
        if ra.parts["weights"] is not None and rb.parts["weights"] is not None and \
                ra.key("weights") != rb.key("weights"):
            weights += 1
        if not ids_differ:
            own += own_differ  # the router's own top-k chose otherwise, its returned ids agree (a replay)
            continue
        ia, ib = ra.values("ids"), rb.values("ids")
        if ia is None or ib is None:
            hashed = True
            choice += 1
            flip = {"token": desc, "slot": None, "a": None, "b": None}
        elif sorted(ia) == sorted(ib):
            order += 1
            continue
        else:
            choice += 1
            slot = next(s for s, (x, y) in enumerate(zip(ia, ib)) if x != y and y not in ia)
            flip = {"token": desc, "slot": slot, "a": ia[slot], "b": ib[slot]}
        ma, mb = ra.margin(), rb.margin()
        flip.update({"margin_a": ma, "margin_b": mb, "dtype_a": ra.parts["dtype"], "dtype_b": rb.parts["dtype"],
                     "cause": _margin_words(ma, mb, ra.parts["dtype"], rb.parts["dtype"])})
        if len(flips) < _MAX_FLIPS:
            flips.append(flip)
    if rows and all(desc.get("row", 0) is None for desc, _, _ in rows):  # whole values: no rows to compare
        why = (f"router: expert ids {'differ' if choice else 'equal'}, routing weights "
               f"{'differ' if weights else 'equal'} (whole values: hash mode without token identity has no rows "
               "per token; record with --mode full, or with token identity, to compare each token)")
        return {"tokens": None, "choice_differs": None, "order_differs": None, "weights_differ": None,
                "own_choice_differs": None, "flips": [], "why": why}
    return {"tokens": n, "choice_differs": choice, "order_differs": order, "weights_differ": weights,
            "own_choice_differs": own, "flips": flips, "why": _why(n, choice, order, weights, own, flips, hashed)}


def _why(n, choice, order, weights, own, flips, hashed) -> str:
    parts = []
    if choice:
        f = flips[0]
        tok = _token_words(f["token"])
        what = (f"; {tok}: a chose {f['a']}, b chose {f['b']} at slot {f['slot']}" if f["a"] is not None
                else f"; {tok} (hash mode: which experts is not stored)")
        parts.append(f"router top-k: expert choice differs for {choice} of {n} tokens{what}")
        if f["cause"]:
            parts.append(f["cause"])
    else:
        parts.append(f"router: expert ids equal on {n - order} of {n} tokens")
    if order:
        parts.append(f"slot order differs for {order} tokens (same experts)")
    if own:
        parts.append(f"the top-k's own indices differ for {own} token{'s' if own != 1 else ''} whose returned ids "
                     "agree (ids replayed or remapped after the top-k)")
    if weights:
        parts.append(f"routing weights differ for {weights} of {n} tokens")
    elif not choice and not order:
        parts.append("routing weights equal")
    if not choice and not order and weights:
        parts[0] = f"expert ids equal on all {n} tokens, routing weights differ for {weights}"
        parts.pop()
    return "; ".join(parts)


def _token_words(desc: dict) -> str:
    if "position" in desc:
        s = desc.get("seq") or {}
        return f"token at position {desc['position']} of sequence {s.get('number', '?')}"
    if desc.get("row") is None:
        return "the router's values (no token rows)"
    return f"call {desc.get('call')} row {desc['row']}"


def annotate(result, ta, tb) -> None:
    """Add `routing` to each origin of `result` that a router made (in place)."""
    divs = [result.first] if result.first is not None else []
    dicts = getattr(result, "origins", None) or []
    pairs = list(zip(dicts, getattr(result, "origin_divs", []) or []))
    divs += [x for _, x in pairs if x is not None and x is not result.first]
    ba = getattr(ta, "trace", ta)
    calls_a = list(ba.calls.values()) if isinstance(ba.calls, dict) else list(ba.calls)
    routers = [d for d in divs if getattr(d, "routing", None) is None
               and any(c.module == d.module and router_parts(ba, c) is not None for c in calls_a)]
    if not routers:  # (nothing more is read: a hash bisect imports neither torch nor numpy)
        return
    sides = getattr(result, "token_sides", None)
    if sides is None:
        from divtrace.align.tokens import TraceTokens

        sides = (TraceTokens(ba), TraceTokens(getattr(tb, "trace", tb)))
    tokens = sides[0].has_tokens and sides[1].has_tokens
    bb = getattr(tb, "trace", tb)
    for d in routers:
        rows = token_rows(d, ba, bb, *sides) if tokens else whole_rows(d, ba, bb)
        d.routing = compare_rows(rows) if rows else None
    for dct, d in pairs:
        if d is not None and d.routing is not None:
            dct["routing"] = d.routing
