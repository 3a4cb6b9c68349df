"""Compare time: pairing tokens of two traces, and a trace seen through one token's rows.

`TraceTokens` reads a trace's token files (divtrace.trace.token_store) and says where each token (its content key)
sits: root call and cell. `TokenView` is a trace narrowed to one root call and one cell of its token grid: module
calls of that root call only, numbered from 0 within it, and every value keyed by that cell's row (dtype, row
shape, row fingerprint) where the value has token rows, by its whole fingerprint where it has none. bisect's
walker runs unchanged on two such views: "inputs equal, output differs" then means "for this token".
"""
from __future__ import annotations

from collections.abc import Mapping

from divtrace.errors import DivtraceError
from divtrace.trace.records import ModuleCall
from divtrace.trace import token_layout as layout
from divtrace.trace.token_store import TokenIndex

class Incomparable(tuple):
    """The key of a value whose rows cannot be compared for one token (attention scores or a 4-D mask, which lay
    the other tokens out per call; an ambiguous shape; a cell the value holds no row for). Comparisons skip it,
    and every such key counts as one the other side holds too, so localizing by value walks past it (a mask
    built another way on each side is not where the data parts) instead of naming the op that made it."""

    __slots__ = ()

    def __eq__(self, other):
        return isinstance(other, Incomparable)

    def __ne__(self, other):
        return not isinstance(other, Incomparable)

    def __hash__(self):
        return 0x1C0


INCOMPARABLE = Incomparable(("incomparable", (), ""))


