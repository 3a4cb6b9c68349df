"""Issue 28 on a GPU: the rollout-vs-trainer case first seen on an H200 (HF Llama, hidden 1024, 4 layers, a
left-padded rollout with KV-cache decode against right-padded trainer micro-batches), bf16 and fp32. Nothing is
planted: what differs is the GPU's own kernels (a decode step's attention and GEMMs against the full sequence's).
The first origin must be the first module output the hooks see differ, every origin's count the hooks', and the
modules whose differences never reach the output listed apart (absorbed), never as `first`.

Skipped without CUDA (`bash bench/gpu_check.sh` runs it). The same assertions run on the CPU in miniature in
tests/test_origins.py (test_the_first_origin_is_the_first_module_output_that_differs)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import divtrace

sys.path.insert(0, str(Path(__file__).parent))
import origin_cases as oc  # noqa: E402
import token_cases as tc  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("mode", ["hash", "full"])
def test_h200_rollout_vs_trainer_first_origin_is_the_first_module_output_that_differs(tmp_path, dtype, mode):
    ps = tc.prompts(lengths=(12, 16, 9, 20, 14, 7, 18, 11), seed=3)
    m = oc.llama(hidden=1024, layers=4, dtype=dtype).cuda()
    roll = oc.rollout(m, tmp_path / "roll", ps, new_tokens=16, mode=mode)
    train = oc.trainer(m, tmp_path / "train", roll.seqs, micro_batch=4, mode=mode)
    truth = oc.truth(train, roll)
    d = divtrace.bisect(train.path, roll.path).to_dict()
    print(f"\n{dtype} {mode}: verdict {d['verdict']}; hooks: origins {truth.origins()}, first module out "
          f"{truth.first_module_out()}, absorbed {sorted(truth.absorbed_modules())}; divtrace: "
          f"origins {[(o['module'], o['op'], o['tokens']) for o in d['origins']]}, "
          f"absorbed {[(a['module'], a['kind'], a['tokens']) for a in d['absorbed']]}")
    if not truth.final_differs:
        assert d["verdict"] in ("identical", "absorbed"), d["reason"]
        return
    expected = truth.origins()
    assert d["verdict"] == "diverged"
    assert {o["module"]: o["tokens"] for o in d["origins"]} == expected
    assert d["first"]["module"] == min(expected, key=truth.order.__getitem__)
    for mod, n in truth.module_counts().items():
        assert d["tokens"]["modules"].get(mod) == n, mod
    # absorbed entries are per token: an op absorbed for some tokens (their module output equal) may be another's
    # origin; what is never absorbed-only is `first`
    assert all(a["tokens"] > 0 and a["kind"] in ("op", "inputs", "module") for a in d["absorbed"])
