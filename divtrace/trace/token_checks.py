"""Checking a trace's token files as they are read (divtrace.trace.token_store.TokenIndex): nothing in them is
trusted.

- The bytes: each file against the sha256 the checksums vouch for (meta.json's `file_checksums` once the recording
  closed; else the checkpoint of checksums.jsonl that records.jsonl was read up to, which also cuts back what a
  killed recording wrote after it). Traces written before these checksums are read unverified, with one warning.
- tokens.jsonl: every line whole JSON (an unparseable line is damage, never the end of the file: only a torn last
  line of an unverified incomplete trace is cut back), every grid well formed, grids in call order, and every
  token's key the fold of its sequence's ids (`check_keys`), so an id, position, sequence or key changed on disk is
  seen.
- rows.jsonl: every line `[vid, call id, layout, offset]` of a value of the trace whose shape fits the layout,
  offsets that follow the rows as they were written (`RowsIndexCheck`), all within rows.bin.
- meta.json's `tokens` counts against the files.
A damaged file is a DivtraceError naming the file and the line (or the bytes); an incomplete trace instead has
what its records do not hold cut back (token lines of calls or values a kill left out of records.jsonl).
"""
from __future__ import annotations

import hashlib
import json
import re

from divtrace.errors import DivtraceError
from divtrace.trace.files import CHECKSUMS, META
from divtrace.trace.token_keys import ROOT_KEY, next_keys

SHA_EMPTY = hashlib.sha256(b"").hexdigest()
_LAST = re.compile(r"(last|prev)[1-9][0-9]*\Z")
WHOLE_CODES = ("x", "?")  # layouts compared whole: no rows (offset -1)


def valid_code(code) -> bool:
    return type(code) is str and (code in ("bt", "bht", "n", "1t") or code in WHOLE_CODES or bool(_LAST.match(code)))


# -- the bytes ------------------------------------------------------------------------------------------------------
def read_files(trace, names) -> tuple[dict[str, bytes], dict[str, str], bool]:
    """(name -> the bytes to read, name -> why the file does not match its checksum, verified). Files a checkpoint
    vouches for less of than they hold (a killed recording) are cut back to it."""
    sums = trace.file_sums
    closed = "checksums" in trace.meta
    data, bad = {}, {}
    for name in names:
        p = trace.path / name
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            raw = None
        except OSError as e:
            raise DivtraceError(f"{p}: cannot read: {e.strerror or e}") from None
        if sums is None:
            data[name] = raw or b""
            continue
        size, sha = sums.get(name, (0, SHA_EMPTY))
        whose = META if closed else CHECKSUMS
        if raw is None:
            raw = b""
            if size:
                bad[name] = f"{p}: missing, but the recording wrote {size} bytes to it ({whose})"
        elif closed and len(raw) != size:
            bad[name] = f"{p}: {len(raw)} bytes, but the recording closed it at {size} ({META}; truncated or edited)"
        elif len(raw) < size:
            bad[name] = f"{p}: {len(raw)} bytes, fewer than the {size} that {CHECKSUMS} vouches for (truncated)"
        elif hashlib.sha256(raw[:size]).hexdigest() != sha:
            bad[name] = (f"{p}: contents do not match the sha256 recorded in {whose} (edited or corrupted)"
                         + _first_changed(trace, name, raw))
        data[name] = raw if name in bad else raw[:size]
    return data, bad, sums is not None


def _first_changed(trace, name: str, raw: bytes) -> str:
    """Where the bytes first part from what checksums.jsonl's checkpoints vouch for: ", within bytes A..B"."""
    try:
        lines = (trace.path / CHECKSUMS).read_bytes().split(b"\n")
    except OSError:
        return ""
    before = 0
    for line in lines:
        try:
            size, sha = json.loads(line)["files"][name]
        except (ValueError, KeyError, TypeError, RecursionError):
            continue
        if not (isinstance(size, int) and isinstance(sha, str)) or size <= before:
            continue
        if size > len(raw) or hashlib.sha256(raw[:size]).hexdigest() != sha:
            if name.endswith(".bin"):
                return f", within rows {before // 8}..{(size - 1) // 8} (bytes {before}..{size - 1})"
            return f", within bytes {before}..{size - 1}"
        before = size
    return ""


def cut_torn_line(data: bytes) -> bytes:
    """An unverified incomplete trace: drop a last line with no newline (a kill mid-write)."""
    end = data.rfind(b"\n") + 1
    return data[:end]


# -- tokens.jsonl ---------------------------------------------------------------------------------------------------
def side_file_bytes(trace, name: str) -> bytes:
    """The bytes of side file `name` of `trace` that its checksums vouch for: a damaged file is a DivtraceError; the
    last line of a trace that stopped early is cut where it was torn."""
    data, bad, verified = read_files(trace, (name,))
    if bad:
        raise DivtraceError(f"damaged trace: {bad[name]}")
    data = data[name]
    if not verified and not trace.meta.get("complete"):
        data = cut_torn_line(data)
    return data


def json_lines(data: bytes, where):
    """(line number, parsed object) of each line; a line that is not whole JSON is damage."""
    lines = data.split(b"\n")
    if lines.pop():
        raise DivtraceError(f"{where}:{len(lines) + 1}: corrupt line (cut off: no newline at its end)")
    for n, line in enumerate(lines, 1):
        try:
            yield n, json.loads(line)
        except (ValueError, RecursionError):
            raise DivtraceError(f"{where}:{n}: corrupt line (not JSON)") from None


