"""The ledger in TRL's GRPOTrainer (trl 1.16), without patching TRL in your code:

    from divtrace.cert.trl import attach
    trainer = GRPOTrainer(model=..., args=GRPOConfig(...), ...)
    attach(trainer, "runs/ledger")          # a TrainerCallback, already added to the trainer
    trainer.train()                         # the END marker is written when training ends
    # divtrace cert runs/ledger

What it hooks, on this trainer instance only (and only here in divtrace):
- the policy model's `generate` (TRL's transformers path, without vLLM): it asks generate for the raw logits
  (`output_logits`) and rebuilds the rollout's logprob of each sampled token from them, folded exactly as TRL's
  fused LM head folds the trainer's (TRL keeps no rollout logprobs without vLLM). The rollout's logprobs are of
  the distribution TRL's loss uses: temperature `args.temperature` (1: the unprocessed one), no top-p/top-k;
- `_get_per_token_logps_and_entropies`: the first recompute of each sampled sequence by the policy (the old
  logprobs when TRL computes them, else the first training forward), as the trainer side.
A step is TRL's `global_step` when the completions were generated. Weights are fingerprinted per step on each
side; `version` is the global step whose weights a side holds (for a separate rollout copy, the step of its
last `sync_weights`).

`processed=True` also stores the logprobs after generate's logits processors (top-k, top-p; `kind="processed"`,
never compared). `rollout_model` + `sync_weights(trainer_model, rollout_model, step)`: generate with a separate copy of the policy
(as an inference engine holds one), synced by your function before each generation. `replay`: save what replays
a step (batch, generation settings, weights) for the first step that parts (`"first"`), also for the steps in
`replay_steps`; `divtrace cert` prints the command that records both sides of it and bisects them.
"""
from __future__ import annotations

import json
import sys
from collections import Counter

import torch

from divtrace.cert.adapters import from_generate
from divtrace.cert.writer import Ledger
from divtrace.errors import DivtraceError

SUPPORTED = ("1.16",)


def _trl():
    try:
        import trl
    except ImportError:
        raise DivtraceError("divtrace.cert.trl needs trl (pip install trl==1.16.0)") from None
    version = getattr(trl, "__version__", "unknown")
    if ".".join(version.split(".")[:2]) not in SUPPORTED:
        raise DivtraceError(f"divtrace.cert.trl supports TRL {', '.join(SUPPORTED)}.x; this is TRL {version}: "
                            "its GRPOTrainer internals may differ (log the ledger from your loop with "
                            "divtrace.cert.ledger instead)")
    return trl


def trl_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float, compute_dtype, config,
                 outputs=("log_probs", "entropy")) -> torch.Tensor:
    """Logprobs of `targets` from logits rows [N, V], folded as TRL 1.16's fused LM head folds the trainer's
    logits tiles (`ChunkedLogProbFunction.forward`, minus the matmul): equal logits give equal bits."""
    from trl.kernels import chunked_logprob as ck
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as chunk

    text = config.get_text_config()
    scaling = [k for k in ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                           "logits_scaling") if getattr(text, k, None) is not None]
    if scaling:
        # generate's logits already carry the model's own scaling, TRL's fused head applies it to hidden @ W:
        # mirroring that exactly is not done yet, so say so rather than compare two different computations
        raise DivtraceError(f"divtrace.cert.trl: this model scales or caps its logits ({', '.join(scaling)}); the "
                            "rollout rebuild mirrors TRL's fused head for unscaled logits only")
    n, vocab = logits.shape
    dev = logits.device
    kernel_args = {"logit_scale": 1.0, "softcap": 1.0, "inv_t": 1 / temperature, "HAS_SOFTCAP": False}
    flags = {f"HAS_{name.upper()}": name in outputs for name in ck.OPTIONAL_OUTPUTS}
    stats = {k: torch.zeros((n,), device=dev, dtype=torch.float32)
             for k in ("sum_exp", "x_sum_exp", "sq_sum_exp", "z_sum", "target_logit")}
    running_max = torch.full((n,), float("-inf"), device=dev, dtype=torch.float32)
    max_before = torch.full((n,), float("-inf"), device=dev, dtype=torch.float32)
    rows = logits.to(compute_dtype)
    for start in range(0, vocab, chunk):
        end = min(start + chunk, vocab)
        tile = rows[:, start:end].contiguous()
        fold = ck._forward_kernel[(n,)] if ck._use_triton(dev) else ck._forward_tile
        fold(tile, tile.stride(0), targets, running_max, stats["sum_exp"], stats["x_sum_exp"], stats["sq_sum_exp"],
             stats["z_sum"], max_before, stats["target_logit"], start, end - start, BLOCK_SIZE=ck._BLOCK_SIZE,
             **flags, **kernel_args)
    log_z = running_max + torch.log(stats["sum_exp"])
    return stats["target_logit"] - log_z


