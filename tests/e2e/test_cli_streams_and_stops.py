"""The CLI with a standard stream closed, `ls` into a pipe and a narrow terminal, `bench` stopped by
a signal or facing a recorded cluster whose server died, and a `demo` document past its bound.

- `get` with stdout closed (`>&-`) and `put KEY -` with stdin closed (`<&-`) failed with
  "internal error: AttributeError: 'NoneType' object has no attribute 'buffer'"; `ls` with stdout
  closed lost its listing and exited 0. Each is now a usage error (2) that says the stream is closed.
- `ls` cut long keys and node ids with "…", into a pipe too (80 columns there): a key read back
  from the listing did not exist. Into a pipe each row is whole; a narrow terminal folds them.
- `bench` stopped by SIGTERM or SIGHUP left its objects under bench/<uuid>/ (it handled SIGINT
  alone), then exited 130 for either, as for Ctrl-C (now 143, 129), and facing a dead recorded
  server it advised `mooncake up`, which is then refused.
- `demo --doc-tokens 99999999999` failed in torch's allocator after the model was built.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest
from helpers import mooncake_bin, read_terminal

from .conftest import HOST_MEM, Mooncake, assert_one_line_error, make_mooncake

LONG_KEY = "long/" + "x" * 150 + "/end"


def _with_closed(cli: Mooncake, fd: int, *args: str) -> subprocess.CompletedProcess[bytes]:
    """Run the CLI with descriptor ``fd`` closed, as the shell's `>&-` / `<&-` do."""
    return subprocess.run(
        [mooncake_bin(), *args],
        env=cli.env,
        timeout=60,
        check=False,
        stdin=subprocess.DEVNULL if fd != 0 else None,
        stdout=subprocess.PIPE if fd != 1 else None,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: os.close(fd),
    )


def test_a_closed_stdout_or_stdin_is_a_usage_error_that_says_so(cluster_cli: Mooncake) -> None:
    cluster_cli.ok("put", "closed/k", "-", stdin=b"hello")
    for args in (("get", "closed/k"), ("ls",), ("ls", "--json"), ("stat",)):
        assert_one_line_error(_with_closed(cluster_cli, 1, *args), 2, "stdout is closed")
    # Output to a file needs no stdout.
    result = _with_closed(cluster_cli, 1, "get", "closed/k", "-o", os.devnull)
    assert result.returncode == 0, result.stderr
    assert_one_line_error(_with_closed(cluster_cli, 0, "put", "closed/k2", "-"), 2, "stdin is closed")
    assert cluster_cli("get", "closed/k2").returncode == 3  # nothing was stored


def test_commands_whose_output_only_tells_what_was_done_work_with_stdout_closed(
    cluster_cli: Mooncake, mooncake: Mooncake
) -> None:
    """An agent's banner and `down`'s summary are no output anyone needs: with stdout closed the
    agent serves (it exited 2 right after it started) and `down` stops the cluster with 0."""
    redis_url = cluster_cli.state()["redis_url"]
    agent = subprocess.Popen(
        [mooncake_bin(), "agent", "--redis-url", redis_url, "--host-mem", "32MiB", "--node-id", "closed-stdout"],
        env={**cluster_cli.env, "MOONCAKE_NAMESPACE": cluster_cli.state()["namespace"]},
        stdin=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: os.close(1),
    )
    try:

        def joined() -> bool:
            nodes = json.loads(cluster_cli.ok("stat", "--json").stdout)["nodes"]
            return any(n["node_id"] == "closed-stdout" and n["alive"] for n in nodes)

        deadline = time.monotonic() + 60
        while not joined():
            assert agent.poll() is None, f"the agent exited {agent.returncode}"
            assert time.monotonic() < deadline, "the agent never joined"
            time.sleep(0.2)
    finally:
        agent.terminate()
        agent.wait(timeout=30)

    mooncake.ok("up", "--detach", "--agents", "1", "--host-mem", HOST_MEM)
    try:
        result = _with_closed(mooncake, 1, "down")
        assert result.returncode == 0, result.stderr
        assert not (mooncake.state_dir / "cluster.json").exists()
    finally:
        mooncake("down", "--timeout", "5")


def test_ls_prints_whole_keys_into_a_pipe_and_folds_them_on_a_narrow_terminal(cluster_cli: Mooncake) -> None:
    cluster_cli.ok("put", LONG_KEY, "-", stdin=b"abc")
    piped = cluster_cli.ok("ls", "long/*", env={"COLUMNS": "30"}).stdout.decode()
    assert LONG_KEY in piped.split() and "…" not in piped, piped
    assert "agent-" in piped

    # On a terminal 30 columns wide: folded onto further lines, nothing cut.
    shown = _on_terminal(cluster_cli, 30, "ls", "long/*")
    assert all(len(line) <= 30 for line in shown), shown
    assert "…" not in "".join(shown)
    assert LONG_KEY in "".join(line.strip() for line in shown), shown


