"""Writing a ledger: one append-only segment per process or rank (docs/cert.md).

    with divtrace.cert.ledger("runs/ledger") as led:
        for step in range(steps):
            ...                                    # the rollout samples completions
            led.rollout(step, prompts, completions, rollout_logprobs, weights=rollout_model, version=v)
            ...                                    # the trainer recomputes their logprobs
            led.trainer(step, prompts, completions, trainer_logprobs, weights=model, version=v)

Each call appends the token payload to the segment's `.bin`, then one JSON line pointing at it (with its CRC)
to the segment's `.jsonl`, so a reader never sees a line whose bytes are not there yet. Leaving the block writes
the segment's end line and (on the writer that finishes the run: rank 0) the END marker.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from divtrace.cert import format as fmt
from divtrace.cert.weights import WEIGHT_HASH_SCHEME, fingerprint_weights
from divtrace.errors import DivtraceError

_TORCH_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16",
                 torch.float16: "float16"}


def _dist_rank() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _write_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


class Ledger:
    """A writer of one segment of a ledger folder. See the module docstring; `docs/cert.md` has the format."""

    def __init__(self, path, *, label: str = "run", rank: int | None = None, world_size: int | None = None,
                 meta: dict | None = None):
        if not label.replace("_", "").replace(".", "").isalnum():
            raise DivtraceError(f"ledger(): label {label!r}: use letters, digits, '_' and '.'")
        r, w = _dist_rank()
        self.rank = r if rank is None else rank
        self.world_size = w if world_size is None else world_size
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        if (self.path / fmt.END_FILE).exists():
            raise DivtraceError(f"{self.path}: this ledger is finished (it has an END marker); write a new one")
        meta_path = self.path / fmt.META_FILE
        if not meta_path.exists():
            _write_atomic(meta_path, {"format": fmt.FORMAT, "format_version": fmt.FORMAT_VERSION})
        host = fmt.host_name()
        self.name = f"{fmt.SEGMENT_PREFIX}{label}-r{self.rank}-{host}-{os.getpid()}"
        self._bin = open(self.path / f"{self.name}.bin", "ab")
        self._lines = open(self.path / f"{self.name}.jsonl", "a", encoding="utf-8")
        self._offset = self._bin.tell()
        self._steps: set = set()
        self.closed = False
        import divtrace

        self._line({"k": "head", "format": fmt.FORMAT, "format_version": fmt.FORMAT_VERSION, "segment": self.name,
                    "rank": self.rank, "world_size": self.world_size, "host": host, "pid": os.getpid(),
                    "created": time.time(), "divtrace": divtrace.__version__, "token_key": fmt.TOKEN_KEY,
                    "weight_hash_scheme": WEIGHT_HASH_SCHEME, "meta": meta or {}})

    # -- records -----------------------------------------------------------------------------------------------
    def rollout(self, step: int, prompts, completions, logprobs, **kw) -> None:
        """The rollout's per-token logprobs of the sampled tokens (see `log`)."""
        self.log(step, "rollout", prompts, completions, logprobs, **kw)

    def trainer(self, step: int, prompts, completions, logprobs, **kw) -> None:
        """The trainer's recomputed logprobs of the same tokens (see `log`)."""
        self.log(step, "trainer", prompts, completions, logprobs, **kw)

    def log(self, step: int, side: str, prompts, completions, logprobs, *, kind: str = "logprobs",
            version=None, weights=None, param_map: str | None = None, seq_ids=None,
            temperature: float = 1.0, dtype: str | None = None) -> None:
        """Append one side's logprobs for some sequences of a step.

        `prompts` and `completions`: one sequence of token ids per sequence (lists, 1-D tensors); `logprobs`: one
        1-D tensor (or list) per sequence with one value per completion token, or a right-padded `[B, C]` tensor.
        `kind="logprobs"` is the unprocessed distribution (temperature 1, no top-p/top-k) unless `temperature`
        says otherwise; `kind="processed"` is stored apart (after the engine's sampling settings). `weights` (a
        module or a `fingerprint_weights` dict) is fingerprinted for this step and side, with `version` (your
        weight version id: async RL uses stale weights on purpose). `seq_ids` label sequences in reports.
        Called several times for one step and side (micro-batches, ranks), the sequences add up."""
        self._check_open()
        if side not in fmt.SIDES:
            raise DivtraceError(f"ledger.log(): side {side!r} is not one of {', '.join(fmt.SIDES)}")
        if kind not in fmt.KINDS:
            raise DivtraceError(f"ledger.log(): kind {kind!r} is not one of {', '.join(fmt.KINDS)}")
        prompts, completions = list(prompts), list(completions)
        if len(prompts) != len(completions):
            raise DivtraceError(f"ledger.log(step {step}, {side}): {len(prompts)} prompts but {len(completions)} "
                                "completions")
        ids = [_ids(c) for c in completions]
        values, dt = _values(step, side, logprobs, [len(c) for c in ids], dtype)
        labels = list(seq_ids) if seq_ids is not None else list(range(len(ids)))
        if len(labels) != len(ids):
            raise DivtraceError(f"ledger.log(step {step}, {side}): {len(labels)} seq_ids for {len(ids)} sequences")
        seqs = []
        for label, p, c in zip(labels, prompts, ids):
            p = _ids(p)
            seqs.append([label if isinstance(label, (int, str)) else str(label), fmt.prompt_key(p), len(p), len(c)])
        payload = (np.concatenate(ids).astype("<i4").tobytes() if ids else b"") + values
        self._bin.write(payload)
        self._bin.flush()
        line = {"k": "lp", "step": int(step), "side": side, "kind": kind, "version": _plain(version),
                "temperature": float(temperature), "dtype": dt, "seqs": seqs, "off": self._offset,
                "len": len(payload), "crc": fmt.crc(payload)}
        self._offset += len(payload)
        self._line(line)
        self._steps.add(int(step))
        if weights is not None:
            self.weights(step, side, weights, version=version, param_map=param_map)

    def weights(self, step: int, side: str, source, *, version=None, param_map: str | None = None) -> None:
        """Append the fingerprint of the weights `side` used at `step` (a module, a dict of tensors, or a dict
        made by `divtrace.cert.fingerprint_weights`, for example inside a remote engine's worker)."""
        self._check_open()
        if side not in fmt.SIDES:
            raise DivtraceError(f"ledger.weights(): side {side!r} is not one of {', '.join(fmt.SIDES)}")
        if isinstance(source, dict) and source and all(isinstance(v, list) for v in source.values()):
            params = source  # already fingerprinted
        else:
            params = fingerprint_weights(source, param_map)
        self._line({"k": "w", "step": int(step), "side": side, "version": _plain(version),
                    "scheme": WEIGHT_HASH_SCHEME, "digest": fmt.weights_digest(params), "params": params})
        self._steps.add(int(step))

    def replay(self, step: int, rel_dir: str, command: list[str] | None = None) -> None:
        """Note that what replays `step` was saved under LEDGER/`rel_dir` (with the command that replays it)."""
        self._check_open()
        self._line({"k": "replay", "step": int(step), "dir": rel_dir, "command": command})

    # -- closing ----------------------------------------------------------------------------------------------
    def close(self, error: str | None = None) -> None:
        """Write this segment's end line (status complete, or error with the message) and close its files."""
        if self.closed:
            return
        self._line({"k": "end", "status": "error" if error else "complete", "error": error,
                    "steps": sorted(self._steps)})
        self._bin.close()
        self._lines.close()
        self.closed = True

    def finish(self, error: str | None = None) -> None:
        """Write the run's END marker (once, after every writer closed: rank 0's job)."""
        segments = sorted(p.stem for p in self.path.glob(f"{fmt.SEGMENT_PREFIX}*.jsonl"))
        _write_atomic(self.path / fmt.END_FILE, {"status": "error" if error else "complete", "error": error,
                                                 "segments": segments, "finished": time.time()})

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        error = None if exc_type is None else f"{exc_type.__name__}: {exc}"
        self.close(error)
        if self.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
        if self.rank == 0:
            self.finish(error)

    def _check_open(self) -> None:
        if self.closed:
            raise DivtraceError(f"{self.path}: ledger segment {self.name} is closed")

    def _line(self, obj: dict) -> None:
        self._lines.write(json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n")
        self._lines.flush()


def _plain(v):
    return v if v is None or isinstance(v, (int, float, str)) else str(v)


def _ids(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().reshape(-1).numpy()
    return np.asarray(x, dtype=np.int64).reshape(-1)


def _values(step, side, logprobs, lengths: list[int], dtype: str | None) -> tuple[bytes, str]:
    """The logprobs' raw bytes, in sequence order, one per completion token, and their dtype name."""
    where = f"ledger.log(step {step}, {side})"
    if isinstance(logprobs, torch.Tensor) and logprobs.dim() == 2:
        if logprobs.shape[0] != len(lengths) or (lengths and max(lengths) > logprobs.shape[1]):
            raise DivtraceError(f"{where}: logprobs {list(logprobs.shape)} do not hold {len(lengths)} sequences of "
                                f"up to {max(lengths, default=0)} tokens")
        rows = [logprobs[i, :n] for i, n in enumerate(lengths)]
    else:
        rows = list(logprobs)
        if len(rows) != len(lengths):
            raise DivtraceError(f"{where}: {len(rows)} logprob rows for {len(lengths)} sequences")
    tensors = []
    for i, (r, n) in enumerate(zip(rows, lengths)):
        if not isinstance(r, torch.Tensor):
            r = _exact_tensor(where, i, r, dtype or "float32")
        r = r.detach().reshape(-1)
        if r.numel() != n:
            raise DivtraceError(f"{where}: sequence {i} has {n} completion tokens but {r.numel()} logprobs")
        tensors.append(r)
    dts = {_TORCH_DTYPES.get(t.dtype) for t in tensors} or {dtype or "float32"}
    if None in dts or len(dts) > 1:
        raise DivtraceError(f"{where}: logprobs must be one of {', '.join(fmt.DTYPE_SIZES)} in every sequence, got "
                            f"{sorted(str(t.dtype) for t in tensors)[:3]}")
    dt = dts.pop()
    if not tensors:
        return b"", dt
    flat = torch.cat(tensors).cpu().contiguous()
    return flat.view(torch.uint8).numpy().tobytes(), dt


def _exact_tensor(where, i, values, dtype: str) -> torch.Tensor:
    """Python floats as a tensor of `dtype`, refusing values that dtype does not hold exactly (a float64 logprob
    stored as float32 would be another number)."""
    tdt = {v: k for k, v in _TORCH_DTYPES.items()}.get(dtype)
    if tdt is None:
        raise DivtraceError(f"{where}: dtype {dtype!r} is not one of {', '.join(fmt.DTYPE_SIZES)}")
    vals = [float(v) for v in values]
    t = torch.tensor(vals, dtype=tdt)
    back = t.double().tolist()
    for j, (v, w) in enumerate(zip(vals, back)):
        if not (v == w or (v != v and w != w)):
            raise DivtraceError(f"{where}: logprob {j} of sequence {i} ({v!r}) is not a {dtype} value; pass a "
                                "tensor in the dtype the logprobs were computed in (or dtype=...)")
    return t


def ledger(path, **kw) -> Ledger:
    """A ledger writer for this process (rank from torch.distributed or RANK): `with ledger(path) as led:`."""
    return Ledger(path, **kw)
