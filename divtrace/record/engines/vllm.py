"""Recording a `vllm.LLM` (in-process engine, eager mode): `with divtrace.record(llm, dir): llm.generate(...)`.

What the adapter does, on top of the plain module recorder:
- finds the model (`llm.llm_engine.model_executor.driver_worker.worker.model_runner.model`) and records every
  forward of it, plus `logits_processor`, which vLLM calls outside the forward (`compute_logits`) on the rows
  it samples from;
- refuses, with one line naming the setting, an engine that recording would not fully see: the engine core in
  another process (VLLM_ENABLE_V1_MULTIPROCESSING), compiled or CUDA-graph mode (enforce_eager=False), prefix
  caching (KV blocks computed before recording would be reused unseen), more than one worker (tensor or
  pipeline parallel), speculative decoding;
- declares each forward's token rows (ids, positions, request ids) from the runner's batch, just before the
  model is called (`model_runner._model_forward`, patched on the instance for the block's duration);
- records vLLM's version and settings in meta.json (`engine`);
- records derived values at a few module boundaries, so that the built-in map `vllm-hf` can compare vLLM's
  fused modules with HF's separate ones in hash mode too (see `DERIVED` below). They are computed while the
  recorder is busy, so they add no op records: each is an extra key in a module's input or output list.
"""
from __future__ import annotations

import os
import re

import torch

from divtrace.errors import DivtraceError
from divtrace.record.module_calls import ModuleCalls
from divtrace.record.recorder import Recorder

# Derived values, recorded at module boundaries under these keys (what the map `vllm-hf` pairs with HF's):
# - `out.q` `out.k` `out.v` of a QKVParallelLinear: the q, k, v column blocks of its fused output (HF's
#   q_proj/k_proj/v_proj outputs, concatenated along the last dim, are that fused output);
# - `out.gate` `out.up` of a MergedColumnParallelLinear with two blocks (gate_up_proj);
# - `out.sum` of a decoder layer returning `(hidden, residual)`: their sum, in their dtype (HF's residual
#   stream after the layer), and `kwargs.divtrace_sum` of one called with `(positions, hidden, residual)`;
# - `kwargs.divtrace_sum` of an RMSNorm called with a residual: hidden + residual (HF's norm input; vLLM's
#   fused add-norm adds them inside its kernel);
# - `kwargs.divtrace_ids` of the token embedding: the ids as int64 (vLLM passes int32, HF int64; a lookup is
#   the same for both).
DERIVED = ("out.q", "out.k", "out.v", "out.gate", "out.up", "out.sum", "kwargs.divtrace_sum", "kwargs.divtrace_ids")

# vLLM ops a repro must not replay outside the recorded process (meta.json engine.unreplayable_ops): their
# arguments point into that process's memory or state. Replaying `_C.onednn_mm` with a recorded handle address
# crashed the repro harness (SIGSEGV).
UNREPLAYABLE_OPS = {
    "_C.onednn_mm.default": "handler_tensor is the address of a oneDNN weight handle in the recording process",
    "_C.onednn_scaled_mm.default": "takes a oneDNN handle address from the recording process",
    "vllm.unified_attention_with_output.default": "reads its KV cache and metadata through vLLM's forward context",
    "vllm.unified_attention.default": "reads its KV cache and metadata through vLLM's forward context",
    "vllm.unified_kv_cache_update.default": "writes vLLM's KV cache, found through its forward context",
}

_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "TORCHDYNAMO_DISABLE",
        "VLLM_CPU_OMP_THREADS_BIND", "VLLM_BATCH_INVARIANT", "VLLM_ATTENTION_BACKEND")


