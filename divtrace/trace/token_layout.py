"""Which dims of a tensor are token rows, inferred from its shape and the root call's token grid.

Layouts (codes stored in rows.jsonl):
- "bt":  [B, T, ...]      row (b, t) is x[b, t]            (hidden states, logits, input ids)
- "bht": [B, H, T, ...]   row (b, t) is x[b, :, t]         (heads-first attention tensors)
- "n":   [B*T, ...]       row i is x[i], cells row-major    (flattened tokens: engines, a linear's 2-D input)
- "lastK": [B, K, ...] with K < T, root outputs only: the last K cells of each row (HF's `logits_to_keep`)
- "prevK": [B, K] with K < T, root outputs only: one value per cell for the K cells before each row's last one: a
           per-token log-probability output (TRL's `[B, T-1]` logps, or the completion's K): the value at cell
           (b, t) is the logprob of the token that follows it, so it is keyed by the cell that predicts
- "1t":  [1, T, ...]      row (b, t) is x[0, t]            (a value broadcast over the batch: HF's position ids and
           cos/sin when the caller passed no position ids)

A shape that fits two layouts with different rows (B, H, T with H == T) is ambiguous here; at record time the op
that made it may still say which (divtrace/record/token_provenance.py), else it gets no rows and is compared whole.
A heads-first tensor whose last dim is the call's key/value length (attention scores, a 4-D mask) holds one token's
view of the others, not its own data: it gets no rows either (`cross`), since a decode step and a full-sequence
forward lay those columns out differently by design.
"""
from __future__ import annotations

AMBIGUOUS = "?"
CROSS = "x"


def infer(shape, grid_shape: list[int], kv_len: int, root_output: bool = False, floating: bool = True) -> str | None:
    """The layout code of a tensor of `shape` in a call with token grid `grid_shape`; None when it holds no token
    rows, AMBIGUOUS or CROSS when it has some but they cannot be compared row by row."""
    nd = len(shape)
    if nd == 0:
        return None
    if len(grid_shape) == 1:
        return "n" if shape[0] == grid_shape[0] else None
    b, t = grid_shape
    bt = nd >= 2 and shape[0] == b and shape[1] == t
    bht = nd >= 3 and shape[0] == b and shape[2] == t and shape[1] != t
    n = shape[0] == b * t and not (nd >= 2 and shape[0] == b and shape[1] == t)
    if bt and nd >= 3 and shape[2] == t and t > 1:
        return AMBIGUOUS  # [B, T, T, ...] or [B, H, T, ...] with H == T
    if (bt or bht) and nd >= 4 and kv_len > 1 and shape[-1] == kv_len:
        return CROSS  # [B, H, T, kv] scores, [B, 1, T, kv] masks (in a decode step [B, 1, 1, kv] fits "bt" too)
    if floating and b > 1 and 2 <= nd <= 3 and shape[0] == 1 and shape[1] == t and not (t == 1 and nd == 2):
        # one row per column, the same for every batch row: cos/sin of positions [1, T]. Not integer ones: an
        # arange over the padded length (cache positions) numbers slots, not tokens, and differs by construction
        # between padding sides (the positions a model uses are compared as positions instead)
        return "1t"
    found = [c for c, ok in (("bt", bt), ("bht", bht), ("n", n)) if ok]
    if len(found) > 1 and t == 1 and found[-1] == "n":
        found.pop()  # with T == 1, x[b] holds the same bytes as x[b, 0] or x[b, :, 0]: the T dim decides
    if len(found) > 1:
        return AMBIGUOUS
    if found:
        return found[0]
    if root_output and nd >= 3 and shape[0] == b and 0 < shape[1] < t:
        return f"last{shape[1]}"
    if root_output and nd == 2 and shape[0] == b and 0 < shape[1] < t:
        return f"prev{shape[1]}"
    return None


def row_count(code: str, grid_shape: list[int]) -> int:
    """How many rows a value of this layout stores."""
    if code.startswith("last") or code.startswith("prev"):
        return grid_shape[0] * int(code[4:])
    if code == "1t":
        return grid_shape[1]
    n = 1
    for s in grid_shape:
        n *= s
    return n


def cell_row(code: str, grid_shape: list[int], cell: int) -> int | None:
    """The stored row holding grid cell `cell` (row-major), or None where the layout does not hold it."""
    if code.startswith("last"):
        k = int(code[4:])
        t = grid_shape[1]
        b, c = divmod(cell, t)
        return b * k + (c - (t - k)) if c >= t - k else None
    if code.startswith("prev"):  # the K cells before the last of each row
        k = int(code[4:])
        t = grid_shape[1]
        b, c = divmod(cell, t)
        return b * k + (c - (t - 1 - k)) if t - 1 - k <= c < t - 1 else None
    if code == "1t":
        return cell % grid_shape[1]
    return cell


def rows_2d(x, code: str):
    """The token rows of `x` as a 2-D tensor [rows, elements], in stored order (a copy only for "bht")."""
    if code == "bht":
        x = x.transpose(1, 2)
        return x.reshape(x.shape[0] * x.shape[1], -1)
    if code in ("bt", "1t") or code.startswith("last") or code.startswith("prev"):
        return x.reshape(x.shape[0] * x.shape[1], -1)
    return x.reshape(x.shape[0], -1)


