"""The ledger's overhead on an RL step: microseconds per token and per step, and the share of a step.

Model: HF LlamaForCausalLM from config (hidden 512, 8 layers, 8 heads, intermediate 1376, vocab 32000: the
bench_record model, 0.5 GB of fp32 weights less the embedding's share), fp32, torch.set_num_threads(1). One RL
step, as a small GRPO step on CPU: generate 8 completions of 64 tokens after 32-token prompts (KV cache, sampled,
output_logits), then the trainer's forward over prompt + completion, backward and an SGD update.

The ledger's work per step, timed on its own in the same rounds (each round runs the step, then the ledger work
for that step's tokens): the rollout's logprobs from generate's logits (`from_generate`), `led.rollout` and
`led.trainer` (payload, CRC, JSON line; per token), and one weight fingerprint per side (per step: the whole
model, twice). The target (issue 29): the ledger's time <= 1% of a step. Reported: the median over rounds of
each part, in µs per token and µs per step, and each as a % of that round's step time.

    python bench/bench_cert.py [--rounds 5] [--small] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))

from bench_tokens import build as build_llama  # noqa: E402

from divtrace.cert import fingerprint_weights, from_generate, ledger  # noqa: E402


def build(small: bool):
    """bench_tokens' model (bench_record's Llama, or its small form), as a trainer: pad id 0, no EOS."""
    model, cfg = build_llama(small)
    cfg.pad_token_id, cfg.eos_token_id = 0, None
    return model


def rl_step(model, opt, prompts, new_tokens):
    t0 = time.perf_counter()
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    model.train()
    seq = out.sequences
    logits = model(seq).logits[:, prompts.shape[1] - 1:-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, seq[:, prompts.shape[1]:, None]).squeeze(-1)
    (-lp.mean()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, out, lp.detach()


def ledger_work(led, step, model, out, prompts, trainer_lp):
    parts = {}
    t = time.perf_counter()
    batch = from_generate(out, prompts)
    parts["from_generate"] = time.perf_counter() - t
    t = time.perf_counter()
    led.rollout(step, batch.prompts, batch.completions, batch.logprobs, version=step)
    led.trainer(step, batch.prompts, batch.completions, trainer_lp, version=step)
    parts["log_rows"] = time.perf_counter() - t
    t = time.perf_counter()
    w = fingerprint_weights(model)
    led.weights(step, "rollout", w, version=step)
    led.weights(step, "trainer", fingerprint_weights(model), version=step)
    parts["weights"] = time.perf_counter() - t
    return parts, sum(map(len, batch.completions))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = build(a.small)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    batch, plen, new = 8, 32, 64
    prompts = torch.randint(1, model.config.vocab_size, (batch, plen), generator=torch.Generator().manual_seed(1))
    nparams = sum(p.numel() for p in model.parameters())
    rows = []
    with tempfile.TemporaryDirectory() as d, ledger(Path(d) / "led") as led:
        rl_step(model, opt, prompts, 4)  # warm-up
        for r in range(a.rounds):
            step_s, out, lp = rl_step(model, opt, prompts, new)
            parts, tokens = ledger_work(led, r, model, out, prompts, lp)
            rows.append({"step_s": step_s, "tokens": tokens, **parts})
            print(f"round {r}: step {step_s:.2f} s, " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in parts.items()),
                  flush=True)
        ledger_bytes = sum(p.stat().st_size for p in (Path(d) / "led").iterdir())
    med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
    share = {k: statistics.median(x[k] / x["step_s"] * 100 for x in rows) for k in ("from_generate", "log_rows",
                                                                                     "weights")}
    total = statistics.median((x["from_generate"] + x["log_rows"] + x["weights"]) / x["step_s"] * 100 for x in rows)
    tokens = rows[0]["tokens"]
    result = {"model_params": nparams, "tokens_per_step": tokens, "rounds": a.rounds, "step_s": med["step_s"],
              "us_per_token": {k: med[k] * 1e6 / tokens for k in ("from_generate", "log_rows")},
              "us_per_step": {k: med[k] * 1e6 for k in ("from_generate", "log_rows", "weights")},
              "percent_of_step": share, "total_percent_of_step": total, "target_percent": 1.0,
              "ledger_bytes_per_step": ledger_bytes / a.rounds}
    print(f"model {nparams / 1e6:.1f}M params, {tokens} sampled tokens per step, step {med['step_s']:.2f} s (median "
          f"of {a.rounds})")
    for k in ("from_generate", "log_rows", "weights"):
        per_tok = f"{med[k] * 1e6 / tokens:8.2f} us/token" if k != "weights" else " " * 17
        print(f"  {k:14s} {per_tok} {med[k] * 1e6:10.0f} us/step {share[k]:7.3f} % of a step")
    print(f"ledger total: {total:.3f} % of a step (target <= 1 %): {'met' if total <= 1.0 else 'NOT met'}; "
          f"{result['ledger_bytes_per_step']:.0f} bytes on disk per step")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