def int_array(values, where, what: str, unsigned: bool = False):
    """A JSON list of integers as a numpy array (int64, or uint64 for keys); anything else is damage."""
    import numpy as np

    if not isinstance(values, list):
        raise DivtraceError(f"{where}: `{what}` is not a list")
    if not values:
        return np.zeros(0, dtype=np.uint64 if unsigned else np.int64)
    try:
        if set(map(type, values)) == {int}:  # (numpy would take floats and booleans as integers)
            return np.array(values, dtype=np.uint64 if unsigned else np.int64)
    except OverflowError:  # a key below 0 or from 2**64, an id beyond int64
        pass
    raise DivtraceError(f"{where}: `{what}` holds something other than {'unsigned ' if unsigned else ''}64-bit "
                        "integers")


def check_keys(grids, first_ids: dict, where) -> None:
    """Every token's key must be the fold of its sequence's ids at positions 0..p (divtrace.trace.token_keys): its
    sequence's key at p - 1 (the latest written before it) extended by its id. Padding cells (key 0) belong to no
    sequence. Raises naming the grid's line and the cell."""
    if not grids:
        return
    import numpy as np

    arrays = [g.arrays for g in grids]
    keys = np.concatenate([a[0] for a in arrays])
    pos = np.concatenate([a[1] for a in arrays])
    ids = np.concatenate([a[2] for a in arrays])
    seq = np.concatenate([a[3] for a in arrays])
    owner = np.repeat(np.arange(len(grids)), [len(a[0]) for a in arrays])

    def bad(i, why):
        g = grids[owner[i]]
        cell = int(i - np.searchsorted(owner, owner[i]))
        raise DivtraceError(f"{where}:{g.line}: cell {cell} of root call {g.root_call} ({why}): an id, position, "
                            "sequence or key was changed")

    real = keys != 0
    wrong = np.flatnonzero(real != (seq >= 0))
    if len(wrong):
        bad(wrong[0], "a token has a sequence number and a padding cell has none" if real[wrong[0]] else
            "a padding cell (key 0) with a sequence number")
    wrong = np.flatnonzero(real & ((pos < 0) | (pos >= 1 << 31) | (seq >= 1 << 31)))
    if len(wrong):
        bad(wrong[0], f"position {pos[wrong[0]]} of sequence {seq[wrong[0]]}")
    cells = np.flatnonzero(real)
    slot = (seq[cells] << 32) | pos[cells]
    prev = np.full(len(cells), ROOT_KEY, dtype=np.uint64)
    if len(np.unique(slot)) == len(slot):  # each (sequence, position) once: no recompute
        order = np.argsort(slot, kind="stable")
        sorted_slot = slot[order]
        later = pos[cells] > 0
        at = np.searchsorted(sorted_slot, slot[later] - 1)
        found = (at < len(sorted_slot)) & (sorted_slot[np.minimum(at, len(sorted_slot) - 1)] == slot[later] - 1)
        j = order[np.minimum(at, len(order) - 1)]
        missing = np.flatnonzero(~found | (j >= np.flatnonzero(later)))
        if len(missing):
            i = cells[np.flatnonzero(later)[missing[0]]]
            bad(i, f"sequence {seq[i]} has no token at position {pos[i] - 1} before position {pos[i]}")
        prev[later] = keys[cells[j]]
    else:  # a position written again (an engine's recompute): the latest key before each cell, in order
        latest: dict[int, int] = {}
        for k, (c, s) in enumerate(zip(cells.tolist(), slot.tolist())):
            if pos[c] > 0:
                p = latest.get(s - 1)
                if p is None:
                    bad(c, f"sequence {seq[c]} has no token at position {pos[c] - 1} before position {pos[c]}")
                prev[k] = p
            latest[s] = int(keys[c])
    want = next_keys(prev, ids[cells])
    wrong = np.flatnonzero(want != keys[cells])
    if len(wrong):
        i = cells[wrong[0]]
        bad(i, f"sequence {seq[i]}, position {pos[i]}, id {ids[i]}: its key is not the fold of its sequence's ids")
    uniq, first = np.unique(slot, return_index=True)  # each (sequence, position): its first cell
    _check_first_ids(grids, first_ids, where, dict(zip(uniq.tolist(), cells[first].tolist())), seq, ids, owner)


def _check_first_ids(grids, first_ids: dict, where, first_cell: dict, seq, ids, owner) -> None:
    """Every sequence a token names was started by a `{"S", "first"}` line no later than its first grid, and that
    line's ids are its first ids."""
    import numpy as np

    used, at = np.unique(seq[seq >= 0], return_index=True)
    at = np.flatnonzero(seq >= 0)[at]
    for s, c in zip(used.tolist(), at.tolist()):
        start = first_ids.get(s)
        line = grids[owner[c]].line
        if start is None or start[1] > line:
            raise DivtraceError(f"{where}:{line}: sequence {s} is used before a line starts it")
    for s, (first, line) in first_ids.items():
        for p, want in enumerate(first):
            c = first_cell.get((s << 32) | p)
            if c is None or ids[c] != want:
                raise DivtraceError(f"{where}:{line}: the first ids of sequence {s} are not the ids its tokens hold")
