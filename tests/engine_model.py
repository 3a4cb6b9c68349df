"""A vLLM-style inference engine for a Llama, written in plain torch, for the origins tests.

What makes it an engine rather than a trainer, as vLLM lays a model out:
- every scheduled token of every sequence is one row of a flattened `[N, hidden]` batch, with its position; a
  step may mix prefills and decodes; each sequence keeps its own KV cache between steps;
- fused projections: `qkv_proj` (q, k and v in one matmul) and `gate_up_proj`, split inside the module;
- fused add + RMSNorm: a decoder layer returns `(hidden, residual)` and the next norm adds them, so the norm's
  inputs are the two parts where HF's norm gets their sum;
- submodules HF does not have: `self_attn.rotary_emb` (a cos/sin cache indexed by position) and `self_attn.attn`;
- the LM head runs on the last row of each sequence only (the rows a sampler needs).

`Engine.from_hf(hf_model)` copies an HF `LlamaForCausalLM`'s weights (fused where the engine fuses them), so the
two compute the same function. `batch_invariant()` makes both sides' matmuls and attention batch-invariant (each
output row is computed alone, in one fixed order), so that a test can make the engine bitwise equal to HF and
plant one cause at a time. The three causes a test can switch on, each a real difference an agent fixes:
- `norm_cast`: the engine's RMSNorm multiplies the weight in fp32 and rounds once (TransformerEngine order),
  HF rounds x-hat to the model dtype first;
- `rope_fp64`: the engine's cos/sin cache is computed in fp64 and rounded, HF computes it in fp32;
- `plain_matmul`: the engine's linear layers use torch's matmul, whose result depends on the number of rows on
  this CPU, instead of the batch-invariant kernel.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

CAUSES = ("norm_cast", "rope_fp64", "plain_matmul")


# -- batch-invariant kernels ----------------------------------------------------------------------------------
def bi_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T with every output element reduced alone over K, in one order: the same bits whatever the
    number of rows (unlike a BLAS matmul, which tiles by M)."""
    out = (x.contiguous().unsqueeze(-2) * weight.contiguous()).sum(-1)  # (the reduction order follows the layout)
    return out if bias is None else out + bias


def bi_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: list[int], scale: float) -> torch.Tensor:
    """Causal attention of one sequence, one query row at a time over exactly its keys 0..pos: q [T, H, d],
    k/v [S, Hkv, d] (the sequence's whole cache), q_pos the position of each query. Returns [T, H, d]."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # (a reduction's order follows the memory layout)
    h, hkv = q.shape[1], k.shape[1]
    rep = h // hkv
    out = []
    for i, p in enumerate(q_pos):
        kk = k[: p + 1].repeat_interleave(rep, dim=1)  # [p+1, H, d]
        vv = v[: p + 1].repeat_interleave(rep, dim=1)
        s = (q[i].unsqueeze(0) * kk).sum(-1).transpose(0, 1) * scale  # [H, p+1]
        w = torch.softmax(s.float(), dim=-1).to(q.dtype)
        out.append((w.transpose(0, 1).unsqueeze(-1) * vv).sum(0))  # [H, d]
    return torch.stack(out)


def _hf_bi_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """HF attention interface over bi_attention: query [B, H, T, d], key/value [B, Hkv, S, d]. Positions come
    from the mask (left or right padding, a KV cache)."""
    b, _, t, _ = query.shape
    s = key.shape[2]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.zeros(b, t, query.shape[1], query.shape[3], dtype=query.dtype)
    for i in range(b):
        if attention_mask is None:
            valid = list(range(s))
        else:
            m = attention_mask[i, 0, -1] if attention_mask.dim() == 4 else attention_mask[i]
            valid = [j for j in range(s) if (m[j] == 0 if m.dtype != torch.bool else bool(m[j]))]
        k = key[i, :, valid].transpose(0, 1)
        v = value[i, :, valid].transpose(0, 1)
        n = len(valid)
        # the queries are the last t key slots; padding queries (not in valid) stay zero
        slots = list(range(s - t, s))
        q_rows = [r for r, sl in enumerate(slots) if sl in valid]
        pos = [valid.index(slots[r]) for r in q_rows]
        if q_rows:
            q = query[i, :, q_rows].transpose(0, 1)
            out[i, q_rows] = bi_attention(q, k[:n], v[:n], pos, scale)
    return out, None


@contextlib.contextmanager
def batch_invariant(hf_model=None):
    """Inside the block F.linear is bi_linear (HF's and the engine's linear layers alike) and, for `hf_model`,
    HF attention is bi_attention (the engine uses it always)."""
    real = F.linear
    F.linear = bi_linear
    configs = {}
    if hf_model is not None:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

        AttentionInterface.register("divtrace_bi", _hf_bi_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register("divtrace_bi", eager_mask)
        configs = {id(m.config): m.config for m in hf_model.modules() if hasattr(m, "config")}
        before = {k: c._attn_implementation for k, c in configs.items()}
        for c in configs.values():
            c._attn_implementation = "divtrace_bi"
    try:
        yield
    finally:
        F.linear = real
        for k, c in configs.items():
            c._attn_implementation = before[k]


# -- the engine ---------------------------------------------------------------------------------------------
class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, plain: bool):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.plain = plain

    def forward(self, x):
        return x @ self.weight.t() if self.plain else bi_linear(x, self.weight)


class RMSNorm(nn.Module):
    """vLLM's RMSNorm with the residual add fused in: norm(x) or, with a residual, (norm(x + r), x + r)."""

    def __init__(self, weight: torch.Tensor, eps: float, cast_after_weight: bool):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.eps, self.cast_after_weight = eps, cast_after_weight

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (self.weight.float() * h).to(dtype) if self.cast_after_weight else self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


