"""Aligning two traces: module-path renames (--map), call pairing, and value comparison with caching."""
from __future__ import annotations

import re
from pathlib import Path

from divtrace.compare.diffs import TensorDiff, Tolerance
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
            if not (repl is None or isinstance(repl, (str, int, float))):
                raise DivtraceError(f"--map: the replacement for {pat!r} (side {side}) is not a string: {repl!r} "
                                    "(a map per side has only the keys a: and b:)")
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
        except UnicodeDecodeError:
            raise DivtraceError(f"{p}: not a text (UTF-8) file; a map file is YAML of regex -> replacement") from None
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
            try:
                path = pat.sub(repl, path)
            except re.error as e:  # a bad group reference in the replacement shows only when the regex matches
                raise DivtraceError(f"--map: bad replacement {repl!r} for {pat.pattern!r} (side {side}): {e}") from None
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


_NONE = object()


class ValueComparator:
    """Decides whether a value of A equals a value of B. Bitwise (fingerprints: dtype, shape, 128-bit hash of
    the raw bytes, from each trace's compact index `vkey`) unless a tolerance is asked for; tolerances need the
    bytes, so they load lazily (and import torch).

    `compared` counts the distinct (va, vb) pairs judged, `bitwise_differs` those that differ bitwise. Bitwise
    judgements are not memoized (comparing two keys is as cheap as looking one up); the pairs seen are kept
    as va -> vb, so counting allocates nothing per pair."""

    def __init__(self, a: Trace, b: Trace, tol: Tolerance | None = None):
        self.a, self.b = a, b
        self.tol = tol if tol is not None and tol.active() else None
        self.compared = 0
        self.bitwise_differs = 0
        self._diffs: dict[tuple[int, int], TensorDiff | None] = {}
        self._same: dict[tuple[int, int], bool] = {}  # with a tolerance: every judgement
        self._seen: dict[int, int] = {}  # bitwise: va -> the first vb it was compared with
        self._seen_more: set[tuple[int, int]] = set()  # bitwise: pairs whose va was seen with another vb
        self._ka, self._kb = a.vkey, b.vkey
        # A view's derived fingerprint that differs from the other side's is settled from the bytes where the
        # trace holding it is full mode (the other side may have made the same bytes another way).
        self._full_a, self._full_b = a.mode == "full", b.mode == "full"
        self._views = bool((self._full_a and a.vderived) or (self._full_b and b.vderived))

    def _view_equal(self, va: int, vb: int) -> bool:
        """Fingerprints differ: whether the bytes are equal all the same (a derived view's, rebuilt in full mode;
        a derived view in a hash-mode trace cannot be settled and stays unequal)."""
        if not self._views:
            return False
        ka, kb = self._ka[va], self._kb[vb]
        da, db = va in self.a.vderived, vb in self.b.vderived
        return ((da or db) and (self._full_a or not da) and (self._full_b or not db)
                and ka[0] == kb[0] and ka[1] == kb[1] and self.a.real_key(va) == self.b.real_key(vb))

    @property
    def values_available(self) -> bool:
        return self.a.mode == "full" and self.b.mode == "full"

    def same(self, va: int, vb: int) -> bool:
        if self.tol is None:
            equal = self._ka[va] == self._kb[vb] or self._view_equal(va, vb)  # (dtype, shape, hash) of each
            if self._new_pair(va, vb):
                self.compared += 1
                self.bitwise_differs += not equal
            return equal
        key = (va, vb)
        hit = self._same.get(key)
        return hit if hit is not None else self._judge(key)

    def _new_pair(self, va: int, vb: int) -> bool:
        """Bitwise mode: note the pair (va, vb) as compared; whether it was not before."""
        prev = self._seen.get(va, _NONE)
        if prev is _NONE:
            self._seen[va] = vb
            return True
        if prev == vb or (va, vb) in self._seen_more:
            return False
        self._seen_more.add((va, vb))
        return True

    def _judge(self, key: tuple[int, int]) -> bool:
        """With a tolerance: compare a pair not seen before (each distinct pair counts once in `compared`)."""
        va, vb = key
        self.compared += 1
        bitwise = self._ka[va] == self._kb[vb] or self._view_equal(va, vb)
        result = bitwise
        if not bitwise:
            self.bitwise_differs += 1
            d = self.diff(va, vb)
            result = bool(d is not None and d.matches())
        self._same[key] = result
        return result

    def first_unequal(self, pairs) -> tuple[int, int] | None:
        """The first (va, vb) of `pairs` (an iterable of 2-tuples) that `same` says differ, or None."""
        if self.tol is not None:
            return next(((va, vb) for va, vb in pairs if not self.same(va, vb)), None)
        ka, kb, seen, views = self._ka, self._kb, self._seen, self._views
        new = 0
        try:
            for va, vb in pairs:  # same(), inlined: this loop sees every op output of the run
                equal = ka[va] == kb[vb] or (views and self._view_equal(va, vb))
                prev = seen.get(va, _NONE)
                if prev is _NONE:
                    seen[va] = vb
                    new += 1
                elif prev != vb and self._new_pair(va, vb):
                    new += 1
                else:
                    if not equal:
                        return va, vb
                    continue
                if not equal:
                    self.bitwise_differs += 1
                    return va, vb
            return None
        finally:
            self.compared += new

    def diff(self, va: int, vb: int) -> TensorDiff | None:
        """Value metrics, or None when either side holds only fingerprints."""
        key = (va, vb)
        if key not in self._diffs:
            if self.a.has_bytes(va) and self.b.has_bytes(vb):
                from divtrace.compare.metrics import compare_tensors

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
        """(key, va, vb) of the first paired tensors that differ, or None."""
        if len(items_a) == 1 and len(items_b) == 1:  # the usual single tensor: pairs() gives a's key and both
            (k, va), (_, vb) = items_a[0], items_b[0]
            return None if self.same(va, vb) else (k, va, vb)
        for k, va, vb in self.pairs(items_a, items_b):
            if not self.same(va, vb):
                return k, va, vb
        return None
