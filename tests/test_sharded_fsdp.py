"""FSDP2 (`fully_shard`), two gloo ranks on the CPU, each with its own sequence, against one process running both
sequences in one batch: bisect pairs the tokens of each rank with the one process's by token identity. Held to the
ground truth of plain hooks (each rank's rows against the one process's rows of the same sequence): identical, or
the module the hooks name, in full and hash mode."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import divtrace  # noqa: E402
from dist_harness import run_ranks  # noqa: E402
from sharded_cases import (FSDP_IDS, bits_equal, capture, fsdp_worker, scale_q_proj, tiny_llama,  # noqa: E402
                           truth_origin)

pytestmark = pytest.mark.gloo  # multi-process (gloo, 2 ranks): .ci/run's stage of their own


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    model = tiny_llama(str(root / "model"))
    ranks = run_ranks(fsdp_worker, 2, model, str(root / "fsdp2"), ["full", "hash"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        from transformers import LlamaForCausalLM

        m = LlamaForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        ids = [s[0] for s in FSDP_IDS]
        for mode in ("full", "hash"):
            with torch.no_grad(), divtrace.record(m, str(root / "one" / mode), mode=mode):
                m(torch.tensor(ids))
        one = capture(m, ids)
        scale_q_proj(m, 1.0)
        for mode in ("full", "hash"):
            with torch.no_grad(), divtrace.record(m, str(root / "one" / ("plant" if mode == "full" else "plant-hash")),
                                                  mode=mode):
                m(torch.tensor(ids))
    finally:
        torch.set_num_threads(threads)
    return root, ranks, one


def _rows(caps, r):
    """The one process's captures narrowed to sequence r (dim 0 where it is the batch)."""
    out = {}
    for k, (x, y) in caps.items():
        out[k] = tuple(t[r:r + 1] if t is not None and t.dim() >= 2 and t.shape[0] == len(FSDP_IDS) else t
                       for t in (x, y))
    return out


def test_fsdp2_against_one_process_is_what_the_hooks_say(runs):
    root, ranks, (one, _) = runs
    origins = []
    for r, (caps, order) in enumerate(ranks):
        o = truth_origin(order, caps, _rows(one, r))
        if o is not None:
            origins.append(o)
    same_logits = all(bits_equal(caps["lm_head"][1], _rows(one, r)["lm_head"][1])
                      for r, (caps, _) in enumerate(ranks))
    for mode in ("full", "hash"):
        res = divtrace.bisect(str(root / "fsdp2" / mode), str(root / "one" / mode))
        d = res.to_dict()
        assert d["alignment"] == "tokens"
        assert d["tokens"]["shared"] == sum(len(s[0]) for s in FSDP_IDS) and not d["tokens"]["only_a"]
        if not origins:
            assert same_logits and res.verdict == "identical", d
        else:
            assert res.verdict == "diverged" and res.first.module in origins, (d["first"], origins)


def test_fsdp2_run_keeps_each_ranks_tokens_apart(runs):
    """The run view holds both ranks' root calls, one after the other, with their own tokens."""
    from divtrace.align.shards import open_side

    root, _, _ = runs
    view = open_side(str(root / "fsdp2" / "hash"))
    assert [g.ranks for g in view.groups] == [[0], [1]]
    roots = [c for c in view.calls.values() if c.module == ""]
    assert [c.call for c in roots] == [0, 1]
    grids = view.token_index().grids
    assert sorted(g.ids[0] for g in grids.values()) == sorted(s[0][0] for s in FSDP_IDS)


def test_data_parallel_run_refuses_call_alignment(runs):
    root, _, _ = runs
    with pytest.raises(divtrace.DivtraceError, match="data parallel"):
        divtrace.bisect(str(root / "fsdp2" / "hash"), str(root / "one" / "hash"), align="calls")


