"""Writing the token files beside a trace while recording (their format, and reading them back:
divtrace.trace.token_store).

In: token grids and row fingerprints (token_rows). Out: tokens.jsonl, rows.jsonl, rows.bin. The lines are handed
to the trace writer at each of its flushes (and when a root call ends); it appends them with the records they
describe, under the same checksums (divtrace.trace.side_files). A grid is made before its root call's enter record
and a value's rows before the record that defines it, so the token files are always in step with records.jsonl:
a killed recording leaves the token lines of the records on disk (the grid of a root call it was killed in, too,
and the rows of that call's values written so far), and none of records that are not.
"""
from __future__ import annotations

import json

from divtrace.trace.token_store import ROWS_BIN, ROWS_INDEX, TOKENS

# json.dumps(x, separators=(",", ":")), with the encoder made once (dumps builds one per call when given options)
_COMPACT = json.JSONEncoder(separators=(",", ":")).encode


class TokenStoreWriter:
    def __init__(self, files) -> None:
        self.files = files  # the trace writer's ChecksummedFiles (None: the writer keeps no token files)
        self._tokens: list[str] = []
        self._index: list[str] = []
        self._bin: list[bytes] = []
        self.rows = 0  # rows written to rows.bin (and buffered)
        self.grids = 0
        self.values = 0
        self.unrowed: dict[str, int] = {}  # layout code ("?", "x") -> values compared whole
        self.current: dict[int, tuple[str, int]] = {}  # vid -> (code, offset) of the root call in progress
        self.shared = 0  # values that point at another value's rows (views of it)
        self.rowed: set[int] = set()  # every value given rows (rows.jsonl lists a value once)

    def add_grid(self, grid) -> None:
        for number, first in grid.new_seqs:
            self._tokens.append(_COMPACT({"S": number, "first": first}))
        line = {"c": grid.call_id, "n": grid.root_call, "shape": grid.shape, "kv": grid.kv_len, "src": grid.source,
                "keys": grid.keys, "pos": grid.pos, "ids": grid.ids, "fed": grid.fed, "seq": grid.seq}
        if grid.next_ids is not None:
            line["next"] = grid.next_ids
        self._tokens.append(_COMPACT(line))
        self.grids += 1

    def add_used(self, call_id: int, used) -> None:
        """The position ids the model used in root call `call_id`, one per cell (an integer tensor, 1-D, read from
        inside the call)."""
        self._tokens.append(_COMPACT({"P": call_id, "used": used.tolist()}))

    def add_rows(self, vid: int, call_id: int, code: str, hashes) -> None:
        """`hashes`: a numpy uint64 array, one per token row, or those as little-endian bytes
        (hashing.rows.strided_row_fingerprints); None for a value whose rows cannot be compared."""
        self.rowed.add(vid)
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
        self.rowed.add(vid)
        self.current[vid] = (code, offset)
        self.shared += 1

    def end_call(self) -> None:
        """The root call's records are all handed to the trace writer: its token lines may follow them."""
        self.current.clear()
        self.hand_over()

    def hand_over(self) -> None:
        self.add_parts(self._bin, self._index, self._tokens)

    def add_parts(self, bins: list, index: list, tokens: list) -> None:
        """Hand row bytes, rows.jsonl lines and tokens.jsonl lines to the trace writer's files; each list is
        emptied. (The device path's store calls it from the writer thread with lists of its own.)"""
        files = self.files
        if files is None:
            bins.clear(), index.clear(), tokens.clear()
            return
        if bins:
            files.add(ROWS_BIN, b"".join(bins))
            bins.clear()
        if index:
            files.add(ROWS_INDEX, ("\n".join(index) + "\n").encode())
            index.clear()
        if tokens:
            files.add(TOKENS, ("\n".join(tokens) + "\n").encode())
            tokens.clear()

    def close(self) -> dict:
        """Hand over what is left (the trace writer's close writes it); meta.json's `tokens` summary."""
        self.hand_over()
        from divtrace.trace.hashing import ROW_SCHEME

        return {"row_scheme": ROW_SCHEME, "grids": self.grids, "values_with_rows": self.values + self.shared,
                "values_sharing_rows": self.shared, "rows": self.rows,
                "compared_whole": dict(self.unrowed)}
