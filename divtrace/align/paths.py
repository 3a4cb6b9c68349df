"""Aligning two traces: module-path renames (--map), call pairing, and value comparison with caching."""
from __future__ import annotations

import re
import weakref
from pathlib import Path

from divtrace.compare.diffs import TensorDiff, Tolerance
from divtrace.errors import DivtraceError
from divtrace.trace.records import ModuleCall
from divtrace.trace.reader import Trace


_MAP_KEYS = {"a", "b", "rules"}
_RULE_KEYS = {"side", "module", "when", "unless", "hide", "split", "inputs", "outputs", "only", "optional", "why"}


class MapRule:
    """One structural rule of a map, for the calls of one side whose (original) path matches `module`:
    - `hide: true`: the call is taken out of the tree; its children and its own ops go to its parent (a module
      the other stack has no counterpart for, such as vLLM's attention wrapper: its ops become the parent's code);
    - `split: {path-replacement: output-key}`: the call stands for several calls of the other side, one per
      entry, each with the call's inputs and the one output named (vLLM's fused qkv_proj as q_proj, k_proj and
      v_proj, from the derived outputs `out.q`... its adapter records);
    - `inputs:` / `outputs: {key: new-key or null}`: renames (null drops the key); with `only: true` the keys
      not listed are dropped (of the lists the rule names: `inputs: {}` with `only` drops every input);
    - `when: KEY` / `unless: KEY`: the rule applies only to calls that have (have not) that input or output key.
    The first rule that applies to a call is the only one applied to it. A rule that matches no call of its
    side is an error unless `optional: true`."""

    def __init__(self, data, where: str):
        if not isinstance(data, dict) or "module" not in data or not set(data) <= _RULE_KEYS:
            raise DivtraceError(f"--map: {where} must be a mapping with `module:` and any of "
                                f"{', '.join(sorted(_RULE_KEYS - {'module'}))}; got {data!r}"[:300])
        self.side = str(data.get("side", "b"))
        if self.side not in ("a", "b", "both"):
            raise DivtraceError(f"--map: {where}: side must be a, b or both, got {self.side!r}")
        try:
            self.module = re.compile(str(data["module"]))
        except re.error as e:
            raise DivtraceError(f"--map: {where}: bad regex {data['module']!r}: {e}") from None
        self.when, self.unless = data.get("when"), data.get("unless")
        self.hide, self.only, self.optional = bool(data.get("hide")), bool(data.get("only")), bool(data.get("optional"))
        self.split = self._mapping(data.get("split"), where, "split", nulls=False)
        self.inputs = self._mapping(data.get("inputs"), where, "inputs", nulls=True)
        self.outputs = self._mapping(data.get("outputs"), where, "outputs", nulls=True)
        self.where = where
        self.why = str(data.get("why") or f"{where} ({self.module.pattern})")
        self.used = {"a": False, "b": False}

    @staticmethod
    def _mapping(m, where, name, nulls):
        if m is None:
            return None
        if not isinstance(m, dict) or not all(isinstance(v, str) or (nulls and v is None) for v in m.values()):
            raise DivtraceError(f"--map: {where}: `{name}` must map keys to {'new keys or null' if nulls else 'strings'}")
        return {str(k): v for k, v in m.items()}

    def applies(self, side: str, call) -> bool:
        if self.side not in (side, "both") or not self.module.search(call.module):
            return False
        keys = {k for k, _ in call.inputs} | {k for k, _ in call.outputs}
        return (self.when is None or self.when in keys) and (self.unless is None or self.unless not in keys)

    def rekey(self, items: list, mapping: dict) -> list:
        out, seen = [], set()
        for k, v in items:
            new = mapping[k] if k in mapping else None if self.only else k
            if new is not None and new not in seen:
                seen.add(new)
                out.append((new, v))
        return out


