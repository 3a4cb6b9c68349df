"""Which Inductor kernel computed a tapped value: read from the code Inductor generated.

A tap runs from the `call` function of the Python module Inductor wrote (its wrapper code). That module names each
kernel it launches, says above each launch which FX nodes and aten ops it fuses ("# Topologically Sorted Source
Nodes: [...], Original ATen: [...]"), and passes buffers by name; a kernel's parameters say which of them it
writes (out_ptr*, in_out_ptr*). So the kernel that last wrote a tapped buffer before the tap line is the one
that computed the tapped value. Read once per generated file and tap line; anything not understood gives no
answer rather than a wrong one.
"""
from __future__ import annotations

import re

_CACHE: dict = {}
_DEF = re.compile(r"^(\w+) = async_compile\.(\w+)\(")
_BUF = re.compile(r"\b(buf\d+|arg\d+_\d+)\b")
_SOURCE = re.compile(r"# Topologically Sorted Source Nodes: \[(.*?)\], Original ATen: \[(.*?)\]")


def split_args(s: str) -> list[str]:
    """Top-level comma split of an argument list."""
    out, depth, cur, quote = [], 0, [], None
    for ch in s:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = None
            continue
        if ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _call_args(line: str, start: int) -> str | None:
    """The text between the parenthesis at `start` and its match."""
    depth = 0
    for i in range(start, len(line)):
        if line[i] == "(":
            depth += 1
        elif line[i] == ")":
            depth -= 1
            if depth == 0:
                return line[start + 1:i]
    return None


def _kernel_params(lines: list[str]) -> dict[str, list[str]]:
    """kernel name -> its parameter names, from the kernel definitions (C++ `kernel(...)`, Triton `def`)."""
    params: dict[str, list[str]] = {}
    i = 0
    while i < len(lines):
        m = _DEF.match(lines[i])
        if m:
            name = m.group(1)
            for j in range(i + 1, min(i + 400, len(lines))):
                line = lines[j]
                k = line.find("kernel(") if "extern \"C\"" in line or line.lstrip().startswith("extern") else -1
                if k < 0 and line.lstrip().startswith(f"def {name}("):
                    k = line.find("(") - len("kernel")
                if k >= 0:
                    text = line[k + len("kernel"):]
                    j2 = j
                    while text.count("(") > text.count(")") and j2 + 1 < len(lines):
                        j2 += 1
                        text += lines[j2]
                    args = _call_args(text, text.find("("))
                    if args is not None:
                        params[name] = [a.split(":")[0].split()[-1].lstrip("*") if a.split(":")[0].split() else a
                                        for a in split_args(args)]
                    i = j
                    break
        i += 1
    return params


def _writes(params: list[str]) -> list[int]:
    return [i for i, p in enumerate(params) if p.startswith("out_ptr") or p.startswith("in_out_ptr")]


def _first_buf(arg: str) -> str | None:
    m = _BUF.search(arg)
    return m.group(1) if m else None