def find_runner(llm):
    """The model runner of an in-process `vllm.LLM`, after checking that recording would see everything it
    computes. Raises DivtraceError naming the setting to change otherwise."""
    eng = getattr(llm, "llm_engine", None)
    cfg = getattr(eng, "vllm_config", None)
    if cfg is None:
        raise DivtraceError(f"record(): {type(llm).__name__} has no llm_engine.vllm_config; divtrace records a "
                            "vllm.LLM (vLLM V1, in-process)")
    core = type(getattr(eng, "engine_core", None)).__name__
    executor = getattr(eng, "model_executor", None)
    if core != "InprocClient" or executor is None:
        raise DivtraceError("record(): this vllm.LLM runs its engine core in another process "
                            f"(VLLM_ENABLE_V1_MULTIPROCESSING={os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING', '1')}, "
                            f"engine client {core}), where divtrace cannot see its forwards; set "
                            "VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating the LLM")
    comp = cfg.compilation_config
    mode = int(getattr(comp, "mode", 0) or 0)
    graphs = str(getattr(comp, "cudagraph_mode", "NONE")).split(".")[-1]
    if not cfg.model_config.enforce_eager or mode != 0 or graphs not in ("NONE", "None"):
        raise DivtraceError("record(): this vllm.LLM runs compiled or CUDA-graph code (enforce_eager="
                            f"{cfg.model_config.enforce_eager}, compilation mode {mode}, cudagraph_mode {graphs}), "
                            "which module hooks do not see; create it with enforce_eager=True")
    if cfg.cache_config.enable_prefix_caching:
        raise DivtraceError("record(): this vllm.LLM has prefix caching on (enable_prefix_caching=True, vLLM's "
                            "default), which reuses KV blocks computed before or outside recording; create it "
                            "with enable_prefix_caching=False")
    par = cfg.parallel_config
    if getattr(par, "world_size", 1) != 1 or getattr(par, "data_parallel_size", 1) != 1:
        raise DivtraceError("record(): this vllm.LLM runs on several workers (tensor_parallel_size="
                            f"{par.tensor_parallel_size}, pipeline_parallel_size={par.pipeline_parallel_size}, "
                            f"data_parallel_size={par.data_parallel_size}); divtrace records one in-process "
                            "worker: set them to 1")
    if getattr(cfg, "speculative_config", None) is not None:
        raise DivtraceError("record(): this vllm.LLM uses speculative decoding (speculative_config), whose draft "
                            "tokens divtrace cannot declare; create it without speculative_config")
    try:
        runner = executor.driver_worker.worker.model_runner
        model = runner.model
    except AttributeError as e:
        raise DivtraceError(f"record(): cannot find the model of this vllm.LLM "
                            f"(llm_engine.model_executor.driver_worker.worker.model_runner.model: {e})") from None
    if not isinstance(model, torch.nn.Module):
        raise DivtraceError(f"record(): the vllm.LLM's model runner holds {type(model).__name__}, not a module")
    return runner


def engine_meta(llm) -> dict:
    """vLLM's version and the settings that decide its numerics, for meta.json."""
    import vllm

    cfg = llm.llm_engine.vllm_config
    mc, cc, sc = cfg.model_config, cfg.cache_config, cfg.scheduler_config
    comp = cfg.compilation_config

    def plain(x):
        return x if isinstance(x, (bool, int, float, str)) or x is None else str(x)

    return {"engine": {
        "name": "vllm", "version": getattr(vllm, "__version__", None),
        "model": plain(mc.model), "dtype": plain(mc.dtype), "max_model_len": plain(mc.max_model_len),
        "enforce_eager": plain(mc.enforce_eager), "compilation_mode": plain(int(getattr(comp, "mode", 0) or 0)),
        "cudagraph_mode": plain(getattr(comp, "cudagraph_mode", None)),
        "enable_prefix_caching": plain(cc.enable_prefix_caching), "block_size": plain(cc.block_size),
        "kv_cache_dtype": plain(cc.cache_dtype),
        "enable_chunked_prefill": plain(getattr(sc, "enable_chunked_prefill", None)),
        "max_num_batched_tokens": plain(getattr(sc, "max_num_batched_tokens", None)),
        "max_num_seqs": plain(getattr(sc, "max_num_seqs", None)),
        "async_scheduling": plain(getattr(sc, "async_scheduling", None)),
        "seed": plain(getattr(mc, "seed", None)),
        # logits are computed after the forward, in this call, on the last row of each request (its own token grid)
        "logits_module": "logits_processor",
        "unreplayable_ops": UNREPLAYABLE_OPS,
        "device": plain(getattr(cfg.device_config, "device_type", None)),
        "env": {k: os.environ[k] for k in _ENV if k in os.environ},
    }}


