"""Token alignment at scale, as ratios and budgets in one run (issue 16).

1. Recording cost of token rows: hash mode, ops=True, with token identity and row fingerprints against the same
   recording with `tokens=False`, on the bench model (HF Llama hidden 512, 8 layers, fp32, 1 thread) and a batch of
   4 x 256 tokens; interleaved rounds in balanced orders (bench_record.rounds), median ratio. Target <= 1.15x.
2. Bytes per token row in hash mode: (rows.bin + rows.jsonl + tokens.jsonl) / rows. Target <= 16.
3. Token-aligned bisect of a rollout (prefill + N decode steps of 8 sequences, ops=True, hash) against its trainer
   recompute (one full-sequence forward of the 8 sequences), in a fresh process: wall time and peak RSS.
   Target (N = 256): under 10 s and 1.5 GB.

    python bench/bench_tokens.py [--repeats 8] [--decode 256] [--json out.json] [--small]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import divtrace

sys.path.insert(0, str(Path(__file__).parent))
from bench_record import rounds  # noqa: E402


def build(small: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if small:
        cfg = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4)
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=8)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval(), cfg


def recording_cost(model, cfg, tmp: Path, repeats: int, seq: int) -> dict:
    ids = torch.randint(0, cfg.vocab_size, (4, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)

    def plain():
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)

    def rec(tokens: bool):
        def run():
            d = tmp / f"rec-{tokens}"
            shutil.rmtree(d, ignore_errors=True)
            with torch.no_grad(), divtrace.record(model, d, mode="hash", tokens=tokens):
                model(input_ids=ids, attention_mask=mask)
        return run

    med, ratio, ts = rounds({"plain": plain, "hash": rec(False), "hash+tokens": rec(True)}, repeats)
    per_round = [t / h for t, h in zip(ts["hash+tokens"], ts["hash"])]
    d = tmp / "rec-True"
    meta = json.loads((d / "meta.json").read_text())
    rows = meta["tokens"]["rows"]
    size = sum((d / f).stat().st_size for f in ("rows.bin", "rows.jsonl", "tokens.jsonl"))
    return {"seconds": med, "ratio_to_plain": ratio,
            "tokens_over_hash": statistics.median(per_round), "tokens_over_hash_rounds": per_round,
            "token_rows": rows, "token_bytes": size, "bytes_per_token_row": size / rows,
            "records_bytes": (d / "records.jsonl").stat().st_size}


def record_rollout(model, cfg, out: Path, decode: int, prompt: int = 32, batch: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, cfg.vocab_size, (batch, prompt), generator=g)
    with torch.no_grad(), divtrace.record(model, out / "rollout", mode="hash", label="rollout"):
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=decode + 1,
                             min_new_tokens=decode + 1, do_sample=False, pad_token_id=0, eos_token_id=None)
    return gen.tolist()


def record_trainer(model, out: Path, seqs: list[list[int]]) -> None:
    ids = torch.tensor(seqs)
    with torch.no_grad(), divtrace.record(model, out / "train", mode="hash", label="train"):
        model(input_ids=ids, attention_mask=torch.ones_like(ids))


_BISECT = """
import json, sys, time
t0 = time.perf_counter()
from divtrace.compare.bisect import bisect
r = bisect(sys.argv[1], sys.argv[2])
dt = time.perf_counter() - t0
d = r.to_dict()
# VmHWM, not ru_maxrss: after fork + exec, ru_maxrss still counts the parent's pages (the bench process holds a
# model), while VmHWM belongs to this process's own memory map
hwm = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM"))
print(json.dumps({"seconds": dt, "peak_rss_mb": hwm / 1024,
                  "verdict": d["verdict"], "alignment": d["alignment"], "tokens": d.get("tokens"),
                  "first": d["first"] and {k: d["first"][k] for k in ("module", "op", "cause", "rows", "token")}}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--decode", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--small", action="store_true")
    p.add_argument("--json", type=Path)
    p.add_argument("--keep", type=Path, help="record the rollout and trainer traces here (kept) instead of a temp dir")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    model, cfg = build(a.small)
    out: dict = {"model": "small" if a.small else "HF Llama h512 L8 fp32", "threads": 1}
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td) if a.keep is None else a.keep
        tmp.mkdir(parents=True, exist_ok=True)
        out["recording"] = recording_cost(model, cfg, tmp, a.repeats, a.seq)
        r = out["recording"]
        print(f"recording 4x{a.seq} hash ops=True: tokens {r['tokens_over_hash']:.3f}x hash without tokens "
              f"(hash {r['ratio_to_plain']['hash']:.2f}x plain, hash+tokens {r['ratio_to_plain']['hash+tokens']:.2f}x); "
              f"{r['bytes_per_token_row']:.2f} bytes per token row ({r['token_rows']} rows)", flush=True)
        t0 = time.perf_counter()
        seqs = record_rollout(model, cfg, tmp, a.decode)
        t1 = time.perf_counter()
        record_trainer(model, tmp, seqs)
        t2 = time.perf_counter()
        sizes = {s: sum(f.stat().st_size for f in (tmp / s).iterdir()) for s in ("rollout", "train")}
        res = subprocess.run([sys.executable, "-c", _BISECT, str(tmp / "train"), str(tmp / "rollout")],
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if res.returncode != 0:
            print(res.stderr, file=sys.stderr)
            return 1
        b = json.loads(res.stdout)
        meta = json.loads((tmp / "rollout" / "meta.json").read_text())
        out["bisect"] = {**b, "decode_steps": a.decode, "sequences": len(seqs), "rollout_records": meta["records"],
                         "record_seconds": {"rollout": t1 - t0, "train": t2 - t1}, "trace_bytes": sizes}
        print(f"bisect rollout (prefill + {a.decode} decode steps x {len(seqs)} seqs, {meta['records']} records) vs "
              f"trainer: {b['seconds']:.2f} s, peak RSS {b['peak_rss_mb']:.0f} MB; verdict {b['verdict']} "
              f"({b['alignment']}); tokens {b['tokens']}; first {b['first']}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
