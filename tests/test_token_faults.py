"""Issue 33: token traces guarded like the rest. Fault injection into the token files of an identical
token-aligned pair (a KV-cache rollout of a bf16 HF Llama against the trainer's full-sequence recompute), in hash
and full mode: every file (tokens.jsonl, rows.jsonl, rows.bin) of either side cut to nothing, to half, by one
byte; bits flipped; lines and rows swapped, zeroed, duplicated and deleted; ids, keys, positions, sequences,
layout codes and offsets changed (tests/token_faults.py). Bisect in both orders must be bad input (exit 2) naming
the damaged file, never identical, never diverged, never an internal error; `show --check` must fail each one.

Run in-process (the CLI's main, no subprocess per case) with fixed seeds. Before this, 78 such runs read
"identical" and a deleted tokens.jsonl passed `show --check`.
"""
from __future__ import annotations

import json
import random
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from divtrace.trace.reader import Trace
from test_trace_fixtures import cli
from token_faults import MUTATIONS, ROWS_BIN, ROWS_INDEX, TOKENS, flip_bit

sys.path.insert(0, str(Path(__file__).parent))
import token_cases as tc  # noqa: E402

pytest.importorskip("transformers")

BIT_FLIP_SEEDS = 4  # bit flips at this many places per file (one is in the table already)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """mode -> (trainer, rollout): an identical token-aligned pair (bf16: batch-invariant matmuls on this CPU)."""
    d = tmp_path_factory.mktemp("token-faults")
    m = tc.llama(torch.bfloat16)
    out = {}
    for mode in ("hash", "full"):
        roll, train = d / f"rollout-{mode}", d / f"train-{mode}"
        seqs = tc.rollout(m, roll, tc.prompts(), mode=mode)
        tc.trainer(m, train, seqs, mode=mode)
        out[mode] = (train, roll)
    return out


def _bisect_json(a, b):
    code, out, err = cli("bisect", a, b, "--json")
    return code, (json.loads(out) if code in (0, 1, 3) else None), err


def test_the_pair_is_identical_and_token_aligned(pairs):
    """The control: unchanged, the pair reads identical by tokens in both orders, and show --check passes with
    the token files verified against their checksums."""
    for mode, (train, roll) in pairs.items():
        for a, b in ((train, roll), (roll, train)):
            code, r, err = _bisect_json(a, b)
            assert code == 0 and r["verdict"] == "identical" and r["alignment"] == "tokens", (mode, err)
        for t in (train, roll):
            code, out, _ = cli("show", t, "--check", "--json")
            tokens = json.loads(out)["check"]["tokens"]
            assert code == 0 and tokens["verified"] is True and tokens["grids"] >= 1


def _cases():
    for fname, muts in MUTATIONS.items():
        for name, mut in muts.items():
            yield fname, name, mut, 0
        for seed in range(1, BIT_FLIP_SEEDS):
            yield fname, f"bit flip #{seed + 1}", flip_bit, seed


def test_every_token_file_mutation_is_bad_input_naming_the_file(pairs, tmp_path):
    outcomes: Counter = Counter()
    failures = []
    n = 0
    for mode, (train, roll) in pairs.items():
        for side, victim in (("rollout", roll), ("trainer", train)):
            other = train if victim is roll else roll
            for fname, name, mut, seed in _cases():
                case = f"{mode} {side} {fname}: {name}"
                bad = tmp_path / f"m{n}"
                n += 1
                shutil.copytree(victim, bad)
                mut(bad / fname, random.Random(f"{case}/{seed}"))
                for a, b in ((other, bad), (bad, other)):
                    code, out, err = cli("bisect", a, b)
                    outcomes[f"bisect exit {code}"] += 1
                    one_line = err.strip().splitlines()
                    if not (code == 2 and len(one_line) == 1 and str(bad / fname) in err
                            and "internal error" not in err and "Traceback" not in err):
                        failures.append((case, "bisect", code, err[-300:], out[:200]))
                code, out, err = cli("show", bad, "--check", "--json")
                check = json.loads(out)["check"] if code in (0, 1) else None
                outcomes[f"show --check exit {code}"] += 1
                if not (code == 1 and check and not check["ok"] and any(str(bad / fname) in p for p in check["problems"])):
                    failures.append((case, "show --check", code, err[-300:], out[-300:]))
                shutil.rmtree(bad)
    print(f"\n{n} mutated traces: {dict(outcomes)}")
    assert not failures, failures[:5]
    assert n == 2 * 2 * sum(len(m) + BIT_FLIP_SEEDS - 1 for m in MUTATIONS.values())
    assert outcomes == {"bisect exit 2": 2 * n, "show --check exit 1": n}


def test_a_call_aligned_pair_with_damaged_token_files_is_bad_input(pairs, tmp_path):
    """The same rollout twice pairs by calls (its root calls hold the same tokens in the same cells): damaged
    token files must not switch it to token alignment, nor be passed over. Each file, three kinds of damage."""
    m = tc.llama(torch.bfloat16)
    again = tmp_path / "again"
    tc.rollout(m, again, tc.prompts(), mode="hash")
    roll = pairs["hash"][1]
    code, r, _ = _bisect_json(roll, again)
    assert code == 0 and r["verdict"] == "identical" and r.get("alignment", "calls") == "calls"
    for fname in (TOKENS, ROWS_INDEX, ROWS_BIN):
        for name in ("deleted", "truncate to half", "bit flip"):
            bad = tmp_path / f"{fname}-{name}".replace(" ", "-")
            shutil.copytree(again, bad)
            MUTATIONS[fname][name](bad / fname, random.Random(name))
            for a, b in ((roll, bad), (bad, roll)):
                code, out, err = cli("bisect", a, b)
                assert code == 2 and str(bad / fname) in err and "internal error" not in err, (fname, name, err)


