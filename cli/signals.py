"""The signals that stop a command that runs on (`up`, `bench`, `stat --watch`), and how it ends.

SIGINT (Ctrl-C), SIGTERM (`kill`, a supervisor) and SIGHUP (a closed terminal) each unwind the
command, so that what it set up is taken down, and it then exits 128 + the signal's number, as a
shell reports a process that signal ended: 130, 143, 129 (`bench` exited 130 after a `kill`, as if
someone had pressed Ctrl-C). A foreground `up` or `agent`, which a signal is the way to stop,
exits 0 instead.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from mooncake_store.errors import signal_exit_status

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

Handler = Callable[[int, FrameType | None], object] | int | None


class Stopped(BaseException):
    """A SIGTERM or SIGHUP, raised so that the command unwinds as Ctrl-C's KeyboardInterrupt makes
    it; `main` exits with :attr:`code` (after one red line when there is a ``message``). A
    BaseException, as KeyboardInterrupt is: raised inside a library call that handles Exception
    (and turns it into its own error), it was swallowed there, and as later signals are ignored
    once the first was raised, `up` then ran on for good (a test saw it outlive two SIGTERMs)."""

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(message or signal.Signals(signum).name)
        self.signum = signum
        self.message = message

    @property
    def code(self) -> int:
        return signal_exit_status(self.signum)


class StopOnce:
    """The handler of the stop signals: the first raises (KeyboardInterrupt for SIGINT, Stopped
    for the others), later ones are ignored. A second Ctrl-C or SIGTERM raised again inside the
    cleanup the first one began, cut it short (`bench` left objects, `up` processes), and changed
    the status to the second signal's."""

    def __init__(self) -> None:
        self.raised = False
        self.signum = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.raised:
            return
        self.raised, self.signum = True, signum
        raise self.exception()

    def exception(self) -> BaseException:
        return KeyboardInterrupt() if self.signum == signal.SIGINT else Stopped(self.signum)

    def check(self) -> None:
        """Raise the stop again where a loop that runs on checks for it. The handler raises in
        whatever code the signal lands in, and where that is a finalizer (a redis parser's
        __del__, run by the garbage collector) Python prints "Exception ignored" and goes on: the
        stop was lost, later signals were ignored, and the command ran on."""
        if self.raised:
            raise self.exception()


def _restore(sig: int, handler: Handler) -> None:
    # None: a handler that was not set from Python, which cannot be put back: the default then.
    signal.signal(sig, signal.SIG_DFL if handler is None else handler)


#: (a name of typeshed's only: sys has no UnraisableHookArgs at run time)
UnraisableHook = Callable[["sys.UnraisableHookArgs"], object]


def hide_lost_stops(stop: StopOnce) -> UnraisableHook:
    """Set a ``sys.unraisablehook`` under which ``stop``'s exception, raised in a finalizer and lost
    there, is not printed as "Exception ignored ... Stopped" with a traceback that looks like a
    crash (`StopOnce.check` raises it again); anything else goes to the hook it replaces, which
    it returns."""
    previous_hook = sys.unraisablehook

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        if not (stop.raised and isinstance(unraisable.exc_value, KeyboardInterrupt | Stopped)):
            previous_hook(unraisable)

    sys.unraisablehook = hook
    return previous_hook


@contextmanager
def stopping_with(stop: StopOnce, *, then_ignore: bool = False) -> Iterator[StopOnce]:
    """``stop`` handles the stop signals inside the block. Once it has fired they stay ignored
    after the block, for the little the command has left to do before it exits with the first
    signal's status: put back to the default action, a second SIGTERM killed it there instead.
    ``then_ignore``: ignored after the block in any case, where the block decided the command's
    outcome and what is left is to report it and exit (a detached `up` that recorded its cluster)."""
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    previous_hook = hide_lost_stops(stop)
    try:
        yield stop
    finally:
        if not stop.raised:  # else kept: a finalizer run at the exit can still lose the stop
            sys.unraisablehook = previous_hook
        try:
            for sig, handler in previous.items():
                _restore(sig, signal.SIG_IGN if stop.raised or then_ignore else handler)
        finally:
            if stop.raised:
                # Also when the first signal landed in the loop above, half way: the handlers it
                # had put back already would have cut short the cleanup that signal begins.
                for sig in STOP_SIGNALS:
                    signal.signal(sig, signal.SIG_IGN)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """A SIGINT, SIGTERM or SIGHUP that arrives inside is acted on when the block is done: raised in
    between (the CLI's handlers raise), it left a process spawned but not recorded, or a cleanup
    half done (`up`'s processes running out of `mooncake down`'s reach, `bench`'s objects left in
    the cluster). The handlers are swapped, not the signal mask: a blocked mask is inherited by
    the processes spawned, and holds only for the thread that set it, while Python runs its
    handlers in the main thread whichever thread was signalled."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread, where they also run
        return
    arrived: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: arrived.append(signum)) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            _restore(sig, handler)
        if arrived:
            signal.raise_signal(arrived[0])  # to the handler that was there before