class PathMap:
    """How the module calls of two stacks correspond. YAML: `{a: {regex: repl}, b: {regex: repl}, rules: [...]}`
    (renames of module paths per side, and structural rules, see MapRule), or a plain `{regex: repl}` mapping,
    which applies to side b (the one usually named differently: the engine). `from_file` also takes the name of
    a map shipped with divtrace (divtrace/maps/NAME.yaml: `vllm-hf`)."""

    def __init__(self, a=None, b=None, rules=None, name: str = "--map"):
        self.rules = {"a": self._compile(a or {}, "a"), "b": self._compile(b or {}, "b")}
        if rules is not None and not isinstance(rules, list):
            raise DivtraceError(f"--map: `rules` must be a list of rules, got {type(rules).__name__}")
        self.structure = [MapRule(r, f"rule {i + 1}") for i, r in enumerate(rules or [])]
        self.name = name
        self.applied: list[str] = []  # "side: rule: N calls"
        self._rewritten: dict[int, tuple] = {}  # id(call dict) -> (the dict, hidden call ids, notes)
        self._checked: set = set()
        self._keep: list = []  # traces checked (their ids stay unique)

    @staticmethod
    def _compile(rules: dict, side: str):
        out = []
        for pat, repl in rules.items():
            if not (repl is None or isinstance(repl, (str, int, float))):
                raise DivtraceError(f"--map: the replacement for {pat!r} (side {side}) is not a string: {repl!r} "
                                    "(a map per side has only the keys a:, b: and rules:)")
            try:
                out.append((re.compile(str(pat)), "" if repl is None else str(repl)))
            except re.error as e:
                raise DivtraceError(f"--map: bad regex {pat!r} for side {side}: {e}") from None
        return out

    @staticmethod
    def builtin(name: str) -> Path | None:
        """The shipped map called `name` (`vllm-hf`), or None."""
        if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
            return None
        p = Path(__file__).resolve().parent.parent / "maps" / f"{name}.yaml"
        return p if p.is_file() else None

    @classmethod
    def from_file(cls, path) -> "PathMap":
        import yaml

        p = Path(path)
        if not p.exists() and cls.builtin(str(path)) is not None:
            p = cls.builtin(str(path))
        try:
            data = yaml.safe_load(p.read_text())
        except OSError as e:
            raise DivtraceError(f"{p}: cannot read map file: {e.strerror or e} (built-in maps: vllm-hf)") from None
        except UnicodeDecodeError:
            raise DivtraceError(f"{p}: not a text (UTF-8) file; a map file is YAML of regex -> replacement") from None
        except yaml.YAMLError as e:
            raise DivtraceError(f"{p}: not valid YAML: {str(e).splitlines()[0]}") from None
        if data is None:
            return cls(name=str(path))
        if not isinstance(data, dict):
            raise DivtraceError(f"{p}: map file must be a mapping of regex -> replacement")
        if set(data) <= _MAP_KEYS and all(isinstance(v, dict) or v is None for k, v in data.items() if k != "rules") \
                and (set(data) & {"a", "b"} or "rules" in data):
            try:
                return cls(data.get("a"), data.get("b"), data.get("rules"), name=str(path))
            except DivtraceError as e:
                raise DivtraceError(f"{p}: {e}") from None
        return cls(None, data, name=str(path))

    def apply(self, side: str, path: str) -> str:
        rules = self.rules[side]
        if not rules:
            return path
        for pat, repl in rules:
            try:
                path = pat.sub(repl, path)
            except re.error as e:  # a bad group reference in the replacement shows only when the regex matches
                raise DivtraceError(f"--map: bad replacement {repl!r} for {pat.pattern!r} (side {side}): {e}") from None
        return path

    # -- structural rules ---------------------------------------------------------------------------------------
    def rewrite(self, side: str, trace) -> None:
        """Apply the structural rules to the call tree of `trace` (a Trace, or a view of one root call of it such
        as token alignment's TokenView), in place, once per call dict (views of one root call share theirs).
        Hidden and split calls stay in `trace.calls` (records still name them) and are listed in
        `trace.hidden_calls`: pairing skips them. Split calls' stand-ins get call ids beyond the whole trace's."""
        rules = [r for r in self.structure if r.side in (side, "both")]
        calls = trace.calls
        done = self._rewritten.get(id(calls))
        if done is None:
            hidden: set[int] = set()
            notes: dict[int, str] = {}
            if rules:
                whole = getattr(trace, "trace", trace)  # the trace a view narrows
                self._apply(side, calls, rules, hidden, notes, max(max(whole.calls, default=-1), max(calls, default=-1)) + 1)
            done = self._rewritten[id(calls)] = (calls, hidden, notes)  # (the dict kept alive: its id stays unique)
        trace.hidden_calls, trace.map_notes = done[1], done[2]

    def _apply(self, side, calls, rules, hidden, notes, next_id) -> None:
        counts: dict[str, int] = {}
        for cid in sorted(calls):
            c = calls[cid]
            if cid in hidden:
                continue
            for r in rules:
                if not r.applies(side, c):
                    continue
                counts[r.where] = counts.get(r.where, 0) + 1
                if r.hide:
                    self._hide(calls, c)
                    hidden.add(cid)
                    break
                if r.split:
                    outs = dict(c.outputs)
                    if all(k in outs for k in r.split.values()):
                        stand_ins = []
                        for repl, key in r.split.items():
                            path = r.module.sub(repl, c.module)
                            n = type(c)(next_id, path, c.call, c.parent, c.enter_index, list(c.inputs), c.exit_index,
                                        [("out", outs[key])], [], list(c.ops))
                            calls[next_id] = n
                            notes[next_id] = f"{path} is {c.module}'s {key} (side {side}): {r.why}"
                            stand_ins.append(next_id)
                            next_id += 1
                        self._replace(calls, c, stand_ins)
                        for ch in c.children:
                            calls[ch].parent = stand_ins[0]
                        calls[stand_ins[0]].children = list(c.children)
                        hidden.add(cid)
                    break
                notes[cid] = f"{c.module or '<root>'} (side {side}): {r.why}"
                if r.inputs is not None:
                    c.inputs = r.rekey(c.inputs, r.inputs)
                if r.outputs is not None:
                    c.outputs = r.rekey(c.outputs, r.outputs)
                break  # the first rule that applies to a call is the one
        self.applied += [f"{side}: {w}: {n} calls" for w, n in counts.items()]

    @staticmethod
    def _replace(calls, c, new_ids: list) -> None:
        """Put `new_ids` where `c` is among its parent's children (a new list: a view may share the old one)."""
        if c.parent is not None and c.parent in calls:
            p = calls[c.parent]
            kids = list(p.children)
            i = kids.index(c.call_id)
            kids[i:i + 1] = new_ids
            p.children = kids

    def _hide(self, calls, c) -> None:
        for ch in c.children:
            if ch in calls:
                calls[ch].parent = c.parent
        self._replace(calls, c, [ch for ch in c.children if ch in calls])
        if c.parent is not None and c.parent in calls:
            p = calls[c.parent]
            p.ops = sorted(p.ops + c.ops)

    def check_used(self, traces: dict) -> None:
        """A map that names modules the traces do not have is bad input: say which (renames and rules). Checked
        once per trace, on the whole trace (a view of one root call lacks the calls made outside it) before any
        rule renamed a key."""
        for side, t in traces.items():
            whole = getattr(t, "trace", t)
            if (side, id(whole)) in self._checked:
                continue
            self._checked.add((side, id(whole)))
            self._keep.append(whole)
            calls = list(whole.calls.values())
            paths = {c.module for c in calls}
            for pat, _ in self.rules[side]:
                if not any(pat.search(p) for p in paths):
                    raise DivtraceError(f"{self.name}: the rename {pat.pattern!r} (side {side}) matches no module of "
                                        f"{whole.path} (its modules: {', '.join(sorted(paths)[:6]) or 'none'}...)")
            for r in self.structure:
                if r.side in (side, "both") and any(r.applies(side, c) for c in calls):
                    r.used[side] = True
        sides = set(traces)
        for r in self.structure:
            mine = [s for s in ("a", "b") if r.side in (s, "both") and s in sides]
            if mine and not r.optional and not any(r.used[s] for s in mine):
                t = getattr(traces[mine[0]], "trace", traces[mine[0]])
                raise DivtraceError(f"{self.name}: {r.where} (module {r.module.pattern!r}, side {r.side}) matches no "
                                    f"module call of {t.path}; is it a trace of this stack?")


