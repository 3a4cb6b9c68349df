"""Call pairing: the module calls of two traces paired by (mapped path, call number).

In: two traces and a path map (paths.py). Out: `Pairing`, which the walker and both bisects (divtrace.compare) and
repro ask for a call's partner.
"""
from __future__ import annotations

from divtrace.align.paths import PathMap
from divtrace.trace.reader import Trace
from divtrace.trace.records import ModuleCall

FINAL = "<final>"  # the module path of rec.final's calls (divtrace.record.token_rows writes them)


class Pairing:
    """Module calls of A and B paired by (mapped path, call number)."""

    def __init__(self, a: Trace, b: Trace, path_map: PathMap | None = None):
        self.a, self.b = a, b
        self.map = path_map or PathMap()
        if path_map is not None:
            self.map.check_used({"a": a, "b": b})
        self.map.rewrite("a", a)
        self.map.rewrite("b", b)
        # Calls a structural rule hid or split get keys no call of the other side has: never paired.
        # rec.final's calls (FINAL) are no module of either model: token alignment reads them as final values.
        ha, hb = getattr(a, "hidden_calls", ()), getattr(b, "hidden_calls", ())
        self.keys_a = {cid: (self.map.apply("a", c.module), c.call) if cid not in ha and c.module != FINAL
                       else ("\0hidden a", cid) for cid, c in a.calls.items()}
        self.keys_b = {cid: (self.map.apply("b", c.module), c.call) if cid not in hb and c.module != FINAL
                       else ("\0hidden b", cid) for cid, c in b.calls.items()}
        self.by_key_b = {k: cid for cid, k in self.keys_b.items()}
        self.by_key_a = {k: cid for cid, k in self.keys_a.items()}
        self.common = set(self.by_key_a) & set(self.by_key_b)

    def map_notes(self, call_a: ModuleCall, call_b: ModuleCall | None = None) -> list[str]:
        """How the map's structural rules made these calls comparable (empty when no rule touched them): for
        a report to say that, say, q_proj was compared with the q block of vLLM's fused qkv_proj."""
        out = [getattr(self.a, "map_notes", {}).get(call_a.call_id)]
        if call_b is not None:
            out.append(getattr(self.b, "map_notes", {}).get(call_b.call_id))
        return [n for n in out if n]

    def partner(self, call_a: ModuleCall) -> ModuleCall | None:
        cid = self.by_key_b.get(self.keys_a[call_a.call_id])
        return None if cid is None else self.b.calls[cid]

    def unmatched(self) -> dict:
        hidden = [sum(1 for k in keys if k[0].startswith("\0hidden")) for keys in (self.by_key_a, self.by_key_b)]
        return {"a": len(self.by_key_a) - len(self.common) - hidden[0],
                "b": len(self.by_key_b) - len(self.common) - hidden[1]}


def fold_unpaired(calls: dict, paired: set, hidden=()) -> tuple[dict, int]:
    """`calls` with every call that has no partner folded into its nearest paired ancestor: its own ops become
    that ancestor's own code and its paired descendants that ancestor's children (an engine's `rotary_emb` and
    `attn` submodules, an `nn.LayerNorm` the other side writes inline: the ops of both sides then meet in one
    region). Returns (new call dict, number of calls folded); `calls` is not changed (views share it). Calls
    with no paired ancestor (another root) stay; `hidden` calls (a map rule already moved their ops and children
    to their parent) are left out."""
    if hidden:
        calls = {cid: c for cid, c in calls.items() if cid not in hidden}
    out: dict = {}
    folded = 0

    def target(cid):
        c = calls[cid]
        while c.parent is not None and c.parent in calls and c.parent not in paired:
            c = calls[c.parent]
        return c.parent if c.parent in paired else None

    for cid, c in calls.items():
        if cid in paired or c.parent is None or c.parent not in calls:
            out[cid] = ModuleCall(c.call_id, c.module, c.call, c.parent, c.enter_index, c.inputs, c.exit_index,
                                  c.outputs, [], list(c.ops))
    for cid in sorted(calls, key=lambda i: calls[i].enter_index):
        c = calls[cid]
        if cid in out and (c.parent is None or c.parent not in calls):
            continue  # a top-level call
        if cid in paired:
            p = c.parent if c.parent in paired else target(cid)
            if p is None:
                continue
            out[cid].parent = p
            out[p].children.append(cid)
        else:
            p = target(cid)
            if p is None:
                out[cid] = ModuleCall(c.call_id, c.module, c.call, c.parent, c.enter_index, c.inputs, c.exit_index,
                                      c.outputs, list(c.children), list(c.ops))
                continue
            out[p].ops.extend(c.ops)
            folded += 1
    for c in out.values():
        c.ops.sort()
    return out, folded


class CallsView:
    """A trace seen with another call tree (fold_unpaired's); everything else is the trace's own."""

    def __init__(self, trace, calls: dict):
        self._trace, self.calls = trace, calls

    def __getattr__(self, name):
        return getattr(self._trace, name)


def folded_pairing(a, b, pairing: Pairing) -> tuple:
    """(view a, view b): the two traces (or views) with their unpaired calls folded into their nearest paired
    ancestors; `pairing` then answers with the folded calls. Returns the views and the calls folded per side."""
    paired_a = {cid for cid, c in a.calls.items() if pairing.partner(c) is not None}
    paired_b = {pairing.partner(a.calls[cid]).call_id for cid in paired_a}
    fa, na = fold_unpaired(a.calls, paired_a, getattr(a, "hidden_calls", ()))
    fb, nb = fold_unpaired(b.calls, paired_b, getattr(b, "hidden_calls", ()))
    va, vb = CallsView(a, fa), CallsView(b, fb)
    pairing.a, pairing.b = va, vb
    return va, vb, (na, nb)