def test_a_difference_in_one_ranks_sequence_is_found_and_reproduced_from_that_rank(runs, tmp_path):
    """Planted in rank 1's forward only: bisect finds it for rank 1's tokens (hash mode as full mode), and the repro is the ordinary one of
    rank 1's trace against the one process (each side at its own batch, the token's row compared)."""
    import json

    from divtrace.repro.writer import write_repro

    root, _, _ = runs
    r = divtrace.bisect(str(root / "fsdp2" / "plant"), str(root / "one" / "plant"))
    d = r.to_dict()
    assert r.verdict == "diverged" and r.first.module == "model.layers.0.self_attn.q_proj", d["first"]
    assert r.first.op == "aten.mul.Tensor"
    assert d["first"]["token"]["seq"]["first_ids"][:3] == FSDP_IDS[1][0][:3]
    # (planted in rank 1's forward: the token is rank 1's, in its only root call; the one process holds it in its one
    # root call, no rank)
    assert (d["first"]["token"]["a"]["rank"], d["first"]["token"]["a"]["rank_call"]) == (1, 0), d["first"]["token"]
    assert d["first"]["token"]["a"]["call"] == 1 and "rank" not in d["first"]["token"]["b"]
    from divtrace.cli.token_render import token_text

    assert "a root call 1 (rank 1's root call 0) row" in token_text(d["first"]["token"])
    h = divtrace.bisect(str(root / "fsdp2" / "plant-hash"), str(root / "one" / "plant-hash"))
    assert h.verdict == "diverged" and (h.first.module, h.first.op) == (r.first.module, r.first.op)  # hash = full
    assert h.to_dict()["first"]["token"] == d["first"]["token"], (h.to_dict()["first"], d["first"])
    res = write_repro(str(root / "fsdp2" / "plant"), str(root / "one" / "plant"), tmp_path / "repro")
    assert res.ok, res.fidelity
    m = json.loads((tmp_path / "repro" / "manifest.json").read_text())
    assert m["origin"]["trace_a"].endswith("rank-1")


def test_auto_pairs_a_data_parallel_run_by_tokens_against_one_process_running_its_sequences_one_at_a_time(runs):
    """One process running each rank's sequence in a call of its own holds the same tokens in the same rows, call
    for call, as the run view (each rank's root call in rank order): `--align auto` must still pair them by tokens
    (a data-parallel run pairs with nothing by calls), not refuse them as bad input. Held to the hooks: identical
    where every logits row is bitwise equal, else the hooks' module."""
    from transformers import LlamaForCausalLM

    root, ranks, _ = runs
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = LlamaForCausalLM.from_pretrained(str(root / "model"), dtype=torch.float32).eval()
        for mode in ("full", "hash"):
            with torch.no_grad(), divtrace.record(m, str(root / "seq" / mode), mode=mode):
                for s in FSDP_IDS:
                    m(torch.tensor(s))
        one = [capture(m, s)[0] for s in FSDP_IDS]
    finally:
        torch.set_num_threads(threads)
    origins = [o for r, (caps, order) in enumerate(ranks) if (o := truth_origin(order, caps, one[r])) is not None]
    same_logits = all(bits_equal(caps["lm_head"][1], one[r]["lm_head"][1]) for r, (caps, _) in enumerate(ranks))
    for mode in ("full", "hash"):
        res = divtrace.bisect(str(root / "fsdp2" / mode), str(root / "seq" / mode))  # align="auto"
        d = res.to_dict()
        assert d["alignment"] == "tokens", d
        assert d["tokens"]["shared"] == sum(len(s[0]) for s in FSDP_IDS), d["tokens"]
        if not origins:
            assert same_logits and res.verdict == "identical", d
        else:
            assert res.verdict == "diverged" and res.first.module in origins, (d["first"], origins)
    # the planted run (rank 1's q_proj) against the same unplanted one-process calls: found for rank 1's tokens
    r = divtrace.bisect(str(root / "fsdp2" / "plant"), str(root / "seq" / "full"))
    assert r.verdict == "diverged" and r.first.module == "model.layers.0.self_attn.q_proj", r.to_dict()["first"]
    assert r.to_dict()["first"]["token"]["seq"]["first_ids"][:3] == FSDP_IDS[1][0][:3]
