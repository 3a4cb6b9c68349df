"""An expert-parallel MoE layer in plain torch for the routed-rows tests (tests/test_sharded_routed.py): what each
rank runs (spawned: module-level functions) and the model, at EP=`world` (each rank holds EXPERTS/world experts)
or EP=1 (all experts local, the same weights).

Mixtral's sparse MoE block (sizes from HF's MixtralConfig, its expert weights' layout `gate_up_proj` [E, 2F, H] and
`down_proj` [E, H, F], seeded): router Linear, softmax in fp32, top-k, weights renormalized; experts SwiGLU. Each
rank takes its share of the (replicated) tokens, sends each (token, slot) row to its expert's rank by
`dist.all_to_all_single` with split sizes (the rows' token, slot and expert ids travel beside them), runs its
experts on the rows it received (grouped by expert), sends the results back by all_to_all, and combines each
token's slots (the weighted sum); an all_gather gives every rank all tokens. At EP=1 the same code runs on a
process group of one.

Plants: `act` ("kernel"): expert EXPERTS-1 (on the last rank) computes SiLU as x * sigmoid(x) instead of F.silu
(every expert computes both, so every rank runs the same ops); `combine` ("rank order"): each token's slots are
summed in the order of the ranks (experts) that computed them instead of routing (slot) order.

No value inside the layer depends on the local token count alone (an `arange(k).expand(local tokens, k)` is the
same on every rank, so it is taken for a replica, and its shape differs from the 1-rank run's).
"""
from __future__ import annotations

import functools
import os
import types

HIDDEN, FFN, EXPERTS, TOPK, TOKENS = 16, 24, 4, 3, 12
LAYOUTS = {r"moe\.experts": {"input": "T@ep", "output": "T@ep"},
           r"moe\.combine": {"input": "T@ep", "output": "S(0)@ep"}}


def config():
    from transformers import MixtralConfig

    return MixtralConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=EXPERTS,
                         num_experts_per_tok=TOPK)


def build(world: int = 1, rank: int = 0, plant: str | None = None, declare: bool = True, router: str | None = None,
          split: bool = False):
    """The model on rank `rank` of EP=`world` (the 1-rank model's weights, which a seed fixes, this rank's experts
    of them). `plant`: None, "kernel" or "combine" (the planted side's code; the other side passes None).
    `declare=False`: the routing is not declared (divtrace.routed is not called). `router`: None (every rank
    routes all tokens inline, then takes its share), else a `Gate` module at `moe.router` routing this rank's share
    of the tokens, with the near-tie planted in the gate's weights (plant_tie): "fp32" (softmax in float32),
    "bf16" (softmax and top-k over bfloat16 scores), "fp32-renorm" (float32, the chosen weights renormalized as
    w * (1 / sum): other bits, the same experts). `split`: the experts take their rows by `rows.split(counts)`
    (aten.split_with_sizes along dim 0) instead of slices."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    cfg = config()
    E, k, H, FF = cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(0)
    gate_w = torch.randn(E, H, generator=g) * 0.5
    gate_up = torch.randn(E, 2 * FF, H, generator=g) * 0.3
    down = torch.randn(E, H, FF, generator=g) * 0.3
    n_local = E // world
    first = rank * n_local
    if router is not None:
        gate_w = plant_tie(gate_w, k)

    class Gate(nn.Module):
        """This rank's tokens' routing: (logits, weights, ids), as HF's routers return them (not named *Router)."""

        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(gate_w.clone())

        def forward(self, x):
            logits = F.linear(x, self.weight)
            probs = torch.softmax(logits.to(torch.bfloat16 if router == "bf16" else torch.float32), dim=-1)
            top, idx = torch.topk(probs, k, dim=-1)
            top = top.float()
            w = top * (1.0 / top.sum(-1, keepdim=True)) if router == "fp32-renorm" else top / top.sum(-1, keepdim=True)
            return logits, w, idx

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            if router is None:
                self.gate = nn.Linear(H, E, bias=False)
                self.gate.weight.data.copy_(gate_w)
            else:
                self.router = Gate()
            self.experts = parts().Experts(gate_up[first:first + n_local], down[first:first + n_local], split=split,
                                           manual=E - 1 - first if plant == "kernel" else None)
            self.combine = parts().Combine(rank_order=plant == "combine")
            self.n_experts = E

        def forward(self, x):
            n = x.shape[0]
            per = n // world
            lo = rank * per
            if router is None:
                probs = torch.softmax(self.gate(x).float(), dim=-1)
                w, ids = torch.topk(probs, k, dim=-1)
                w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
                xs, ids_l, w_l = x[lo:lo + per], ids[lo:lo + per], w[lo:lo + per]
            else:
                xs = x[lo:lo + per]
                _, w_l, ids_l = self.router(xs)
                w_l = w_l.to(x.dtype)
            return routed_forward(self, x, xs, ids_l, w_l, lo=lo, world=world, first=first, declare=declare)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = MoE()

        def forward(self, x):
            return x + self.moe(x)

    return Net().eval()


