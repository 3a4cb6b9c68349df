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

from divtrace.trace.hashing.rows import row_fingerprints, rows_bytes, strided_row_fingerprints
from divtrace.record.token_identity import TokenTracker
from divtrace.record.token_store import TokenStoreWriter
from divtrace.trace import token_layout


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
        self._layout_grid = None  # the grid _layouts holds the inferred layouts of: (shape, root output) -> code
        self._layouts: dict = {}

    def open(self, writer) -> None:
        self.store = TokenStoreWriter(writer.files)
        writer.before_flush.append(self.store.hand_over)  # token lines go out with the records they describe

    def declare(self, ids, positions, seqs=None) -> None:
        """Recorder.tokens: the token rows of the next root call."""
        self.tracker.declare(ids, positions, seqs)

    def begin_root_call(self, call_id: int, call: int, args, kwargs, where: str) -> None:
        """Give the root call about to be recorded its token grid (None where it has no token rows)."""
        self.grid = self.tracker.on_root_call(call_id, call, args, kwargs, where)
        if self.grid is not None:
            self.store.add_grid(self.grid)

    def end_root_call(self) -> None:
        self.grid = None
        self.rowed.clear()
        self.store.end_call()  # (written with the records: a failed write stops the recording, trace/writer.py)

    def rows(self, vid: int, t: torch.Tensor, root_output: bool = False, alias=None) -> None:
        """Fingerprint each token row of a value made in the current root call (see divtrace.trace.token_layout). A
        view whose rows hold the same bytes as its source's rows (`alias`: a reshape of a row-major layout, or the
        [B, T, H, d] <-> [B, H, T, d] transpose) points at the source's fingerprints instead of hashing again."""
        g = self.grid
        self.rowed.add(vid)
        if g is not self._layout_grid:  # the layout of a shape is the same all through one grid's call
            self._layout_grid, self._layouts = g, {}
        shape = t.shape
        code = self._layouts.get((shape, root_output), False)
        if code is False:
            code = self._layouts[(shape, root_output)] = token_layout.infer(shape, g.shape, g.kv_len, root_output)
        if self.layouts_override:
            path = self.boundary_path
            if path is None:
                path = self.call_paths.get(self._stack[-1].call_id, "") if self._stack else ""
            code = token_layout.override(self.layouts_override, path, t.shape, g.shape, code)
        if code is None:
            return
        if code in (token_layout.AMBIGUOUS, token_layout.CROSS):
            self.store.add_rows(vid, g.call_id, code, None)
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
            hashes = strided_row_fingerprints(t, code, token_layout.row_count(code, g.shape))
            if hashes is None:
                hashes = rows_bytes(row_fingerprints(token_layout.rows_2d(t, code)))
        self.store.add_rows(vid, g.call_id, code, hashes)

    def close(self) -> dict | None:
        """Close the token files: meta.json's `tokens` summary (None when there is none to give)."""
        tokens = self.store.close() if self.store is not None else None
        self.warnings.extend(w for w in self.tracker.warnings if w not in self.warnings)
        return tokens
