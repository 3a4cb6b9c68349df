"""Bad traces: every one gives a one-line error naming the file (exit 2), and none is ever called identical."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from divtrace.errors import DivtraceError
from divtrace.trace.reader import Trace
from test_trace_fixtures import cli, copy_trace, edit_meta, flip_byte, record_tiny, shard


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("pair")
    return record_tiny(d / "a"), record_tiny(d / "b")


def one_line_error(code, err, *needles):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_closed_trace_carries_checksums(pair):
    a, _ = pair
    meta = json.loads((a / "meta.json").read_text())
    assert meta["checksums"]["records"]["sha256"] == hashlib.sha256((a / "records.jsonl").read_bytes()).hexdigest()
    # Shards carry no digest of their own: every tensor in them is checked against its fingerprint.
    assert meta["checksums"]["shards"] == {} and meta["shards"]
    # (and the files beside records.jsonl: params.jsonl, token files; never a shard)
    assert all(set(json.loads(line)) <= {"records", "sha256", "files"}
               for line in (a / "checksums.jsonl").read_text().splitlines())
    Trace(a).verify_shards()
    assert cli("show", a, "--check")[0] == 0


def _as_older_trace(path):
    """What the writer made before shards lost their sha256: one per shard in meta.json's checksums."""
    meta = json.loads((path / "meta.json").read_text())
    meta["checksums"]["shards"] = {s: hashlib.sha256((path / s).read_bytes()).hexdigest() for s in meta["shards"]}
    (path / "meta.json").write_text(json.dumps(meta))


def test_older_trace_shards_still_checked_against_their_sha256(pair, tmp_path):
    old = copy_trace(pair[0], tmp_path / "old")
    _as_older_trace(old)
    Trace(old).verify_shards()
    assert cli("show", old, "--check")[0] == 0
    # A byte of the header's padding: no tensor changes, only the file's sha256 can tell.
    s = shard(old)
    raw = s.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    pad = raw.rindex(b"}", 8, 8 + n) + 1
    if pad == 8 + n:  # no padding in this header: pad it, and record the padded file's sha256
        raw = (n + 8).to_bytes(8, "little") + raw[8:8 + n] + b" " * 8 + raw[8 + n:]
        s.write_bytes(raw)
        _as_older_trace(old)
        Trace(old).verify_shards()
    flip_byte(s, pad)
    with pytest.raises(DivtraceError, match="do not match the recorded sha256"):
        Trace(old).verify_shards()


def test_older_incomplete_trace_reads_its_shard_lines(pair, tmp_path):
    # Before, checksums.jsonl also held one {"shard", "sha256", "bytes"} line per shard.
    old = copy_trace(pair[0], tmp_path / "old")
    edit_meta(old, status="running", complete=False, checksums=None)
    s = shard(old)
    line = json.dumps({"shard": s.name, "sha256": hashlib.sha256(b"other").hexdigest(), "bytes": s.stat().st_size})
    (old / "checksums.jsonl").write_text(line + "\n" + (old / "checksums.jsonl").read_text())
    t = Trace(old)
    with pytest.raises(DivtraceError, match="do not match the recorded sha256"):
        t.verify_shards()


def test_corrupt_shard_bytes_with_intact_manifest(pair, tmp_path):
    a, b = pair
    bad = copy_trace(a, tmp_path / "bad")
    s = shard(bad)
    flip_byte(s, s.stat().st_size - 3)  # in the tensor data, not the header
    t = Trace(bad)  # the manifest is fine, so opening works ...
    with pytest.raises(DivtraceError, match=s.name):
        t.verify_shards()  # ... but the bytes are not what was written
    code, out, _ = cli("show", bad, "--check")
    assert code == 1 and "FAILED" in out
    code, out, err = cli("bisect", bad, b, "--json")
    assert code == 2 and "identical" not in out, (code, out, err)  # needs bisect to call verify_shards()
    one_line_error(code, err, s.name)


def test_every_shard_tensor_is_checked_against_its_fingerprint(pair, tmp_path):
    bad = copy_trace(pair[0], tmp_path / "bad")
    s = shard(bad)
    flip_byte(s, s.stat().st_size - 3)
    t = Trace(bad)
    errors = []
    for vid in t.values:
        try:
            t.tensor(vid)
        except DivtraceError as e:
            errors.append(str(e))
    assert errors and all("corrupt" in e and s.name in e for e in errors)


