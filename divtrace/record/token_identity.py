"""Record time: which token each row of a root call's input is.

Two rows of two traces are the same token when their sequences hold the same token ids at positions 0..p: the
key of a token is a 64-bit fold of those ids (`next_key`), never a batch slot, request id, micro-batch, padding
side or decode step. `TokenTracker` keeps each sequence's running key between root calls, so a decode step (a
call with a cache) continues the rows of the calls before it.

Sources, in this order:
- a declaration, `rec.tokens(ids, positions, seqs=None)`, made before the root call (engines, custom loops);
- HF-style keyword inputs: `input_ids` [B, T] or [T], with `attention_mask` (either padding side; [B, past + T]
  in decode), `position_ids` (a real token at position 0 after others in its row starts a packed sequence),
  `cache_position`, and a cache (`past_key_values` or `cache`) whose length says the call continues the rows of
  the previous root call.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from divtrace.errors import DivtraceError
from divtrace.trace.token_keys import MASK64, ROOT_KEY, next_key  # noqa: F401 (the key fold is the format's)

FIRST_IDS = 8  # ids kept per sequence to show people which sequence a token is in


@dataclass
class TokenGrid:
    """The token rows of one root call, in the order the call lays them out: `shape` is [B, T] for a batch of rows
    or [N] for flattened tokens, and every list has one entry per cell, row-major. A cell whose key is 0 is no
    token (padding, or a row whose sequence divtrace could not follow)."""

    call_id: int
    root_call: int  # call number of the root module
    shape: list[int]
    keys: list[int]
    pos: list[int]  # position in its sequence (0-based), -1 for no token
    ids: list[int]
    fed: list[int]  # the position id the model was given for it, -1 where none was
    seq: list[int]  # sequence number in this trace (the `S` entries of tokens.jsonl), -1 for no token
    kv_len: int  # key/value positions the call attends over (cache + this call's), for spotting cross-token tensors
    source: str  # "hf" or "declared"
    new_seqs: list[tuple[int, list[int]]] = field(default_factory=list)  # (seq number, its first ids) started here
    next_ids: list[int] | None = None  # rec.final's logprobs: the id each value is the logprob of (the next token)


class _Seq:
    __slots__ = ("number", "keys", "ids")

    def __init__(self, number: int):
        self.number, self.keys, self.ids = number, [], []

    def add(self, token_id: int) -> int:
        key = next_key(self.keys[-1] if self.keys else ROOT_KEY, token_id)
        self.keys.append(key)
        self.ids.append(token_id)
        return key


def _as_list(x, what: str) -> list[int]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise DivtraceError(f"rec.tokens: {what} must be 1-D (one entry per token row), got shape {list(x.shape)}")
        return [int(v) for v in x.tolist()]
    try:
        return [int(v) for v in x]
    except (TypeError, ValueError):
        raise DivtraceError(f"rec.tokens: {what} must be a list or 1-D tensor of ints, got {type(x).__name__}") from None


def _tensor(obj) -> torch.Tensor | None:
    return obj if isinstance(obj, torch.Tensor) else None


def _cache_len(cache) -> int:
    """Positions already held by an HF cache object (or a legacy tuple of (k, v) per layer), 0 when unknown."""
    if cache is None:
        return 0
    get = getattr(cache, "get_seq_length", None)
    if callable(get):
        try:
            return int(get())
        except Exception:
            return 0
    try:
        return int(cache[0][0].shape[-2])
    except Exception:
        return 0


class TokenTracker:
    """Follows sequences across the root calls of one recording."""

    def __init__(self) -> None:
        self._declared: tuple[list[int], list[int], list | None] | None = None
        self._rows: list[_Seq | None] | None = None  # HF: the sequence of each batch row of the last call
        self._by_handle: dict = {}  # declared: seq handle -> _Seq
        self._auto: list[_Seq] = []  # declared without handles: sequences that may continue
        self._count = 0
        self.warnings: list[str] = []

    def _new_seq(self, grid_new: list) -> _Seq:
        s = _Seq(self._count)
        self._count += 1
        grid_new.append(s)
        return s

    # -- declarations --------------------------------------------------------------------------------------
    def declare(self, ids, positions, seqs=None) -> None:
        ids_l, pos_l = _as_list(ids, "ids"), _as_list(positions, "positions")
        if len(ids_l) != len(pos_l):
            raise DivtraceError(f"rec.tokens: {len(ids_l)} ids but {len(pos_l)} positions; give one of each per token row")
        if seqs is not None:
            seqs = seqs.tolist() if isinstance(seqs, torch.Tensor) else list(seqs)
            if len(seqs) != len(ids_l):
                raise DivtraceError(f"rec.tokens: {len(ids_l)} ids but {len(seqs)} seqs; give one sequence handle per "
                                    "token row")
        if any(p < 0 for p in pos_l):
            raise DivtraceError("rec.tokens: positions must be >= 0")
        self._declared = (ids_l, pos_l, seqs)

    @property
    def pending(self) -> bool:
        return self._declared is not None

    # -- root calls ----------------------------------------------------------------------------------------
    def on_root_call(self, call_id: int, root_call: int, args, kwargs, where: str) -> TokenGrid | None:
        if self._declared is not None:
            declared, self._declared = self._declared, None
            return self._from_declared(call_id, root_call, args, kwargs, declared, where)
        return self._from_hf(call_id, root_call, args, kwargs)

    def _from_declared(self, call_id, root_call, args, kwargs, declared, where) -> TokenGrid:
        ids, pos, seqs = declared
        n = len(ids)
        ints = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)
                and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool]
        id_input = kwargs.get("input_ids") if isinstance(kwargs.get("input_ids"), torch.Tensor) else \
            (ints[0] if ints else None)
        shape = [n]
        if id_input is not None:
            if id_input.numel() != n:
                raise DivtraceError(f"rec.tokens declared {n} token rows but {where} takes {list(id_input.shape)} "
                                    f"token ids ({id_input.numel()} rows)")
            got = [int(v) for v in id_input.reshape(-1).tolist()]
            bad = next((i for i in range(n) if got[i] != ids[i]), None)
            if bad is not None:
                raise DivtraceError(f"rec.tokens: row {bad} declares token id {ids[bad]} but {where} takes id {got[bad]} "
                                    "there; declare the rows in the order the call lays its tokens out")
            if id_input.dim() == 2:
                shape = list(id_input.shape)
        new: list[_Seq] = []
        keys, seqn = [], []
        prev_auto: _Seq | None = None
        for i in range(n):
            p, tid = pos[i], ids[i]
            if seqs is not None:
                h = seqs[i]
                s = self._by_handle.get(h)
                if s is None or p == 0:
                    s = self._by_handle[h] = self._new_seq(new)
            elif p == 0:
                s = self._new_seq(new)
                self._auto.append(s)
            elif prev_auto is not None and len(prev_auto.keys) == p:
                s = prev_auto
            else:
                cands = [c for c in self._auto if len(c.keys) == p]
                if len(cands) != 1:
                    raise DivtraceError(
                        f"rec.tokens: row {i} of {where} has position {p} and no sequence handle, and "
                        f"{len(cands)} earlier sequences hold {p} tokens; pass seqs= (request ids) to say which it "
                        "continues")
                s = cands[0]
            prev_auto = s if seqs is None else None
            if p < len(s.keys):  # a recompute (preemption) or a rewritten request: keep the prefix before p
                del s.keys[p:], s.ids[p:]
            if p > len(s.keys):
                keys.append(0)
                seqn.append(-1)
                self._warn(f"{where}: row {i} is at position {p} of a sequence divtrace saw only {len(s.keys)} "
                           "tokens of (recording began mid-sequence, or a prefix cache hit): it is not aligned")
                continue
            keys.append(s.add(tid))
            seqn.append(s.number)
        return TokenGrid(call_id, root_call, shape, keys, list(pos), list(ids), list(pos), seqn,
                         kv_len=max(pos) + 1 if pos else 0, source="declared",
                         new_seqs=[(s.number, s.ids[:FIRST_IDS]) for s in new])

    def _warn(self, msg: str) -> None:
        if len(self.warnings) < 20 and msg not in self.warnings:
            self.warnings.append(msg)

    def _from_hf(self, call_id, root_call, args, kwargs) -> TokenGrid | None:
        ids = _tensor(kwargs.get("input_ids"))
        if ids is None and args and isinstance(args[0], torch.Tensor):
            ids = args[0]
        if (ids is None or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool
                or ids.dim() not in (1, 2) or ids.is_meta):
            return None
        flat = ids.dim() == 1
        ids2 = ids[None] if flat else ids
        b, t = ids2.shape
        mask = _tensor(kwargs.get("attention_mask"))
        if mask is not None and not (mask.dim() == 2 and mask.shape[0] == b and mask.shape[1] >= t):
            mask = None  # a 4-D mask made by the caller: padding cannot be read from it
        pos_ids = _tensor(kwargs.get("position_ids"))
        if pos_ids is not None:
            if pos_ids.dim() == 1 and pos_ids.shape[0] == t:
                pos_ids = pos_ids[None].expand(b, t)
            elif not (pos_ids.dim() == 2 and pos_ids.shape[1] == t and pos_ids.shape[0] in (1, b)):
                pos_ids = None
            elif pos_ids.shape[0] == 1:
                pos_ids = pos_ids.expand(b, t)
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        past = _cache_len(cache)
        cpos = _tensor(kwargs.get("cache_position"))
        if cpos is not None and cpos.numel():
            past = max(past, int(cpos.reshape(-1)[0]))
        ids_l = ids2.tolist()
        mask_l = mask[:, mask.shape[1] - t:].tolist() if mask is not None else None
        pos_l = pos_ids.tolist() if pos_ids is not None else None
        new: list[_Seq] = []
        rows: list[_Seq | None] = []
        if past > 0:
            if self._rows is None or len(self._rows) != b:
                self._warn(f"root call {root_call} continues a cache of {past} positions that divtrace did not see "
                           "filled (recording began mid-generation, or the batch changed): its rows are not aligned")
                self._rows = None
                return None
            rows = list(self._rows)
        else:
            rows = [None] * b
        keys, pos, fed, seqn, flat_ids = [], [], [], [], []
        for r in range(b):
            s = rows[r]
            for c in range(t):
                tid = ids_l[r][c]
                flat_ids.append(tid)
                real = mask_l is None or mask_l[r][c] != 0
                f = pos_l[r][c] if pos_l is not None else -1
                if not real:
                    keys.append(0), pos.append(-1), fed.append(f), seqn.append(-1)
                    continue
                if s is None or (f == 0 and s.keys and pos_l is not None):  # a row's start, or a packed restart
                    s = self._new_seq(new)
                keys.append(s.add(tid))
                pos.append(len(s.keys) - 1)
                fed.append(f)
                seqn.append(s.number)
            rows[r] = s
        self._rows = rows
        return TokenGrid(call_id, root_call, [t] if flat else [b, t], keys, pos, flat_ids, fed, seqn,
                         kv_len=past + t, source="hf", new_seqs=[(s.number, s.ids[:FIRST_IDS]) for s in new])
