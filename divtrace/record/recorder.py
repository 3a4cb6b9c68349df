"""`Recorder`: the `with divtrace.record(model, path):` block, a coordinator over one part per job.

- module_calls.ModuleCalls: module hooks, the call tree, enter and exit records;
- op_records.OpRecorder: the dispatch mode and op records (ops=True);
- values.ValueIdentity: value ids, versions and fingerprints of every tensor met;
- token_rows.TokenRows: token identity of root calls and the row fingerprints of their values;
- lifecycle: signals, the per-thread state recorders share, and how the block ends;
- compiled.session.CompiledSession: what the recording does about torch.compile.

The Recorder starts and ends the block: it writes meta.json's start (settings, environment, module tree), opens
the trace writer, wires the parts to it, hooks the model, pushes the dispatch mode and installs the signal
handlers; at exit it undoes them in reverse and closes the trace with its status. Engine adapters
(divtrace/record/engines) subclass it.

Defined behaviour at the edges (the parts' docstrings say more):
- A KeyboardInterrupt or SIGTERM ends the block: its calls stay open, the trace is marked
  "interrupted"/"terminated" and `unfinished_calls` says how many.
- Tensor subclasses: DTensor-like ones (`to_local`) are recorded through their local tensor; others, sparse,
  meta, quantized and nested tensors are skipped with a warning kept in meta.json.
- Inference tensors have no version counter, so in-place writes to them are tracked from op schemas (ops=True)
  or detected by re-fingerprinting (ops=False).
"""
from __future__ import annotations

import gc

import torch

from divtrace.errors import DivtraceError
from divtrace.record.device import attach, wants_device_path
from divtrace.record.lifecycle import ACTIVE, ACTIVE_MODELS, STATE, SignalHandlers, closing_status
from divtrace.record.module_calls import ModuleCalls, compile_filters
from divtrace.record.op_records import OpRecorder
from divtrace.record.param_names import ParamNames
from divtrace.record.settings import numerics_settings, run_environment
from divtrace.record.token_rows import TokenRows
from divtrace.record.values import ValueIdentity
from divtrace.trace.derived_views import VIEW_KEY
from divtrace.trace.writer import TraceWriter
from divtrace.trace.layouts import LAYOUTS
from divtrace.trace.param_names import PARAMS, ParamNameWriter
from divtrace.trace.token_store import TOKEN_FILES


def freeze_gc() -> bool:
    """Leave the objects that exist when a block starts out of garbage collection until it ends (`gc.freeze`,
    undone by `gc.unfreeze` at its end), unless the process froze objects itself (a forking server such as vLLM
    does; a rank of a sharded run has done it already, record/ranks.py): True where it froze them. The values,
    records and lines a recording keeps until they are written survive the young generations, so Python's full
    collection ran about once every few recordings of a forward, walking the ~300k objects torch and
    transformers hold: ~170 ms each time (bench/bench_rank_ops.py, TP=1: 23 ms a recorded forward on average);
    frozen, a collection walks what the block made. Cyclic garbage of older objects waits for the block's end.
    (gc.get_freeze_count walks the frozen objects: cheap where none are, as here at the start of a block; a
    process that froze ~400k objects itself pays ~20-40 ms a block for the question.)"""
    if gc.get_freeze_count() or not gc.isenabled():
        return False
    gc.freeze()
    return True


