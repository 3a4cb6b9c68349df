"""Where the ranks of a data group part: they ran different ops (an MoE layer whose experts' loop runs only over the
experts that got rows, as HF Mixtral's does, runs fewer ops on a rank whose expert got none). Past that record the
ranks' values cannot be put together (plan.py keys them RankLocal), so a comparison that found no origin before it
is inconclusive, and says where, rank by rank (divtrace.compare.verdict). divtrace saw every op: this is no
computation it did not see (meta.json's `unseen`).

In: a RunDir and its groups (plan.Group, with each rank's aligned length). Out: one sentence per parting rank pair.
"""
from __future__ import annotations


def _module(t, i: int) -> str:
    c = t.calls[t.rcall[i]]
    return f"{c.module or '<root>'} (call {c.call})"


def _what(t, i: int) -> str:
    """Record i of trace `t`, in words: the op and the module that runs it, or the module entered or left."""
    if i >= len(t.rcall):
        return "no more records (its trace ends there)"
    op = t.rop[i]
    if op is not None:
        return f"{op} in {_module(t, i)}"
    c = t.calls[t.rcall[i]]
    return f"{'enters' if c.enter_index == i else 'leaves'} {c.module or '<root>'} (call {c.call})"


def partings(run, groups) -> list[str]:
    """Each pair (a group's representative, another rank of it) whose op sequences part while both recorded on: the
    record where they part and what each rank runs there. A rank that merely stopped early is no parting (the run's
    status says so)."""
    out = []
    for g in groups:
        t0 = run.traces[g.rep]
        for q in g.ranks[1:]:
            tq, i = run.traces[q], g.aligned.get(q)
            if i is None:
                continue
            n0, nq = len(t0.rcall), len(tq.rcall)
            if not ((i < n0 and i < nq) or (i < max(n0, nq) and t0.complete and tq.complete)):
                continue
            out.append(f"ranks {g.rep} and {q} run different ops from record {i} on (rank {g.rep}: {_what(t0, i)}; "
                       f"rank {q}: {_what(tq, i)})")
    return out