class RotaryEmbedding(nn.Module):
    """A cos/sin cache indexed by position, applied to q and k in the engine's flat layout [N, heads * d]."""

    def __init__(self, inv_freq: torch.Tensor, head_dim: int, max_pos: int, dtype, fp64: bool):
        super().__init__()
        inv = inv_freq.float()  # HF's buffer, as the model holds it (a bf16 model holds it in bf16)
        pos = torch.arange(max_pos)
        if fp64:
            freqs = pos.double()[:, None] * inv.double()[None, :]
        else:  # HF's arithmetic: inv_freq @ position (K = 1: one product per element)
            freqs = (inv[None, :, None] @ pos[None, None, :].float()).transpose(1, 2)[0]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().float().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().float().to(dtype), persistent=False)
        self.head_dim = head_dim

    def forward(self, positions, q, k):
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [N, 1, d]

        def rot(x):
            x = x.view(x.shape[0], -1, self.head_dim)
            half = self.head_dim // 2
            rh = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
            return ((x * cos) + (rh * sin)).flatten(1)

        return rot(q), rot(k)


class Attention(nn.Module):
    """Writes each sequence's new k/v rows into its cache and attends over the cache (one query row at a time)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.cache: dict = {}  # sequence id -> (k [S, Hkv, d], v [S, Hkv, d])

    def forward(self, q, k, v):
        batch = Engine.current
        out = []
        d = self.head_dim
        for seq, sl, pos in batch:
            kk = k[sl].view(-1, self.kv_heads, d)
            vv = v[sl].view(-1, self.kv_heads, d)
            if seq in self.cache:
                ck, cv = self.cache[seq]
                kk, vv = torch.cat((ck, kk)), torch.cat((cv, vv))
            self.cache[seq] = (kk, vv)
            out.append(bi_attention(q[sl].view(-1, self.heads, d), kk, vv, pos, d ** -0.5).flatten(1))
        return torch.cat(out)


class SelfAttention(nn.Module):
    def __init__(self, hf_attn, cfg, inv_freq, plain: bool, rope_fp64: bool, dtype):
        super().__init__()
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        w = torch.cat((hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight))
        self.qkv_proj = Linear(w, plain)
        self.o_proj = Linear(hf_attn.o_proj.weight, plain)
        self.rotary_emb = RotaryEmbedding(inv_freq, self.head_dim, cfg.max_position_embeddings, dtype, rope_fp64)
        self.attn = Attention(self.heads, self.kv_heads, self.head_dim)

    def forward(self, positions, x):
        qkv = self.qkv_proj(x)
        nq, nkv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class MLP(nn.Module):
    def __init__(self, hf_mlp, plain: bool):
        super().__init__()
        self.gate_up_proj = Linear(torch.cat((hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight)), plain)
        self.down_proj = Linear(hf_mlp.down_proj.weight, plain)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, hf_layer, cfg, inv_freq, causes, dtype):
        super().__init__()
        eps = cfg.rms_norm_eps
        cast = "norm_cast" in causes
        self.input_layernorm = RMSNorm(hf_layer.input_layernorm.weight, eps, cast)
        self.self_attn = SelfAttention(hf_layer.self_attn, cfg, inv_freq, "plain_matmul" in causes, "rope_fp64" in causes, dtype)
        self.post_attention_layernorm = RMSNorm(hf_layer.post_attention_layernorm.weight, eps, cast)
        self.mlp = MLP(hf_layer.mlp, "plain_matmul" in causes)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Model(nn.Module):
    def __init__(self, hf, causes, dtype):
        super().__init__()
        cfg = hf.config
        self.embed_tokens = nn.Embedding.from_pretrained(hf.model.embed_tokens.weight.detach().clone())
        self.layers = nn.ModuleList(DecoderLayer(l, cfg, hf.model.rotary_emb.inv_freq, causes, dtype)
                                    for l in hf.model.layers)
        self.norm = RMSNorm(hf.model.norm.weight, cfg.rms_norm_eps, "norm_cast" in causes)

    def forward(self, input_ids, positions):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Engine(nn.Module):
    """`forward(input_ids [N], positions [N])` -> logits of the last row of each sequence of the step [S, V]; the
    step's layout (which rows are which sequence) is `Engine.current` while it runs (as vLLM's forward context)."""

    current: list = []  # [(sequence id, slice of rows, positions of those rows)]

    def __init__(self, hf, causes=(), dtype=None):
        super().__init__()
        unknown = set(causes) - set(CAUSES)
        assert not unknown, unknown
        dtype = dtype or hf.dtype
        self.model = Model(hf, causes, dtype)
        self.lm_head = Linear(hf.lm_head.weight, "plain_matmul" in causes)

    @classmethod
    def from_hf(cls, hf, causes=()):
        with torch.no_grad():
            return cls(hf, causes).eval()

    def forward(self, input_ids, positions):
        hidden = self.model(input_ids, positions)
        last = torch.tensor([sl.stop - 1 for _, sl, _ in Engine.current])
        return self.lm_head(hidden[last])

    def reset(self):
        for m in self.modules():
            if isinstance(m, Attention):
                m.cache.clear()


def generate(engine: Engine, prompts: list[list[int]], new_tokens: int, rec=None, declare_final: bool = True):
    """Greedy generation, continuous-batching style: step 0 prefills every prompt (one flat batch), each later
    step decodes one token per sequence. With `rec` (divtrace's recorder) each step's tokens are declared, and the
    logits rows (the last row of each sequence) are declared as the step's final values. Returns prompt +
    response per sequence."""
    engine.reset()
    seqs = [list(p) for p in prompts]
    fed = [0] * len(seqs)  # tokens of each sequence already in its cache
    with torch.no_grad():
        for _ in range(new_tokens):
            ids, pos, owners, layout, start = [], [], [], [], 0
            for i, s in enumerate(seqs):
                new = s[fed[i]:]
                p = list(range(fed[i], len(s)))
                ids += new
                pos += p
                owners += [f"seq-{i}"] * len(new)
                layout.append((i, slice(start, start + len(new)), p))
                start += len(new)
                fed[i] = len(s)
            if rec is not None:
                rec.tokens(ids, pos, seqs=owners)
            Engine.current = layout
            logits = engine(torch.tensor(ids), torch.tensor(pos))
            if rec is not None and declare_final:
                rec.final(logits, rows=[sl.stop - 1 for _, sl, _ in layout])
            for row, (i, _, _) in enumerate(layout):
                seqs[i].append(int(logits[row].argmax()))
    return seqs
