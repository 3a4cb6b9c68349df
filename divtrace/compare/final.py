"""The RL-facing summary of the root output: how far apart the two policies' logprobs are."""
from __future__ import annotations

import re

import torch


def _train_first(label_a: str, label_b: str) -> bool:
    """KL is reported as KL(train || infer); a side is 'train' when its label says so, else A is."""
    return not ("train" in (label_b or "").lower() and "train" not in (label_a or "").lower())


_LOGITS_NAME = re.compile(r"logit|logprob|log_prob")


def is_logprobs(x: torch.Tensor) -> bool:
    """Every row along the last dim is normalized log-probabilities: logsumexp about 0 (0.05: logprobs computed in
    bf16 and stored in fp32 are off by a few bf16 ULPs; raw logits are off by about log(vocab))."""
    if x.dim() == 0 or x.shape[-1] < 2 or not x.is_floating_point() or x.numel() == 0:
        return False
    lse = torch.logsumexp(x.double(), dim=-1)
    return bool(torch.isfinite(lse).all() and lse.abs().max() <= 0.05)


def output_caveat(name: str | None, a: torch.Tensor, b: torch.Tensor) -> str | None:
    """A caveat for the logprob figures when the output is not known to be logits or logprobs, else None."""
    if (name and _LOGITS_NAME.search(name)) or (is_logprobs(a) and is_logprobs(b)):
        return None
    what = f"the output {name}" if name else "the output"
    return (f"{what} is neither named logits nor normalized log-probabilities: these figures take its last dim as "
            "logits over a vocabulary, and mean nothing if it is something else (hidden states, a value head, a "
            "reward)")


def logprob_mismatch(a: torch.Tensor, b: torch.Tensor, label_a: str = "a", label_b: str = "b",
                     name: str | None = None) -> dict:
    """max |dlogprob|, mean KL(train||infer) per position and argmax agreement, in float64.

    `a`/`b` may be logits or logprobs: log_softmax is idempotent on logprobs, so both are normalized first.
    `caveat` says when the output (named `name`) is known to be neither."""
    if a.shape != b.shape:
        return {"max_abs_logprob_diff": None, "kl": None, "argmax_agreement": None,
                "note": f"shapes differ: {list(a.shape)} vs {list(b.shape)}"}
    if a.numel() == 0:  # an empty micro-batch: no position to summarise (max() of nothing raises)
        return {"max_abs_logprob_diff": None, "kl": None, "argmax_agreement": None,
                "note": f"no positions: shape {list(a.shape)}"}
    lpa = torch.log_softmax(a.double(), dim=-1)
    lpb = torch.log_softmax(b.double(), dim=-1)
    p, q = (lpa, lpb) if _train_first(label_a, label_b) else (lpb, lpa)
    finite = torch.isfinite(p) & torch.isfinite(q)
    diff = (lpa - lpb).abs()
    diff = torch.where(torch.isfinite(lpa) & torch.isfinite(lpb), diff, torch.where(lpa == lpb, 0.0, float("inf")))
    kl_terms = torch.where(finite, p.exp() * (p - q), torch.zeros_like(p))
    kl = kl_terms.sum(-1).mean().item()
    agree = (lpa.argmax(-1) == lpb.argmax(-1)).double().mean().item()
    train, infer = (label_a, label_b) if _train_first(label_a, label_b) else (label_b, label_a)
    return {"max_abs_logprob_diff": diff.max().item(), "mean_abs_logprob_diff": diff.mean().item(), "kl": kl,
            "kl_direction": f"{train}||{infer}", "argmax_agreement": agree, "positions": int(lpa.numel() // lpa.shape[-1]),
            "caveat": output_caveat(name, a, b)}
