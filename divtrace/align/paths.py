"""Path maps: how the module paths of one stack name the modules of another (`--map FILE`, the built-in maps in
divtrace/maps, such as `vllm-hf`), with structural rules that hide, split or re-key calls so fused modules compare
with separate ones.

In: a map (YAML) and the calls of a trace. Out: the trace's calls rewritten in place and mapped paths, which call
pairing (calls.py) keys calls by.
"""
from __future__ import annotations

import re
from pathlib import Path

from divtrace.errors import DivtraceError


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
            if not isinstance(repl, str):
                # (a number or a null was taken as its text: `'^model\.': 12` renamed every model.* call to "12...")
                hint = ("a map per side has only the keys a:, b: and rules:" if isinstance(repl, (dict, list)) else
                        "quote it; '' deletes what the regex matches")
                raise DivtraceError(f"--map: the replacement for {pat!r} (side {side}) is not a string: {repl!r} "
                                    f"({hint})"[:300])
            try:
                out.append((re.compile(str(pat)), repl))
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
