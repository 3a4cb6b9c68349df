"""GPU check (one chip) for sharded runs: torch's DTensor tensor-parallel code paths (parallelize_module with
ColwiseParallel and RowwiseParallel) on a single-GPU mesh (a one-rank NCCL group), recorded in hash mode; every
CUDA synchronisation divtrace's own code makes while recording is caught (torch.cuda.set_sync_debug_mode) and
attributed to the divtrace module that made it. The sharded-run parts (record/placements.py, collectives.py,
shard_rules.py, trace/layouts.py) must make none; the lines name any other module that syncs (the writer's device
path is another issue's).

    python bench/gpu_check_sharded.py        # exit 0: no sync from the sharded-run parts, 1: some, 2: no GPU
"""
from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback
import warnings
from collections import Counter

SHARDED_PARTS = ("record/placements.py", "record/collectives.py", "record/shard_rules.py", "trace/layouts.py")


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA GPU")
        return 2
    import torch.distributed as dist
    from torch.distributed.tensor import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import divtrace

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 1024, bias=False), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 256, bias=False)).cuda()
    parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(64, 256, device="cuda")
    out = tempfile.mkdtemp()
    with torch.no_grad():
        m(x)  # warm-up: kernels and NCCL communicators made before anything is timed or trapped
        with divtrace.record(m, os.path.join(out, "warm"), mode="hash", tokens=False):
            m(x)
    torch.cuda.synchronize()
    where: Counter = Counter()
    old_show = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # where the sync was made: the stack now
        if "synchroniz" not in str(message).lower():
            return
        frames = [f.filename for f in traceback.extract_stack()]
        mine = next((p for p in SHARDED_PARTS for f in frames if f.endswith(p)), None)
        other = next((f.split("divtrace/")[-1] for f in reversed(frames) if "/divtrace/" in f
                      and not f.endswith("gpu_check_sharded.py")), "elsewhere")
        where[mine or other] += 1
    warnings.showwarning = show
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with torch.no_grad(), divtrace.record(m, os.path.join(out, "run"), mode="hash", tokens=False):
            m(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old_show
    dist.destroy_process_group()
    bad = {k: v for k, v in where.items() if k in SHARDED_PARTS}
    for k, v in sorted(where.items(), key=str):
        print(f"sync: {k}: {v}")
    if bad:
        print(f"FAILED: the sharded-run parts synchronised {sum(bad.values())} time(s): {bad}")
        return 1
    print(f"PASSED: no CUDA synchronisation from the sharded-run parts ({sum(where.values())} elsewhere)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
