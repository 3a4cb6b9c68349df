"""Strided views (w.t(), transposes, expands) get a fingerprint derived from their op and input (divtrace.views),
and in full mode no bytes of their own: the reader rebuilds them from the op. Rebuilt bytes must be exactly the
view the recording saw, a view must never make two equal tensors compare unequal where the bytes are there, and
a record edited to rebuild something else must be caught."""
from __future__ import annotations

import json

import pytest
import torch

from divtrace.compare.align import ValueComparator
from divtrace.errors import DivtraceError
from divtrace.fingerprint import fingerprint
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
    from divtrace.records import FORMAT_VERSION

    _, full, hashed = llama
    assert full.meta["format_version"] == FORMAT_VERSION == 2
    assert hashed.meta["format_version"] == 1 and hashed.vderived
