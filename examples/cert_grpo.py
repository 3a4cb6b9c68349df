"""Certify a TRL GRPO run: 3 steps on a tiny random Llama (CPU), with the divtrace ledger on.

    python examples/cert_grpo.py --out runs/cert                  # bf16, prompts of different lengths (padding)
    divtrace cert runs/cert/ledger                                # exit 1: the first parting step, sequence, token
    python examples/cert_grpo.py --out runs/cert-equal --equal-lengths
    divtrace cert runs/cert-equal/ledger                          # exit 0: every token of every step bitwise equal

Needs trl==1.16.0 (its own venv: README, "Certify a run"). No download: the tokenizer is a word-level one built
here, the model is initialized from a config.
"""
from __future__ import annotations

import argparse
import sys

import torch

PADDED = ["w5 w6 w7", "w9 w10 w11 w12 w13 w14", "w20 w21", "w30 w31 w32 w33"]  # generate left-pads these
EQUAL = ["w5 w6 w7 w8", "w9 w10 w11 w12", "w20 w21 w22 w23", "w30 w31 w32 w33"]  # nothing to pad


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, 128)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_llama(dtype=torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
                      eos_token_id=1, bos_token_id=None)
    return LlamaForCausalLM(cfg).to(dtype)


def grpo_trainer(model, prompts, out_dir, lr=1e-6, steps=3):
    """A GRPOTrainer on CPU: 2 prompts x 2 completions of up to 6 tokens per step, a length reward."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    args = GRPOConfig(output_dir=str(out_dir), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=6, max_steps=steps, learning_rate=lr, logging_steps=1, report_to=[],
                      use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True)
    return GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                       args=args, train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer())


def main(argv=None) -> int:
    from divtrace.cert.trl import attach

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="writes OUT/ledger (and TRL's output_dir OUT/trl)")
    ap.add_argument("--equal-lengths", action="store_true", help="prompts of one length: nothing is padded")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    a = ap.parse_args(argv)
    model = tiny_llama(torch.bfloat16 if a.dtype == "bf16" else torch.float32)
    trainer = grpo_trainer(model, EQUAL if a.equal_lengths else PADDED, f"{a.out}/trl")
    attach(trainer, f"{a.out}/ledger")
    trainer.train()
    print(f"ledger written: {a.out}/ledger; next: divtrace cert {a.out}/ledger")
    return 0


if __name__ == "__main__":
    sys.exit(main())
