"""Damage done to a trace's token files, one way at a time (for tests/test_token_faults.py).

Each mutation takes a copy of a complete trace and changes one token file the way a bad disk, a bad copy or a hand
edit would: cut it (to nothing, to half, by one byte), flip bits, swap, zero, duplicate or delete a line or a row,
or change what a line says (an id, a key, a position, a sequence, a layout code, an offset). The random choices
are drawn from a seeded generator, so every run makes the same changes.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

TOKENS, ROWS_INDEX, ROWS_BIN = "tokens.jsonl", "rows.jsonl", "rows.bin"


def _lines(p: Path) -> list[bytes]:
    return p.read_bytes().split(b"\n")[:-1]


def _write_lines(p: Path, lines: list[bytes]) -> None:
    p.write_bytes(b"".join(x + b"\n" for x in lines))


def _grid_lines(lines: list[bytes]) -> list[int]:
    return [i for i, x in enumerate(lines) if x.startswith(b'{"c"')]


def _edit_grid(p: Path, rng: random.Random, field: str, change) -> None:
    """Change one real token's `field` in one grid line (a cell with a key, so the change is one the reader can see
    only by checking what the key folds)."""
    lines = _lines(p)
    i = rng.choice(_grid_lines(lines))
    d = json.loads(lines[i])
    cells = [c for c, k in enumerate(d["keys"]) if k]
    c = rng.choice(cells)
    d[field][c] = change(d[field][c])
    lines[i] = json.dumps(d, separators=(",", ":")).encode()
    _write_lines(p, lines)


def _edit_rows_line(p: Path, rng: random.Random, change) -> None:
    lines = _lines(p)
    cands = [i for i, x in enumerate(lines) if change(json.loads(x)) is not None]
    i = rng.choice(cands)
    lines[i] = json.dumps(change(json.loads(lines[i])), separators=(",", ":")).encode()
    _write_lines(p, lines)


def truncate(frac):
    def f(p: Path, rng) -> None:
        data = p.read_bytes()
        p.write_bytes(data[:int(len(data) * frac)])
    return f


def truncate_one(p: Path, rng) -> None:
    p.write_bytes(p.read_bytes()[:-1])


def flip_bit(p: Path, rng) -> None:
    data = bytearray(p.read_bytes())
    i = rng.randrange(len(data))
    data[i] ^= 1 << rng.randrange(8)
    p.write_bytes(bytes(data))


def delete_file(p: Path, rng) -> None:
    p.unlink()


# -- lines (tokens.jsonl, rows.jsonl) -------------------------------------------------------------------------------
def swap_lines(p: Path, rng) -> None:
    lines = _lines(p)
    i = rng.randrange(len(lines) - 1)
    j = next(j for j in range(i + 1, len(lines)) if lines[j] != lines[i])
    lines[i], lines[j] = lines[j], lines[i]
    _write_lines(p, lines)


def zero_line(p: Path, rng) -> None:
    lines = _lines(p)
    i = rng.randrange(len(lines))
    lines[i] = bytes(len(lines[i]))
    _write_lines(p, lines)


def duplicate_line(p: Path, rng) -> None:
    lines = _lines(p)
    i = rng.randrange(len(lines))
    lines.insert(i, lines[i])
    _write_lines(p, lines)


def delete_line(p: Path, rng) -> None:
    lines = _lines(p)
    del lines[rng.randrange(len(lines))]
    _write_lines(p, lines)


def delete_last_line(p: Path, rng) -> None:
    _write_lines(p, _lines(p)[:-1])


def change_id(p: Path, rng) -> None:
    _edit_grid(p, rng, "ids", lambda v: v + 1)


def change_key(p: Path, rng) -> None:
    _edit_grid(p, rng, "keys", lambda v: v ^ 1)


def change_pos(p: Path, rng) -> None:
    _edit_grid(p, rng, "pos", lambda v: v + 1)


def change_seq(p: Path, rng) -> None:
    _edit_grid(p, rng, "seq", lambda v: 1 - v if v in (0, 1) else 0)


def change_layout(p: Path, rng) -> None:
    _edit_rows_line(p, rng, lambda e: [e[0], e[1], "n", e[3]] if e[2] == "bt" else None)


def change_offset(p: Path, rng) -> None:
    _edit_rows_line(p, rng, lambda e: [e[0], e[1], e[2], e[3] + 1] if e[3] >= 0 else None)


# -- rows (rows.bin) ------------------------------------------------------------------------------------------------
def _rows(p: Path) -> list[bytes]:
    data = p.read_bytes()
    return [data[i:i + 8] for i in range(0, len(data), 8)]


def swap_rows(p: Path, rng) -> None:
    rows = _rows(p)
    i = rng.randrange(len(rows) - 1)
    j = next(j for j in range(i + 1, len(rows)) if rows[j] != rows[i])
    rows[i], rows[j] = rows[j], rows[i]
    p.write_bytes(b"".join(rows))


def zero_row(p: Path, rng) -> None:
    rows = _rows(p)
    i = rng.choice([i for i, r in enumerate(rows) if r != bytes(8)])
    rows[i] = bytes(8)
    p.write_bytes(b"".join(rows))


def duplicate_row(p: Path, rng) -> None:
    rows = _rows(p)
    i = rng.randrange(len(rows))
    rows.insert(i, rows[i])
    p.write_bytes(b"".join(rows))


def delete_row(p: Path, rng) -> None:
    rows = _rows(p)
    del rows[rng.randrange(len(rows))]
    p.write_bytes(b"".join(rows))


COMMON = {"truncate to 0": truncate(0), "truncate to half": truncate(0.5), "truncate by one byte": truncate_one,
          "bit flip": flip_bit, "deleted": delete_file}
LINES = {"swapped lines": swap_lines, "zeroed line": zero_line, "duplicated line": duplicate_line,
         "deleted line": delete_line, "deleted last line": delete_last_line}
MUTATIONS = {
    TOKENS: {**COMMON, **LINES, "changed id": change_id, "changed key": change_key, "changed position": change_pos,
             "changed sequence": change_seq},
    ROWS_INDEX: {**COMMON, **LINES, "layout code bt -> n": change_layout, "changed offset": change_offset},
    ROWS_BIN: {**COMMON, "swapped rows": swap_rows, "zeroed row": zero_row, "duplicated row": duplicate_row,
               "deleted row": delete_row},
}
