"""The recorded block's lifecycle: what every recorder on a thread shares, and how signals end a recording.

- While a recorder does its own bookkeeping (`BUSY`), no recorder records: its own torch calls are not the
  model's. Signals that arrive meanwhile are held until it is done, so the files never hold a half-written flush
  and record indices never skip.
- A KeyboardInterrupt or SIGTERM ends the block: its calls stay open, the trace is marked "interrupted" /
  "terminated" (`closing_status`) and `unfinished_calls` says how many. A trainer's own SIGTERM or SIGINT
  handler keeps its signal (`SignalHandlers` installs divtrace's only over Python's defaults).
- Two recorders on two models may run at once: `owners()` is this thread's stack of open module calls, by
  recorder, so an op belongs to the recorder whose module call is innermost.

In: the Recorder's enter and exit. Out: the status and error meta.json gets, signals raised where it is safe.
"""
from __future__ import annotations

import signal
import threading

from divtrace.record.values import _forget


class _State(threading.local):
    """Per thread, shared by all recorders: while one does its own bookkeeping (busy), none records. Class-level
    defaults, so the hot paths read `STATE.busy` without a getattr default."""

    busy = 0
    deferred = None  # a signal held while busy
    owners = None


STATE = _State()
ACTIVE_MODELS: set[int] = set()
ACTIVE: list = []  # recorders inside their `with` block, any thread


class RecordingTerminated(KeyboardInterrupt):
    """Raised inside the recorded block when the process gets SIGTERM, so the trace is closed and marked. A
    KeyboardInterrupt subclass so that code (and the CLI) treating Ctrl-C as "stop" treats it the same."""


class _Busy:
    def __enter__(self):
        STATE.busy += 1

    def __exit__(self, *exc):
        STATE.busy -= 1
        if STATE.busy == 0 and STATE.deferred is not None and exc[0] is None:
            pending, STATE.deferred = STATE.deferred, None
            raise pending


BUSY = _Busy()


def busy() -> bool:
    return STATE.busy > 0


def owners() -> list:
    o = getattr(STATE, "owners", None)
    if o is None:
        o = STATE.owners = []
    return o


def closing_status(exc_type, exc) -> tuple[str, str | None]:
    """(status, error) of a block that ends with exception `exc` (or none)."""
    if exc_type is None:
        return "complete", None
    if issubclass(exc_type, RecordingTerminated):
        return "terminated", "SIGTERM"
    if issubclass(exc_type, KeyboardInterrupt):
        return "interrupted", "KeyboardInterrupt"
    return "error", f"{exc_type.__name__}: {exc}".splitlines()[0][:500]


class SignalHandlers:
    """divtrace's SIGTERM and SIGINT handlers for one recording: a signal raises in the block, unless the
    recorder is busy (held until it is done) or the writer is flushing (held until the files are whole)."""

    def __init__(self) -> None:
        self._mine: dict = {}

    def install(self, writer) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(exc_type):
            def on_signal(signum, frame):
                exc = exc_type("SIGTERM" if signum == signal.SIGTERM else "")
                if busy() or (frame is not None and frame.f_code is _forget.__code__):
                    STATE.deferred = exc  # raised when the bookkeeping in progress (or the next) is done
                elif writer.critical:
                    writer.deferred = exc
                else:
                    raise exc
            on_signal.divtrace_handler = True
            return on_signal

        # Only where Python's own handling is in place (or a recorder this one is nested in put its own): a
        # trainer's handler (finish the step, checkpoint on preemption) keeps its signal, and the recording then
        # ends however that handler has it end.
        for sig, default, exc_type in ((signal.SIGTERM, signal.SIG_DFL, RecordingTerminated),
                                       (signal.SIGINT, signal.default_int_handler, KeyboardInterrupt)):
            current = signal.getsignal(sig)
            if current == default or getattr(current, "divtrace_handler", False):
                mine = handler(exc_type)
                mine.divtrace_active, mine.divtrace_old = True, current
                signal.signal(sig, mine)
                self._mine[sig] = mine

    def restore(self) -> None:
        for sig, mine in self._mine.items():
            mine.divtrace_active = False
            if signal.getsignal(sig) is mine:  # else a handler set inside the block: it stays
                old = mine.divtrace_old
                while getattr(old, "divtrace_handler", False) and not old.divtrace_active:
                    old = old.divtrace_old  # a recorder entered before this one and exited already
                signal.signal(sig, old)
        self._mine.clear()
