"""The CLI's stop-signal handler (`StopOnce` inside `stopping_with`), run in this process with real
signals: the first stop raises, later ones are ignored, and a stop that the handler raised inside a
finalizer, where Python only reports it, is raised again by `check` without a traceback on stderr."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator

import pytest
from mooncake_cli.signals import STOP_SIGNALS, StopOnce, Stopped, stopping_with


@pytest.fixture(autouse=True)
def handlers_put_back() -> Iterator[None]:
    """`stopping_with` leaves the stop signals ignored once one fired (the command exits then);
    this process goes on, with its own handlers and hook."""
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    hook = sys.unraisablehook
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        sys.unraisablehook = hook


class _SignalledWhenFinalized:
    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __del__(self) -> None:
        signal.raise_signal(self.signum)  # the handler runs here, inside the finalizer


@pytest.fixture
def unraisables() -> list[BaseException | None]:
    """What reaches the hook that was there before the command's (Python's own prints it)."""
    seen: list[BaseException | None] = []
    sys.unraisablehook = lambda unraisable: seen.append(unraisable.exc_value)
    return seen


@pytest.mark.parametrize(
    ("signum", "raised"), [(signal.SIGTERM, Stopped), (signal.SIGHUP, Stopped), (signal.SIGINT, KeyboardInterrupt)]
)
def test_a_stop_lost_in_a_finalizer_is_raised_again_by_check_and_not_reported(
    signum: int, raised: type[BaseException], unraisables: list[BaseException | None]
) -> None:
    with pytest.raises(raised) as caught, stopping_with(StopOnce()) as stop:
        _SignalledWhenFinalized(signum)  # dropped at once
        assert stop.raised and stop.signum == signum  # the handler ran, its exception was lost
        stop.check()
        pytest.fail("check() did not raise the lost stop")
    assert unraisables == []  # not printed as "Exception ignored" with a traceback
    if raised is Stopped:
        assert isinstance(caught.value, Stopped) and caught.value.code == 128 + signum


def test_the_first_stop_raises_and_later_ones_are_ignored() -> None:
    with stopping_with(StopOnce()) as stop:
        with pytest.raises(Stopped) as first:
            signal.raise_signal(signal.SIGTERM)
        assert first.value.signum == signal.SIGTERM
        signal.raise_signal(signal.SIGINT)  # ignored: the first stop's cleanup runs on
        assert stop.signum == signal.SIGTERM
    for sig in STOP_SIGNALS:  # after the block, until the command exits
        assert signal.getsignal(sig) == signal.SIG_IGN


def test_other_unraisable_errors_are_still_reported(unraisables: list[BaseException | None]) -> None:
    class Broken:
        def __del__(self) -> None:
            raise ValueError("a finalizer's own error")

    with stopping_with(StopOnce()) as stop:
        with pytest.raises(Stopped):
            signal.raise_signal(signal.SIGTERM)
        assert stop.raised
        Broken()
    assert [str(exc) for exc in unraisables] == ["a finalizer's own error"]


def test_the_hook_is_put_back_when_no_stop_came() -> None:
    hook = sys.unraisablehook
    with stopping_with(StopOnce()):
        assert sys.unraisablehook is not hook
    assert sys.unraisablehook is hook
