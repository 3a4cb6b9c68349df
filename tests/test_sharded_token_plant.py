"""TP=2 (HF's TP plan, 2 gloo ranks) against one process whose row-parallel Linears sum the same two partial
matmuls (tests/tp_plant_cases.py): bitwise equal without a plant, so one planted difference is the only one.

- No plant, hash mode: identical. It had said `absorbed` (exit 4) naming a `transpose` in layer 0's attention: a
  rank's one K/V head `[B, T, 1, d]` transposed is contiguous, so the rank hashed it from its bytes, while the one
  process's transpose of its two heads is strided and gets a fingerprint derived from the op; the run view keyed
  the blocks by their bytes, so the two never matched in hash mode (full mode settles it from the bytes). The
  same false difference was named as the origin, by calls in hash mode, of a plant in a later MLP.
- One token's MLP: rank 1's block of layer 0's up_proj output scaled at token 5 of sequence 0. Hooks: up_proj is the
  first module whose output differs, only at that row and only in rank 1's column block; later tokens of the
  sequence differ from layer 1's attention on, whose input rows for them are equal (the difference reaches them
  through attention over token 5's K/V rows); the logits differ at tokens 5, 6 and 7. bisect must name up_proj's
  planted op at token 5, in rank 1's block, full and hash, by calls (`align="calls"` on a run directory had been
  refused as "not one trace") and by tokens, where every origin is that op with the "through attention over the
  K/V rows" note, never the attention kernel.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # HF's TP plan needs it

import divtrace  # noqa: E402
from dist_harness import run_ranks  # noqa: E402
from sharded_cases import bits_equal, tiny_llama  # noqa: E402
from tp_plant_cases import differing_rows, single, tp_worker  # noqa: E402

pytestmark = pytest.mark.gloo

CASES = [("none-hash", "none", "hash", "float32"), ("up5-full", "up5", "full", "float32"),
         ("up5-hash", "up5", "hash", "float32"), ("k2-full", "k2", "full", "bfloat16"),
         ("k2-hash", "k2", "hash", "bfloat16"), ("ow0-full", "ow0", "full", "bfloat16"),
         ("base-bf16-full", "none", "full", "bfloat16")]
UP = "model.layers.0.mlp.up_proj"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-plant")
    model = tiny_llama(str(root / "model"))
    (truth,) = run_ranks(tp_worker, 2, model, str(root / "tp2"), CASES)[:1]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks
    try:
        caps = {(plant, dtype): single(model, str(root / "tp1" / name), plant, mode, dtype)[0]
                for name, plant, mode, dtype in CASES}
    finally:
        torch.set_num_threads(threads)
    return root, truth, caps


def _bisect(root, name, align):
    return divtrace.bisect(str(root / "tp2" / name), str(root / "tp1" / name), align=align)


@pytest.mark.parametrize("align", ["calls", "tokens"])
def test_no_plant_is_identical_in_hash_mode(runs, align):
    root, truth, caps = runs
    g, b = truth["none", "float32"], caps["none", "float32"]
    for path, (x, y) in g.items():  # the hooks: every module's input and output bitwise equal
        assert bits_equal(x, b[path][0]) and bits_equal(y, b[path][1]), path
    d = _bisect(root, "none-hash", align).to_dict()
    assert d["verdict"] == "identical", (d["reason"], d.get("absorbed"))


def _truth(runs):
    _, truth, caps = runs
    g, b = truth["up5", "float32"], caps["up5", "float32"]
    order = list(g)
    diff = {p: differing_rows(g[p][1], b[p][1]) for p in order if g[p][1] is not None and g[p][1].dim() == 3}
    assert diff[UP] == [(0, 5)] and bits_equal(g[UP][0], b[UP][0])
    half = g[UP][1].shape[-1] // 2
    assert bits_equal(g[UP][1][..., :half], b[UP][1][..., :half])  # rank 0's block is equal
    layer0 = [p for p in diff if p.startswith("model.layers.0.") and diff[p]]
    assert all(p == UP or not p.startswith("model.layers.0.self_attn") for p in layer0), layer0
    attn = "model.layers.1.self_attn"
    assert differing_rows(g[attn][0], b[attn][0]) == [(0, 5)] and diff[attn] == [(0, 5), (0, 6), (0, 7)]
    assert diff[""] == [(0, 5), (0, 6), (0, 7)]  # the logits
    return half


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_one_tokens_mlp_plant_by_calls(runs, mode):
    root = runs[0]
    half = _truth(runs)
    for align in ("calls", "auto"):  # (auto takes calls: the same batch on both sides)
        r = _bisect(root, f"up5-{mode}", align)
        d = r.to_dict()
        assert d["verdict"] == "diverged" and d["alignment"] == "calls", d["reason"]
        assert (r.first.module, r.first.op) == (UP, "aten.mul.Tensor"), (align, r.first.module, r.first.op)
        assert r.first.shards["why"] == "up_proj: mul, where on 2 blocks of dim 2, one per rank on a, where on b"
        if mode == "full":
            assert r.first.shards["block_a"] == f"rank 1's block (dim 2: {half}..{2 * half - 1})"
            assert r.first.diff.first_index == [0, 5, half]


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_one_tokens_mlp_plant_by_tokens_reaches_later_tokens_through_kv(runs, mode):
    root = runs[0]
    _truth(runs)
    d = _bisect(root, f"up5-{mode}", "tokens").to_dict()
    assert d["verdict"] == "diverged" and d["alignment"] == "tokens", d["reason"]
    f = d["first"]
    assert (f["module"], f["op"], f["token"]["position"]) == (UP, "aten.mul.Tensor", 5), f
    assert "through attention over the K/V rows of the token at position 5" in f["note"], f["note"]
    assert {(o["module"], o["op"], o["token"]["position"]) for o in d["origins"]} == {(UP, "aten.mul.Tensor", 5)}
    assert f["shards"]["why"] == "up_proj: mul, where on 2 blocks of dim 2, one per rank on a, where on b"
    if mode == "full":  # the token's row: in rank 1's column block, as by calls (it had named no block)
        assert f["shards"]["block_a"] == "rank 1's block (dim 2: 64..127)", f["shards"]


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_a_k_row_reaching_a_token_through_two_attentions(runs, mode):
    """bf16, rank 1's K block (its one K/V head) scaled at token 2. Hooks: k_proj differs at that row only; some
    later token's rows are equal through layer 0 (absorbed there) and differ from layer 1's attention on, reading
    the K/V rows of a token that differs since layer 0's attention (which read token 2's K row). Every token's
    origin is token 2's k_proj op. Before, that token was left at layer 1's attention kernel ("whose first difference
    is not localized"): the earlier token's first differing module (the first to exit, o_proj) had its input
    differing already, and the walk did not go up to the attention's own code."""
    root, truth, caps = runs
    g, b = truth["k2", "bfloat16"], caps["k2", "bfloat16"]
    k = "model.layers.0.self_attn.k_proj"
    assert differing_rows(g[k][1], b[k][1]) == [(0, 2)]
    half = g[k][1].shape[-1] // 2
    assert bits_equal(g[k][1][..., :half], b[k][1][..., :half])  # rank 0's block equal
    final = set(differing_rows(g[""][1], b[""][1]))
    layer0 = set(differing_rows(g["model.layers.0"][1], b["model.layers.0"][1]))
    attn1 = "model.layers.1.self_attn"
    two_hops = {t for t in final if t not in layer0 and t[1] > 2
                and t not in differing_rows(g[attn1][0], b[attn1][0])}
    if not two_hops:
        pytest.skip("this CPU's bf16 kernels absorb no later token at layer 0: no second hop to check")
    d = _bisect(root, f"k2-{mode}", "tokens").to_dict()
    assert d["verdict"] == "diverged" and d["alignment"] == "tokens", d["reason"]
    assert [(o["module"], o["op"], o["token"]["position"]) for o in d["origins"]] == [(k, "aten.mul.Tensor", 2)], \
        [(o["module"], o["op"], o["note"]) for o in d["origins"]]
    assert d["origins"][0]["tokens"] == len(final)
    r = _bisect(root, f"k2-{mode}", "calls")
    assert (r.first.module, r.first.op) == (k, "aten.mul.Tensor")
    if mode == "full":
        assert r.first.shards["block_a"] == f"rank 1's block (dim 2: {half}..{2 * half - 1})"


def test_a_weight_block_read_by_every_token_is_no_attention_path(runs):
    """bf16, TP=2 against TP=2: rank 0's block of o_proj's weight nudged. Hooks: o_proj's input is equal and its
    output row differs for most tokens: each such token's own o_proj is its origin. A token's difference comes
    through attention only where its layer-0 output row is equal (its own o_proj row equal, or absorbed). bisect
    counts every differing token at o_proj's matmul and, where it says a token is reached through attention, that
    token must be such a one. Before, the weight (an input with no token rows that differs) was taken for another
    token's K/V rows: every token was said to be reached from token 0 'through attention'."""
    import re

    root, truth, _ = runs
    g, b = truth["ow0", "bfloat16"], truth["none", "bfloat16"]
    o = "model.layers.0.self_attn.o_proj"
    assert bits_equal(g[o][0], b[o][0])
    rows = differing_rows(g[o][1], b[o][1])
    assert len(rows) > 2  # (most tokens: a row whose products round alike is equal)
    final = differing_rows(g[""][1], b[""][1])
    through = set(final) - set(differing_rows(g["model.layers.0"][1], b["model.layers.0"][1]))
    d = divtrace.bisect(str(root / "tp2" / "ow0-full"), str(root / "tp2" / "base-bf16-full"), align="tokens").to_dict()
    assert d["verdict"] == "diverged" and d["alignment"] == "tokens", d["reason"]
    assert [(x["module"], x["op"], x["tokens"]) for x in d["origins"]] == [(o, "aten.mm.default", len(final))]
    note = d["origins"][0]["note"]
    if note is not None:
        pos = int(re.search(r"reaches the token at position (\d+)", note).group(1))
        assert any(t[1] == pos for t in through), (note, sorted(through))
