"""Token files beside a trace: what is written while recording, and how it is read back.

- tokens.jsonl: one line per root call with token identity: {"c": call id, "n": root call number, "shape": grid,
  "kv": key/value length, "src": "hf"|"declared", "keys", "pos", "ids", "fed", "seq"} (lists, one entry per
  cell), preceded by {"S": sequence number, "first": first ids} for each sequence that starts in that call.
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
import os
from dataclasses import dataclass
from pathlib import Path

TOKENS, ROWS_INDEX, ROWS_BIN = "tokens.jsonl", "rows.jsonl", "rows.bin"
TOKEN_FILES = (TOKENS, ROWS_INDEX, ROWS_BIN)
# json.dumps(x, separators=(",", ":")), with the encoder made once (dumps builds one per call when given options)
_COMPACT = json.JSONEncoder(separators=(",", ":")).encode


class TokenStoreWriter:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        for name in TOKEN_FILES:  # an overwritten trace must not keep the tokens of the one before
            try:
                (self.path / name).unlink()
            except FileNotFoundError:
                pass
        self._fds: dict[str, int] = {}
        self._tokens: list[str] = []
        self._index: list[str] = []
        self._bin: list[bytes] = []
        self.rows = 0  # rows written to rows.bin (and buffered)
        self.grids = 0
        self.values = 0
        self.unrowed: dict[str, int] = {}  # layout code ("?", "x") -> values compared whole
        self.current: dict[int, tuple[str, int]] = {}  # vid -> (code, offset) of the root call in progress
        self.shared = 0  # values that point at another value's rows (views of it)

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            fd = self._fds[name] = os.open(self.path / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        return fd

    def add_grid(self, grid) -> None:
        for number, first in grid.new_seqs:
            self._tokens.append(_COMPACT({"S": number, "first": first}))
        self._tokens.append(_COMPACT(
            {"c": grid.call_id, "n": grid.root_call, "shape": grid.shape, "kv": grid.kv_len, "src": grid.source,
             "keys": grid.keys, "pos": grid.pos, "ids": grid.ids, "fed": grid.fed, "seq": grid.seq}))
        self.grids += 1

    def add_rows(self, vid: int, call_id: int, code: str, hashes) -> None:
        """`hashes`: a numpy uint64 array, one per token row, or those as little-endian bytes
        (rowhash.strided_row_hashes); None for a value whose rows cannot be compared."""
        if hashes is None:
            self._index.append(f'[{vid},{call_id},"{code}",-1]')
            self.unrowed[code] = self.unrowed.get(code, 0) + 1
            return
        self._index.append(f'[{vid},{call_id},"{code}",{self.rows}]')
        self.current[vid] = (code, self.rows)
        if type(hashes) is bytes:
            self._bin.append(hashes)
            self.rows += len(hashes) >> 3
        else:
            self._bin.append(hashes.astype("<u8", copy=False).tobytes())
            self.rows += len(hashes)
        self.values += 1

    def add_rows_ref(self, vid: int, call_id: int, code: str, offset: int) -> None:
        """A value whose rows are another value's (a view holding the same bytes per row): its index line points at
        those fingerprints."""
        self._index.append(f'[{vid},{call_id},"{code}",{offset}]')
        self.current[vid] = (code, offset)
        self.shared += 1

    def end_call(self) -> None:
        self.current.clear()
        self.flush()

    def flush(self) -> None:
        if self._bin:
            os.write(self._fd(ROWS_BIN), b"".join(self._bin))
            self._bin.clear()
        if self._index:
            os.write(self._fd(ROWS_INDEX), ("\n".join(self._index) + "\n").encode())
            self._index.clear()
        if self._tokens:
            os.write(self._fd(TOKENS), ("\n".join(self._tokens) + "\n").encode())
            self._tokens.clear()

    def close(self) -> dict:
        try:
            self.flush()
        except OSError:
            self._bin.clear(), self._index.clear(), self._tokens.clear()
            raise
        finally:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
        from divtrace.record.rowhash import ROW_SCHEME

        return {"row_scheme": ROW_SCHEME, "grids": self.grids, "values_with_rows": self.values + self.shared,
                "values_sharing_rows": self.shared, "rows": self.rows,
                "compared_whole": dict(self.unrowed)}


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
        for d in _lines(p / TOKENS):
            if "S" in d:
                self.first_ids[d["S"]] = d.get("first", [])
                continue
            try:
                g = Grid(d["c"], d["n"], d["shape"], d["kv"], d["src"], d["keys"], d["pos"], d["ids"], d["fed"], d["seq"])
            except (KeyError, TypeError):
                from divtrace.errors import DivtraceError

                raise DivtraceError(f"{p / TOKENS}: a line is not a token grid: {str(d)[:120]}") from None
            self.grids[g.call_id] = g
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
