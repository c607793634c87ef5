"""The benchmark scripts stopped by Ctrl-C or a closed terminal: Ctrl-C printed a KeyboardInterrupt
traceback and SIGHUP ended a run on the spot (its children then left to their watchdogs). Each
now unwinds as SIGTERM did, and exits 128 + the signal's number without a traceback."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
from helpers import signal_after_first_line

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP, signal.SIGTERM], ids=["SIGINT", "SIGHUP", "SIGTERM"])
def test_a_benchmark_stopped_by_a_signal_exits_without_a_traceback(sig: signal.Signals) -> None:
    # Its first line is its machine line: the handlers are in place, the rounds begin.
    status, err = signal_after_first_line([sys.executable, str(BENCH / "allocator.py"), "--quick"], sig)
    assert status == 128 + sig, err
    assert "Traceback" not in err, err
