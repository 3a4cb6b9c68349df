"""Token identity and rows at record time: which token each row of a recorded tensor is.

A root call's inputs (HF-style `input_ids` with `attention_mask`, `position_ids`, a cache) or a declaration
(`rec.tokens(ids, positions, seqs)`) give the call a token grid (token_identity); every value made in that call
then gets its token dims inferred from its shape (divtrace.trace.token_layout, overridable per module with
`token_layouts`) and an 8-byte fingerprint per token row (rowhash), written beside the trace (token_store).

In: root calls begun and ended (module_calls), values made during one (values). Out: tokens.jsonl, rows.jsonl and
rows.bin in the trace directory (appended by the trace writer in step with records.jsonl, under its checksums), and
meta.json's `tokens` summary at close.
"""
from __future__ import annotations

import torch

from divtrace.errors import DivtraceError
from divtrace.trace.hashing import rows as hashing_rows
from divtrace.trace.hashing.base import native_eligible
from divtrace.trace.hashing.rows import row_fingerprints, rows_bytes, strided_row_fingerprints
from divtrace.record.token_identity import TokenTracker
from divtrace.record.token_provenance import layout_from_op
from divtrace.record.token_store import TokenStoreWriter
from divtrace.trace import token_layout

_STRIDED = torch.strided
_FIRST_BYTE = bytes(8)  # (int64 0: the one run of a whole row starts at its byte 0)
FINAL = "<final>"  # the module path of rec.final's calls: no module of a model is named so


def _int_list(x, where: str, what: str) -> list[int]:
    if isinstance(x, torch.Tensor):
        x = x.reshape(-1).tolist()
    try:
        return [int(v) for v in x]
    except (TypeError, ValueError):
        raise DivtraceError(f"{where}: {what} must be a list or 1-D tensor of ints, got {type(x).__name__}") from None


