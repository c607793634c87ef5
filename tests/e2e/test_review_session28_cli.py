"""The live views on a terminal and a foreground cluster into a file (review, twenty-eighth session)."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from helpers import interrupt, mooncake_bin

from .conftest import Mooncake


def _read_pty(fd: int, seconds: float, until: bytes) -> bytes:
    """What the terminal shows within ``seconds``, or until ``until`` appears (bounded reads)."""
    buf = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and until not in buf:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                data = os.read(fd, 65536)
            except OSError:
                break
            if not data:
                break
            buf += data
    return buf


def test_stat_watch_on_an_80_column_terminal_shows_every_counter(cluster_cli: Mooncake) -> None:
    """A Live display crops the lines of a soft-wrapping console at the terminal's width: in 80
    columns the totals ended at "... evict", and the counters after it (evicted, corrupt, short:
    the one the README has people watch during rolling restarts) never showed."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {k: v for k, v in cluster_cli.env.items() if k not in ("COLUMNS", "LINES")}
    env["TERM"] = "xterm"
    proc = subprocess.Popen(
        [mooncake_bin(), "stat", "--watch", "--interval", "0.5"],
        stdin=child,
        stdout=child,
        stderr=child,
        env=env,
        start_new_session=True,
    )
    os.close(child)
    try:
        shown = _read_pty(main, 30, until=b"short")
    finally:
        interrupt(proc)
        os.close(main)
    text = shown.decode(errors="replace")
    assert "agent-0" in text, text[-2000:]
    assert "short" in text and "corrupt" in text, text[-2000:]


def test_a_foreground_cluster_into_a_file_leaves_its_output_whole(mooncake: Mooncake, tmp_path: Path) -> None:
    """`mooncake up > log 2>&1` showed one frame of the live view, cropped, at the stop, with no
    newline before the stop's report ("... evictestopped 2 process(es)"). Into a file it now
    says what started and, at the stop, what was stopped, each on lines of their own."""
    log = tmp_path / "up.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [mooncake_bin(), "up", "--agents", "1", "--host-mem", "16MiB"], stdout=sink, stderr=sink, env=mooncake.env
        )
    try:
        deadline = time.monotonic() + 60
        while not (mooncake.state_dir / "cluster.json").exists() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
        time.sleep(1.5)  # a refresh of a live view, had there been one
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, log.read_text()
    lines = log.read_text().splitlines()
    assert any(line.startswith("stopped ") and "process(es)" in line for line in lines), lines
    assert not any("Ctrl-C stops the cluster" in line for line in lines), lines  # no live frame


INTERRUPTED_IMPORT = """
import sys

class CtrlCDuringImport:
    # As a Ctrl-C in the second the command's modules take to import.
    def find_spec(self, name, path=None, target=None):
        if name == "mooncake_cli.main":
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, CtrlCDuringImport())
from mooncake_cli.entry import main
main()
"""


def test_a_ctrl_c_while_the_command_imports_exits_130_without_a_traceback() -> None:
    """A Ctrl-C in the first ~1 s of any command (its imports) printed a KeyboardInterrupt
    traceback from inside typer or rich."""
    result = subprocess.run([sys.executable, "-c", INTERRUPTED_IMPORT], capture_output=True, timeout=60, check=False)
    assert result.returncode == 130, result.stderr.decode()
    assert b"Traceback" not in result.stderr, result.stderr.decode()
