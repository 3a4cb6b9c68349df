"""The verdict rule, in one place: what a comparison may claim from what it saw.

Every command that compares two traces (`bisect` by calls or by tokens, `repro`, `verify --runs`) asks `decide`
for its verdict, so "identical" means the same thing everywhere:

- **identical** (exit 0): both traces are complete, divtrace saw everything that ran in both (no `unseen`
  entry in either meta.json), and the final outputs of both sides were compared and are bitwise equal.
- **within_tolerance** (exit 0): as identical, but some compared tensors differ bitwise, each within the
  tolerance the user gave.
- **diverged** (exit 1): an origin was found. The divergence is real even when a trace stopped early (what
  was recorded ran); the reason then says which trace is incomplete.
- **absorbed** (exit 4): as identical, except that some internal values differ: every compared final output
  is bitwise equal, and the differences inside never reach one (an fp32 mean whose last bit the bf16 rounding
  after it absorbs), or a parameter or buffer compared by name differs (a weight no output of this batch reads:
  an embedding row no token looks up, an MoE expert no token was routed to; divtrace.compare.params). Neither
  identical nor diverged; the absorbed differences are listed, each differing parameter by its name.
- **inconclusive** (exit 3): anything else, and it wins over absorbed. The reason names the trace, its status,
  how far it got, and what to do next; or the coverage gap (tokens only one side fed, calls left unpaired) that
  makes "identical" impossible; or, for a run directory whose ranks ran different ops (`parted`), where they part
  (the record, each rank's op and its module): divtrace saw those ops, but past them nothing can be compared.

Parameters: a parameter is an op input from outside, which no walk along values compares; the traces name them
and the callers compare them by name (same dtype and shape; names that do not pair are not compared, never called
different). A differing parameter counts as an absorbed difference (`absorbed` below) where no origin was found; it
never makes an origin, never moves one, and never turns inconclusive into anything else. Where the runs diverged,
the differing parameters are reported beside the origin (`parameters`).

The function is pure (no torch, no trace reading): callers say what they saw. `progress` turns a trace that
stopped early into words, from duck-typed traces (`.calls` of `ModuleCall`s, `.path`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from divtrace.errors import DivtraceError

IDENTICAL, WITHIN_TOLERANCE, DIVERGED, INCONCLUSIVE = "identical", "within_tolerance", "diverged", "inconclusive"
ABSORBED = "absorbed"
EXIT_CODES = {IDENTICAL: 0, WITHIN_TOLERANCE: 0, DIVERGED: 1, INCONCLUSIVE: 3, ABSORBED: 4}


class Inconclusive(DivtraceError):
    """A command that needs an origin or an identical pair got neither: the one-line reason, exit 3."""

    exit_code = 3


@dataclass
class TraceSeen:
    """What a comparison knows about one of its traces."""

    side: str  # "a" | "b"
    path: str
    complete: bool  # closed with status "complete" (a `running` trace, SIGKILLed or still recording, is not)
    status: str  # meta.json's status, spelled out ("terminated", "running (never closed: ...)")
    error: str | None = None  # meta.json's error, when the recording stopped on one
    progress: str | None = None  # how far an incomplete trace got, in words (`progress()`)
    unseen: list[str] = field(default_factory=list)  # meta.json "unseen": what ran without divtrace seeing it
    missing_ranks: list[int] = field(default_factory=list)  # a run directory's ranks with no trace folder
    parted: list[str] = field(default_factory=list)  # a run directory's ranks whose op sequences part, in words


@dataclass
class Coverage:
    """How much of the two runs the comparison covered (`bisect --json`'s `coverage`)."""

    calls_compared: int  # aligned call pairs (or token rows, for a token-aligned comparison)
    only_a: int  # calls (or tokens) of a with no counterpart in b: not compared
    only_b: int
    final_compared: bool  # the final outputs of both sides were compared
    final_equal: bool | None  # their comparison (bitwise, or within the tolerance given); None when not compared
    final_note: str | None = None  # why the final outputs were not compared
    complete: dict = field(default_factory=dict)  # {"a": bool, "b": bool}
    unseen: dict = field(default_factory=dict)  # {"a": [...], "b": [...]}
    unit: str = "calls"  # what calls_compared / only_a / only_b count: "calls" or "tokens"
    gaps: list = field(default_factory=list)  # what was not compared and should have been (the "coverage" reason)
    parted: dict = field(default_factory=dict)  # {"a": [...], "b": [...]}: where a run's ranks ran different ops

    def to_dict(self) -> dict:
        return {"calls_compared": self.calls_compared, "only_a": self.only_a, "only_b": self.only_b,
                "final_compared": self.final_compared, "final_equal": self.final_equal,
                "final_note": self.final_note, "complete": dict(self.complete), "unseen": dict(self.unseen),
                "unit": self.unit, "gaps": list(self.gaps), "parted": dict(self.parted)}


@dataclass
class Verdict:
    verdict: str  # identical | within_tolerance | diverged | inconclusive
    reason: str  # one sentence or a few, "; "-joined: why this verdict, and what to do next where it is not final
    coverage: Coverage
    exit_code: int


def unseen_of(meta: dict) -> list[str]:
    """meta.json's "unseen" as a list of strings (absent or empty: nothing unseen)."""
    u = meta.get("unseen")
    if not u:
        return []
    if isinstance(u, (list, tuple)):
        return [str(x) for x in u if x not in (None, "")]
    return [str(u)]


def progress(t, ref) -> str:
    """How far incomplete trace `t` got, measured against `ref` (the other trace): "stopped in root call 1 of 1
    after 47 of the reference's 91 module calls; last module model.layers.5". Measured against `ref` only where
    `t`'s calls so far are `ref`'s first calls (the same work: the same modules, called in the same order); else
    (a rollout's decode steps against a trainer's one forward) in `t`'s own terms, with what `ref` holds beside.
    Duck-typed: `.calls` maps ids to ModuleCall-like objects (module, call, parent, enter_index, exit_index)."""
    calls = sorted(t.calls.values(), key=lambda c: c.enter_index)
    top = [c for c in calls if c.parent is None]
    ref_calls = sorted(ref.calls.values(), key=lambda c: c.enter_index)
    ref_top = sum(1 for c in ref_calls if c.parent is None)
    whose = "the reference's" if getattr(ref, "complete", True) else "the other trace's (itself incomplete)"
    if not calls:
        return f"stopped before its first module call was written ({whose} {len(ref_calls)} module calls)"
    same_work = len(calls) <= len(ref_calls) and all(
        (c.module, c.call) == (r.module, r.call) for c, r in zip(calls, ref_calls))
    open_top = next((i for i, c in enumerate(top) if c.exit_index is None), None)
    if open_top is None and same_work:
        # Every root call has its exit (an exception closes the calls it passes through): the stop came inside the
        # last one when it holds fewer calls than the reference's call of the same number, else after it.
        k = len(top) - 1
        inside = k < len(_root_spans(ref_calls)) and _root_spans(calls)[k] < _root_spans(ref_calls)[k]
        open_top = k if inside else None
    unfinished = [c for c in calls if c.exit_index is None]
    last = f"last module {(unfinished[-1] if unfinished else calls[-1]).module or '<root>'}"
    if not same_work:
        where = (f"stopped in its root call {open_top + 1}" if open_top is not None
                 else f"stopped after its root call {len(top)}")
        other = "the reference" if whose == "the reference's" else "the other trace (itself incomplete)"
        return (f"{where} after {len(calls)} module calls; {last} ({other} holds {_count(ref_top, 'root call')} "
                f"and {_count(len(ref_calls), 'module call')}, not these: how far it got cannot be measured against it)")
    where = (f"stopped in root call {open_top + 1} of {ref_top}" if open_top is not None
             else f"stopped after root call {len(top)} of {ref_top}")
    return f"{where} after {len(calls)} of {whose} {len(ref_calls)} module calls; {last}"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _root_spans(calls: list) -> list[int]:
    """Per top-level call (in order), how many calls it spans, itself included (`calls` sorted by enter)."""
    spans = []
    for c in calls:
        if c.parent is None:
            spans.append(0)
        if spans:
            spans[-1] += 1
    return spans


def _incomplete(t: TraceSeen) -> str:
    status = t.status + (f", {t.error}" if t.error else "")
    return f"trace {t.path} is incomplete (status: {status})" + (f": {t.progress}" if t.progress else "")


def decide(*, origin_found: bool, within_tolerance: bool, final_compared: bool, final_equal: bool | None,
           a: TraceSeen, b: TraceSeen, calls_compared: int, only_a: int = 0, only_b: int = 0,
           final_note: str | None = None, unit: str = "calls", absorbed: int = 0,
           gaps: list | None = None, final_local: bool = False) -> Verdict:
    """The verdict of a comparison, from what it saw.

    origin_found: a divergence was localized (an origin, or the earliest differing call). Diverged, whatever
        else holds.
    within_tolerance: no origin beyond the tolerance, but some compared tensors differ bitwise (each within
        it). Exit 0 only under the conditions of identical.
    final_compared / final_equal: the final outputs of both sides (the last root call's output; each token's
        logits under token alignment) were compared, and whether they are equal (bitwise, or within the
        tolerance given). final_note says why they were not compared, in words.
    a, b: each trace's path, completeness, status, progress and `unseen` list.
    calls_compared, only_a, only_b: the coverage counts (of `unit`: "calls" or "tokens").
    absorbed: internal differences that reach no compared final output, differing parameters included (then, at
        best, absorbed: exit 4).
    gaps: coverage gaps in words (tokens one side fed and the other did not; calls left unpaired): inconclusive,
        reason "coverage: ...", unless an origin was found.
    final_local: the final outputs pair up but were not compared, a run directory's side holding them only as its
        ranks' own pieces (that side's `parted` or `unseen` says why; no --map advice).
    """
    cov = Coverage(calls_compared, only_a, only_b, final_compared, final_equal if final_compared else None,
                   None if final_compared else final_note, {"a": a.complete, "b": b.complete},
                   {"a": list(a.unseen), "b": list(b.unseen)}, unit, list(gaps or []),
                   {t.side: list(t.parted) for t in (a, b) if t.parted})
    incomplete = [t for t in (a, b) if not t.complete]
    parted = [t for t in (a, b) if t.parted]
    if origin_found:
        reason = "the runs diverge (`first` says where, and whether its inputs were still equal)"
        if incomplete:
            reason += ("; the divergence is real, but " + "; ".join(map(_incomplete, incomplete))
                       + ", so later divergences may be missing")
        for t in parted:
            reason += (f"; the ranks of {t.path} then ran different ops ({'; '.join(t.parted)}): nothing past that "
                       "was compared, so later divergences may be missing")
        return Verdict(DIVERGED, reason, cov, EXIT_CODES[DIVERGED])
    why = []
    for t in incomplete:
        stopped = not t.missing_ranks or "stopped (" in t.status  # a run directory may only miss a rank's folder
        todo = [f"record every rank of the run into it (RUN/rank-K, rank {', '.join(map(str, t.missing_ranks))} "
                "included)"] if t.missing_ranks else []
        todo += ["re-record it to its end (a run that finishes closes its trace as complete)"] if stopped else []
        why.append(f"{_incomplete(t)}, and no divergence was found "
                   f"{'before it stopped' if stopped else 'in what could be compared'}; {' and '.join(todo)} and "
                   "compare again")
    for t in (a, b):
        if t.unseen:
            why.append(f"trace {t.path} ran computation divtrace did not see ({'; '.join(t.unseen)}): what was "
                       "compared may not be what ran; record it eagerly (no torch.compile regions without taps, no "
                       "CUDA-graph replays) to compare every step")
    for t in parted:
        why.append(f"the ranks of {t.path} ran different ops ({'; '.join(t.parted)}), and no divergence was found "
                   "before that: past it their values cannot be put together into global values, so nothing there "
                   "was compared; find why the ranks' ops part there (an MoE experts' loop that runs only the "
                   "experts that got rows runs fewer ops on a rank whose expert got none: the routing differs)")
    if gaps:
        why.append("coverage: " + "; ".join(gaps) + ": the runs did not do the same work, so they cannot be called "
                   "identical (compare runs of the same prompts, or find what one side left out)")
    if not incomplete and not parted and not final_compared and not (final_local and (a.unseen or b.unseen)):
        why.append(f"the final outputs were not compared ({final_note or 'no final output pair'})" + (
            "" if final_local else "; make both runs make the same calls (or pass --map FILE where the stacks name "
                                   "modules differently)"))
    elif not incomplete and final_equal is False:
        why.append("the final outputs differ but no divergence was localized (please report this)")
    if why:
        return Verdict(INCONCLUSIVE, "; ".join(why), cov, EXIT_CODES[INCONCLUSIVE])
    if absorbed:
        return Verdict(ABSORBED, f"both traces complete and fully seen; the final outputs were compared and are "
                       f"bitwise equal, but {absorbed} internal difference(s) never reach them (absorbed: listed in "
                       "`absorbed`)", cov, EXIT_CODES[ABSORBED])
    if within_tolerance:
        return Verdict(WITHIN_TOLERANCE, "both traces complete; every difference passes the tolerance, the final "
                       "outputs included", cov, EXIT_CODES[WITHIN_TOLERANCE])
    return Verdict(IDENTICAL, "both traces complete and fully seen; the final outputs were compared and are bitwise "
                   "equal, as is every compared tensor", cov, EXIT_CODES[IDENTICAL])
