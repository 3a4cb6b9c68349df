"""An expert-parallel MoE layer whose experts' loop runs only over the experts that got rows (as HF Mixtral's
`MixtralExperts.forward` does, over `expert_hit`), for tests/test_sharded_parted.py: a routing difference that empties
an expert on one rank makes that rank run fewer ops than its partner, so the ranks' op sequences part.

Sizes: 4 tokens, 8 experts, top-2, EP=2 (4 experts a rank). Each rank routes its share of the tokens (`moe.router`,
declared `S(0)@ep`), sends each (token, slot) row to its expert's rank by all_to_all, runs its experts that got rows,
sends the rows back, combines each token's slots; an all_gather gives every rank all tokens. At EP=1 the same code
runs on a process group of one.

`find_plant()` picks, from the seeded weights and inputs, a token whose last slot is the only row of its expert, and
another expert for it, such that moving it leaves the two ranks with different numbers of experts hit (while the
unplanted routing hits as many on each). Plants (the EP side's code; the other side passes None):
- "router": the router's weight row of the new expert is stale (moved so the token's logit for it passes its old
  expert's): the router's ids differ, before the ranks part;
- "inline": the router is the same; the MoE layer's code then sends the token's slot to the other expert
  (`torch.where` on every rank: the same ops), so nothing differs before the experts' loop parts.
"""
from __future__ import annotations

from moe_cases import parts, record_cases, routed_forward

HIDDEN, FFN, EXPERTS, TOPK, TOKENS = 16, 24, 8, 2, 4
LAYOUTS = {r"moe\.experts": {"input": "T@ep", "output": "T@ep"},
           r"moe\.combine": {"input": "T@ep", "output": "S(0)@ep"},
           r"moe\.router": {"input": "S(0)@ep", "outputs": "S(0)@ep"}}


def _data(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    gate_w = torch.randn(EXPERTS, HIDDEN, generator=g) * 0.5
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    gate_up = torch.randn(EXPERTS, 2 * FFN, HIDDEN, generator=g) * 0.3
    down = torch.randn(EXPERTS, HIDDEN, FFN, generator=g) * 0.3
    return gate_w, x, gate_up, down


def route(gate_w, x):
    import torch

    return torch.topk(torch.softmax((x @ gate_w.T).float(), -1), TOPK, -1).indices


def hits(ids, world: int = 2) -> list[int]:
    """How many of each rank's experts got rows."""
    n, used = EXPERTS // world, set(ids.reshape(-1).tolist())
    return [sum(e in used for e in range(r * n, r * n + n)) for r in range(world)]


def moved_weight(gate_w, x, t: int, e: int, e2: int):
    w = gate_w.clone()
    logits = x[t] @ gate_w.T
    w[e2] += (logits[e] + 0.5 - logits[e2]) * x[t] / (x[t] @ x[t])
    return w


def find_plant():
    """(seed, token, its last slot's expert, the expert it is sent to instead)."""
    import torch

    for seed in range(100):
        gate_w, x, _, _ = _data(seed)
        ids = route(gate_w, x)
        if len(set(hits(ids))) != 1:
            continue
        count = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
        for t in range(TOKENS):
            e = int(ids[t, TOPK - 1])
            for e2 in range(EXPERTS):
                if count[e] != 1 or e2 in ids[t].tolist():
                    continue
                moved = ids.clone()
                moved[t, TOPK - 1] = e2
                r = route(moved_weight(gate_w, x, t, e, e2), x)
                if len(set(hits(moved))) > 1 and torch.equal(r, moved):
                    return seed, t, e, e2
    raise AssertionError("no routing that parts the ranks could be planted")


def build(world: int = 1, rank: int = 0, plant: str | None = None):
    import torch
    import torch.nn.functional as F
    from torch import nn

    seed, tok, e_old, e_new = find_plant()
    gate_w, _, gate_up, down = _data(seed)
    x_all = inputs()
    if plant == "router":
        gate_w = moved_weight(gate_w, x_all, tok, e_old, e_new)
    E, k, n_local, per = EXPERTS, TOPK, EXPERTS // world, TOKENS // world
    first, lo = rank * n_local, rank * per

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(gate_w.clone())

        def forward(self, x):
            logits = F.linear(x, self.weight)
            top, idx = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
            return logits, top / top.sum(-1, keepdim=True), idx

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = Gate()
            self.experts = parts().Experts(gate_up[first:first + n_local], down[first:first + n_local],
                                           silu_only=True, only_hit=True)
            self.combine = parts().Combine()
            mask = torch.zeros(per, k, dtype=torch.bool)
            if lo <= tok < lo + per:
                mask[tok - lo, k - 1] = True
            self.mask = mask
            self.n_experts = E

        def forward(self, x):
            xs = x[lo:lo + per]
            _, w_l, ids_l = self.router(xs)
            if plant == "inline":  # the token's last slot sent to another expert (every rank: the same ops)
                ids_l = torch.where(self.mask, torch.full_like(ids_l, e_new), ids_l)
            return routed_forward(self, x, xs, ids_l, w_l.to(x.dtype), lo=lo, world=world, first=first)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = MoE()

        def forward(self, x):
            return x + self.moe(x)

    return Net().eval()


def inputs():
    return _data(find_plant()[0])[1]


def capture(model, rank: int, world: int):
    """Ground truth from plain forward hooks on an unrecorded forward: per global token its router input, logits
    and ids rows; the experts this rank ran (those whose rows reached it); the model's output."""
    import torch

    got = {"x": {}, "logits": {}, "ids": {}, "ran": None}
    lo = rank * (TOKENS // world)

    def router_hook(m, args, out):
        for i in range(args[0].shape[0]):
            got["x"][lo + i], got["logits"][lo + i], got["ids"][lo + i] = (args[0][i].clone(), out[0][i].clone(),
                                                                         out[2][i].clone())

    def experts_hook(m, args, out):
        got["ran"] = sorted(set(m.routing[:, 2].tolist()))

    hs = [model.moe.router.register_forward_hook(router_hook), model.moe.experts.register_forward_hook(experts_hook)]
    try:
        with torch.no_grad():
            got["out"] = model(inputs())
    finally:
        for h in hs:
            h.remove()
    return got


def worker(rank, world, root, cases):
    """Record each case (name, mode, plant) at EP=`world` into root/name; each rank returns its hooks' captures."""
    return record_cases(root, cases, lambda plant: build(world, rank, plant), inputs, LAYOUTS,
                        lambda m: capture(m, rank, world))
