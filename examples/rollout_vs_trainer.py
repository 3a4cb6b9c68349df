"""A real RL scenario: an HF Llama rollout (generate with a KV cache over a left-padded batch) against the trainer's
recompute of the same tokens (full-sequence forwards in right-padded micro-batches), both recorded with divtrace.

    python examples/rollout_vs_trainer.py --out runs            # fp32: the CPU's own batch-size-dependent matmul
    divtrace bisect runs/train runs/rollout                     # names q_proj's mm, the token, the rows (M) per side

    python examples/rollout_vs_trainer.py --out runs-bf16 --dtype bf16 --variant rmsnorm_cast
    divtrace bisect runs-bf16/train runs-bf16/rollout           # the rollout's RMSNorm casts after the weight multiply

Same seed, same weights on both sides (a random-init model from a config: nothing is downloaded). The rollout
makes one prefill call, then one decode call per new token; the trainer makes one call per micro-batch. bisect pairs
the tokens by content (the same ids at positions 0..p), whatever their batch slot, padding side or step.

Variants (planted in the rollout's model code only):
  none                  nothing planted: in fp32 this CPU's matmul already gives another row at M=2 (a decode step
                        of 2 sequences) than at M=40 (the trainer's micro-batch); in bf16 it does not
  rmsnorm_cast          every RMSNorm computes `(w.float() * x_hat).to(dtype)` instead of HF's `w * x_hat.to(dtype)`
                        (TransformerEngine-style); visible in bf16, invisible in fp32
  split_k_decode        layer 1's down_proj sums its matmul over two halves of K at decode sizes (M <= 4): a
                        split-K kernel chosen by batch size
"""
from __future__ import annotations

import argparse
import types
from pathlib import Path

import torch

import divtrace

VARIANTS = ("none", "rmsnorm_cast", "split_k_decode")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_model(dtype: str = "fp32", seed: int = 0, layers: int = 2, hidden: int = 128, vocab: int = 256):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # RMSNorm weights start at 1.0, where a cast-order change cannot show
        for m in model.modules():
            if type(m).__name__ == "LlamaRMSNorm":
                m.weight.normal_(1.0, 0.1)
    return model.to(DTYPES[dtype]).eval()


def make_prompts(lengths=(12, 16), seed: int = 1, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def plant(model, variant: str) -> None:
    if variant == "rmsnorm_cast":
        def rmsnorm(self, x):
            dtype = x.dtype
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (self.weight.float() * h).to(dtype)

        for m in model.modules():
            if type(m).__name__ == "LlamaRMSNorm":
                m.forward = types.MethodType(rmsnorm, m)
    elif variant == "split_k_decode":
        def linear(self, x):
            if x.reshape(-1, x.shape[-1]).shape[0] > 4:
                return torch.nn.functional.linear(x, self.weight, self.bias)
            k = x.shape[-1] // 2
            return x[..., :k] @ self.weight[:, :k].t() + x[..., k:] @ self.weight[:, k:].t()

        down = model.model.layers[1].mlp.down_proj
        down.forward = types.MethodType(linear, down)
    elif variant != "none":
        raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")


def _padded(seqs, left: bool):
    t = max(map(len, seqs))
    ids = torch.tensor([([0] * (t - len(s)) + s) if left else (s + [0] * (t - len(s))) for s in seqs])
    mask = torch.tensor([([0] * (t - len(s)) + [1] * len(s)) if left else ([1] * len(s) + [0] * (t - len(s)))
                         for s in seqs])
    return ids, mask


def record_rollout(model, out, prompts, new_tokens: int = 4, mode: str = "full", ops: bool = True) -> list[list[int]]:
    """Greedy generation with a KV cache over a left-padded batch, recorded into `out`; the finished sequences."""
    ids, mask = _padded(prompts, left=True)
    with torch.no_grad(), divtrace.record(model, out, mode=mode, ops=ops, label="rollout"):
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return [p + gen[i, ids.shape[1]:].tolist() for i, p in enumerate(prompts)]


def record_trainer(model, out, seqs, micro_batch: int = 2, mode: str = "full", ops: bool = True) -> None:
    """The trainer's recompute: full-sequence forwards of the finished sequences in right-padded micro-batches."""
    with torch.no_grad(), divtrace.record(model, out, mode=mode, ops=ops, label="train"):
        for i in range(0, len(seqs), micro_batch):
            ids, mask = _padded(seqs[i:i + micro_batch], left=False)
            pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
            model(input_ids=ids, attention_mask=mask, position_ids=pos)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for the two traces (OUT/rollout, OUT/train)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--variant", choices=VARIANTS, default="none", help="what to plant in the rollout's model code")
    p.add_argument("--mode", choices=("full", "hash"), default="full")
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    for name in ("rollout", "train"):
        if (a.out / name / "meta.json").exists() and not a.overwrite:
            p.error(f"{a.out / name} already holds a trace (pass --overwrite)")
        if a.overwrite:
            import shutil

            shutil.rmtree(a.out / name, ignore_errors=True)
    rollout_model, trainer_model = make_model(a.dtype), make_model(a.dtype)
    plant(rollout_model, a.variant)
    seqs = record_rollout(rollout_model, a.out / "rollout", make_prompts(), a.new_tokens, a.mode)
    record_trainer(trainer_model, a.out / "train", seqs, a.micro_batch, a.mode)
    print(f"recorded {a.out / 'rollout'} ({len(seqs)} sequences, {a.new_tokens} new tokens each) and "
          f"{a.out / 'train'}; next: divtrace bisect {a.out / 'train'} {a.out / 'rollout'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
