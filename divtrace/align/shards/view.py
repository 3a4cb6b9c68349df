"""`RunView`: a run directory seen as one trace of global values, so bisect, the walker, token alignment and
repro read a sharded run through the same interface as a single-process trace.

The view holds the records of each data group's representative rank (divtrace.align.shards.plan), one group
after the other: for a tensor-parallel run, rank 0's records; for a data-parallel run, every rank's (their root
calls follow one another, call numbers continuing). Each value's key is its global value's (plan.ValuePlan.key);
its bytes (full mode) are put together from the ranks' blocks when asked for.

In: a RunDir (divtrace.trace.run) and its Plan. Out: a Trace (a subclass, so code that checks for one takes it).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from divtrace.align.shards.keys import RankLocal
from divtrace.errors import DivtraceError
from divtrace.trace.reader import Trace
from divtrace.trace.records import ModuleCall, ModuleEnter, ModuleExit, OpRecord


class Segment:
    """One group's representative inside the view: its trace and the offsets of its vids, records and calls."""

    def __init__(self, group, trace, vbase: int, ibase: int, cbase: int):
        self.group, self.trace, self.vbase, self.ibase, self.cbase = group, trace, vbase, ibase, cbase
        self.rank = group.rep
        self.vend = vbase + (max(trace.vkey, default=-1) + 1)
        self.iend = ibase + len(trace.rcall)
        self.cend = cbase + (max(trace.calls, default=-1) + 1)


def _remap(x, vb: int):
    """An encoded argument with every {"$v": vid} moved by `vb`."""
    if isinstance(x, dict):
        if "$v" in x and len(x) == 1:
            return {"$v": x["$v"] + vb}
        return {k: _remap(v, vb) for k, v in x.items()}
    if isinstance(x, list):
        return [_remap(v, vb) for v in x]
    return x


class _RunRecords(Sequence):
    def __init__(self, view):
        self._v = view

    def __len__(self):
        return len(self._v.rcall)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        s = self._v.segment_of_index(i)
        rec = s.trace.records[i - s.ibase]
        if not (s.vbase or s.ibase or s.cbase):
            return rec
        vb, cb = s.vbase, s.cbase
        if isinstance(rec, OpRecord):
            return replace(rec, index=i, call_id=rec.call_id + cb, args=_remap(rec.args, vb),
                           kwargs=_remap(rec.kwargs, vb), inputs=[v + vb for v in rec.inputs],
                           outputs=[v + vb for v in rec.outputs], out=_remap(rec.out, vb))
        if isinstance(rec, ModuleEnter):
            return replace(rec, index=i, call_id=rec.call_id + cb, inputs=[(k, v + vb) for k, v in rec.inputs],
                           parent=None if rec.parent is None else rec.parent + cb)
        assert isinstance(rec, ModuleExit)
        return replace(rec, index=i, call_id=rec.call_id + cb, outputs=[(k, v + vb) for k, v in rec.outputs])


class _RunValues(Mapping):
    def __init__(self, view):
        self._v = view

    def __getitem__(self, vid):
        s = self._v.segment_of_vid(vid)
        v = s.trace.values[vid - s.vbase]
        vp = s.group.values.get(vid - s.vbase)
        changes = {}
        if s.vbase or s.ibase:
            changes.update(vid=vid, producer=None if v.producer is None else v.producer + s.ibase)
        if vp is not None and vp.kind == "blocks":
            from divtrace.trace.records import contiguous_stride

            changes.update(shape=list(vp.gshape), stride=contiguous_stride(list(vp.gshape)), hash=vp.key[2],
                           blob=None, shard=None, derived=False, stats={})
        return replace(v, **changes) if changes else v

    def __iter__(self):
        return iter(self._v.vkey)

    def __len__(self):
        return len(self._v.vkey)

    def __contains__(self, vid):
        return vid in self._v.vkey


