"""Module hooks: the call tree of a recorded run (path, call number, inputs, outputs), one record per call edge.

Module forward pre/post hooks (or, inside torch.compile'd code, the compiled session's taps: `tap_enter`,
`tap_exit`) open and close a frame per module call; `include`/`exclude` decide which calls are recorded. The
pre hook goes first and the post hook last, so a call spans the module's own hooks: its inputs are what the
caller passed, its outputs what the caller receives.

Defined behaviour at the edges:
- A module call that raises gets an exit record with `error` and no outputs (the post hook is `always_call`;
  torch runs it for Exceptions). A later call of the root (the user caught an interrupt) first drops the stale
  open calls an interrupt left.
- Module calls inside backward (activation checkpointing's recompute) are not recorded: they would shift the
  call numbers of every later forward against a run without checkpointing.

In: the model's module calls. Out: ModuleEnter/ModuleExit records with their inputs' and outputs' value ids
(values) to the trace writer; root calls begun and ended for token rows (token_rows); the record index, which op
records (op_records) share.
"""
from __future__ import annotations

import itertools
import re
import sys

import torch

from divtrace.errors import DivtraceError
from divtrace.record.lifecycle import BUSY as _BUSY
from divtrace.record.lifecycle import busy as _busy
from divtrace.record.lifecycle import owners as _owners
from divtrace.record.settings import note_grad_mode
from divtrace.record.values import flatten_tensors
from divtrace.trace.records import ModuleEnter, ModuleExit

_POSITION_NAMES = ("position_ids", "positions")  # the positions a model uses, as its submodules get them
_POSITION_KEYS = tuple(f"kwargs.{n}" for n in _POSITION_NAMES)
_POSITIONAL: dict = {}  # forward function -> the flat keys ("args.N") of its parameters named as positions
# -1 outside backward. Module calls inside backward are activation checkpointing's recompute: recorded, they
# would shift the call numbers of every later forward against a run without checkpointing.
_GRAPH_TASK = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_SEQ = itertools.count()


def _position_args(module) -> tuple:
    """The flat keys of `module.forward`'s parameters named `position_ids`/`positions` where they are passed by
    position (vLLM's `self.model(input_ids, positions, ...)`, a decoder layer's `layer(positions, hidden, ...)`):
    ("args.1",) for `forward(self, input_ids, positions)`. Cached per forward function."""
    fwd = getattr(module, "forward", None)
    fn = getattr(fwd, "__func__", fwd)
    got = _POSITIONAL.get(fn)
    if got is None:
        import inspect

        try:
            params = list(inspect.signature(fwd).parameters.values())
        except (TypeError, ValueError):
            params = []
        got = []
        for i, prm in enumerate(params):
            if prm.kind not in (prm.POSITIONAL_ONLY, prm.POSITIONAL_OR_KEYWORD):
                break
            if prm.name in _POSITION_NAMES:
                got.append(f"args.{i}")
        got = _POSITIONAL[fn] = tuple(got)
    return got


def compile_filters(include, exclude):
    """(include, exclude) as compiled regexes (None where not given); DivtraceError for a bad one."""
    try:
        return (re.compile(include) if include else None), (re.compile(exclude) if exclude else None)
    except re.error as e:
        raise DivtraceError(f"bad include/exclude regex: {e}") from None


class _Frame:
    """One module call on the recorder's stack."""

    __slots__ = ("call_id", "module", "excluded", "exc", "token")

    def __init__(self, call_id, module, excluded, exc, token):
        self.call_id, self.module, self.excluded, self.exc, self.token = call_id, module, excluded, exc, token