class Recorder:
    """The context manager returned by `divtrace.record`."""

    calls_class = ModuleCalls  # an engine adapter's own module-call handling (divtrace/record/engines/vllm.py)

    def __init__(self, model, path, *, mode="full", ops=None, label=None, include=None, exclude=None,
                 overwrite=False, shard_bytes=128 << 20, extra_meta=None, flush_records=4096, durable=False,
                 tokens=True, token_layouts=None, compiled=None, layouts=None, mesh=None, params=None):
        if not isinstance(model, torch.nn.Module):
            raise DivtraceError(f"record() needs a torch.nn.Module (or a vllm.LLM), got {type(model).__name__}")
        if mode not in ("full", "hash"):
            raise DivtraceError(f"mode must be 'full' or 'hash', got {mode!r}")
        from divtrace.record.compiled.session import resolve  # torch.compile: divtrace/record/compiled, docs/compiled.md

        self.compiled, ops, self._regions = resolve(model, compiled, ops)
        if params not in (None, "read", "all", "blocks", "none"):
            raise DivtraceError(f"params must be 'all', 'blocks', 'read', 'none' or None, got {params!r}")
        from divtrace.record.ranks import current_rank, rank_path  # a rank of a sharded run: docs/sharded.md

        from divtrace.record.declared import declares_routed

        self.rank = current_rank(model, routed=declares_routed(layouts))
        self.placements = None
        if self.rank is not None:
            path = rank_path(path, self.rank)
        self.declared_layouts = None  # layouts of plain tensors the user declared (record/declared.py)
        ignored = False
        if layouts or mesh is not None:
            from divtrace.record.declared import Declared, check_outside

            if self.rank is not None:
                self.declared_layouts = Declared(model, layouts or {}, mesh, self.rank.rank)
            else:
                ignored = check_outside(layouts or {}, mesh)
        self._session = None
        self._froze_gc = False
        self.model, self.path, self.mode, self.ops, self.label = model, path, mode, ops, label
        include_re, exclude_re = compile_filters(include, exclude)
        self._include_src, self._exclude_src = include, exclude
        self._overwrite, self._shard_bytes, self._flush_records = overwrite, shard_bytes, flush_records
        self._durable = durable
        self._extra_meta = dict(extra_meta or {})
        self.warnings: list[str] = []
        if ignored:
            self.warnings.append("declared layouts ignored: not inside a torch.distributed process group")
        self.writer: TraceWriter | None = None
        self._signals = SignalHandlers()
        # The parts, one per job (see the module docstring); they share the stack of open module calls.
        stack: list = []
        self.token_rows = TokenRows(tokens, token_layouts, stack, self.warnings)
        self.values = ValueIdentity(mode, self.token_rows, self.warnings)
        # Parameter names (record/param_names.py); params=None: unread ones fingerprinted too where ops are
        # recorded (there a dense model's ops read every weight: nothing more is read; docs/performance.md)
        # "blocks": "all" and each whole weight's chunk partials too (one more read of each weight per chunk dim)
        self.param_names = ParamNames(unread=params in ("all", "blocks") or (params is None and bool(ops)),
                                      enabled=params != "none", chunks=params == "blocks")
        if params == "none":  # (said in meta.json: bisect says why no parameter is compared)
            self._extra_meta["params"] = "none"
        self.values.names = self.param_names
        self.calls = self.calls_class(model, include_re, exclude_re, stack, self.values, self.token_rows,
                                      self.warnings)
        self.op_records = OpRecorder(self.calls, self.values)

    @property
    def _calls(self) -> dict[str, int]:
        """Module path -> calls recorded so far (the ModuleCalls' counts)."""
        return self.calls.counts

    # context ----------------------------------------------------------------------------------------------
    def __enter__(self):
        if id(self.model) in ACTIVE_MODELS:
            raise DivtraceError("this model is already being recorded; nested record() on one model is not supported")
        first = next(self.model.parameters(), None)  # not list(): that walks every parameter of a big model
        device = str(first.device) if first is not None else "cpu"
        from divtrace.record.compiled.paths import recorded_modules
        from divtrace.record.compiled.session import CompiledSession

        modules = recorded_modules(self.model)  # torch.compile's `_orig_mod.` wrappers left out of the paths
        self.calls.root = modules[0][1]
        self.param_names.modules = modules
        self._session = CompiledSession(self, modules, self._regions, self.compiled)
        meta = {"label": self.label, "ops": self.ops, "include": self._include_src, "exclude": self._exclude_src,
                "model_class": type(self.model).__name__, "settings": numerics_settings(), "view_key": VIEW_KEY,
                "module_tree": [[name, type(m).__name__] for name, m in modules],
                **run_environment(device), **self._session.start_meta(), **self._extra_meta}
        if self.rank is not None:
            meta["dist"] = self.rank.meta()
        meta["settings"].update(self._session.settings())
        self.writer = TraceWriter(self.path, mode=self.mode, meta=meta, overwrite=self._overwrite,
                                  shard_bytes=self._shard_bytes, flush_records=self._flush_records,
                                  durable=self._durable,
                                  checksummed_files=(TOKEN_FILES if self.token_rows.on else ())
                                  + ((LAYOUTS,) if self.rank is not None else ()) + (PARAMS,))
        self.param_names.out = ParamNameWriter(self.writer)
        self.calls.writer = self.values.writer = self.op_records.writer = self.writer
        self.token_rows.open(self.writer)
        if wants_device_path(device):  # fingerprints on the device, nothing waits for it (divtrace.record.device)
            attach(self.writer, self.token_rows)
        if self.rank is not None:  # (after the device path: a rank's layouts go out through it too)
            from divtrace.record.ranks import attach as attach_rank

            self.placements = attach_rank(self, self.rank)
        ACTIVE_MODELS.add(id(self.model))
        ACTIVE.append(self)
        if self._regions:
            self.warnings.append("the model is torch.compile'd: " + (
                "recorded at module boundaries inside the compiled code (compiled=True); aten ops inside it are not "
                "visible" if self.compiled else "recorded with compiled=False, so torch.compile was set to "
                "force_eager inside the block: this trace is of the eager computation, not of the compiled kernels"))
        self.calls.hook([] if self.compiled else modules)  # compiled: the session's taps instead
        if self.ops:
            self.op_records.push_mode()
        self._session.start()
        self._signals.install(self.writer)
        self._froze_gc = self.rank is None and freeze_gc()  # (a rank froze them in attach_rank already)
        return self

    def routed(self, rows, *, tokens, slots, n_tokens: int, top_k: int, experts=None) -> None:
        """The routing of `rows` (`divtrace.routed`; record/routing.py). Checked even outside a process group,
        where it is then ignored, as declared layouts are."""
        from divtrace.record.routing import make_routing

        routing = make_routing(rows, tokens, slots, n_tokens, top_k, experts)
        if self.placements is not None:
            self.placements.routes.declare(rows, routing)

    def tokens(self, ids, positions, seqs=None) -> None:
        """Declare the token rows of the next root call of the recorded model, in the order the call lays its
        tokens out (flattened for `[N, ...]` inputs, row-major for `[B, T]`): `ids` and `positions` hold one
        entry per row, `seqs` (optional) a sequence handle per row, such as a request id, that chains decode
        steps to their sequence; without it a sequence starts where a position is 0. Engines and custom loops
        call this before each forward; HF-style calls (`input_ids`, `attention_mask`, `position_ids`, a cache)
        need no declaration.

        Example::

            with divtrace.record(model, "runs/rollout", mode="hash") as rec:
                rec.tokens(ids=[5, 9, 2, 7], positions=[0, 1, 2, 3], seqs=["req-0"] * 4)
                model(input_ids, positions)
        """
        self.token_rows.declare(ids, positions, seqs)

    def final(self, values, rows=None, kind=None, targets=None, call=None) -> None:
        """Declare the final values of the last model call: the logits rows (or per-token logprobs) that an
        engine or a fused head computes for some of its token rows only, so that bisect compares them per token.
        `values` holds one row per entry of `rows`, the cells (row-major indices into the last root call's token
        rows, in the order rec.tokens declared them) the values belong to; `rows=None` means every cell in order,
        `rows="last"` the last cell of each sequence, in the order the sequences first appear (a generate step's).
        `kind` is "logits" ([R, V]: the row predicts the token after the cell) or "logprobs" ([R]: the logprob of
        the token after the cell; `targets` may give those ids); by default logits for 2-D values, else logprobs.
        `call`: the number of the root call whose token rows `rows` index (default: the last one), for values
        computed after several calls (generate's steps).

        Example (an engine that computes logits for the last row of each sequence)::

            with divtrace.record(engine, "runs/rollout", mode="hash") as rec:
                rec.tokens(ids, positions, seqs=request_ids)
                logits = engine(input_ids, positions)           # [num_seqs, vocab]
                rec.final(logits, rows=last_row_of_each_sequence)
        """
        self.token_rows.final(self.calls, values, rows, kind, targets, call)

    def last_rows(self, call=None) -> list[int]:
        """The cells (rows for rec.final) of the last token of each sequence in the last root call (or root call
        number `call`), in the order the sequences first appear: a generate step's predicting rows. Example::

            cells = rec.last_rows(call=step)
            rec.final(step_logprobs[alive], rows=[cells[b] for b in alive], kind="logprobs", call=step)
        """
        return self.token_rows.last_rows(call)

    def __exit__(self, exc_type, exc, tb):
        try:
            self.op_records.pop_mode()
        finally:
            self.calls.closing_warnings()
            compiled_meta = self._session.stop() if self._session is not None else {}
            self.calls.unhook()
            ACTIVE_MODELS.discard(id(self.model))
            if self in ACTIVE:
                ACTIVE.remove(self)
            self.calls.release_frames()
            status, error = closing_status(exc_type, exc)
            # A signal held while an exception was already on its way out is settled here, not later.
            held, STATE.deferred = STATE.deferred, None
            tokens = self.token_rows.close()
            if exc_type is None and not self.writer.failed:
                try:
                    self.param_names.finish()
                except Exception as e:  # (a parameter that cannot be read: the trace is closed all the same)
                    self.warnings.append(f"unread parameters not fingerprinted: {type(e).__name__}: {e}")
            extra = {"tokens": tokens} if tokens and tokens["grids"] else {}
            if self.rank is not None:
                from divtrace.record.ranks import closing_meta

                extra["dist"] = closing_meta(self.rank, self.placements)
            try:
                self.writer.close(status, error, warnings=self.warnings, unfinished_calls=self.calls.unfinished(),
                                  **extra, **compiled_meta)
            finally:
                self._signals.restore()
                if self._froze_gc:
                    self._froze_gc = False
                    gc.unfreeze()
            if held is not None and exc_type is None:
                raise held
        why = self._session.compile_failure(exc) if self._session is not None and exc is not None else None
        if why:
            raise DivtraceError(why) from None  # (the trace is closed and marked as failed)
        return False
