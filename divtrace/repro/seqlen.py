"""A symbolic sequence length in generated repros, so that verify's "another sequence length" sweep can run.

The recorded sequence length T is dim 1 of the batched activation (`[B, T, ...]`). Inputs led by the batch get
`seq_dims`: their dims after the batch whose size is T (`[B, T, H]` -> [1]; `[B, heads, T, d]` -> [2]). In the
sides' code, size arguments equal to T (views, reshapes, expands, a mask built with `full([T, T])`, `arange(T)`)
are written as `S = <input>.shape[d]`. A size that only happens to equal T (T == heads, say) would be wrong at
another length, so the symbolic version is kept only when it reproduces the recorded outputs and both sides run
at another length with outputs whose T-sized dims follow it; otherwise the repro keeps the recorded length and
says why.
"""
from __future__ import annotations


def seq_len(specs: dict, batch: int | None) -> int | None:
    """T from the batched activations `[B, T, ...]`, or None when there is no such input or T cannot be told from
    the batch (T == B) or is 1 (a decode step: nothing to sweep)."""
    if batch is None:
        return None
    for sp in specs.values():
        shape = sp["shape"]
        if sp["role"] == "activation" and sp.get("batch_dim") == 0 and len(shape) >= 3 and shape[0] == batch:
            t = int(shape[1])
            return t if t > 1 and t != batch else None
    return None


def mark(specs: dict, seq: int | None) -> None:
    """`seq_dims` of every input: the dims after the batch whose size is T (null when none, or no T)."""
    for sp in specs.values():
        dims = [d for d in range(1, len(sp["shape"])) if sp["shape"][d] == seq] if (
            seq is not None and sp.get("batch_dim") == 0) else []
        sp["seq_dims"] = dims or None


def seq_input(specs: dict) -> tuple[str, int] | None:
    """(input name, dim) the sides read S from."""
    for name, sp in specs.items():
        if sp.get("seq_dims"):
            return name, sp["seq_dims"][0]
    return None


def other_length(seq: int) -> int:
    """The length verify sweeps to (and the writer checks at): 2T - 1, odd, so no power-of-two tiling hides it."""
    return 2 * seq - 1 if seq > 1 else 2


def runs(ns: dict, specs: dict, seq: int, out_shapes: dict) -> str | None:
    """None when both sides run at another sequence length and their outputs' T-sized dims follow it."""
    new = other_length(seq)
    shapes = {}
    for k, sp in specs.items():
        if sp.get("seq_dims"):
            shape = list(sp["shape"])
            for d in sp["seq_dims"]:
                shape[d] = new
            shapes[k] = shape
    if not shapes:
        return "no input has the sequence length in its shape"
    try:
        x = ns["random_inputs"](0, shapes)
        for s, fn, st in (("a", ns["side_a"], ns["SETTINGS_A"]), ("b", ns["side_b"], ns["SETTINGS_B"])):
            got = list(ns["run_side"](fn, st, x).shape)
            want = [new if n == seq else n for n in out_shapes[s]]
            if got != want:
                return f"side {s} at sequence length {new} gives shape {got}, expected {want}"
    except Exception as e:
        return f"at sequence length {new}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None
