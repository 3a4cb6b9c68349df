"""One difference planted in an HF Llama at TP=2 (HF's TP plan), against the same model in one process whose
row-parallel Linears (o_proj, down_proj) sum two partial matmuls as the ranks' all-reduce does: without the plant
the two runs are bitwise equal (checked with hooks), so the plant is the only difference and its ground truth is
plain. The plant scales one token's row of one Linear's output on one rank (in its column block), with recorded
ops (`where` of a `mul`); the other ranks and the one-process run do the same ops with the scale 1.

Ranks are spawned (module-level functions). Ground truth: every module's input and output, captured with plain
hooks in an unrecorded forward and put together into global values (tests/sharded_cases.py).
"""
from __future__ import annotations

import os

from sharded_cases import IDS, bits_equal, capture, unshard_tp

# name: (module path, the TP=2 rank whose block is scaled, token position in sequence 0, scale)
PLANTS = {
    "none": None,
    "up5": ("model.layers.0.mlp.up_proj", 1, 5, 1 + 2 ** -10),
    "k2": ("model.layers.0.self_attn.k_proj", 1, 2, 1 + 2 ** -5),  # (bf16: a step of a few ulps)
    "ow0": ("weight", "model.layers.0.self_attn.o_proj", 0),  # rank 0's block of the row-parallel weight, row 3
}


def plant_row(mod, pos: int, scale: float, seq: int = 0) -> None:
    import torch

    orig = mod.forward

    def forward(x, *a, **k):
        y = orig(x, *a, **k)
        pick = (torch.arange(y.shape[0]).view(-1, 1, 1) == seq) & (torch.arange(y.shape[1]).view(1, -1, 1) == pos)
        return torch.where(pick, y * scale, y)
    mod.forward = forward


def sum_partials(m, world: int = 2) -> None:
    """o_proj and down_proj as `world` partial matmuls over blocks of the input's last dim, summed in rank order:
    the bytes the TP ranks' all-reduce gives (gloo, 2 ranks: one addition)."""
    import torch

    for path, mod in m.named_modules():
        if path.rsplit(".", 1)[-1] in ("o_proj", "down_proj"):
            def forward(x, mod=mod):
                h = mod.weight.shape[1] // world
                parts = [torch.nn.functional.linear(x[..., i * h:(i + 1) * h].contiguous(),
                                                    mod.weight[:, i * h:(i + 1) * h].contiguous())
                         for i in range(world)]
                out = parts[0]
                for p in parts[1:]:
                    out = out + p
                return out
            mod.forward = forward


def _plant(m, name: str, rank: int) -> None:
    import torch

    p = PLANTS[name]
    if p is not None and p[0] == "weight":
        if rank == p[2]:  # (the one-process run keeps the weight)
            w = m.get_submodule(p[1]).weight
            w = w.to_local() if hasattr(w, "to_local") else w
            with torch.no_grad():
                w[3] = w[3] * (1 + 2 ** -6)
    elif p is not None:
        path, on, pos, scale = p
        plant_row(m.get_submodule(path), pos, scale if rank == on else 1.0)


def tp_worker(rank, world, model_dir, root, cases):
    """Record each case (run name, plant name, mode, dtype name) at TP=`world`; rank 0 returns each (plant, dtype)'s
    global captures."""
    import torch

    import divtrace
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    truth = {}
    for name, plant, mode, dtype in cases:
        m = LlamaForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=getattr(torch, dtype)).eval()
        _plant(m, plant, rank)
        with torch.no_grad(), divtrace.record(m, os.path.join(root, name), mode=mode):
            m(torch.tensor(IDS))
        g = unshard_tp(capture(m, IDS)[0])
        if rank == 0:
            truth[plant, dtype] = {k: tuple(None if t is None else t.clone() for t in v) for k, v in g.items()}
    return truth if rank == 0 else None


def single(model_dir, out, plant: str, mode: str, dtype: str = "float32"):
    """The one-process run (partial sums summed as the ranks do), recorded into `out`; its captures returned."""
    import torch

    import divtrace
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    sum_partials(m)
    _plant(m, plant, -1)
    with torch.no_grad(), divtrace.record(m, out, mode=mode):
        m(torch.tensor(IDS))
    return capture(m, IDS)


def differing_rows(a, b) -> list:
    """(sequence, position) of each token row of [B, T, ...] values a and b that differs bitwise."""
    return [(s, p) for s in range(a.shape[0]) for p in range(a.shape[1])
            if not bits_equal(a[s, p].reshape(-1), b[s, p].reshape(-1))]
