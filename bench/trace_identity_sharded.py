"""bench/trace_identity.py for sharded runs: record a fixed set of tensor-parallel runs (2 gloo ranks, HF's TP plan)
with one tree, again with another, and compare the rank traces file by file (trace_identity.compare: layouts.jsonl
byte for byte; records with process addresses masked, as there).

    PYTHONPATH=OLD_TREE python bench/trace_identity_sharded.py record /tmp/a
    PYTHONPATH=NEW_TREE python bench/trace_identity_sharded.py record /tmp/b
    python bench/trace_identity_sharded.py compare /tmp/a /tmp/b

Runs, each recorded twice in the same processes (the second meets the weights again: record/placements.py keeps
their partial fingerprints): the tests' tiny Llama (2 layers, hidden 64) in hash mode with ops=True and ops=False
and in full mode; bench_record.py's Llama (hidden 512, 8 layers; 64 tokens) in hash and full mode with ops=True,
whose transposed weight blocks are big enough to be copied before their partial.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

RUNS = {"tiny": (("hash", True), ("hash", False), ("full", True)), "llama": (("hash", True), ("full", True))}


def _rank(rank, world, models: dict, out: str) -> None:
    import torch
    from transformers import LlamaForCausalLM

    import divtrace
    from sharded_cases import IDS

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    torch.set_num_threads(1)
    inputs = {"tiny": torch.tensor(IDS),
              "llama": torch.randint(0, 32000, (1, 64), generator=torch.Generator().manual_seed(0))}
    for name, model_dir in models.items():
        m = LlamaForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32).eval()
        for mode, ops in RUNS[name]:
            for k in range(2):
                run = os.path.join(out, f"{name}-{mode}-{'ops' if ops else 'modules'}-{k}")
                with torch.no_grad(), divtrace.record(m, run, mode=mode, ops=ops):
                    m(inputs[name], use_cache=False)


def record(out: Path) -> None:
    from bench_record import build
    from dist_harness import run_ranks
    from sharded_cases import tiny_llama

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        models = {"tiny": tiny_llama(os.path.join(d, "tiny"))}
        model, _ = build(False)
        model.save_pretrained(os.path.join(d, "llama"))
        models["llama"] = os.path.join(d, "llama")
        run_ranks(_rank, 2, models, str(out), timeout_s=600, join_s=1800)


def compare(a: Path, b: Path) -> int:
    from trace_identity import compare as compare_traces

    runs = sorted(p.name for p in a.iterdir() if p.is_dir())
    if runs != sorted(p.name for p in b.iterdir() if p.is_dir()):
        print(f"FAILED: different runs: {runs} vs {sorted(p.name for p in b.iterdir())}")
        return 1
    bad = sum(compare_traces(a / r, b / r) for r in runs)
    print(f"PASSED: {len(runs)} runs identical" if not bad else f"FAILED: {bad} of {len(runs)} runs differ")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "record":
        record(Path(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        sys.exit(__doc__)
