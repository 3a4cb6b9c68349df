"""Token files beside a trace: what they hold, and how they are read back, checked (written by
divtrace.record.token_store, in step with records.jsonl and under its checksums: divtrace.trace.side_files).

- tokens.jsonl: one line per root call with token identity: {"c": call id, "n": root call number, "shape": grid,
  "kv": key/value length, "src": "hf"|"declared", "keys", "pos", "ids", "fed", "seq"} (lists, one entry per
  cell), preceded by {"S": sequence number, "first": first ids} for each sequence that starts in that call. A line
  is a grid when it has "c" and "keys", a sequence start when it has "S"; any other JSON object is a line kind of a
  newer divtrace, kept as (line number, object) in `other_lines`, as are a grid line's other keys in `Grid.extra`.
  A grid of rec.final's declared values has "src": "final:logits" or "final:logprobs" (and "next": the ids the
  logprobs are of); {"P": call id, "used": [...]} gives the position ids the model used in that call, per cell.
- rows.bin: little-endian uint64 row fingerprints (divtrace.record.rowhash, scheme in meta tokens.row_scheme), 8
  bytes per token row.
- rows.jsonl: one line per value with token rows: [vid, call id, layout code, offset in rows.bin (in rows)].
  Values whose shape is ambiguous are listed with their code ("?" or "x") and offset -1.

Every byte is checked when read (divtrace.trace.token_checks): damage is a DivtraceError naming the file and line;
an incomplete trace keeps what its records hold.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from divtrace.errors import DivtraceError
from divtrace.trace.files import CHECKSUMS
from divtrace.trace import token_checks as checks
from divtrace.trace import token_layout

TOKENS, ROWS_INDEX, ROWS_BIN = "tokens.jsonl", "rows.jsonl", "rows.bin"
TOKEN_FILES = (ROWS_BIN, ROWS_INDEX, TOKENS)  # in the order a flush appends them: bytes before the lines


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
    line: int = 0  # its line in tokens.jsonl
    extra: dict = field(default_factory=dict)  # keys of its line this reader does not know
    arrays: tuple = ()  # (keys, pos, ids, seq) as numpy arrays, while the file is checked
    used: list | None = None  # the position ids the model used (read inside the call: a "P" line), one per cell


    @property
    def final(self) -> str | None:
        """"logits" or "logprobs" for a grid of rec.final's declared values, else None."""
        return self.source[6:] if self.source.startswith("final:") else None

    @property
    def next(self) -> list | None:
        """rec.final's logprobs: the id each value is the logprob of, where declared."""
        nxt = self.extra.get("next")
        return nxt if isinstance(nxt, list) and len(nxt) == len(self.keys) else None


_GRID_KEYS = ("c", "n", "shape", "kv", "src", "keys", "pos", "ids", "fed", "seq")


def _grid(d: dict, where, n: int) -> Grid:
    at = f"{where}:{n}"
    missing = [k for k in _GRID_KEYS if k not in d]
    if missing:
        raise DivtraceError(f"{at}: a token grid without {', '.join(missing)}")
    c, num, shape, kv, src = d["c"], d["n"], d["shape"], d["kv"], d["src"]
    if not all(type(x) is int and x >= 0 for x in (c, num, kv)) or type(src) is not str:
        raise DivtraceError(f"{at}: a token grid whose call id, call number, kv or src is malformed")
    if not (isinstance(shape, list) and len(shape) in (1, 2) and all(type(x) is int and x >= 0 for x in shape)):
        raise DivtraceError(f"{at}: a token grid of shape {str(shape)[:40]} (one or two sizes)")
    cells = shape[0] * (shape[1] if len(shape) == 2 else 1)
    for k in _CELL_LISTS:
        if not isinstance(d[k], list) or len(d[k]) != cells:
            raise DivtraceError(f"{at}: `{k}` is not a list of {cells} entries, one per cell of the grid")
    return Grid(c, num, shape, kv, src, d["keys"], d["pos"], d["ids"], d["fed"], d["seq"], n,
                {k: v for k, v in d.items() if k not in _GRID_KEYS})


_CELL_LISTS = ("keys", "pos", "ids", "fed", "seq")


