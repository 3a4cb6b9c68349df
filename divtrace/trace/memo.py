"""The recorder's small caches (layouts, plans, partials kept per shape or key): a few entries come back every layer,
so they stay small; one that grows past its bound (a run of ever new shapes) is emptied rather than grown."""
from __future__ import annotations


def bounded_put(d: dict, key, value, limit: int = 4096) -> None:
    """d[key] = value, emptying `d` first when it holds `limit` entries already."""
    if len(d) >= limit:
        d.clear()
    d[key] = value
