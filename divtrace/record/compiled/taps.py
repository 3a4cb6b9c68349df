"""The tap: an opaque custom op that torch.compile keeps in the compiled graph and that hands a module's inputs or
outputs, as the compiled code computed them, to the recorder when it runs.

`divtrace::tap(clock, xs, keys, session, path, event)` returns nothing and declares that it writes `clock`, one
small tensor shared by every tap. That declaration is what makes the compiled code keep it and keep every tap in
program order: a write to a graph input is never removed, and two writes to one tensor are never reordered.
(Inductor does not keep ops registered as ORDERED effects in order among themselves in torch 2.13: seen, a
module's exit tap ran before its enter tap.) The op does not write `xs`, so it does not make Inductor keep a
tensor alive or materialize it where the unrecorded graph would not read it; it does read `xs`, so Inductor
materializes each tapped value once (in a buffer that the next kernels then read), which is the value recorded.

The op is tagged `cudagraph_unsafe`: Inductor's CUDA graphs never capture it (a replay would skip it), and
partition the graph around it instead where they can.

`keys` (the tensors' keys joined by SEP), `session`, `path` and `event` are constants baked into the compiled graph; at run time the op looks up
the recording session by its number. A tap whose session has ended (compiled code kept from an earlier
recording) does nothing.
"""
from __future__ import annotations

import threading

import torch

_LOCK = threading.Lock()
_OP = None
CLOCK: torch.Tensor | None = None
SESSIONS: dict = {}
_KEEP: list = []  # the Library object: the op lives as long as it does  # session number -> the CompiledSession that taps report to


SEP = "\x1f"  # joins the keys into one str argument (custom ops take no list of str)


CAST = "\x1e"  # key CAST dtype: the value was handed over as float32 and is stored back in that dtype
_LOW = (torch.bfloat16, torch.float16)


def _dispatch(xs, keys, session, path, event) -> None:
    s = SESSIONS.get(session)
    if s is None:
        return
    flat = []
    for k, x in zip(keys.split(SEP) if keys else [], xs):
        if CAST in k:
            k, dt = k.split(CAST, 1)
            x = x.to(getattr(torch, dt))  # rounds as Inductor's store of the value in its own dtype does
        flat.append((k, x))
    s.on_tap(path, event, flat, in_graph=True)


def hand_over(flat: list) -> tuple[list, str]:
    """The tensors and joined keys a tap takes, inside traced code. A 16-bit float value is handed over as
    float32 (`x.float()`), so the tap reads a new buffer and not the value itself: Inductor then keeps the
    value in a fused kernel's float32 registers where the unrecorded graph does (forcing it into a buffer of
    its own dtype would round it there, and change what the next kernel computes). The tap stores it back in
    its dtype, which rounds as storing the value does."""
    ts, ks = [], []
    for k, t in flat:
        if t.dtype in _LOW:
            ts.append(t.float())
            ks.append(k + CAST + str(t.dtype).removeprefix("torch."))
        else:
            ts.append(t)
            ks.append(k)
    return ts, SEP.join(ks)


def tap_op():
    """torch.ops.divtrace.tap.default, registered on first use (importing divtrace stays light)."""
    global _OP, CLOCK
    if _OP is not None:
        return _OP
    with _LOCK:
        if _OP is None:
            # torch.library.custom_op would put Python autograd and ADInplaceOrView layers (and a version bump of
            # the clock) in front of every call: about 0.2 ms a tap. Defined directly, a call goes from the
            # dispatcher to _impl; no autograd is needed (the op returns nothing).
            lib = torch.library.Library("divtrace", "FRAGMENT")
            lib.define("tap(Tensor(a!) clock, Tensor[] xs, str keys, int session, str path, str event) -> ()",
                       tags=(torch.Tag.cudagraph_unsafe,))

            def _impl(clock, xs, keys, session, path, event):
                _dispatch(xs, keys, session, path, event)

            def _fake(clock, xs, keys, session, path, event):
                return None

            lib.impl("tap", _impl, "CompositeExplicitAutograd")
            torch.library.register_fake("divtrace::tap", _fake, lib=lib)
            _KEEP.append(lib)
            CLOCK = torch.zeros(1, dtype=torch.int64)
            _OP = torch.ops.divtrace.tap.default
    return _OP


def flatten(obj, prefix: str, out: list, depth: int = 0) -> list:
    """(key, tensor) pairs of a nested structure, keyed as the eager recorder keys them (values.flatten_tensors)
    for tuples, lists and dicts (HF ModelOutput is a dict). Kept to what torch.compile traces without a graph
    break: dataclasses that are not dicts are not looked into."""
    if isinstance(obj, torch.Tensor):
        out.append((prefix, obj))
    elif depth >= 8 or obj is None or isinstance(obj, (int, float, str, bool)):
        pass
    elif isinstance(obj, dict):
        for k, v in obj.items():
            flatten(v, f"{prefix}.{k}", out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            flatten(v, f"{prefix}.{i}", out, depth + 1)
    return out