def check_grids(grids: list[Grid], first_ids: dict, where) -> None:
    """Every cell an integer, and every token's key the fold of its sequence's ids (numpy: a trace the checksums
    vouch for is checked so only in `check()`, since its bytes are what the recorder wrote)."""
    for g in grids:
        at = f"{where}:{g.line}"
        keys, pos, ids, fed, seq = (checks.int_array(getattr(g, f), at, k, unsigned=k == "keys")
                                    for f, k in zip(("keys", "pos", "ids", "fed", "seq"), _CELL_LISTS))
        g.arrays = (keys, pos, ids, seq)
    try:
        checks.check_keys(grids, first_ids, where)
    finally:
        for g in grids:
            g.arrays = ()


def _read_tokens(data: bytes, where, strict: bool) -> tuple[list[Grid], dict, list]:
    grids: list[Grid] = []
    first_ids: dict[int, tuple[list[int], int]] = {}
    other = []
    for n, d in checks.json_lines(data, where):
        if not isinstance(d, dict):
            raise DivtraceError(f"{where}:{n}: not a token line (a JSON object)")
        if "c" in d and "keys" in d:
            g = _grid(d, where, n)
            if grids and g.call_id <= grids[-1].call_id:
                raise DivtraceError(f"{where}:{n}: the grid of call {g.call_id} after the grid of call "
                                    f"{grids[-1].call_id} (grids are written in call order)")
            grids.append(g)
        elif "S" in d:
            s, first = d["S"], d.get("first", [])
            if type(s) is not int or s < 0 or not isinstance(first, list) or not all(type(x) is int for x in first):
                raise DivtraceError(f"{where}:{n}: a sequence line whose number or first ids are malformed")
            if s in first_ids or s != len(first_ids):
                raise DivtraceError(f"{where}:{n}: sequence {s} starts again or out of order")
            first_ids[s] = (first, n)
        else:
            other.append((n, d))  # a line kind of a newer divtrace: (line number, object)
    if strict:
        check_grids(grids, first_ids, where)
    return grids, first_ids, other


