"""A run directory: the traces of the ranks of one torch.distributed run (`RUN/rank-0`, `RUN/rank-1`, ...), read
back and checked against each other (docs/sharded.md). Each rank's trace is a whole trace of its own (`Trace`);
this reads them and their layouts.jsonl, and says which ranks are missing or stopped. Putting shards together is
divtrace.align.shards' job.

In: a directory written by `divtrace.record(model, RUN)` inside a process group. Out: `RunDir` (each rank's
`Trace` and `RankLayouts`, the world size, the ranks missing).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from divtrace.errors import DivtraceError
from divtrace.trace.files import META
from divtrace.trace.layouts import RankLayouts, read_layouts

_RANK = re.compile(r"rank-(\d+)$")


def rank_dirs(path) -> dict[int, Path]:
    """rank -> its trace directory, for the `rank-K` subdirectories of `path` that hold a meta.json."""
    p = Path(path)
    out = {}
    try:
        entries = list(p.iterdir())
    except OSError:
        return out
    for d in entries:
        m = _RANK.match(d.name)
        if m and d.is_dir() and (d / META).is_file():
            out[int(m.group(1))] = d
    return out


def is_run_dir(path) -> bool:
    """Whether `path` is a run directory: no meta.json of its own, and at least one `rank-K` trace."""
    p = Path(path)
    return p.is_dir() and not (p / META).is_file() and bool(rank_dirs(p))


def _dist_of(d: Path) -> dict:
    try:
        meta = json.loads((d / META).read_bytes())
    except (OSError, ValueError):
        raise DivtraceError(f"{d / META}: unreadable trace metadata") from None
    dist = meta.get("dist") if isinstance(meta, dict) else None
    if not isinstance(dist, dict) or not isinstance(dist.get("rank"), int) or not isinstance(dist.get("world_size"), int):
        raise DivtraceError(f"{d / META}: not a rank's trace (no dist.rank / dist.world_size): a run directory holds "
                            "only traces recorded inside a process group")
    return dist


class RunDir:
    """The rank traces of one run directory, opened and checked: same world size, each rank where its name says,
    one mode and one fingerprint scheme. `traces[rank]`, `layouts[rank]`; `missing` lists the ranks with no trace."""

    def __init__(self, path):
        from divtrace.trace.reader import Trace

        self.path = Path(path)
        dirs = rank_dirs(self.path)
        if not dirs:
            raise DivtraceError(f"{self.path}: not a run directory (no rank-K trace in it)")
        worlds = {}
        for r, d in sorted(dirs.items()):
            dist = _dist_of(d)
            if dist["rank"] != r:
                raise DivtraceError(f"{d / META}: records rank {dist['rank']} but lies in {d.name}")
            worlds[r] = dist["world_size"]
        if len(set(worlds.values())) != 1:
            raise DivtraceError(f"{self.path}: holds ranks of runs of different sizes ("
                                + ", ".join(f"rank-{r}: world {w}" for r, w in sorted(worlds.items()))
                                + "); record each run into its own directory")
        self.world_size = next(iter(worlds.values()))
        extra = [r for r in dirs if r >= self.world_size]
        if extra:
            raise DivtraceError(f"{self.path}: rank-{extra[0]} lies outside the run's world of {self.world_size}")
        self.traces = {r: Trace(d) for r, d in sorted(dirs.items())}
        self.layouts: dict[int, RankLayouts] = {r: read_layouts(t) for r, t in self.traces.items()}
        self.missing = [r for r in range(self.world_size) if r not in self.traces]
        modes = {t.mode for t in self.traces.values()}
        schemes = {t.hash_scheme for t in self.traces.values()}
        if len(modes) > 1 or len(schemes) > 1:
            raise DivtraceError(f"{self.path}: its ranks were recorded in different modes or fingerprint schemes "
                                f"({sorted(modes)}, {sorted(schemes)}); record every rank with one divtrace and mode")

    @property
    def ranks(self) -> list[int]:
        return sorted(self.traces)

    def stopped(self) -> dict[int, str]:
        """rank -> its status, for the ranks whose trace is incomplete."""
        out = {}
        for r, t in self.traces.items():
            if not t.complete:
                err = str(t.meta.get("error") or "").splitlines()[0] if t.meta.get("error") else ""
                out[r] = t.status + (f", {err[:160]}" + ("..." if len(err) > 160 else "") if err else "")
        return out
