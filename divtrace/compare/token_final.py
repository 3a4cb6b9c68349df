"""The RL-facing mismatch per shared token: the numbers RL infra engineers read off their dashboards.

For each token both runs computed logits for (float64, after log_softmax of each side's row):
- `dlogprob` of the next token of its sequence (where the trace knows it): logp_train(next) - logp_infer(next);
- KL over the whole vocabulary, both directions: KL(train||infer) and KL(infer||train);
- k3 = exp(r) - 1 - r with r = logp_train(next) - logp_infer(next): Schulman's unbiased, always positive
  estimator of KL(infer||train) from the sampled tokens, as RL trainers log it;
- token_mult_prob_error = exp(|r|): 1.0 where the two policies give the sampled token the same probability
  (the mean, as NeMo-RL logs it).
"""
from __future__ import annotations

import math

import torch

from divtrace.compare.final import _train_first, is_logprobs, output_caveat
from divtrace.trace import token_layout as layout


def _row(tok, final: dict, key: int, cache: dict):
    """The token's logits row (a tensor), from the value `final` (final_rows) names for it, or None."""
    got = final.get(key)
    if got is None:
        return None
    cid, cell, vid = got
    if not tok.trace.has_bytes(vid):
        return None
    x = cache.get(vid)
    if x is None:
        x = cache[vid] = tok.trace.tensor(vid)
    g = tok.index.grids[cid]
    return layout.row_of(x, tok.index.index[vid][1], g.shape, cell)


def _next_ids(tok) -> dict:
    """(sequence number, position) -> token id, over every grid of the trace."""
    out = {}
    for g in tok.index.grids.values():
        for s, p, i in zip(g.seq, g.pos, g.ids):
            if s >= 0:
                out[(s, p)] = i
    return out


def per_token_logprob_metrics(sa, sb, groups, label_a: str, label_b: str, fin_a: dict, fin_b: dict) -> dict:
    train_first = _train_first(label_a, label_b)
    nxt = _next_ids(sa)
    nxt_b = _next_ids(sb)
    kl_ab, kl_ba, dlp, k3, mult, worst = [], [], [], [], [], None
    cache_a, cache_b = {}, {}
    normalized, name = True, None  # for the caveat: every row logprobs, or the output named logits
    for (ra, rb), toks in groups.items():
        ga, gb = sa.index.grids[ra], sb.index.grids[rb]
        for k, ca, cb in toks:
            xa, xb = _row(sa, fin_a, k, cache_a), _row(sb, fin_b, k, cache_b)
            if xa is None or xb is None or xa.numel() != xb.numel():
                continue
            if name is None:
                name = _output_name(sa, fin_a, k)
            normalized = normalized and is_logprobs(xa.reshape(-1)) and is_logprobs(xb.reshape(-1))
            lpa = torch.log_softmax(xa.double().reshape(-1), -1)
            lpb = torch.log_softmax(xb.double().reshape(-1), -1)
            fin = torch.isfinite(lpa) & torch.isfinite(lpb)
            kl_ab.append(float(torch.where(fin, lpa.exp() * (lpa - lpb), 0).sum()))
            kl_ba.append(float(torch.where(fin, lpb.exp() * (lpb - lpa), 0).sum()))
            n = nxt.get((ga.seq[ca], ga.pos[ca] + 1))
            if n is None:
                n = nxt_b.get((gb.seq[cb], gb.pos[cb] + 1))
            if n is not None and 0 <= n < lpa.numel():
                d = float(lpa[n] - lpb[n])
                r = d if train_first else -d  # logp_train - logp_infer
                dlp.append(abs(d))
                if math.isfinite(r):
                    k3.append(math.expm1(r) - r)
                    mult.append(math.exp(abs(r)))
                if worst is None or abs(d) > worst[0]:
                    worst = (abs(d), ga.pos[ca], ga.seq[ca])
    if not kl_ab:
        return {}
    train, infer = (label_a, label_b) if train_first else (label_b, label_a)
    kl_ti, kl_it = (kl_ab, kl_ba) if train_first else (kl_ba, kl_ab)
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    return {"tokens_with_logits": len(kl_ab), "kl_direction": f"{train}||{infer}",
            "kl": mean(kl_ti), "kl_reverse": mean(kl_it), "kl_max": max(kl_ti),
            "max_abs_logprob_diff": max(dlp) if dlp else None, "mean_abs_logprob_diff": mean(dlp),
            "kl_k3": mean(k3), "token_mult_prob_error": mean(mult),
            "tokens_with_next": len(dlp), "caveat": None if normalized else output_caveat(name, *_NOT_LOGPROBS)}


_NOT_LOGPROBS = (torch.zeros(2), torch.zeros(2))  # rows that are not logprobs: output_caveat then goes by the name


def _output_name(tok, final: dict, key: int) -> str | None:
    """The output key (`out`, `out.logits`) of the value that holds the token's final row."""
    got = final.get(key)
    call = tok.trace.calls.get(got[0]) if got else None
    return next((k for k, v in call.outputs if v == got[2]), None) if call is not None else None
