"""Two gloo ranks, DTensor Shard(d) layouts (uneven chunks included): each rank fingerprints only its local shard
at the global offset DTensor gives it, the ranks exchange nothing but those partials (16 bytes per value, 8 per
token row), and the sum is the fingerprint of the unsharded value, computed in each rank from the same seed."""
from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CASES = [  # (global shape, dtype, mesh placements as shard dims; None = Replicate)
    ((6, 10), torch.float32, 1), ((7, 5), torch.bfloat16, 1), ((5, 3, 9), torch.bfloat16, 2),
    ((9, 4), torch.int8, 0), ((3, 1031), torch.float16, 1), ((4, 6), torch.float64, None),
]



pytestmark = pytest.mark.gloo  # multi-process (gloo, 2 ranks): .ci/run's stage of their own

def _worker(rank: int, world: int, port: int, errors):
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        from divtrace.trace.hashing import rows as RW, tensor as T
        from fp2_cases import values

        mesh = init_device_mesh("cpu", (world,))
        for shape, dtype, dim in CASES:
            full = values(dtype, shape, seed=sum(shape))  # every rank makes the same global value, for the check
            placements = [Shard(dim)] if dim is not None else [Replicate()]
            local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
            local = full[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))].contiguous()
            dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                    stride=full.stride())
            part = T.tensor_partial(dt.to_local(), dt.shape, offset)
            if dim is None:  # a replica: one rank's copy stands for the value; the others add zero
                part = part if rank == 0 else torch.zeros(2, dtype=torch.int64)
            got = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(got, part)  # 16 bytes per rank: the only thing that crosses
            assert torch.equal(T.combine(got), T.tensor_fingerprint(full)), (shape, dtype, dim)
            if dim is not None and dim >= 1 and len(shape) >= 2:  # token rows [shape[0]], columns sharded
                row_shape, row_off = shape[1:], offset[1:]
                rp = RW.row_fingerprints(dt.to_local(), row_shape, row_off)
                rows = [torch.zeros(shape[0], dtype=torch.int64) for _ in range(world)]
                dist.all_gather(rows, rp)
                assert torch.equal(RW.combine_rows(rows), RW.row_fingerprints(full)), (shape, dtype, dim)
        dist.barrier()  # (a rank that tears its group down while the other still talks aborts in gloo)
        dist.destroy_process_group()
    except Exception:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_dtensor_shards_fingerprint_in_place_and_sum_across_ranks():
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        mp.start_processes(_worker, args=(2, _free_port(), errors), nprocs=2, start_method="spawn")
    except Exception:
        msgs = []
        while not errors.empty():
            msgs.append(errors.get())
        pytest.fail("\n".join(msgs) or "a rank failed")
