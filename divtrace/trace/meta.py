"""Opening a trace: the directory, and meta.json read and validated field by field (what each field divtrace
reads must hold, the format version, the fingerprint scheme). Whether meta.json agrees with the records is
checked once they are read (divtrace/trace/integrity.py)."""
from __future__ import annotations

import json
from itertools import chain
from pathlib import Path

from divtrace.errors import DivtraceError
from divtrace.trace.records import FORMAT_VERSION
from divtrace.trace.fields import _is_int, _str_or_none
from divtrace.trace.files import META

# Fingerprint schemes divtrace.trace.fingerprint accepts, known here without importing it (it imports torch);
# tests/test_bisect_scale.py checks this against fingerprint.hasher. Any other name is asked of
# fingerprint.hasher itself, so a scheme added there is accepted too.
_SCHEMES_KNOWN_WITHOUT_TORCH = frozenset({"lane32-wsum128", "lane-gsum128-v2"})


def _hasher(scheme):
    """fingerprint.hasher(scheme); imports torch."""
    from divtrace.trace.fingerprint import hasher

    return hasher(scheme)


def _scheme_known(scheme) -> bool:
    return scheme in _SCHEMES_KNOWN_WITHOUT_TORCH or _hasher(scheme) is not None


# meta.json fields divtrace itself reads, and the type each must have (others are kept as they are).
_META_FIELDS = {
    "complete": lambda x: isinstance(x, bool), "status": lambda x: isinstance(x, str), "label": _str_or_none,
    "error": _str_or_none, "ops": lambda x: isinstance(x, bool), "settings": lambda x: isinstance(x, dict),
    "module_tree": lambda x: isinstance(x, list) and (not x or (set(map(type, x)) == {list} and set(map(len, x)) == {2}
                                                                and set(map(type, chain.from_iterable(x))) == {str})),
    "warnings": lambda x: isinstance(x, list) and all(isinstance(w, str) for w in x),
    "records": _is_int, "shards": lambda x: isinstance(x, list) and all(isinstance(s, str) for s in x),
    "entry": _str_or_none, "entry_args": lambda x: isinstance(x, dict), "model_class": _str_or_none,
    "torch_version": _str_or_none, "device": _str_or_none, "hash_scheme": lambda x: isinstance(x, str),
    "include": _str_or_none, "exclude": _str_or_none, "unfinished_calls": _is_int,
}


def _checksums_ok(c) -> bool:
    if not isinstance(c, dict) or set(c) != {"records", "shards"}:
        return False
    r, s = c["records"], c["shards"]
    return (isinstance(r, dict) and isinstance(r.get("sha256"), str) and _is_int(r.get("bytes"))
            and isinstance(s, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in s.items()))


def _file_checksums_ok(c) -> bool:
    """meta.json's `file_checksums`: {name: null (the recording has not closed) or {"sha256", "bytes"}}."""
    return isinstance(c, dict) and all(
        isinstance(k, str) and (v is None or (isinstance(v, dict) and set(v) == {"sha256", "bytes"}
                                              and isinstance(v["sha256"], str) and _is_int(v["bytes"]) and v["bytes"] >= 0))
        for k, v in c.items())


def check_trace_dir(p: Path) -> None:
    """Raise DivtraceError unless `p` is a directory holding a meta.json."""
    try:
        if not p.exists():
            raise DivtraceError(f"{p}: no such trace directory")
        if not p.is_dir():
            raise DivtraceError(f"{p}: is a file, not a trace directory")
        if not (p / META).is_file():
            what = "empty directory" if not any(p.iterdir()) else "directory without meta.json"
            raise DivtraceError(f"{p}: not a divtrace trace ({what})")
    except OSError as e:
        raise DivtraceError(f"{p}: cannot read trace directory: {e.strerror or e}") from None


def read_meta(path: Path) -> dict:
    """meta.json of the trace in `path`, every field divtrace reads checked for its type."""
    where = path / META
    try:
        meta = json.loads(where.read_bytes())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise DivtraceError(f"{where}: unreadable trace metadata ({type(e).__name__})") from None
    if not isinstance(meta, dict) or "format_version" not in meta:
        raise DivtraceError(f"{where}: not divtrace metadata (no format_version)")
    fv = meta["format_version"]
    if not _is_int(fv):
        raise DivtraceError(f"{where}: format_version must be an integer, got {fv!r}"[:300])
    if fv > FORMAT_VERSION:
        raise DivtraceError(f"{where}: written by a newer divtrace (format_version {fv}, this one reads up to "
                            f"{FORMAT_VERSION}); upgrade divtrace")
    if fv < 1:
        raise DivtraceError(f"{where}: format_version {fv} is not a divtrace format")
    if meta.get("mode") not in ("full", "hash"):
        raise DivtraceError(f"{where}: unknown mode {meta.get('mode')!r}"[:300])
    for k, ok in _META_FIELDS.items():
        if k in meta and not ok(meta[k]):
            raise DivtraceError(f"{where}: field {k!r} is malformed (edited by hand?)")
    if "hash_scheme" not in meta:
        raise DivtraceError(f"{where}: no hash_scheme: written by an early development version of divtrace "
                            "whose fingerprints cannot be verified; record it again")
    if not _scheme_known(meta["hash_scheme"]):
        from divtrace.trace.fingerprint import HASH_SCHEME
        from divtrace.trace.hashing import TENSOR_SCHEME

        raise DivtraceError(f"{where}: fingerprint scheme {meta['hash_scheme']!r} is unknown to this divtrace "
                            f"(it knows {HASH_SCHEME!r} and {TENSOR_SCHEME!r}); upgrade divtrace"[:300])
    if "checksums" in meta and not _checksums_ok(meta["checksums"]):
        raise DivtraceError(f"{where}: field 'checksums' is malformed (edited by hand?)")
    if "file_checksums" in meta and (not _file_checksums_ok(meta["file_checksums"]) or (
            "checksums" in meta and None in meta["file_checksums"].values())):
        raise DivtraceError(f"{where}: field 'file_checksums' is malformed (edited by hand?)")
    if meta.get("complete") is True and ("checksums" not in meta or meta.get("status") != "complete"):
        raise DivtraceError(f"{where}: marked complete but lacks what a finished recording writes (status, "
                            "checksums): edited by hand?")
    return meta