@pytest.mark.parametrize("edit", ["hash", "stats", "op", "drop_line", "append_line"])
def test_hand_edited_records_of_a_closed_trace(pair, tmp_path, edit):
    bad = copy_trace(pair[0], tmp_path / "bad")
    p = bad / "records.jsonl"
    lines = p.read_text().splitlines()
    i = next(n for n, line in enumerate(lines) if '"k":"o"' in line and '"V"' in line)
    rec = json.loads(lines[i])
    if edit == "hash":
        h = rec["V"][-1]["h"]
        rec["V"][-1]["h"] = ("1" if h[0] != "1" else "2") + h[1:]
    elif edit == "stats":
        rec["V"][-1]["m"][1] = 1234.5
    elif edit == "op":
        rec["op"] = "aten.sub.Tensor"
    lines[i] = json.dumps(rec, separators=(",", ":"))
    if edit == "drop_line":
        lines.pop()
    if edit == "append_line":
        lines.append(lines[-1])
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(DivtraceError, match="records.jsonl"):
        Trace(bad)
    one_line_error(*cli("bisect", bad, pair[1], "--json")[::2], "records.jsonl")


def test_truncated_records_and_shard(pair, tmp_path):
    bad = copy_trace(pair[0], tmp_path / "bad")
    p = bad / "records.jsonl"
    p.write_bytes(p.read_bytes()[:-40])
    one_line_error(*cli("show", bad)[::2], "records.jsonl", "truncated")
    bad2 = copy_trace(pair[0], tmp_path / "bad2")
    s = shard(bad2)
    s.write_bytes(s.read_bytes()[: s.stat().st_size // 2])
    t = Trace(bad2)
    with pytest.raises(DivtraceError, match=s.name):
        t.verify_shards()
    with pytest.raises(DivtraceError, match="truncated or corrupt"):
        t.tensor(next(iter(t.values)))
    assert cli("show", bad2, "--check")[0] == 1


@pytest.mark.parametrize("older", [False, True])
def test_record_pointing_to_a_missing_tensor(pair, tmp_path, older):
    # A shard rewritten as a valid file (in an older trace, its checksum updated too) without one tensor a
    # record needs.
    bad = copy_trace(pair[0], tmp_path / "bad")
    s = shard(bad)
    tensors = load_file(str(s))
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, str(s))
    if older:
        _as_older_trace(bad)
    with pytest.raises(DivtraceError, match=f"has no tensor {dropped}" if older else f"tensor {dropped} missing"):
        Trace(bad).verify_shards()
    code, out, err = cli("bisect", bad, pair[1], "--json")
    assert code == 2 and "identical" not in out, (code, out, err)
    (bad / s.name).unlink()
    with pytest.raises(DivtraceError, match="shard missing"):
        Trace(bad).verify_shards()


@pytest.mark.parametrize("case", ["missing", "file", "empty", "no_meta", "not_json", "newer", "bad_type",
                                  "bad_mode", "no_scheme", "complete_without_checksums", "meta_is_dir"])
def test_not_a_trace_or_bad_metadata(pair, tmp_path, case):
    p = tmp_path / "t"
    if case == "file":
        p.write_text("hello")
    elif case == "empty":
        p.mkdir()
    elif case == "no_meta":
        p.mkdir()
        (p / "records.jsonl").write_text("")
    elif case == "meta_is_dir":
        p.mkdir()
        (p / "meta.json").mkdir()
    elif case != "missing":
        copy_trace(pair[0], p)
        if case == "not_json":
            (p / "meta.json").write_bytes(b"\x80\x04garbage{")
        elif case == "newer":
            edit_meta(p, format_version=99)
        elif case == "bad_type":
            edit_meta(p, settings=["not", "a", "dict"])
        elif case == "bad_mode":
            edit_meta(p, mode="partial")
        elif case == "no_scheme":
            edit_meta(p, hash_scheme=None)
        elif case == "complete_without_checksums":
            edit_meta(p, checksums=None)
    needles = {"missing": "no such trace", "file": "is a file", "empty": "empty directory",
               "no_meta": "without meta.json", "not_json": "meta.json", "newer": "newer divtrace",
               "bad_type": "'settings' is malformed", "bad_mode": "unknown mode", "no_scheme": "hash_scheme",
               "complete_without_checksums": "marked complete", "meta_is_dir": "meta.json"}[case]
    one_line_error(*cli("show", p)[::2], needles)
    one_line_error(*cli("bisect", p, pair[1])[::2], needles)


def _as_killed(src, dst):
    """A copy that looks like a run killed before close: meta.json still says running, no final checksums."""
    t = copy_trace(src, dst)
    edit_meta(t, status="running", complete=False, checksums=None, records=None, shards=None)
    return t


def test_unclosed_trace_is_verified_from_checksums_file(pair, tmp_path):
    t = _as_killed(pair[0], tmp_path / "killed")
    assert Trace(t).verified and not Trace(t).complete
    p = t / "records.jsonl"
    raw = p.read_bytes()
    p.write_bytes(raw + raw[:25])  # a flush the run did not finish: dropped, trace still opens
    tr = Trace(t)
    assert tr.torn_tail and len(tr.records) == raw.count(b"\n")
    p.write_bytes(raw.replace(b'"k":"o"', b'"k":"o" ', 1))  # an edit inside verified bytes
    with pytest.raises(DivtraceError, match="checksums.jsonl"):
        Trace(t)
    (t / "checksums.jsonl").unlink()
    p.write_bytes(raw)
    tr = Trace(t)
    assert not tr.verified and tr.warnings  # nothing to verify against: said so, not hidden
    assert cli("show", t, "--check")[0] == 1


def test_same_record_with_other_dtype_or_shape(tmp_path):
    a = record_tiny(tmp_path / "a")
    b = record_tiny(tmp_path / "b", x=torch.randn(5, 8))  # another batch size: every shape differs
    code, out, err = cli("bisect", a, b, "--json")
    assert code == 1 and json.loads(out)["verdict"] == "diverged", err
    from test_trace_fixtures import Tiny
    import divtrace

    m = Tiny().double()
    with torch.no_grad(), divtrace.record(m, tmp_path / "c"):
        m(torch.randn(3, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    code, out, err = cli("bisect", a, tmp_path / "c", "--json")
    first = json.loads(out)["first"]
    assert code == 1 and first["cause"] == "propagated" and first["tensor"] == "input args.0", (out, err)
    code, out, err = cli("bisect", a, tmp_path / "c")  # the human report renders mismatched dtypes too
    assert code == 1 and "FAILED" in out and not err


def test_unrelated_models_are_refused_clearly(tmp_path):
    a = record_tiny(tmp_path / "a")
    import divtrace

    m = torch.nn.Sequential(torch.nn.Conv1d(2, 2, 3))
    with torch.no_grad(), divtrace.record(m, tmp_path / "b"):
        m(torch.randn(1, 2, 8))
    one_line_error(*cli("bisect", a, tmp_path / "b")[::2], "unrelated models")


@pytest.mark.parametrize("mode", ["hash", "full"])
@pytest.mark.parametrize("durable", [False, True])
def test_durable_fsyncs_the_data_before_the_meta_that_vouches_for_it(tmp_path, monkeypatch, durable, mode):
    """durable=True: records.jsonl and the shards, then meta.json's temp file, then the trace directory (the
    rename) and its parent (the trace directory's entry) reach the disk, in that order, at close. The default
    fsyncs nothing (an fsync on a busy disk stalls the recording); the trace reads the same either way."""
    import os

    import divtrace
    from test_trace_fixtures import Tiny, tiny_input

    synced = []
    real = os.fsync

    def fsync(fd):
        ino = os.fstat(fd).st_ino
        name = next((str(p.relative_to(tmp_path)) for p in [tmp_path, *tmp_path.rglob("*")] if p.stat().st_ino == ino))
        synced.append("<meta temp>" if name.startswith("t/.meta.json.") and name.endswith(".tmp") else name)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    m = Tiny()
    with torch.no_grad(), divtrace.record(m, tmp_path / "t", mode=mode, durable=durable, shard_bytes=600):
        m(tiny_input())
    shards = sorted(p.name for p in (tmp_path / "t").glob("tensors-*.safetensors"))
    assert (len(shards) > 1) is (mode == "full") and (mode == "full" or not shards)
    # (the files beside records.jsonl first: params.jsonl, the parameter names)
    assert synced == (["t/params.jsonl", "t/records.jsonl", *(f"t/{s}" for s in shards), "<meta temp>", "t", "."]
                      if durable else [])
    t = Trace(tmp_path / "t")
    assert t.complete and len(t.records) > 3


def test_non_finite_meta_fields_are_written_as_strict_json(tmp_path):
    """meta.json is strict JSON even when a field holds NaN or Inf (written as their repr)."""
    import divtrace
    from test_trace_fixtures import Tiny, tiny_input

    m = Tiny()
    with torch.no_grad(), divtrace.record(m, tmp_path / "t", mode="hash", extra_meta={"lr": float("nan"),
                                                                                      "clip": [float("inf")]}):
        m(tiny_input())
    meta = json.loads((tmp_path / "t" / "meta.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert meta["lr"] == "nan" and meta["clip"] == ["inf"] and Trace(tmp_path / "t").complete
