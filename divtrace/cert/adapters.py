"""Rollout logprobs from what engines return, ready for `Ledger.rollout(step, b.prompts, b.completions, b.logprobs)`.

- `from_generate`: HF `generate(..., output_logits=True, return_dict_in_generate=True)`. `output_logits` are the
  model's raw logits, so their logprobs are the unprocessed distribution (temperature 1, no top-p/top-k):
  `logprobs`. With `output_scores=True` too, the processed scores (after temperature, top-k, top-p) give
  `processed`, stored apart (`kind="processed"`).
- `from_vllm`: vLLM `RequestOutput`s of a request with `SamplingParams(logprobs=0 or more)`: the logprob vLLM
  returns for each sampled token goes in as it is (float32, as vLLM computed it). vLLM's `logprobs_mode` says
  which distribution that is: `raw_logprobs` (its default) is the unprocessed one, `processed_logprobs` is stored
  apart; `*_logits` modes return logits, not logprobs, and are refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from divtrace.errors import DivtraceError


@dataclass
class RolloutBatch:
    prompts: list
    completions: list
    logprobs: list  # one 1-D tensor per sequence
    kind: str = "logprobs"
    processed: list | None = None  # generate's processed scores, when asked for
    seq_ids: list | None = None
    meta: dict = field(default_factory=dict)


def log_softmax_fp32(logits: torch.Tensor) -> torch.Tensor:
    """The default logprob of a row of logits: log_softmax in float32 (as vLLM's sampler computes it)."""
    return torch.log_softmax(logits.float(), dim=-1)


def from_generate(output, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                  eos_token_id=None, logprob_fn=None, token_logprob_fn=None) -> RolloutBatch:
    """Per-sequence completion ids and logprobs of the sampled tokens from a `GenerateOutput`.

    `input_ids`/`attention_mask`: what generate was given (either padding side). A completion runs to its first
    EOS (`eos_token_id`, an int or a list; included), else to the end. `logprob_fn(logits [B, V]) -> [B, V]`
    turns a step's logits into logprobs (default: log_softmax in float32); or `token_logprob_fn(logits [B, V],
    tokens [B]) -> [B]` gives the sampled tokens' logprobs directly (a fused computation's own fold)."""
    logits = getattr(output, "logits", None)
    if not logits:
        raise DivtraceError("from_generate(): the output has no logits; call generate(..., output_logits=True, "
                            "return_dict_in_generate=True)")
    if token_logprob_fn is None:
        fn = logprob_fn or log_softmax_fp32
        token_logprob_fn = lambda lg, tok: fn(lg).gather(-1, tok[:, None].to(lg.device)).squeeze(-1)  # noqa: E731
    seqs = output.sequences
    width = input_ids.shape[1]
    gen = seqs[:, width:]
    if gen.shape[1] != len(logits):
        raise DivtraceError(f"from_generate(): {gen.shape[1]} generated positions but {len(logits)} logits steps")
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    lengths = []
    for row in gen.tolist():
        n = len(row)
        for i, tok in enumerate(row):
            if tok in eos:
                n = i + 1
                break
        lengths.append(n)
    steps = max(lengths, default=0)
    raw = _gathered(token_logprob_fn, logits[:steps], gen)
    scores = getattr(output, "scores", None)
    processed = _gathered(_log_softmax_at, scores[:steps], gen) if scores else None
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    prompts = [ids[m.bool()].tolist() for ids, m in zip(input_ids.cpu(), mask.cpu())]
    completions = [gen[i, :n].tolist() for i, n in enumerate(lengths)]
    return RolloutBatch(prompts, completions, [raw[i, :n] for i, n in enumerate(lengths)],
                        processed=None if processed is None else [processed[i, :n] for i, n in enumerate(lengths)])


def _log_softmax_at(lg: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    return log_softmax_fp32(lg).gather(-1, tok[:, None].to(lg.device)).squeeze(-1)


def _gathered(token_fn, per_step, gen: torch.Tensor) -> torch.Tensor:
    """[B, steps]: the logprob of each generated token under `token_fn` of its step's logits."""
    cols = []
    for t, lg in enumerate(per_step):
        cols.append(token_fn(lg, gen[:, t]).cpu())
    return torch.stack(cols, 1) if cols else torch.empty(gen.shape[0], 0)


_VLLM_MODES = {"raw_logprobs": "logprobs", "processed_logprobs": "processed"}


def from_vllm(outputs, llm=None, *, logprobs_mode: str | None = None) -> RolloutBatch:
    """Per-completion ids and the logprob vLLM returned for each sampled token, from `llm.generate(...)`'s
    `RequestOutput`s. `llm` (or `logprobs_mode`) tells which distribution vLLM's logprobs are of."""
    if logprobs_mode is None and llm is not None:
        mc = llm.llm_engine.vllm_config.model_config
        logprobs_mode = str(getattr(mc, "logprobs_mode", "raw_logprobs")).split(".")[-1].lower()
    mode = logprobs_mode or "raw_logprobs"
    kind = _VLLM_MODES.get(mode)
    if kind is None:
        raise DivtraceError(f"from_vllm(): vLLM's logprobs_mode is {mode!r}: it returns logits, not logprobs; run "
                            "the engine with logprobs_mode='raw_logprobs' (the unprocessed distribution)")
    prompts, completions, logprobs, ids = [], [], [], []
    for ro in outputs:
        for co in ro.outputs:
            toks = list(co.token_ids)
            lps = co.logprobs
            if lps is None or len(lps) != len(toks):
                raise DivtraceError(f"from_vllm(): request {ro.request_id} completion {co.index} has "
                                    f"{0 if lps is None else len(lps)} logprob entries for {len(toks)} tokens; "
                                    "sample with SamplingParams(logprobs=0) (or more)")
            vals = []
            for t, (tok, entry) in enumerate(zip(toks, lps)):
                got = entry.get(tok) if hasattr(entry, "get") else None
                if got is None:
                    raise DivtraceError(f"from_vllm(): request {ro.request_id} token {t}: vLLM returned no logprob "
                                        f"for the sampled token {tok}")
                vals.append(float(getattr(got, "logprob", got)))
            t32 = torch.tensor(vals, dtype=torch.float32)
            if t32.double().tolist() != vals and not any(v != v for v in vals):
                raise DivtraceError(f"from_vllm(): request {ro.request_id}: logprobs are not float32 values; this "
                                    "vLLM computes them in another dtype")
            prompts.append(list(ro.prompt_token_ids))
            completions.append(toks)
            logprobs.append(t32)
            ids.append(f"{ro.request_id}/{co.index}")
    return RolloutBatch(prompts, completions, logprobs, kind=kind, seq_ids=ids, meta={"logprobs_mode": mode})


def vllm_weights(llm) -> dict:
    """Weight fingerprints of an in-process `vllm.LLM`'s model (VLLM_ENABLE_V1_MULTIPROCESSING=0), under HF's
    names (`vllm-hf`: fused projections split, vocabulary padding cut), ready for `Ledger.weights`. For an engine
    in other processes, run `divtrace.cert.fingerprint_weights(model, "vllm-hf")` in its worker
    (`llm.collective_rpc`) and pass the dict."""
    from divtrace.cert.weights import fingerprint_weights

    try:
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    except AttributeError as e:
        raise DivtraceError(f"vllm_weights(): cannot reach this vllm.LLM's model in this process ({e}); fingerprint "
                            "it in the engine's worker and pass the dict") from None
    return fingerprint_weights(model, "vllm-hf")
