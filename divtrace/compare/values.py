"""Value comparison: whether a value of trace A equals a value of trace B, bitwise by fingerprint unless a
tolerance is asked for, with caching; over two token views, by token row (`TokenComparator`).

In: two traces (divtrace.trace) or two TokenViews (divtrace.align.tokens) and an optional Tolerance. Out:
equal or not, the first unequal pair of a list, and the metrics of a differing pair (metrics.py, where bytes are
stored), for the walker and both bisects.
"""
from __future__ import annotations

import weakref

from divtrace.align.tokens import Incomparable
from divtrace.compare.diffs import TensorDiff, Tolerance
from divtrace.trace.reader import Trace

_NONE = object()

# Ops that allocate without initializing: their outputs' bytes are whatever the allocator handed out, so they
# carry no value to compare (vLLM allocates every linear's and the attention's output this way, then a custom op
# writes into it). Views of such a buffer taken before anything wrote into it are as undefined.
_UNINITIALIZED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_ALIASING = {"view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "t", "permute", "expand",
             "unsqueeze", "squeeze", "select", "slice", "as_strided", "alias", "detach", "split", "split_with_sizes",
             "chunk", "unbind", "narrow", "flatten", "view_as", "expand_as", "movedim", "diagonal"}


def uninitialized_values(t: Trace) -> set[int]:
    """Value ids of `t` whose bytes are undefined: outputs of allocations that do not initialize, and views of
    them made before a write (a write makes a new value id, so later views are not in the set)."""
    base = getattr(t, "trace", t)  # a token view (divtrace.align.tokens) reads its trace's records
    got = _UNDEFINED_CACHE.get(id(base))
    if got is not None and got[0]() is base:
        return got[1]
    out: set[int] = set()
    rop, rin, rout = getattr(base, "rop", None), getattr(base, "rin", None), getattr(base, "rout", None)
    if rop is None or rin is None or rout is None:
        return out
    kinds: dict = {}  # op name -> 1 allocates, 2 aliases, 0 neither (a trace has few distinct op names)
    for op, ins, outs in zip(rop, rin, rout):
        if op is None or ins is None:
            continue
        kind = kinds.get(op)
        if kind is None:
            parts = op.split(".")
            name = parts[1] if len(parts) > 1 else op
            kind = kinds[op] = 1 if name in _UNINITIALIZED else 2 if name in _ALIASING else 0
        if kind == 1 or (kind == 2 and out and ins and all(v in out for v in ins)):
            out.update(outs)
    try:
        _UNDEFINED_CACHE[id(base)] = (weakref.ref(base), out)
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return out


# id(trace) -> (weak reference to it, its uninitialized values): a token-aligned bisect builds a comparator per
# token and per root call pair, and each asked again over the whole trace (610 scans of 200k records: 56 s)
_UNDEFINED_CACHE: dict = {}


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
        self._undef_a, self._undef_b = uninitialized_values(a), uninitialized_values(b)
        self._undef = bool(self._undef_a and self._undef_b)
        # A run directory's values that have no global value (divtrace.align.shards.keys): left out where the
        # other side holds a global one.
        self._runs = any(getattr(getattr(t, "trace", t), "groups", None) is not None for t in (a, b))

    def _view_equal(self, va: int, vb: int) -> bool:
        """Fingerprints differ: whether the bytes are equal all the same (a derived view's, rebuilt in full mode;
        a derived view in a hash-mode trace cannot be settled and stays unequal)."""
        if not self._views:
            return False
        ka, kb = self._ka[va], self._kb[vb]
        da, db = va in self.a.vderived, vb in self.b.vderived
        return ((da or db) and (self._full_a or not da) and (self._full_b or not db)
                and ka[0] == kb[0] and ka[1] == kb[1] and self.a.real_key(va) == self.b.real_key(vb))

    def _both_undefined(self, va: int, vb: int) -> bool:
        """Two uninitialized buffers of one dtype and shape: nothing to compare (their garbage may differ)."""
        return (self._undef and va in self._undef_a and vb in self._undef_b
                and self._ka[va][:2] == self._kb[vb][:2])

    @property
    def values_available(self) -> bool:
        return self.a.mode == "full" and self.b.mode == "full"

    def uncompared(self, va: int, vb: int) -> bool:
        """Whether the pair is left out of every comparison: a run directory's side holds no global value for it
        (its ranks' own pieces, divtrace.align.shards.keys.RankLocal) and the other side does."""
        return self._uncompared(va, vb)

    def _uncompared(self, va: int, vb: int) -> bool:
        if not self._runs:
            return False
        from divtrace.align.shards.keys import uncompared

        return uncompared(self._ka[va], self._kb[vb])

    def same(self, va: int, vb: int) -> bool:
        if self.tol is None:
            equal = self._ka[va] == self._kb[vb] or self._view_equal(va, vb) or self._both_undefined(va, vb)
            if not equal and self._uncompared(va, vb):
                return True  # (neither counted nor different: one side has no global value here)
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
        if self._uncompared(va, vb):
            self._same[key] = True
            return True
        self.compared += 1
        bitwise = self._ka[va] == self._kb[vb] or self._view_equal(va, vb) or self._both_undefined(va, vb)
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
                equal = ka[va] == kb[vb] or (views and self._view_equal(va, vb)) or self._both_undefined(va, vb)
                if not equal and self._runs and self._uncompared(va, vb):
                    continue
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
            pieces = False
            if self._runs:  # held as the ranks' pieces on both sides: the differing rank's, not the representative's
                from divtrace.compare.shard_pieces import pair_diff

                pieces, got = pair_diff(self.a, self.b, va, vb, self.tol)
            if pieces:
                self._diffs[key] = got
            elif self.a.has_bytes(va) and self.b.has_bytes(vb):
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
        if common or not items_a or not items_b or len(items_a) != len(items_b):
            # (as many on each side, or nothing: an engine's (input_ids, positions) against HF's input_ids,
            # attention_mask and position_ids would pair positions with a mask the engine never passed)
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


class TokenComparator(ValueComparator):
    """ValueComparator over two TokenViews: values whose keys cannot be paired (another row length: a decode
    step's cache against a full sequence; a cross-token value) are not compared at all, neither equal nor
    different; another dtype with the same row length is a difference (an fp32 residual against bf16)."""

    @staticmethod
    def comparable(ka, kb) -> bool:
        return not isinstance(ka, Incomparable) and not isinstance(kb, Incomparable) and tuple(ka[1]) == tuple(kb[1])

    def same(self, va: int, vb: int) -> bool:
        if not self.comparable(self._ka[va], self._kb[vb]):
            return True
        return super().same(va, vb)

    def first_unequal(self, pairs):
        ka, kb = self._ka, self._kb
        return super().first_unequal([(va, vb) for va, vb in pairs if self.comparable(ka[va], kb[vb])])