class TokenRows:
    """The token grid of the root call in progress and the row fingerprints of its values (one per Recorder)."""

    def __init__(self, on: bool, token_layouts, stack: list, warnings_out: list):
        self.on = bool(on)  # record(tokens=...)
        self.layouts_override = token_layout.compile_overrides(token_layouts)
        self.call_paths: dict[int, str] = {}  # call id -> module path (for token_layouts)
        self.boundary_path: str | None = None  # the module whose inputs or outputs are being recorded
        self._stack = stack  # the module calls' frames (module_calls): the call a value is made in
        self.warnings = warnings_out
        self.tracker = TokenTracker()
        self.grid = None  # the token grid of the root call in progress (divtrace.record.token_identity.TokenGrid)
        self.store: TokenStoreWriter | None = None
        self.device = None  # the trace writer's device path, where values are fingerprinted on their device
        self.rowed: set[int] = set()  # vids whose token rows were looked at (the current root call's)
        self.unrowed: set[int] = set()  # of those, the ones no layout fitted (a root output may fit one: lastK)
        self.last_grid = None  # the grid of the last root call that ended (what rec.final's rows refer to)
        self.grids_by_call: dict = {}  # root call number -> its grid (rec.final(..., call=n))
        self.positions_seen = False  # the positions the current root call's model uses were read
        self._layout_grid = None  # the grid _layouts holds the inferred layouts of: (shape, root output) -> code
        self._layouts: dict = {}
        self._plans: dict = {}  # (code, shape, stride, dtype) -> (row count, row_layout's answer), for _layout_grid
        self.shard_rows = None  # a rank of a sharded run: rows of a value's block as partials (record/placements.py)
        # a rank with declared module outputs: whether a value made now waits for its module's exit for its rows
        # (its layout, and so its rows' partials, come with the declaration there)
        self.defer_rows = None
        self.deferred: set[int] = set()

    def open(self, writer) -> None:
        self.store = TokenStoreWriter(writer.files)
        writer.before_flush.append(self.store.hand_over)  # token lines go out with the records they describe

    def declare(self, ids, positions, seqs=None) -> None:
        """Recorder.tokens: the token rows of the next root call."""
        self.tracker.declare(ids, positions, seqs)

    def begin_root_call(self, call_id: int, call: int, args, kwargs, where: str) -> None:
        """Give the root call about to be recorded its token grid (None where it has no token rows)."""
        self.grid = self.tracker.on_root_call(call_id, call, args, kwargs, where)
        self.positions_seen = False
        if self.grid is not None:
            self.store.add_grid(self.grid)

    def end_root_call(self) -> None:
        self.last_grid = self.grid
        if self.grid is not None:
            self.grids_by_call[self.grid.root_call] = self.grid
        self.grid = None
        self.rowed.clear()
        self.unrowed.clear()
        self.deferred.clear()
        self.store.end_call()  # (written with the records: a failed write stops the recording, trace/writer.py)

    def declared_rows(self, vid: int, t: torch.Tensor) -> None:
        """The rows of a declared module's output whose rows waited for its layout (`defer_rows`)."""
        self.deferred.discard(vid)
        if self.grid is not None:
            self.rows(vid, t, defer=False)

    def rows(self, vid: int, t: torch.Tensor, root_output: bool = False, alias=None, defer: bool = True,
             made_by=None) -> None:
        """Fingerprint each token row of a value made in the current root call (see divtrace.trace.token_layout). A
        view whose rows hold the same bytes as its source's rows (`alias`: a reshape of a row-major layout, or the
        [B, T, H, d] <-> [B, H, T, d] transpose) points at the source's fingerprints instead of hashing again."""
        g = self.grid
        self.rowed.add(vid)
        if g is not self._layout_grid:  # the layout of a shape is the same all through one grid's call
            self._layout_grid, self._layouts, self._plans = g, {}, {}
        shape = t.shape
        floating = t.is_floating_point()
        code = self._layouts.get((shape, root_output, floating), False)
        if code is False:
            code = self._layouts[(shape, root_output, floating)] = token_layout.infer(
                shape, g.shape, g.kv_len, root_output, floating)
        if self.layouts_override:
            path = self.boundary_path
            if path is None:
                path = self.call_paths.get(self._stack[-1].call_id, "") if self._stack else ""
            code = token_layout.override(self.layouts_override, path, t.shape, g.shape, code)
        if code is None:
            self.unrowed.add(vid)
            return
        self.unrowed.discard(vid)
        if code == token_layout.AMBIGUOUS and made_by is not None:  # (op, encoded args, inputs, the values' table)
            op, args, inputs, table = made_by
            cur = self.store.current
            shapes = {e[0]: s.shape for s in inputs if (e := table.get(s)) is not None}
            code = layout_from_op(op, args, shapes, lambda v: (cur.get(v) or (None,))[0], shape) or code
        if code in (token_layout.AMBIGUOUS, token_layout.CROSS):
            self.store.add_rows(vid, g.call_id, code, None)
            return
        if self.shard_rows is not None:
            same = None  # (a value whose rows hold these bytes row by row: its partials may serve, placements says)
            if alias is not None:
                ref = self.store.current.get(alias[0])
                if ref is not None and token_layout.same_rows(ref[0], code, alias[1], t, g.shape):
                    same = alias[0]
            hashes = self.shard_rows(t, code, vid, same)
            if hashes is not None:
                self.store.add_rows(vid, g.call_id, code, hashes)
                return
            if defer and self.defer_rows is not None and not root_output and self.defer_rows(self._stack, t):
                self.deferred.add(vid)
                return
        if alias is not None:
            ref = self.store.current.get(alias[0])
            if ref is not None and token_layout.same_rows(ref[0], code, alias[1], t, g.shape):
                self.store.add_rows_ref(vid, g.call_id, code, ref[1])
                return
        dev = self.device
        if dev is not None and (dev.forced or not t.is_cpu):  # on the device, read on the writer thread
            hashes = dev.pending_rows(token_layout.rows_2d(t, code))
        else:
            hashes = self._in_place(t, code, g)
            if hashes is None:
                hashes = _copied_rows(token_layout.rows_2d(t, code))
        self.store.add_rows(vid, g.call_id, code, hashes)

    def _in_place(self, t: torch.Tensor, code: str, g) -> bytes | None:
        """strided_row_fingerprints(t, code, row count) (whole rows read in place by the C kernel), with its answer
        on where the rows lie kept per (code, shape, stride, dtype) for the grid's call (layers repeat them); None
        where the kernel cannot read them so."""
        native = hashing_rows._native
        if native is None or not t.is_cpu or t.layout is not _STRIDED or t.is_conj() or t.is_neg() or t.is_quantized:
            return strided_row_fingerprints(t, code, token_layout.row_count(code, g.shape))
        key = (code, t.shape, t.stride(), t.dtype)
        plan = self._plans.get(key)
        if plan is None:
            rows = token_layout.row_count(code, g.shape)
            plan = self._plans[key] = (rows, hashing_rows.row_layout(t, code, rows))
        rows, got = plan
        if got is None:  # ([B, H, T, d] stored heads first: each head's part read in place, no [B, T, H, d] copy)
            return hashing_rows.heads_row_fingerprints(t, rows) if code == "bht" else None
        return native.row_fingerprints2(t.data_ptr(), rows, got[0], got[1], _FIRST_BYTE, 0)

    def observe_positions(self, t: torch.Tensor) -> None:
        """The position ids the model uses in the current root call, from the first module input named
        `position_ids`/`positions` below the root: what HF computes itself where the caller passed none (an arange
        over the padded length, not the positions a token has in its sequence). Read once per root call: on the
        CPU a host read of a small integer tensor, as the root's input ids are; on the device path the store
        queues its copy, read on the writer thread."""
        self.positions_seen = True
        g = self.grid
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or t.is_meta:
            return
        if len(g.shape) == 2:
            b, n = g.shape
            if t.dim() == 1 and t.shape[0] == n:
                t = t[None]
            if not (t.dim() == 2 and t.shape[1] == n and t.shape[0] in (1, b)):
                return
            used = t.expand(b, n).reshape(-1)
        else:
            if t.dim() == 2 and t.shape[0] == 1:
                t = t[0]
            if not (t.dim() == 1 and t.shape[0] == g.shape[0]):
                return
            used = t
        self.store.add_used(g.call_id, used)

    def final(self, calls, t: torch.Tensor, rows, kind, targets, call=None) -> None:
        """rec.final: write `t` as the final values of `rows` (cells) of the last root call's token grid (or of root
        call number `call`), as a call of the pseudo module FINAL with a token grid of its own (one cell per row)."""
        from divtrace.record.token_identity import TokenGrid

        where = "rec.final"
        g = self.last_grid if call is None else self.grids_by_call.get(call)
        if call is not None and g is None:
            raise DivtraceError(f"{where}: root call {call} has no token rows (root calls with rows: "
                                f"{sorted(self.grids_by_call)[:8]})")
        if not isinstance(t, torch.Tensor):
            raise DivtraceError(f"{where}: values must be a tensor, got {type(t).__name__}")
        if g is None:
            raise DivtraceError(f"{where}: no root call with token rows has ended yet: call it after the model call "
                                "whose tokens the values belong to (declare them with rec.tokens, or an HF-style call)")
        if isinstance(rows, str) and rows == "last":
            cells = _last_cells(g)
        else:
            cells = _int_list(rows, where, "rows") if rows is not None else list(range(len(g.keys)))
        if t.dim() == 0 or t.shape[0] != len(cells):
            raise DivtraceError(f"{where}: values of shape {list(t.shape)} hold {t.shape[0] if t.dim() else 0} rows, "
                                f"but {len(cells)} rows were named; give one row of values per cell")
        bad = next((c for c in cells if not 0 <= c < len(g.keys)), None)
        if bad is not None:
            raise DivtraceError(f"{where}: row {bad} is outside the last root call's {len(g.keys)} token rows")
        if kind is None:
            kind = "logits" if t.dim() >= 2 and t.shape[-1] > 1 else "logprobs"
        if kind not in ("logits", "logprobs"):
            raise DivtraceError(f"{where}: kind must be 'logits' or 'logprobs', got {kind!r}")
        if kind == "logits" and t.dim() < 2:
            raise DivtraceError(f"{where}: logits need a row of vocabulary values per cell (2-D), got shape "
                                f"{list(t.shape)}")
        nxt = _int_list(targets, where, "targets") if targets is not None else None
        if nxt is not None and len(nxt) != len(cells):
            raise DivtraceError(f"{where}: {len(nxt)} targets for {len(cells)} rows")

        def grid_for(call_id, call_number):
            return TokenGrid(call_id, call_number, [len(cells)], [g.keys[c] for c in cells], [g.pos[c] for c in cells],
                             [g.ids[c] for c in cells], [g.fed[c] for c in cells], [g.seq[c] for c in cells], kv_len=0,
                             source=f"final:{kind}", next_ids=nxt)

        calls.pseudo_call(FINAL, grid_for, t, f"out.{kind}")

    def last_rows(self, call=None) -> list[int]:
        """rec.last_rows: the last cell of each sequence in the last root call's token grid (or root call number
        `call`), in the order the sequences first appear."""
        g = self.last_grid if call is None else self.grids_by_call.get(call)
        if g is None:
            raise DivtraceError(f"rec.last_rows: {'no root call with token rows has ended yet' if call is None else f'root call {call} has no token rows'}")
        return _last_cells(g)

    def close(self) -> dict | None:
        """Close the token files: meta.json's `tokens` summary (None when there is none to give)."""
        tokens = self.store.close() if self.store is not None else None
        self.warnings.extend(w for w in self.tracker.warnings if w not in self.warnings)
        return tokens


def _copied_rows(x: torch.Tensor) -> bytes:
    """rows_bytes(row_fingerprints(x)) of the token rows as a 2-D tensor [rows, elements] (a copy where they were not
    in place): a contiguous one is read by the C kernel as whole rows straight to rows.bin's bytes (no int64 tensor
    made and read back)."""
    native = hashing_rows._native
    if native is not None and x.shape[0] and x.shape[1] and x.is_contiguous() and native_eligible(x):
        step = x.shape[1] * x.element_size()
        return native.row_fingerprints2(x.data_ptr(), x.shape[0], step, step, _FIRST_BYTE, 0)
    return rows_bytes(row_fingerprints(x))


def _last_cells(g) -> list[int]:
    """The last cell of each sequence of a grid, in the order the sequences first appear (a generate step's
    predicting rows)."""
    last: dict = {}
    for c, sq in enumerate(g.seq):
        if sq >= 0:
            last[sq] = c
    return list(last.values())
