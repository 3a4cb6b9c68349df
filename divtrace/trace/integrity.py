"""Integrity of a trace's files: records.jsonl against its recorded sha256 (meta.json's when the recording
closed, else checksums.jsonl's checkpoints, which also cover what a killed run left), and the stored tensor
bytes against their fingerprints (older traces: each shard against its sha256). `show --check`
(divtrace/trace/check.py) and bisect, before it says "identical", ask for the whole of it."""
from __future__ import annotations

import hashlib
import json

from divtrace.errors import DivtraceError
from divtrace.trace.fields import _is_int
from divtrace.trace.files import CHECKSUMS, RECORDS, sha256_file


class Integrity:
    """The integrity checks of Trace (a mixin: the state is Trace's, see divtrace/trace/reader.py)."""

    # records.jsonl ----------------------------------------------------------------------------------------
    def _verified_records(self) -> bytes:
        """The bytes of records.jsonl that a recorded sha256 vouches for."""
        where = self.path / RECORDS
        try:
            raw = where.read_bytes()
        except OSError as e:
            raise DivtraceError(f"{where}: cannot read records: {e.strerror or e}") from None
        sums = self.meta.get("checksums")
        if sums is not None:  # the recording closed: the whole file is accounted for
            self._shard_sums = dict(sums["shards"])
            want = sums["records"]
            if len(raw) != want["bytes"]:
                raise DivtraceError(f"{where}: {len(raw)} bytes, but the recording closed it at {want['bytes']} "
                                    "(truncated or edited)")
            if hashlib.sha256(raw).hexdigest() != want["sha256"]:
                raise DivtraceError(f"{where}: contents do not match the sha256 recorded in meta.json (edited or "
                                    "corrupted)")
            return raw
        checkpoints = self._read_checksums_file()
        if checkpoints is None:
            self.verified = False
            self.warnings.append(f"{self.path}: no checksums (meta.json unfinished and {CHECKSUMS} missing): "
                                 "records are not verified")
            return raw
        best = max((c for c in checkpoints if c[0] <= len(raw)), default=(0, hashlib.sha256(b"").hexdigest()))
        if hashlib.sha256(raw[:best[0]]).hexdigest() != best[1]:
            raise DivtraceError(f"{where}: the first {best[0]} bytes do not match their sha256 in {CHECKSUMS} "
                                "(edited or corrupted)")
        if best[0] < len(raw):
            self.torn_tail = True  # a write the run did not finish
        return raw[:best[0]]

    def _read_checksums_file(self):
        where = self.path / CHECKSUMS
        try:
            raw = where.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise DivtraceError(f"{where}: cannot read: {e.strerror or e}") from None
        lines = raw.split(b"\n")
        last_whole = lines.pop()  # b"" when the file ends with a newline; else a line the run did not finish
        del last_whole
        checkpoints = []
        for n, line in enumerate(lines, 1):
            try:
                d = json.loads(line)
            except (ValueError, RecursionError):
                raise DivtraceError(f"{where}:{n}: corrupt line (not JSON)") from None
            if isinstance(d, dict) and set(d) == {"records", "sha256"} and _is_int(d["records"]) \
                    and isinstance(d["sha256"], str):
                checkpoints.append((d["records"], d["sha256"]))
            elif isinstance(d, dict) and set(d) == {"shard", "sha256", "bytes"} and isinstance(d["shard"], str) \
                    and isinstance(d["sha256"], str):
                self._shard_sums[d["shard"]] = d["sha256"]
            else:
                raise DivtraceError(f"{where}:{n}: not a checksum line")
        return checkpoints

    # stored bytes -----------------------------------------------------------------------------------------
    def shard_has_sha256(self, name: str) -> bool:
        """Whether the shard carries a sha256 (traces written before shards lost it)."""
        return name in self._shard_sums

    def shard_problems(self) -> list[str]:
        """Every problem with the stored bytes: a shard missing, or a tensor a record points to missing or not
        matching its fingerprint. Shards of older traces that carry a sha256 are checked against it instead
        (a stream of each file; no tensor deserialized)."""
        by_shard: dict[str, list[int]] = {}
        for vid, (_, shard) in self.vblob.items():
            by_shard.setdefault(shard, []).append(vid)
        problems = []
        for name in sorted(by_shard):
            p = self.path / name
            if not p.is_file():
                problems.append(f"{p}: shard missing ({len(by_shard[name])} tensor values point to it)")
                continue
            want = self._shard_sums.get(name)
            if want is None:
                problems += self._check_tensors(by_shard[name])
                continue
            try:
                got = sha256_file(p)
            except OSError as e:
                problems.append(f"{p}: cannot read: {e.strerror or e}")
                continue
            if got != want:
                problems.append(f"{p}: contents do not match the recorded sha256 (truncated, edited or corrupted)")
                continue
            try:
                keys = set(self._open_shard(name, by_shard[name][0]).keys())
            except DivtraceError as e:
                problems.append(str(e))
                continue
            missing = sorted({self.vblob[vid][0] for vid in by_shard[name]} - keys)
            if missing:
                problems.append(f"{p}: has no tensor {missing[0]}, which a record points to")
        return problems

    def _check_tensors(self, vids: list[int]) -> list[str]:
        problems, seen = [], set()
        for vid in vids:
            if self.vblob[vid][0] in seen:
                continue
            seen.add(self.vblob[vid][0])
            try:
                self.tensor(vid)
            except DivtraceError as e:
                problems.append(str(e))
        return problems

    def verify_shards(self) -> None:
        """Raise DivtraceError (naming the file) unless every stored byte is what the recording wrote. Bisect
        calls it before it reports "identical", which it otherwise decides from fingerprints alone."""
        if self._shards_verified:
            return
        problems = self.shard_problems()
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise DivtraceError(problems[0] + more)
        self._shards_verified = True
