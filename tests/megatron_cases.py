"""A Megatron-style hand-sharded MLP (plain tensors, no DTensor, no TP style) for the declared-layout tests: what each
rank runs (spawned: module-level functions) and the model it runs, at TP=1 (one process) or TP=2.

Each rank holds plain `nn.Linear`s: the column-parallel one `ffn/tp` rows of W1 (and of its bias), the row-parallel
one `ffn/tp` columns of W2, and the MLP sums the row-parallel partial sums with an explicit `dist.all_reduce`, as
Megatron's RowParallelLinear does. The weights are the one-process model's, sliced.
"""
from __future__ import annotations

import os

from sharded_cases import capture, unshard_tp

VOCAB, HIDDEN, FFN, LAYERS = 48, 32, 64, 2
IDS = [[1, 5, 9, 3, 7, 2, 11, 4], [8, 6, 2, 14, 3, 9, 1, 12]]
PARAMS = {r"layers\.\d+\.fc1\.(weight|bias)": "S(0)@tp", r"layers\.\d+\.fc2\.weight": "S(1)@tp"}
MODULES = {r"layers\.\d+\.fc1": "S(-1)@tp", r"layers\.\d+\.act": {"input": "S(-1)@tp", "output": "S(-1)@tp"},
           r"layers\.\d+\.fc2": "P@tp", "embed": "R@tp"}


def build(tp: int = 1, rank: int = 0):
    """The model at TP=`tp` (this rank's slices of the one-process model's weights, which a seed fixes)."""
    import torch
    from torch import nn

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(HIDDEN, FFN // tp)  # ColumnParallelLinear: a block of W1's rows
            self.act = nn.GELU()
            self.fc2 = nn.Linear(FFN // tp, HIDDEN, bias=False)  # RowParallelLinear: a block of W2's columns

        def forward(self, x):
            y = self.fc2(self.act(self.fc1(x)))
            if tp > 1:
                import torch.distributed as dist

                dist.all_reduce(y)  # the row-parallel partial sums, summed
            return y

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.layers = nn.ModuleList(MLP() for _ in range(LAYERS))
            self.head = nn.Linear(HIDDEN, VOCAB)

        def forward(self, ids):
            h = self.embed(ids)
            for layer in self.layers:
                h = h + layer(h)
            return self.head(h)

    if tp == 1:
        torch.manual_seed(0)
        return Net().eval()
    one, k = build(1), FFN // tp
    model = Net().eval()
    sd = {}
    for name, t in one.state_dict().items():
        if ".fc1." in name:
            t = t[rank * k:(rank + 1) * k]
        elif ".fc2." in name:
            t = t[:, rank * k:(rank + 1) * k]
        sd[name] = t.clone()
    model.load_state_dict(sd)
    return model


def plant(model, rank_scale: float) -> None:
    """Layer 0's fc1 multiplies its output by `rank_scale` (1.0: the same ops, no change)."""
    mod = model.layers[0].fc1
    orig = mod.forward

    def forward(x):
        return orig(x) * rank_scale
    mod.forward = forward


def unshard(caps):
    """The global values of a TP rank's captures: fc1's output, act's input and output and fc2's input are column
    blocks of the last dim (gathered and concatenated); fc2's output is a partial sum (no global value of its own:
    None); everything else must be the same on every rank."""
    return unshard_tp(caps, is_block=lambda leaf, i: (leaf == "fc1" and i == 1) or leaf == "act"
                      or (leaf == "fc2" and i == 0), is_partial=lambda leaf, i: leaf == "fc2" and i == 1)


def worker(rank, world, root, cases, layouts):
    """Record each case (name, mode, plant) at TP=`world` with the declared `layouts`; rank 0 returns the ground
    truth (unsharded captures of an unrecorded forward) of each case."""
    import torch

    import divtrace

    torch.set_num_threads(1)
    truth = {}
    for name, mode, planted in cases:
        m = build(world, rank)
        if planted:
            plant(m, 1.0 + 2.0 ** -20 if rank == world - 1 else 1.0)
        with torch.no_grad(), divtrace.record(m, os.path.join(root, name), mode=mode, layouts=layouts,
                                              mesh={"tp": None}):
            m(torch.tensor(IDS))
        caps, order = capture(m, IDS)
        g = unshard(caps)
        if rank == 0:
            truth[name] = (g, order)
    return truth if rank == 0 else None


def single(out, mode: str, planted: bool):
    """The one-process run: recorded into `out`; its captures returned."""
    import torch

    import divtrace

    m = build(1)
    if planted:
        plant(m, 1.0)
    with torch.no_grad(), divtrace.record(m, out, mode=mode):
        m(torch.tensor(IDS))
    return capture(m, IDS)


def bad_spec_worker(rank, world, root, specs):
    """Record with each layouts dict of `specs`; the one-line DivtraceError each gives (None: none)."""
    import torch

    import divtrace
    from divtrace.errors import DivtraceError

    torch.set_num_threads(1)
    out = []
    for i, layouts in enumerate(specs):
        m = build(world, rank)
        try:
            with torch.no_grad(), divtrace.record(m, os.path.join(root, str(i)), layouts=layouts,
                                                  mesh={"tp": None}):
                m(torch.tensor(IDS))
            out.append(None)
        except DivtraceError as e:
            out.append(str(e))
    return out
