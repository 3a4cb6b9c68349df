"""Aligning two traces: module-path renames (--map), call pairing, and value comparison with caching."""
from __future__ import annotations

import re
from pathlib import Path

from divtrace.compare.metrics import TensorDiff, Tolerance, compare_tensors
from divtrace.errors import DivtraceError
from divtrace.records import ModuleCall
from divtrace.trace.reader import Trace


class PathMap:
    """Regex renames of module paths, per side. YAML: `{a: {regex: repl}, b: {regex: repl}}`, or a plain
    `{regex: repl}` mapping, which applies to side b (the one usually named differently: the engine)."""

    def __init__(self, a=None, b=None):
        self.rules = {"a": self._compile(a or {}, "a"), "b": self._compile(b or {}, "b")}

    @staticmethod
    def _compile(rules: dict, side: str):
        out = []
        for pat, repl in rules.items():
            try:
                out.append((re.compile(str(pat)), "" if repl is None else str(repl)))
            except re.error as e:
                raise DivtraceError(f"--map: bad regex {pat!r} for side {side}: {e}") from None
        return out

    @classmethod
    def from_file(cls, path) -> "PathMap":
        import yaml

        p = Path(path)
        try:
            data = yaml.safe_load(p.read_text())
        except OSError as e:
            raise DivtraceError(f"{p}: cannot read map file: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise DivtraceError(f"{p}: not valid YAML: {str(e).splitlines()[0]}") from None
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise DivtraceError(f"{p}: map file must be a mapping of regex -> replacement")
        if set(data) <= {"a", "b"} and all(isinstance(v, dict) or v is None for v in data.values()):
            return cls(data.get("a"), data.get("b"))
        return cls(None, data)

    def apply(self, side: str, path: str) -> str:
        rules = self.rules[side]
        if not rules:
            return path
        for pat, repl in rules:
            path = pat.sub(repl, path)
        return path


class Pairing:
    """Module calls of A and B paired by (mapped path, call number)."""

    def __init__(self, a: Trace, b: Trace, path_map: PathMap | None = None):
        self.a, self.b = a, b
        self.map = path_map or PathMap()
        self.keys_a = {cid: (self.map.apply("a", c.module), c.call) for cid, c in a.calls.items()}
        self.keys_b = {cid: (self.map.apply("b", c.module), c.call) for cid, c in b.calls.items()}
        self.by_key_b = {k: cid for cid, k in self.keys_b.items()}
        self.by_key_a = {k: cid for cid, k in self.keys_a.items()}
        self.common = set(self.by_key_a) & set(self.by_key_b)

    def partner(self, call_a: ModuleCall) -> ModuleCall | None:
        cid = self.by_key_b.get(self.keys_a[call_a.call_id])
        return None if cid is None else self.b.calls[cid]

    def unmatched(self) -> dict:
        return {"a": len(self.by_key_a) - len(self.common), "b": len(self.by_key_b) - len(self.common)}


class ValueComparator:
    """Decides whether a value of A equals a value of B. Bitwise (fingerprints: dtype, shape, 128-bit hash of
    the raw bytes) unless a tolerance is asked for; tolerances need the bytes, so they load lazily."""

    def __init__(self, a: Trace, b: Trace, tol: Tolerance | None = None):
        self.a, self.b = a, b
        self.tol = tol if tol is not None and tol.active() else None
        self.compared = 0
        self.bitwise_differs = 0
        self._diffs: dict[tuple[int, int], TensorDiff | None] = {}
        self._same: dict[tuple[int, int], bool] = {}

    @property
    def values_available(self) -> bool:
        return self.a.mode == "full" and self.b.mode == "full"

    def same(self, va: int, vb: int) -> bool:
        key = (va, vb)
        hit = self._same.get(key)
        if hit is not None:
            return hit
        self.compared += 1
        x, y = self.a.values[va], self.b.values[vb]
        bitwise = x.hash == y.hash and x.dtype == y.dtype and x.shape == y.shape
        result = bitwise
        if not bitwise:
            self.bitwise_differs += 1
            if self.tol is not None:
                d = self.diff(va, vb)
                result = bool(d is not None and d.matches())
        self._same[key] = result
        return result

    def diff(self, va: int, vb: int) -> TensorDiff | None:
        """Value metrics, or None when either side holds only fingerprints."""
        key = (va, vb)
        if key not in self._diffs:
            if self.a.has_bytes(va) and self.b.has_bytes(vb):
                self._diffs[key] = compare_tensors(self.a.tensor(va), self.b.tensor(vb), self.tol)
            else:
                self._diffs[key] = None
        return self._diffs[key]

    def pairs(self, items_a: list[tuple[str, int]], items_b: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
        """Tensors of two input/output lists paired by key; by position when the keys share nothing (one
        side passes `hidden_states=` by keyword, the other positionally). A key with a tensor on one side only
        (a mask one implementation builds and the other does not) is not compared."""
        db = dict(items_b)
        common = [(k, va, db[k]) for k, va in items_a if k in db]
        if common or not items_a or not items_b:
            return common
        return [(ka, va, vb) for (ka, va), (_, vb) in zip(items_a, items_b)]

    def first_mismatch(self, items_a, items_b):
        for k, va, vb in self.pairs(items_a, items_b):
            if not self.same(va, vb):
                return k, va, vb
        return None