def row_of(x, code: str, grid_shape: list[int], cell: int):
    """The sub-tensor of `x` that is grid cell `cell`'s row (for value metrics), or None."""
    r = cell_row(code, grid_shape, cell)
    if r is None:
        return None
    if code == "n":
        return x[r]
    if code == "1t":
        return x[0, r]
    if code.startswith("last") or code.startswith("prev"):
        k = int(code[4:])
        return x[r // k, r % k]
    t = grid_shape[1]
    b, c = divmod(r, t)
    return x[b, c] if code == "bt" else x[b, :, c]


def row_index(code: str, grid_shape: list[int], cell: int) -> list | None:
    """The index of grid cell `cell`'s row in a tensor of this layout, as a list (":" for a whole dim): what
    `row_of` selects, written so a generated repro can select it too."""
    r = cell_row(code, grid_shape, cell)
    if r is None:
        return None
    if code == "n":
        return [r]
    if code == "1t":
        return [0, r]
    if code.startswith("last") or code.startswith("prev"):
        k = int(code[4:])
        return [r // k, r % k]
    b, c = divmod(r, grid_shape[1])
    return [b, c] if code == "bt" else [b, ":", c]


ROW_MAJOR = ("bt", "n")  # layouts whose rows are consecutive chunks of the tensor's row-major bytes, cell by cell


def same_rows(src_code: str, code: str, src, t, grid_shape: list[int]) -> bool:
    """Whether view `t` of `src` (the same storage) holds, cell by cell, the same row bytes as `src` does, so its
    row fingerprints are `src`'s: two row-major layouts of contiguous tensors with as many rows (a reshape), or the
    [B, T, H, d] <-> [B, H, T, d] transpose (dims 1 and 2 swapped, the same strides otherwise)."""
    if row_count(src_code, grid_shape) != row_count(code, grid_shape) or src.storage_offset() != t.storage_offset():
        return False
    if src_code in ROW_MAJOR and code in ROW_MAJOR:
        return src.is_contiguous() and t.is_contiguous()
    if {src_code, code} == {"bt", "bht"} and src.dim() == t.dim() >= 3:
        ss, st = list(src.stride()), list(t.stride())
        sh, th = list(src.shape), list(t.shape)
        ss[1], ss[2], sh[1], sh[2] = ss[2], ss[1], sh[2], sh[1]
        return ss == st and sh == th
    return False


def row_len(shape, code: str) -> tuple:
    """(elements,) of one row: rows are compared as their bytes in row-major order, so an engine's flat [H*d] row
    of q meets a trainer's heads-first [H, d] row of the same token (the fingerprint depends on the bytes alone)."""
    n = 1
    for s in row_shape(shape, code):
        n *= s
    return (n,)


def row_shape(shape, code: str) -> tuple:
    """The shape of one row of a tensor of `shape` laid out as `code`."""
    if code == "n":
        return tuple(shape[1:])
    if code == "bht":
        return (shape[1],) + tuple(shape[3:])
    return tuple(shape[2:])


OVERRIDE_CODES = ("bt", "bht", "n", "none")


def compile_overrides(spec) -> list:
    """`token_layouts={regex: code}` of `divtrace.record` as [(compiled regex, code)]; a one-line error otherwise."""
    import re

    from divtrace.errors import DivtraceError

    if not spec:
        return []
    if not isinstance(spec, dict):
        raise DivtraceError(f"token_layouts must map module path regexes to one of {OVERRIDE_CODES}, got "
                            f"{type(spec).__name__}")
    out = []
    for pat, code in spec.items():
        if code not in OVERRIDE_CODES:
            raise DivtraceError(f"token_layouts[{pat!r}]: {code!r} is not a layout; use one of {OVERRIDE_CODES}")
        try:
            out.append((re.compile(pat), code))
        except re.error as e:
            raise DivtraceError(f"token_layouts: bad regex {pat!r}: {e}") from None
    return out


def override(rules: list, path: str, shape, grid_shape: list[int], inferred: str | None) -> str | None:
    """The layout a `token_layouts` rule gives a value of module `path`: the rule's where the shape fits it; none
    where neither the rule nor the inference finds token rows; an error where the inference finds token rows the
    rule cannot describe (the override does not fit the call)."""
    for pat, code in rules:
        if pat.search(path):
            if code == "none":
                return None
            fits = {"bt": len(grid_shape) == 2 and len(shape) >= 2 and list(shape[:2]) == list(grid_shape),
                    "bht": len(grid_shape) == 2 and len(shape) >= 3 and shape[0] == grid_shape[0]
                    and shape[2] == grid_shape[1],
                    "n": len(shape) >= 1 and shape[0] == row_count("n", grid_shape)}[code]
            if fits:
                return code
            if inferred is None:
                return None  # no token rows at all (a weight's view made inside the module): nothing to override
            if not fits:
                from divtrace.errors import DivtraceError

                raise DivtraceError(f"token_layouts[{pat.pattern!r}] = {code!r} does not fit a tensor of shape "
                                    f"{list(shape)} in module {path or '<root>'!r}: the call's token grid is "
                                    f"{list(grid_shape)}")
            return code
    return inferred


def fits(code: str, shape, grid_shape) -> bool:
    """Whether a value of `shape` can hold token rows laid out as `code` in a call with token grid `grid_shape`
    (what a reader checks rows.jsonl's layouts against)."""
    shape, grid_shape = list(shape), list(grid_shape)
    nd = len(shape)
    if code in (AMBIGUOUS, CROSS):
        return nd >= 1
    if code == "n":
        return nd >= 1 and shape[0] == row_count("n", grid_shape)
    if len(grid_shape) != 2:
        return False
    b, t = grid_shape
    if code == "bt":
        return nd >= 2 and shape[:2] == [b, t]
    if code == "bht":
        return nd >= 3 and shape[0] == b and shape[2] == t
    if code.startswith("last"):
        return nd >= 2 and shape[0] == b and shape[1] == int(code[4:]) < t
    if code.startswith("prev"):
        return nd == 2 and shape[0] == b and shape[1] == int(code[4:]) < t
    if code == "1t":
        return nd >= 2 and shape[0] == 1 and shape[1] == t
    return False
