"""Which tokens an op's batch variance reaches: its differing rows as (sequence, slot, position) of the root
call's tokens.

Read from the root call's HF-style inputs: `input_ids` [B, T] (or [T]), with `position_ids` or an
`attention_mask` (padding on either side: a padded slot has no position) when given. An op's rows map to tokens
when it has one row per token (B*T rows: row r is sequence r // T, slot r % T) or one row per slot of a sequence
(T rows, as attention's query rows per head). Anything else is left unmapped (None): rows stay row numbers.
"""
from __future__ import annotations


class TokenViews:
    """The TokenView of the root call each op ran in (a generate() loop has one root call per step): from the
    token grids the trace recorded (divtrace.tokens: HF inputs or `rec.tokens(...)` declarations) where it has
    them, else read off the root call's HF-style inputs."""

    def __init__(self, trace):
        self.trace, self._views, self._root = trace, {}, {}
        # (read and checked: damaged token files are bad input here too)
        self.grids = trace.token_index().grids if hasattr(trace, "token_index") else {}

    def tokens(self, call_id: int, n_rows: int, rows: list[int]) -> list[dict] | None:
        root = self._root.get(call_id)
        if root is None:
            c = call_id
            while self.trace.calls[c].parent is not None:
                c = self.trace.calls[c].parent
            root = self._root[call_id] = c
        view = self._views.get(root)
        if view is None:
            grid = self.grids.get(root)
            view = self._views[root] = (GridView(grid) if grid is not None
                                        else TokenView(self.trace, self.trace.calls[root]))
        return view.tokens(n_rows, rows)


class GridView:
    """The rows of a recorded token grid ([B, T] or [N] cells, row-major; position -1: no token)."""

    def __init__(self, grid):
        shape = list(grid.shape)
        self.b, self.t = (1, shape[0]) if len(shape) == 1 else (shape[0], shape[1])
        pos = [p if p >= 0 else None for p in grid.pos]
        seq = [s if s >= 0 else None for s in grid.seq]
        self.grid = [pos[i * self.t:(i + 1) * self.t] for i in range(self.b)]
        self.seqs = [seq[i * self.t:(i + 1) * self.t] for i in range(self.b)]

    def tokens(self, n_rows: int, rows: list[int]) -> list[dict] | None:
        if not rows:
            return None
        b, t = self.b, self.t
        if n_rows == b * t:
            return [{"row": r, "seq": self.seqs[r // t][r % t], "slot": r % t, "position": self.grid[r // t][r % t]}
                    for r in rows]
        if n_rows == t:
            same = all(g == self.grid[0] for g in self.grid)
            return [{"row": r, "seq": self.seqs[0][r] if b == 1 else None, "slot": r,
                     "position": self.grid[0][r] if same else None} for r in rows]
        return None


class TokenView:
    def __init__(self, trace, root):
        self.grid = None  # [B][T] -> position, or None for a padded slot
        inputs = dict(root.inputs)
        vid = inputs.get("kwargs.input_ids", inputs.get("args.0"))
        if vid is None or not trace.has_bytes(vid):
            return
        dtype, shape, _ = trace.vkey[vid]
        if not dtype.startswith("torch.int") or len(shape) not in (1, 2):
            return
        b, t = (1, shape[0]) if len(shape) == 1 else shape
        grid = [[p for p in range(t)] for _ in range(b)]
        try:
            pos_vid = inputs.get("kwargs.position_ids")
            mask_vid = inputs.get("kwargs.attention_mask")
            if pos_vid is not None and trace.has_bytes(pos_vid):
                pos = trace.tensor(pos_vid).reshape(-1, t).tolist()
                grid = [list(pos[i % len(pos)]) for i in range(b)]
            elif mask_vid is not None and trace.has_bytes(mask_vid) and list(trace.vkey[mask_vid][1]) == list(shape):
                mask = trace.tensor(mask_vid).reshape(b, t).tolist()
                grid = []
                for row in mask:
                    seen, out = 0, []
                    for m in row:
                        out.append(seen if m else None)
                        seen += 1 if m else 0
                    grid.append(out)
        except Exception:  # a malformed optional input: positions by slot
            pass
        self.grid, self.b, self.t = grid, b, t

    def tokens(self, n_rows: int, rows: list[int]) -> list[dict] | None:
        """[{"row", "seq", "slot", "position"}] for `rows` of an op with `n_rows` rows, or None when the op's
        rows are not the tokens. seq None: the row stands for that slot of every sequence; position None: a
        padded slot, or a slot whose position differs between the sequences."""
        if self.grid is None or not rows:
            return None
        b, t = self.b, self.t
        if n_rows == b * t:
            return [{"row": r, "seq": r // t, "slot": r % t, "position": self.grid[r // t][r % t]} for r in rows]
        if n_rows == t:
            same = all(g == self.grid[0] for g in self.grid)
            return [{"row": r, "seq": 0 if b == 1 else None, "slot": r,
                     "position": self.grid[0][r] if same else None} for r in rows]
        return None