@functools.cache
def parts():
    """The experts and combine modules of build() and tests/moe_part_cases.py (classes made on first use: torch is
    imported here), as `parts().Experts`, `parts().Combine`."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Experts(nn.Module):
        """This rank's experts (`gate_up`, `down`: their weights): rows grouped by expert, `counts` rows each, taken by
        slices or (`split`) by `rows.split(counts)`. `manual`: the local expert whose SiLU is x * sigmoid(x) (the
        kernel plant); unless `silu_only`, every expert computes both forms, so every rank runs the same ops.
        `only_hit`: an expert with no rows runs nothing (HF Mixtral's loop over `expert_hit`)."""

        def __init__(self, gate_up, down, *, split=False, manual=None, silu_only=False, only_hit=False):
            super().__init__()
            self.gate_up_proj = nn.Parameter(gate_up.clone())
            self.down_proj = nn.Parameter(down.clone())
            self.split, self.manual, self.silu_only, self.only_hit = split, manual, silu_only, only_hit

        def forward(self, rows, counts):
            outs, start = [], 0
            chunks = rows.split(counts) if self.split else None
            for e in range(len(counts)):
                if self.only_hit and counts[e] == 0:
                    continue
                x = chunks[e] if self.split else rows[start:start + counts[e]]
                start += counts[e]
                gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
                if self.silu_only:
                    act = F.silu(gate)
                else:
                    silu, manual = F.silu(gate), gate * torch.sigmoid(gate)  # (both, on every rank: the same ops)
                    act = manual if e == self.manual else silu
                outs.append(F.linear(act * up, self.down_proj[e]))
            return torch.cat(outs)

    class Combine(nn.Module):
        """Each token's slots, weighted and summed: in routing (slot) order, or (`rank_order`, the plant) in the
        order of the ranks (experts) that computed them."""

        def __init__(self, rank_order: bool = False):
            super().__init__()
            self.rank_order = rank_order

        def forward(self, back, weights, pos, ids):
            if self.rank_order:
                perm = torch.argsort(ids, dim=1, stable=True)  # the slots by expert: the order of their ranks
                pos, weights = pos.gather(1, perm), weights.gather(1, perm)
            y = weights[:, 0:1] * back[pos[:, 0]]
            for j in range(1, pos.shape[1]):
                y = y + weights[:, j:j + 1] * back[pos[:, j]]
            return y

    return types.SimpleNamespace(Experts=Experts, Combine=Combine)


def routed_forward(moe, x, xs, ids_l, w_l, *, lo: int, world: int, first: int, declare: bool = True):
    """The expert-parallel rest of an MoE layer's forward, once this rank's tokens `xs` (global rows lo..) are routed
    (`ids_l`, `w_l`: [tokens here, k]): each (token, slot) row to its expert's rank by all_to_all (its token, slot and
    expert ids beside it), `moe.experts(rows, counts)` on the rows that came, the rows back, `moe.combine(back, w_l,
    pos, ids_l)`, and an all_gather of every rank's tokens. Sets `moe.experts.routing` and `moe.combine.routing`
    (for the tests' hooks). Shared with tests/moe_part_cases.py."""
    import torch
    import torch.distributed as dist

    import divtrace

    n, (per, k) = x.shape[0], ids_l.shape
    E = moe.n_experts
    n_local = E // world
    flat = ids_l.reshape(-1)  # row i: token lo + i // k, slot i % k
    order = torch.argsort(flat, stable=True)  # by expert, so by the rank that holds it
    send = xs.repeat_interleave(k, dim=0)[order]
    meta = torch.stack([lo + torch.arange(per * k) // k, torch.arange(per * k) % k, flat], 1)[order]
    send_splits = torch.bincount(flat, minlength=E).view(world, n_local).sum(1)
    recv_splits = torch.empty_like(send_splits)
    dist.all_to_all_single(recv_splits, send_splits)
    ins, outs = send_splits.tolist(), recv_splits.tolist()
    recv = x.new_empty(sum(outs), x.shape[1])
    dist.all_to_all_single(recv, send, outs, ins)
    recv_meta = meta.new_empty(sum(outs), 3)
    dist.all_to_all_single(recv_meta, meta, outs, ins)
    by_expert = torch.argsort(recv_meta[:, 2], stable=True)
    rows, rmeta = recv[by_expert], recv_meta[by_expert]
    if declare:
        divtrace.routed(rows, tokens=rmeta[:, 0], slots=rmeta[:, 1], experts=rmeta[:, 2], n_tokens=n, top_k=k)
    moe.experts.routing = rmeta  # (for the tests' hooks)
    counts = torch.bincount(rmeta[:, 2] - first, minlength=n_local).tolist()
    done = moe.experts(rows, counts)
    back_send = torch.empty_like(done)
    back_send[by_expert] = done
    back = x.new_empty(send.shape)
    dist.all_to_all_single(back, back_send, ins, outs)
    if declare:
        divtrace.routed(back, tokens=meta[:, 0], slots=meta[:, 1], experts=meta[:, 2], n_tokens=n, top_k=k)
    moe.combine.routing = meta
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel())
    y_loc = moe.combine(back, w_l, pos.view(per, k), ids_l)
    parts = [torch.empty_like(y_loc) for _ in range(world)]
    dist.all_gather(parts, y_loc)
    return torch.cat(parts)


TIE_TOKEN = 8  # the token whose k-th and (k+1)-th experts tie in bf16 (routed by the last rank at EP=2)
ROUTER_LAYOUTS = {**LAYOUTS, r"moe\.router": {"input": "S(0)@ep", "outputs": "S(0)@ep"}}  # (logits, weights, ids)


def plant_tie(gate_w, k: int):
    """The gate weights with TIE_TOKEN's (k+1)-th expert's logit moved to within 1e-4 of its k-th's, on the side
    where a bf16 softmax + top-k chooses otherwise than float32 (both sides are tried; the one that flips is kept)."""
    import torch

    x = inputs()[TIE_TOKEN]
    logits = x @ gate_w.T
    order = torch.argsort(logits, descending=True).tolist()
    kth, out = order[k - 1], order[k]
    for gap in (1e-4, -1e-4):
        w = gate_w.clone()
        w[out] += (logits[kth] + gap - logits[out]) * x / (x @ x)
        moved = x @ w.T
        f32 = set(torch.topk(torch.softmax(moved, -1), k).indices.tolist())
        b16 = set(torch.topk(torch.softmax(moved.bfloat16(), -1), k).indices.tolist())
        if f32 != b16:
            return w
    raise AssertionError("no near-tie flip could be planted")


def inputs():
    import torch

    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))


