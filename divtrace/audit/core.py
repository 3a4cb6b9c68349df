"""divtrace audit: every recorded computing op re-run from its recorded inputs, checked for batch invariance and
determinism, grouped by (module class, op, shapes) and timed.

An op is *audited* when it could be re-run; it is batch-invariant when each of its rows comes out bitwise the
same computed alone, in splits of the batch and padded into a larger batch, and deterministic when the same call
twice gives the same bytes. Ops that must not be re-run (random ops, collectives, ops with no output) and ops
whose row dim cannot be told are *not audited*, each with the reason, and never counted as clean.
"""
from __future__ import annotations

import os
import shlex
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field

from divtrace.errors import DivtraceError


@dataclass
class OpAudit:
    """What the audit found for one recorded op."""

    index: int  # record index
    op: str
    module: str
    module_class: str
    shapes: list
    dtypes: list
    audited: bool
    why: str | None = None  # why not audited (or why batch invariance was not checked)
    deterministic: bool | None = None
    batch_invariant: bool | None = None  # None: not checked (see why)
    family: str | None = None  # how its rows were found (rows.py)
    n_rows: int | None = None
    rows_checked_at: list = field(default_factory=list)
    rows_differ_at: list = field(default_factory=list)
    rows: list = field(default_factory=list)  # differing rows, 0..n_rows-1
    tokens: list | None = None  # the differing rows as tokens ({"row", "seq", "position"}), where they map
    max_ulp: int | None = None
    seconds: float = 0.0
    replays_record: bool | None = None  # the replay's output is bitwise the recorded output
    constant: bool = False  # computed from constants alone: no data rows
    notes: list = field(default_factory=list)

    @property
    def finding(self) -> bool:
        return self.batch_invariant is False or self.deterministic is False


@dataclass
class Group:
    """Ops of one (module class, op, shapes, dtypes): one line of the report."""

    ops: list[OpAudit]

    @property
    def first(self) -> OpAudit:
        return self.ops[0]

    def _all(self, attr):
        vals = [getattr(o, attr) for o in self.ops]
        if any(v is False for v in vals):
            return False
        if any(v is None for v in vals):
            return None
        return True

    def to_dict(self, total_seconds: float) -> dict:
        f = self.first
        ulps = [o.max_ulp for o in self.ops if o.max_ulp is not None]
        differ = sorted({m for o in self.ops for m in o.rows_differ_at})
        worst = max(self.ops, key=lambda o: (len(o.rows), o.max_ulp or 0))
        secs = sum(o.seconds for o in self.ops)
        return {
            "module": f.module, "op": f.op, "count": len(self.ops),
            "batch_invariant": self._all("batch_invariant"), "deterministic": self._all("deterministic"),
            "rows_differ_at": differ, "max_ulp": max(ulps) if ulps else None,
            "time_share": round(secs / total_seconds, 6) if total_seconds > 0 else 0.0,
            # extensions
            "module_class": f.module_class, "shapes": f.shapes, "dtypes": f.dtypes, "record": f.index,
            "records": [o.index for o in self.ops][:64],
            "modules": list(dict.fromkeys(o.module for o in self.ops))[:64],
            "rows_checked_at": sorted({m for o in self.ops for m in o.rows_checked_at}),
            "n_rows": f.n_rows, "rows": worst.rows[:64], "rows_differing": len(worst.rows), "family": f.family,
            "tokens": worst.tokens[:64] if worst.tokens is not None else None,
            "seconds": round(secs, 6), "replays_record": self._all("replays_record"),
            "why": f.why, "notes": list(dict.fromkeys(n for o in self.ops for n in o.notes)),
        }


