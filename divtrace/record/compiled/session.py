"""What a recording does about torch.compile: record inside compiled code (compiled=True), or make sure compiled
code does not run unseen (compiled=False), and say in the trace which it was.

compiled=True: every recorded module gets a forward pre hook and a forward hook that, while torch.compile traces
them, put a tap (divtrace.record.compiled.taps) into the graph, and when they run eagerly record directly. Hooks added
to an already compiled model never run inside its compiled code (Dynamo does not guard on them), so the session
drops Dynamo's compiled code (torch._dynamo.reset()) when it starts, and again when it ends: the model recompiles
with the taps on its next call inside the block, and without them on its first call after. The dispatch mode is
not used: it would make Dynamo skip the compiled code and run the model eagerly.

compiled=False on a model with compiled parts: the block runs under torch.compiler.set_stance("force_eager"), so
the eager code that is recorded is the code that runs (the trace says so).

Either way, compiled code that runs inside the block without divtrace seeing into it (a torch.compile'd copy of the
model that is not the one recorded; a compiled region inside which no module call was seen) is listed in the
trace's meta.json under "unseen", which makes a comparison inconclusive rather than identical.
"""
from __future__ import annotations

import itertools
import sys
import time

from divtrace.record.compiled import taps
from divtrace.record.compiled.paths import compiled_regions
from divtrace.errors import DivtraceError

_SIDS = itertools.count(1)
GRANULARITY_COMPILED = "modules (inside compiled code, at module boundaries; no ops: the compiled kernels fuse them)"


def resolve(model, compiled, ops) -> tuple[bool, bool, list[dict]]:
    """(compiled, ops, regions) for a record() call. compiled=None: compiled recording when part of the model is
    torch.compile'd and ops were not asked for; ops=None: True unless recording compiled code."""
    if compiled not in (None, True, False):
        raise DivtraceError(f"compiled must be True, False or None (automatic), got {compiled!r}")
    if ops not in (None, True, False):
        raise DivtraceError(f"ops must be True or False, got {ops!r}")
    regions = compiled_regions(model)
    if compiled is True and not regions:
        # Nothing compiled would run: the trace would hold eager code labelled compiled.
        raise DivtraceError("compiled=True (--compiled), but no module of the model is torch.compile'd, so only eager "
                            "code would run; compile it first (torch.compile(model) or model.compile(), returned by "
                            "the ENTRY), or record without --compiled")
    if compiled is None:
        compiled = bool(regions) and ops is not True
    if compiled and ops:
        raise DivtraceError("ops=True cannot be recorded inside compiled code (Inductor fuses the aten ops into kernels "
                            "divtrace cannot see into); use ops=False to record the compiled module boundaries, or "
                            "compiled=False to record the eager code op by op")
    return compiled, (not compiled) if ops is None else ops, regions


