"""Expert parallelism (MoE) against one rank, bitwise: a Mixtral-style MoE whose experts run over 2 ranks.

    python examples/moe_ep.py full                          # EP=1: all 8 experts on one rank   -> runs/ep1
    torchrun --nproc-per-node 2 examples/moe_ep.py full     # EP=2: 4 experts on each rank      -> runs/ep2
    divtrace bisect runs/ep2 runs/ep1                       # identical
    torchrun --nproc-per-node 2 examples/moe_ep.py full --plant weight --out runs/ep2-weight
    divtrace bisect runs/ep2-weight runs/ep1                # exit 1: the experts, their (token, slot) rows, the op

(from the repository root, with divtrace installed: `bash scripts/setup.sh`, then `. .venv/bin/activate`;
tests/test_example_moe_ep.py runs these commands.)

MODE (full or hash) is record's mode. Two MoE layers (sizes from HF's MixtralConfig, random weights fixed by a
seed): router Linear, softmax in fp32, top-2 of 8, weights renormalized; SwiGLU experts. Each rank takes its share
of the tokens, sends each (token, slot) row to the rank of its expert by `dist.all_to_all_single`, runs its experts
on the rows it got, sends them back, and sums each token's slots; an all_gather gives every rank all tokens.
The one-rank run is the same code on a process group of one. `--plant weight`: rank 1's copy of expert 7's
down-projection is stale (a weight sync that missed it). Recording is two things (README "Expert parallelism (MoE)", docs/sharded.md
"Routed rows"): the routed rows' module sides declared `T@ep`, and `divtrace.routed(...)` where the rows arrive.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import MixtralConfig

import divtrace

CFG = MixtralConfig(hidden_size=32, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                    num_hidden_layers=2)
TOKENS = 16
# The module sides that hold routed rows (T: rows in routing order, @ep: over the group "ep"). The combine's
# output is each rank's tokens, a block of dim 0 of all tokens.
LAYOUTS = {r"layers\.\d+\.experts": {"input": "T@ep", "output": "T@ep"},
           r"layers\.\d+\.combine": {"input": "T@ep", "output": "S(0)@ep"}}


class Experts(nn.Module):
    """This rank's experts (SwiGLU), each run on its rows: `rows` grouped by expert, `counts` rows each."""

    def __init__(self, w1, w3, w2, first):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Parameter(w1), nn.Parameter(w3), nn.Parameter(w2)  # [experts here, ...]
        self.first = first

    def forward(self, rows, counts):
        outs = []
        for e, x in enumerate(rows.split(counts)):  # each expert's rows (bisect follows a row through the split)
            gate, up = F.linear(x, self.w1[e]), F.linear(x, self.w3[e])
            outs.append(F.linear(F.silu(gate) * up, self.w2[e]))
        return torch.cat(outs)


class Combine(nn.Module):
    """Each token's top-k rows, weighted by the router and summed in slot order. pos[t, s]: the row of (t, s)."""

    def forward(self, rows, weights, pos):
        y = weights[:, 0:1] * rows[pos[:, 0]]
        for s in range(1, pos.shape[1]):
            y = y + weights[:, s:s + 1] * rows[pos[:, s]]
        return y