class TokenIndex:
    """The token files of one trace, read back and checked. `grids` by root call id; `index` (vid -> (call id,
    code, offset)); `bin` (the row fingerprints). Made by `Trace.token_index()` (read once per trace). `check()`
    checks the rows too (they are read on first use); `verified` is False for a trace written before token
    checksums."""

    def __init__(self, trace) -> None:
        self.trace = trace
        self.path = p = trace.path
        self.complete = trace.complete  # else: cut back to what the records hold
        data, bad, self.verified = checks.read_files(trace, TOKEN_FILES)
        if not self.verified and not trace.complete:
            data = {n: (checks.cut_torn_line(b) if n != ROWS_BIN else b[:len(b) - len(b) % 8]) for n, b in data.items()}
        if not self.verified and any(data.values()):
            trace.warnings.append(
                f"{p}: {CHECKSUMS} is missing, so the token files are read unverified" if "file_checksums" in trace.meta
                else f"{p}: token files written before divtrace checked them ({', '.join(TOKEN_FILES)} have no "
                     "checksums): they are read unverified")
        # The bytes the checksums vouch for are what the recorder wrote: their keys are re-folded in check() only;
        # where nothing vouches for them (older traces), or to name the line of damage the checksums found, now.
        strict = not self.verified or bool(bad)
        try:
            grids, first_ids, self.other_lines = _read_tokens(data[TOKENS], p / TOKENS, strict)
            self._unchecked = None if strict else (grids, first_ids)
            self._rows_data = data[ROWS_INDEX]
            self._bin_data = data[ROWS_BIN]
            if len(self._bin_data) % 8:
                raise DivtraceError(f"{p / ROWS_BIN}: {len(self._bin_data)} bytes, not a whole number of 8-byte row "
                                    "fingerprints")
            self.grids: dict[int, Grid] = {}
            self.cut_grids: dict[int, list[int]] = {}  # call id -> grid shape of grids cut back (incomplete trace)
            for g in grids:
                self._take_grid(g)
            self.first_ids = {s: first for s, (first, _) in first_ids.items()}
            self._take_used()
            self._check_counts_of_grids(len(grids))
            self._bin = None
            self._index = None
            if ROWS_INDEX in bad:  # name the line, where one is wrong
                self.index
        except DivtraceError as e:
            if bad:
                raise DivtraceError("; ".join([str(e), *bad.values()])) from None
            raise
        if bad:
            raise DivtraceError("; ".join(bad.values()))

    def _take_used(self) -> None:
        """The "P" lines: the position ids each root call's model used, one per cell of its grid."""
        for n, d in self.other_lines:
            if "P" not in d:
                continue
            g = self.grids.get(d["P"])
            used = d.get("used")
            if g is None:
                if d["P"] in self.cut_grids:
                    continue
                raise DivtraceError(f"{self.path / TOKENS}:{n}: positions of call {d['P']!r}, which has no token grid")
            if not (isinstance(used, list) and len(used) == len(g.keys) and all(type(x) is int for x in used)):
                raise DivtraceError(f"{self.path / TOKENS}:{n}: the positions of call {g.call_id} are not "
                                    f"{len(g.keys)} ints, one per cell of its grid")
            g.used = used

    def _take_grid(self, g: Grid) -> None:
        call = self.trace.calls.get(g.call_id)
        if call is None:
            if self.complete:
                raise DivtraceError(f"{self.path / TOKENS}:{g.line}: a token grid of call {g.call_id}, which "
                                    "records.jsonl does not hold")
            self.cut_grids[g.call_id] = g.shape  # written after the records a kill left: not read
            return
        if call.call != g.root_call:
            raise DivtraceError(f"{self.path / TOKENS}:{g.line}: the grid of call {g.call_id} says it is call "
                                f"{g.root_call} of {call.module or '<root>'}, records.jsonl says {call.call}")
        self.grids[g.call_id] = g

    def _summary(self) -> dict | None:
        """meta.json's `tokens` of a complete trace (the counts to check the files against)."""
        if not self.complete:
            return None
        s = self.trace.meta.get("tokens")
        if s is not None and not isinstance(s, dict):
            raise DivtraceError(f"{self.path / 'meta.json'}: field 'tokens' is malformed (edited by hand?)")
        return s

    def _check_counts_of_grids(self, n: int) -> None:
        s = self._summary()
        if not self.complete:
            return
        want = (s or {}).get("grids", 0)
        if want != n:
            raise DivtraceError(f"{self.path / TOKENS}: holds {n} token grids, meta.json says the recording wrote "
                                f"{want}")

    @property
    def bin(self):
        """rows.bin as a numpy uint64 array (numpy is imported on first use: deciding whether to align by tokens
        needs only the grids)."""
        if self._bin is None:
            import numpy as np

            self._bin = np.frombuffer(self._bin_data, dtype="<u8")
        return self._bin

    @property
    def index(self) -> dict[int, tuple[int, str, int]]:
        """vid -> (root call id, layout code, offset in rows.bin or -1)."""
        if self._index is None:
            rows = RowsIndexCheck(self, len(self._bin_data) // 8)
            self._index = rows.read(self._rows_data)
            rows.check_counts(self._summary())
        return self._index

    def check(self) -> None:
        """Read and check everything: the rows, and every key of the grids (see __init__)."""
        if self._unchecked is not None:
            check_grids(*self._unchecked, self.path / TOKENS)
            self._unchecked = None
        self.index

    @property
    def has_tokens(self) -> bool:
        return bool(self.grids)


class RowsIndexCheck:
    """rows.jsonl read and checked line by line against the grids, rows.bin and the trace's values."""

    def __init__(self, tokens: TokenIndex, rows: int) -> None:
        self.tokens, self.rows = tokens, rows
        self.where = tokens.path / ROWS_INDEX
        self.end = 0  # rows accounted for: each line's offset is either here (new rows) or before it (shared)
        self.values = self.shared = 0
        self.whole: dict[str, int] = {}
        self._counts: dict[tuple, int] = {}
        self._fits: dict[tuple, bool] = {}

    def read(self, data: bytes) -> dict:
        lines = data.split(b"\n")
        if lines.pop():
            raise DivtraceError(f"{self.where}:{len(lines) + 1}: corrupt line (cut off: no newline at its end)")
        try:  # one json.loads: 150k lines of a long rollout parse in a third of the time this way
            entries = json.loads(b"[" + b",".join(lines) + b"]") if all(lines) else None
        except (ValueError, RecursionError):
            entries = None
        if entries is None or len(entries) != len(lines):  # (a line holding two entries joins as two)
            entries = []
            for n, d in checks.json_lines(data, self.where):
                entries.append(d)
        index: dict[int, tuple[int, str, int]] = {}
        for n, e in enumerate(entries, 1):
            self._line(n, e, index)
        if self.end != self.rows and self.tokens.complete:
            raise DivtraceError(f"{self.tokens.path / ROWS_BIN}: holds {self.rows} row fingerprints, {ROWS_INDEX} "
                                f"accounts for {self.end}")
        return index

    def _line(self, n: int, e, index: dict) -> None:
        if type(e) is not list or len(e) != 4 or type(e[0]) is not int or type(e[1]) is not int \
                or type(e[3]) is not int:
            raise DivtraceError(f"{self.where}:{n}: not a rows line [value id, call id, layout, offset]")
        vid, cid, code, off = e
        count = self._counts.get((cid, code))  # rows a value of this layout holds in this call (memo: a long
        if count is None:                      # rollout has 150k lines over a few layouts per call)
            count = self._count(n, vid, cid, code)
            if count is None:
                return  # an unverified trace a kill cut: its grid line was torn
        if (off == -1) != (count < 0) or off < -1:
            raise DivtraceError(f"{self.where}:{n}: offset {off} for layout {code!r}")
        if off >= 0:
            if off == self.end:
                self.end += count
                self.values += 1
            elif off + count <= self.end:
                self.shared += 1
            else:
                raise DivtraceError(f"{self.where}:{n}: offset {off} skips rows {self.end}.. (lines must follow the "
                                    "rows as they were written: a line deleted or moved)")
            if off + count > self.rows:
                if self.tokens.complete or self.tokens.verified:
                    raise DivtraceError(f"{self.where}:{n}: rows {off}..{off + count - 1} lie past the end of "
                                        f"{ROWS_BIN} ({self.rows} rows)")
                return  # an unverified trace a kill cut: its rows stop here
        else:
            self.whole[code] = self.whole.get(code, 0) + 1
        g = self.tokens.grids.get(cid)
        if g is None:
            return  # a call a kill left out of the records
        key = self.tokens.trace.vkey.get(vid)
        if key is None:
            if self.tokens.complete:
                raise DivtraceError(f"{self.where}:{n}: value {vid}, which no record of records.jsonl defines")
            return
        if vid in index:
            raise DivtraceError(f"{self.where}:{n}: value {vid} listed twice")
        fits = self._fits.get((cid, code, key[1]))
        if fits is None:
            fits = self._fits[(cid, code, key[1])] = token_layout.fits(code, key[1], g.shape)
        if not fits:
            raise DivtraceError(f"{self.where}:{n}: layout {code!r} does not fit value {vid} of shape {list(key[1])} "
                                f"in a call whose token grid is {g.shape}")
        index[vid] = (cid, code, off)

    def _count(self, n: int, vid: int, cid: int, code) -> int | None:
        """Rows a value of layout `code` holds in call `cid` (-1: compared whole, no rows); None: no grid to say."""
        if not checks.valid_code(code):
            raise DivtraceError(f"{self.where}:{n}: unknown layout {str(code)[:20]!r}")
        g = self.tokens.grids.get(cid)
        grid_shape = g.shape if g is not None else self.tokens.cut_grids.get(cid)
        if grid_shape is None:
            if self.tokens.complete or self.tokens.verified:
                raise DivtraceError(f"{self.where}:{n}: value {vid} of call {cid}, which has no token grid in {TOKENS}")
            return None
        count = self._counts[(cid, code)] = -1 if code in checks.WHOLE_CODES else token_layout.row_count(code, grid_shape)
        return count

    def check_counts(self, summary: dict | None) -> None:
        """A complete trace's meta.json `tokens` counts against the files."""
        if summary is None:
            if self.tokens.complete and (self.end or self.whole):
                raise DivtraceError(f"{self.where}: token rows in a trace whose meta.json has no `tokens` summary")
            return
        got = {"rows": self.rows, "values_with_rows": self.values + self.shared,
               "values_sharing_rows": self.shared, "compared_whole": self.whole}
        for k, v in got.items():
            if k in summary and summary[k] != v:
                raise DivtraceError(f"{self.tokens.path / 'meta.json'}: tokens.{k} is {summary[k]}, the token files "
                                    f"hold {v}"[:300])
