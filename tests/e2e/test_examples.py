"""The examples run as the README shows them, with a private cluster they stop themselves."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from helpers import signal_after_first_line, wait_until

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / "kv_transfer.py"), *args], capture_output=True, text=True, timeout=180
    )


def test_kv_transfer_moves_chunks_byte_exact_and_stops_its_cluster() -> None:
    result = _run("--total", "8MiB", "--agents", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stored" in result.stdout and "Traceback" not in result.stderr


def test_kv_transfer_on_a_given_server_stops_its_own_agents_and_leaves_the_server(redis_url: str) -> None:
    """With --redis-url the example starts agents of its own on that server, in a namespace of its
    own, and stops them; its last line said "stopped the cluster", though the server runs on."""
    result = _run("--total", "8MiB", "--agents", "1", "--redis-url", redis_url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stopped the 1 agent(s) it started; the server at --redis-url runs on" in result.stdout, result.stdout
    assert f"cluster: index {redis_url}, 1 agents" in result.stdout, result.stdout
    server = redis.Redis.from_url(redis_url)
    try:
        assert server.ping()  # left running
    finally:
        server.close()


def test_kv_transfer_refuses_a_size_it_cannot_read_as_usage() -> None:
    """--total abc ended in a traceback (ConfigError raised outside the example's try)."""
    result = _run("--total", "abc")
    assert result.returncode == 2, result.stderr
    assert "not a size" in result.stderr and "Traceback" not in result.stderr


def test_kv_transfer_refuses_no_agents_as_usage() -> None:
    """--agents 0 started a cluster with nowhere to store, then failed with NoCapacity (exit 1)."""
    result = _run("--agents", "0")
    assert result.returncode == 2, result.stderr
    assert "--agents 0: at least one agent" in result.stderr and "Traceback" not in result.stderr


def test_kv_transfer_refuses_a_total_under_one_chunk_as_usage() -> None:
    """--total 0, 1 or 1MiB each moved one 8 MiB chunk and exited 0 without a word."""
    result = _run("--total", "1MiB")
    assert result.returncode == 2, result.stderr
    assert "--total 1048576 is less than one chunk (8.0 MiB)" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT", "SIGHUP"])
def test_kv_transfer_stopped_by_a_signal_stops_its_cluster_without_a_traceback(sig: signal.Signals) -> None:
    """Ctrl-C printed a KeyboardInterrupt traceback, and SIGHUP ended it on the spot: it now
    unwinds, its cluster's processes stopped, and exits 128 + the signal's number."""
    children: list[int] = []

    def cluster_up(line: str, pid: int) -> None:  # its first line is printed once its cluster is up
        assert line.startswith("cluster: "), line
        children.extend(children_of(pid))
        assert children, "the cluster's processes"

    cmd = [sys.executable, str(EXAMPLES / "kv_transfer.py"), "--total", "64MiB", "--agents", "1"]
    status, err = signal_after_first_line(cmd, sig, on_line=cluster_up)
    assert status == 128 + sig, err
    assert "Traceback" not in err, err
    assert wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), 10.0), children


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                status = (entry / "status").read_text()
                if f"\nPPid:\t{pid}\n" in status:
                    found.append(int(entry.name))
    return found


#: Runs the example with its reader replaced (the example's module looks `reader` up at each
#: call), so that a reader that dies or fails can be had on demand. Spawned readers import this
#: script again as their main module, and find the replacement there.
DRIVER = """
import os
import sys

sys.path.insert(0, {examples!r})
import kv_transfer

real_reader = kv_transfer.reader


def dying_reader(url, namespace, count, transport, queue):
    os._exit(3)  # as a reader killed by the OOM killer, or crashed, would end: without a word


def reader_of_another_namespace(url, namespace, count, transport, queue):
    real_reader(url, namespace + "-elsewhere", count, transport, queue)  # its keys are not there


if __name__ == "__main__":
    kv_transfer.reader = {replacement}
    sys.argv = ["kv_transfer.py", "--total", "8MiB", "--agents", "1"]
    sys.exit(kv_transfer.main())
"""


def _run_with_reader(tmp_path: Path, replacement: str) -> subprocess.CompletedProcess[str]:
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(examples=str(EXAMPLES), replacement=replacement))
    return subprocess.run([sys.executable, str(driver)], capture_output=True, text=True, timeout=120)


def test_kv_transfer_says_so_when_its_reader_dies_without_answering(tmp_path: Path) -> None:
    """The example waited 300 s for a reader that had died, then ended with a queue.Empty traceback."""
    result = _run_with_reader(tmp_path, "dying_reader")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the reader over shm ended with exit status 3 before answering" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_kv_transfer_relays_its_readers_error(tmp_path: Path) -> None:
    """A reader the store refused (here: keys it cannot find) ended with a traceback in the child,
    and the example waited 300 s for its answer."""
    result = _run_with_reader(tmp_path, "reader_of_another_namespace")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the reader over shm failed: KeyNotFound" in result.stderr, result.stderr
    assert "doc/chunk/0" in result.stderr and "Traceback" not in result.stderr
