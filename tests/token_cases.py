"""Rollout-vs-trainer runs of a small HF Llama, recorded with divtrace, for the token-alignment tests.

A rollout generates with a KV cache over a left-padded batch (one prefill call, then one decode call per new
token); a trainer recomputes each finished sequence (prompt + response) in full-sequence forwards, in its own
right-padded micro-batches. Divergences are planted in named places of the real HF model code (module forwards
replaced on one side only), so a test knows where bisect must point.
"""
from __future__ import annotations

import types

import torch

import divtrace

VOCAB = 256


def llama(dtype=torch.float32, layers: int = 2, seed: int = 0, attn: str = "sdpa", hidden: int = 128):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                      attn_implementation=attn)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # RMSNorm weights start at 1.0, where a cast-order change cannot show: make them real
        for m in model.modules():
            if type(m).__name__ == "LlamaRMSNorm":
                m.weight.normal_(1.0, 0.1)
    return model.to(dtype).eval()


def prompts(lengths=(12, 16), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def left_padded(seqs: list[list[int]], pad: int = 0):
    t = max(map(len, seqs))
    ids = torch.tensor([[pad] * (t - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (t - len(s)) + [1] * len(s) for s in seqs])
    return ids, mask


def right_padded(seqs: list[list[int]], pad: int = 0):
    t = max(map(len, seqs))
    ids = torch.tensor([s + [pad] * (t - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (t - len(s)) for s in seqs])
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids from an attention mask, as HF generate makes them (padding gets 1, masked out anyway)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


def rollout(model, path, prompt_ids, new_tokens: int = 4, mode: str = "full", ops: bool = True, **kw):
    """Greedy generation with a KV cache over a left-padded batch, recorded; returns prompt + response per row."""
    dev = next(model.parameters()).device
    ids, mask = (x.to(dev) for x in left_padded(prompt_ids))
    with torch.no_grad(), divtrace.record(model, path, mode=mode, ops=ops, label="rollout", **kw):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    t = ids.shape[1]
    return [p + out[i, t:].tolist() for i, p in enumerate(prompt_ids)]


def trainer(model, path, seqs, micro_batch: int = 2, mode: str = "full", ops: bool = True, **kw):
    """Full-sequence forwards of the finished sequences, in right-padded micro-batches, recorded."""
    with torch.no_grad(), divtrace.record(model, path, mode=mode, ops=ops, label="train", **kw):
        for i in range(0, len(seqs), micro_batch):
            ids, mask = (x.to(next(model.parameters()).device) for x in right_padded(seqs[i:i + micro_batch]))
            model(input_ids=ids, attention_mask=mask, position_ids=positions(mask))


def batch_dependent_linear(linear: torch.nn.Linear, max_rows: int = 4):
    """Plant a batch-size-dependent matmul: at most `max_rows` rows (a decode step), the product is summed over
    two halves of K (a split-K kernel chosen for small M), else in one matmul."""
    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        if rows > max_rows:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        k = x.shape[-1] // 2
        return x[..., :k] @ self.weight[:, :k].t() + x[..., k:] @ self.weight[:, k:].t()

    linear.forward = types.MethodType(forward, linear)


def rmsnorm_cast_after_weight(norm):
    """Plant the RMSNorm cast-order change: `(w.float() * x_hat).to(dtype)` instead of HF's `w * x_hat.to(dtype)`."""
    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        h = hidden_states.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * h).to(dtype)

    norm.forward = types.MethodType(forward, norm)


def split_kv_decode_attention(model):
    """Plant decode attention that differs from full-sequence attention: a one-token query (a decode step) is
    answered flash-decoding style, the keys split in two halves whose partial softmaxes are merged by their
    log-sum-exp; longer queries run SDPA as the trainer does."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def split_kv(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        if query.shape[2] != 1 or key.shape[2] < 2:
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                          dropout=dropout, **kw)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        half = key.shape[2] // 2
        outs, lses = [], []
        for sl in (slice(0, half), slice(half, None)):
            s = (query @ key[:, :, sl].transpose(-1, -2)).float() * scale
            if attention_mask is not None:
                s = s + attention_mask[..., sl].float()
            lse = torch.logsumexp(s, -1, keepdim=True)
            outs.append((torch.exp(s - lse) @ value[:, :, sl].float()))
            lses.append(lse)
        total = torch.logaddexp(lses[0], lses[1])
        out = outs[0] * torch.exp(lses[0] - total) + outs[1] * torch.exp(lses[1] - total)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    AttentionInterface.register("divtrace_split_kv", split_kv)
    ALL_MASK_ATTENTION_FUNCTIONS.register("divtrace_split_kv", sdpa_mask)  # the masks SDPA gets, as the trainer
    model.config._attn_implementation = "divtrace_split_kv"
    for m in model.modules():
        if hasattr(m, "config") and m.config is not model.config:
            m.config._attn_implementation = "divtrace_split_kv"
