"""The benchmark scripts stopped by Ctrl-C or a closed terminal: Ctrl-C printed a KeyboardInterrupt
traceback and SIGHUP ended a run on the spot (its children then left to their watchdogs). Each
now unwinds as SIGTERM did, and exits 128 + the signal's number without a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP, signal.SIGTERM], ids=["SIGINT", "SIGHUP", "SIGTERM"])
def test_a_benchmark_stopped_by_a_signal_exits_without_a_traceback(sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "allocator.py"), "--quick"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},  # its first line read as it is printed
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline()  # its machine line: the handlers are in place, the rounds begin
        proc.send_signal(sig)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, err
    assert b"Traceback" not in err, err
