"""Integrity of a trace's files: records.jsonl against its recorded sha256 (meta.json's when the recording
closed, else checksums.jsonl's checkpoints, which also cover what a killed run left), the files appended in step
with it (the token files: which prefix of each the same checkpoint vouches for, `file_sums`; they are checked
when read, divtrace/trace/token_checks.py), and the stored tensor bytes against their fingerprints (older traces:
each shard against its sha256). `show --check` (divtrace/trace/check.py) and bisect, before it says
"identical", ask for the whole of it."""
from __future__ import annotations

import hashlib
import json

from divtrace.errors import DivtraceError
from divtrace.trace.fields import _is_int
from divtrace.trace.files import CHECKSUMS, META, RECORDS, sha256_file


def _file_sums_ok(files) -> bool:
    """A checkpoint's `files`: {name: [bytes, sha256]}."""
    return isinstance(files, dict) and all(
        isinstance(v, list) and len(v) == 2 and _is_int(v[0]) and v[0] >= 0 and isinstance(v[1], str)
        for v in files.values())


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
        files = self.meta.get("file_checksums")
        if sums is not None:  # the recording closed: the whole file is accounted for
            self._shard_sums = dict(sums["shards"])
            if files is not None:
                self.file_sums = {n: (d["bytes"], d["sha256"]) for n, d in files.items()}
            want = sums["records"]
            if len(raw) != want["bytes"]:
                raise DivtraceError(f"{where}: {len(raw)} bytes, but the recording closed it at {want['bytes']} "
                                    "(truncated or edited)")
            if hashlib.sha256(raw).hexdigest() != want["sha256"]:
                raise DivtraceError(f"{where}: contents do not match the sha256 recorded in meta.json (edited or "
                                    "corrupted)")
            self._note_checksums_file()
            return raw
        checkpoints = self._read_checksums_file()
        if checkpoints is None:
            self.verified = False
            self.warnings.append(f"{self.path}: no checksums (meta.json unfinished and {CHECKSUMS} missing): "
                                 "records are not verified")
            return raw
        # The last checkpoint whose records reached the file (checkpoints grow; one line may follow another with
        # the same records and more of the files beside them).
        best = (0, hashlib.sha256(b"").hexdigest(), {})
        for c in checkpoints:
            if c[0] <= len(raw):
                best = c
        if files is not None:
            self.file_sums = {n: tuple(v) for n, v in best[2].items()}
        if hashlib.sha256(raw[:best[0]]).hexdigest() != best[1]:
            raise DivtraceError(f"{where}: the first {best[0]} bytes do not match their sha256 in {CHECKSUMS} "
                                "(edited or corrupted)")
        if best[0] < len(raw):
            self.torn_tail = True  # a write the run did not finish
        return raw[:best[0]]

    def _note_checksums_file(self) -> None:
        """checksums.jsonl of a closed trace. meta.json's sha256 verifies records.jsonl, so the file is not
        needed to read the trace; but a file of the trace that cannot be read is said (a warning, FAILED in
        `show --check`), never ignored silently."""
        kept, self._shard_sums = self._shard_sums, {}  # meta.json's: a closed trace's shard digests are those
        try:
            if self._read_checksums_file(closed=True) is None:
                self._file_problem(f"{self.path / CHECKSUMS}: missing")
        except DivtraceError as e:
            self._file_problem(str(e))
        finally:
            self._shard_sums = kept

    def _file_problem(self, problem: str) -> None:
        self.file_problems.append(f"{problem}; ignored: meta.json's sha256 still verifies {RECORDS}")
        self.warnings.append(self.file_problems[-1])

    def _read_checksums_file(self, closed: bool = False):
        """The (bytes, sha256, files) checkpoints of records.jsonl and of the files beside it ({name: [bytes,
        sha256]}) in checksums.jsonl (and older traces' shard digests, into _shard_sums); None when there is no
        such file. A line the run did not finish is dropped,
        unless the recording `closed` (then every line was finished)."""
        where = self.path / CHECKSUMS
        try:
            raw = where.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise DivtraceError(f"{where}: cannot read: {e.strerror or e}") from None
        lines = raw.split(b"\n")
        last_whole = lines.pop()  # b"" when the file ends with a newline; else a line the run did not finish
        if closed and last_whole:
            raise DivtraceError(f"{where}:{len(lines) + 1}: corrupt line (cut off{'' if lines else ', or not JSON'})")
        checkpoints = []
        for n, line in enumerate(lines, 1):
            try:
                d = json.loads(line)
            except (ValueError, RecursionError):
                raise DivtraceError(f"{where}:{n}: corrupt line (not JSON)") from None
            if isinstance(d, dict) and set(d) - {"files"} == {"records", "sha256"} and _is_int(d["records"]) \
                    and isinstance(d["sha256"], str) and _file_sums_ok(d.get("files", {})):
                if checkpoints and d["records"] < checkpoints[-1][0]:
                    raise DivtraceError(f"{where}:{n}: a checkpoint of fewer records than the line before it")
                checkpoints.append((d["records"], d["sha256"], d.get("files", {})))
            elif isinstance(d, dict) and set(d) == {"shard", "sha256", "bytes"} and isinstance(d["shard"], str) \
                    and isinstance(d["sha256"], str):
                self._shard_sums[d["shard"]] = d["sha256"]
            else:
                raise DivtraceError(f"{where}:{n}: not a checksum line")
        return checkpoints

    # meta.json against the records --------------------------------------------------------------------------
    # meta.json is written by the recording, and nothing vouches for it but itself: an edited status, record
    # count or module tree would still read. What the records can check is checked when the trace is opened
    # (cheap: nothing per record, and the calls walked only when some never returned). Each check holds for
    # every trace divtrace writes, so a mismatch is a damaged trace, never a judgement call.
    def meta_problems(self) -> list[str]:
        """What meta.json says that the records contradict, one line each naming meta.json."""
        where, meta, problems = self.path / META, self.meta, []
        want = meta.get("records")
        if "checksums" in meta and want is not None and want != len(self.rcall):
            problems.append(f"{where}: says {want} records, {RECORDS} holds {len(self.rcall)}")
        status = meta.get("status")
        if status == "complete" and meta.get("complete") is not True:
            problems.append(f"{where}: status is complete but complete is {meta.get('complete')!r}")
        if status == "complete" and meta.get("error") is not None:
            problems.append(f"{where}: status is complete but it records an error ({meta['error']!r})"[:300])
        if "checksums" in meta and status == "running":
            problems.append(f"{where}: status is running but it holds the final checksums of a closed recording")
        tree = meta.get("module_tree")
        if tree is not None:
            names = {name for name, _ in tree}
            missing = [m for m in self._call_counts if m not in names]  # every module path the records call
            if missing:
                call = next(c for c in self.calls.values() if c.module == missing[0])
                problems.append(f"{where}: module_tree has no module {missing[0] or '<root>'!r}, which {RECORDS} "
                                f"calls (record {call.enter_index}){f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}"[:300])
        unfinished = meta.get("unfinished_calls")
        # Only where every record reached the file (closed with a status the writer leaves whole): then the
        # calls the recorder still held are among those the records leave running, and are all of them when
        # the root is recorded and no include filter can hide the call a stale frame was dropped in.
        if (unfinished is not None and "checksums" in meta and not self.torn_tail
                and status in ("complete", "terminated", "interrupted")):
            running = self.calls_left_running()
            exact = "" in self._call_counts and meta.get("include") is None
            if unfinished > len(running) or (exact and unfinished != len(running)):
                if running and unfinished == 0:
                    last = self.calls[running[-1]]
                    problems.append(f"{where}: says no module call was left running, but {RECORDS} ends inside "
                                    f"{last.module or '<root>'} call {last.call}, which never returned"[:300])
                else:
                    problems.append(f"{where}: says {unfinished} module calls were left running, {RECORDS} leaves "
                                    f"{len(running)}")
        return problems

    def check_meta(self) -> None:
        """Raise DivtraceError (naming meta.json and what disagrees) when meta.json contradicts the records."""
        problems = self.meta_problems()
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise DivtraceError(f"damaged trace: {problems[0]}{more}")

    def calls_left_running(self) -> list[int]:
        """The call_ids of the module calls the recording still held open when it stopped, outermost first, as
        far as the records show: calls that never returned and that no later record shows were left (a later
        record belongs to a call outside the call's subtree). Superset of what the recorder held: a call left
        without any later record, by an unrecorded caller's return, cannot be told from one held."""
        if not self._open:
            return []
        calls = self.calls
        chain = []  # the last record's call and its callers, innermost first
        c = self.rcall[-1]
        while c is not None:
            chain.append(c)
            c = calls[c].parent
        chain.reverse()
        depth_of = {cid: j for j, cid in enumerate(chain)}
        # latest[j]: the last record of any call whose deepest enclosing chain call is chain[j - 1] (none: 0)
        latest = [-1] * (len(chain) + 1)
        for cid, call in calls.items():
            d, path = depth_of.get(cid), []
            while d is None:
                path.append(cid)
                cid = calls[cid].parent
                d = -1 if cid is None else depth_of.get(cid)
            for p in path:
                depth_of[p] = d
            last = call.exit_index if call.exit_index is not None else call.ops[-1] if call.ops else call.enter_index
            if last > latest[d + 1]:
                latest[d + 1] = last
        running, before = [], -1  # before: the last record of any call outside chain[j]'s subtree
        for j, cid in enumerate(chain):
            before = max(before, latest[j])
            call = calls[cid]
            if call.exit_index is None and before < call.enter_index:
                running.append(cid)
        return running

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

    # token files ------------------------------------------------------------------------------------------
    def token_index(self):
        """The token files, read back and checked (divtrace.trace.token_store.TokenIndex; read once). Raises
        DivtraceError naming the file and line of any damage."""
        if self._token_index is None:
            from divtrace.trace.token_store import TokenIndex

            self._token_index = TokenIndex(self)
        return self._token_index

    def token_problems(self) -> list[str]:
        """What is wrong with the token files (every line and row checked), one line each; [] when nothing is."""
        try:
            self.token_index().check()
        except DivtraceError as e:
            return [str(e)]
        return []

    def verify_shards(self) -> None:
        """Raise DivtraceError (naming the file) unless every stored byte is what the recording wrote: tensors and
        token files. Bisect calls it before it reports "identical", which it otherwise decides from fingerprints
        alone."""
        if self._shards_verified:
            return
        problems = self.token_problems() + self.shard_problems()
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise DivtraceError(problems[0] + more)
        self._shards_verified = True