class TraceTokens:
    """One trace's tokens: `where[key]` -> (root call id, cell) of the token's first occurrence."""

    def __init__(self, trace) -> None:
        self.trace = trace
        self.index = trace.token_index() if hasattr(trace, "token_index") else TokenIndex(trace)  # (read, checked)
        self.where: dict[int, tuple[int, int]] = {}
        # token key -> (call id, cell) of its row among rec.final's declared values (the last one declared)
        self.declared_final: dict[int, tuple[int, int]] = {}
        for cid in sorted(self.index.grids):
            g = self.index.grids[cid]
            if g.final is not None:
                for cell, k in enumerate(g.keys):
                    if k:
                        self.declared_final[k] = (cid, cell)
                continue
            for cell, k in enumerate(g.keys):
                if k and k not in self.where:
                    self.where[k] = (cid, cell)
        self._roots: dict[int, dict[int, ModuleCall]] = {}
        self._order: dict[int, dict[tuple, int]] = {}

    @property
    def has_tokens(self) -> bool:
        return bool(self.where)

    def describe(self) -> str:
        """What the trace holds, in words (for "no shared token")."""
        grids = self.index.grids
        seqs = {s for g in grids.values() for s in g.seq if s >= 0}
        first = [self.index.first_ids.get(s, [])[:6] for s in sorted(seqs)[:2]]
        return (f"{len(self.where)} tokens in {len(seqs)} sequences over {len(grids)} root calls"
                + (f" (first ids {', '.join(map(str, first))})" if first else ""))

    def root_calls(self, root_cid: int) -> dict[int, ModuleCall]:
        """The module calls of one root call, call numbers counted from 0 within it (cached)."""
        got = self._roots.get(root_cid)
        if got is None:
            t = self.trace
            root = t.calls[root_cid]
            todo, found = [root], []
            while todo:
                c = todo.pop()
                found.append(c)
                todo.extend(t.calls[x] for x in reversed(c.children))
            found.sort(key=lambda c: c.enter_index)
            base: dict[str, int] = {}
            for c in found:
                base.setdefault(c.module, c.call)
            got = {c.call_id: ModuleCall(c.call_id, c.module, c.call - base[c.module], c.parent if c is not root else None,
                                         c.enter_index, c.inputs, c.exit_index, c.outputs, c.children, c.ops)
                   for c in found}
            self._roots[root_cid] = got
            self._order[root_cid] = {(c.module, got[c.call_id].call): i for i, c in enumerate(found)}
        return got

    def order(self, root_cid: int) -> dict[tuple, int]:
        """(module path, call within the root call) -> its rank in the root call's execution order."""
        self.root_calls(root_cid)
        return self._order[root_cid]

    def row_key(self, vid: int, root_cid: int, cell: int):
        """The key of `vid` for one token: its row's (dtype, (elements,), fingerprint); a key nothing equals where
        the value's rows cannot be compared; None where the value has no rows in this root call."""
        e = self.index.index.get(vid)
        if e is None or e[0] != root_cid:
            return None
        code, off = e[1], e[2]
        if off < 0:
            return INCOMPARABLE
        g = self.index.grids[root_cid]
        r = layout.cell_row(code, g.shape, cell)
        if r is None:
            return INCOMPARABLE
        dtype, shape, _ = self.trace.vkey[vid]
        return (dtype, layout.row_len(shape, code), int(self.index.bin[off + r]))

    def final_row_key(self, vid: int, key: int):
        """The key of `vid`'s row for token `key` among rec.final's declared values (an engine's logits rows,
        computed on the last row of each sequence, have token rows only there), or None."""
        got = self.declared_final.get(key)
        if got is None:
            return None
        e = self.index.index.get(vid)
        if e is None or e[0] != got[0]:
            return None
        return self.row_key(vid, got[0], got[1])

    @property
    def branching(self) -> set:
        """Keys of tokens followed by more than one token id in this trace (a GRPO group's prompt, sampled several
        times): a row keyed by the token that predicts (a per-token logprob, "prevK") holds one value per
        continuation there, so `where[key]`'s row is one continuation's of several."""
        got = getattr(self, "_branching", None)
        if got is None:
            at: dict = {}
            for g in self.index.grids.values():
                if g.final is None:
                    for k, sq, p in zip(g.keys, g.seq, g.pos):
                        if k and sq >= 0:
                            at[(sq, p)] = k
            after: dict = {}
            for (sq, p), k in at.items():
                prev = at.get((sq, p - 1))
                if prev is not None:
                    after.setdefault(prev, set()).add(k)
            got = self._branching = {k for k, nxt in after.items() if len(nxt) > 1}
        return got

    def rows_at(self, vid: int, root_cid: int, cells: np.ndarray, skip=None):
        """(dtype, row shape, fingerprints at `cells`, valid mask) of a value with rows, or None. `skip`: a mask of
        cells whose rows keyed by the predicting token ("prevK") are not compared (their token branches)."""
        import numpy as np

        e = self.index.index.get(vid)
        if e is None or e[0] != root_cid or e[2] < 0:
            return None
        code, off = e[1], e[2]
        g = self.index.grids[root_cid]
        if code == "1t":
            idx, valid = cells % g.shape[1], np.ones(len(cells), dtype=bool)
        elif code.startswith("last") or code.startswith("prev"):
            rows = [layout.cell_row(code, g.shape, int(c)) for c in cells]
            valid = np.array([r is not None for r in rows], dtype=bool)
            idx = np.array([r if r is not None else 0 for r in rows], dtype=np.int64)
            if skip is not None and code.startswith("prev"):
                valid &= ~skip
        else:
            idx, valid = cells, np.ones(len(cells), dtype=bool)
        dtype, shape, _ = self.trace.vkey[vid]
        return dtype, layout.row_len(shape, code), self.index.bin[off + idx], valid