class RunView(Trace):
    """A run directory as one trace of global values (see the module docstring)."""

    def __init__(self, run, groups, findings):  # noqa: super().__init__ reads a trace directory; this reads ranks
        self.run = run
        self.path = Path(run.path)
        self.groups = groups
        self.findings = list(findings)
        rep = run.traces[groups[0].rep]
        self.meta = dict(rep.meta)
        self._full = self.meta["mode"] == "full"
        self.torn_tail = False
        self.verified = all(t.verified for t in run.traces.values())
        self.read_fast = self.read_native = False
        self.warnings = [f"rank {r}: {w}" for r, t in run.traces.items() for w in t.warnings]
        self.file_problems = [f"rank {r}: {p}" for r, t in run.traces.items() for p in t.file_problems]
        self._shard_sums = {}
        self._reset()
        self._build()
        self._shards = {}
        self._shards_verified = False
        self._token_index = None
        self.meta.update(self._run_meta())

    # -- building the index ---------------------------------------------------------------------------------
    def _build(self) -> None:
        segs, vb, ib, cb = [], 0, 0, 0
        for g in self.groups:
            s = Segment(g, self.run.traces[g.rep], vb, ib, cb)
            segs.append(s)
            vb, ib, cb = s.vend, s.iend, s.cend
        self.segments = segs
        if len(segs) == 1:
            t = segs[0].trace
            self.calls, self.rcall, self.rop, self.rin, self.rout = t.calls, t.rcall, t.rop, t.rin, t.rout
            self.vprod, self.vsrc = t.vprod, t.vsrc
            self.vkey = {v: vp.key for v, vp in segs[0].group.values.items()}
            self.vderived = _view_derived(t, segs[0].group.values, 0)
            return
        self.calls, self.rcall, self.rop, self.rin, self.rout = {}, [], [], [], []
        self.vprod, self.vsrc, self.vkey, self.vderived = {}, {}, {}, set()
        counts: dict[str, int] = {}
        for s in segs:
            t, vb, ib, cb = s.trace, s.vbase, s.ibase, s.cbase
            self.rcall += [c + cb for c in t.rcall]
            self.rop += t.rop
            self.rin += [None if x is None else tuple(v + vb for v in x) for x in t.rin]
            self.rout += [None if x is None else tuple(v + vb for v in x) for x in t.rout]
            self.vprod.update((v + vb, i + ib) for v, i in t.vprod.items())
            self.vsrc.update((v + vb, i + ib) for v, i in t.vsrc.items())
            self.vkey.update((v + vb, vp.key) for v, vp in s.group.values.items())
            self.vderived.update(_view_derived(t, s.group.values, vb))
            mine: dict[str, int] = {}
            for cid in sorted(t.calls):
                c = t.calls[cid]
                mine[c.module] = mine.get(c.module, 0) + 1
                self.calls[cid + cb] = ModuleCall(
                    cid + cb, c.module, c.call + counts.get(c.module, 0),
                    None if c.parent is None else c.parent + cb, c.enter_index + ib,
                    [(k, v + vb) for k, v in c.inputs], None if c.exit_index is None else c.exit_index + ib,
                    [(k, v + vb) for k, v in c.outputs], [x + cb for x in c.children], [x + ib for x in c.ops])
            for m, n in mine.items():
                counts[m] = counts.get(m, 0) + n

    def _run_meta(self) -> dict:
        run = self.run
        stopped = run.stopped()
        complete = not run.missing and not stopped
        parts = [f"rank {r} has no trace" for r in run.missing]
        parts += [f"rank {r} stopped ({s})" for r, s in sorted(stopped.items())]
        unseen = []
        for t in run.traces.values():
            unseen += [u for u in (t.meta.get("unseen") or []) if u not in unseen]
        from divtrace.align.shards.parted import partings

        parted = partings(run, self.groups)
        last = self._last_root_outputs()
        if complete and not parted and last and all(type(self.vkey[v]) is RankLocal for _, v in last):
            unseen.append("the final output is each rank's own piece and no layout says how the pieces make the "
                          "whole, so it cannot be compared with another run's")
        out = {"complete": complete, "status": "complete" if complete else "; ".join(parts), "unseen": unseen,
               "label": self.meta.get("label") or self.path.name,
               "run": {"world_size": run.world_size, "ranks": run.ranks, "missing": run.missing,
                       "groups": [g.ranks for g in self.groups]}}
        if parted:
            out["parted"] = parted
        if not complete:
            errs = [f"rank {r}: {t.meta['error']}" for r, t in run.traces.items() if t.meta.get("error")]
            out["error"] = "; ".join(errs) or None
        return out

    def _last_root_outputs(self):
        roots = [c for c in self.calls.values() if c.parent is None and c.exit_index is not None]
        return max(roots, key=lambda c: c.exit_index).outputs if roots else []

    # -- what Trace offers ----------------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return bool(self.meta.get("complete"))

    @property
    def status(self) -> str:
        return self.meta.get("status", "?")

    @property
    def label(self) -> str:
        return self.meta.get("label") or self.path.name

    @property
    def records(self):
        return _RunRecords(self)

    @property
    def values(self):
        return _RunValues(self)

    def segment_of_vid(self, vid: int) -> Segment:
        for s in self.segments:
            if s.vbase <= vid < s.vend:
                return s
        raise KeyError(vid)

    def segment_of_index(self, i: int) -> Segment:
        for s in self.segments:
            if s.ibase <= i < s.iend:
                return s
        raise IndexError(i)

    def plan_of(self, vid: int):
        """(segment, the representative's vid, its ValuePlan) of view value `vid`."""
        s = self.segment_of_vid(vid)
        return s, vid - s.vbase, s.group.values[vid - s.vbase]

    def has_bytes(self, vid: int) -> bool:
        if vid not in self.vkey:
            raise KeyError(vid)
        s, v, vp = self.plan_of(vid)
        if vp.kind == "blocks":
            return all(self.run.traces[r].has_bytes(q) for r, q, _ in vp.blocks)
        return s.trace.has_bytes(v)

    def real_key(self, vid: int) -> tuple:
        s, v, vp = self.plan_of(vid)
        if vp.real is not None:
            return vp.real
        if vp.kind != "whole" or v not in s.trace.vderived:
            return self.vkey[vid]
        return s.trace.real_key(v)

    def tensor(self, vid: int):
        s, v, vp = self.plan_of(vid)
        if vp.kind != "blocks":
            return s.trace.tensor(v)
        from divtrace.align.shards.tensors import assemble

        return assemble(self.run, vp, where=f"{self.path} value {vid}")

    def verify_shards(self) -> None:
        for t in self.run.traces.values():
            verify = getattr(t, "verify_shards", None)
            if verify is not None:
                verify()

    def token_index(self):
        """The run's token files as one TokenIndex-like object (divtrace.align.shards.tokens)."""
        if self._token_index is None:
            from divtrace.align.shards.tokens import RunTokenIndex

            self._token_index = RunTokenIndex(self)
        return self._token_index

    def check_meta(self) -> None:  # each rank's trace was checked when it was opened
        return None


def _view_derived(t, values: dict, vb: int) -> set:
    """The view's values keyed by a derived fingerprint: a rank's own derived view, or blocks keyed as one (plan.real,
    also where the rank hashed its view from its bytes)."""
    return {v + vb for v, vp in values.items() if (v in t.vderived and _derived(vp)) or vp.real is not None}


def _derived(vp) -> bool:
    """Whether a value keyed by a derived view fingerprint: a rank's own view, or blocks keyed as one (plan.real)."""
    return vp.kind != "blocks" or vp.real is not None


def raise_if_unpairable(a, b) -> None:
    """Bad input: a data-parallel run (ranks holding different inputs) compared by calls, where its root calls
    cannot pair with the other side's."""
    for t, other in ((a, b), (b, a)):
        if isinstance(t, RunView) and len(t.groups) > 1:
            raise DivtraceError(
                f"{t.path}: its ranks hold different inputs ({', '.join(str(g.ranks) for g in t.groups)}: data "
                "parallel), so its calls cannot be paired with another run's by module and call number; compare it "
                "by tokens (record HF-style calls with input_ids, or declare tokens with rec.tokens(...)) "
                "with --align tokens")