class _State:
    def __init__(self):
        self.step = None
        self.pending = Counter()  # content keys of this step's rollout sequences not yet recomputed
        self.rollout = {}  # content key -> [logprob tensor] of this step's rollout
        self.trainer_weights_logged = False
        self.gen = None  # this step's generate call: inputs, config, sequences (for a replay)
        self.replayed = set()
        self.options = {}  # attach()'s replay, replay_steps, weights_ref, rollout_model


def attach(trainer, path, *, rollout_model=None, sync_weights=None, replay="first", replay_steps=(),
           weights_ref: str | None = None, processed: bool = False, label: str = "run"):
    """Turn the ledger on in a TRL GRPOTrainer; returns the callback (already added to the trainer)."""
    trl = _trl()
    from transformers import TrainerCallback

    for name in ("_get_per_token_logps_and_entropies", "use_vllm", "temperature", "state"):
        if not hasattr(trainer, name):
            raise DivtraceError(f"divtrace.cert.trl: this trainer ({type(trainer).__name__}) has no {name!r}; attach "
                                "takes a trl.GRPOTrainer")
    if trainer.use_vllm or getattr(trainer, "use_transformers_continuous_batching", False) \
            or getattr(trainer, "rollout_func", None) is not None:
        raise DivtraceError("divtrace.cert.trl: this GRPOTrainer does not generate with transformers' generate "
                            "(use_vllm, continuous batching or a rollout_func); log the ledger from your rollout "
                            "with divtrace.cert.from_vllm / divtrace.cert.ledger")
    if (rollout_model is None) != (sync_weights is None):
        raise DivtraceError("attach(): rollout_model and sync_weights go together (a separate rollout copy and the "
                            "function that syncs it)")
    policy = trainer.accelerator.unwrap_model(trainer.model)
    led = Ledger(path, label=label, meta={"integration": "trl", "trl": trl.__version__,
                                          "temperature": trainer.temperature})
    st = _State()
    st.options = {"replay": replay, "replay_steps": set(replay_steps), "weights_ref": weights_ref,
                  "rollout_model": rollout_model}
    gen_model = rollout_model if rollout_model is not None else policy
    synced = {"version": None}
    original_generate = gen_model.generate

    def generate(*args, generation_config=None, **kw):
        if not trainer.model.training:  # evaluation: TRL recomputes nothing to compare with
            return original_generate(*args, generation_config=generation_config, **kw)
        step = int(trainer.state.global_step)
        if rollout_model is not None and synced["version"] != step:
            with torch.no_grad():
                sync_weights(policy, rollout_model, step)
            synced["version"] = step
        cfg = (generation_config or gen_model.generation_config).__class__.from_dict(
            (generation_config or gen_model.generation_config).to_dict())
        cfg.output_logits, cfg.return_dict_in_generate = True, True
        cfg.output_scores = bool(processed or cfg.output_scores)
        out = original_generate(*args, generation_config=cfg, **kw)
        ids, mask = kw.get("input_ids", args[0] if args else None), kw.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        head = gen_model.get_output_embeddings().weight.dtype
        batch = from_generate(out, ids, mask, eos_token_id=trainer.eos_token_ids,
                              token_logprob_fn=lambda lg, tok: trl_logprobs(
                                  lg, tok.to(lg.device), temperature=trainer.temperature, compute_dtype=head,
                                  config=gen_model.config))
        _new_step(st, step)
        version = synced["version"] if rollout_model is not None else step
        led.rollout(step, batch.prompts, batch.completions, batch.logprobs, weights=gen_model, version=version,
                    temperature=trainer.temperature)
        if processed and batch.processed is not None:  # after generate's processors (top-k, top-p, ...): apart
            led.rollout(step, batch.prompts, batch.completions, batch.processed, kind="processed", version=version)
        for p, c, lp in zip(batch.prompts, batch.completions, batch.logprobs):
            key = (tuple(p), tuple(c))
            st.pending[key] += 1
            st.rollout.setdefault(key, []).append(lp)
        st.gen = {"input_ids": ids.detach().cpu(), "attention_mask": mask.detach().cpu(),
                  "sequences": out.sequences.detach().cpu(), "config": _as_resolved(cfg, gen_model.generation_config),
                  "version": version}
        return out.sequences

    original_logps = trainer._get_per_token_logps_and_entropies

    def per_token_logps(model, input_ids, attention_mask, logits_to_keep, *args, **kw):
        result = original_logps(model, input_ids, attention_mask, logits_to_keep, *args, **kw)
        if trainer.accelerator.unwrap_model(model) is policy and st.step is not None and st.pending:
            _trainer_side(trainer, led, st, policy, input_ids, attention_mask, logits_to_keep, result[0], args, kw)
        return result

    policy.generate = generate  # TRL calls the policy's generate; a rollout copy's own generate runs inside
    trainer._get_per_token_logps_and_entropies = per_token_logps

    class LedgerCallback(TrainerCallback):
        """Closes the ledger segment and writes the END marker when training ends."""
        ledger = led

        def on_train_end(self, args, state, control, **kwargs):
            if not led.closed:
                led.close()
                trainer.accelerator.wait_for_everyone()  # every rank's segment closed before the END marker
                if trainer.accelerator.is_main_process:
                    led.finish()

    cb = LedgerCallback()
    trainer.add_callback(cb)
    return cb


