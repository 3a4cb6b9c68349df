"""A sharded value's bytes put together from its ranks' blocks (full mode), checked against its global key."""
from __future__ import annotations

from divtrace.errors import DivtraceError


def assemble(run, vp, where: str):
    """The global tensor of a value planned as blocks (plan.ValuePlan): each distinct block, loaded from its
    rank's trace (checked there against its own fingerprint), written at its offsets; the whole checked against
    the sum of the blocks' partial fingerprints."""
    import torch

    from divtrace.trace.hashing.tensor import tensor_fingerprint, to_hex

    pieces = [(off, run.traces[r].tensor(q)) for r, q, off in vp.blocks]
    out = torch.empty(vp.gshape, dtype=pieces[0][1].dtype)
    for off, x in pieces:
        if vp.routed:  # routed rows: each row at its global row (token * top_k + slot)
            out[list(off)] = x
            continue
        out[tuple(slice(o, o + n) for o, n in zip(off, x.shape))] = x
    got = to_hex(tensor_fingerprint(out))
    want = (vp.real or vp.key)[2]  # (a derived view's blocks: their bytes' key is `real`)
    if got != want:
        raise DivtraceError(f"{where}: the blocks put together do not give the recorded global fingerprint "
                            f"({got} vs {want}): a rank's layouts do not match its bytes")
    return out