class CompiledSession:
    """One recording's dealings with torch.compile (see the module docstring)."""

    def __init__(self, recorder, modules: list, regions: list[dict], compiled: bool):
        self.rec = recorder
        self.modules = dict(modules)
        self.regions = regions
        self.compiled = compiled
        self.sid = next(_SIDS)
        self.handles: list = []
        self.hits = 0  # compiled code entered (a guard check that passed) while recording
        self.taps_run = 0
        self.graph_taps = 0  # taps that ran from compiled code (the rest ran eagerly, between graphs)
        self.kernels: dict = {}  # path -> {output key: kernel info}, from the generated code (kernels.py)
        self._prev_hook = None
        self._hooked_guards = False
        self._stance = None
        self._dynamo = None
        self._before: dict = {}
        self._t_first: float | None = None
        self._skip_hook_guards = True
        self._left: dict = {}  # layout -> alias of a tapped value that left its graph unchanged (_settle)
        self._runs: dict = {}  # generated file -> [last tap line, {token: tensor handed over}]

    # -- meta -----------------------------------------------------------------------------------------------
    def settings(self) -> dict:
        """Settings keys this recording overrides: the Inductor options the compiled model was given (mode=,
        options=) and which compiler ran (None: eager)."""
        from divtrace.record.settings import inductor_settings

        if not self.compiled:
            return {"torch_compile": None}
        backends = sorted({str(r.get("backend")) for r in self.regions}) or ["inductor"]
        options: dict = {}
        for r in self.regions:
            options.update(r.get("options") or {})
        return {"torch_compile": ",".join(backends), **inductor_settings(options)}

    def start_meta(self) -> dict:
        return {"compiled": {"recorded": "compiled" if self.compiled else "eager",
                             "regions": [{k: _jsonable(v) for k, v in r.items()} for r in self.regions]},
                "granularity": GRANULARITY_COMPILED if self.compiled else
                ("modules and aten ops" if self.rec.ops else "modules")}

    # -- start / stop ---------------------------------------------------------------------------------------
    def start(self) -> None:
        if "torch._dynamo" in sys.modules or self.compiled:
            import torch._dynamo  # noqa: F401  (compiled=True needs it anyway)

            self._dynamo = sys.modules["torch._dynamo"]
        if self.compiled:
            taps.tap_op()
            taps.SESSIONS[self.sid] = self
            self._install_hooks()
            # Dynamo does not guard on module hooks by default: a graph compiled for another instance of the same
            # class (no hooks, so no taps) was reused for the recorded model, which then ran with no tap.
            cfg = self._dynamo.config
            self._skip_hook_guards = cfg.skip_nnmodule_hook_guards
            cfg.skip_nnmodule_hook_guards = False
            self._dynamo.reset()
        if self._dynamo is not None:
            from torch._dynamo.utils import counters  # (after the reset, which clears some of them)

            self._before = {"graph_break": dict(counters["graph_break"]),
                            "unique_graphs": counters["stats"].get("unique_graphs", 0),
                            "compile_s": _compile_seconds()}
            self._install_guard_hook()
        if not self.compiled and self.regions:
            import torch

            self._stance = torch.compiler.set_stance("force_eager")

    def stop(self) -> dict:
        """Undo what start() did; the meta keys to write at close ("compiled" details, "unseen")."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        taps.SESSIONS.pop(self.sid, None)
        self._runs.clear()
        self._left.clear()
        if self._stance is not None:
            self._stance.__exit__(None, None, None)
            self._stance = None
        self._remove_guard_hook()
        info = self.start_meta()["compiled"]
        unseen: list[str] = []
        if self._dynamo is not None:
            from torch._dynamo.utils import counters

            breaks = {k: v - self._before["graph_break"].get(k, 0) for k, v in counters["graph_break"].items()
                      if v - self._before["graph_break"].get(k, 0) > 0}
            info["graph_breaks"] = [{"reason": k[:300], "count": v, "in_divtrace_tap": "divtrace" in k}
                                    for k, v in breaks.items()]
            info["graphs_compiled"] = counters["stats"].get("unique_graphs", 0) - self._before["unique_graphs"]
            info["compile_seconds"] = round(_compile_seconds() - self._before["compile_s"], 3)
        if self.compiled:
            self._dynamo.config.skip_nnmodule_hook_guards = self._skip_hook_guards
            self._dynamo.reset()  # the taps stay in the compiled code until it is dropped
            info["taps_run"] = self.taps_run
            info["kernels"] = self.kernels
            info["notes"] = self._notes()
            if self.taps_run and not self.graph_taps:
                return {"compiled": info, "unseen": self._regions_without_calls(), **self._ran_eagerly(info)}
        else:
            if self.regions:
                info["notes"] = ["compiled=False: torch.compile was set to force_eager inside the block, so the "
                                 "recorded eager code is what ran"]
            if self.hits:
                unseen.append(f"compiled code ran {self.hits} time(s) inside the block without divtrace seeing into "
                              "it (code torch.compile'd before recording, not the recorded model: e.g. "
                              "torch.compile(model) called while `model` was recorded); record the compiled module "
                              "with compiled=True")
        unseen += self._regions_without_calls()
        return {"compiled": info, "unseen": unseen}

    def _ran_eagerly(self, info: dict) -> dict:
        """compiled=True, yet no tap ran from compiled code: what was recorded is eager code (Dynamo disabled, a
        force_eager stance, or only an uncompiled part of the model called). Say so; never label it compiled."""
        info["recorded"] = "eager"
        info["notes"] = ["compiled=True, but none of the model's compiled code ran inside the block (torch._dynamo "
                         "disabled, e.g. TORCHDYNAMO_DISABLE=1, or a force_eager stance): the module boundaries "
                         "recorded are of the eager code"]
        w = self.rec.warnings
        w[:] = [x for x in w if not x.startswith("the model is torch.compile'd: recorded at module boundaries")]
        w.append("the model is torch.compile'd, but its compiled code did not run inside the block: this trace is "
                 "of the eager code, at module boundaries")
        settings = dict(self.rec.writer.meta.get("settings") or {}, torch_compile=None)
        return {"granularity": "modules", "settings": settings}

    def compile_failure(self, exc) -> str | None:
        """One line for an exception torch.compile raised inside a compiled=True block (compiling the model with
        the taps failed, or fullgraph=True met a graph break), with what works instead; None for anything else."""
        if not self.compiled:
            return None
        mod = type(exc).__module__ or ""
        if not (mod.startswith("torch._dynamo") or mod.startswith("torch._inductor")):
            return None
        msg = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        return (f"compiling the model with divtrace's taps failed ({type(exc).__name__}: {msg}); record it eagerly "
                "with compiled=False (--no-compiled), or compile it without fullgraph=True if a tap broke the graph")

    def _notes(self) -> list[str]:
        notes = ["module inputs and outputs are the compiled code's values: each tapped value is the buffer "
                 "Inductor computed it into; aten ops inside compiled code are not visible"]
        low = any(str(getattr(p, "dtype", "")) in ("torch.float16", "torch.bfloat16")
                  for m in list(self.modules.values())[:1] for p in m.parameters())
        if low:
            notes.append("16-bit floats are handed to the taps as float32 copies stored back in their dtype, so a "
                         "tap does not make Inductor round a fused intermediate it keeps in float32; if the "
                         "recorded final output still differs from an unrecorded run's, a tap changed the fusion")
        if any((r.get("options") or {}).get("triton.cudagraphs") for r in self.regions) or \
                (self._dynamo is not None and _inductor_cfg("triton.cudagraphs")):
            notes.append("CUDA graphs: taps are cudagraph-unsafe, so Inductor ran the recorded graphs split around "
                         "them (or without CUDA graphs); replays were not recorded as such")
        return notes

    def _regions_without_calls(self) -> list[str]:
        """A compiled region that ran but inside which no module call was seen: its compiled code ran blind."""
        out = []
        calls = self.rec.calls.counts
        excl = self.rec.calls.exclude
        for r in self.regions:
            p = r["path"]
            n = calls.get(p, 0)
            if not n:
                continue
            prefix = p + "." if p else ""
            inner = [q for q in self.modules if q != p and q.startswith(prefix)
                     and not (excl is not None and excl.search(q))]
            if inner and not any(calls.get(q, 0) for q in inner):
                out.append(f"compiled region {p or '<root>'} ran {n} time(s) and no module call inside it was seen "
                           f"({len(inner)} submodules): its compiled code ran without divtrace's hooks")
        return out

    # -- guard hook: counts entries into compiled code ------------------------------------------------------
    def _install_guard_hook(self) -> None:
        try:
            from torch._C._dynamo.eval_frame import set_guard_complete_hook
        except ImportError:
            return
        prev_box = []

        def hook(result):
            if result:
                self.hits += 1
            p = prev_box[0] if prev_box else None
            return p(result) if p is not None else result

        prev = set_guard_complete_hook(hook)
        prev_box.append(prev)
        self._prev_hook, self._hooked_guards = prev, True

    def _remove_guard_hook(self) -> None:
        if self._hooked_guards:
            from torch._C._dynamo.eval_frame import set_guard_complete_hook

            set_guard_complete_hook(self._prev_hook)
            self._hooked_guards = False

    # -- taps -----------------------------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        op = taps.tap_op()
        flatten = taps.flatten
        hand_over = taps.hand_over
        sid = self.sid
        import torch

        compiling = torch.compiler.is_compiling

        for path, m in self.modules.items():
            def pre(module, args, kwargs, path=path):
                flat = flatten(args, "args", []) + flatten(kwargs, "kwargs", [])
                if compiling():
                    op(taps.CLOCK, *hand_over(flat), sid, path, "enter")
                else:
                    self.on_tap(path, "enter", flat)

            def post(module, args, kwargs, output, path=path):
                flat = flatten(output, "out", [])
                if compiling():
                    op(taps.CLOCK, *hand_over(flat), sid, path, "exit")
                else:
                    self.on_tap(path, "exit", flat)

            post_h = m.register_forward_hook(post, with_kwargs=True, always_call=True)
            pre_h = m.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
            self.handles += (pre_h, post_h)

    def _settle(self, alias) -> None:
        """`alias` (a tapped tensor's fresh alias) leaves its graph with the bytes it was tapped with. If the very
        next tap runs in another graph that gets the same memory, in the same layout, as an input it has not
        written (a hook of the root module compiled as a graph of its own gets the logits the lm_head's exit tap
        handed over), it is handed this alias and the bytes are not hashed again. Only Python glue runs between
        two consecutive taps; eager code writing the bytes there moves the version counter the alias shares
        (then they are hashed anew), and the alias keeps the memory alive, so it cannot be another tensor's."""
        self._left[_layout(alias)] = alias

    def on_tap(self, path: str, event: str, flat: list, in_graph: bool = False) -> None:
        """A tap ran: record the module's enter or exit. `in_graph`: it ran from compiled code.

        Compiled code writes its buffers without moving torch's version counters (a kernel may even write the
        result in place of its input), so inside compiled code the tensor object a tap gets says nothing about
        its bytes: each is handed to the recorder as a fresh alias (hashed anew), except where the generated
        code shows an earlier tap of the same run of the graph handed over the same bytes (kernels.site_info's
        tokens: the same argument, no write in between). That one is handed over as the object the recorder
        got then, so it is not hashed again (a module's output is the next module's input)."""
        from divtrace.record.compiled.kernels import producer_kernels, site_info, tap_site

        self.taps_run += 1
        self.graph_taps += in_graph
        module = self.modules.get(path)
        if module is None:
            return
        site = tap_site(sys._getframe(1)) if in_graph else None
        info = site_info(site)
        if info is not None and len(info[1]) == len(flat):
            file, line = site
            state = self._runs.get(file)
            if state is None or line <= state[0]:  # the graph's code runs straight through: a new run of it
                state = self._runs[file] = [line, {}]
            state[0] = line
            held = state[1]
            settled = info[3] if len(info[3]) == len(flat) else [False] * len(flat)
            left, self._left = self._left, {}  # only the tap right before may hand a value on (_settle)
            for i, tok in enumerate(info[1]):
                key, x = flat[i]
                prev = held.get(tok) if tok is not None else None
                if prev is None and tok is not None and tok[1].startswith("arg") and tok[2] == 0 and left:
                    prev = _left_graph(left, x)  # a graph input unwritten so far: what the tap before left
                if prev is not None and prev.shape == x.shape and prev.dtype == x.dtype:
                    flat[i] = (key, prev)
                else:
                    flat[i] = (key, x.detach())
                    if tok is not None:
                        held[tok] = flat[i][1]
                    if settled[i]:
                        self._settle(flat[i][1])
        elif in_graph:
            flat = [(k, x.detach()) for k, x in flat]
            self._left = {}
        else:
            self._left = {}
        if event == "enter":
            self.rec.calls.tap_enter(path, module, flat)
        else:
            if path not in self.kernels and len(self.kernels) < 10000:
                k = producer_kernels(info, [k for k, _ in flat])
                if k is not None:
                    self.kernels[path] = k
            self.rec.calls.tap_exit(module, flat)
        if info is not None and site is not None and site[0] in self._runs:
            held = self._runs[site[0]][1]
            for tok in info[2]:  # no later tap of this run hands it over: let the buffer go
                held.pop(tok, None)


def _layout(x) -> tuple:
    return (x.data_ptr(), x.dtype, tuple(x.shape), tuple(x.stride()), x.device)


def _left_graph(left: dict, x):
    a = left.get(_layout(x)) if left else None
    try:
        return a if a is not None and a._version == x._version else None
    except RuntimeError:  # inference tensors have no version counter: no sharing
        return None


def _compile_seconds() -> float:
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return 0.0
    return sum(compilation_time_metrics.get("_compile.compile_inner", []))


def _inductor_cfg(attr: str):
    cfg = sys.modules.get("torch._inductor.config")
    obj = cfg
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    return obj


def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)[:200]
