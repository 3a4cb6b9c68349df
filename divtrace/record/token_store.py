"""Writing the token files beside a trace while recording (their format, and reading them back:
divtrace.trace.token_store).

In: token grids and row fingerprints (token_rows). Out: tokens.jsonl, rows.jsonl, rows.bin, appended at each root
call's end and at close, bytes before lines.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from divtrace.trace.token_store import ROWS_BIN, ROWS_INDEX, TOKEN_FILES, TOKENS

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
        (hashing.rows.strided_row_fingerprints); None for a value whose rows cannot be compared."""
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
        self.write_parts(self._bin, self._index, self._tokens)

    def write_parts(self, bins: list, index: list, tokens: list) -> None:
        """Append row bytes, then rows.jsonl lines, then tokens.jsonl lines (bytes before the lines that point at
        them); each list is emptied once written. (The device path's store calls it from the writer thread.)"""
        if bins:
            os.write(self._fd(ROWS_BIN), b"".join(bins))
            bins.clear()
        if index:
            os.write(self._fd(ROWS_INDEX), ("\n".join(index) + "\n").encode())
            index.clear()
        if tokens:
            os.write(self._fd(TOKENS), ("\n".join(tokens) + "\n").encode())
            tokens.clear()

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
        from divtrace.trace.hashing import ROW_SCHEME

        return {"row_scheme": ROW_SCHEME, "grids": self.grids, "values_with_rows": self.values + self.shared,
                "values_sharing_rows": self.shared, "rows": self.rows,
                "compared_whole": dict(self.unrowed)}
