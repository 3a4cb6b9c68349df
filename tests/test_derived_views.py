"""Strided views (w.t(), transposes, expands) get a fingerprint derived from their op and input (divtrace.trace.derived_views),
and in full mode no bytes of their own: the reader rebuilds them from the op. Rebuilt bytes must be exactly the
view the recording saw, a view must never make two equal tensors compare unequal where the bytes are there, and
a record edited to rebuild something else must be caught."""
from __future__ import annotations

import json

import pytest
import torch

from divtrace.compare.values import ValueComparator
from divtrace.errors import DivtraceError
from divtrace.trace.hashing.tensor import hash_with_stats as fingerprint  # the scheme traces are written in
from divtrace.trace.check import check_trace
from divtrace.trace.reader import Trace
from helpers import hf_llama, record_model
from test_trace_fixtures import cli, copy_trace, edit_meta


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("views")
    model, inputs = hf_llama("eager")
    record_model(model, inputs, d / "full", mode="full")
    record_model(model, inputs, d / "hash", mode="hash")
    return model, Trace(d / "full"), Trace(d / "hash")


def test_transposed_weights_are_rebuilt_not_stored(llama):
    model, t, _ = llama
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    by_weight = {fingerprint(m.weight.detach())[0]: name for name, m in linears.items()}
    rebuilt = set()
    for vid in t.vderived:
        v, rec = t.values[vid], t.records[t.values[vid].producer]
        assert v.blob is None and v.shard is None and vid not in t.vblob and t.has_bytes(vid)
        x = t.tensor(vid)
        assert list(x.shape) == v.shape and fingerprint(x)[0] == t.real_key(vid)[2]
        src = t.values[rec.inputs[0]]
        if rec.op == "aten.t.default" and src.hash in by_weight:
            w = linears[by_weight[src.hash]].weight.detach()
            assert torch.equal(x.view(torch.int32), w.t().view(torch.int32)) and x.stride() == w.t().stride()
            rebuilt.add(by_weight[src.hash])
    assert rebuilt == set(linears)  # every Linear's w.t(), lm_head included
    # ... and none of them is in a shard: no stored blob holds a transposed weight's bytes
    stored = {b.rsplit("-", 1)[1] for b, _ in t.vblob.values()}
    assert not {fingerprint(m.weight.detach().t())[0] for m in linears.values()} & stored


def test_full_and_hash_mode_derive_the_same_fingerprints(llama):
    _, full, hashed = llama
    assert full.vderived and full.vderived == hashed.vderived
    assert list(full.vkey.values()) == list(hashed.vkey.values())
    assert not hashed.has_bytes(next(iter(hashed.vderived)))


def test_check_verifies_derived_views(llama):
    _, t, _ = llama
    report = check_trace(t)
    assert report["ok"], report["problems"]
    assert report["views"] == len(t.vderived) > 0
    code, out, err = cli("show", t.path, "--check")
    assert code == 0 and f"{report['views']} views stored as their op agree with their fingerprints" in out


class Proj(torch.nn.Module):
    """x @ w.T, with the transposed weight a view (A) or a contiguous copy (B): the same bytes made two ways."""

    def __init__(self, copy: bool):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(48, 32, generator=torch.Generator().manual_seed(3)))
        self.copy = copy

    def forward(self, x):
        wt = self.w.t().contiguous() if self.copy else self.w.t()
        return torch.mm(x, wt), self.w.t().detach()  # a module output that is a view of a view


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_a_view_and_a_copy_of_the_same_bytes(tmp_path, mode):
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    record_model(Proj(False), (x,), tmp_path / "a", mode=mode)
    record_model(Proj(True), (x,), tmp_path / "b", mode=mode)
    a, b = Trace(tmp_path / "a"), Trace(tmp_path / "b")
    mm_a = next(r for r in a.records if r.kind == "op" and r.op == "aten.mm.default")
    mm_b = next(r for r in b.records if r.kind == "op" and r.op == "aten.mm.default")
    wa, wb = mm_a.inputs[1], mm_b.inputs[1]
    assert wa in a.vderived and wb not in b.vderived and a.vkey[wa] != b.vkey[wb]
    # Full mode settles unequal fingerprints of a derived view from the bytes: equal. Hash mode has no bytes and
    # keeps them apart (documented): never the other way round.
    cmp = ValueComparator(a, b)
    assert cmp.same(wa, wb) is (mode == "full")
    assert (cmp.first_unequal([(wa, wb)]) is None) is (mode == "full")
    # The module's outputs are hashed (and stored) for real at the boundary, views included.
    (root,) = a.roots()
    assert len(root.outputs) == 2
    for _, vid in root.outputs:
        assert vid not in a.vderived
        if mode == "full":
            assert fingerprint(a.tensor(vid))[0] == a.vkey[vid][2]
    code, out, err = cli("bisect", tmp_path / "a", tmp_path / "b", "--json")
    assert code in (0, 1), err


