"""Runs for the origins tests: each side recorded by divtrace and, in the same run, watched by plain hooks
(origin_truth.ModuleRows), so a test can hold divtrace's answer against the hooks' ground truth.

Sides:
- `rollout`: HF generate with a KV cache over a left-padded batch (prefill, then one decode call per token);
- `trainer`: full-sequence forwards of the finished sequences in right-padded micro-batches, with position ids
  (or, `positions=False`, without: HF then numbers positions from the padding, as TRL's recompute does over
  left-padded prompts);
- `engine`: engine_model's vLLM-style engine (flat batch, fused projections and add+norm, LM head on the last
  rows), declaring its tokens and final rows;
- `fused_head`: a trainer whose head returns per-token log-probabilities [B, T-1] and no logits (TRL's
  `_get_per_token_logps`).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

import divtrace

sys.path.insert(0, str(Path(__file__).parent))
import origin_truth as ot  # noqa: E402
import token_cases as tc  # noqa: E402


def llama(hidden: int = 128, layers: int = 2, dtype=torch.float32, seed: int = 0):
    return tc.llama(dtype=dtype, layers=layers, seed=seed, hidden=hidden)


@dataclass
class Side:
    path: Path
    rows: ot.ModuleRows
    layouts: list
    seqs: list = field(default_factory=list)


def rollout(model, path, prompts, new_tokens: int = 4, mode: str = "full", **kw) -> Side:
    rows = ot.ModuleRows(model)
    try:
        seqs = tc.rollout(model, path, prompts, new_tokens=new_tokens, mode=mode, **kw)
    finally:
        rows.remove()
    return Side(Path(path), rows, ot.generate_layouts(prompts, new_tokens), seqs)


def trainer(model, path, seqs, micro_batch: int = 2, mode: str = "full", positions: bool = True,
            left_pad: bool = False, **kw) -> Side:
    rows = ot.ModuleRows(model)
    layouts = []
    try:
        with torch.no_grad(), divtrace.record(model, path, mode=mode, label="train", **kw):
            for i in range(0, len(seqs), micro_batch):
                chunk = seqs[i:i + micro_batch]
                ids, mask = (x.to(next(model.parameters()).device)
                             for x in (tc.left_padded if left_pad else tc.right_padded)(chunk))
                extra = {"position_ids": tc.positions(mask)} if positions else {}
                model(input_ids=ids, attention_mask=mask, **extra)
                t = ids.shape[1]
                toks = []
                for j, s in enumerate(chunk):
                    pad = [None] * (t - len(s))
                    own = [(i + j, p) for p in range(len(s))]
                    toks += (pad + own) if left_pad else (own + pad)
                layouts.append(ot.Layout((len(chunk), t), toks))
    finally:
        rows.remove()
    return Side(Path(path), rows, layouts, seqs)


def engine(hf, path, prompts, new_tokens: int = 4, causes=(), mode: str = "full", declare_final: bool = True, **kw):
    import engine_model as em

    eng = em.Engine.from_hf(hf, causes)
    rows = ot.ModuleRows(eng)
    try:
        with divtrace.record(eng, path, mode=mode, label="engine", **kw) as rec:
            seqs = em.generate(eng, prompts, new_tokens, rec=rec, declare_final=declare_final)
    finally:
        rows.remove()
    return Side(Path(path), rows, ot.engine_layouts(prompts, new_tokens), seqs)


class FusedHead(torch.nn.Module):
    """A causal LM whose forward returns the log-probability of each next token [B, T-1] (fp32 log_softmax of the
    logits, gathered at the next id), never the logits: TRL's per-token logps."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        logits = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        logps = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        return logps.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def fused_head(model, path, seqs, micro_batch: int = 2, mode: str = "full", **kw) -> Side:
    head = FusedHead(model)
    rows = ot.ModuleRows(head, names={n: n.removeprefix("lm.") if n != "" else "" for n, _ in head.named_modules()})
    layouts = []
    try:
        with torch.no_grad(), divtrace.record(head, path, mode=mode, label="train", **kw):
            for i in range(0, len(seqs), micro_batch):
                chunk = seqs[i:i + micro_batch]
                ids, mask = tc.right_padded(chunk)
                head(ids, attention_mask=mask, position_ids=tc.positions(mask))
                t = ids.shape[1]
                layouts.append(ot.Layout((len(chunk), t), [x for j, s in enumerate(chunk)
                                                            for x in [(i + j, p) for p in range(len(s))] + [None] * (t - len(s))]))
    finally:
        rows.remove()
    return Side(Path(path), rows, layouts, seqs)


def truth(a: Side, b: Side, final: str = "lm_head") -> ot.Truth:
    return ot.Truth(a.rows, a.layouts, b.rows, b.layouts, final=final)
