"""A token repro cut down to the engine side's parting op, when the rest of that side's region cannot run outside
the engine.

An engine's region often holds kernels that replay only inside the process that recorded them: vLLM's attention
reads its KV cache and metadata through the engine's forward context, its matmuls take the address of a oneDNN
weight handle (the trace's meta.json lists them as `engine.unreplayable_ops`). When the divergence *starts* at a
kernel that does replay (vLLM's `_C.rotary_embedding` against HF's rotate-half arithmetic), the repro is cut at
that kernel's output: the engine side replays the parting op alone, and the other side replays its own ops up to
the value that stands for the same quantity for the token. Which value that is cannot be read from the names (the
two sides share no code there), so it is the one nearest in value to the engine's output row among the values the
other side's region computes with the same dtype and row length, and it is accepted only when it is near (within
a tenth of the row's largest magnitude): a rounding difference, not another tensor. The cut is said in the repro's
warnings, with the distance.

Both regions keep walking back until values the other side's *original* region also holds (the whole diverging
call's cone), so a parting op that takes tensors the counterpart value does not need (RoPE rotates the key
too) still starts from shared inputs rather than pulling in the engine's matmul.
"""
from __future__ import annotations

from dataclasses import replace

from divtrace.repro.region import Side, Target, build_side, cone_keys, parting_record, token_row_index

NEAR = 0.1  # the counterpart's largest |difference| must be within this fraction of the row's largest magnitude


def engine_only_ops(*traces) -> dict[str, str]:
    """op -> why it replays only inside the engine that recorded it (meta.json engine.unreplayable_ops)."""
    ops: dict[str, str] = {}
    for t in traces:
        engine = t.meta.get("engine")
        known = engine.get("unreplayable_ops") if isinstance(engine, dict) else None
        if isinstance(known, dict):
            ops.update((k, str(v)) for k, v in known.items() if isinstance(k, str))
    return ops


def narrow_to_parting_op(target: Target, sides: dict[str, Side]) -> tuple[Target, dict[str, Side]] | None:
    """(target, sides) of the cut repro, or None when no cut applies (the target then gets a warning if a cut was
    needed and could not be made)."""
    import torch

    if target.views is None:
        return None
    unrep = engine_only_ops(sides["a"].trace, sides["b"].trace)
    blocked = {s: sorted({sides[s].trace.records[i].op for i in sides[s].ops} & set(unrep)) for s in ("a", "b")}
    engine = [s for s in ("a", "b") if blocked[s]]
    if not engine:
        return None

    def give_up(why: str) -> None:
        target.warnings.append(f"side {engine[0]}'s region holds ops that replay only inside the engine that "
                               f"recorded them ({', '.join(blocked[engine[0]])}), and it cannot be cut before "
                               f"them: {why}")
        return None

    if len(engine) == 2:
        return give_up("both sides hold such ops")
    s = engine[0]
    o = "b" if s == "a" else "a"
    side, other = sides[s], sides[o]
    ts, to = side.trace, other.trace
    view_s, view_o = target.views[s], target.views[o]
    key_s, key_o = view_s.vkey.__getitem__, view_o.vkey.__getitem__
    orig = {"a": target.va, "b": target.vb}
    part = parting_record(side)
    if part is None:
        return give_up("no op computes there")
    prec = ts.records[part]
    if prec.op in unrep:
        return give_up(f"the divergence starts at {prec.op} itself ({unrep[prec.op]})")
    # what each side's whole diverging region holds: a differing output is none of the other side's, and each cut
    # walk stops there (see the module docstring)
    cones = {o: cone_keys(to, orig[o], key_o)}
    new_s = next((v for v in prec.outputs if token_row_index(view_s, v) is not None and key_s(v) not in cones[o]),
                 None)
    if new_s is None:
        return give_up(f"no output of its parting op {prec.op} (record {part}) has a differing row for the token")
    if not ts.has_bytes(new_s):
        return give_up(f"the output of {prec.op} (record {part}) has no recorded bytes (mode={ts.mode})")
    row_s = view_s.tensor(new_s)
    best = None
    for i in other.ops:
        for v in to.records[i].outputs:
            if to.values[v].dtype != ts.values[new_s].dtype or token_row_index(view_o, v) is None or \
                    not to.has_bytes(v):
                continue
            row_o = view_o.tensor(v)
            if row_o.numel() != row_s.numel():
                continue
            d = (row_o.reshape(-1).double() - row_s.reshape(-1).double()).abs().max().item()
            if d == d and (best is None or d < best[0]):  # (NaN never wins)
                best = (d, v, i)
    scale = row_s.double().abs().max().item() if row_s.numel() else 0.0
    if best is None or not best[0] <= NEAR * scale or best[0] == 0.0:
        return give_up(f"side {o}'s region holds no value near the output of {prec.op} (record {part}) for the "
                       "token")
    dist, new_o, rec_o = best
    new = replace(target, warnings=list(target.warnings), row_index=dict(target.row_index))
    if s == "a":
        new.va, new.vb, new.record, new.record_b = new_s, new_o, part, rec_o
    else:
        new.va, new.vb, new.record, new.record_b = new_o, new_s, rec_o, part
    cones[s] = cone_keys(ts, orig[s], key_s)
    vals = {"a": new.va, "b": new.vb}
    calls = {"a": target.call_a, "b": target.call_b}
    cut = {}
    for x, y in (("a", "b"), ("b", "a")):
        key_x = target.views[x].vkey.__getitem__
        cut[x] = build_side(sides[x].trace, sides[y].trace, vals[x], calls[x], vals[y], key_x, other_keys=cones[y])
        cut[x].row_index = token_row_index(target.views[x], vals[x])
        new.row_index[x] = cut[x].row_index
    still = sorted({ts.records[i].op for i in cut[s].ops} & set(unrep))
    if still:
        return give_up(f"cut at {prec.op} (record {part}), the region still needs {', '.join(still)}")
    new.tensor = f"output of {prec.op} (record {part}, side {s})"
    new.keep_untied = True
    new.warnings.append(
        f"side {s}'s region holds ops that replay only inside the engine that recorded them "
        f"({', '.join(blocked[s])}): the repro is cut at the output of its parting op {prec.op} (record {part}), "
        f"where the divergence starts; side {o}'s counterpart is the value of its region nearest to it for the "
        f"token: output of {to.records[rec_o].op} (record {rec_o}), max |difference| {dist:.3g} "
        f"(the row's largest magnitude {scale:.3g})")
    return new, cut
