"""Scheme lane-gsum128-v2 (divtrace.trace.hashing.tensor): the C kernel, the torch ops and the plain-Python spec give
the same numbers on every dtype and layout; shards' partials sum to the global fingerprint on any Shard(d) or
2-D layout, uneven chunks included; any one flipped bit changes the fingerprint; -0.0, NaN payloads and views."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from divtrace.trace import derived_views as views, fingerprint
from divtrace.errors import DivtraceError
from divtrace.trace.hashing import TENSOR_SCHEME, spec, tensor as T, weights
from fp2_cases import DTYPES, all_paths, boxes, chunk_sizes, take, torch_path, unsigned, values
from native_kernels import kernel  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(T._native is None, reason="divtrace._native not built (no C compiler at install)")


def _all_paths(x, global_shape=None, offsets=None) -> list[list[int]]:
    return all_paths(T.tensor_partial, x, global_shape, offsets)


def test_torch_weights_are_the_spec_formula():
    w, u = weights.inner("cpu"), weights.outer(70000, "cpu")
    for r in (0, 1):
        assert [x & spec.MASK for x in w[r, [0, 1, 2, 511, 1023]].tolist()] == \
            [spec.inner_weight(r, j) for j in (0, 1, 2, 511, 1023)]
        assert [x & spec.MASK for x in u[r, [0, 1, 4095, 4096, 69999]].tolist()] == \
            [spec.outer_weight(r, q) for q in (0, 1, 4095, 4096, 69999)]
    assert all(x & 1 for x in w.reshape(-1).tolist())  # odd: units mod 2**64
    # the definition pinned (another implementation checks itself against these digits)
    assert spec.to_hex(*spec.tensor_sums(bytes(range(1, 11)))) == T.to_hex(T.tensor_fingerprint(
        torch.arange(1, 11, dtype=torch.uint8)))


LAYOUTS = {
    "contiguous": lambda x: x,
    "transposed": lambda x: x.transpose(0, 1),
    "permuted": lambda x: x.permute(2, 0, 1),
    "step": lambda x: x[:, ::2],
    "offset": lambda x: x[1:],  # starts mid-lane for 1- and 2-byte types
    "expanded": lambda x: x[:1].expand(3, -1, -1),
    "row": lambda x: x[1, :, 0],
    "scalar": lambda x: x[1, 2, 3],
    "empty": lambda x: x[:, :0],
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_c_torch_and_spec_agree_on_every_dtype_and_layout(kernel, dtype, layout):
    x = LAYOUTS[layout](values(dtype, (3, 7, 5), seed=len(layout)))
    c, t_mm, t_acc = _all_paths(x)
    assert c == t_mm == t_acc == list(spec.tensor_partial(x))
    assert T.tensor_hash(x) == spec.to_hex(*c) == T.to_hex(T.tensor_fingerprint(x))
    if x.numel() == 0:
        assert T.tensor_hash(x) == "0" * 32


@pytest.mark.parametrize("shape", [(2049,), (3, 1500), (5000, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64])
def test_agree_across_blocks(kernel, dtype, shape):
    x = values(dtype, shape, seed=3)
    c, t_mm, t_acc = _all_paths(x)
    assert c == t_mm == t_acc == list(spec.tensor_partial(x))


def _check_tiling(g: torch.Tensor, tiles, reference: bool = True):
    full = T.tensor_fingerprint(g)
    parts = {"c": [], "torch": [], "accel": []}
    for off, loc in tiles:
        x = take(g, off, loc)
        c, t_mm, t_acc = _all_paths(x, g.shape, off)
        assert c == t_mm == t_acc, (off, loc)
        if reference and x.numel() <= 64:
            assert c == list(spec.tensor_partial(x, g.shape, off)), (off, loc)
        for k, v in zip(parts, (c, t_mm, t_acc)):
            parts[k].append(v)
    for k, v in parts.items():
        assert [sum(p[r] for p in v) & spec.MASK for r in (0, 1)] == unsigned(full), k
    assert T.combine([T.tensor_partial(take(g, o, n), g.shape, o) for o, n in tiles]).tolist() == full.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.bool,
                                   torch.complex64])
@pytest.mark.parametrize("shape,dim,k", [((3, 5000), 1, 3), ((7, 3001), 1, 4), ((2100, 3), 0, 3),
                                         ((5, 3, 1031), 1, 2), ((4, 4, 2047), 2, 3), ((9,), 0, 4)])
def test_shards_sum_to_the_global_fingerprint(kernel, dtype, shape, dim, k):
    g = values(dtype, shape, seed=k)
    _check_tiling(g, boxes(shape, [(dim, chunk_sizes(shape[dim], k))]))


@st.composite
def _sharded(draw):
    nd = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=nd, max_size=nd)))
    if draw(st.booleans()):  # sometimes one long dim: runs cross 1024-lane blocks at odd phases
        d = draw(st.integers(0, nd - 1))
        shape = shape[:d] + (draw(st.integers(1000, 2100)),) + shape[d + 1:]
    dtype = draw(st.sampled_from(DTYPES))
    cut_dims = draw(st.lists(st.integers(0, nd - 1), min_size=1, max_size=2, unique=True))
    plan = []
    for d in cut_dims:
        n = shape[d]
        points = sorted(draw(st.lists(st.integers(0, n), max_size=3)))  # any cuts: uneven, empty pieces too
        edges = [0, *points, n]
        plan.append((d, [b - a for a, b in zip(edges, edges[1:])]))
    return dtype, shape, plan, draw(st.integers(0, 2**16))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_sharded())
def test_property_any_tiling_sums_to_the_global_fingerprint(case):
    dtype, shape, plan, seed = case
    g = values(dtype, shape, seed)
    _check_tiling(g, boxes(shape, plan), reference=g.numel() <= 4096)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool,
                                   torch.complex64])
def test_every_single_bit_flip_changes_the_fingerprint_and_the_partial(dtype):
    g = values(dtype, (4, 5), seed=1)
    raw = g.contiguous().view(torch.uint8).reshape(-1)
    es = g.element_size()
    base = T.tensor_hash(g)
    shard_off, shard = (0, 2), (4, 2)  # a column shard (misaligned for 1- and 2-byte types)
    base_part = T.tensor_partial(take(g, shard_off, shard), g.shape, shard_off).tolist()
    seen = set()
    for byte in range(raw.numel()):
        for bit in range(8):
            flipped = raw.clone()
            flipped[byte] ^= 1 << bit
            y = flipped.view(dtype).reshape(g.shape)  # (a bool byte may then hold 2..255: raw bytes all the same)
            h = T.tensor_hash(y)
            assert h != base, (byte, bit)
            seen.add(h)
            col = (byte // es) % 5
            if 2 <= col < 4:
                assert T.tensor_partial(take(y, shard_off, shard), g.shape, shard_off).tolist() != base_part
    assert len(seen) == raw.numel() * 8  # and no two flips collide with each other


def test_signed_zero_nan_payloads_and_sign_flips_are_seen():
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        z = torch.zeros(6, dtype=dt)
        nz = z.clone()
        nz[3] = -0.0
        assert T.tensor_hash(z) != T.tensor_hash(nz), dt
    nans = torch.tensor([0x7FC00000, 0x7FC00001, 0xFFC00000, 0x7F800001], dtype=torch.int64).to(torch.int32)
    hs = {T.tensor_hash(torch.full((5,), 1.0).index_fill(0, torch.tensor([2]), 0).view(torch.int32)
                        .index_fill(0, torch.tensor([2]), int(v)).view(torch.float32)) for v in nans}
    assert len(hs) == 4  # four NaN bit patterns, four fingerprints
    x = values(torch.float32, (64, 33), seed=5)
    assert T.tensor_hash(x) != T.tensor_hash(-x)  # every sign bit flipped (lane differences of 2**31)
    y = x.clone()
    y[3, 4], y[10, 20] = -y[3, 4], -y[10, 20]
    assert T.tensor_hash(y) != T.tensor_hash(x)


def test_fingerprint_does_not_depend_on_what_was_hashed_before():
    x = values(torch.bfloat16, (3, 3), seed=2)
    first, first_torch = T.tensor_hash(x), None
    with torch_path():
        first_torch = T.tensor_hash(x)
        T.tensor_hash(torch.zeros(1 << 23, dtype=torch.int8))  # grows the outer-weight table
        assert T.tensor_hash(x) == first_torch
    T.tensor_hash(torch.zeros(1 << 23, dtype=torch.int8))
    assert T.tensor_hash(x) == first == first_torch


def test_views_hash_by_logical_order():
    """A view's v2 fingerprint is its logical bytes' (in place, any stride), so reshapes keep the input's and a
    reader's rebuilt derived view (views.rebuild_view) verifies against a fingerprint taken of the real view."""
    x = values(torch.bfloat16, (4, 6, 5), seed=9)
    h = T.tensor_hash(x)
    for same in (x.view(24, 5), x.reshape(-1), x.unsqueeze(1), x[None].squeeze(0), torch.ops.aten.alias(x)):
        assert T.tensor_hash(same) == h
    vh = fingerprint.hasher(TENSOR_SCHEME)
    cases = [("aten.t.default", x[0], [{"$v": 1}]), ("aten.transpose.int", x, [{"$v": 1}, 0, 2]),
             ("aten.permute.default", x, [{"$v": 1}, [2, 0, 1]]), ("aten.slice.Tensor", x, [{"$v": 1}, 1, 1, 5, 2]),
             ("aten.select.int", x, [{"$v": 1}, 2, 3]), ("aten.expand.default", x[:, :1], [{"$v": 1}, [4, 3, 5]]),
             ("aten.diagonal.default", x, [{"$v": 1}, 0, 0, 1]), ("aten.unfold.default", x, [{"$v": 1}, 1, 2, 2])]
    for op, src, args in cases:
        rebuilt = views.rebuild_view(op, args, {}, src)
        _, name, overload = op.split(".")
        direct = getattr(getattr(torch.ops.aten, name), overload)(src, *args[1:])
        assert vh(rebuilt) == vh(direct.contiguous()) == spec.to_hex(*spec.tensor_partial(direct)), op
        with torch_path():
            assert vh(rebuilt) == vh(direct.contiguous())
        derived = views.view_fingerprint(op, vh(src), str(src.dtype), list(src.shape), list(direct.shape), args, {})
        assert len(derived) == 32 and derived != vh(direct)  # derived keys stay their own namespace