def _as_resolved(cfg, model_cfg) -> dict:
    """`cfg` as a dict with each setting it leaves unset (None) taken from the model's generation config, as generate
    resolves them. The replay rebuilds the model from config.json, whose generation defaults may not be the ones
    that ran: TRL sets `config.use_cache = False` for gradient checkpointing after the policy's generation config
    was made (use_cache True), and a replay without the KV cache runs other matmul shapes (tests/test_cert_trl.py:
    on a CPU whose bf16 kernels depend on the row count, its logprobs then differ from the rollout's)."""
    d = cfg.to_dict()
    for k, v in model_cfg.to_dict().items():
        if v is not None and d.get(k) is None and not k.startswith("_") and k != "transformers_version":
            d[k] = v
    return d


def _new_step(st: _State, step: int) -> None:
    if st.step != step:
        st.step, st.pending, st.rollout, st.trainer_weights_logged = step, Counter(), {}, False


def _trainer_side(trainer, led, st, policy, input_ids, attention_mask, logits_to_keep, logps, args, kw) -> None:
    """Log the trainer's logprobs of this step's sequences that this recompute call is the first to score."""
    c = int(logits_to_keep)
    ids, mask = input_ids.detach().cpu(), attention_mask.detach().cpu()
    prompts, completions, values, rows, parts = [], [], [], [], False
    for r in range(ids.shape[0]):
        pm, cm = mask[r, :-c].bool(), mask[r, -c:].bool()
        p, comp = ids[r, :-c][pm].tolist(), ids[r, -c:][cm].tolist()
        key = (tuple(p), tuple(comp))
        if st.pending[key] <= 0:
            continue
        st.pending[key] -= 1
        lp = logps[r, -c:].detach()[cm.to(logps.device)].cpu()
        prompts.append(p)
        completions.append(comp)
        values.append(lp)
        rows.append(r)
        parts = parts or not _same_bits(st.rollout[key][0], lp)
    if not prompts:
        return
    weights = None if st.trainer_weights_logged else policy
    led.trainer(st.step, prompts, completions, values, weights=weights, version=int(trainer.state.global_step),
                temperature=trainer.temperature)
    st.trainer_weights_logged = True
    want = st.step in st.options["replay_steps"] or (st.options["replay"] == "first" and parts and not st.replayed)
    if want and st.step not in st.replayed and st.gen is not None:
        st.replayed.add(st.step)
        call = {"input_ids": input_ids, "attention_mask": attention_mask, "logits_to_keep": c,
                "batch_size": kw.get("batch_size", args[0] if args else None)}
        save_replay(led, trainer, st, policy, st.options["rollout_model"], call, rows, values,
                    st.options["weights_ref"])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ia = a.contiguous().view(torch.int32 if a.element_size() == 4 else torch.int16)
    ib = b.contiguous().view(torch.int32 if b.element_size() == 4 else torch.int16)
    return bool(torch.equal(ia, ib))