class ModuleCalls:
    """The module calls of one recording: hooks, the stack of open calls, their enter and exit records."""

    def __init__(self, model, include, exclude, stack: list, values, tokens, warnings_out: list):
        self.model = model
        self.include, self.exclude = include, exclude  # compiled regexes (compile_filters) or None
        self.stack: list[_Frame] = stack  # open calls, innermost last (token_rows reads it too)
        self._values = values
        self._plain, self._vid_of = values.plain, values.vid_of  # (bound once: called for every boundary tensor)
        self._tokens = tokens
        self.warnings = warnings_out
        self.writer = None  # the TraceWriter, from the start of the block
        self.root = None  # the recorded model's module (without torch.compile's wrapper), from the start
        self._handles: list = []
        self._hooked: list = []  # (path, module, pre hook id): checked at exit for pre hooks prepended since
        self.backward_calls = 0  # module calls skipped because they ran inside backward
        self._excluded_depth = 0
        self.counts: dict[str, int] = {}  # module path -> calls seen
        self.next_call_id = 0
        self._index = 0
        self._root_calls = 0  # calls of the recorded model seen (the first sets the grad-mode settings)
        self.placements = None  # a rank of a sharded run: the values' layouts (divtrace.record.placements)

    def hook(self, modules: list) -> None:
        """Hook every (path, module) of `modules` (the compiled session taps compiled models instead)."""
        for name, m in modules:
            # Pre hook first and post hook last: the call spans the module's own hooks, its inputs are what the
            # caller passed and its outputs what the caller receives.
            post = m.register_forward_hook(self._make_post(name), with_kwargs=True, always_call=True)
            pre = m.register_forward_pre_hook(self._make_pre(name, post.id), with_kwargs=True, prepend=True)
            self._handles += (pre, post)
            self._hooked.append((name, m, pre.id))

    def unhook(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def release_frames(self) -> None:
        """The block ends: this thread's innermost-call bookkeeping forgets the calls still open."""
        owners = _owners()
        for f in self.stack:
            if f.token in owners:
                owners.remove(f.token)

    def unfinished(self) -> int:
        """Recorded calls still open (an interrupt, or an exception, ended the block inside them)."""
        return sum(1 for f in self.stack if f.call_id is not None)

    def closing_warnings(self) -> None:
        """A pre hook prepended inside the block runs before divtrace's: the inputs recorded for that module
        are then not what its caller passed. Say so in the trace. (Forward hooks registered inside the block
        are moved behind divtrace's at each call, so they cannot do the same to outputs.)"""
        late = []
        for name, m, pre in self._hooked:
            try:
                moved = next(iter(m._forward_pre_hooks)) != pre
            except (AttributeError, StopIteration, TypeError):  # another torch's private layout: cannot tell
                moved = False
            if moved:
                late.append(name or "<root>")
        self._hooked.clear()
        if self.backward_calls:
            self.warnings.append(f"{self.backward_calls} module calls ran inside backward (activation "
                                 "checkpointing's recompute) and were not recorded")
        if late:
            self.warnings.append(
                f"forward pre hooks were prepended on {len(late)} module(s) while recording "
                f"({', '.join(late[:5])}" + (", ..." if len(late) > 5 else "") + "): they ran before divtrace's, "
                "so the inputs recorded there may differ from what the caller passed; register hooks before "
                "divtrace.record")

    def _make_pre(self, path: str, post_id: int):
        def pre(module, args, kwargs):
            if _busy() or self.writer.failed:
                return None
            # A forward hook registered since (a temperature on the logits; transformers' output capture)
            # would run after the post hook: moved last again, the recorded outputs are what the caller gets.
            try:
                hooks = module._forward_hooks
                if next(reversed(hooks)) != post_id:
                    hooks.move_to_end(post_id)
            except (AttributeError, StopIteration, KeyError, TypeError):  # another torch's private layout
                pass
            if _GRAPH_TASK() != -1:
                self.backward_calls += 1  # its post hook finds no frame and returns
                return None
            with _BUSY:
                self.enter(path, module, args, kwargs)
            return None
        return pre

    def _make_post(self, path: str):
        def post(module, args, kwargs, output):
            if _busy() or self.writer.failed:
                return None
            with _BUSY:
                self.exit(module, output)
            return None
        return post

    def _recorded_parent(self):
        for f in reversed(self.stack):
            if f.call_id is not None:
                return f.call_id
        return None

    def _push(self, call_id, module, excluded):
        token = (next(_SEQ), self)
        _owners().append(token)
        self.stack.append(_Frame(call_id, module, excluded, sys.exc_info()[1], token))

    def tap_enter(self, path, module, flat) -> None:
        """A module call seen by a compiled-code tap (divtrace.record.compiled): `flat` is its inputs' (key, tensor)."""
        if not _busy() and not self.writer.failed:
            with _BUSY:
                self.enter(path, module, None, None, flat)

    def tap_exit(self, module, flat) -> None:
        if not _busy() and not self.writer.failed:
            with _BUSY:
                self.exit(module, None, flat)

    def enter(self, path, module, args, kwargs, flat=None):
        if module is self.root:
            note_grad_mode(self.writer.meta.setdefault("settings", {}), first=not self._root_calls)
            self._root_calls += 1
        if module is self.root and self.stack:
            # A new call of the root while calls are open: they were left by an interrupt the caller caught.
            while self.stack:
                self._pop()
        inside_recorded = bool(self.stack) and self.stack[-1].call_id is not None
        if self.exclude is not None and self.exclude.search(path):
            self._excluded_depth += 1
            self._push(None, module, True)
            return
        if self._excluded_depth or (self.include is not None and not inside_recorded
                                    and not self.include.search(path)):
            self._push(None, module, False)
            return
        call = self.counts.get(path, 0)
        if module is self.root and self._tokens.on and args is not None:  # (compiled taps: no token rows)
            # (before the call is counted: a declaration that does not fit the call is the caller's error)
            self._tokens.begin_root_call(self.next_call_id, call, args, kwargs,
                                         f"root call {call} of {type(module).__name__}")
        self.counts[path] = call + 1
        call_id = self.next_call_id
        self.next_call_id += 1
        values: list = []
        pairs = []
        tokens = self._tokens
        if tokens.layouts_override:
            tokens.call_paths[call_id] = tokens.boundary_path = path
        try:
            if flat is None:
                flat = flatten_tensors(args, "args", []) + flatten_tensors(kwargs, "kwargs", [])
            pl = self.placements
            for key, t0 in flat:
                t = self._plain(t0, path or "<root>")
                if t is not None:
                    if pl is not None:
                        pl.before_value(t0, t, module, "in", key)
                    vid = self._vid_of(t, values, boundary=True)
                    if pl is not None:
                        pl.after_value(t, vid)
                    pairs.append((key, vid))
                    if tokens.grid is not None and not tokens.positions_seen and module is not self.root \
                            and (key in _POSITION_KEYS or (key.startswith("args.") and key in _position_args(module))):
                        tokens.observe_positions(t)
        finally:
            tokens.boundary_path = None
        rec = ModuleEnter(self.take_index(), call_id, path, call, self._recorded_parent(), pairs)
        self._push(call_id, module, False)
        self.writer.append(rec, values)

    def exit(self, module, output, flat=None):
        stack = self.stack
        if stack and stack[-1].module is module:  # (the usual case: the innermost call ends)
            depth = len(stack) - 1
        else:
            depth = next((i for i in range(len(stack) - 1, -1, -1) if stack[i].module is module), None)
        if depth is None:
            return  # its pre hook did not run (the call began before recording, or while busy)
        # Pop to this module's frame: calls that raised inside and were caught left theirs.
        while len(self.stack) > depth + 1:
            self._pop()
        frame = self._pop()
        if frame.call_id is None:
            return
        root = module is self.root and self._tokens.grid is not None
        try:
            self._write_exit(frame, output, root, flat)
        finally:
            if root:
                self._tokens.end_root_call()

    def _write_exit(self, frame, output, root: bool, flat=None) -> None:
        current = sys.exc_info()[1]
        if current is not None and current is not frame.exc:
            # torch runs always_call hooks from its `except Exception:`: the forward raised.
            err = f"{type(current).__name__}: {current}".splitlines()[0][:300] if str(current) else type(current).__name__
            self.writer.append(ModuleExit(self.take_index(), frame.call_id, [], error=err), [])
            return
        values: list = []
        pairs = []
        tokens = self._tokens
        if tokens.layouts_override:
            tokens.boundary_path = tokens.call_paths.get(frame.call_id, "")
        try:
            pl = self.placements
            for key, t0 in (flatten_tensors(output, "out", []) if flat is None else flat):
                t = self._plain(t0, "output")
                if t is not None:
                    if pl is not None:
                        pl.before_value(t0, t, frame.module, "out", key)
                    vid = self._vid_of(t, values, boundary=True, root_output=root)
                    if pl is not None:
                        if vid in tokens.deferred:  # (a declared output: its rows as its layout's partials)
                            tokens.declared_rows(vid, t)
                        pl.after_value(t, vid)
                    if root and (vid not in tokens.rowed or vid in tokens.unrowed):
                        # made by an op before it was known to be the output (the logits of generate's prefill,
                        # [B, 1, V], fit no layout inside lm_head and the last-cells layout at the root's exit)
                        tokens.rows(vid, t, root_output=True)
                    pairs.append((key, vid))
        finally:
            tokens.boundary_path = None
        self.writer.append(ModuleExit(self.take_index(), frame.call_id, pairs), values)

    def pseudo_call(self, path: str, grid_for, t: torch.Tensor, key: str) -> None:
        """A call of no module, recorded after the model's root calls: `t` as its one output under `key`, with
        the token grid `grid_for(call id, call number)` (rec.final's declared final values)."""
        if self.writer is None or self.writer.failed:
            return
        with _BUSY:
            call = self.counts.get(path, 0)
            call_id = self.next_call_id
            tokens = self._tokens
            grid = grid_for(call_id, call) if tokens.on else None
            if call == 0:  # meta.json's module tree names every module path the records call
                self.writer.meta.setdefault("module_tree", []).append([path, "declared final values"])
            self.counts[path] = call + 1
            self.next_call_id += 1
            self.writer.append(ModuleEnter(self.take_index(), call_id, path, call, None, []), [])
            if grid is not None:
                tokens.grid = grid
                tokens.store.add_grid(grid)
            try:
                values: list = []
                t = self._plain(t, path)
                pairs = []
                if t is not None:
                    vid = self._vid_of(t, values, boundary=True)
                    # a value met before (the model's output) gets rows for this grid, unless it has some already
                    # (an engine's decode step, whose output rows are its tokens: bisect reads those)
                    if grid is not None and vid not in tokens.rowed and vid not in tokens.store.rowed:
                        tokens.rows(vid, t)
                    pairs.append((key, vid))
                self.writer.append(ModuleExit(self.take_index(), call_id, pairs), values)
            finally:
                if grid is not None:
                    tokens.grid = None
                    tokens.rowed.clear()
                    tokens.unrowed.clear()
                    tokens.store.end_call()

    def _pop(self) -> _Frame:
        frame = self.stack.pop()
        if frame.excluded:
            self._excluded_depth -= 1
        owners = _owners()
        if owners and owners[-1] is frame.token:
            owners.pop()
        elif frame.token in owners:
            owners.remove(frame.token)
        return frame

    def take_index(self) -> int:
        i = self._index
        self._index += 1
        return i
