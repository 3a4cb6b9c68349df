"""The TRL replay's saved generation settings are the ones generate resolved (divtrace.cert.trl._as_resolved).

Regression: TRL sets `config.use_cache = False` for gradient checkpointing after the policy's generation config was
made (use_cache True), so the replay, rebuilt from config.json, ran generate without the KV cache: other matmul
and attention shapes, and on a CPU whose kernels depend on them (an AMD EPYC without AVX-512) logprobs that no
longer reproduced the rollout's. Checked with a real HF model's generate here (no TRL needed): the saved settings,
loaded into a model rebuilt from a config.json that says use_cache false, run with the cache as the original did.
"""
from __future__ import annotations

import torch

from divtrace.cert.trl import _as_resolved


def _model(use_cache: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, use_cache=use_cache)
    return LlamaForCausalLM(cfg).eval()


def test_unset_settings_are_saved_as_generate_resolved_them():
    from transformers import GenerationConfig

    policy = _model(use_cache=True)  # its generation config made while use_cache was True ...
    policy.config.use_cache = False  # ... then set False, as TRL does for gradient checkpointing
    asked = GenerationConfig(max_new_tokens=3, do_sample=False)  # use_cache left unset (None), as TRL leaves it
    assert asked.use_cache is None and policy.generation_config.use_cache is True
    saved = _as_resolved(asked, policy.generation_config)
    assert saved["use_cache"] is True and saved["max_new_tokens"] == 3 and saved["do_sample"] is False
    assert not any(k.startswith("_") for k in saved if saved[k] != asked.to_dict().get(k))

    # a replay's model, rebuilt from config.json (use_cache false there): the saved settings run it with the cache
    replay = _model(use_cache=False)
    replay.load_state_dict(policy.state_dict())
    seen = []
    replay.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        replay.generate(input_ids=ids, generation_config=GenerationConfig.from_dict(saved))
    assert seen == [4, 1, 1]  # a prefill, then one new token per step: the KV cache
    seen.clear()
    with torch.no_grad():  # the unresolved settings: no cache, the whole sequence every step
        replay.generate(input_ids=ids, generation_config=GenerationConfig.from_dict(asked.to_dict()))
    assert seen == [4, 5, 6]
