"""A rank's block values (op results with an S layout) get their fingerprint and their partial of the global value
from one read (record/partials.Partials.block_fp, hashing.tensor.hash_and_partial): in a real TP recording
(HF's TP plan, 2 gloo ranks, ops=True) every pair equals the two kernels run apart, the slot is empty once each is
bound, and the trace is byte for byte (process addresses masked) the one recorded with the pair path switched off."""
from __future__ import annotations

import os
import re

import pytest

from dist_harness import run_ranks
from sharded_cases import IDS, tiny_llama

pytestmark = pytest.mark.gloo  # a process group (gloo): .ci/run's stage of its own


def pair_worker(rank, world, model_dir, root):
    import torch
    from transformers import LlamaForCausalLM

    import divtrace
    from divtrace.record import partials
    from divtrace.trace.hashing.tensor import hash_with_stats, partial_hex

    torch.set_num_threads(1)
    fused = partials.hash_and_partial
    seen, wrong = [], []

    def checked(t, gshape, offsets):
        got = fused(t, gshape, offsets)
        want = (*hash_with_stats(t), partial_hex(t, gshape, offsets))
        seen.append(tuple(t.shape))
        if got != want:
            wrong.append((tuple(t.shape), t.stride(), gshape, offsets, got, want))
        return got

    partials.hash_and_partial = checked
    out = {}
    for dtype in ("float32", "bfloat16"):
        m = LlamaForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=getattr(torch, dtype)).eval()
        for pair in (True, False):
            rec = divtrace.record(m, os.path.join(root, f"{dtype}-{pair}"), mode="hash", ops=True)
            with torch.no_grad(), rec:
                if not pair:
                    rec.values.block_fp = None
                m(torch.tensor(IDS))
                left = len(rec.placements.partials.pairs)
            out[(dtype, pair)] = (len(seen), left)
            seen.clear()
    return out, wrong


def test_block_values_fingerprint_and_partial_in_one_read(tmp_path):
    model = tiny_llama(str(tmp_path / "model"))
    for out, wrong in run_ranks(pair_worker, 2, model, str(tmp_path / "runs")):
        assert wrong == []
        for dtype in ("float32", "bfloat16"):
            assert out[(dtype, True)][0] >= 20  # (q/k/v, gate/up projections and the ops on their blocks)
            assert out[(dtype, False)][0] == 0
            assert out[(dtype, True)][1] == out[(dtype, False)][1] == 0
    for dtype in ("float32", "bfloat16"):
        for rank in ("rank-0", "rank-1"):
            a, b = tmp_path / "runs" / f"{dtype}-True" / rank, tmp_path / "runs" / f"{dtype}-False" / rank
            for f in ("layouts.jsonl", "rows.bin", "tokens.jsonl"):
                assert (a / f).read_bytes() == (b / f).read_bytes(), (dtype, rank, f)
            addr = re.compile(rb" at 0x[0-9a-f]+")  # (ScriptObjects' addresses in the collectives' arguments)
            assert addr.sub(b"", (a / "records.jsonl").read_bytes()) == addr.sub(b"", (b / "records.jsonl").read_bytes())