def test_hasher_keeps_the_old_scheme_and_knows_the_new():
    x = values(torch.float32, (5, 3), seed=4)
    assert fingerprint.hasher(fingerprint.HASH_SCHEME) is fingerprint.tensor_hash
    assert fingerprint.hasher(TENSOR_SCHEME)(x) == T.tensor_hash(x)
    assert fingerprint.hasher("no-such-scheme") is None
    # v1 and v2 are different functions: a reader must never compare hashes across schemes
    assert fingerprint.tensor_hash(x[:, :1]) != T.tensor_hash(x[:, :1])


def test_stats_in_the_same_pass_match_the_old_kernel():
    for x in (values(torch.float32, (30, 70), 1), values(torch.bfloat16, (9, 301), 2),
              torch.tensor([[1.0, float("nan")], [-float("inf"), 3.0]]), values(torch.float64, (5, 5), 3),
              values(torch.int8, (4, 4), 4)):
        h, stats = T.hash_with_stats(x)
        assert h == T.tensor_hash(x)
        assert stats == fingerprint.fingerprint(x)[1]
        part, pstats = T.partial_with_stats(x[:, 1:], x.shape, (0, 1))
        assert part.tolist() == T.tensor_partial(x[:, 1:], x.shape, (0, 1)).tolist()
        want = fingerprint.fingerprint(x[:, 1:].contiguous())[1]
        if want:  # (the mean is accumulated in float32 per block: a strided shard sums in another order)
            assert pstats.pop("mean") == pytest.approx(want.pop("mean"), rel=1e-5, abs=1e-6)
        assert pstats == want


