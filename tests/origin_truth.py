"""Ground truth for the origins tests, from plain forward hooks (never from divtrace's own output).

`ModuleRows(model)` hooks every module of a model and keeps, per root call, each module call's first input and
first output tensor (a module returning a tuple: its first element). The test driver says which token each row
of each root call is (`Layout`), the way it laid the batch out. `Truth(a, b)` then compares, per module and per
token, the two sides' rows bit for bit:

- `out_differs[module]`: the tokens whose output row differs there (per the modules both sides have);
- `final_differs`: the tokens whose final value (logits row) differs;
- `origins()`: for every token whose final differs, the module where its difference originates, found by
  descending from the root along *differing outputs*: the first child (in execution order) whose output differs;
  entered when its input is equal for the token, else the parent's own code made it. Returns {module: count}.
- `first_module_out()`: the first module, in execution order, whose output differs for any token.
- `absorbed_only()`: modules with a differing output row for some token whose final is equal.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for y in x:
            t = _first_tensor(y)
            if t is not None:
                return t
    if hasattr(x, "logits") and isinstance(getattr(x, "logits"), torch.Tensor):
        return x.logits
    if isinstance(x, dict):
        for y in x.values():
            t = _first_tensor(y)
            if t is not None:
                return t
    return None


def _bits(row: torch.Tensor) -> bytes:
    r = row.detach().contiguous().cpu()  # (after the recording: a GPU run's rows are read here, not in the block)
    return bytes(r.view(torch.uint8).reshape(-1).tolist()) + str(r.dtype).encode()


@dataclass
class Layout:
    """Which token each row of one root call is: `tokens` lists (sequence, position) per row in row-major order of
    `grid` ([B, T] or [N]); None for padding. `final_rows`, where the final output holds fewer rows than the grid
    (logits_to_keep, an engine's last rows): the grid cells its rows are."""

    grid: tuple
    tokens: list
    final_rows: list | None = None


@dataclass
class _Call:
    module: str
    inp: torch.Tensor | None
    out: torch.Tensor | None


@dataclass
class ModuleRows:
    """Forward hooks on every module of `model`; `root_calls[i]` lists the module calls of root call i in the
    order their outputs were produced, with `order` the first exit order of each module name."""

    model: torch.nn.Module
    names: dict = field(default_factory=dict)  # rename sides' module paths to a shared name
    root_calls: list = field(default_factory=list)
    order: dict = field(default_factory=dict)

    def __post_init__(self):
        self._handles = []
        self._depth = 0
        for name, m in self.model.named_modules():
            self._handles.append(m.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post(name), with_kwargs=True))
        self._inputs: list = []

    def _pre(self, name):
        def hook(m, args, kwargs):
            if name == "":
                self.root_calls.append([])
            x = _first_tensor(args) if args else _first_tensor(list(kwargs.values()))
            self._inputs.append(None if x is None else x.detach().clone())
        return hook

    def _post(self, name):
        def hook(m, args, kwargs, out):
            inp = self._inputs.pop()
            o = _first_tensor(out)
            key = self.names.get(name, name)
            self.root_calls[-1].append(_Call(key, inp, None if o is None else o.detach().clone()))
            self.order.setdefault(key, len(self.order))
        return hook

    def remove(self):
        for h in self._handles:
            h.remove()


def _rows(x: torch.Tensor | None, layout: Layout, final: bool):
    """{token: row bytes} of a tensor laid out by `layout` (its rows the grid's cells), or {}."""
    if x is None:
        return {}
    g = list(layout.grid)
    n = 1
    for s in g:
        n *= s
    shape = list(x.shape)
    cells = None
    if len(g) == 2 and shape[:2] == g:
        rows = x.reshape(n, -1)
        cells = list(range(n))
    elif len(g) == 1 and shape[:1] == g:
        rows = x.reshape(n, -1)
        cells = list(range(n))
    elif final and layout.final_rows is not None and shape[0] * (shape[1] if len(shape) > 2 else 1) == len(layout.final_rows):
        rows = x.reshape(len(layout.final_rows), -1)
        cells = layout.final_rows
    else:
        return {}
    out = {}
    for r, c in enumerate(cells):
        tok = layout.tokens[c]
        if tok is not None:
            out[tok] = _bits(rows[r])
    return out