class _RowKeys(Mapping):
    """vid -> key for one token of one root call (see TraceTokens.row_key); whole fingerprints elsewhere."""

    def __init__(self, tokens: TraceTokens, root_cid: int, cell: int):
        self._t, self._root, self._cell, self._whole = tokens, root_cid, cell, tokens.trace.vkey
        self._key = tokens.index.grids[root_cid].keys[cell]
        self._finals = bool(tokens.declared_final)
        self._memo: dict = {}

    def __getitem__(self, vid):
        k = self._memo.get(vid)
        if k is None:
            k = self._t.row_key(vid, self._root, self._cell)
            if k is None and self._finals:
                k = self._t.final_row_key(vid, self._key)
            if k is None:
                k = self._whole[vid]
            self._memo[vid] = k
        return k

    def __contains__(self, vid) -> bool:
        return vid in self._whole

    def __iter__(self):
        return iter(self._whole)

    def __len__(self) -> int:
        return len(self._whole)


class TokenView:
    """A trace seen through one token: the attributes bisect's walker reads, narrowed to one root call and keyed by
    one cell's rows."""

    def __init__(self, tokens: TraceTokens, root_cid: int, cell: int):
        t = tokens.trace
        self.trace, self.tokens, self.root_cid, self.cell = t, tokens, root_cid, cell
        self.calls = tokens.root_calls(root_cid)
        self.vkey = _RowKeys(tokens, root_cid, cell)
        self.rop, self.rin, self.rout, self.rcall, self.vprod = t.rop, t.rin, t.rout, t.rcall, t.vprod
        self.meta, self.mode, self.path, self.label = t.meta, t.mode, t.path, t.label
        # row fingerprints are of real bytes; whole keys of derived views compare as is (so the comparator never
        # settles a derived view from bytes, and needs no real_key)
        self.vderived = frozenset()
        self.complete = t.complete

    @property
    def root(self) -> ModuleCall:
        return self.calls[self.root_cid]

    def has_bytes(self, vid: int) -> bool:
        return self.trace.has_bytes(vid)

    def tensor(self, vid: int):
        x = self.trace.tensor(vid)
        e = self.tokens.index.index.get(vid)
        if e is not None and e[0] == self.root_cid and e[2] >= 0:
            g = self.tokens.index.grids[self.root_cid]
            row = layout.row_of(x, e[1], g.shape, self.cell)
            if row is not None:
                return row
        return x


def shared_tokens(sa: TraceTokens, sb: TraceTokens) -> list[int]:
    """Keys of the tokens both traces computed, in side a's order."""
    if not sa.has_tokens or not sb.has_tokens:
        raise DivtraceError("token alignment needs token identity in both traces")
    shared = [k for k in sa.where if k in sb.where]
    if not shared:
        raise DivtraceError(f"{sa.trace.path} and {sb.trace.path} share no token (a token is the same when its "
                            f"sequence holds the same ids at positions 0..p): a holds {sa.describe()}; b holds "
                            f"{sb.describe()}")
    return shared


def token_alignment_needed(ta, tb, forced: bool = False) -> bool:
    """Whether to align by tokens: both traces carry token identity, and their root calls do not already hold
    the same tokens in the same cells (then pairing calls pairs the same rows, with whole-tensor metrics).
    `forced` (--align tokens): True, or a one-line error naming the trace without tokens."""
    ia, ib = ta.token_index(), tb.token_index()  # damaged token files (one deleted too): exit 2 here
    if not (ia.has_tokens and ib.has_tokens):
        if forced:
            t = ta if not ia.has_tokens else tb
            raise DivtraceError(
                f"{t.path}: the trace carries no token identity, so it cannot be aligned by tokens; record HF-style "
                "calls (input_ids, attention_mask, position_ids, a cache) or declare each root call's tokens with "
                "rec.tokens(ids, positions, seqs) inside the record block, or use --align calls")
        return False
    if forced:
        return True
    grids_a = [(g.shape, g.keys) for _, g in sorted(ia.grids.items())]
    grids_b = [(g.shape, g.keys) for _, g in sorted(ib.grids.items())]
    roots_a = sum(1 for c in ta.calls.values() if c.module == "")
    roots_b = sum(1 for c in tb.calls.values() if c.module == "")
    return not (grids_a == grids_b and roots_a == roots_b == len(grids_a))
