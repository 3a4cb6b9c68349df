"""Routing replay: the rollout's expert choices forced on the trainer's MoE routers, to see what else differs.

    with divtrace.routing.capture(engine_model) as got:      # side a: each router's ids and weights, per call
        engine_model(input_ids)
    with divtrace.routing.replay(trainer_model, got.ids()):  # side b: those ids forced (got.weights() too: optional)
        trainer_model(input_ids)

A router is a module whose class name ends in "Router" (HF MixtralTopKRouter, Qwen2MoeTopKRouter), or one whose
path matches `routers` (a regex, re.fullmatch). `replay` wraps each given router's forward: its own `torch.topk`
still runs (and is recorded: the router's own choice stays visible), then its result is replaced by the forced
ids and the router's scores gathered at them, so the code after the top-k (renormalization) runs as the model
wrote it; with `weights`, the router's returned weights ([rows, k], float) are replaced too. Replaying ids alone
removes a flipped choice but not a difference in how the weights are computed: bisect then names the router with
"expert ids equal on all N tokens, routing weights differ for M" (docs/sharded.md, "Routing (MoE)").

In: a torch.nn.Module and {router path: tensor or list of tensors, one per call in order}. Out: context managers.
"""
from __future__ import annotations

import re
from contextlib import contextmanager

from divtrace.errors import DivtraceError


def routers(model, pattern: str | None = None) -> dict:
    """{path: module} of the model's routers: class name ending in "Router", or path matching `pattern`."""
    rx = re.compile(pattern) if pattern is not None else None
    return {p: m for p, m in model.named_modules()
            if (rx.fullmatch(p) if rx is not None else type(m).__name__.endswith("Router"))}


def _split(out):
    """(ids, weights) of a router's output: its integer and float [rows, k] tensors (ids first found)."""
    import torch

    items = out if isinstance(out, (tuple, list)) else (out,)
    ids = next((x for x in items if isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_floating_point()),
               None)
    if ids is None:
        return None, None
    w = next((x for x in items if isinstance(x, torch.Tensor) and x.is_floating_point() and x.shape == ids.shape),
             None)
    return ids, w


class Captured(dict):
    """{router path: [(ids, weights), ...]} one entry per call, in order."""

    def ids(self) -> dict:
        return {p: [i for i, _ in v] for p, v in self.items()}

    def weights(self) -> dict:
        return {p: [w for _, w in v] for p, v in self.items()}


@contextmanager
def capture(model, pattern: str | None = None):
    """Collect each router call's returned expert ids and weights (detached copies)."""
    got = Captured()
    hooks = []
    for path, m in routers(model, pattern).items():
        def hook(mod, args, out, path=path):
            ids, w = _split(out)
            if ids is not None:
                got.setdefault(path, []).append((ids.detach().clone(), None if w is None else w.detach().clone()))
        hooks.append(m.register_forward_hook(hook))
    try:
        yield got
    finally:
        for h in hooks:
            h.remove()


def _queue(x, path: str, what: str) -> list:
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)) and all(isinstance(y, torch.Tensor) or y is None for y in x):
        return list(x)
    raise DivtraceError(f"routing.replay: {what} for {path} must be a tensor or a list of tensors, one per call")


@contextmanager
def replay(model, ids: dict, weights: dict | None = None):
    """Force `ids` ({router path: [rows, k] tensor, or a list of them, one per call}) and optionally `weights` on
    the routers at those paths, while the block runs."""
    mods = dict(model.named_modules())
    missing = [p for p in list(ids) + list(weights or {}) if p not in mods]
    if missing:
        raise DivtraceError(f"routing.replay: no module {missing[0]!r} in the model")
    queues = {p: _queue(v, p, "ids") for p, v in ids.items()}
    wqueues = {p: _queue(v, p, "weights") for p, v in (weights or {}).items()}
    saved = []
    for path in dict.fromkeys(list(ids) + list(weights or {})):
        m = mods[path]
        saved.append((m, m.__dict__.get("forward")))
        m.forward = _forced_forward(m, path, queues.get(path), wqueues.get(path))
    try:
        yield
    finally:
        for m, f in saved:
            if f is None:
                del m.forward
            else:
                m.forward = f


def _forced_forward(m, path: str, idq: list | None, wq: list | None):
    inner = m.forward
    calls = [0]

    def forward(*args, **kwargs):
        n = calls[0]
        calls[0] += 1
        forced = _take(idq, n, path, "ids")
        if forced is None:
            out = inner(*args, **kwargs)
        else:
            with _ForceTopk(forced, path):
                out = inner(*args, **kwargs)
        w = _take(wq, n, path, "weights")
        if w is not None:
            out = _with_weights(out, w, path)
        return out
    return forward


def _take(q: list | None, n: int, path: str, what: str):
    if q is None:
        return None
    if n >= len(q):
        raise DivtraceError(f"routing.replay: {path} was called {n + 1} times, {what} were given for {len(q)}")
    return q[n]


def _with_weights(out, w, path: str):
    ids, old = _split(out)
    if old is None or tuple(w.shape) != tuple(old.shape):
        raise DivtraceError(f"routing.replay: {path} returns no float [rows, k] weights of shape "
                            f"{tuple(w.shape)} to replace")
    items = list(out) if isinstance(out, (tuple, list)) else [out]
    items = [w.to(old.dtype).to(old.device) if x is old else x for x in items]
    return type(out)(items) if isinstance(out, tuple) and type(out) is tuple else (
        items if isinstance(out, list) else items[0])


def _force_topk_mode():
    from torch.overrides import TorchFunctionMode

    class ForceTopk(TorchFunctionMode):
        """Inside one router call: its first torch.topk runs, then returns the forced ids and the scores there."""

        def __init__(self, forced, path):
            super().__init__()
            self.forced, self.path, self.done = forced, path, False

        def __torch_function__(self, func, types, args=(), kwargs=None):
            import torch

            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if self.done or func not in (torch.topk, torch.Tensor.topk):
                return out
            self.done = True
            vals, idx = out
            f = self.forced.to(idx.device)
            if tuple(f.shape) != tuple(idx.shape):
                raise DivtraceError(f"routing.replay: {self.path}'s top-k chose {tuple(idx.shape)} ids, the ids "
                                    f"given have shape {tuple(f.shape)}")
            dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
            scores = args[0]
            f = f.to(idx.dtype).clone()  # made inside the router call: the recording gives it token rows
            return torch.return_types.topk((scores.gather(dim, f), f))

    return ForceTopk


def _ForceTopk(forced, path):
    return _force_topk_mode()(forced, path)
