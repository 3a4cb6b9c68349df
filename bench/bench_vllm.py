"""Recording overhead on a vLLM rollout, as ratios to plain generate in the same run.

Workload (issue 17): a random-weight Llama, fp32, 8 prompts of 16 tokens, 64 new tokens each (greedy,
logprobs), one in-process eager engine (enable_prefix_caching=False). By default the tiny model of
examples/vllm_vs_hf.py (vocab 512, hidden 128, intermediate 256, 2 layers); `--hidden/--intermediate/--layers/
--heads/--vocab` give a bigger one (still random init, still CPU), where the fixed per-call cost of recording
weighs less against the model's compute. Configurations: plain `llm.generate`, and the same inside
`divtrace.record(llm, dir, mode="hash")` with ops=True and with ops=False. They run in rounds, each round in the
next of the orders of a Latin square, so a slow spell of the shared machine hits them all; each ratio is the
median over rounds of (time / that round's plain generate), with every round's ratio kept. Targets: ops=True
at most 2x, ops=False at most 1.2x. `--profile ops|modules` instead runs one recorded generate under cProfile
and prints where the time goes (sorted by own time), with the trace's counts of module calls and ops.

    python bench/bench_vllm.py [--rounds 6] [--json out.json]                  (in the vLLM venv: docs/vllm.md)
    python bench/bench_vllm.py --hidden 1024 --intermediate 2816 --layers 4 --heads 16 --kv-heads 4
    python bench/bench_vllm.py --rounds 3 --vocab 32000 --hidden 2048 --intermediate 5632 --layers 8 --heads 16 \
        --kv-heads 4                                                    (0.5B-class: 1.32x / 1.12x at 1 thread)
    python bench/bench_vllm.py --profile ops
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


def build(args, work: Path):
    """(llm, prompts, sampling params) of the workload."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm import LLM, SamplingParams

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(work / "model")
    llm = LLM(model=str(work / "model"), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=256, enable_prefix_caching=False, seed=0)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, min_tokens=args.tokens, logprobs=1,
                            detokenize=False)
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(1, args.vocab, (16,), generator=g).tolist()}
               for _ in range(args.prompts)]
    return llm, prompts, params


def profile(llm, prompts, params, ops: bool, work: Path, top: int) -> None:
    import cProfile
    import pstats

    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    with divtrace.record(llm, work / "warm", mode="hash", ops=ops):
        llm.generate(prompts, params, use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    plain = time.perf_counter() - t0
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    with divtrace.record(llm, work / "prof", mode="hash", ops=ops):
        prof.enable()
        llm.generate(prompts, params, use_tqdm=False)
        prof.disable()
    recorded = time.perf_counter() - t0
    kinds: dict = {}
    with open(work / "prof" / "records.jsonl") as f:
        for line in f:
            k = json.loads(line).get("k")
            kinds[k] = kinds.get(k, 0) + 1
    print(f"plain {plain:.3f} s, recorded under cProfile {recorded:.3f} s; records by kind {kinds}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(top)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--profile", choices=("ops", "modules"))
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    try:
        llm, prompts, params = build(args, work)
        if args.profile:
            profile(llm, prompts, params, args.profile == "ops", work, args.top)
            return 0

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
            "workload": f"{args.prompts} prompts x {args.tokens} new tokens, Llama fp32 (vocab {args.vocab}, hidden "
                        f"{args.hidden}, intermediate {args.intermediate}, {args.layers} layers, {args.heads}/"
                        f"{args.kv_heads} heads), vllm {getattr(sys.modules.get('vllm'), '__version__', '?')}, "
                        f"torch {torch.__version__}, {torch.get_num_threads()} threads",
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
