"""Two gloo ranks, DTensor Shard(d) layouts (uneven chunks included): each rank fingerprints only its local shard
at the global offset DTensor gives it, the ranks exchange nothing but those partials (16 bytes per value, 8 per
token row), and the sum is the fingerprint of the unsharded value, computed in each rank from the same seed."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_ranks

CASES = [  # (global shape, dtype, mesh placements as shard dims; None = Replicate)
    ((6, 10), torch.float32, 1), ((7, 5), torch.bfloat16, 1), ((5, 3, 9), torch.bfloat16, 2),
    ((9, 4), torch.int8, 0), ((3, 1031), torch.float16, 1), ((4, 6), torch.float64, None),
]

pytestmark = pytest.mark.gloo  # multi-process (gloo, 2 ranks): .ci/run's stage of their own


def shards_worker(rank: int, world: int) -> int:
    """One rank (dist_harness: the gloo group is up): every case checked in place, with asserts. Returns the number
    of cases checked."""
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
    return len(CASES)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_dtensor_shards_fingerprint_in_place_and_sum_across_ranks():
    # (through dist_harness, as every multi-process test: a rank's result counts once it is sent, so gloo's
    # teardown race at interpreter exit cannot fail a rank that passed; see tests/dist_harness.py)
    assert run_ranks(shards_worker, 2) == [len(CASES)] * 2