def capture(model):
    """Ground truth from plain forward hooks on an unrecorded forward: the experts' input and output rows (and
    expert) and the combine's input rows keyed by (token, slot), the combine's output rows keyed by token, and the
    model's output."""
    import torch

    got = {"experts_in": {}, "experts": {}, "expert_of": {}, "back": {}, "combine": {}}

    def experts_hook(m, args, out):
        for (t, s, e), row, x in zip(m.routing.tolist(), out, args[0]):
            got["experts"][(t, s)], got["experts_in"][(t, s)], got["expert_of"][(t, s)] = row.clone(), x.clone(), e

    def combine_hook(m, args, out):
        for (t, s, _), row in zip(m.routing.tolist(), args[0]):
            got["back"][(t, s)] = row.clone()
        lo = int(m.routing[:, 0].min()) if m.routing.numel() else 0
        for i, row in enumerate(out):
            got["combine"][lo + i] = row.clone()

    hs = [model.moe.experts.register_forward_hook(experts_hook),
          model.moe.combine.register_forward_hook(combine_hook)]
    try:
        with torch.no_grad():
            got["out"] = model(inputs())
    finally:
        for h in hs:
            h.remove()
    return got


def worker(rank, world, root, cases):
    """Record each case (name, mode, plant) at EP=`world` into root/name; each rank returns its hooks' captures."""
    return record_cases(root, cases, lambda plant: build(world, rank, plant), inputs, LAYOUTS, capture)


