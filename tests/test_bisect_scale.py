"""Bisect at scale (issue 2): the fast trace reader, the compact index bisect reads, and no torch for hash traces.

The fast reader (Trace._read_fast) must accept exactly what the reference reader (Trace._read_reference, the
record-by-record validator) accepts, build the same records, values and calls, and leave every error to the
reference; these tests check that on systematically mutated traces. A bisect of hash traces must not import
torch (it costs seconds and ~220 MB); the tables that let it avoid torch are checked against torch here.
"""
from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import divtrace
from divtrace.compare import op_kinds as bisect_mod
from divtrace.errors import DivtraceError
from divtrace.trace import reader
from divtrace.trace.reader import Trace
from helpers import ROOT, record_model, record_pair
from test_trace_fixtures import Tiny, edit_meta, tiny_input

sys.path.insert(0, str(ROOT / "bench"))
import bench_bisect  # noqa: E402

INDEX = ("vkey", "vprod", "vsrc", "vblob", "vderived", "rcall", "rop", "rin", "rout", "calls", "_open",
         "_call_counts", "torn_tail", "verified", "warnings")
READERS = ("reference", "python", "native")  # Trace._read_reference; _index_fast alone; divtrace._index first

needs_native = pytest.mark.skipif(reader._native_index_records is None, reason="divtrace._index was not built")


def _record(path: Path, mode: str) -> Path:
    m = Tiny()
    with torch.no_grad(), divtrace.record(m, path, mode=mode, flush_records=6, shard_bytes=600):
        m(tiny_input())
        m(tiny_input(2))
    return path


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    d = tmp_path_factory.mktemp("scale")
    return {"hash": _record(d / "hash", "hash"), "full": _record(d / "full", "full")}


def _read(path: Path, fast: bool, native: bool = False):
    """('error', message) or ('ok', everything the trace holds), read with the reference reader (fast=False),
    the Python fast reader, or the C reader first (native=True)."""
    old = Trace.FAST, Trace.NATIVE
    Trace.FAST, Trace.NATIVE = fast, native
    try:
        t = Trace(path)
    except DivtraceError as e:
        return ("error", str(e)), None
    finally:
        Trace.FAST, Trace.NATIVE = old
    state = {k: getattr(t, k) for k in INDEX}
    state["records"] = list(t.records)
    state["values"] = dict(t.values.items())
    return ("ok", repr(state)), t  # repr: a NaN in the stats equals itself


