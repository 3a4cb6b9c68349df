"""Traces are written in the shard-summable scheme (lane-gsum128-v2 / row-gsum64-v2); traces of the older scheme
(lane32-wsum128 / rowlane-wsum2x32) still read, verify and compare with each other, and two traces of different
schemes are refused with one line instead of every value reading as different."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import divtrace
from divtrace.errors import DivtraceError
from divtrace.trace import fingerprint as v1
from divtrace.trace import hashing

sys.path.insert(0, str(Path(__file__).parent))
import token_cases as tc  # noqa: E402

pytest.importorskip("transformers")


def _record(path, old_scheme: bool, monkeypatch):
    """A small rollout, written in the current scheme or (old_scheme) in lane32-wsum128 / rowlane-wsum2x32, as a
    divtrace before the switch wrote it."""
    with monkeypatch.context() as m:
        if old_scheme:
            from divtrace.record import rowhash, token_rows, token_store, values
            from divtrace.trace import writer

            m.setattr(writer, "HASH_SCHEME", v1.HASH_SCHEME)
            m.setattr(writer, "fingerprint", v1.fingerprint)
            m.setattr(values, "fingerprint", v1.fingerprint)
            m.setattr(token_rows, "strided_row_fingerprints", rowhash.strided_row_hashes)
            m.setattr(token_rows, "rows_bytes", lambda x: x)
            m.setattr(token_rows, "row_fingerprints", rowhash.row_hashes)
            m.setattr(hashing, "ROW_SCHEME", rowhash.ROW_SCHEME)
        tc.rollout(tc.llama(layers=1), path, tc.prompts((5, 7)), new_tokens=2, mode="full")
    return json.loads((Path(path) / "meta.json").read_text())


def test_new_traces_use_the_summable_schemes(tmp_path, monkeypatch):
    meta = _record(tmp_path / "new", False, monkeypatch)
    assert meta["hash_scheme"] == hashing.TENSOR_SCHEME == "lane-gsum128-v2"
    assert meta["tokens"]["row_scheme"] == hashing.ROW_SCHEME == "row-gsum64-v2"


def test_old_scheme_traces_still_read_verify_and_compare(tmp_path, monkeypatch):
    for name in ("old1", "old2"):
        meta = _record(tmp_path / name, True, monkeypatch)
        assert meta["hash_scheme"] == "lane32-wsum128" and meta["tokens"]["row_scheme"] == "rowlane-wsum2x32"
    t = divtrace.open_trace(tmp_path / "old1")
    t.verify_shards()  # every stored tensor against its (old) fingerprint
    r = divtrace.bisect(tmp_path / "old1", tmp_path / "old2", align="tokens")
    assert r.verdict == "identical"


def test_traces_of_two_schemes_are_refused(tmp_path, monkeypatch):
    _record(tmp_path / "old", True, monkeypatch)
    _record(tmp_path / "new", False, monkeypatch)
    for a, b in (("old", "new"), ("new", "old")):
        with pytest.raises(DivtraceError, match=r"different fingerprint schemes \(.*\).*record both with one divtrace"):
            divtrace.bisect(tmp_path / a, tmp_path / b)