def save_replay(led, trainer, st, policy, rollout_model, call: dict, rows, values, weights_ref) -> None:
    """Write LEDGER/replay/step-N/ (see divtrace.cert.trl_replay) and note it in the ledger with its commands.
    `call`: the trainer's recompute call holding the parting sequence (input_ids, attention_mask,
    logits_to_keep, batch_size); `rows`, `values`: its rows logged and their logprobs."""
    from safetensors.torch import save_file, save_model

    input_ids, attention_mask, c = call["input_ids"], call["attention_mask"], call["logits_to_keep"]

    step = st.step
    rel = f"replay/step-{step:06d}"
    out = led.path / rel
    out.mkdir(parents=True, exist_ok=True)
    gen = st.gen
    save_file({k: gen[k].contiguous() for k in ("input_ids", "attention_mask", "sequences")},
              str(out / "rollout.safetensors"))
    save_file({"input_ids": input_ids.detach().cpu().contiguous(),
               "attention_mask": attention_mask.detach().cpu().contiguous()}, str(out / "trainer.safetensors"))
    expected = {}
    width = gen["input_ids"].shape[1]
    for b in range(gen["sequences"].shape[0]):
        p = gen["input_ids"][b][gen["attention_mask"][b].bool()].tolist()
        for key, lps in st.rollout.items():
            if key[0] == tuple(p) and list(key[1]) == gen["sequences"][b, width:width + len(key[1])].tolist():
                expected[f"rollout.{b}"] = lps[0].contiguous()
                break
    for r, v in zip(rows, values):
        expected[f"trainer.{r}"] = v.contiguous()
    save_file(expected, str(out / "expected.safetensors"))
    if weights_ref is None:
        save_model(policy, str(out / "weights.safetensors"))
        if rollout_model is not None:
            save_model(rollout_model, str(out / "rollout_weights.safetensors"))
    policy.config.to_json_file(str(out / "config.json"))
    batch_size = call["batch_size"]
    manifest = {
        "step": step, "temperature": trainer.temperature, "generation_config": gen["config"],
        "logits_to_keep": c, "batch_size": batch_size, "rows": rows,
        "dtype": str(next(policy.parameters()).dtype).removeprefix("torch."),
        "mixed_precision": str(getattr(trainer.accelerator, "mixed_precision", "no")),
        "cast_lm_head_to_fp32": bool(getattr(trainer.args, "cast_lm_head_to_fp32", False)),
        "trainer_grad_enabled": torch.is_grad_enabled(), "trainer_training": policy.training,
        "num_threads": torch.get_num_threads(), "weights_ref": weights_ref,
        # (config.json leaves it out: a replay rebuilt with the default attention runs another kernel)
        "attn_implementation": getattr(policy.config, "_attn_implementation", None),
        "rollout_weights": "rollout_weights.safetensors" if rollout_model is not None and weights_ref is None else None,
        "ledger": str(led.path), "trl": __import__("trl").__version__,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    traces = out / "traces"
    led.replay(step, rel, [f"{sys.executable} -m divtrace.cert.trl_replay {out} --out {traces}",
                           f"divtrace bisect {traces}/trainer {traces}/rollout --align tokens"])