def _analyze(path: str) -> dict:
    """tap line number -> (producers, tokens, last, settled): per tapped tensor, the kernel that computed it (or
    None), and a token that two taps of one run of `call` share exactly when they hand over the same bytes (the
    same argument text, and the buffer not written in between); `last` holds the tokens no later tap uses;
    `settled` says, per tensor, that nothing in the graph writes its buffer after the tap (its bytes leave the
    graph as tapped). Any line not understood counts as writing every buffer it names, so a token is never
    shared wrongly."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    params = _kernel_params(lines)
    out: dict[int, tuple] = {}
    producer: dict[str, dict] = {}
    alias: dict[str, str] = {}
    version: dict[str, int] = {}  # root buffer -> line of its last (possible) write
    source = None
    in_call = False
    last_use: dict = {}
    call_taps: list = []

    def written(text: str, no: int) -> None:
        for b in _BUF.findall(text):
            version[_root(alias, b)] = no

    for no, raw in enumerate(lines, 1):
        line = raw.strip()
        if raw.startswith("    def call(") or raw.startswith("def call("):
            in_call, producer, alias, version, source, call_taps = True, {}, {}, {}, None, []
            continue
        if not in_call:
            continue
        m = _SOURCE.search(line)
        if m:
            source = {"source_nodes": [s.strip() for s in m.group(1).split(",") if s.strip()],
                      "aten": [s.strip() for s in m.group(2).split(",") if s.strip()]}
            continue
        if "divtrace.tap" in line:
            k = line.find("(")
            args = split_args(_call_args(line, k) or "")
            if len(args) >= 2 and args[1].startswith("[") and args[1].endswith("]"):
                items = split_args(args[1][1:-1])
                bufs = [_first_buf(a) for a in items]
                roots = [_root(alias, b) if b else None for b in bufs]
                tokens = [(a, r, version.get(r, 0)) if r else None for a, r in zip(items, roots)]
                out[no] = ([producer.get(r) if r else None for r in roots], tokens, set(), [])
                call_taps.append((no, tokens))
                for t in tokens:
                    if t is not None:
                        last_use[t] = no
            else:
                written(line, no)
            source = None
            continue
        if line.startswith("del ") or line.startswith("#") or not line or line.startswith("assert_"):
            continue
        if re.fullmatch(r"(arg\d+_\d+, ?)*(arg\d+_\d+,?)? ?= args", line) or line == "args.clear()":
            continue  # the graph's inputs arrive
        if line.startswith("return "):  # the end of the run: a tapped buffer not written since stays as tapped
            for tno, tokens in call_taps:
                out[tno][3].extend(t is not None and version.get(t[1], 0) == t[2] for t in tokens)
            call_taps = []
            continue
        m = re.match(r"^(buf\d+) = (buf\d+)(?:\[\d+\])?(?:;|$)", line)  # reuse, or an item of a fallback's tuple
        if m:
            if "# reuse" not in line:
                alias[m.group(1)] = m.group(2)
            else:
                version[m.group(1)] = no
            continue
        m = re.match(r"^(buf\d+) = reinterpret_tensor\((buf\d+|arg\d+_\d+),", line)
        if m:
            if "# alias" in line:
                alias[m.group(1)] = m.group(2)
            else:
                version[m.group(1)] = no
            continue
        m = re.match(r"^(buf\d+) = (torch\.ops\.[\w.]+|extern_kernels\.\w+)\(", line)
        if m:  # a fallback op (not generated code) that returns its result
            producer[m.group(1)] = {"kernel": m.group(2), **(source or {})}
            written(line, no)  # (it may also write its arguments)
            source = None
            continue
        m = re.match(r"^(extern_kernels\.\w+|torch\.ops\.[\w.]+)\((.*)\)$", line)
        if m:
            outs = re.findall(r"\bout=(buf\d+)", line)
            for b in outs:
                producer[_root(alias, b)] = {"kernel": m.group(1), **(source or {})}
            written(line, no)
            source = None
            continue
        m = re.match(r"^(\w+?)(\.run)?\(", line)
        if m and m.group(1) in params:
            name = m.group(1)
            args = split_args(_call_args(line, line.find("(")) or "")
            for i in _writes(params[name]):
                if i < len(args):
                    b = _first_buf(args[i])
                    if b:
                        producer[_root(alias, b)] = {"kernel": name, **(source or {})}
                        version[_root(alias, b)] = no
            source = None
            continue
        written(line, no)  # anything else: every buffer it names may have changed
    for t, no in last_use.items():
        out[no][2].add(t)
    return out


def tap_site(frame):
    """(generated file, line) of the tap call in Inductor's generated `call` that `frame` runs under, or None."""
    f, depth = frame, 0
    while f is not None and depth < 40:
        if f.f_code.co_name == "call" and ("reinterpret_tensor" in f.f_globals or "extern_kernels" in f.f_globals):
            return f.f_code.co_filename, f.f_lineno
        f, depth = f.f_back, depth + 1
    return None


def site_info(site):
    """_analyze's entry for a tap site, or None."""
    if site is None:
        return None
    path, line = site
    try:
        table = _CACHE.get(path)
        if table is None:
            table = _CACHE[path] = _analyze(path)
        return table.get(line)
    except Exception:  # another torch's generated code: no answer rather than a wrong one
        _CACHE[path] = {}
        return None


def _root(alias: dict, b: str) -> str:
    seen = 0
    while b in alias and seen < 100:
        b, seen = alias[b], seen + 1
    return b


def producer_kernels(info, keys: list[str]) -> dict | None:
    """{key: {"kernel", "source_nodes", "aten"}} for the tensors a tap hands over (graph inputs and values the
    generated code did not compute left out), from its site_info; None when unknown."""
    if not info:
        return None
    res = {k: p for k, p in zip(keys, info[0]) if p}
    return res or None