class Pairing:
    """Module calls of A and B paired by (mapped path, call number)."""

    def __init__(self, a: Trace, b: Trace, path_map: PathMap | None = None):
        self.a, self.b = a, b
        self.map = path_map or PathMap()
        if path_map is not None:
            self.map.check_used({"a": a, "b": b})
        self.map.rewrite("a", a)
        self.map.rewrite("b", b)
        # Calls a structural rule hid or split get keys no call of the other side has: never paired.
        ha, hb = getattr(a, "hidden_calls", ()), getattr(b, "hidden_calls", ())
        self.keys_a = {cid: (self.map.apply("a", c.module), c.call) if cid not in ha else ("\0hidden a", cid)
                       for cid, c in a.calls.items()}
        self.keys_b = {cid: (self.map.apply("b", c.module), c.call) if cid not in hb else ("\0hidden b", cid)
                       for cid, c in b.calls.items()}
        self.by_key_b = {k: cid for cid, k in self.keys_b.items()}
        self.by_key_a = {k: cid for cid, k in self.keys_a.items()}
        self.common = set(self.by_key_a) & set(self.by_key_b)

    def map_notes(self, call_a: ModuleCall, call_b: ModuleCall | None = None) -> list[str]:
        """How the map's structural rules made these calls comparable (empty when no rule touched them): for
        a report to say that, say, q_proj was compared with the q block of vLLM's fused qkv_proj."""
        out = [getattr(self.a, "map_notes", {}).get(call_a.call_id)]
        if call_b is not None:
            out.append(getattr(self.b, "map_notes", {}).get(call_b.call_id))
        return [n for n in out if n]

    def partner(self, call_a: ModuleCall) -> ModuleCall | None:
        cid = self.by_key_b.get(self.keys_a[call_a.call_id])
        return None if cid is None else self.b.calls[cid]

    def unmatched(self) -> dict:
        hidden = [sum(1 for k in keys if k[0].startswith("\0hidden")) for keys in (self.by_key_a, self.by_key_b)]
        return {"a": len(self.by_key_a) - len(self.common) - hidden[0],
                "b": len(self.by_key_b) - len(self.common) - hidden[1]}


