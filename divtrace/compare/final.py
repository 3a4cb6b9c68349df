"""The RL-facing summary of the root output: how far apart the two policies' logprobs are."""
from __future__ import annotations

import torch


def _train_first(label_a: str, label_b: str) -> bool:
    """KL is reported as KL(train || infer); a side is 'train' when its label says so, else A is."""
    return not ("train" in (label_b or "").lower() and "train" not in (label_a or "").lower())


def logprob_mismatch(a: torch.Tensor, b: torch.Tensor, label_a: str = "a", label_b: str = "b") -> dict:
    """max |dlogprob|, mean KL(train||infer) per position and argmax agreement, in float64.

    `a`/`b` may be logits or logprobs: log_softmax is idempotent on logprobs, so both are normalized first."""
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
            "kl_direction": f"{train}||{infer}", "argmax_agreement": agree, "positions": int(lpa.numel() // lpa.shape[-1])}