@dataclass
class AuditResult:
    path: str
    label: str
    ops: list[OpAudit]
    seconds: float  # the timed replay of every audited op
    under: str | None = None
    device: str = "cpu"
    warnings: list[str] = field(default_factory=list)

    @property
    def audited(self) -> list[OpAudit]:
        return [o for o in self.ops if o.audited]

    @property
    def not_audited(self) -> list[OpAudit]:
        return [o for o in self.ops if not o.audited]

    def groups(self, which) -> list[Group]:
        by: dict[tuple, list] = {}
        for o in which:
            key = (o.module_class, o.op, repr(o.shapes), repr(o.dtypes), o.why if not o.audited else None)
            by.setdefault(key, []).append(o)
        return sorted((Group(v) for v in by.values()), key=lambda g: g.first.index)

    @property
    def findings(self) -> list[Group]:
        return [g for g in self.groups([o for o in self.ops if o.finding])]

    @property
    def not_invariant(self) -> int:
        return sum(o.batch_invariant is False for o in self.ops)

    @property
    def not_deterministic(self) -> int:
        return sum(o.deterministic is False for o in self.ops)

    @property
    def verdict(self) -> str:
        """findings (exit 1); inconclusive (exit 3) when no op was audited: nothing audited is never clean; clean."""
        if any(o.finding for o in self.ops):
            return "findings"
        return "clean" if self.audited else "inconclusive"

    @property
    def exit_code(self) -> int:
        return {"findings": 1, "inconclusive": 3}.get(self.verdict, 0)

    @property
    def reason(self) -> str | None:
        """Why the audit is inconclusive, in words (None when it is not)."""
        if self.verdict != "inconclusive":
            return None
        first = self.not_audited[0] if self.not_audited else None
        return (f"nothing was audited: none of the {len(self.ops)} computing ops could be re-run and checked"
                + (f" (the first, {first.op} in {first.module or '<root>'}: {first.why})" if first else "")
                + "; fix what the not-audited list says, or record the run again in full mode with ops")

    def headline(self) -> str:
        return (f"AUDIT: {len(self.ops)} ops, {self.not_invariant} not batch-invariant, {self.not_deterministic} "
                f"not deterministic")

    def clean_by_op(self) -> list[dict]:
        """Audited ops that are batch-invariant and deterministic, per op name (first occurrence first)."""
        by: dict[str, dict] = {}
        for o in self.audited:
            if o.finding:
                continue
            e = by.setdefault(o.op, {"op": o.op, "count": 0, "batch_invariant": True, "constant": 0,
                                     "first": o.module})
            e["count"] += 1
            if o.constant or o.batch_invariant is None:
                e["constant"] += 1
        return list(by.values())

    def to_dict(self) -> dict:
        na = self.groups(self.not_audited)
        return {
            "verdict": self.verdict, "reason": self.reason, "ops": len(self.ops), "audited": len(self.audited),
            "not_audited": len(self.not_audited),
            "findings": [g.to_dict(self.seconds) for g in self.findings],
            # extensions
            "headline": self.headline(), "trace": self.path, "label": self.label, "device": self.device,
            "under": self.under, "not_batch_invariant": self.not_invariant, "not_deterministic": self.not_deterministic,
            "replay_seconds": round(self.seconds, 6),
            "clean": self.clean_by_op(),
            "not_audited_ops": [{"module": g.first.module, "op": g.first.op, "count": len(g.ops), "why": g.first.why,
                                 "deterministic": g._all("deterministic"), "record": g.first.index}
                                for g in na],
            "warnings": self.warnings,
        }


def _full_mode_command(t) -> str:
    entry = t.meta.get("entry")
    args = " ".join(f"--arg {shlex.quote(f'{k}={v}')}" for k, v in (t.meta.get("entry_args") or {}).items())
    target = f"{shlex.quote(entry)} {args}".strip() if entry else "ENTRY"
    return f"divtrace record {target} --out {shlex.quote(str(t.path) + '-full')} --mode full"


def _under_factory(spec: str | None):
    if not spec:
        return None
    from divtrace.record.entry import load_entry

    return load_entry(spec, what="--under", classes=True)  # (a class such as contextlib:nullcontext is a factory)


def _enter(factory, spec):
    if factory is None:
        return nullcontext()
    try:
        cm = factory()
    except Exception as e:
        raise DivtraceError(f"--under {spec}: calling it raised {type(e).__name__}: {e}") from None
    if not (hasattr(type(cm), "__enter__") and hasattr(type(cm), "__exit__")):
        raise DivtraceError(f"--under {spec}: returned {type(cm).__name__}, not a context manager")
    return cm


def _entered(stack: ExitStack, factory, spec) -> None:
    """Enter the --under context for one op's replays; a context that cannot be entered is the user's error, said
    once in one line (an error inside it while an op runs is that op's, which is then not audited)."""
    cm = _enter(factory, spec)
    try:
        stack.enter_context(cm)
    except Exception as e:
        raise DivtraceError(f"--under {spec}: entering its context manager raised {type(e).__name__}: "
                            f"{str(e).splitlines()[0][:200] if str(e) else ''}") from None


