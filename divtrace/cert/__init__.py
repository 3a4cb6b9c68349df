"""divtrace cert: a bitwise ledger of rollout vs trainer logprobs over a whole RL run (docs/cert.md).

    import divtrace.cert

    with divtrace.cert.ledger("runs/ledger") as led:
        led.rollout(step, prompts, completions, rollout_logprobs, weights=rollout_model, version=step)
        led.trainer(step, prompts, completions, trainer_logprobs, weights=model, version=step)

then `divtrace cert runs/ledger`. Adapters: `from_generate` (HF generate's output_logits / output_scores),
`from_vllm` (vLLM's returned logprobs); TRL: `divtrace.cert.trl.attach(trainer, path)`.
"""
from __future__ import annotations

from divtrace.cert.adapters import from_generate, from_vllm, vllm_weights
from divtrace.cert.verdict import CertResult, certify
from divtrace.cert.weights import WEIGHT_HASH_SCHEME, fingerprint_weights
from divtrace.cert.writer import Ledger, ledger

__all__ = ["Ledger", "ledger", "certify", "CertResult", "fingerprint_weights", "WEIGHT_HASH_SCHEME",
           "from_generate", "from_vllm", "vllm_weights"]