def record_cases(root, cases, make, inputs, layouts, capture) -> dict:
    """Record each case (name, mode, plant): the model `make(plant)` run on `inputs()` with `layouts` over the group
    "ep" (the world) into root/name; per case, `capture(model)` (hooks on an unrecorded forward)."""
    import torch

    import divtrace

    torch.set_num_threads(1)
    out = {}
    for name, mode, plant in cases:
        m = make(plant)
        with torch.no_grad(), divtrace.record(m, os.path.join(root, name), mode=mode, layouts=layouts,
                                              mesh={"ep": None}):
            m(inputs())
        out[name] = capture(m)
    return out


def undeclared_worker(rank, world, root):
    """Record with T layouts but no routing declared: the one-line DivtraceError, or None."""
    import torch

    import divtrace
    from divtrace.errors import DivtraceError

    torch.set_num_threads(1)
    m = build(world, rank, declare=False)
    try:
        with torch.no_grad(), divtrace.record(m, root, layouts=LAYOUTS, mesh={"ep": None}):
            m(inputs())
    except DivtraceError as e:
        return str(e)
    return None


def router_capture(model):
    """Ground truth from a plain forward hook on `moe.router` (an unrecorded forward): per global token, its router
    input row, logits row, weights row and ids row."""
    import torch

    got = {"x": {}, "logits": {}, "w": {}, "ids": {}}
    per = inputs().shape[0] // model.world
    lo = model.rank * per

    def hook(m, args, out):
        for i in range(args[0].shape[0]):
            got["x"][lo + i], got["w"][lo + i] = args[0][i].clone(), out[1][i].clone()
            got["ids"][lo + i], got["logits"][lo + i] = out[2][i].clone(), out[0][i].clone()

    h = model.moe.router.register_forward_hook(hook)
    try:
        with torch.no_grad():
            model(inputs())
    finally:
        h.remove()
    return got


def routing_worker(rank, world, root, cases, forced=None):
    """Record each case (name, mode, router) at EP=`world` into root/name, the router routing this rank's share of
    the tokens (build(router=...)); with `forced` ({name: global [tokens, k] ids}), those ids' rows of this rank's
    tokens are forced on its router (divtrace.routing.replay). Each rank returns, per case, its router's hook
    captures, the collectives (and their tensor bytes) of a plain forward and of the recorded one, and what
    divtrace.routing.capture saw (a regex: the router is no *Router class)."""
    import torch

    import divtrace
    from sharded_cases import CountCollectives

    torch.set_num_threads(1)
    out = {}
    for name, mode, router in cases:
        m = build(world, rank, router=router)
        m.world, m.rank = world, rank
        per = inputs().shape[0] // world
        ids = (forced or {}).get(name)
        force = {"moe.router": ids[rank * per:(rank + 1) * per]} if ids is not None else {}
        with torch.no_grad(), CountCollectives() as plain, divtrace.routing.replay(m, force):
            m(inputs())
        with torch.no_grad(), CountCollectives() as rec, divtrace.routing.capture(m, r"moe\.router") as got, \
                divtrace.routing.replay(m, force), \
                divtrace.record(m, os.path.join(root, name), mode=mode, layouts=ROUTER_LAYOUTS, mesh={"ep": None}):
            m(inputs())
        with divtrace.routing.replay(m, force):
            truth = router_capture(m)
        out[name] = dict(truth, calls=(plain.calls, plain.bytes, rec.calls, rec.bytes), captured=got.ids())
    return out