def _setting_api(torch):
    """name -> (get, set) of the recorded settings a replay re-applies (as repro.py's harness does)."""
    cuda = torch.backends.cuda.matmul
    return {
        "float32_matmul_precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
        "cuda_matmul_allow_tf32": (lambda: cuda.allow_tf32, lambda v: setattr(cuda, "allow_tf32", v)),
        "cudnn_allow_tf32": (lambda: torch.backends.cudnn.allow_tf32,
                             lambda v: setattr(torch.backends.cudnn, "allow_tf32", v)),
        "allow_fp16_reduced_precision_reduction": (
            lambda: cuda.allow_fp16_reduced_precision_reduction,
            lambda v: setattr(cuda, "allow_fp16_reduced_precision_reduction", v)),
        "allow_bf16_reduced_precision_reduction": (
            lambda: cuda.allow_bf16_reduced_precision_reduction,
            lambda v: setattr(cuda, "allow_bf16_reduced_precision_reduction", v)),
        "deterministic_algorithms": (
            lambda: (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled()),
            lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
    }


class _Settings:
    """The recording's numerics settings while replaying (restored afterwards): thread count (capped at this
    machine's cores), float32 matmul precision, TF32 and reduced-precision flags, deterministic algorithms."""

    def __init__(self, settings: dict, device: str, warnings: list):
        import torch

        self.api, self.want, self.old = _setting_api(torch), {}, {}
        self.torch = torch
        threads = settings.get("num_threads")
        if isinstance(threads, int) and threads > 0 and device == "cpu":
            cap = os.cpu_count() or threads
            if threads > cap:
                warnings.append(f"recorded with {threads} threads, this machine has {cap}: replayed with {cap} "
                                "(a CPU kernel's reduction order can depend on the thread count)")
            self.want["num_threads"] = min(threads, cap)
        for k in self.api:
            v = settings.get(k)
            if k == "deterministic_algorithms":
                if isinstance(v, bool):
                    self.want[k] = (v, bool(settings.get("deterministic_warn_only")))
            elif v is not None:
                self.want[k] = v

    def _get(self, k):
        if k == "num_threads":
            return self.torch.get_num_threads()
        try:
            return self.api[k][0]()
        except (RuntimeError, AttributeError):  # a backend this build lacks
            return None

    def _set(self, k, v) -> None:
        if v is None:
            return
        try:
            self.torch.set_num_threads(v) if k == "num_threads" else self.api[k][1](v)
        except (RuntimeError, AttributeError, TypeError, ValueError):
            pass

    def __enter__(self):
        self.old = {k: self._get(k) for k in self.want}
        for k, v in self.want.items():
            if self.old[k] != v:
                self._set(k, v)

    def __exit__(self, *exc):
        for k, v in self.old.items():
            if self._get(k) != v:
                self._set(k, v)


def audit(path, *, under: str | None = None, device: str | None = None, progress=None) -> AuditResult:
    """Audit the full-mode trace at `path`. `under` (MODULE:FACTORY) names a function returning a context
    manager entered around each op's replays; `device` replays on another device than the recorded one."""
    import torch

    from divtrace.audit.checks import check_rows, same_bytes, with_layout
    from divtrace.audit.replay import recorded_call, resolve, why_not_replayable
    from divtrace.audit.rows import NoRows, plan_rows
    from divtrace.compare.op_kinds import constant_derived, is_computing
    from divtrace.compare.metrics import bitwise_equal
    from divtrace.repro.codegen import Unreplayable
    from divtrace.repro.region import op_short
    from divtrace.trace.reader import Trace

    t = Trace(path)
    if t.mode != "full":
        raise DivtraceError(f"{t.path}: recorded in hash mode (fingerprints only); audit re-runs each op from its "
                            f"recorded inputs, so it needs their values: {_full_mode_command(t)}")
    if t.meta.get("ops") is False:
        raise DivtraceError(f"{t.path}: recorded without ops (--no-ops); audit re-runs each recorded op: record "
                            f"again with ops: {_full_mode_command(t)}")
    warnings = list(t.warnings)
    if not t.complete:
        warnings.append(f"{t.path}: the recording did not finish ({t.status}): the ops it recorded are audited")
    rec_device = t.meta.get("device") or "cpu"
    dev = device or rec_device
    try:
        torch.device(dev)
    except (RuntimeError, TypeError):
        raise DivtraceError(f"--device {dev!r}: not a torch device") from None
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise DivtraceError(f"{t.path}: recorded on {rec_device}, and this machine has no CUDA device; audit on "
                            f"the CPU kernels instead with --device cpu")
    factory = _under_factory(under)
    from divtrace.audit.tokens_view import TokenViews

    token_views = TokenViews(t)
    classes = dict(t.meta.get("module_tree") or [])

    selected = []
    for i in range(len(t.rop)):
        op = t.rop[i]
        if op is None or op.startswith("divtrace."):  # divtrace's own derived values (the top-k margin)
            continue
        rec = t.records[i]
        if is_computing(rec, t) or op_short(op) == "embedding":
            selected.append(rec)
    if not selected:
        raise DivtraceError(f"{t.path}: the trace holds no computing ops ({len(t.records)} records): nothing to "
                            "audit (record the model's forward with ops on: divtrace.record(..., ops=True))")

    last_use: dict[int, int] = {}
    for rec in selected:
        for vid in rec.inputs:
            last_use[vid] = rec.index
    cache: dict[int, object] = {}
    memo: dict = {}

    def load(vid):
        x = cache.get(vid)
        if x is None:
            v = t.values[vid]
            x = t.tensor(vid)
            if not v.derived:
                x = with_layout(x, v.shape, v.stride)
            # onto the replay device where it lived on the recording's device; a CPU value of a GPU run stays
            x = x.to(dev if (v.device or rec_device) == rec_device else v.device)
            cache[vid] = x
        return x

    settings = _Settings(t.meta.get("settings") or {}, dev, warnings)
    results: list[OpAudit] = []
    total = 0.0
    with settings, torch.no_grad():
        for k, rec in enumerate(selected):
            if progress is not None:
                progress(k, len(selected))
            module = t.calls[rec.call_id].module
            shapes = [t.values[v].shape for v in rec.inputs]
            dtypes = [t.values[v].dtype.removeprefix("torch.") for v in rec.inputs]
            a = OpAudit(rec.index, rec.op, module, classes.get(module, "?"), shapes, dtypes, audited=False)
            results.append(a)
            try:
                fn = resolve(rec.op)
                why = why_not_replayable(rec, fn)
                if why is None:
                    missing = [v for v in list(rec.inputs) + list(rec.outputs) if not t.has_bytes(v)]
                    if missing:
                        why = f"value {missing[0]} has no stored bytes in the trace"
                if why is not None:
                    a.why = why
                    continue
                call = recorded_call(rec, rec_device, dev)
                tensors = {vid: load(vid) for vid in dict.fromkeys(rec.inputs)}
                with ExitStack() as under_cm:
                    _entered(under_cm, factory, under)
                    if dev.startswith("cuda"):
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    out1 = call.run(tensors)
                    if dev.startswith("cuda"):
                        torch.cuda.synchronize()
                    first = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    out2 = call.run(tensors)
                    if dev.startswith("cuda"):
                        torch.cuda.synchronize()
                    # the fastest call: the first call of a kernel also pays for its warm-up, and a short op
                    # timed once is mostly noise (a few more calls, up to about a millisecond)
                    a.seconds = min(first, time.perf_counter() - t0)
                    for _ in range(8 if a.seconds < 1e-4 else 3 if a.seconds < 1e-3 else 0):
                        t0 = time.perf_counter()
                        call.run(tensors)
                        if dev.startswith("cuda"):
                            torch.cuda.synchronize()
                        a.seconds = min(a.seconds, time.perf_counter() - t0)
                    a.audited = True
                    total += a.seconds
                    keep = call.compared(len(out1))
                    a.deterministic = same_bytes([out1[i] for i in keep], [out2[i] for i in keep])
                    a.replays_record = len(rec.outputs) == len(out1) and all(
                        bitwise_equal(out1[i].cpu(), t.tensor(rec.outputs[i])) for i in keep)
                    if not a.replays_record:
                        a.notes.append("the replay's output is not bitwise the recorded one (another torch, thread "
                                       "count or kernel than the recording's)")
                    if constant_derived(t, rec.index, memo):
                        a.constant = True
                        a.why = "computed from constants alone (no data rows): determinism only"
                        continue
                    if not a.deterministic:
                        a.why = "not deterministic: its rows were not compared across batches"
                        continue
                    try:
                        plan = plan_rows(call, {v: t.values[v].shape for v in rec.inputs},
                                         [t.values[v].shape for v in rec.outputs])
                    except NoRows as e:
                        a.audited = False
                        a.why = f"row dim unknown: {e}" if not str(e).startswith("row dim") else str(e)
                        continue
                    a.family, a.n_rows = plan.family, plan.n
                    r = check_rows(call, plan, tensors, out1, seed=rec.index)
                    a.batch_invariant = r.invariant
                    a.rows_checked_at, a.rows_differ_at, a.rows = r.checked, r.differ_at, r.rows
                    a.max_ulp = r.max_ulp if r.differ_at else 0
                    a.tokens = token_views.tokens(rec.call_id, plan.n, r.rows)
                    a.notes += r.notes
            except Unreplayable as e:
                a.why = f"cannot be re-run: {e}"
            except DivtraceError:
                raise
            except Exception as e:  # the kernel refused a split or a padded batch: say so, never call it clean
                a.audited, a.batch_invariant = False, None
                a.why = f"re-running it failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            finally:
                for vid in rec.inputs:
                    if last_use.get(vid) == rec.index:
                        cache.pop(vid, None)
    return AuditResult(str(t.path), t.label, results, total, under=under, device=dev, warnings=warnings)
