"""Certifying a ledger: per step, are the trainer's recomputed logprobs bitwise the rollout's, with equal weights?

Sequences of the two sides are paired by content (prompt key and length, completion ids), duplicates in the order
written; tokens are compared by their raw bytes and dtype. The verdict (docs/cert.md):
- `certified` (exit 0): the run ended, every step has both sides and both weight listings, every sequence pairs,
  every token is bitwise equal and the weights are equal;
- `parts` (exit 1): a step whose tokens differ, or whose weights differ under the same version (equal
  logprobs included), even when later steps are missing or the run is still being written;
- `inconclusive` (exit 3) otherwise, with `reason` (`running`, `stopped`, `missing`, `stale`, `empty`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from divtrace.cert import format as fmt
from divtrace.cert.reader import LedgerData, Sequence, read_ledger
from divtrace.cert.weights import compare_weights

EXIT = {"certified": 0, "parts": 1, "inconclusive": 3}


@dataclass
class StepReport:
    step: int
    status: str = "equal"  # equal | parts | missing | stale
    cause: str | None = None  # parts: "weights" (the sides ran other weights) or "numerics" (same weights)
    tokens_compared: int = 0
    tokens_equal: int = 0
    max_abs_diff: float | None = None
    kl: float | None = None  # k3 estimate of KL(rollout || trainer) from the sampled tokens, mean per token
    kl_k1: float | None = None  # mean of rollout - trainer logprob
    sequences: dict = field(default_factory=lambda: {"compared": 0, "only_rollout": 0, "only_trainer": 0})
    weights: dict = field(default_factory=dict)
    first: dict | None = None  # the first parting token of this step
    notes: list = field(default_factory=list)
    processed_tokens: int = 0

    @property
    def equal_fraction(self) -> float | None:
        return self.tokens_equal / self.tokens_compared if self.tokens_compared else None

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("step", "status", "cause", "tokens_compared", "tokens_equal",
                                            "max_abs_diff", "kl", "kl_k1", "sequences", "weights", "first",
                                            "notes", "processed_tokens")}
        d["equal_fraction"] = self.equal_fraction
        return d


@dataclass
class CertResult:
    ledger: str
    verdict: str
    reason: str | None
    steps: list
    first: dict | None
    running: bool
    end: dict | None
    segments: list
    replay: dict | None = None

    @property
    def exit_code(self) -> int:
        return EXIT[self.verdict]

    def to_dict(self) -> dict:
        total = sum(s.tokens_compared for s in self.steps)
        equal = sum(s.tokens_equal for s in self.steps)
        return {"verdict": self.verdict, "reason": self.reason, "ledger": self.ledger, "running": self.running,
                "steps_seen": len(self.steps), "tokens_compared": total, "tokens_equal": equal,
                "first": self.first, "replay": self.replay,
                "segments": [{"name": s.name, "rank": s.rank, "closed": s.closed, "status": s.status,
                              "error": s.error, "torn_tail": s.torn} for s in self.segments],
                "end": self.end, "steps": [s.to_dict() for s in self.steps]}


def certify(path) -> CertResult:
    """Read the ledger at `path` and judge it (see the module docstring)."""
    data = read_ledger(path)
    reports = [_step(data, s) for s in data.steps]
    parting = [r for r in reports if r.status == "parts"]
    first = None
    if parting:
        r = parting[0]
        first = {"step": r.step, "cause": r.cause, "token": r.first,
                 "weights_differ": r.weights.get("differ", []) + r.weights.get("only_rollout", [])
                 + r.weights.get("only_trainer", [])}
    verdict, reason = _verdict(data, reports, parting)
    replay = None
    if first is not None and first["step"] in data.replays:
        replay = dict(data.replays[first["step"]], step=first["step"])
    return CertResult(str(path), verdict, reason, reports, first, data.end is None, data.end, data.segments, replay)


def _verdict(data: LedgerData, reports: list, parting: list) -> tuple[str, str | None]:
    if parting:
        r = parting[0]
        what = ("the weights differ under the same version" if r.cause == "weights"
                else "the logprobs differ with equal weights")
        more = "" if data.end is not None else "; the run is still being written (later steps not seen)"
        return "parts", f"step {r.step} parts: {what}{more}"
    if data.end is None:
        gone = [s for s in data.segments if not s.closed and _writer_gone(s)]
        if gone:
            s = gone[0]
            return "inconclusive", (f"stopped: segment {s.name}'s writer (pid {s.pid} on this host) is gone and "
                                    "never closed it; the run was killed (no END marker)")
        return "inconclusive", "running"
    if data.end.get("status") != "complete":
        return "inconclusive", f"stopped: the run ended with an error ({data.end.get('error')})"
    names = {s.name for s in data.segments}
    lost = [n for n in data.end.get("segments", []) if n not in names]
    if lost:
        return "inconclusive", f"missing: segment {lost[0]} listed in END is not in the ledger"
    open_ = [s for s in data.segments if not s.closed or s.status != "complete"]
    if open_:
        s = open_[0]
        return "inconclusive", (f"stopped: segment {s.name} (rank {s.rank}) "
                                + ("did not close" if not s.closed else f"ended with an error ({s.error})"))
    if len(data.schemes - {None}) > 1:
        return "inconclusive", f"missing: segments fingerprint weights with different schemes {sorted(data.schemes - {None})}"
    if not reports:
        return "inconclusive", "empty: the ledger holds no step"
    for r in reports:
        if r.status in ("missing", "stale"):
            return "inconclusive", f"{r.status}: step {r.step}: {r.notes[0] if r.notes else r.status}"
    return "certified", None


def _writer_gone(seg) -> bool:
    """True when the segment was written on this host by a process that no longer exists (killed)."""
    import os

    if seg.host != fmt.host_name() or not isinstance(seg.pid, int):
        return False
    try:
        os.kill(seg.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _merged_weights(data: LedgerData, step: int, side: str):
    ws = data.weights.get((step, side))
    if not ws:
        return None, None
    params = {}
    for w in ws:
        params.update(w.params)
    return params, ws[0].version


def _step(data: LedgerData, step: int) -> StepReport:
    r = StepReport(step)
    rollout = data.seqs.get((step, "rollout", "logprobs"), [])
    trainer = data.seqs.get((step, "trainer", "logprobs"), [])
    r.processed_tokens = sum(len(s.ids) for s in data.seqs.get((step, "rollout", "processed"), []))
    for side, seqs in (("rollout", rollout), ("trainer", trainer)):
        if not seqs:
            r.notes.append(f"no {side} logprobs")
    wr, vr = _merged_weights(data, step, "rollout")
    wt, vt = _merged_weights(data, step, "trainer")
    vr = vr if vr is not None else (rollout[0].version if rollout else None)
    vt = vt if vt is not None else (trainer[0].version if trainer else None)
    cmp = compare_weights(wr, wt)
    r.weights = {"equal": cmp["equal"], "differ": cmp["differ"], "only_rollout": cmp["only_a"],
                 "only_trainer": cmp["only_b"], "versions": {"rollout": vr, "trainer": vt}}
    for side, w in (("rollout", wr), ("trainer", wt)):
        if w is None:
            r.notes.append(f"no {side} weight fingerprint")
    temps = {s.temperature for s in rollout} | {s.temperature for s in trainer}
    if len(temps) > 1:
        r.notes.append(f"the sides' logprobs are of different temperatures {sorted(temps)}: not the same distribution")
    _compare_tokens(r, rollout, trainer)
    stale = vr is not None and vt is not None and vr != vt and cmp["equal"] is not True
    if cmp["equal"] is False and not stale:
        r.status, r.cause = "parts", "weights"
    elif r.tokens_equal < r.tokens_compared and not stale and len(temps) <= 1:
        r.status, r.cause = "parts", "numerics" if cmp["equal"] else "unknown"
        if not cmp["equal"]:
            r.notes.append("the logprobs differ but a side's weights were not recorded: the cause is not known")
    elif stale:
        r.status = "stale"
        r.notes.insert(0, f"the rollout used weights version {vr!r}, the trainer {vt!r} (stale weights, on purpose "
                          "in async RL): not comparable bitwise")
    elif r.notes or r.sequences["only_rollout"] or r.sequences["only_trainer"]:
        r.status = "missing"
        if r.sequences["only_rollout"] or r.sequences["only_trainer"]:
            r.notes.append(f"{r.sequences['only_rollout']} sequences only in the rollout, "
                           f"{r.sequences['only_trainer']} only in the trainer (not paired by content)")
    return r


def _compare_tokens(r: StepReport, rollout: list, trainer: list) -> None:
    pool: dict = {}
    for t in trainer:
        pool.setdefault(t.content, []).append(t)
    diffs, k3 = [], []
    for index, a in enumerate(rollout):
        partners = pool.get(a.content)
        if not partners:
            r.sequences["only_rollout"] += 1
            continue
        b = partners.pop(0)
        r.sequences["compared"] += 1
        for t, (va, vb) in enumerate(zip(a.values, b.values)):
            r.tokens_compared += 1
            same = va == vb and a.dtype == b.dtype
            if same:
                r.tokens_equal += 1
            xa, xb = fmt.bits_to_float(va, a.dtype), fmt.bits_to_float(vb, b.dtype)
            if not same and r.first is None:
                r.first = _token(index, t, a, b, xa, xb, va, vb)
            if math.isfinite(xa) and math.isfinite(xb):
                d = xb - xa  # log(trainer / rollout) at a token the rollout sampled
                diffs.append(d)
                k3.append(math.expm1(d) - d)
    r.sequences["only_trainer"] = sum(len(v) for v in pool.values())
    if diffs:
        r.max_abs_diff = max(abs(d) for d in diffs)
        r.kl = sum(k3) / len(k3)
        r.kl_k1 = -sum(diffs) / len(diffs)


def _token(index: int, t: int, a: Sequence, b: Sequence, xa: float, xb: float, va: bytes, vb: bytes) -> dict:
    return {"sequence": a.label, "sequence_index": index, "sequence_trainer": b.label, "token": t,
            "position": a.prompt_len + t, "id": a.ids[t], "prompt_key": a.prompt_key,
            "rollout": xa, "trainer": xb, "abs_diff": abs(xa - xb) if math.isfinite(xa - xb) else None,
            "rollout_bits": fmt.bits_hex(va), "trainer_bits": fmt.bits_hex(vb),
            "dtype": a.dtype if a.dtype == b.dtype else f"{a.dtype} vs {b.dtype}",
            "where": {"rollout": a.where, "trainer": b.where}}
