"""No pickle on any read path, and a pickle planted in a trace never runs."""
from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

from test_trace_fixtures import cli, copy_trace, record_tiny, shard

PKG = Path(__file__).resolve().parent.parent / "divtrace"
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal", "jsonpickle"}
# torch.load / numpy.load / yaml.load and friends deserialize code or arbitrary objects.
BANNED_CALLS = {("torch", "load"), ("serialization", "load"), ("np", "load"), ("numpy", "load"), ("yaml", "load"),
                ("yaml", "unsafe_load"), ("yaml", "full_load"), ("yaml", "load_all"), ("pd", "read_pickle"),
                ("pandas", "read_pickle")}


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(PKG.parent)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            out += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod.split(".")[0] in BANNED_MODULES:
                out.append(f"{where}: from {mod} import ...")
            if mod in ("torch", "torch.serialization", "numpy") and any(a.name == "load" for a in node.names):
                out.append(f"{where}: from {mod} import load")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, (ast.Name, ast.Attribute)):
                base = f.value.id if isinstance(f.value, ast.Name) else f.value.attr
                if (base, f.attr) in BANNED_CALLS:
                    out.append(f"{where}: {base}.{f.attr}(...)")
            for kw in node.keywords:
                if isinstance(kw.value, ast.Constant):
                    if kw.arg == "weights_only" and kw.value.value is False:
                        out.append(f"{where}: weights_only=False")
                    if kw.arg == "allow_pickle" and kw.value.value is True:
                        out.append(f"{where}: allow_pickle=True")
    return out


def test_source_walk_finds_no_pickle():
    files = sorted(PKG.rglob("*.py"))
    assert len(files) > 10
    problems = [p for f in files for p in _problems(f)]
    assert not problems, problems


def test_source_walk_would_catch_it(tmp_path):
    # The walker itself must see each banned form (else the test above passes vacuously).
    bad = PKG / "_walker_probe.py"
    src = ("import pickle\nfrom torch import load\nimport torch, numpy as np, yaml\n"
           "torch.load('x', weights_only=False)\nnp.load('x', allow_pickle=True)\nyaml.load('x')\n")
    bad.write_text(src)
    try:
        assert len(_problems(bad)) == 7, _problems(bad)
    finally:
        bad.unlink()


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pickle code ran"))


@pytest.mark.parametrize("target", ["shard", "meta", "records", "checksums", "extra_pt"])
def test_planted_pickle_never_runs(tmp_path, monkeypatch, target):
    monkeypatch.setenv("COLUMNS", "1000")  # one message, one line: a long temp path must not wrap it
    a = record_tiny(tmp_path / "a")
    bad = copy_trace(a, tmp_path / "bad")
    marker = tmp_path / "PWNED"
    payload = pickle.dumps(_Payload(marker))
    dest = {"shard": shard(bad), "meta": bad / "meta.json", "records": bad / "records.jsonl",
            "checksums": bad / "checksums.jsonl", "extra_pt": bad / "tensors-00007.pt"}[target]
    dest.write_bytes(payload)
    results = [cli("show", bad), cli("show", bad, "--check"), cli("bisect", bad, a, "--json")]
    assert not marker.exists()
    for code, out, err in results:
        assert code in (0, 1, 2) and "Traceback" not in err and len(err.strip().splitlines()) <= 1, err
    if target in ("meta", "records"):
        assert all(code == 2 for code, _, _ in results)
    if target == "checksums":  # not needed to read a closed trace, but never ignored silently
        assert results[1][0] == 1 and all("checksums.jsonl" in out + err for _, out, err in results)
    if target == "shard":
        assert results[1][0] == 1 and results[2][0] == 2  # --check fails; bisect refuses (verify_shards)
