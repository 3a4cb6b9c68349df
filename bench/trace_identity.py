"""Check that a change to the recorder leaves what it records byte-identical: record a fixed set of deterministic
runs into a directory with one tree, again with another, and compare the two directories file by file.

    PYTHONPATH=OLD_TREE setarch -R python bench/trace_identity.py record /tmp/a    (vLLM venv: both engines)
    PYTHONPATH=NEW_TREE setarch -R python bench/trace_identity.py record /tmp/b
    python bench/trace_identity.py compare /tmp/a /tmp/b

Runs: HF LlamaForCausalLM (tiny, random init, generate of 2 x 6 tokens + 6 new) in hash mode with ops=True and
ops=False and in full mode; a vLLM rollout of the same kind (4 prompts, 12 new tokens, fp32) in hash mode with
ops=True and ops=False and in full mode (skipped where vllm is not installed). Every file of every trace must be
equal byte for byte, except meta.json's timing fields (`started`, `finished`) and the engine's temporary model
path, and what differs from process to process in a vLLM trace whatever the recorder does: addresses in
`$repr` arguments (`<LayerName object at 0x...>`) and the oneDNN weight handles, int64 scalars from outside (an
address). Those are masked in records.jsonl, and then checksums.jsonl, meta.json's records digest and the shard
files (compared tensor by tensor, the masked handles' blobs left out) are compared where they differ.
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

for _k, _v in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_TARGET_DEVICE", "cpu"),
               ("VLLM_CPU_KVCACHE_SPACE", "1"), ("TORCHDYNAMO_DISABLE", "1")):
    os.environ.setdefault(_k, _v)

TIMING = ("started", "finished")
RUNS = (("hash", True), ("hash", False), ("full", True), ("full", False))


def record(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import divtrace

    out.mkdir(parents=True, exist_ok=True)
    # Fresh buffers (torch.empty) are filled, so their recorded fingerprints do not depend on what the allocator
    # left there; run under `setarch -R` so vLLM's oneDNN handle addresses (an op argument) repeat too.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    hf = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    for mode, ops in RUNS:
        with divtrace.record(hf, out / f"hf-{mode}-{'ops' if ops else 'modules'}", mode=mode, ops=ops), \
                torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        print("vllm not installed: HF runs only")
        return
    with tempfile.TemporaryDirectory() as d:  # (meta.json names it: compared without engine.model)
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        LlamaForCausalLM(cfg).save_pretrained(Path(d) / "model")
        llm = LLM(model=str(Path(d) / "model"), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                  max_model_len=256, enable_prefix_caching=False, seed=0)
        params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=1, detokenize=False)
        prompts = [{"prompt_token_ids": p} for p in ([1, 5, 7, 9, 11], [3, 4, 5, 6, 7, 8, 9, 10, 12], [20, 21, 22],
                                                    [100, 200, 300, 400, 17, 18, 19])]
        for mode, ops in RUNS:
            with divtrace.record(llm, out / f"vllm-{mode}-{'ops' if ops else 'modules'}", mode=mode, ops=ops):
                llm.generate(prompts, params, use_tqdm=False)


def _meta(p: Path) -> dict:
    m = json.loads(p.read_text())
    for k in TIMING:
        m.pop(k, None)
    m.get("engine", {}).pop("model", None)
    return m


_ADDR = re.compile(r" at 0x[0-9a-f]+")


def _records(p: Path) -> tuple[list, set]:
    """records.jsonl's records with process-specific values masked; the blob keys of the masked values."""
    out, masked = [], set()
    for line in p.read_text().splitlines():
        r = json.loads(_ADDR.sub(" at 0x?", line))
        for v in r.get("V", ()):
            if v["d"] == "int64" and v["s"] == [] and "p" not in v:  # a handle address passed to an op
                masked.add(v.pop("b", None))
                v.pop("h"), v.pop("f", None)
        out.append(r)
    return out, masked


def _shard_tensors(p: Path, skip: set) -> dict:
    from safetensors.numpy import load_file

    return {k: (t.dtype.str, t.shape, t.tobytes()) for k, t in load_file(p).items() if k not in skip}


def compare(a: Path, b: Path) -> int:
    bad = 0
    traces = sorted(p.name for p in a.iterdir() if p.is_dir())
    if traces != sorted(p.name for p in b.iterdir() if p.is_dir()):
        print(f"FAILED: different traces: {traces} vs {sorted(p.name for p in b.iterdir())}")
        return 1
    for t in traces:
        files = sorted(p.name for p in (a / t).iterdir())
        if files != sorted(p.name for p in (b / t).iterdir()):
            print(f"FAILED {t}: different files")
            bad += 1
            continue
        raw = (a / t / "records.jsonl").read_bytes() == (b / t / "records.jsonl").read_bytes()
        ra, ma = _records(a / t / "records.jsonl")
        rb, mb = _records(b / t / "records.jsonl")
        for f in files:
            fa, fb = a / t / f, b / t / f
            if fa.read_bytes() == fb.read_bytes():
                continue
            if f == "meta.json":
                ma_, mb_ = _meta(fa), _meta(fb)
                if not raw:  # the records digest differs with the masked records (compared above)
                    ma_.pop("checksums", None), mb_.pop("checksums", None)
                same = ma_ == mb_
            elif f == "records.jsonl":
                same = ra == rb
            elif f == "checksums.jsonl":
                same = not raw and ra == rb
            elif f.endswith(".safetensors"):
                same = _shard_tensors(fa, ma | mb) == _shard_tensors(fb, ma | mb)
            else:
                same = False
            if not same:
                print(f"FAILED {t}/{f} differs")
                bad += 1
        print(f"{t}: {len(files)} files compared ({sum((a / t / f).stat().st_size for f in files)} bytes)")
    print("PASSED: identical" if not bad else f"FAILED: {bad} files differ")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "record":
        record(Path(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        sys.exit(__doc__)
