"""Token files beside a trace: what they hold, and how they are read back (written by
divtrace.record.token_store).

- tokens.jsonl: one line per root call with token identity: {"c": call id, "n": root call number, "shape": grid,
  "kv": key/value length, "src": "hf"|"declared", "keys", "pos", "ids", "fed", "seq"} (lists, one entry per
  cell), preceded by {"S": sequence number, "first": first ids} for each sequence that starts in that call. A grid
  of rec.final's values has "src": "final:logits" or "final:logprobs" (and "next": the ids the logprobs are of);
  {"P": call id, "used": [...]} gives the position ids the model used in that call, one per cell.
- rows.bin: little-endian uint64 row fingerprints (divtrace.record.rowhash, scheme in meta tokens.row_scheme), 8
  bytes per token row.
- rows.jsonl: one line per value with token rows: [vid, call id, layout code, offset in rows.bin (in rows)].
  Values whose shape is ambiguous are listed with their code ("?" or "x") and offset -1.

All three are appended at each root call's end and at close: bytes before lines, so an index line never
points past the data. A recording killed mid-write leaves at most a cut last line, which the reader ignores
(the trace is then incomplete anyway).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TOKENS, ROWS_INDEX, ROWS_BIN = "tokens.jsonl", "rows.jsonl", "rows.bin"
TOKEN_FILES = (TOKENS, ROWS_INDEX, ROWS_BIN)


@dataclass
class Grid:
    """A root call's token grid as read back (see divtrace.record.token_identity.TokenGrid)."""

    call_id: int
    root_call: int
    shape: list[int]
    kv_len: int
    source: str
    keys: list[int]
    pos: list[int]
    ids: list[int]
    fed: list[int]
    seq: list[int]
    next: list[int] | None = None  # rec.final's logprobs: the id each value is the logprob of
    used: list[int] | None = None  # the position ids the model used (read inside the call), one per cell

    @property
    def final(self) -> str | None:
        """"logits" or "logprobs" for a grid of rec.final's declared values, else None."""
        return self.source[6:] if self.source.startswith("final:") else None


def _lines(path: Path):
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except ValueError:
            return  # a line cut by a crash: nothing after it is whole


def _array_lines(path: Path) -> list:
    """The whole lines of a JSONL file of small arrays, parsed in one json.loads (a long rollout writes one line per
    value: 150k lines parse in a third of the time this way); a line cut by a crash ends what is read."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    if lines and lines[-1].strip():  # no newline after the last line: cut by a crash
        lines.pop()
    lines = [x for x in lines if x.strip()]
    try:
        return json.loads(b"[" + b",".join(lines) + b"]")
    except ValueError:
        return list(_lines(path))  # a damaged line: read line by line up to it


class TokenIndex:
    """The token files of one trace, read back. `grids` by root call id; `rows_of(vid)` -> (call id, code,
    offset) or None; `row_hash(vid, cell)`."""

    def __init__(self, trace_path) -> None:
        p = Path(trace_path)
        self.path = p
        self.grids: dict[int, Grid] = {}
        self.first_ids: dict[int, list[int]] = {}
        used: dict = {}
        for d in _lines(p / TOKENS):
            if "S" in d:
                self.first_ids[d["S"]] = d.get("first", [])
                continue
            if "P" in d:
                used[d["P"]] = d.get("used")
                continue
            try:
                g = Grid(d["c"], d["n"], d["shape"], d["kv"], d["src"], d["keys"], d["pos"], d["ids"], d["fed"], d["seq"],
                         d.get("next"))
            except (KeyError, TypeError):
                from divtrace.errors import DivtraceError

                raise DivtraceError(f"{p / TOKENS}: a line is not a token grid: {str(d)[:120]}") from None
            self.grids[g.call_id] = g
        for cid, u in used.items():
            g = self.grids.get(cid)
            if g is not None and isinstance(u, list) and len(u) == len(g.keys):
                g.used = u
        self._bin = None
        self._index = None

    @property
    def bin(self):
        """rows.bin as a numpy uint64 array (read on first use: deciding whether to align by tokens needs only
        the grids, and a hash-trace bisect by calls imports no numpy)."""
        if self._bin is None:
            import numpy as np

            try:
                self._bin = np.fromfile(self.path / ROWS_BIN, dtype="<u8")
            except (FileNotFoundError, ValueError):
                self._bin = np.zeros(0, dtype="<u8")
        return self._bin

    @property
    def index(self) -> dict[int, tuple[int, str, int]]:
        """vid -> (root call id, layout code, offset in rows.bin or -1)."""
        if self._index is None:
            from divtrace.trace.token_layout import row_count

            n = len(self.bin)
            self._index = {}
            for d in _array_lines(self.path / ROWS_INDEX):
                vid, cid, code, off = d
                g = self.grids.get(cid)
                if g is None:
                    continue
                if off >= 0 and off + row_count(code, g.shape) > n:
                    break  # data cut by a crash
                self._index[vid] = (cid, code, off)
        return self._index

    @property
    def has_tokens(self) -> bool:
        return bool(self.grids)