_NONE = object()

# Ops that allocate without initializing: their outputs' bytes are whatever the allocator handed out, so they
# carry no value to compare (vLLM allocates every linear's and the attention's output this way, then a custom op
# writes into it). Views of such a buffer taken before anything wrote into it are as undefined.
_UNINITIALIZED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_ALIASING = {"view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "t", "permute", "expand",
             "unsqueeze", "squeeze", "select", "slice", "as_strided", "alias", "detach", "split", "split_with_sizes",
             "chunk", "unbind", "narrow", "flatten", "view_as", "expand_as", "movedim", "diagonal"}


def uninitialized_values(t: Trace) -> set[int]:
    """Value ids of `t` whose bytes are undefined: outputs of allocations that do not initialize, and views of
    them made before a write (a write makes a new value id, so later views are not in the set)."""
    base = getattr(t, "trace", t)  # a token view (divtrace.align.tokens) reads its trace's records
    got = _UNDEFINED_CACHE.get(id(base))
    if got is not None and got[0]() is base:
        return got[1]
    out: set[int] = set()
    rop, rin, rout = getattr(base, "rop", None), getattr(base, "rin", None), getattr(base, "rout", None)
    if rop is None or rin is None or rout is None:
        return out
    kinds: dict = {}  # op name -> 1 allocates, 2 aliases, 0 neither (a trace has few distinct op names)
    for op, ins, outs in zip(rop, rin, rout):
        if op is None or ins is None:
            continue
        kind = kinds.get(op)
        if kind is None:
            parts = op.split(".")
            name = parts[1] if len(parts) > 1 else op
            kind = kinds[op] = 1 if name in _UNINITIALIZED else 2 if name in _ALIASING else 0
        if kind == 1 or (kind == 2 and out and ins and all(v in out for v in ins)):
            out.update(outs)
    try:
        _UNDEFINED_CACHE[id(base)] = (weakref.ref(base), out)
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return out


