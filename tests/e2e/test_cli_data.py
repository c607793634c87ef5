"""put / get / ls / rm / stat / doctor / agent against a detached cluster, all through the console script."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis
from helpers import mooncake_bin

from mooncake_store.embedded import EmbeddedServer

from .conftest import Mooncake, assert_one_line_error


def test_put_get_10mib_byte_exact_from_separate_processes(cluster_cli: Mooncake, tmp_path: Path) -> None:
    src = tmp_path / "blob.bin"
    src.write_bytes(os.urandom(10 << 20))
    put = cluster_cli.ok("put", "blob", str(src))
    assert "put blob (10.0 MiB" in put.stderr.decode()
    out = tmp_path / "back.bin"
    cluster_cli.ok("get", "blob", "-o", str(out))  # another process than the put
    assert out.read_bytes() == src.read_bytes()
    # As `put KEY FILE` takes it, `get KEY FILE` writes it (it was refused: "unexpected extra argument").
    out.unlink()
    cluster_cli.ok("get", "blob", str(out))
    assert out.read_bytes() == src.read_bytes()


def test_stdin_put_and_replace(cluster_cli: Mooncake) -> None:
    cluster_cli.ok("put", "greeting", "-", stdin=b"hello")
    cluster_cli.ok("put", "greeting", "-", stdin=b"hello again")  # replaces atomically
    assert cluster_cli.ok("get", "greeting", "-o", "-").stdout == b"hello again"
    assert cluster_cli.ok("get", "greeting", "-").stdout == b"hello again"
    assert_one_line_error(cluster_cli("get", "greeting", "a", "-o", "b"), 2, "two places to write to")
    cluster_cli.ok("put", "empty", "-", stdin=b"")
    assert cluster_cli.ok("get", "empty").stdout == b""  # a 0-byte object round-trips too


def test_stat_json_shows_both_agents(cluster_cli: Mooncake) -> None:
    asked_ms = time.time() * 1000
    data = json.loads(cluster_cli.ok("stat", "--json").stdout)
    answered_ms = time.time() * 1000
    nodes = {n["node_id"]: n for n in data["nodes"]}
    assert {"agent-0", "agent-1"} <= set(nodes)
    for node_id in ("agent-0", "agent-1"):
        node = nodes[node_id]
        assert node["alive"] is True
        assert node["tiers"][0]["tier"] == "host"
        assert node["tiers"][0]["capacity_bytes"] == 64 << 20
        assert "shm" in node["transports"] and "tcp" in node["transports"]
    assert data["namespace"] == "default"
    assert data["redis_url"] == cluster_cli.state()["redis_url"]
    table = cluster_cli.ok("stat").stdout.decode()
    assert "agent-0" in table and "agent-1" in table and "2/2 alive" in table
    # The activity table: per node and tier, what was served and moved under pressure.
    for column in ("up", "hits", "reads", "demoted", "promoted", "spill out", "spill in", "evicted", "copied", "ratio"):
        assert column in table, column
    assert "evicted 0" in table and "short 0" in table
    assert data["short"] == 0  # objects short of their replicas since a node's loss
    # The counters count from each agent's start, which stat() and --json carry.
    assert all(0 < nodes[n]["started_ms"] <= time.time() * 1000 for n in ("agent-0", "agent-1"))
    # The uptime by the index server's clock, as the start is stamped (one host here: its clock too),
    # at some moment while the command ran (a loaded machine takes seconds to start a CLI).
    for n in ("agent-0", "agent-1"):
        earliest, latest = ((t - nodes[n]["started_ms"]) / 1000 for t in (asked_ms, answered_ms))
        assert earliest - 1 <= nodes[n]["uptime_s"] <= latest + 1, (earliest, nodes[n]["uptime_s"], latest)


def test_stat_fits_an_80_column_pipe_with_every_header_whole(cluster_cli: Mooncake) -> None:
    """The activity table needed ~85 columns, so an 80-column pipe cut its headers ("spill o…").
    Its two-word headers now fold onto two lines instead."""
    table = cluster_cli.ok("stat", env={"COLUMNS": "80"}).stdout.decode()
    assert "…" not in table, table
    (header,) = [line for line in table.splitlines() if "promoted" in line]
    assert len(header) <= 80, table
    for column in ("hits", "reads", "demoted", "promoted", "spill", "out", "in", "evicted", "copied", "ratio"):
        assert column in table, column


def test_ls_and_rm(cluster_cli: Mooncake) -> None:
    cluster_cli.ok("put", "ls-a", "-", stdin=b"a" * 100)
    cluster_cli.ok("put", "ls-b", "-", stdin=b"b" * 200)
    listing = json.loads(cluster_cli.ok("ls", "ls-*", "--json").stdout)
    assert [(k["key"], k["size_bytes"]) for k in listing] == [("ls-a", 100), ("ls-b", 200)]
    assert listing[0]["replicas"][0]["node_id"] in ("agent-0", "agent-1")
    table = cluster_cli.ok("ls", "ls-*").stdout.decode()
    assert "ls-a" in table and "100 B" in table and "host" in table
    # "limit reached" only when the limit cut the listing short, not when it was met exactly.
    assert "limit" not in cluster_cli.ok("ls", "ls-*", "--limit", "2").stderr.decode()
    cut = cluster_cli.ok("ls", "ls-*", "--limit", "1")
    assert "limit 1 reached" in cut.stderr.decode() and cut.stdout.decode().count("ls-") == 1

    cluster_cli.ok("rm", "ls-a", "ls-b")
    assert json.loads(cluster_cli.ok("ls", "ls-*", "--json").stdout) == []
    assert_one_line_error(cluster_cli("get", "ls-a"), 3, "'ls-a'", "not found")
    # rm of a missing key: exit 3 naming it, unless --force.
    assert_one_line_error(cluster_cli("rm", "ls-a"), 3, "'ls-a'")


def test_no_capacity_is_exit_5(cluster_cli: Mooncake, tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    with big.open("wb") as fh:
        fh.truncate(80 << 20)  # sparse: bigger than any 64 MiB arena
    assert_one_line_error(cluster_cli("put", "too-big", str(big)), 5)


def test_up_refuses_while_running(cluster_cli: Mooncake) -> None:
    assert_one_line_error(cluster_cli("up", "--detach", "--host-mem", "64MiB"), 1, "already running")


def test_doctor_passes_on_a_running_cluster(cluster_cli: Mooncake) -> None:
    result = cluster_cli("doctor")
    text = result.stdout.decode()
    assert result.returncode == 0, text
    names = [line.split()[1] for line in text.splitlines() if line.strip()]
    assert names == ["redis", "clock", "eviction", "agents", "endpoints", "shm", "tcp", "rdma", "gpu"]
    assert "2 of 2 alive" in text
    checks = json.loads(cluster_cli.ok("doctor", "--json").stdout)
    assert {c["name"]: c["status"] for c in checks}["redis"] == "ok"
    assert {c["name"]: c["status"] for c in checks}["eviction"] == "ok"


def test_doctor_warns_of_a_server_that_evicts_keys(mooncake: Mooncake) -> None:
    """A server whose maxmemory-policy evicts keys drops node records, object records and leases
    when memory runs short: the index then loses objects and arena memory with no error, and every
    check said ✓. doctor warns, naming the policy and the fix."""
    with EmbeddedServer() as server:
        redis.Redis.from_url(server.url).config_set("maxmemory-policy", "allkeys-lru")
        result = mooncake("doctor", "--json", "--redis-url", server.url)
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    assert checks["eviction"]["status"] == "warn", checks["eviction"]
    assert "maxmemory-policy allkeys-lru" in checks["eviction"]["detail"]
    assert "noeviction" in checks["eviction"]["detail"]


def test_agent_command_joins_and_leaves(cluster_cli: Mooncake) -> None:
    url = cluster_cli.state()["redis_url"]
    proc = cluster_cli.popen(
        "agent", "--redis-url", url, "--namespace", "extra", "--host-mem", "16MiB", "--node-id", "n1", "--ready-json"
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline().decode() if ready else ""
        assert line.startswith("READY "), (line, proc.poll())
        shm = Path("/dev/shm") / json.loads(line[6:])["shm_name"]
        assert shm.exists()
        data = json.loads(cluster_cli.ok("stat", "--json", "--namespace", "extra").stdout)
        assert [n["node_id"] for n in data["nodes"]] == ["n1"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert not shm.exists()
        data = json.loads(cluster_cli.ok("stat", "--json", "--namespace", "extra").stdout)
        assert data["nodes"] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_agent_command_on_a_port_in_use_is_a_usage_error(cluster_cli: Mooncake) -> None:
    """A port already taken is the command line's to fix (exit 2, the port and what to do said),
    not "cannot connect" (4), which sends the operator looking for Redis."""
    url = cluster_cli.state()["redis_url"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = cluster_cli(
            "agent",
            "--redis-url",
            url,
            "--namespace",
            "busyport",
            "--host-mem",
            "16MiB",
            "--listen",
            f"127.0.0.1:{port}",
        )
    err = result.stderr.decode()
    assert result.returncode == 2, (result.returncode, err)
    assert f"cannot listen on 127.0.0.1:{port}" in err and "in use" in err and "port 0" in err, err
    assert json.loads(cluster_cli.ok("stat", "--json", "--namespace", "busyport").stdout)["nodes"] == []


def test_agent_command_without_a_url_joins_the_recorded_cluster(cluster_cli: Mooncake) -> None:
    """`mooncake stat` on a cluster without agents says "start one with `mooncake agent`": with
    no URL given anywhere, the agent joins the cluster `mooncake up` recorded (it used to exit 2,
    "an agent needs a cluster"), in that cluster's namespace."""
    before = {n["node_id"] for n in json.loads(cluster_cli.ok("stat", "--json").stdout)["nodes"]}
    proc = cluster_cli.popen("agent", "--host-mem", "16MiB", "--node-id", "joined", "--ready-json")
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline().decode() if ready else ""
        assert line.startswith("READY "), (line, proc.poll(), proc.stderr.read().decode() if proc.poll() else "")
        nodes = {n["node_id"] for n in json.loads(cluster_cli.ok("stat", "--json").stdout)["nodes"]}
        assert nodes == before | {"joined"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_put_from_a_fifo_stores_what_comes_through_it(cluster_cli: Mooncake, tmp_path: Path) -> None:
    """The size of a pipe, a FIFO or a /proc file is 0: `put k <(cmd)` stored 0 B and said ✓."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    payload = os.urandom(300_000)
    proc = cluster_cli.popen("put", "via-fifo", str(fifo))
    with fifo.open("wb") as w:  # opens once the CLI opens its end
        w.write(payload)
    assert proc.wait(timeout=60) == 0, proc.stderr.read().decode() if proc.stderr else ""
    if proc.stdout:
        proc.stdout.close()
    if proc.stderr:
        proc.stderr.close()
    assert cluster_cli.ok("get", "via-fifo").stdout == payload


def test_an_endless_stream_is_read_no_further_than_a_node_could_hold(cluster_cli: Mooncake, mooncake: Mooncake) -> None:
    """`mooncake put k /dev/zero` (or an endless stdin) read until the machine ran out of memory,
    before it even looked for the cluster: now it stops one byte past the largest host tier."""
    result = cluster_cli("put", "endless", "/dev/zero")
    assert_one_line_error(result, 5, "/dev/zero holds more than 67108864 B (64.0 MiB)", "no node could store it")
    assert not json.loads(cluster_cli.ok("ls", "endless", "--json").stdout)
    # With no cluster to talk to, nothing is read at all.
    assert_one_line_error(mooncake("put", "k", "/dev/zero"), 4, "no cluster to talk to")


def test_a_get_counts_a_miss_and_a_reader_that_leaves_early_is_no_error(cluster_cli: Mooncake) -> None:
    """`mooncake get` looked the size up first (which counts nothing) and said "not found" itself,
    so stat() never counted its misses; and `get big | head -c 10` exited 1 (the framework turns
    an escaping EPIPE into status 1)."""

    before = json.loads(cluster_cli.ok("stat", "--json").stdout)
    assert_one_line_error(cluster_cli("get", "never-put"), 3, "'never-put'", "not found")
    after = json.loads(cluster_cli.ok("stat", "--json").stdout)
    assert after["misses"] == before["misses"] + 1, (before.get("misses"), after.get("misses"))
    cluster_cli.ok("put", "big-for-head", "-", stdin=os.urandom(8 << 20))
    proc = cluster_cli.popen("get", "big-for-head")
    assert proc.stdout is not None and proc.stderr is not None
    assert len(proc.stdout.read(10)) == 10
    proc.stdout.close()  # the reader leaves, as head does
    assert proc.wait(timeout=60) == 0, proc.stderr.read().decode()
    proc.stderr.close()


def test_a_get_to_a_full_device_names_where_it_could_not_write(cluster_cli: Mooncake) -> None:
    """`mooncake get k > /dev/full` said only "No space left on device", naming neither the key nor
    stdout."""
    cluster_cli.ok("put", "to-full", "-", stdin=b"x" * 100_000)
    with open("/dev/full", "wb") as full:
        result = subprocess.run(
            [mooncake_bin(), "get", "to-full"], stdout=full, stderr=subprocess.PIPE, env=cluster_cli.env, timeout=60
        )
    assert result.returncode == 1, result.stderr
    (line,) = [x for x in result.stderr.decode().splitlines() if x.strip()]  # no traceback at exit either
    assert line == "error: cannot write 'to-full' to stdout: No space left on device", line
    # To a file too; a small object fails only at the file's close, whose error replaced this one.
    cluster_cli.ok("put", "small-to-full", "-", stdin=b"y" * 100)
    for key in ("to-full", "small-to-full"):
        assert_one_line_error(
            cluster_cli("get", key, "-o", "/dev/full"), 1, f"cannot write '{key}' to /dev/full: No space left"
        )


def test_get_returns_one_whole_object_while_the_key_is_replaced_by_smaller_ones(cluster_cli: Mooncake) -> None:
    """`mooncake get` sized its buffer from a lookup, then read: a key replaced by a smaller object
    in between came out as the new bytes followed by uninitialised memory, with exit status 0.
    It now keeps only what the read wrote. (The CLI's fetch, in this process, against a writer
    alternating a 4 MiB and a 16 B value; bounded in count and time.) The replaced values wait in
    the agents' graveyards for their read leases, so on a loaded machine both arenas fill and a
    pressure pass may evict the key's current value before the writer's next one lands: this is a
    cache, and such a read is a miss (KeyNotFound), not a wrong value."""
    import threading

    import numpy as np
    from mooncake_cli.commands.data import _fetch

    from mooncake_store import KeyNotFound, connect

    big, small = np.full(4 << 20, ord("A"), np.uint8), np.full(16, ord("B"), np.uint8)
    with connect(cluster_cli.state()["redis_url"]) as client:
        client.put("race", big)
        stop = threading.Event()

        def writer() -> None:
            for i in range(2000):
                if stop.is_set():
                    return
                client.put("race", big if i % 2 else small)

        thread = threading.Thread(target=writer)
        thread.start()
        wrong = []
        whole = misses = 0
        try:
            deadline = time.monotonic() + 10
            for _ in range(300):
                if time.monotonic() > deadline:
                    break
                try:
                    got = _fetch(client, "race")
                except KeyNotFound:
                    misses += 1
                    continue
                if np.array_equal(got, big) or np.array_equal(got, small):
                    whole += 1
                else:
                    wrong.append((len(got), bytes(got[:20])))
        finally:
            stop.set()
            thread.join(30)
    assert not wrong, f"{len(wrong)} reads were neither value, first {wrong[0]}"
    assert whole >= 10, f"{whole} whole reads ({misses} misses): the race was hardly run"


def test_rm_of_a_key_named_twice_removes_it_once_and_succeeds(cluster_cli: Mooncake) -> None:
    """`rm a a` said "1 key(s) not found: 'a' (removed 1 other(s))" and exited 3."""
    cluster_cli.ok("put", "twice", "-", stdin=b"x")
    result = cluster_cli.ok("rm", "twice", "twice")
    assert "removed 1 key(s)" in result.stderr.decode()
    assert_one_line_error(cluster_cli("get", "twice"), 3, "'twice'", "not found")


def test_put_of_a_proc_file_stores_its_bytes(cluster_cli: Mooncake) -> None:
    """A file of /proc is a regular file of size 0: `mooncake put k /proc/version` stored 0 B and
    said ✓ (only pipes and FIFOs were read to their end)."""
    cluster_cli.ok("put", "proc-version", "/proc/version")
    stored = cluster_cli.ok("get", "proc-version").stdout
    assert stored and stored == Path("/proc/version").read_bytes()


def test_a_file_cut_short_while_it_is_read_is_refused_not_stored(tmp_path: Path) -> None:
    """A file was mapped, and one truncated by another process during the put killed the command
    with SIGBUS (its reservation then blocked other puts until it timed out). It is read now, and
    a file that holds less once read than it did when opened is refused, naming both sizes."""
    from mooncake_cli.commands.data import _read_file
    from mooncake_cli.exits import CliError

    src = tmp_path / "shrinks.bin"
    src.write_bytes(os.urandom(1 << 20))
    with src.open("rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        os.truncate(src, 1000)  # another process, between the open and the read
        try:
            _read_file(fh, size, name=str(src))
        except CliError as exc:
            assert f"was {1 << 20} B when opened and 1000 B once read" in str(exc)
        else:
            raise AssertionError("a file cut short was taken")
    with src.open("rb") as fh:  # a file whole as opened is read whole
        assert bytes(_read_file(fh, 1000, name=str(src))) == src.read_bytes()


def test_a_file_larger_than_any_node_could_store_is_refused_unread(
    cluster_cli: Mooncake, mooncake: Mooncake, tmp_path: Path
) -> None:
    """A file was read whole into memory before the cluster was asked anything: a sparse 40 GiB
    file ran the command out of memory ("error: out of memory", exit 1), even with no cluster to
    talk to. Its size is now held against the largest host tier first, as a stream's bytes are."""
    sparse = tmp_path / "sparse.bin"
    with sparse.open("wb") as fh:
        fh.truncate(40 << 30)
    result = cluster_cli("put", "huge", str(sparse))
    assert_one_line_error(
        result, 5, f"holds {40 << 30} B (40.0 GiB), more than the 67108864 B (64.0 MiB)", "no node could store it"
    )
    assert_one_line_error(mooncake("put", "k", str(sparse)), 4, "no cluster to talk to")