def test_alias_of_a_derived_view_is_readable(tmp_path):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(6, 4))

        def forward(self, x):
            return (x @ self.w.t().detach()).sum(0, keepdim=True)

    record_model(M(), (torch.randn(3, 4),), tmp_path / "t", mode="full")
    t = Trace(tmp_path / "t")
    for vid in t.values:
        assert t.has_bytes(vid)
        assert fingerprint(t.tensor(vid))[0] == t.real_key(vid)[2]


def _edit_derived_record(src, dst, edit):
    """A copy of the trace whose first derived view's producing record is changed by `edit(record)`, with the
    records' checksums dropped (as if hand-edited in a trace killed before close) so the reader takes it."""
    bad = copy_trace(src, dst)
    t = Trace(bad)
    vid = min(t.vderived)
    lines = (bad / "records.jsonl").read_text().splitlines()
    rec = json.loads(lines[t.values[vid].producer])
    edit(rec)
    lines[t.values[vid].producer] = json.dumps(rec, separators=(",", ":"))
    (bad / "records.jsonl").write_text("\n".join(lines) + "\n")
    (bad / "checksums.jsonl").unlink()
    edit_meta(bad, status="running", complete=False, checksums=None)
    return bad, vid


def _to_transpose(r):
    r["op"], r["a"] = "aten.transpose.int", [r["a"][0], 0, 1]


@pytest.mark.parametrize("edit, needle", [
    (lambda r: r.__setitem__("op", "aten.neg.default"), "not a view divtrace rebuilds"),
    (_to_transpose, "corrupt"),  # a view op all the same, but not the one its fingerprint was derived from
])
def test_edited_view_record_is_caught(llama, tmp_path, edit, needle):
    _, t, _ = llama
    bad, vid = _edit_derived_record(t.path, tmp_path / "bad", edit)
    tb = Trace(bad)
    with pytest.raises(DivtraceError, match=needle):
        tb.tensor(vid)
    report = check_trace(tb)
    assert not report["ok"] and any(f"value {vid}" in p for p in report["problems"])


def test_each_mode_writes_the_oldest_format_that_holds_it(llama):
    # Full-mode views without bytes need version 2 (a version-1 reader would call them broken); hash mode adds
    # only the optional "r" mark, which version-1 readers ignore, so its traces stay readable by them.
    from divtrace.trace.records import FORMAT_VERSION

    _, full, hashed = llama
    assert full.meta["format_version"] == FORMAT_VERSION == 2
    assert hashed.meta["format_version"] == 1 and hashed.vderived