def test_hex_forms_and_combining_stored_partials():
    g = values(torch.bfloat16, (6, 7), seed=8)
    parts = [T.tensor_partial(take(g, o, n), g.shape, o) for o, n in boxes(g.shape, [(1, [3, 1, 3])])]
    assert T.combine_hex([T.to_hex(p) for p in parts]) == T.tensor_hash(g) == T.hexes(torch.stack(parts).sum(0)[None])[0]
    assert spec.to_hex(*T.from_hex(T.tensor_hash(g))) == T.tensor_hash(g)


@pytest.mark.parametrize("shape,offsets,match", [((2, 3), (0, 1), "does not fit"), ((2,), (0, 0), "number of dims"),
                                                 ((2, 3), (-1, 0), "does not fit")])
def test_a_shard_that_does_not_fit_is_one_clear_error(shape, offsets, match):
    with pytest.raises(DivtraceError, match=match):
        T.tensor_partial(torch.zeros(2, 3), shape, offsets)


def test_the_documented_test_vectors():
    """The digits docs/trace-format.md gives reimplementers (a change here is a new scheme, under a new name)."""
    from divtrace.trace.hashing import rows as RW
    from helpers import ROOT

    data = torch.arange(1, 11, dtype=torch.uint8)
    whole, row = T.to_hex(T.tensor_fingerprint(data)), RW.row_fingerprints(data[None]).tolist()[0] & spec.MASK
    parts = [T.to_hex(T.tensor_partial(data[a:b], (10,), (a,))) for a, b in ((0, 3), (3, 10))]
    want = ("ef8d6f0f7284f259f1fec87dd6376113", 0xdf1ade1ee509e4b2, 0xe7ad61a8d8c93c9b, 0xa8bfa0dd9b34cacb,
            ["5ed0f3abb3562ee91c7c215216615b77", "90bc7b63bf2ec370d582a72bbfd6059c"])
    assert (whole, row, spec.inner_weight(0, 0), spec.outer_weight(0, 0), parts) == want
    assert T.combine_hex(parts) == whole
    doc = (ROOT / "docs" / "trace-format.md").read_text()
    for text in (want[0], f"0x{want[1]:016x}", f"0x{want[2]:016x}", f"0x{want[3]:016x}", *want[4]):
        assert text in doc, text


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(DTYPES), st.lists(st.integers(1, 40), min_size=1, max_size=3), st.integers(0, 2**31),
       st.integers(0, 2**31))
