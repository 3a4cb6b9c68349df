"""`show --check`: verify every stored tensor of a trace against its recorded fingerprint."""
from __future__ import annotations

from divtrace.errors import DivtraceError


def check_trace(t) -> dict:
    problems = []
    blobs_seen = set()
    n = 0
    for vid, v in t.values.items():
        if v.blob is None or v.blob in blobs_seen:
            continue
        blobs_seen.add(v.blob)
        n += 1
        try:
            t.tensor(vid)
        except DivtraceError as e:
            problems.append(str(e))
    if not t.complete:
        problems.append(f"{t.path}: trace is incomplete (status: {t.meta.get('status')})")
    return {"ok": not problems, "tensors": n, "problems": problems}