def _as_written_before_checksums(path: Path) -> None:
    """Make a trace look as it was written before the token files had checksums: no meta.json file_checksums,
    no `files` in checksums.jsonl."""
    meta = json.loads((path / "meta.json").read_text())
    meta.pop("file_checksums")
    (path / "meta.json").write_text(json.dumps(meta))
    lines = [json.loads(x) for x in (path / "checksums.jsonl").read_text().splitlines()]
    (path / "checksums.jsonl").write_text("".join(json.dumps({k: v for k, v in d.items() if k != "files"}) + "\n"
                                                  for d in lines))


def test_traces_written_before_token_checksums_read_with_one_warning(pairs, tmp_path):
    train, roll = pairs["hash"]
    old = shutil.copytree(roll, tmp_path / "old")
    _as_written_before_checksums(old)
    code, r, err = _bisect_json(train, old)
    assert code == 0 and r["verdict"] == "identical" and r["alignment"] == "tokens", err
    said = [w for w in r["warnings"] if "token files written before divtrace checked them" in w]
    assert len(said) == 1 and said[0].startswith(f"{old}:") and "read unverified" in said[0]
    code, out, err = cli("show", old, "--check")
    assert code == 0 and "unverified: no checksums" in out, out
    said = " ".join((out + err).split())  # (rich wraps long lines)
    assert said.count("token files written before divtrace checked them") == 1, said
    # What can still be checked is: the keys fold the ids, the lines parse, meta.json's counts hold.
    for fname, name in ((TOKENS, "changed id"), (TOKENS, "zeroed line"), (ROWS_INDEX, "deleted line"),
                        (ROWS_INDEX, "truncate to half"), (TOKENS, "deleted")):
        bad = shutil.copytree(old, tmp_path / f"old-{fname}-{name}".replace(" ", "-"))
        MUTATIONS[fname][name](bad / fname, random.Random(name))
        code, out, err = cli("bisect", train, bad)
        assert code == 2 and str(bad) in err and "internal error" not in err, (fname, name, err)


def test_a_zeroed_module_output_row_is_damage_and_repro_refuses_it(pairs, tmp_path):
    """Zeroing one row of a module's output in rows.bin read "FAILED: diverged ... mismatched 0 of 256, max abs
    0" (rows whose stored bytes are equal named as a divergence), and repro wrote a repro of it. It is damage: the
    checksums say so, bisect and repro are bad input naming rows.bin, and no repro is written."""
    train, roll = pairs["full"]
    bad = shutil.copytree(train, tmp_path / "train")
    t = Trace(train)
    idx = t.token_index()
    mlp = next(c for c in t.calls.values() if c.module == "model.layers.0.mlp")
    vid = mlp.outputs[0][1]
    cid, code, off = idx.index[vid]
    assert code == "bt" and off >= 0 and t.vkey[vid][1][-1] == 128  # [B, T, 128] bf16: 256-byte rows
    data = bytearray((bad / ROWS_BIN).read_bytes())
    data[8 * off:8 * off + 8] = bytes(8)
    (bad / ROWS_BIN).write_bytes(bytes(data))
    for a, b in ((bad, roll), (roll, bad)):
        code, out, err = cli("bisect", a, b)
        assert code == 2 and f"{bad / ROWS_BIN}: contents do not match the sha256" in err and "FAILED" not in out, err
    code, out, err = cli("repro", bad, roll, "--out", tmp_path / "repro")
    assert code == 2 and str(bad / ROWS_BIN) in err and not (tmp_path / "repro" / "repro.py").exists(), err


def _reseal(path: Path) -> None:
    """Give the token files of a closed trace the digests a writer of their current bytes would have written."""
    import hashlib

    meta = json.loads((path / "meta.json").read_text())
    for name in meta["file_checksums"]:
        data = (path / name).read_bytes() if (path / name).exists() else b""
        meta["file_checksums"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (path / "meta.json").write_text(json.dumps(meta))


def test_lines_and_keys_of_a_newer_divtrace_are_kept_not_refused(pairs, tmp_path):
    """Forward compatible: a line kind this reader does not know (a newer divtrace's declared final values) and a
    grid key it does not know (a per-grid `used` positions list) are kept for whoever reads them, and the trace
    reads as before."""
    train, roll = pairs["hash"]
    new = shutil.copytree(roll, tmp_path / "newer")
    lines = (new / TOKENS).read_text().splitlines()
    i = next(i for i, x in enumerate(lines) if x.startswith('{"c"'))
    grid = json.loads(lines[i])
    grid["used"] = [0, 1]
    lines[i] = json.dumps(grid, separators=(",", ":"))
    lines.append(json.dumps({"final": {"c": grid["c"], "key": "out.logits"}}))
    (new / TOKENS).write_text("\n".join(lines) + "\n")
    _reseal(new)
    code, r, err = _bisect_json(train, new)
    assert code == 0 and r["verdict"] == "identical" and r["alignment"] == "tokens", err
    idx = Trace(new).token_index()
    idx.check()
    assert idx.grids[grid["c"]].extra == {"used": [0, 1]}
    # (this divtrace's own line kinds, "P": the positions a call's model used, are kept there too)
    assert [x for x in idx.other_lines if "P" not in x[1]] == [(len(lines), {"final": {"c": grid["c"], "key": "out.logits"}})]