def test_property_one_flipped_bit_changes_value_shard_and_row(dtype, shape, where, seed):
    """Any one bit, anywhere: the whole fingerprint, the partial of the shard holding it (a Shard(last dim) cut
    at a random column) and the fingerprint of its row all change."""
    from divtrace.trace.hashing import rows as RW

    g = values(dtype, tuple(shape), seed)
    raw = g.contiguous().view(torch.uint8).reshape(-1).clone()
    byte, bit = where % raw.numel(), (where // raw.numel()) % 8
    raw[byte] ^= 1 << bit
    y = raw.view(dtype).reshape(g.shape)
    assert T.tensor_hash(y) != T.tensor_hash(g)
    elem = byte // g.element_size()
    col, last = elem % shape[-1], shape[-1]
    cut = seed % (last + 1)
    off, n = (cut, last - cut) if col >= cut else (0, cut)
    idx = (0,) * (len(shape) - 1) + (off,)
    box = tuple(shape[:-1]) + (n,)
    assert not torch.equal(T.tensor_partial(take(y, idx, box), g.shape, idx),
                           T.tensor_partial(take(g, idx, box), g.shape, idx))
    rows_g, rows_y = g.reshape(-1, last), y.reshape(-1, last)
    r = elem // last
    assert RW.row_fingerprints(rows_y).tolist()[r] != RW.row_fingerprints(rows_g).tolist()[r]


def test_a_trace_of_the_new_scheme_is_accepted_and_an_unknown_one_refused(tmp_path):
    import json

    from divtrace.trace.meta import read_meta

    for scheme, ok in ((TENSOR_SCHEME, True), ("lane-gsum128-v9", False)):
        (tmp_path / "meta.json").write_text(json.dumps({"format_version": 1, "mode": "hash", "hash_scheme": scheme}))
        if ok:
            assert read_meta(tmp_path)["hash_scheme"] == scheme
        else:
            with pytest.raises(DivtraceError, match="unknown to this divtrace"):
                read_meta(tmp_path)