def _reseal(path: Path) -> None:
    """Make records.jsonl's recorded sha256 match its (edited) bytes: the reader then parses it as verified.
    meta.json's fields that the opened trace is checked against (the module tree, the calls left running) are
    dropped, so that an edit of the records reaches the readers compared here instead of that check."""
    raw = (path / "records.jsonl").read_bytes()
    meta = json.loads((path / "meta.json").read_text())
    meta["checksums"]["records"] = {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
    meta.pop("module_tree", None)
    meta.pop("unfinished_calls", None)
    (path / "meta.json").write_text(json.dumps(meta))


def _unverify(path: Path) -> None:
    """As a killed run whose checksums were lost: nothing to verify against, parsed line by line."""
    edit_meta(path, status="running", complete=False, checksums=None, records=None, shards=None)
    (path / "checksums.jsonl").unlink()


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


REPLACEMENTS = [None, True, False, 0, -1, 1, 3, 10**12, 1.5, float("nan"), "", "x", "o", "e", "torch.float32",
                "float32", "bfloat16", "float8_e4m3fn", "0" * 32, "A" * 32, "0" * 31, [], [0], [1, 2], [True],
                [1.0], [-1], ["args.0", 0], [["args.0", 0]], {}, {"$v": 0}, [1.0, 2.0, 3.0, 0, 0], "tensors-00000.safetensors"]


def _mutations(lines: list[bytes], rng: random.Random, n: int):
    """n edits of records.jsonl, drawn deterministically: a value replaced or deleted anywhere in a line, lines
    dropped, duplicated, swapped, re-spaced or reordered (still the same JSON), and a few that are not JSON."""
    docs = [json.loads(line) for line in lines]
    for _ in range(n):
        i = rng.randrange(len(lines))
        new = list(lines)
        what = rng.random()
        if what < 0.75:
            doc = json.loads(lines[i])
            path = rng.choice(list(_paths(doc))[1:])
            parent = doc
            for key in path[:-1]:
                parent = parent[key]
            if isinstance(parent, dict) and rng.random() < 0.2:
                del parent[path[-1]]
            else:
                parent[path[-1]] = rng.choice(REPLACEMENTS)
            new[i] = json.dumps(doc, separators=(",", ":")).encode()
        elif what < 0.8:
            del new[i]
        elif what < 0.85:
            new.insert(rng.randrange(len(new) + 1), lines[i])
        elif what < 0.9:
            j = rng.randrange(len(lines))
            new[i], new[j] = new[j], new[i]
        elif what < 0.95:  # the same record, written another (valid) way: both readers must accept it alike
            doc = docs[i]
            new[i] = json.dumps(dict(reversed(list(doc.items()))) if rng.random() < 0.5 else doc).encode()
        else:
            new[i] = rng.choice([b"", b"{", b"[]", b"1", lines[i] + b" " + lines[i], lines[i][:-3], b"null",
                                 lines[i] + b"," + lines[i]])
        yield b"\n".join(new) + b"\n"


@pytest.mark.parametrize("base,unverified,n", [("hash", False, 700), ("full", False, 300), ("hash", True, 300)])
def test_fast_readers_agree_with_the_reference(bases, tmp_path, base, unverified, n):
    """Whatever the edit, the Python fast reader and the C reader give the reference's error, or the same
    trace (the same index and chunks, for the two fast ones)."""
    import shutil

    t = shutil.copytree(bases[base], tmp_path / "t")
    if unverified:
        _unverify(t)
    lines = (t / "records.jsonl").read_bytes().splitlines()
    same = fast_ok = native_ok = errors = 0
    for data in _mutations(lines, random.Random(f"{base}-{unverified}"), n):
        (t / "records.jsonl").write_bytes(data)
        if not unverified:
            _reseal(t)
        ref, _ = _read(t, fast=False)
        got, trace = _read(t, fast=True)
        assert got == ref, (data.decode(errors="replace")[:2000], got[1] if got[0] == "error" else "ok",
                            ref[1] if ref[0] == "error" else "ok")
        got_native, trace_native = _read(t, fast=True, native=True)
        assert got_native == ref, (data.decode(errors="replace")[:2000], str(got_native[1])[:300], str(ref[1])[:300])
        if trace is not None and trace.read_fast:
            assert trace_native._chunks == trace._chunks
        same += 1
        errors += ref[0] == "error"
        fast_ok += trace is not None and trace.read_fast
        native_ok += trace_native is not None and trace_native.read_native
    # Both kinds of outcome were exercised, and the fast reader took most of the valid edits itself. (The C
    # reader gives up on any edit that leaves the writer's form, such as re-spaced or reordered keys.)
    assert errors > n // 4 and fast_ok > (same - errors) // 2, (same, errors, fast_ok)
    if reader._native_index_records is not None:
        assert native_ok > (same - errors) // 3, (same, errors, native_ok)


@needs_native
@pytest.mark.parametrize("mode", ["hash", "full"])
def test_native_reader_builds_what_the_python_readers_build(bases, mode):
    ref, _ = _read(bases[mode], fast=False)
    fast, t = _read(bases[mode], fast=True)
    native, n = _read(bases[mode], fast=True, native=True)
    assert n.read_native and not t.read_native and native == fast == ref and n._chunks == t._chunks
    assert n.records[5] == t.records[5] and dict(n.values.items()) == dict(t.values.items())


def _with(d: dict, after: str, key: str, value) -> dict:
    """`d` with `key` set right after `after` (the writer's key order)."""
    out = {}
    for k, v in d.items():
        if k != key:
            out[k] = v
        if k == after:
            out[key] = value
    return out


# Edits in the writer's exact form (so the C reader reads them through) that break what a record means:
# (name, line index in the Tiny hash trace or None for every line, edit of its parsed JSON). Line 2 is an op (aten.t) whose values
# are weight 1 (from outside) and its derived view 2; 3 is an op (addmm); 13 a later root call's enter.
_MEANING_EDITS = [
    ("producer is another record", 3, lambda d: d["V"][1].update(p=4)),
    ("vid defined twice", 3, lambda d: d["V"][0].update(v=0)),
    # the bias (vid 3) called 0 everywhere, so every reference to it still resolves: only the second
    # definition of 0 is wrong
    ("vid defined twice, consistently", None, lambda d: _renamed_vid(d, 3, 0)),
    ("negative vid", None, lambda d: _renamed_vid(d, 3, -3)),
    ("unknown dtype", 3, lambda d: d["V"][0].update(d="float7")),
    ("hash in upper case", 3, lambda d: d["V"][0].update(h=d["V"][0]["h"].upper())),
    ("hash too short", 3, lambda d: d["V"][0].update(h=d["V"][0]["h"][:31])),
    ("negative dim", 3, lambda d: d["V"][0].update(s=[-16])),
    ("stride of another rank", 3, lambda d: d["V"].__setitem__(1, _with(d["V"][1], "p", "t", [1]))),
    ("derived without producer", 2, lambda d: d["V"].__setitem__(0, {**d["V"][0], "r": 1})),
    ("derived mark 2", 2, lambda d: d["V"][1].update(r=2)),
    ("stored bytes in a hash trace", 3, lambda d: d["V"].__setitem__(0, {**d["V"][0], "b": "x", "f": "tensors-00000.safetensors"})),
    ("four stats", 3, lambda d: d["V"][0].update(m=d["V"][0]["m"][:4])),
    ("stats not a dict", 3, lambda d: d["V"].__setitem__(0, {("M" if k == "m" else k): v for k, v in d["V"][0].items()})),
    ("kwargs a list", 3, lambda d: _swap(d, _with(d, "o", "kw", []))),
    ("args an object", 3, lambda d: d.update(a={})),
    ("index skips", 3, lambda d: d.update(i=4)),
    ("unknown kind", 3, lambda d: d.update(k="z")),
    ("input never defined", 3, lambda d: d["in"].append(10**6)),
    ("output another op made", 3, lambda d: d["out"].append(2)),
    ("output another op made, alone", 3, lambda d: d.update(out=[2])),
    ("output listed twice", 3, lambda d: d["out"].append(4)),
    ("value it produced not an output", 3, lambda d: d.update(out=[])),
    ("op in a call not open", 3, lambda d: d.update(c=2)),
    ("op in a call that returned", 6, lambda d: d.update(c=1)),
    # every record of call 4 (the second root call) renamed call 1, an id the first root call's child used
    ("enter of a call id used before", None, lambda d: d.update({k: 1 for k in ("c", "p") if d.get(k) == 4})),
    ("call number skips", 13, lambda d: d.update(n=2)),
    ("parent not open", 14, lambda d: d.update(p=0)),
    ("exit of a call not open", 4, lambda d: d.update(c=10**6)),
    ("exit of a call that returned", 7, lambda d: d.update(c=1)),
    ("exit output never defined", 4, lambda d: d.update(out=[["out", 10**6]])),
    ("enter input from its own values", 13, lambda d: None),
]


def _renamed_vid(d: dict, old: int, new: int) -> None:
    """Value `old` called `new` wherever an op record defines or reads it (the bias of the Tiny trace's Linear)."""
    for v in d.get("V", ()):
        if v["v"] == old:
            v["v"] = new
    if d["k"] == "o":
        d["in"] = [new if x == old else x for x in d["in"]]


def _swap(d: dict, new: dict) -> None:
    d.clear()
    d.update(new)


@needs_native
@pytest.mark.parametrize("name,line,edit", _MEANING_EDITS, ids=[e[0] for e in _MEANING_EDITS])
def test_native_reader_checks_what_a_record_means(bases, tmp_path, name, line, edit):
    """Each edit keeps the writer's form, so the C reader itself must decide: as the reference does."""
    import shutil

    t = shutil.copytree(bases["hash"], tmp_path / "t")
    lines = (t / "records.jsonl").read_bytes().splitlines()
    for i in range(len(lines)) if line is None else [line]:
        d = json.loads(lines[i])
        edit(d)
        lines[i] = json.dumps(d, separators=(",", ":")).encode()
    (t / "records.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    _reseal(t)
    ref, _ = _read(t, fast=False)
    got, trace = _read(t, fast=True, native=True)
    assert got == ref
    if name in ("output listed twice", "enter input from its own values"):
        assert ref[0] == "ok" and trace.read_native  # both accept
    else:
        assert ref[0] == "error"


def _planted(line: bytes) -> list[bytes]:
    """Lines the C reader must give up on (each still a JSON object, most of them a valid record): another
    key order, spacing, an escape, a float where an int goes, NaN, an extra key, deep nesting."""
    doc = json.loads(line)
    return [json.dumps(doc).encode(), json.dumps(dict(reversed(list(doc.items()))), separators=(",", ":")).encode(),
            line.replace(b'"k":', b'"k" :'), line.replace(b'"i":', b'"i":1e0,"j":', 1),
            line[:-1] + b',"zz":1}', line.replace(b'"V":[', b'"V":[ ', 1),
            line.replace(b'"a":[', b'"a":[' + b"[" * 70 + b"]" * 70 + b",", 1),
            line.replace(b'"a":[', b'"a":["\\u00e9",NaN,', 1),
            line.replace(b'"a":[', b'"a":[' + b"1" * 5000 + b",", 1),  # json refuses ints over 4300 digits
            b'{"k":"', line.replace(b'"a":[', b'"a":["\\x",', 1), line.replace(b'"a":[', b'"a":["\\u12G4",', 1)]


@needs_native
def test_native_reader_gives_up_on_anything_but_the_writers_form(bases, tmp_path):
    """Each planted line, alone in an otherwise untouched trace: the C reader gives up (never accepts), and
    the trace reads exactly as the reference reads it."""
    import shutil

    t = shutil.copytree(bases["hash"], tmp_path / "t")
    lines = (t / "records.jsonl").read_bytes().splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(b'{"k":"o"') and b'"V":[' in line)
    tried = 0
    for planted in _planted(lines[i]):
        (t / "records.jsonl").write_bytes(b"\n".join(lines[:i] + [planted] + lines[i + 1:]) + b"\n")
        _reseal(t)
        ref, _ = _read(t, fast=False)
        got, trace = _read(t, fast=True, native=True)
        assert got == ref and (trace is None or not trace.read_native), planted
        tried += 1
    assert tried == 12


@needs_native
def test_native_reader_reads_escaped_strings_it_does_not_keep(bases, tmp_path):
    """Escapes in strings the index does not keep (an error message, a string argument) are read natively;
    names it keeps (module, op, keys) still go to the Python readers when escaped."""
    import shutil

    t = shutil.copytree(bases["hash"], tmp_path / "t")
    lines = (t / "records.jsonl").read_bytes().splitlines()
    op, exit_ = json.loads(lines[3]), json.loads(lines[4])
    assert op["k"] == "o" and exit_["k"] == "x"
    op["a"].append('a "quoted" \\ path, caf\u00e9\n\t/')
    exit_["err"] = 'ValueError: bad "x" in caf\u00e9\u2028'
    lines[3], lines[4] = (json.dumps(d, separators=(",", ":")).encode() for d in (op, exit_))
    assert b"\\u00e9" in lines[3] and b'\\"' in lines[4]
    (t / "records.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    _reseal(t)
    ref, _ = _read(t, fast=False)
    got, trace = _read(t, fast=True, native=True)
    assert got == ref and ref[0] == "ok" and trace.read_native
    assert trace.records[3].args[-1] == op["a"][-1] and trace.records[4].error == exit_["err"]


@needs_native
def test_native_reader_stops_at_a_line_cut_after_its_kind(bases, tmp_path):
    """The last line cut right where the kind letter goes: nothing past the end is read (found with ASan)."""
    import shutil

    t = shutil.copytree(bases["hash"], tmp_path / "t")
    (t / "records.jsonl").write_bytes((t / "records.jsonl").read_bytes() + b'{"k":"\n')
    _reseal(t)
    ref, _ = _read(t, fast=False)
    got, _ = _read(t, fast=True, native=True)
    assert got == ref and ref[0] == "error"


def _fnv_slot(name: str) -> int:
    """The slot divtrace._index's intern table (FNV-1a, 4096 slots) first tries for `name`."""
    h = 2166136261
    for b in name.encode():
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h % 4096


@needs_native
def test_native_reader_with_a_crowded_intern_table(bases, tmp_path):
    """Nine names that all want one slot of the intern table, in one record: the module name (interned first)
    is still used after the eighth key has found the table crowded there. It must not have been let go (a
    use-after-free, found by review: the process crashed)."""
    import shutil

    by_slot: dict = {}
    for i in range(10**6):
        names = by_slot.setdefault(_fnv_slot(f"n{i}"), [])
        names.append(f"n{i}")
        if len(names) == 9:
            break
    module, keys = names[0], names[1:]
    t = shutil.copytree(bases["hash"], tmp_path / "t")
    lines = (t / "records.jsonl").read_bytes().splitlines()
    d = json.loads(lines[1])
    assert d["m"] == "lin" and d["in"] == [["args.0", 0]]
    d.update(m=module, **{"in": [[k, 0] for k in keys]})
    lines[1] = json.dumps(d, separators=(",", ":")).encode()
    lines = [line.replace(b'"m":"lin"', f'"m":"{module}"'.encode()) for line in lines]
    (t / "records.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    _reseal(t)
    ref, _ = _read(t, fast=False)
    got, trace = _read(t, fast=True, native=True)
    assert got == ref and trace.read_native
    assert trace.calls[1].module == module and [k for k, _ in trace.calls[1].inputs] == keys


def test_records_split_across_lines_are_built_as_validated(bases, tmp_path):
    """A hand edit can split one record over two lines and put two records on one line; read as one JSON array
    (as the reference does for checksummed bytes) that is still the same records. Records built later must
    come from that same parse, not from a line read alone (which would be half a record, or another one)."""
    import shutil

    t = shutil.copytree(bases["hash"], tmp_path / "t")
    lines = (t / "records.jsonl").read_bytes().splitlines()
    i = next(n for n, line in enumerate(lines) if b'"a":[{"$v":' in line and b'},{"$v":' in line)
    cut = lines[i].index(b'},{"$v":') + 1
    j = i + 3  # two other records share a line, so the count of lines stays the count of records
    edited = lines[:i] + [lines[i][:cut], lines[i][cut + 1:]] + lines[i + 1:j] + [lines[j] + b"," + lines[j + 1]] \
        + lines[j + 2:]
    assert len(edited) == len(lines)
    (t / "records.jsonl").write_bytes(b"\n".join(edited) + b"\n")
    _reseal(t)
    fast, trace = _read(t, fast=True)
    ref, _ = _read(t, fast=False)
    assert trace.read_fast and fast == ref
    again = Trace(t)  # one record asked for first, alone: built from the chunk it was validated in
    assert again.records[i + 1] == Trace(bases["hash"]).records[i + 1]
    assert again.records[i] == Trace(bases["hash"]).records[i]


@pytest.mark.parametrize("mode", ["hash", "full"])
def test_fast_reader_builds_what_the_reference_builds(bases, mode):
    fast, t = _read(bases[mode], fast=True)
    ref, _ = _read(bases[mode], fast=False)
    assert t.read_fast and fast == ref


def test_lazy_records_and_values_act_like_list_and_dict(bases):
    t = Trace(bases["full"])
    _, r = _read(bases["full"], fast=False)  # the reference reader's plain list and dict, for comparison
    assert t.read_fast and not r.read_fast
    n = len(r.records)
    assert len(t.records) == n and len(t.values) == len(r.values) > 0
    assert t.records[-1] == r.records[-1] and t.records[1:4] == r.records[1:4] and t.records[::5] == r.records[::5]
    assert list(t.records) == r.records and t.records == r.records and r.records == t.records
    with pytest.raises(IndexError):
        t.records[n]
    with pytest.raises(TypeError):
        t.records["0"]
    vid = next(iter(r.values))
    assert vid in t.values and t.values[vid] == r.values[vid] and t.values.get(-5) is None
    with pytest.raises(KeyError):
        t.values[10**9]
    assert list(t.values) == list(r.values) and t.values == r.values and dict(t.values) == r.values
    assert t.producer(vid) == r.values[vid].producer and t.has_bytes(vid)


def test_hash_bisect_never_imports_torch(tmp_path):
    """A hash-trace bisect, through the CLI and the library, with a real localization (casts included), runs
    without torch."""
    a, b = record_pair(tmp_path, "all", mode="hash")
    code = ("import json, sys\n"
            "from divtrace.cli.app import main\n"
            "rc = main(['bisect', sys.argv[1], sys.argv[2], '--json'])\n"
            "sys.stderr.write('\\nRESULT ' + json.dumps([rc, 'torch' in sys.modules]) + '\\n')\n"
            "from divtrace.compare.bisect import bisect\n"
            "r = bisect(sys.argv[1], sys.argv[2])\n"
            "sys.stderr.write('RESULT ' + json.dumps([r.first.module, r.first.op, r.first.op_b, 'torch' in sys.modules]) + '\\n')\n")
    p = subprocess.run([sys.executable, "-c", code, str(a), str(b)], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in p.stderr.splitlines() if "RESULT " in line]
    assert len(results) == 2, p.stderr
    assert results[0] == [1, False]
    assert results[1] == ["model.layers.0.input_layernorm", "aten._to_copy.default", "aten.mul.Tensor", False]
    out = json.loads(p.stdout)
    assert out["verdict"] == "diverged" and out["first"]["metrics_available"] is False and out["hint"]
    # and `divtrace bisect` itself, as a user runs it: -X importtime lists every module the process imports
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "divtrace", "bisect", str(a), str(b), "--json"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    imported = [line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")]
    assert p.returncode == 1 and json.loads(p.stdout) == out and "divtrace.compare.bisect" in imported
    assert not [m for m in imported if m.split(".")[0] in ("torch", "numpy", "safetensors")], imported


@pytest.mark.parametrize("mode", ["hash", "full"])
def test_bisect_is_the_same_on_either_reader(tmp_path, mode):
    a, b = record_pair(tmp_path, "all", mode=mode)
    results = []
    for fast, native in ((True, True), (True, False), (False, False)):
        Trace.FAST, Trace.NATIVE = fast, native
        try:
            ta, tb = Trace(a), Trace(b)
            assert ta.read_fast is fast and tb.read_fast is fast
            assert ta.read_native is tb.read_native is (native and reader._native_index_records is not None)
            results.append(divtrace.bisect(ta, tb).to_dict())
        finally:
            Trace.FAST, Trace.NATIVE = True, True
    assert results[0] == results[1] == results[2]
    assert results[0]["verdict"] == "diverged" and results[0]["compared"] > 10


def test_torch_free_tables_match_torch():
    """The dtype, finfo and fingerprint-scheme tables the reader and bisect use instead of importing torch."""
    from divtrace.compare import results
    from divtrace.record import settings
    from divtrace.trace import fingerprint

    for short, size in {**reader._CORE_DTYPES, **reader._OPTIONAL_DTYPES}.items():
        d = getattr(torch, short, None)
        assert reader._dtype_info(short) == (None if d is None else (f"torch.{short}", d.itemsize)), short
        if d is None:
            continue
        assert d.itemsize == size
        name = f"torch.{short}"
        if not d.is_floating_point:
            assert bisect_mod._finfo(name) is None and name not in bisect_mod._FLOAT_WITHOUT_FINFO
            continue
        try:
            fi = torch.finfo(d)
            want = (fi.bits, fi.eps, fi.max, fi.tiny)
        except (NotImplementedError, TypeError, RuntimeError):
            assert name in bisect_mod._FLOAT_WITHOUT_FINFO and bisect_mod._finfo(name) is None
            continue
        assert bisect_mod._finfo(name) == want and name not in bisect_mod._FLOAT_WITHOUT_FINFO, name
    assert reader._dtype_info("float33") is None and reader._dtype_info(["float32"]) is None
    for scheme in reader._SCHEMES_KNOWN_WITHOUT_TORCH:
        assert fingerprint.hasher(scheme) is not None
    assert fingerprint.HASH_SCHEME in reader._SCHEMES_KNOWN_WITHOUT_TORCH
    a = {"num_threads": 1, "x": None, "sdp_flash": True}
    b = {"num_threads": 2, "y": 0, "sdp_flash": True}
    assert results.settings_diff(a, b) == settings.settings_diff(a, b)


def test_cast_to_packed_fp4_is_computing_not_a_crash():
    """torch.finfo has no float4_e2m1fn_x2: telling whether a cast to or from it rounds raised
    NotImplementedError (an "internal error" from bisect); such a cast may round, so it is computing."""
    assert bisect_mod.cast_rounds("torch.float32", "torch.float4_e2m1fn_x2")
    assert bisect_mod.cast_rounds("torch.float4_e2m1fn_x2", "torch.float32")
    assert not bisect_mod.cast_rounds("torch.float4_e2m1fn_x2", "torch.float4_e2m1fn_x2")
    assert not bisect_mod.cast_rounds("torch.bfloat16", "torch.float32")
    assert bisect_mod.cast_rounds("torch.float32", "torch.bfloat16")
    with pytest.raises(DivtraceError):
        bisect_mod.cast_rounds("torch.float32", "torch.bogus")


def test_show_counts_ops_from_the_index(bases):
    from divtrace.cli.show_cmd import trace_summary

    t = Trace(bases["full"])
    s = trace_summary(t)
    ops = [r.op for r in Trace(bases["full"]).records if r.kind == "op"]
    assert s["ops"] == len(ops) > 0 and dict(s["top_ops"]) == {op: ops.count(op) for op in set(ops)}


def test_bench_reaches_the_record_count():
    # bench/bench_record.py's synthetic model stopped at 91,666 records for a 100k target
    for n in (100_000, 3, 14, 15, 99_999):
        leaves = bench_bisect.leaves_for(n)
        assert leaves * bench_bisect.RECORDS_PER_LEAF + bench_bisect.ROOT_RECORDS >= n


def test_bench_runs(tmp_path):
    """The benchmark end to end at a small size (no timing asserted): both variants in fresh processes."""
    out = tmp_path / "bench.json"
    assert bench_bisect.main(["--records", "400", "--repeats", "1", "--json", str(out), "--keep", str(tmp_path / "t")]) == 0
    res = json.loads(out.read_text())
    assert min(res["records_per_trace"]) >= 400
    for variant in ("cli", "library"):
        r = res[variant]
        assert (r["verdict"], r["module"], r["op"]) == ("diverged", "", "aten.add.Tensor")
        assert r["torch_imported"] is False and r["seconds"] > 0 and r["peak_rss_mb"] > 0


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_record_bench_orders_are_balanced(n):
    """bench/bench_record.py runs each round in one of these orders: each configuration must come right after
    each other one equally often, and every order must hold every configuration once."""
    from collections import Counter

    import bench_record

    orders = bench_record.balanced_orders(n)
    assert all(sorted(o) == list(range(n)) for o in orders)
    follows = Counter((o[i], o[i + 1]) for o in orders for i in range(n - 1))
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1


@pytest.mark.parametrize("fast,native", [(True, True), (True, False), (False, False)])
def test_a_trace_nobody_refers_to_is_freed(bases, fast, native):
    """Reading and bisecting pause the cyclic GC, and a caller may keep it off, so a trace must be freed by
    reference counting alone: in a reference cycle it could stay (when the reader still froze the GC, two
    100k-record traces kept ~400 MB for the life of the process). A view of its records keeps it alive while
    used."""
    import weakref

    old = Trace.FAST, Trace.NATIVE
    Trace.FAST, Trace.NATIVE = fast, native
    try:
        t = Trace(bases["full"])
        list(t.records)
        vid = next(iter(t.values))
        t.tensor(vid)
        assert Trace(bases["full"]).records[3] == t.records[3]  # a temporary trace, alive through its view
        ref = weakref.ref(t)
        del t
        assert ref() is None
    finally:
        Trace.FAST, Trace.NATIVE = old


class _Cycle:
    def __init__(self):
        self.me = self


@pytest.mark.parametrize("fast,native", [(True, True), (True, False), (False, False)])
def test_reading_and_bisecting_leave_the_gc_able_to_free_older_cycles(bases, fast, native):
    """Regression: the reader called gc.freeze() after every read, which moved every object of the process out
    of the GC's reach for good, so cyclic garbage made of objects alive at that moment (a model a trainer drops
    after bisecting in-process) was never freed."""
    import gc
    import weakref

    from divtrace.compare.bisect import bisect

    old = Trace.FAST, Trace.NATIVE
    Trace.FAST, Trace.NATIVE = fast, native
    try:
        cycle = _Cycle()
        ref = weakref.ref(cycle)
        frozen = gc.get_freeze_count()
        Trace(bases["hash"])
        bisect(bases["hash"], bases["full"])
        assert gc.get_freeze_count() == frozen and gc.isenabled()
        del cycle
        gc.collect()
        assert ref() is None
        gc.disable()  # a caller who runs with the GC off keeps it off
        try:
            bisect(bases["hash"], bases["hash"])
            assert not gc.isenabled()
        finally:
            gc.enable()
    finally:
        Trace.FAST, Trace.NATIVE = old


@pytest.mark.parametrize("fast,native", [(True, True), (True, False), (False, False)])
def test_the_index_is_left_out_of_gc_scans(bases, fast, native):
    """What replaced gc.freeze: the index is tuples of ints and strings, which the GC stops tracking (the C
    reader at once, CPython in its first collections for the Python readers), so later collections do not walk
    hundreds of thousands of them. A list in their place would be tracked for good."""
    import gc

    old = Trace.FAST, Trace.NATIVE
    Trace.FAST, Trace.NATIVE = fast, native
    try:
        t = Trace(bases["full"])
    finally:
        Trace.FAST, Trace.NATIVE = old
    assert t.read_native == native
    if not native:
        # A collection meets a key tuple before its shape tuple (it moves what only the key refers to behind it),
        # so it untracks the shapes, and the next one the keys.
        gc.collect()
        gc.collect()
    ops = [i for i, r in enumerate(t.rin) if r is not None]
    assert ops and all(type(t.rin[i]) is tuple and type(t.rout[i]) is tuple for i in ops)
    assert all(type(k[1]) is tuple for k in t.vkey.values()) and t.vblob
    index = [*t.vkey.values(), *t.vblob.values(), *(t.rin[i] for i in ops), *(t.rout[i] for i in ops),
             *(p for c in t.calls.values() for p in (*c.inputs, *c.outputs))]
    assert not [x for x in index if gc.is_tracked(x)]


class _Scalars(torch.nn.Module):
    def forward(self, x):
        return (x + torch.arange(x.shape[-1])).sum() + torch.zeros(())  # ops with no tensor input; 0-d values


def test_readers_agree_on_scalars_and_ops_without_inputs(tmp_path):
    """Empty shapes ("s":[]) and empty input lists ("in":[]) become empty tuples in every reader's index."""
    m = _Scalars()
    with torch.no_grad(), divtrace.record(m, tmp_path / "t", mode="hash"):
        m(torch.randn(3, 4))
    ref, t = _read(tmp_path / "t", fast=False)
    assert () in {k[1] for k in t.vkey.values()} and () in set(t.rin)
    assert _read(tmp_path / "t", fast=True)[0] == ref
    if reader._native_index_records is not None:
        got, tn = _read(tmp_path / "t", fast=True, native=True)
        assert got == ref and tn.read_native


class _Splits(torch.nn.Module):
    def forward(self, x):
        return torch.stack(torch.split(x, 1))  # one op with 100 outputs


@needs_native
def test_native_reader_reads_ops_with_many_outputs(tmp_path):
    m = _Splits()
    with torch.no_grad(), divtrace.record(m, tmp_path / "t", mode="hash"):
        m(torch.randn(100, 4))
    ref, _ = _read(tmp_path / "t", fast=False)
    got, t = _read(tmp_path / "t", fast=True, native=True)
    assert got == ref and t.read_native and max(len(o) for o in t.rout if o) == 100


class _Fp8(torch.nn.Module):
    def forward(self, x):
        return x.to(torch.float8_e4m3fn).float()


@needs_native
def test_native_reader_looks_up_a_dtype_it_has_not_seen(tmp_path, monkeypatch):
    """A dtype the reader's table does not hold yet (float8: asking imports torch) is looked up and the trace
    read again, not handed to the slower Python reader."""
    m = _Fp8()
    with torch.no_grad(), divtrace.record(m, tmp_path / "t", mode="hash"):
        m(torch.randn(8, 4))
    monkeypatch.delitem(reader._DTYPE_INFO, "float8_e4m3fn", raising=False)
    got, t = _read(tmp_path / "t", fast=True, native=True)
    assert t.read_native and "float8_e4m3fn" in reader._DTYPE_INFO
    assert got == _read(tmp_path / "t", fast=False)[0]
