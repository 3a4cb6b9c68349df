"""A run's token files as one: `RunTokenIndex` has what divtrace.trace.token_store.TokenIndex has (grids,
first_ids, index, bin), over the run view's root calls and values (divtrace.align.shards.view).

Each group's representative brings its grids (call ids moved to the view's, sequence numbers kept apart per
group). A value's rows are the representative's where the value is whole; the sum of its blocks' row partials
where it is a block of a value cut along its row dims (each rank fingerprinted its block's rows at their global
offsets); and none where the value is a rank's own piece, a partial sum, or a block without row partials: its
whole key (divtrace.align.shards.keys.RankLocal) then leaves it out of comparisons, and the walker retraces past
it.
"""
from __future__ import annotations

from dataclasses import replace

from divtrace.trace import token_layout as layout


class RunTokenIndex:
    def __init__(self, view):
        import numpy as np

        self.path = view.path
        self.grids, self.first_ids, self.index = {}, {}, {}
        idx = {r: t.token_index() for r, t in view.run.traces.items()}
        chunks, size, seq_base, root_base = [], 0, 0, 0
        for s in view.segments:
            ti = idx[s.rank]
            for cid, g in ti.grids.items():
                self.grids[cid + s.cbase] = replace(g, call_id=cid + s.cbase, root_call=g.root_call + root_base,
                                                    seq=[x + seq_base if x >= 0 else x for x in g.seq])
            root_base += sum(1 for c in s.trace.calls.values() if c.module == "")
            for n, ids in ti.first_ids.items():
                self.first_ids[n + seq_base] = ids
            seq_base += max(ti.first_ids, default=-1) + 1
            for vid, (cid, code, off) in ti.index.items():
                vp = s.group.values.get(vid)
                g = ti.grids.get(cid)
                if vp is None or g is None:
                    continue
                n = layout.row_count(code, g.shape)
                rows = None
                if off >= 0 and vp.kind == "whole":
                    rows = ti.bin[off:off + n]
                elif off >= 0 and vp.kind == "blocks" and vp.rows:
                    rows = _sum_rows(idx, vp.rows, code, n)
                if off < 0:
                    self.index[vid + s.vbase] = (cid + s.cbase, code, -1)  # ("x", "?": compared whole)
                    continue
                if rows is None or len(rows) != n:
                    continue  # no rows to compare: its whole key (a rank's own piece, a partial sum) decides
                chunks.append(np.asarray(rows, dtype="<u8"))
                self.index[vid + s.vbase] = (cid + s.cbase, code, size)
                size += n
        self.bin = np.concatenate(chunks) if chunks else np.zeros(0, dtype="<u8")

    @property
    def has_tokens(self) -> bool:
        return bool(self.grids)


def _sum_rows(idx: dict, parts: list, code: str, n: int):
    """The sum (mod 2**64) of the row partials of each block (rank, vid), or None where a block has no rows."""
    import numpy as np

    total = np.zeros(n, dtype="<u8")
    for r, q in parts:
        e = idx[r].index.get(q)
        if e is None or e[2] < 0 or e[1] != code:
            return None
        rows = idx[r].bin[e[2]:e[2] + n]
        if len(rows) != n:
            return None
        total += rows  # (unsigned addition wraps mod 2**64)
    return total