class Truth:
    """Per-token bitwise comparison of two ModuleRows runs (module names as renamed by each side's `names`)."""

    def __init__(self, a: ModuleRows, layouts_a: list, b: ModuleRows, layouts_b: list, final: str = ""):
        self.order = a.order
        self.out_rows = ({}, {})
        self.in_rows = ({}, {})
        for side, (run, layouts) in enumerate(((a, layouts_a), (b, layouts_b))):
            assert len(run.root_calls) == len(layouts), (len(run.root_calls), len(layouts))
            for calls, lay in zip(run.root_calls, layouts):
                for c in calls:
                    is_final = c.module in (final, "")  # (an HF model returns lm_head's rows as its own)
                    for tok, bits in _rows(c.out, lay, is_final).items():
                        self.out_rows[side].setdefault(c.module, {}).setdefault(tok, bits)
                    for tok, bits in _rows(c.inp, lay, False).items():
                        self.in_rows[side].setdefault(c.module, {}).setdefault(tok, bits)
        self.final = final
        self.out_differs = self._differs(self.out_rows)
        self.in_differs = self._differs(self.in_rows)
        fa, fb = self.out_rows[0].get(final, {}), self.out_rows[1].get(final, {})
        self.final_compared = sorted(set(fa) & set(fb))
        self.final_differs = {t for t in self.final_compared if fa[t] != fb[t]}

    @staticmethod
    def _differs(rows) -> dict:
        out = {}
        for m in set(rows[0]) & set(rows[1]):
            ra, rb = rows[0][m], rows[1][m]
            out[m] = {t for t in set(ra) & set(rb) if ra[t] != rb[t]}
        return out

    def parent(self, module: str) -> str:
        """The nearest called ancestor (a ModuleList is never called: layers.0's parent is the model)."""
        parts = module.split(".")
        for n in range(len(parts) - 1, 0, -1):
            p = ".".join(parts[:n])
            if p in self.order:
                return p
        return ""

    def children(self, module: str) -> list:
        kids = [m for m in self.order if m != "" and m != module and self.parent(m) == module]
        return sorted(kids, key=self.order.__getitem__)

    def origins(self) -> dict:
        count = defaultdict(int)
        for tok in self.final_differs:
            m = self._descend(tok, "")
            if self._attends(m):
                m = self._through_attention(tok, m)
            count[m] += 1
        return dict(count)

    def _attends(self, module: str) -> bool:
        """An attention module: its own code mixes the tokens of a sequence (it holds K and V projections)."""
        return any(k.rsplit(".", 1)[-1] in ("k_proj", "v_proj", "qkv_proj") for k in self.children(module))

    def _through_attention(self, tok, m: str, hops: int = 0) -> str:
        """tok's row first differs in attention module m's own code, which reads the K/V rows of the earlier tokens
        of its sequence: where an earlier token's rows differ inside m (at m's output or any module under it), the
        earliest such token's difference is tok's, and its origin tok's origin: descended from m where its rows
        are equal at m's input, else from the root (its difference came from before m: an earlier layer's op at
        that token), through attention again where that lands in an attention's own code (as bisect walks back
        through the K/V rows, divtrace.compare.token_origins)."""
        inside = [k for k in self.out_differs if k == m or k.startswith(m + ".")]
        earlier = sorted({x for k in inside for x in self.out_differs[k] if x[0] == tok[0] and x[1] < tok[1]},
                         key=lambda x: x[1])
        if not earlier:
            return m
        x = earlier[0]
        o = self._descend(x, "" if x in self.in_differs.get(m, ()) else m)
        if self._attends(o) and hops < 16:
            o = self._through_attention(x, o, hops + 1)
        return o

    def _descend(self, tok, m: str) -> str:
        while True:
            kids = [k for k in self.children(m) if tok in self.out_differs.get(k, ())]
            if not kids:
                return m
            k = kids[0]
            if tok in self.in_differs.get(k, ()):
                return m
            m = k

    def first_module_out(self) -> str | None:
        diff = [m for m, toks in self.out_differs.items() if toks]
        return min(diff, key=self.order.__getitem__) if diff else None

    def module_counts(self) -> dict:
        """Per module, how many tokens' output rows differ there."""
        return {m: len(t) for m, t in self.out_differs.items() if t}

    def absorbed_modules(self) -> set:
        """Modules whose output differs for some token whose final value is equal."""
        return {m for m, toks in self.out_differs.items() if toks - self.final_differs and m != self.final}


# -- layouts of the runs the tests drive --------------------------------------------------------------------
def generate_layouts(prompts: list, new_tokens: int, logits_to_keep: bool = True) -> list:
    """HF generate over a left-padded batch: the prefill [B, T] (padding None), then one [B, 1] call per decoded
    token but the last (generate never feeds it back). The prefill's logits hold the last column only."""
    t = max(map(len, prompts))
    b = len(prompts)
    toks = []
    for i, p in enumerate(prompts):
        pad = t - len(p)
        toks += [None] * pad + [(i, j) for j in range(len(p))]
    out = [Layout((b, t), toks, [i * t + t - 1 for i in range(b)] if logits_to_keep else None)]
    for s in range(new_tokens - 1):
        out.append(Layout((b, 1), [(i, len(p) + s) for i, p in enumerate(prompts)]))
    return out


def trainer_layouts(seqs: list, micro_batch: int) -> list:
    """Right-padded micro-batches of whole sequences."""
    out = []
    for s0 in range(0, len(seqs), micro_batch):
        chunk = seqs[s0:s0 + micro_batch]
        t = max(map(len, chunk))
        toks = []
        for i, s in enumerate(chunk):
            toks += [(s0 + i, j) for j in range(len(s))] + [None] * (t - len(s))
        out.append(Layout((len(chunk), t), toks))
    return out


def engine_layouts(prompts: list, new_tokens: int) -> list:
    """engine_model.generate: a flat prefill of every prompt, then one row per sequence per step; the final
    (logits) rows are the last row of each sequence in the step."""
    out = []
    fed = [0] * len(prompts)
    lens = [len(p) for p in prompts]
    for step in range(new_tokens):
        toks, last = [], []
        for i in range(len(prompts)):
            new = range(fed[i], lens[i] + step)
            toks += [(i, j) for j in new]
            last.append(len(toks) - 1)
            fed[i] = lens[i] + step
        out.append(Layout((len(toks),), toks, last))
    return out
