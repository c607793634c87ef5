"""Commands stopped by signals, and keys that are not UTF-8 on the command line.

- `bench` cleaning up after a SIGTERM was cut short by a second signal (its handler raised again
  inside the removal), leaving objects under bench/<uuid>/ and the second signal's status.
- `stat --watch` ended by SIGTERM or SIGHUP died by the default action: on a terminal the cursor
  the live view had hidden stayed hidden. It unwinds now and exits 128 + the signal's number.
- A key given as bytes that are not UTF-8 was quoted as the lone surrogate Python decodes such a
  byte to (`'\\udcff'`); it is quoted as the byte (`'\\xff'`), and a character that repr() showed
  the same way (U+00A0 as `'\\xa0'`) as `'\\u00a0'`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from helpers import mooncake_bin, read_terminal

from .conftest import Mooncake, assert_one_line_error

#: A key as `mooncake put $'bad\xff' -` passes it: the byte 0xff, not UTF-8.
UNDECODABLE = os.fsdecode(b"bad\xff")


def _bench_keys(cli: Mooncake) -> list[str]:
    return [row["key"] for row in json.loads(cli.ok("ls", "bench/*", "--json").stdout or b"[]")]


def test_signals_during_bench_cleanup_neither_cut_it_short_nor_change_the_status(cluster_cli: Mooncake) -> None:
    proc = subprocess.Popen(
        [mooncake_bin(), "bench", "--seconds", "60", "--sizes", "64KiB", "--transport", "tcp"],
        env=cluster_cli.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not _bench_keys(cluster_cli):  # the put loop has started
            assert time.monotonic() < deadline, "bench wrote no keys within 60 s"
            assert proc.poll() is None, f"bench ended ({proc.returncode}) before it wrote keys"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        # More signals, as from an impatient user or a supervisor, until it ends: some land while
        # it removes its objects. Bounded by count and time.
        deadline = time.monotonic() + 30
        for n in range(20_000):
            if proc.poll() is not None or time.monotonic() > deadline:
                break
            proc.send_signal(signal.SIGINT if n % 2 else signal.SIGTERM)
            time.sleep(0.001)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    left = _bench_keys(cluster_cli)
    assert left == [], f"{len(left)} bench keys left after repeated signals, e.g. {left[0]}"
    # The first signal's status: SIGTERM's, or SIGINT's where both were pending at once (the main
    # thread in a call that does not return to Python for a while): the interpreter then runs the
    # handlers in signal-number order, SIGINT (2) first. Not any other: no later one changed it.
    assert proc.returncode in (128 + signal.SIGTERM, 128 + signal.SIGINT), stderr.decode(errors="replace")
    assert b"Traceback" not in stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_stat_watch_on_a_terminal_stopped_by_a_signal_shows_the_cursor_again(
    cluster_cli: Mooncake, sig: signal.Signals
) -> None:
    main, sub = os.openpty()
    try:
        proc = subprocess.Popen(
            [mooncake_bin(), "stat", "--watch", "--interval", "0.2"],
            env={**cluster_cli.env, "TERM": "xterm"},
            stdin=subprocess.DEVNULL,
            stdout=sub,
            stderr=subprocess.DEVNULL,
        )
        os.close(sub)
        hide, show = b"\x1b[?25l", b"\x1b[?25h"
        signalled = []

        def signal_once_drawn(shown: bytes) -> None:
            if not signalled and hide in shown and b"agent-" in shown:  # the live view is drawn
                proc.send_signal(sig)
                signalled.append(sig)

        shown = read_terminal(main, proc, each=signal_once_drawn)
        assert signalled, shown[-2000:]
        code = proc.wait(timeout=30)
    finally:
        os.close(main)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert code == 128 + sig, shown[-2000:]
    assert shown.rfind(show) > shown.rfind(hide), "the cursor stayed hidden"


@pytest.mark.parametrize(
    "args",
    [("put", UNDECODABLE, "-"), ("get", UNDECODABLE), ("rm", "fine", UNDECODABLE), ("ls", UNDECODABLE + "*")],
    ids=["put", "get", "rm", "ls"],
)
def test_a_key_that_is_not_utf8_is_refused_naming_its_byte(cluster_cli: Mooncake, args: tuple[str, ...]) -> None:
    line = assert_one_line_error(cluster_cli(*args, stdin=b"x"), 2, "'bad\\xff", "\\xff (character 4)")
    assert "udc" not in line, line


def test_a_missing_key_is_named_so_that_no_character_looks_like_a_byte(cluster_cli: Mooncake) -> None:
    """U+00A0 (no-break space) is a key's character like any other; repr() shows it as '\\xa0',
    as a byte 0xa0 that is not UTF-8 is shown now."""
    key = "nbsp\u00a0"
    assert_one_line_error(cluster_cli("get", key), 3, "key 'nbsp\\u00a0' not found")
    assert_one_line_error(cluster_cli("rm", key), 3, "1 key(s) not found: 'nbsp\\u00a0'")
