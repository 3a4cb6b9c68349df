"""A rank keeps the partial fingerprints of its weight blocks (and of their transposed views) from one recording to
the next, keyed by each block's own fingerprint (record/placements.py, `_PARTIALS`). A weight changed between two
recordings behind its version counter (`.data`, as a weight sync does) must get the partial of its new bytes:
checked against partials computed in the test from the blocks as they are, on two gloo ranks with HF's TP plan."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # HF's TP plan (from_pretrained(tp_plan=...)) needs it

from dist_harness import run_ranks  # noqa: E402
from sharded_cases import IDS, tiny_llama  # noqa: E402

pytestmark = pytest.mark.gloo

CHANGED = "model.layers.0.self_attn.q_proj.weight"


def _worker(rank, world, model_dir, root):
    """Record twice (a, then b after scaling CHANGED's block through `.data`); return each parameter's partial of
    its block and of the block's transpose, computed here from the bytes as they were at b."""
    import torch
    from transformers import LlamaForCausalLM

    import divtrace
    from divtrace.trace.hashing.tensor import tensor_partial, to_hex

    torch.set_num_threads(1)
    m = LlamaForCausalLM.from_pretrained(model_dir, tp_plan="auto").eval()
    with torch.no_grad(), divtrace.record(m, os.path.join(root, "a"), mode="hash"):
        m(torch.tensor(IDS))
    local = dict(m.named_parameters())[CHANGED]._local_tensor
    version = local._version
    local.data.mul_(2.0)  # (the block's own version counter does not move)
    assert local._version == version
    with torch.no_grad(), divtrace.record(m, os.path.join(root, "b"), mode="hash"):
        m(torch.tensor(IDS))
    truth = {}
    for name, p in m.named_parameters():
        if hasattr(p, "_local_tensor"):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            loc = p._local_tensor
            _, off = compute_local_shape_and_global_offset(tuple(p.shape), p.device_mesh, p.placements)
            t = [to_hex(tensor_partial(loc.t(), tuple(p.shape)[::-1], tuple(off)[::-1]))] if loc.dim() == 2 else []
            truth[name] = [to_hex(tensor_partial(loc, tuple(p.shape), tuple(off)))] + t
    return truth


def _lines(trace):
    lays = [json.loads(x) for x in open(os.path.join(trace, "layouts.jsonl"))]
    recs = [json.loads(x) for x in open(os.path.join(trace, "records.jsonl"))]
    return {d["v"]: d for d in lays if "v" in d}, [r for r in recs if r.get("k") == "o"]


def _partials(trace, views=None) -> dict:
    """param name -> [partial of its block, partials of the transposes of it (or of an alias of it)]; `views`, if
    given, gets param name -> the partials of its aliases (to_local's views, whose partial is the block's)."""
    lays, ops = _lines(trace)
    name_of = {v: d["why"] for v, d in lays.items() if d["src"] == "param"}
    out = {n: [lays[v]["h"]] for v, n in name_of.items()}
    for r in ops:  # ops in order: an alias (to_local's view) of a block names the block
        if r["op"] in ("aten.view.default", "aten.alias.default", "aten.t.default") and r["in"] \
                and r["in"][0] in name_of:
            name = name_of[r["in"][0]]
            if r["op"] == "aten.t.default":
                if r["out"][0] in lays and "h" in lays[r["out"][0]]:
                    out[name].append(lays[r["out"][0]]["h"])
            else:
                name_of[r["out"][0]] = name
                if views is not None and "h" in lays.get(r["out"][0], {}):
                    views.setdefault(name, []).append(lays[r["out"][0]]["h"])
    return out


def test_weight_partials_met_again_are_those_of_the_bytes_as_they_are(tmp_path):
    model = tiny_llama(str(tmp_path / "model"))
    truths = run_ranks(_worker, 2, model, str(tmp_path))
    for rank, truth in enumerate(truths):
        a = _partials(str(tmp_path / "a" / f"rank-{rank}"))
        views: dict = {}
        b = _partials(str(tmp_path / "b" / f"rank-{rank}"), views)
        # (an alias of a kept block takes the block's partial within the recording: that of the bytes as they are)
        assert CHANGED in views and len(views) >= 14
        for name, hs in views.items():
            assert all(h == truth[name][0] for h in hs), name
        assert CHANGED in b and set(b) <= set(truth) and sum(len(v) > 1 for v in b.values()) >= 14  # (7 Linears a layer)
        for name, got in b.items():
            assert got[0] == truth[name][0], name
            assert all(h == truth[name][1] for h in got[1:]), name  # (its transposes, as the matmuls use them)
            assert (a[name] != got) == (name == CHANGED), name
