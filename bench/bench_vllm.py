"""Recording overhead on a vLLM rollout, as ratios to plain generate in the same run.

Workload (issue 17): the tiny random Llama of examples/vllm_vs_hf.py (vocab 512, hidden 128, 2 layers), fp32,
8 prompts of 16 tokens, 64 new tokens each (greedy, logprobs), one in-process eager engine
(enable_prefix_caching=False). Configurations: plain `llm.generate`, and the same inside
`divtrace.record(llm, dir, mode="hash")` with ops=True and with ops=False. They run in rounds, each round in the
next of the orders of a Latin square, so a slow spell of the shared machine hits them all; each ratio is the
median over rounds of (time / that round's plain generate), with every round's ratio kept. Targets: ops=True
at most 2x, ops=False at most 1.2x.

    python bench/bench_vllm.py [--rounds 6] [--json out.json]      (in the vLLM venv: docs/vllm.md)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

for _k, _v in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_TARGET_DEVICE", "cpu"),
               ("VLLM_CPU_KVCACHE_SPACE", "1"), ("TORCHDYNAMO_DISABLE", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

import divtrace  # noqa: E402

CONFIGS = ("plain", "hash_ops", "hash_modules")
ORDERS = [("plain", "hash_ops", "hash_modules"), ("hash_ops", "hash_modules", "plain"),
          ("hash_modules", "plain", "hash_ops")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm import LLM, SamplingParams

    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    try:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        LlamaForCausalLM(cfg).save_pretrained(work / "model")
        llm = LLM(model=str(work / "model"), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                  max_model_len=256, enable_prefix_caching=False, seed=0)
        params = SamplingParams(temperature=0, max_tokens=args.tokens, min_tokens=args.tokens, logprobs=1,
                                detokenize=False)
        g = torch.Generator().manual_seed(1)
        prompts = [{"prompt_token_ids": torch.randint(1, 512, (16,), generator=g).tolist()}
                   for _ in range(args.prompts)]

        def run(config: str, n: int) -> float:
            out = work / f"trace-{config}-{n}"
            t0 = time.perf_counter()
            if config == "plain":
                llm.generate(prompts, params, use_tqdm=False)
            else:
                with divtrace.record(llm, out, mode="hash", ops=config == "hash_ops"):
                    llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            shutil.rmtree(out, ignore_errors=True)
            return dt

        for c in CONFIGS:  # warm-up: first-call allocations, lazy imports
            run(c, -1)
        times = {c: [] for c in CONFIGS}
        for r in range(args.rounds):
            for c in ORDERS[r % len(ORDERS)]:
                times[c].append(run(c, r))
        ratios = {c: [t / p for t, p in zip(times[c], times["plain"])] for c in CONFIGS if c != "plain"}
        result = {
            "workload": f"{args.prompts} prompts x {args.tokens} new tokens, tiny Llama fp32, vllm "
                        f"{getattr(sys.modules.get('vllm'), '__version__', '?')}, torch {torch.__version__}",
            "plain_s_median": statistics.median(times["plain"]),
            "ratio_hash_ops": statistics.median(ratios["hash_ops"]),
            "ratio_hash_modules": statistics.median(ratios["hash_modules"]),
            "rounds": {c: [round(x, 3) for x in v] for c, v in ratios.items()},
            "targets": {"hash_ops": 2.0, "hash_modules": 1.2},
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
