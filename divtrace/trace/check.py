"""`show --check`: verify a whole trace.

Opening the trace already verified records.jsonl against its sha256 and validated every record. Here every
stored tensor is checked against its fingerprint (and, in older traces that carry one, every shard file
against its sha256 first), every view stored as "rebuild from the op" against the fingerprint derived from
its op and input, the token files against their sha256 and line by line (divtrace/trace/token_checks.py), and
params.jsonl likewise (divtrace/trace/param_names.py).
(meta.json was checked against the records when the trace was opened, see trace/integrity.py; a file of the trace
that cannot be read but is not needed, a closed trace's checksums.jsonl, is a problem here.)"""
from __future__ import annotations

from divtrace.errors import DivtraceError


def check_trace(t) -> dict:
    problems = list(t.shard_problems())
    token_problems = t.token_problems()  # (a trace written before token checksums adds its one warning here)
    blobs_seen = set()
    n = 0
    bad_shards = {p.split(":")[0] for p in problems}
    for vid, (blob, shard) in t.vblob.items():  # every value with stored bytes, in the order defined
        if blob in blobs_seen:
            continue
        blobs_seen.add(blob)
        n += 1
        if str(t.path / shard) in bad_shards or not t.shard_has_sha256(shard):
            continue  # already reported for the whole file, or its tensors already checked one by one
        try:
            t.tensor(vid)
        except DivtraceError as e:
            problems.append(str(e))
    views = sorted(t.vderived) if t.mode == "full" else []
    problems += [p for p in map(t.derived_problem, views) if p]  # stored as "rebuild from the op": must agree
    if not t.verified:
        problems += t.warnings
    problems += t.file_problems  # a file of the trace that cannot be read (each also a warning when opened)
    problems += token_problems
    if getattr(t, "run", None) is None:  # the parameter names (trace/param_names.py): bytes and lines
        from divtrace.trace.param_names import read_param_names

        try:
            read_param_names(t)
        except DivtraceError as e:
            problems.append(str(e))
    if not t.complete:
        problems.append(f"{t.path}: trace is incomplete (status: {t.status})")
    tokens = None
    if not token_problems and t.token_index().has_tokens:
        ix = t.token_index()
        tokens = {"grids": len(ix.grids), "rows": len(ix.bin), "values_with_rows": len(ix.index),
                  "verified": ix.verified}
    return {"ok": not problems, "tensors": n, "views": len(views), "tokens": tokens, "problems": problems}
