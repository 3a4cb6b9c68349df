"""Recording one rank of a torch.distributed run: where its trace goes, and what it says about the run.

Inside an initialized process group, `divtrace.record(model, "runs/tp2")` records this process into
`runs/tp2/rank-K` (K its global rank): a run directory is a set of rank traces (docs/sharded.md). Each rank's
meta.json carries `dist`: its rank, the world size, the backend, and (at close) the process groups and device
meshes its values and collectives refer to. No rank talks to another for this: nothing is exchanged while
recording.

In: the path given to `record` and torch.distributed's state. Out: the rank's trace path and its `dist` meta.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from divtrace.errors import DivtraceError
from divtrace.trace.files import META

RANK_DIR = "rank-{}"


@dataclass
class RankInfo:
    rank: int
    world_size: int
    backend: str

    def meta(self) -> dict:
        local = os.environ.get("LOCAL_RANK")
        return {"rank": self.rank, "world_size": self.world_size, "backend": self.backend,
                "local_rank": int(local) if local and local.isdigit() else None}


def current_rank(model=None, routed: bool = False) -> RankInfo | None:
    """This process's place in an initialized default process group, or None outside one. A group of one process
    whose model holds no DTensor is no sharded run: vLLM (and other engines and trainers) initialize a group of one
    for their single worker, and its recording is a plain trace at the path given. A DTensor model on a one-rank
    mesh is recorded as a run of one rank (its layouts and collectives are what a user checks there), and so is a
    recording that declares routed rows (`routed`: the 1-rank side of an expert-parallel comparison, whose routed
    values are keyed by token and slot as the expert-parallel run's are)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    if world == 1 and not routed and not _holds_dtensor(model):
        return None
    try:
        backend = str(dist.get_backend())
    except Exception:
        backend = "?"
    return RankInfo(dist.get_rank(), world, backend)


def _holds_dtensor(model) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    if not hasattr(model, "parameters"):
        return False
    return any(isinstance(t, DTensor) for t in (*model.parameters(), *model.buffers()))


def rank_path(path, info: RankInfo) -> Path:
    """Where rank `info` records when asked to record into the run directory `path`: `path/rank-K`. A `path` that
    holds a single-process trace is refused (a run directory holds only rank traces)."""
    p = Path(path)
    if (p / META).is_file():
        raise DivtraceError(f"{p}: holds a single-process trace; inside a process group each rank records into "
                            f"{p}/rank-K, so choose a new directory for the run")
    if p.exists() and not p.is_dir():
        raise DivtraceError(f"{p}: exists and is not a directory")
    return p / RANK_DIR.format(info.rank)


def attach(recorder, info: RankInfo):
    """Wire a rank's parts into `recorder` once its writer is open: the values' layouts (record/placements.py),
    the collectives (record/collectives.py) and the rows of sharded values. Returns the Placements."""
    from divtrace.record.collectives import Collectives
    from divtrace.record.placements import Placements

    pl = Placements(recorder.model, recorder.writer, recorder.warnings,
                    recorder.declared_layouts, recorder.values)
    recorder.calls.placements = recorder.op_records.placements = pl
    pl.stack = recorder.calls.stack
    recorder.op_records.collectives = Collectives(pl, info.rank)
    recorder.token_rows.shard_rows = pl.shard_rows
    recorder.values.block_fp = pl.block_fp  # (a block op result: its fingerprint and partial from one read)
    if pl.declared is not None and pl.declared.modules:
        recorder.token_rows.defer_rows = pl.defer_rows
    # The objects that exist when the block starts (the model, torch.distributed's and DTensor's machinery: some
    # 400k on an HF TP rank) are left out of garbage collection until it ends: a TP forward's own allocations
    # made each collection walk them, and recording adds allocations (a TP rank's hash recording: 0.86 s against
    # 0.50 s frozen, its plain forward 0.45 s). Not where the process froze objects itself (a forking server).
    import gc

    pl.froze_gc = gc.get_freeze_count() == 0
    if pl.froze_gc:
        gc.freeze()
    return pl


def closing_meta(info: RankInfo, placements) -> dict:
    """meta.json's `dist` at close: the rank, and the meshes and groups its layouts refer to (the objects frozen
    at the start are handed back to the garbage collector)."""
    d = info.meta()
    if placements is not None:
        if getattr(placements, "froze_gc", False):
            import gc

            gc.unfreeze()
            placements.froze_gc = False
        d["meshes"] = placements.meshes
    return d