# id(trace) -> (weak reference to it, its uninitialized values): a token-aligned bisect builds a comparator per
# token and per root call pair, and each asked again over the whole trace (610 scans of 200k records: 56 s)
_UNDEFINED_CACHE: dict = {}


class ValueComparator:
    """Decides whether a value of A equals a value of B. Bitwise (fingerprints: dtype, shape, 128-bit hash of
    the raw bytes, from each trace's compact index `vkey`) unless a tolerance is asked for; tolerances need the
    bytes, so they load lazily (and import torch).

    `compared` counts the distinct (va, vb) pairs judged, `bitwise_differs` those that differ bitwise. Bitwise
    judgements are not memoized (comparing two keys is as cheap as looking one up); the pairs seen are kept
    as va -> vb, so counting allocates nothing per pair."""

    def __init__(self, a: Trace, b: Trace, tol: Tolerance | None = None):
        self.a, self.b = a, b
        self.tol = tol if tol is not None and tol.active() else None
        self.compared = 0
        self.bitwise_differs = 0
        self._diffs: dict[tuple[int, int], TensorDiff | None] = {}
        self._same: dict[tuple[int, int], bool] = {}  # with a tolerance: every judgement
        self._seen: dict[int, int] = {}  # bitwise: va -> the first vb it was compared with
        self._seen_more: set[tuple[int, int]] = set()  # bitwise: pairs whose va was seen with another vb
        self._ka, self._kb = a.vkey, b.vkey
        # A view's derived fingerprint that differs from the other side's is settled from the bytes where the
        # trace holding it is full mode (the other side may have made the same bytes another way).
        self._full_a, self._full_b = a.mode == "full", b.mode == "full"
        self._views = bool((self._full_a and a.vderived) or (self._full_b and b.vderived))
        self._undef_a, self._undef_b = uninitialized_values(a), uninitialized_values(b)
        self._undef = bool(self._undef_a and self._undef_b)

    def _view_equal(self, va: int, vb: int) -> bool:
        """Fingerprints differ: whether the bytes are equal all the same (a derived view's, rebuilt in full mode;
        a derived view in a hash-mode trace cannot be settled and stays unequal)."""
        if not self._views:
            return False
        ka, kb = self._ka[va], self._kb[vb]
        da, db = va in self.a.vderived, vb in self.b.vderived
        return ((da or db) and (self._full_a or not da) and (self._full_b or not db)
                and ka[0] == kb[0] and ka[1] == kb[1] and self.a.real_key(va) == self.b.real_key(vb))

    def _both_undefined(self, va: int, vb: int) -> bool:
        """Two uninitialized buffers of one dtype and shape: nothing to compare (their garbage may differ)."""
        return (self._undef and va in self._undef_a and vb in self._undef_b
                and self._ka[va][:2] == self._kb[vb][:2])

    @property
    def values_available(self) -> bool:
        return self.a.mode == "full" and self.b.mode == "full"

    def same(self, va: int, vb: int) -> bool:
        if self.tol is None:
            equal = self._ka[va] == self._kb[vb] or self._view_equal(va, vb) or self._both_undefined(va, vb)
            if self._new_pair(va, vb):
                self.compared += 1
                self.bitwise_differs += not equal
            return equal
        key = (va, vb)
        hit = self._same.get(key)
        return hit if hit is not None else self._judge(key)

    def _new_pair(self, va: int, vb: int) -> bool:
        """Bitwise mode: note the pair (va, vb) as compared; whether it was not before."""
        prev = self._seen.get(va, _NONE)
        if prev is _NONE:
            self._seen[va] = vb
            return True
        if prev == vb or (va, vb) in self._seen_more:
            return False
        self._seen_more.add((va, vb))
        return True

    def _judge(self, key: tuple[int, int]) -> bool:
        """With a tolerance: compare a pair not seen before (each distinct pair counts once in `compared`)."""
        va, vb = key
        self.compared += 1
        bitwise = self._ka[va] == self._kb[vb] or self._view_equal(va, vb) or self._both_undefined(va, vb)
        result = bitwise
        if not bitwise:
            self.bitwise_differs += 1
            d = self.diff(va, vb)
            result = bool(d is not None and d.matches())
        self._same[key] = result
        return result

    def first_unequal(self, pairs) -> tuple[int, int] | None:
        """The first (va, vb) of `pairs` (an iterable of 2-tuples) that `same` says differ, or None."""
        if self.tol is not None:
            return next(((va, vb) for va, vb in pairs if not self.same(va, vb)), None)
        ka, kb, seen, views = self._ka, self._kb, self._seen, self._views
        new = 0
        try:
            for va, vb in pairs:  # same(), inlined: this loop sees every op output of the run
                equal = ka[va] == kb[vb] or (views and self._view_equal(va, vb)) or self._both_undefined(va, vb)
                prev = seen.get(va, _NONE)
                if prev is _NONE:
                    seen[va] = vb
                    new += 1
                elif prev != vb and self._new_pair(va, vb):
                    new += 1
                else:
                    if not equal:
                        return va, vb
                    continue
                if not equal:
                    self.bitwise_differs += 1
                    return va, vb
            return None
        finally:
            self.compared += new

    def diff(self, va: int, vb: int) -> TensorDiff | None:
        """Value metrics, or None when either side holds only fingerprints."""
        key = (va, vb)
        if key not in self._diffs:
            if self.a.has_bytes(va) and self.b.has_bytes(vb):
                from divtrace.compare.metrics import compare_tensors

                self._diffs[key] = compare_tensors(self.a.tensor(va), self.b.tensor(vb), self.tol)
            else:
                self._diffs[key] = None
        return self._diffs[key]

    def pairs(self, items_a: list[tuple[str, int]], items_b: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
        """Tensors of two input/output lists paired by key; by position when the keys share nothing (one
        side passes `hidden_states=` by keyword, the other positionally). A key with a tensor on one side only
        (a mask one implementation builds and the other does not) is not compared."""
        db = dict(items_b)
        common = [(k, va, db[k]) for k, va in items_a if k in db]
        if common or not items_a or not items_b:
            return common
        return [(ka, va, vb) for (ka, va), (_, vb) in zip(items_a, items_b)]

    def first_mismatch(self, items_a, items_b):
        """(key, va, vb) of the first paired tensors that differ, or None."""
        if len(items_a) == 1 and len(items_b) == 1:  # the usual single tensor: pairs() gives a's key and both
            (k, va), (_, vb) = items_a[0], items_b[0]
            return None if self.same(va, vb) else (k, va, vb)
        for k, va, vb in self.pairs(items_a, items_b):
            if not self.same(va, vb):
                return k, va, vb
        return None
