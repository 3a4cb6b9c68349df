"""Shared test helpers: record the example pair (or any model) into traces with the Python API."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

import divtrace

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "llama_pair.py"


def load_example():
    name = "divtrace_example_llama_pair"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def record_model(model, inputs, path, **kw):
    with torch.no_grad(), divtrace.record(model, path, **kw):
        out = model(*inputs) if isinstance(inputs, (tuple, list)) else model(**inputs)
    return out


def record_pair(tmp_path: Path, variant: str, dtype: str = "bf16", mode: str = "full", ops: bool = True, **cfg):
    """Record training and inference(variant) of the example model; returns the two trace paths."""
    ex = load_example()
    a, b = tmp_path / f"train-{variant}-{dtype}", tmp_path / f"infer-{variant}-{dtype}"
    model, inputs = ex.training(dtype=dtype, **cfg)
    record_model(model, inputs, a, mode=mode, ops=ops, label="train")
    model, inputs = ex.inference(dtype=dtype, variant=variant, **cfg)
    record_model(model, inputs, b, mode=mode, ops=ops, label="infer")
    return a, b


def hf_llama(attn: str, dtype=torch.float32, seed: int = 0, layers: int = 2):
    """A small HF LlamaForCausalLM from config (random init, no download) and its input ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      attn_implementation=attn)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed + 1))
    return model, {"input_ids": ids, "use_cache": False}