_LAYER = re.compile(r"(^|\.)layers\.\d+$")


class VllmCalls(ModuleCalls):
    """The module calls of a vLLM model: the token grid of the logits call, no HF-style token reading of an
    undeclared forward, and the derived boundary values listed in DERIVED."""

    def __init__(self, model, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        self._logits = getattr(model, "logits_processor", None)
        self.logit_rows: list | None = None  # (id, position, request) of the rows the next logits call gets
        self.declared = False  # the next root call's tokens were declared (else it gets no token grid)
        self._derive: dict[int, str] = {}
        for name, m in model.named_modules():
            kind = type(m).__name__
            if kind == "QKVParallelLinear":
                self._derive[id(m)] = "qkv"
            elif kind == "MergedColumnParallelLinear" and len(getattr(m, "output_sizes", ())) == 2:
                self._derive[id(m)] = "gate_up"
            elif kind == "RMSNorm":
                self._derive[id(m)] = "norm"
            elif kind == "VocabParallelEmbedding" and name.endswith("embed_tokens"):
                self._derive[id(m)] = "embed"
            elif _LAYER.search(name):
                self._derive[id(m)] = "layer"

    def enter(self, path, module, args, kwargs):
        tokens = self._tokens
        if module is self._logits and self.logit_rows is not None and tokens.on:
            self._logits_grid(path, args)
        if module is self.model:
            declared, self.declared = self.declared, False
            if not declared and tokens.on:
                # Not read as an HF-style call either: vLLM's flat ids would pass for one sequence from position 0.
                tokens.on = False
                try:
                    return super().enter(path, module, args, kwargs)
                finally:
                    tokens.on = True
        kind = self._derive.get(id(module))
        if kind == "norm" and len(args) + len(kwargs) >= 2:
            x = args[0] if args else kwargs.get("x")
            res = args[1] if len(args) > 1 else kwargs.get("residual")
            if isinstance(x, torch.Tensor) and isinstance(res, torch.Tensor) and x.shape == res.shape:
                kwargs = {**kwargs, "divtrace_sum": x + res}
        elif kind == "layer" and len(args) >= 3 and isinstance(args[1], torch.Tensor) \
                and isinstance(args[2], torch.Tensor) and args[1].shape == args[2].shape:
            kwargs = {**kwargs, "divtrace_sum": args[1] + args[2]}
        elif kind == "embed" and args and isinstance(args[0], torch.Tensor) and args[0].dtype != torch.int64:
            kwargs = {**kwargs, "divtrace_ids": args[0].to(torch.int64)}
        return super().enter(path, module, args, kwargs)

    def _logits_grid(self, path, args) -> None:
        """Give the logits call a token grid of its own (the same tokens as the forward's last row of each
        request), so its logits rows are fingerprinted per token like a root call's outputs."""
        rows, self.logit_rows = self.logit_rows, None
        hidden = args[1] if len(args) > 1 else None
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[0] != len(rows):
            self._values.skip("a vLLM logits call whose rows are not the last row of each request (prompt logprobs "
                              "or speculative decoding): its rows were not declared")
            return
        self._tokens.declare([r[0] for r in rows], [r[1] for r in rows], seqs=[r[2] for r in rows])
        self._tokens.begin_root_call(self.next_call_id, self.counts.get(path, 0), args, {},
                                     f"{path} call {self.counts.get(path, 0)}")

    def exit(self, module, output):
        tokens = self._tokens
        if module is self._logits and tokens.grid is not None:
            try:
                return super().exit(module, output)
            finally:
                tokens.grid = None
                tokens.rowed.clear()
                tokens.store.hand_over()
        kind = self._derive.get(id(module))
        if kind is not None and isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            extra = self._derived_outputs(kind, module, output)
            if extra:
                output = {**{str(i): o for i, o in enumerate(output)}, **extra}
        return super().exit(module, output)

    @staticmethod
    def _derived_outputs(kind, module, output) -> dict:
        y = output[0]
        if kind == "qkv":
            sizes = [module.num_heads * module.head_size, module.num_kv_heads * module.head_size,
                     module.num_kv_heads * getattr(module, "v_head_size", module.head_size)]
            if sum(sizes) == y.shape[-1]:
                return dict(zip(("q", "k", "v"), y.split(sizes, dim=-1)))
        elif kind == "gate_up":
            sizes = list(module.output_sizes)
            if sum(sizes) == y.shape[-1]:
                return dict(zip(("gate", "up"), y.split(sizes, dim=-1)))
        elif kind == "layer" and len(output) == 2 and isinstance(output[1], torch.Tensor) \
                and output[1].shape == y.shape:
            return {"sum": y + output[1]}
        return {}


class VllmRecorder(Recorder):
    """`record(llm, path)` for a `vllm.LLM`: the module recorder on the engine's model, with token rows
    declared per forward and the derived boundary values listed in DERIVED (VllmCalls)."""

    calls_class = VllmCalls

    def __init__(self, llm, path, *, extra_meta=None, **kwargs):
        runner = find_runner(llm)
        meta = engine_meta(llm)
        meta.update(extra_meta or {})
        super().__init__(runner.model, path, extra_meta=meta, **kwargs)
        self.llm, self.runner = llm, runner
        self._patched = False
        self.steps = 0

    # context --------------------------------------------------------------------------------------------------
    def __enter__(self):
        super().__enter__()
        runner = self.runner
        original = runner._model_forward  # the bound method of the class (or a patch already there)

        def model_forward(*args, **kwargs):
            self._declare_tokens(kwargs)
            return original(*args, **kwargs)

        runner._model_forward = model_forward  # on the instance: removed again at exit
        self._patched = True
        return self

    def __exit__(self, *exc):
        if self._patched:
            self._patched = False
            try:
                del self.runner._model_forward
            except AttributeError:
                pass
        return super().__exit__(*exc)

    def _declare_tokens(self, kwargs) -> None:
        """Declare the token rows of the forward about to run: vLLM lays every scheduled token of every
        request out flat, request after request in the input batch's order (query_start_loc)."""
        self.steps += 1
        ids, positions = kwargs.get("input_ids"), kwargs.get("positions")
        if not isinstance(ids, torch.Tensor) or not isinstance(positions, torch.Tensor) or positions.dim() != 1:
            self.values.skip("a vLLM forward without flat input_ids/positions (embeddings or M-RoPE input): its "
                             "token rows were not declared")
            return
        batch = self.runner.input_batch
        n_reqs = batch.num_reqs
        starts = self.runner.query_start_loc.np[: n_reqs + 1].tolist()
        seqs: list = []
        for rid, s, e in zip(batch.req_ids[:n_reqs], starts, starts[1:]):
            seqs.extend([rid] * (e - s))
        n = ids.shape[0]
        ids_l, pos_l = ids.tolist(), positions.tolist()
        # vLLM computes logits after the forward, on the last scheduled row of each request (logits_indices)
        self.calls.logit_rows = [(ids_l[e - 1], pos_l[e - 1], rid)
                                 for rid, e in zip(batch.req_ids[:n_reqs], starts[1:]) if 0 < e <= n]
        declare = getattr(self, "tokens", None)
        if not self.token_rows.on:  # record(..., tokens=False)
            return
        if len(seqs) != n:
            # Padded rows (CUDA-graph sizes, which are refused; sequence-parallel padding): a padding row declared
            # as a token could pass for a real sequence starting with the pad id, so the step is left undeclared.
            self.values.skip(f"a vLLM forward of {n} rows holds {len(seqs)} scheduled tokens (padding): its token "
                             "rows were not declared")
            return
        if declare is not None:
            declare(ids_l, pos_l, seqs=seqs)
            self.calls.declared = True
        else:
            self.values.skip("this divtrace has no token API (rec.tokens): the vLLM forwards' token rows were not "
                             "declared")