class ViewOfView(torch.nn.Module):
    """`a = w.t()` gets its real fingerprint (and bytes) when it enters `inner`; `b = a[1:3]` was derived from
    a's derived fingerprint before that, so it must be derived again from a's real one."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)))
        self.inner = torch.nn.Identity()

    def forward(self, x):
        a = self.w.t()
        b = a[1:3]
        c = self.inner(a)
        return b.sum() + c.sum() + x.sum(), b * 1


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_view_of_a_view_that_crosses_a_module_boundary(tmp_path, mode):
    m = ViewOfView()
    out = record_model(m, (torch.randn(2),), tmp_path / "t", mode=mode)
    t = Trace(tmp_path / "t")
    sl = next(r for r in t.records if r.kind == "op" and r.op == "aten.slice.Tensor")
    b = sl.outputs[0]
    assert b in t.vderived and t.values[sl.inputs[0]].hash == fingerprint(m.w.detach().t())[0]  # a: real now
    assert t.derived_problem(b) is None
    if mode == "full":
        assert torch.equal(t.tensor(b), m.w.detach().t()[1:3]) and check_trace(t)["ok"]
        mul = next(r for r in t.records if r.kind == "op" and r.op == "aten.mul.Tensor")
        assert torch.equal(t.tensor(mul.outputs[0]), out[1])


class Expand(torch.nn.Module):
    """The same bytes as a column or as a row, expanded to [3, 3]: other values, from one input hash."""

    def __init__(self, col: bool, implicit: bool = False):
        super().__init__()
        self.col, self.implicit = col, implicit

    def forward(self, x, m):
        src = m[:, None] if self.col else m[None, :]
        return x + torch.ops.aten.expand.default(src, [3, 3], implicit=self.implicit)


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_derived_fingerprint_knows_the_input_shape(tmp_path, mode):
    # Before the source's shape was part of the key, [3, 1] and [1, 3] expanded to [3, 3] got one fingerprint:
    # bisect then said the expands agreed and blamed the add that followed. No false "identical", either mode.
    x, m = torch.zeros(3, 3), torch.tensor([1., 2., 3.])
    record_model(Expand(True), (x, m), tmp_path / "a", mode=mode)
    record_model(Expand(False), (x, m), tmp_path / "b", mode=mode)
    a, b = Trace(tmp_path / "a"), Trace(tmp_path / "b")
    ea, eb = ([r for r in t.records if r.kind == "op" and r.op == "aten.expand.default"][0] for t in (a, b))
    va, vb = ea.outputs[0], eb.outputs[0]
    assert va in a.vderived and vb in b.vderived and a.vkey[va] != b.vkey[vb]
    assert not ValueComparator(a, b).same(va, vb)
    code, out, err = cli("bisect", tmp_path / "a", tmp_path / "b", "--json")
    region = [r["op"] for r in json.loads(out)["first"]["region_a"]]
    assert code == 1 and "aten.expand.default" in region, region


def test_keyword_arguments_of_a_view_are_rebuilt(tmp_path):
    x, m = torch.zeros(3, 3), torch.tensor([1., 2., 3.])
    record_model(Expand(True, implicit=True), (x, m), tmp_path / "t", mode="full")
    t = Trace(tmp_path / "t")
    (e,) = [r for r in t.records if r.kind == "op" and r.op == "aten.expand.default"]
    assert e.kwargs == {"implicit": True} and e.outputs[0] in t.vderived
    assert torch.equal(t.tensor(e.outputs[0]), m[:, None].expand(3, 3)) and check_trace(t)["ok"]


def test_full_mode_view_against_a_hash_mode_copy(tmp_path):
    # The full side can rebuild its view's bytes, so the hash side's real fingerprint of a copy settles it.
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    record_model(Proj(False), (x,), tmp_path / "a", mode="full")
    record_model(Proj(True), (x,), tmp_path / "b", mode="hash")
    a, b = Trace(tmp_path / "a"), Trace(tmp_path / "b")
    wa = next(r for r in a.records if r.kind == "op" and r.op == "aten.mm.default").inputs[1]
    wb = next(r for r in b.records if r.kind == "op" and r.op == "aten.mm.default").inputs[1]
    assert wa in a.vderived and a.vkey[wa] != b.vkey[wb]
    assert ValueComparator(a, b).same(wa, wb) and ValueComparator(b, a).same(wb, wa)


def test_derived_views_warn_across_view_keys(tmp_path):
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    record_model(Proj(False), (x,), tmp_path / "a", mode="hash")
    record_model(Proj(False), (x,), tmp_path / "b", mode="hash")
    assert Trace(tmp_path / "a").meta["view_key"] == "op-src-shape-2"
    edit_meta(tmp_path / "b", view_key=None)  # as written before the key was recorded
    code, out, err = cli("bisect", tmp_path / "a", tmp_path / "b", "--json")
    assert any("view_key" in w for w in json.loads(out)["warnings"])
    code, out, err = cli("bisect", tmp_path / "a", tmp_path / "a", "--json")
    assert code == 0 and not any("view_key" in w for w in json.loads(out)["warnings"])


@pytest.mark.parametrize("cross", [False, True])
def test_long_chain_of_views(tmp_path, cross):
    # Deeper than Python's recursion limit: read back in a loop. With `cross`, the root view gets its real
    # fingerprint at a module boundary and every view in the chain below it is derived again (in a loop too).
    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(1200, 4))
            self.inner = torch.nn.Identity()

        def forward(self, x):
            a = b = self.w.t()
            for _ in range(1100):
                b = b[:, 1:]
            return (self.inner(a).sum() if cross else 0) + (b * x).sum()

    m = Chain()
    record_model(m, (torch.ones(1),), tmp_path / "t", mode="full")
    t = Trace(tmp_path / "t")
    assert len(t.vderived) == 1100 + (not cross)  # the root w.t() too, unless it crossed the boundary
    assert check_trace(t)["ok"]
    assert torch.equal(t.tensor(max(t.vderived)), m.w.detach().t()[:, 1100:])