def test_ls_prints_keys_holding_line_or_paragraph_separators_whole(cluster_cli: Mooncake) -> None:
    """U+2028 and U+2029 are allowed in keys (neither is C0 or C1), and rich measures a text by
    its str.splitlines() pieces: the key column was the width of the longest piece, and such a key
    was cut with "…" into a pipe, where `get` of the key read back from the listing failed."""
    keys = ["sep/l1\u2028line-two", "sep/p1\u2029para-two"]
    for key in keys:
        cluster_cli.ok("put", "--", key, "-", stdin=b"x")
    piped = cluster_cli.ok("ls", "sep/*").stdout.decode()
    rows = piped.split("\n")[1:3]  # a file's lines: split at newlines only, as a script reads them
    assert [row.split("  ")[0] for row in rows] == keys and "…" not in piped, rows
    for row in rows:
        assert cluster_cli.ok("get", "--", row.split("  ")[0], "-").stdout == b"x"


def test_bench_figures_are_whole_in_a_pipe_and_on_a_narrow_terminal(cluster_cli: Mooncake) -> None:
    """rich cut them to "0.…" in 40 columns, into a pipe (80) too where a row was longer."""
    args = ("bench", "--seconds", "0.05", "--sizes", "4KiB", "--transport", "tcp")
    piped = cluster_cli.ok(*args, env={"COLUMNS": "40"}).stdout.decode()
    assert "path  size   memcpy" in piped and "get/memcpy  keys" in piped and "…" not in piped, piped
    shown = _on_terminal(cluster_cli, 40, *args)
    # The header line is soft-wrapped by the terminal itself: whole, on as many rows as it takes.
    assert all(len(line) <= 40 for line in shown if not line.startswith("index ")), shown
    assert "…" not in "".join(shown)
    assert any(line.startswith("tcp 4 KiB") for line in shown), shown
    assert any("get/memcpy" in line and "keys 64" in line for line in shown), shown


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_bench_stopped_by_a_signal_removes_its_keys(cluster_cli: Mooncake, sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        [mooncake_bin(), "bench", "--seconds", "2", "--transport", "tcp"],
        env=cluster_cli.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not json.loads(cluster_cli.ok("ls", "bench/*", "--json").stdout or b"[]"):
            assert time.monotonic() < deadline, "bench wrote no keys within 60 s"
            assert proc.poll() is None, f"bench ended ({proc.returncode}) before it wrote keys"
            time.sleep(0.1)
        proc.send_signal(sig)
        # 128 + the signal's number, as a shell reports it (it exited 130 for each, as for Ctrl-C).
        assert proc.wait(timeout=60) == 128 + sig
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    left = json.loads(cluster_cli.ok("ls", "bench/*", "--json").stdout or b"[]")
    assert left == [], f"{len(left)} bench keys left after {sig.name}, e.g. {left[0]['key']}"


def test_bench_facing_a_dead_recorded_server_says_to_run_down_first(tmp_path_factory: pytest.TempPathFactory) -> None:
    cli = make_mooncake(tmp_path_factory.mktemp("dead-server"))
    cli.ok("up", "--detach", "--agents", "1", "--host-mem", HOST_MEM)
    try:
        for server in cli.state()["servers"]:
            os.kill(server["pid"], signal.SIGKILL)
        assert_one_line_error(cli("bench", "--seconds", "0.05"), 4, "mooncake down")
    finally:
        cli("down", "--timeout", "5")


def test_demo_refuses_a_document_past_its_bound_before_building_anything(mooncake: Mooncake) -> None:
    result = mooncake("demo", "--doc-tokens", "99999999999", timeout=60)
    assert result.returncode == 2, result.stderr
    assert b"99999999999 is more than 1048576" in result.stderr


def _on_terminal(cli: Mooncake, columns: int, *args: str) -> list[str]:
    """The lines ``args`` print on a terminal ``columns`` wide (a pseudo-terminal), styles left out."""
    main, sub = os.openpty()
    try:
        proc = subprocess.Popen(
            [mooncake_bin(), *args],
            env={**cli.env, "COLUMNS": str(columns)},
            stdin=subprocess.DEVNULL,
            stdout=sub,
            stderr=subprocess.DEVNULL,
        )
        os.close(sub)
        shown = read_terminal(main, proc)
        assert proc.wait(timeout=30) == 0
    finally:
        os.close(main)
    return re.sub(r"\x1b\[[0-9;]*m", "", shown.decode()).splitlines()  # bold stays under NO_COLOR
