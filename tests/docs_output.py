"""What the docs' output blocks promise, and what may differ on another machine (used by tests/test_docs_drift.py and
scripts/simulate_machines.py).

A ```text block marked `<!-- divtrace-example: output -->` shows output of the commands run before it. Each of its
lines (but `...`) must be a line they printed, compared after `normal` (runs of spaces, i.e. table padding,
collapsed). Within a line:

FIXED, compared exactly (a change is drift, and the drift tests fail): the line itself (a shown line must be
printed), the verdict words (PASSED / FAILED / INCONCLUSIVE, diverged / identical, origin / propagated, equal NO /
yes), module paths, op names, call numbers, record indices, tensor names, dtypes and shapes, totals (`of 4096
elements`, `/4096`, `on 6 of 6 input sets`, `246 compared tensors`, `(1 recorded, 20 trial, 4 sweep, 4
reference)`), table headers and file names.

MACHINE-DEPENDENT (`MACHINE_DEPENDENT`, `MACHINE_DEPENDENT_JSON`): figures that another CPU (its ISA: AVX-512,
AVX2, none), its BLAS, the thread count or another torch build may change, because the reductions and kernels
behind them round in another order: mismatch counts, max abs / max rel, ULP counts, the first mismatching element
(its index and bits), the final logprob / KL / argmax figures, the fp64 reference errors and bound, the per-token
counts of differing tokens, and audit's batch sizes, rows, ULPs and time shares. Each is named by its line (its
label, its neighbours) and must still be there, of the same kind (an integer, a number, hex bits, an index of the
same rank); only its digits may differ. Never a whole line, never a module, op, verdict or total.

VOLATILE (`VOLATILE`, every run differs): a number with a unit of time, rate or size, a percentage or a ratio
(`1.3 s`, `5.9 us`, `3.07 MB`, `4.2 GB/s`, `215%`, `0.47x`).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

VOLATILE = re.compile(r"-?\d+(\.\d+)?(e-?\d+)?\s?(s|ms|us|µs|MB|GB/s|%|x)(?=\W|$)")

_KINDS = {
    "int": r"\d+",
    "num": r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?|nan|inf|-inf",
    "bits": r"0x[0-9a-f]+",
    "index": r"\[\d+(?:, \d+)*\]",
    "ulp": r"\d+(?: \(\+\d+ sign flips\))?",
    "ints": r"\d+(?:, \d+)*",  # a list of batch sizes
    "positions": r"[\d, -]+",  # token positions, as ranges
}
_NUM = _KINDS["num"]

# (what, a regex over a `normal` line: `{kind}` marks a machine-dependent figure; everything else is fixed)
MACHINE_DEPENDENT = [
    ("mismatch count", r"│ mismatched │ {int} of \d+ elements │"),
    ("max abs / max rel", r"│ max abs / max rel │ {num} / {num} │"),
    ("max ULP", r"│ max ULP │ {ulp} │"),
    ("first mismatching element", r"│ first mismatch │ index {index}: a={num} \({bits}\) b={num} \({bits}\) │"),
    ("final logprob / KL / argmax figure",
     r"│ (?:max \|dlogprob\|(?: \(next token\))?|mean \|dlogprob\||KL\([\w|]+\) (?:per position|mean per token)|"
     r"KL reverse, mean per token|argmax agreement|k3 KL[^│]*|token_mult_prob_error[^│]*) │ {num} │"),
    ("a later call's max abs and mismatch count", r"│ \d+ │ [\w.]+ │ \d+ │ propagated │ [\w.]+ │ {num} │ {int} │"),
    ("repro: the sides on one input set",
     r"(?:recorded|random seed=\d+) NO {int}/\d+ {num} {ulp} {index} {num} \({bits}\) {num} \({bits}\)"),
    ("fp64 reference errors", r"PASSED: reference \([^)]*\): patch error {num} <= bound {num} \(fp64 reference: .*\)"),
    ("differing tokens", r"tokens: \d+ shared, \d+ only in a, \d+ only in b, {int} differ; final logits compared "
                         r"for \d+ \({int} differ\)"),
    ("audit: ops found", r"AUDIT: \d+ ops, {int} not batch-invariant, {int} not deterministic"),
    ("audit: where rows differ", r"rows differ at M=\[{ints}\] \(checked M=\[[\d, ]+\]\); {int} of \d+ rows; "
                                 r"max ULP {int}; <N> of the replay time"),
    ("audit: tokens reached", r"tokens reached: positions {positions}(?: in \d+ sequences)?"),
    ("audit: findings", r"FAILED: findings: {int} op groups \({int} ops not batch-invariant, {int} not deterministic\)"),
]

# `bisect --json` keys whose values may differ by machine (dotted paths from the top): the kind must match
MACHINE_DEPENDENT_JSON = {
    "first.max_abs", "first.max_rel", "first.max_ulp", "first.max_ulp_raw", "first.sign_flips", "first.mismatched",
    "first.first_index", "first.first_a_bits", "first.first_b_bits", "first.first_a", "first.first_b",
    "final.max_abs_logprob_diff", "final.mean_abs_logprob_diff", "final.kl", "final.argmax_agreement",
}


@dataclass
class Rule:
    what: str
    regex: re.Pattern
    kinds: list


def _compile(template: str) -> Rule:
    kinds = []

    def group(m):
        kinds.append(m.group(1))
        return f"(?P<v{len(kinds) - 1}>{_KINDS[m.group(1)]})"

    return Rule("", re.compile(re.sub(r"\{(\w+)\}", group, template)), kinds)


RULES = [Rule(what, r.regex, r.kinds) for what, r in ((w, _compile(t)) for w, t in MACHINE_DEPENDENT)]


def normal(line: str) -> str:
    """A line with its volatile figures replaced and runs of spaces (table padding) collapsed."""
    return " ".join(VOLATILE.sub("<N>", line).split())


def figures(line: str):
    """(rule, match) when a normal line holds machine-dependent figures, else None."""
    for rule in RULES:
        m = rule.regex.fullmatch(line)
        if m:
            return rule, m
    return None


def shape(line: str) -> re.Pattern | None:
    """For a normal line with machine-dependent figures: a regex that matches the line with any figures of the same
    kinds in their places (the rest exact); None for a line with none."""
    got = figures(line)
    if got is None:
        return None
    rule, m = got
    out, pos = [], 0
    for i, kind in enumerate(rule.kinds):
        s, e = m.span(f"v{i}")
        out.append(re.escape(line[pos:s]))
        value = m.group(f"v{i}")
        # an index keeps its rank; any other figure is matched by kind
        out.append(r"\[" + ", ".join([r"\d+"] * (value.count(",") + 1)) + r"\]" if kind == "index"
                   else f"(?:{_KINDS[kind]})")
        pos = e
    out.append(re.escape(line[pos:]))
    return re.compile("".join(out))


def missing_lines(shown: list[tuple[int, str]], printed: str) -> list[tuple[int, str]]:
    """The shown lines (number, text) that no printed line matches."""
    real = [normal(x) for x in printed.splitlines()]
    exact = set(real)
    out = []
    for n, t in shown:
        if not t.strip() or t.strip() == "...":
            continue
        line = normal(t)
        pat = shape(line)
        if line in exact or (pat is not None and any(pat.fullmatch(r) for r in real)):
            continue
        out.append((n, t))
    return out


# -- JSON ------------------------------------------------------------------------------------------------------

def _same_kind(shown, real) -> bool:
    if isinstance(shown, bool) or isinstance(real, bool):
        return type(shown) is type(real)
    if isinstance(shown, (int, float)):
        return isinstance(real, (int, float))
    if isinstance(shown, str) and re.fullmatch(_KINDS["bits"], shown):
        return isinstance(real, str) and re.fullmatch(_KINDS["bits"], real) is not None
    if isinstance(shown, list):
        return isinstance(real, list) and len(real) == len(shown)
    return type(shown) is type(real)


def json_agrees(shown, real, where: str = "") -> list[str]:
    """What the shown JSON says that the real one does not: every shown key must be there; machine-dependent values
    (MACHINE_DEPENDENT_JSON) of the same kind, everything else equal (a list may end with "...")."""
    if where.lstrip(".") in MACHINE_DEPENDENT_JSON:
        return [] if _same_kind(shown, real) else [f"{where}: doc {shown!r}, output {real!r} (another kind)"]
    if isinstance(shown, dict):
        if not isinstance(real, dict):
            return [f"{where}: the doc shows an object, the output has {type(real).__name__}"]
        bad = [f"{where}.{k}: not in the output" for k in shown if k not in real]
        return bad + [p for k in shown if k in real for p in json_agrees(shown[k], real[k], f"{where}.{k}")]
    if isinstance(shown, list):
        if not isinstance(real, list):
            return [f"{where}: the doc shows a list, the output has {type(real).__name__}"]
        cut = next((i for i, x in enumerate(shown) if isinstance(x, str) and x.startswith("...")), None)
        if cut is None and len(shown) != len(real):
            return [f"{where}: {len(shown)} entries shown, {len(real)} in the output"]
        return [p for i, x in enumerate(shown[:cut]) for p in json_agrees(x, real[i] if i < len(real) else None,
                                                                          f"{where}[{i}]")]
    if isinstance(shown, bool) or isinstance(real, bool):
        same = type(shown) is type(real) and shown == real
    elif isinstance(shown, (int, float)):
        same = isinstance(real, (int, float)) and shown == real
    else:
        same = shown == real
    return [] if same else [f"{where}: doc {shown!r}, output {real!r}"]


# -- perturbation: another machine, and real drift -----------------------------------------------------------

def _bump(digit: str) -> str:
    if digit.isdigit():
        return str((int(digit) + 1) % 10)
    return "0123456789abcdef"[("0123456789abcdef".index(digit) + 1) % 16]


def _bump_last_digit(value: str) -> str:
    i = max(i for i, c in enumerate(value) if c.isdigit() or (c in "abcdef" and value.startswith("0x")))
    return value[:i] + _bump(value[i]) + value[i + 1:]


def as_on_another_machine(line: str) -> str | None:
    """The shown line with the last digit of each machine-dependent figure changed (None: it has none)."""
    got = figures(normal(line))
    if got is None:
        return None
    rule, m = got
    text = m.string
    for i in reversed(range(len(rule.kinds))):
        s, e = m.span(f"v{i}")
        text = text[:s] + _bump_last_digit(text[s:e]) + text[e:]
    return text


def json_as_on_another_machine(shown, where: str = ""):
    if where.lstrip(".") in MACHINE_DEPENDENT_JSON:
        if isinstance(shown, bool):
            return shown
        if isinstance(shown, (int, float)):
            return type(shown)(_bump_last_digit(repr(shown))) if isinstance(shown, int) else \
                float(_bump_last_digit(repr(shown)))
        if isinstance(shown, str) and re.search(r"[0-9a-f]$", shown):
            return _bump_last_digit(shown)
        if isinstance(shown, list) and shown and isinstance(shown[-1], int):
            return shown[:-1] + [shown[-1] + 1]
        return shown
    if isinstance(shown, dict):
        return {k: json_as_on_another_machine(v, f"{where}.{k}") for k, v in shown.items()}
    if isinstance(shown, list):
        return [json_as_on_another_machine(v, f"{where}[{i}]") for i, v in enumerate(shown)]
    return shown


# Real drift: each must make the check fail. (name, pattern, replacement): applied to the first shown line it fits.
DRIFTS = [
    ("module", re.compile(r"model\.layers\.0\.(\w+)"), r"model.layers.1.\1"),
    ("op", re.compile(r"aten\.(_to_copy|mul|mm|bmm)\.(default|Tensor)"), r"aten.add.\2"),
    ("verdict", re.compile(r"^(\s*)(PASSED|FAILED)(?=:)"), lambda m: m.group(1) + {"PASSED": "FAILED",
                                                                                   "FAILED": "PASSED"}[m.group(2)]),
    ("total", re.compile(r"\b(of|on \d+ of) (\d+)\b(?= (elements|input sets|random trials))"),
     lambda m: f"{m.group(1)} {int(m.group(2)) + 1}"),
    ("record index", re.compile(r"\(record (\d+)\)"), lambda m: f"(record {int(m.group(1)) + 1})"),
]


def drifted(lines: list[tuple[int, str]]) -> dict[str, list[tuple[int, str]]]:
    """{drift name: the shown lines with that drift in the first line it fits} for each drift that fits one."""
    out = {}
    for name, pat, repl in DRIFTS:
        for i, (n, t) in enumerate(lines):
            new = pat.sub(repl, t, count=1)
            if new != t:
                out[name] = lines[:i] + [(n, new)] + lines[i + 1:]
                break
    return out


JSON_DRIFTS = [("module", "first.module", "model.layers.1.input_layernorm"), ("op", "first.op", "aten.add.Tensor"),
               ("verdict", "verdict", "identical"), ("cause", "first.cause", "propagated"),
               ("total", "first.numel", 4097)]


def json_drifted(shown: dict) -> dict[str, dict]:
    out = {}
    for name, path, value in JSON_DRIFTS:
        keys = path.split(".")
        node = shown
        for k in keys[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, dict) and keys[-1] in node and node[keys[-1]] != value:
            copy = json.loads(json.dumps(shown))
            target = copy
            for k in keys[:-1]:
                target = target[k]
            target[keys[-1]] = value
            out[name] = copy
    return out
