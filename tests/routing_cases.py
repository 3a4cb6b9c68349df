"""A tiny HF Mixtral with a planted router near-tie, and the side-b variants the routing tests record.

`mixtral()` builds MixtralForCausalLM from a config (hidden 64, 2 layers, 4 experts, top-2, seeded random init,
no download) and edits layer 0's router so that one token's second and third experts' logits lie within bf16
resolution of each other, the higher-numbered expert winning in float32: a bf16 softmax before top-k sees a tie
there (and breaks it towards the lower index), float32 does not. Side b's variants are plain forward overrides:
`bf16_router` (softmax and top-k in bf16, weights back in float32), `weights_other_order` (the chosen weights
renormalized by a division in another order: other bits, same experts), `expert_kernel` (one expert's down
projection computed in float64, rounded back: other bits, same routing).
"""
from __future__ import annotations

import types

import torch

TOKEN = (0, 5)  # (batch row, position) of the planted near-tie
EXPERTS = 4


def mixtral(seed: int = 0):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, num_local_experts=EXPERTS,
                        num_experts_per_tok=2, max_position_embeddings=64, router_jitter_noise=0.0)
    model = MixtralForCausalLM(cfg).float().eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(seed + 1))
    _plant_near_tie(model, ids)
    return model, ids


def router_input(model, ids) -> torch.Tensor:
    """Layer 0's router input ([tokens, hidden]), from a plain forward hook."""
    got = {}
    gate = model.model.layers[0].mlp.gate
    def hook(mod, args, out):
        got.setdefault("x", args[0].detach().clone())
    h = gate.register_forward_hook(hook)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        h.remove()
    return got["x"].reshape(-1, model.config.hidden_size)


def _plant_near_tie(model, ids) -> None:
    """Move the logit of TOKEN's third expert to within 1e-4 of its second's (far below bf16 resolution), on the
    side of it that float32 and a bf16 softmax + top-k order differently (CPU top-k breaks ties by its own rule:
    both sides are tried, the one that flips is kept)."""
    x = router_input(model, ids)
    row = TOKEN[0] * ids.shape[1] + TOKEN[1]
    gate = model.model.layers[0].mlp.gate
    w0 = gate.weight.detach().clone()
    with torch.no_grad():
        logits = (x @ w0.T)[row]  # (all rows in one product, as the router computes them)
        order = torch.argsort(logits, descending=True).tolist()
        second, third = order[1], order[2]
        for gap in (1e-4, -1e-4):
            target = logits[second] + gap
            gate.weight.copy_(w0)
            gate.weight[third] += (target - logits[third]) * x[row] / (x[row] @ x[row])
            moved = (x @ gate.weight.T)[row]
            f32 = set(torch.topk(torch.softmax(moved, -1), 2).indices.tolist())
            b16 = set(torch.topk(torch.softmax(moved.bfloat16(), -1), 2).indices.tolist())
            if f32 != b16:
                return
    raise AssertionError("no near-tie flip could be planted")


def _router(gate, scores_dtype, renormalize, reversed_ties: bool = False) -> None:
    """Replace `gate`'s forward: softmax and top-k over scores in `scores_dtype`, weights back in float32 and
    renormalized by `renormalize(top)`; `reversed_ties`: the top-k runs over the experts in reverse order (a kernel
    that breaks ties the other way)."""
    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        probs = torch.softmax(logits.to(scores_dtype), dim=-1)
        if reversed_ties:
            top, idx = torch.topk(probs.flip(-1), self.top_k, dim=-1)
            idx = probs.shape[-1] - 1 - idx
        else:
            top, idx = torch.topk(probs, self.top_k, dim=-1)
        return logits, renormalize(top.float()), idx
    gate.forward = types.MethodType(forward, gate)


def bf16_router(gate) -> None:
    """Side b's router: softmax and top-k over bf16 scores (ties where float32 has none)."""
    _router(gate, torch.bfloat16, lambda top: top / top.sum(dim=-1, keepdim=True))


def bf16_router_other_ties(gate) -> None:
    """bf16_router whose top-k breaks ties the other way (same scores, same margins)."""
    _router(gate, torch.bfloat16, lambda top: top / top.sum(dim=-1, keepdim=True), reversed_ties=True)


def weights_other_order(gate) -> None:
    """Side b's router: the same experts, the chosen weights renormalized as a * (1/sum) (other bits)."""
    _router(gate, torch.float32, lambda top: top * (1.0 / top.sum(dim=-1, keepdim=True)))


def expert_kernel(experts, which: int = 1) -> None:
    """Side b's experts: expert `which`'s down projection in float64, rounded to float32 (other bits)."""
    def forward2(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = e[0]
            if e == self.num_experts:
                continue
            pos, tok = torch.where(mask[e])
            cur = hidden_states[tok]
            gate, up = torch.nn.functional.linear(cur, self.gate_up_proj[e]).chunk(2, dim=-1)
            cur = self.act_fn(gate) * up
            if int(e) == which:
                cur = (cur.double() @ self.down_proj[e].double().T).float()
            else:
                cur = torch.nn.functional.linear(cur, self.down_proj[e])
            cur = cur * top_k_weights[tok, pos, None]
            final.index_add_(0, tok, cur.to(final.dtype))
        return final
    experts.forward = types.MethodType(forward2, experts)
