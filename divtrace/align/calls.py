"""Call pairing: the module calls of two traces paired by (mapped path, call number).

In: two traces and a path map (paths.py). Out: `Pairing`, which the walker and both bisects (divtrace.compare) and
repro ask for a call's partner.
"""
from __future__ import annotations

from divtrace.align.paths import PathMap
from divtrace.trace.reader import Trace
from divtrace.trace.records import ModuleCall


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
        ha, hb = getattr(a, "hidden_calls", ()), getattr(b, "hidden_calls", ())
        self.keys_a = {cid: (self.map.apply("a", c.module), c.call) if cid not in ha else ("\0hidden a", cid)
                       for cid, c in a.calls.items()}
        self.keys_b = {cid: (self.map.apply("b", c.module), c.call) if cid not in hb else ("\0hidden b", cid)
                       for cid, c in b.calls.items()}
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
