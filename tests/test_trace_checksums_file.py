"""A closed trace's checksums.jsonl that cannot be read (issue 20 item 9). meta.json's sha256 still verifies
records.jsonl, so the trace reads; but the file is never ignored silently: a warning naming it in `show` and
`bisect`, FAILED in `show --check`."""
from __future__ import annotations

import json

import pytest

from divtrace.trace.reader import Trace
from test_trace_fixtures import cli, copy_trace, record_tiny


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("sums")
    return record_tiny(d / "a"), record_tiny(d / "b")


def spoil(path, how):
    f = path / "checksums.jsonl"
    whole = f.read_bytes()
    if how == "not_json":
        f.write_bytes(b"this is not a checksums file\n")
    elif how == "binary":
        f.write_bytes(bytes(range(256)))
    elif how == "no_newline":
        f.write_bytes(b"garbage")
    elif how == "json_not_checksums":
        f.write_text(json.dumps({"hello": 1}) + "\n")
    elif how == "last_line_cut":
        f.write_bytes(whole[:-10])
    elif how == "directory":
        f.unlink()
        f.mkdir()
    elif how == "missing":
        f.unlink()


CASES = ["not_json", "binary", "no_newline", "json_not_checksums", "last_line_cut", "directory", "missing"]


@pytest.mark.parametrize("how", CASES)
def test_unreadable_checksums_file_is_reported(pair, tmp_path, how):
    a, b = pair
    t = copy_trace(a, tmp_path / "t")
    spoil(t, how)
    name = str(t / "checksums.jsonl")

    tr = Trace(t)  # still reads: meta.json's sha256 vouches for records.jsonl
    assert tr.verified and tr.complete
    assert len(tr.file_problems) == 1 and tr.file_problems[0].startswith(name), tr.file_problems
    assert tr.file_problems[0] in tr.warnings

    code, out, err = cli("show", t)
    assert code == 0 and name in out + err and "warning" in out + err, out + err

    code, out, err = cli("show", t, "--check")
    assert code == 1, out + err
    failed = [line for line in (out + err).splitlines() if line.startswith("FAILED")]
    assert failed and name in failed[0], out + err

    code, out, err = cli("bisect", b, t)
    assert code == 0 and name in out + err, out + err  # identical runs: the verdict stands, with the warning
    code, out, err = cli("bisect", t, b, "--json")
    assert code == 0 and any(w.startswith(name) for w in json.loads(out)["warnings"]), out


def test_intact_checksums_file_is_not_reported(pair):
    a, b = pair
    assert Trace(a).file_problems == [] and Trace(a).warnings == []
    code, out, err = cli("show", a, "--check")
    assert code == 0 and "checksums.jsonl" not in out + err
    code, out, err = cli("bisect", a, b)
    assert code == 0 and "checksums.jsonl" not in out + err


def test_shard_digests_come_from_meta_json_of_a_closed_trace(pair, tmp_path):
    """Reading a closed trace's checksums.jsonl for its report must not take shard digests from it (older
    traces' shard lines): meta.json's are those of the closed trace."""
    t = copy_trace(pair[0], tmp_path / "t")
    shard = json.loads((t / "meta.json").read_text())["shards"][0]
    line = json.dumps({"shard": shard, "sha256": "0" * 64, "bytes": 1}, separators=(",", ":"))
    (t / "checksums.jsonl").write_text(line + "\n" + (t / "checksums.jsonl").read_text())
    tr = Trace(t)
    assert tr.file_problems == [] and not tr.shard_has_sha256(shard)
    assert cli("show", t, "--check")[0] == 0