class MoELayer(nn.Module):
    def __init__(self, layer, rank, world, plant):
        super().__init__()
        E, H, FF = CFG.num_local_experts, CFG.hidden_size, CFG.intermediate_size
        g = torch.Generator().manual_seed(layer)  # the same weights on every rank and at every EP size
        self.gate = nn.Linear(H, E, bias=False)
        self.gate.weight.data = torch.randn(E, H, generator=g) * 0.5
        w1, w3, w2 = (torch.randn(E, FF, H, generator=g) * 0.3, torch.randn(E, FF, H, generator=g) * 0.3,
                      torch.randn(E, H, FF, generator=g) * 0.3)
        n = E // world  # experts per rank: rank r holds experts r*n .. r*n+n-1
        mine = slice(rank * n, rank * n + n)
        if plant == "weight" and rank == world - 1:  # the plant: this rank's copy of expert 7's down-projection is
            w2[E - 1] = w2[E - 1] * (1 + 2 ** -20)    # stale (a weight sync that missed it), by about 1e-6
        self.experts = Experts(w1[mine].clone(), w3[mine].clone(), w2[mine].clone(), rank * n)
        self.combine = Combine()
        self.rank, self.world, self.n = rank, world, n

    def forward(self, x):  # x: all N tokens, on every rank
        N, k, E = x.shape[0], CFG.num_experts_per_tok, CFG.num_local_experts
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        w, ids = torch.topk(probs, k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        per = N // self.world  # this rank's tokens: lo .. lo+per-1
        lo = self.rank * per
        ids, w = ids[lo:lo + per], w[lo:lo + per]
        flat = ids.reshape(-1)  # one row per (token, slot): row i is token lo + i // k, slot i % k
        order = torch.argsort(flat, stable=True)  # rows by expert, so by the rank that holds it
        send = x[lo:lo + per].repeat_interleave(k, dim=0)[order]
        meta = torch.stack([lo + torch.arange(per * k) // k, torch.arange(per * k) % k, flat], 1)[order]
        # dispatch: each row (and its token, slot, expert) to its expert's rank
        send_n = torch.bincount(flat, minlength=E).view(self.world, self.n).sum(1)
        recv_n = torch.empty_like(send_n)
        dist.all_to_all_single(recv_n, send_n)
        ins, outs = send_n.tolist(), recv_n.tolist()
        recv, recv_meta = x.new_empty(sum(outs), x.shape[1]), meta.new_empty(sum(outs), 3)
        dist.all_to_all_single(recv, send, outs, ins)
        dist.all_to_all_single(recv_meta, meta, outs, ins)
        by_expert = torch.argsort(recv_meta[:, 2], stable=True)
        rows, self.routing = recv[by_expert], recv_meta[by_expert]  # (token, slot, expert) of each row
        divtrace.routed(rows, tokens=self.routing[:, 0], slots=self.routing[:, 1], experts=self.routing[:, 2],
                        n_tokens=N, top_k=k)  # a no-op when not recording
        counts = torch.bincount(self.routing[:, 2] - self.experts.first, minlength=self.n).tolist()
        done = self.experts(rows, counts)
        # return: each row back to the rank that sent it, in the order it was sent
        back_send = torch.empty_like(done)
        back_send[by_expert] = done
        back = x.new_empty(send.shape)
        dist.all_to_all_single(back, back_send, ins, outs)
        divtrace.routed(back, tokens=meta[:, 0], slots=meta[:, 1], experts=meta[:, 2], n_tokens=N, top_k=k)
        pos = torch.empty_like(order)
        pos[order] = torch.arange(order.numel())
        y = self.combine(back, w, pos.view(per, k))
        parts = [torch.empty_like(y) for _ in range(self.world)]
        dist.all_gather(parts, y)
        return torch.cat(parts)


class Model(nn.Module):
    def __init__(self, rank=0, world=1, plant=None):
        super().__init__()
        self.layers = nn.ModuleList(MoELayer(i, rank, world, plant) for i in range(CFG.num_hidden_layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def inputs():
    return torch.randn(TOKENS, CFG.hidden_size, generator=torch.Generator().manual_seed(100))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["full", "hash"])
    p.add_argument("--plant", choices=["weight"], help="rank 1's copy of expert 7's down-projection is stale")
    p.add_argument("--out", help="run directory (default runs/ep1 or runs/ep2: runs/ep<ranks>)")
    a = p.parse_args()
    torch.set_num_threads(1)
    if "RANK" in os.environ:  # under torchrun: one rank of EP=2
        dist.init_process_group("gloo")
    else:  # one process: a process group of one, so that the routed rows are recorded as at EP=2 (rank-0)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Model(rank, world, a.plant).eval()
    out = a.out or f"runs/ep{world}"
    with torch.no_grad(), divtrace.record(model, out, mode=a.mode, layouts=LAYOUTS, mesh={"ep": None},
                                          overwrite=True):
        model(inputs())  # rank K records into OUT/rank-K
    sys.stdout.write(f"rank {rank} of {world}: recorded {out}/rank-{rank}\n")  # (one write: ranks share stdout)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
