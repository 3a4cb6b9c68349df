"""Ground truth inside the expert-parallel MoE layer of tests/moe_cases.py, for tests/test_sharded_routed_ops.py: which
op on which rank computed the planted rows, and which order of summing a token's slots reproduces each side's
combine. Taken with plain torch (a TorchDispatchMode logging the experts' ops, forward hooks on the combine), on an
unrecorded forward after the recorded one.
"""
from __future__ import annotations

import os

from moe_cases import LAYOUTS, build, capture, inputs


def _op_log(model):
    """A forward pre-hook and hook pair on the experts that log each aten op they run: (op name, for each input
    the position of the logged op that made it or None)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    import torch

    log, made, keep = [], {}, []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = [made.get(id(a)) for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    made[id(o)] = len(log)
                    keep.append(o)  # (held, so no id is reused while the log runs)
            log.append((str(func), ins))
            return out

    mode = Log()

    def enter(m, args):
        mode.__enter__()

    def leave(m, args, out):
        mode.__exit__(None, None, None)

    hs = [model.moe.experts.register_forward_pre_hook(enter), model.moe.experts.register_forward_hook(leave)]
    return log, hs


def truth(model, world: int) -> dict:
    """The experts' op log, the combine's routing weights per token and the plain hooks' captures (moe_cases)."""
    log, hs = _op_log(model)
    w = {}

    def weights_hook(m, args, out):
        lo = int(m.routing[:, 0].min()) if m.routing.numel() else 0
        for i, row in enumerate(args[1]):
            w[lo + i] = row.clone()

    hs.append(model.moe.combine.register_forward_hook(weights_hook))
    try:
        got = capture(model)
    finally:
        for h in hs:
            h.remove()
    got["ops"], got["weights"], got["world"] = log, w, world
    return got


def worker(rank, world, root, cases):
    """Record each case (name, mode, plant) at EP=`world` into root/name (moe_cases.worker); return each case's
    ground truth, taken on a model built again (the same seeded weights)."""
    import moe_cases

    moe_cases.worker(rank, world, root, cases)
    return {name: truth(build(world, rank, plant), world) for name, _, plant in cases}


def merge(per_rank, skip=("ops",)):
    """Every rank's captures of one case, keyed globally (by (token, slot) or token); the keys in `skip` left out."""
    out = {}
    for caps in per_rank:
        for k, v in caps.items():
            if isinstance(v, dict):
                out.setdefault(k, {}).update(v)
            elif k not in skip:
                out[k] = v
    return out


def planted_op(log: list, consumes: str) -> int | None:
    """The position in an experts op log of the last aten.mul.Tensor whose input 0 an op named `consumes` made (the
    activation times `up`): the mul of the last expert's SwiGLU."""
    hits = [j for j, (name, ins) in enumerate(log)
            if name == "aten.mul.Tensor" and ins and ins[0] is not None and log[ins[0]][0] == consumes]
    return hits[-1] if hits else None


def combine_in_order(back: dict, weights: dict, token: int, order: list):
    """A token's combine summed slot after slot in `order`: w[s] * row(token, s), in the recorded dtype."""
    s0 = order[0]
    y = weights[token][s0:s0 + 1] * back[(token, s0)]
    for s in order[1:]:
        y = y + weights[token][s:s + 1] * back[(token, s)]
    return y


def flipped(model):
    """The experts computing each expert's rows in reverse order (flipped, computed, flipped back): the same
    values, by ops (aten.flip) whose rows divtrace does not follow."""
    import torch

    inner = model.moe.experts.forward

    def forward(rows, counts):
        def per_expert(x):
            out, start = [], 0
            for c in counts:
                out.append(x[start:start + c].flip(0))
                start += c
            return torch.cat(out)

        return per_expert(inner(per_expert(rows), counts))

    model.moe.experts.forward = forward
    return model


def flipped_worker(rank, world, root, cases):
    """Record each case at EP=`world` with the experts flipped (see `flipped`)."""
    import torch

    import divtrace

    torch.set_num_threads(1)
    for name, mode, plant in cases:
        m = flipped(build(world, rank, plant))
        with torch.no_grad(), divtrace.record(m, os.path.join(root, name), mode=mode, layouts=LAYOUTS, mesh={"ep": None}):
            m(inputs())


def split_worker(rank, world, root, cases):
    """As `worker`, with the experts taking their rows by `rows.split(counts)` (moe_cases.build(split=True))."""
    from moe_cases import record_cases

    record_cases(root, cases, lambda plant: build(world, rank, plant, split=True), inputs, LAYOUTS, lambda m: None)
    return {name: truth(build(world, rank, plant, split=True), world) for name, _, plant in cases}
