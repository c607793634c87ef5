"""Small helpers shared by the test modules (tests/ is on sys.path through its conftest)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from mooncake_store.index.client import PendingPut
from mooncake_store.transport.frames import SPILL_FLAG
from mooncake_store.transport.tcp import TcpTransport, parse_endpoint
from mooncake_store.types import NodeInfo, Replica, ReplicaState, TierKind, TierUsage, TransportKind

if TYPE_CHECKING:
    from mooncake_store import Client
    from mooncake_store.agent.node import Agent
    from mooncake_store.agent.spill import SpillJob


def mooncake_bin() -> str:
    """The installed `mooncake` console script: the test install (pip install -e '.[test,hf]')
    always provides it, so its absence fails the test rather than skipping it."""
    beside = Path(sys.executable).parent / "mooncake"
    found = str(beside) if beside.exists() else shutil.which("mooncake")
    if not found:
        pytest.fail("the mooncake console script is not installed: the package did not install it")
    return found


def read_terminal(
    main: int, proc: subprocess.Popen[bytes], *, seconds: float = 60.0, each: Callable[[bytes], None] | None = None
) -> bytes:
    """What ``proc`` wrote to the pseudo-terminal whose main side is ``main``, until it closes its
    side or exits (or ``seconds`` pass); ``each(shown)`` is called before each wait, with all of it
    so far (to act once something is drawn)."""
    shown = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if each is not None:
            each(shown)
        ready, _, _ = select.select([main], [], [], 0.5)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the terminal's other side closed
            break
        if not chunk:
            break
        shown += chunk
    return shown


def refused_agent(*args: str, timeout_s: float = 60.0) -> tuple[int, str]:
    """Run ``python -m mooncake_store.agent ARGS``, which must refuse to start: its exit status and
    stderr. One that started after all is stopped by its own pid."""
    cmd = [sys.executable, "-m", "mooncake_store.agent", *args]
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode, err


def signal_after_first_line(
    cmd: list[str], sig: int, *, on_line: Callable[[str, int], None] | None = None, timeout_s: float = 60.0
) -> tuple[int, str]:
    """Run ``cmd``, wait for its first line of stdout (unbuffered), call ``on_line(line, pid)``,
    send it ``sig`` by its PID, and return (exit status, stderr). Killed if it outlives the test."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},  # its first line read as it is printed
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if on_line is not None:
            on_line(line, proc.pid)
        os.kill(proc.pid, sig)
        _out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; its last answer either way."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


@dataclasses.dataclass(frozen=True)
class TcpSocket:
    """One row of /proc/net/tcp{,6}."""

    local_port: int
    remote_port: int
    state: str  # 01 ESTABLISHED, 06 TIME_WAIT, 08 CLOSE_WAIT
    unread_bytes: int  # its receive queue: bytes its owner has not read
    inode: str


def tcp_sockets() -> list[TcpSocket]:
    """Every TCP socket of this network namespace, as the kernel lists them."""
    rows: list[TcpSocket] = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(name) as table:
            next(table)
            for line in table:
                f = line.split()
                rows.append(
                    TcpSocket(
                        local_port=int(f[1].rsplit(":", 1)[1], 16),
                        remote_port=int(f[2].rsplit(":", 1)[1], 16),
                        state=f[3],
                        unread_bytes=int(f[4].split(":")[1], 16),
                        inode=f[9],
                    )
                )
    return rows


def socket_fds(pid: int | str) -> list[str]:
    """The socket inode of each of a process's socket descriptors (``"self"``: this process)."""
    fd_dir = f"/proc/{pid}/fd"
    inodes: list[str] = []
    for fd in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            target = os.readlink(f"{fd_dir}/{fd}")
            if target.startswith("socket:["):
                inodes.append(target[8:-1])
    return inodes


def requests_waiting_at(endpoint: str) -> int:
    """TCP connections to ``endpoint`` (on loopback) with bytes the agent has not read: requests
    a stopped agent holds."""
    port = parse_endpoint(endpoint)[1]
    return sum(1 for s in tcp_sockets() if s.local_port == port and s.unread_bytes > 0)


def beat_since(client: Client, since: float, node_id: str | None = None) -> bool:
    """Whether the node (the first one by default) has heartbeat after ``since`` (time.monotonic()):
    the node table shows its counters and use as of then. An older beat may show them as they were
    before what the caller waits for, and a check of a count that must stay 0 would pass unseen."""
    nodes = client.stat().nodes
    node = nodes[0] if node_id is None else next(n for n in nodes if n.node_id == node_id)
    return node.heartbeat_age_s < time.monotonic() - since


def synced_after(client: Client, node_id: str) -> Callable[[], bool]:
    """From now, whether an agent process has completed a sync (its frees applied): a marker ack
    (an alloc id of tag 0, which no agent hands out, so a sync commits nothing for it) goes into
    the node's ack list; the sync that takes it moves it to the carried list (acksout), and the
    next sync, which says the one before was applied, deletes that. Only the index shows a
    process's syncs."""
    r, prefix = client.index.redis, client.index.prefix
    marker = str(uuid.uuid4().int % (1 << 47))  # below 1 << ALLOC_TAG_SHIFT: tag 0
    r.rpush(prefix + "acks:" + node_id, marker)

    def synced() -> bool:
        lists = (prefix + "acks:" + node_id, prefix + "acksout:" + node_id)
        return not any(marker in r.lrange(name, 0, -1) for name in lists)

    return synced


def host_use_since(client: Client, since: float) -> float:
    """The host tier's used bytes as the first node's last heartbeat published them, if it beat
    after ``since`` (see beat_since); infinity if not yet."""
    return client.stat().nodes[0].tiers[0].used_bytes if beat_since(client, since) else float("inf")


def guarded_spill_copy(
    client: Any, a: Any, b: Any, *, size: int, guard_ttl_ms: int = 60_000
) -> tuple[Replica, Replica, str]:
    """Put "obj" (``size`` bytes of 0xAA) on agent ``a``, then copy it to ``b`` as a's pressure
    thread spills (agent/spill.py): a guard record, a reservation on b, the bytes. Returns (a's
    replica, the new replica on b, guard id); the swap is the test's to make."""
    value = np.full(size, 0xAA, dtype=np.uint8)
    client.put("obj", value, preferred_node=a.node_id)
    meta = client.object_meta("obj")
    assert meta is not None and meta.replicas[0].node_id == a.node_id
    put_id = uuid.uuid4().bytes
    client.index.guard_reservations([put_id.hex()], node_id=b.node_id, ttl_ms=guard_ttl_ms)
    tcp = TcpTransport(timeout_s=10.0, connections_per_peer=1, stripe_bytes=1 << 30)
    try:
        (res,) = tcp.peer(b.endpoint).reserve([(size, put_id)], node_id=b.node_id, flags=SPILL_FLAG)
        tcp.peer(b.endpoint).write(res.alloc_id, res.offset, memoryview(value))
    finally:
        tcp.close()
    return meta.replicas[0], host_replica(b.node_id, res, size), put_id.hex()


def host_replica(node_id: str, reserved: Any, size: int, state: ReplicaState = ReplicaState.COMPLETE) -> Replica:
    """The location a reservation in ``node_id``'s host tier makes (``reserved``: a Reservation or
    an Allocation: its offset and alloc id), as a swap or a put names it."""
    return Replica(
        node_id=node_id,
        tier=TierKind.HOST,
        offset=reserved.offset,
        size_bytes=size,
        alloc_id=reserved.alloc_id,
        state=state,
    )


def random_bytes(n: int, seed: int) -> np.ndarray:
    """``n`` reproducible random bytes."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def put_on(agent: Agent, key: str, data: np.ndarray, *, tier: TierKind) -> int:
    """Store ``data`` under ``key`` in ``agent``'s GPU or host table, as a committed object; its alloc id."""
    table = agent.gpu_table if tier == TierKind.GPU else agent.table
    assert table is not None
    put_id = uuid.uuid4().bytes
    (alloc,) = table.reserve([(data.nbytes, put_id)]) or []
    if tier == TierKind.GPU:
        agent.gpu.write_from_host(alloc.offset, memoryview(data.view(np.uint8)))  # type: ignore[union-attr]
    else:
        agent.arena.view(alloc.offset, data.nbytes)[:] = data.view(np.uint8)
    replica = Replica(
        node_id=agent.node_id,
        tier=tier,
        offset=alloc.offset,
        size_bytes=data.nbytes,
        alloc_id=alloc.alloc_id,
        state=ReplicaState.PENDING,
    )
    pending = PendingPut(
        put_id=put_id.hex(),
        key=key,
        size_bytes=data.nbytes,
        dtype=str(data.dtype),
        shape=data.shape,
        checksum=0,
        replicas=(replica,),
    )
    agent.index.put_start([pending], ttl_ms=60_000)
    assert agent.index.put_commit([put_id.hex()]) == ["OK"]
    agent.sync_once()  # the commit's ack
    return alloc.alloc_id


def host_spill_jobs(
    agent: Agent, count: int, size: int, prefix: str = "o"
) -> tuple[list[SpillJob], dict[str, np.ndarray]]:
    """``count`` distinct objects of ``size`` B committed on ``agent``'s host tier (keys ``prefix``
    and a number), as spill jobs in key order, and their values."""
    from mooncake_store.agent.spill import SpillJob

    values = {f"{prefix}{i:02d}": np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(count)}
    for key, value in values.items():
        put_on(agent, key, value, tier=TierKind.HOST)
    victims = sorted(agent.index.victim_candidates(agent.node_id, "host"), key=lambda c: c.key)
    jobs = [SpillJob(victim=v, offset=agent.table.offset_of(v.alloc_id)[0]) for v in victims]  # type: ignore[index]
    return jobs, values


def put_on_disk(agent: Agent, key: str, data: np.ndarray) -> int:
    """``key`` stored on ``agent``'s host tier and demoted to its disk tier; the disk alloc id."""
    put_on(agent, key, data, tier=TierKind.HOST)
    (victim,) = [c for c in agent.index.victim_candidates(agent.node_id, "host") if c.key == key]
    location = agent.table.offset_of(victim.alloc_id)
    assert location is not None and agent.pressure.moves.demote_to_disk(victim, location[0])
    (replica,) = replicas_of(agent, key)
    return replica.alloc_id


@contextlib.contextmanager
def small_tmpfs(
    where: Path, *, size_mib: int = 8, left_bytes: int = 0, inodes_left: int | None = None
) -> Iterator[Path]:
    """A tmpfs of ``size_mib`` mounted at ``where``, filled by another program's file until about
    ``left_bytes`` are left (0: full), unmounted at the end; with ``inodes_left``, of 64 inodes
    (a tmpfs has millions by default), and filled by empty files until only that many more can be
    made. Skipped, saying why, where one cannot be mounted (it needs root)."""
    if os.geteuid() != 0:
        pytest.skip("mounts a small tmpfs, which needs root")
    where.mkdir(parents=True, exist_ok=True)
    options = f"size={size_mib}m" + (",nr_inodes=64" if inodes_left is not None else "")
    command = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)]
    mounted = subprocess.run(command, capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        with open(where / "other-programs-data", "wb") as junk:
            for _ in range(size_mib * 16):  # bounded: the filesystem holds no more than this
                room = os.statvfs(where)
                if room.f_bavail * room.f_frsize <= left_bytes:
                    break
                try:
                    junk.write(b"\0" * 65536)
                    junk.flush()
                except OSError:  # full
                    break
        for i in range(64 if inodes_left is not None else 0):
            if os.statvfs(where).f_favail <= (inodes_left or 0):
                break
            (where / f"other-programs-file-{i}").touch()
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def pending_put(key: str, *placed: tuple[str, TierKind, int], size: int = 16) -> PendingPut:
    """A put of ``size`` bytes under ``key`` with a PENDING replica per (node, tier, alloc id), for
    the index's scripts alone (no agent holds the bytes)."""
    return PendingPut(
        put_id=uuid.uuid4().hex,
        key=key,
        size_bytes=size,
        dtype="|u1",
        shape=(size,),
        checksum=7,
        replicas=tuple(
            Replica(node_id=node, tier=tier, offset=0, size_bytes=size, alloc_id=alloc, state=ReplicaState.PENDING)
            for node, tier, alloc in placed
        ),
    )


def replicas_of(agent: Agent, key: str) -> list[Replica]:
    meta = agent.index.lookup([key], lease_ms=0).objects[0]
    return list(meta.replicas) if meta is not None else []


def node_row(
    node_id: str,
    *,
    tiers: tuple[TierUsage, ...] = (),
    transports: tuple[TransportKind, ...] = (TransportKind.TCP,),
    labels: dict[str, str] | None = None,
) -> NodeInfo:
    """A node-table row for a node no agent serves (host "h", zone "z"): for index scripts and
    client tables that need a row and nothing behind it."""
    return NodeInfo(
        node_id=node_id,
        host="h",
        host_id="h",
        zone="z",
        pid=1,
        tcp_endpoint="127.0.0.1:1",
        shm_name="",
        transports=transports,
        tiers=tiers,
        labels=labels or {},
    )


def count_read_requests(peer: Any) -> list[int]:
    """Spy (calling through) on a PeerConnections' read_many: the number of requests of each call,
    appended to the returned list. A stalled agent costs a timeout per call: counted, not timed."""
    asked: list[int] = []
    real_read_many = peer.read_many

    def counting_read_many(requests: Any) -> Any:
        asked.append(len(requests))
        return real_read_many(requests)

    peer.read_many = counting_read_many
    return asked


def write_fenced(puts: Any, node: Any, group: list[Any]) -> None:
    """A writer's same-host copies of ``group`` ((replica, plan) pairs) into ``node``'s arena as
    a put makes them (FENCE, copy, UNFENCE), without the index steps around them."""
    parts = puts.writes.fence(node, group)
    try:
        for part in parts:
            puts.writes.copy_fenced(part)
            part.fence.unfence()
        for part in parts:
            part.fence.finish()
    finally:
        for part in parts:
            part.fence.abort()  # a no-op once finished


def held_fences(agent: Any) -> int:
    """Fences an in-process agent's server holds, over all its connections."""
    return sum(len(s) for s in list(agent.server._fences.values()))


def run_for(seconds: float, threads: list[threading.Thread], stop: threading.Event, timeout_s: float = 30.0) -> None:
    """Start ``threads``, let them run ``seconds``, then set ``stop`` and join them. Fails if one is
    still running ``timeout_s`` after the stop (a hang)."""
    for th in threads:
        th.start()
    stop.wait(seconds)
    stop.set()
    deadline = time.monotonic() + timeout_s
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    assert not any(th.is_alive() for th in threads), f"a thread was still running {timeout_s} s after the stop"


def run_in_threads(work: Callable[[int], None], count: int, timeout_s: float = 60.0) -> list[BaseException]:
    """``work(0)`` .. ``work(count - 1)`` on threads of their own, all at once; the errors they
    raised. Fails if one is still running after ``timeout_s`` (a hang)."""
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            work(t)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(count)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + timeout_s
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    assert not any(th.is_alive() for th in threads), f"a thread was still running after {timeout_s} s"
    return errors


#: Chunks that take a 4 MiB host tier past its high watermark (90 %): 15 of 256 KiB. Its low
#: watermark (75 %) is 12 of them, so one pressure pass moves exactly NEED.
CHUNK = 256 << 10
FILL = 15
NEED = 3


def fill(client: Client, agent: Agent, prefix: str = "k", n: int = FILL) -> dict[str, np.ndarray]:
    """``n`` chunks on ``agent``, each strictly colder than the next, synced."""
    values: dict[str, np.ndarray] = {}
    for i in range(n):
        key = f"{prefix}{i:02d}"
        values[key] = np.full(CHUNK, i + 1, dtype=np.uint8)
        client.put(key, values[key], preferred_node=agent.node_id)
        time.sleep(0.002)
    agent.sync_once()
    return values


def counter(agent: Agent, tier: TierKind, name: str) -> int:
    """One of an in-process agent's pressure counters (spills_out, evictions, ...) of ``tier``."""
    return int(agent.pressure.counters[tier][name])


class SilentPeer:
    """A TCP endpoint that accepts connections and never answers: an agent hung, or cut off from
    its peers while it still reaches the index."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.listener.getsockname()[1]}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.listener.close()
        for conn in self.accepted:
            conn.close()


def register_silent_node(agent: Agent, peer: SilentPeer) -> str:
    """A node in ``agent``'s namespace whose endpoint is ``peer`` (it never answers): ``agent``'s own
    record under the id "ghost" with a 1 GiB host tier, empty, live for a minute; its node id."""
    ghost = dataclasses.replace(
        agent.node_info(),
        node_id="ghost",
        tcp_endpoint=peer.endpoint,
        tiers=(TierUsage(tier=TierKind.HOST, capacity_bytes=1 << 30, used_bytes=0, objects=0),),
    )
    agent.index.register_node(ghost, incarnation="ghost-1", ttl_ms=60_000)
    return ghost.node_id


class DarkPeer:
    """A loopback endpoint whose connects neither complete nor fail: a listener that accepts none,
    its queue filled, so the kernel drops every further SYN, as a host gone dark does (the caller
    retries the SYN until its own timeout)."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)
        self._fillers: list[socket.socket] = []
        for _ in range(3):  # the queue holds one; the others wait in SYN_SENT, as the next will
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(self.listener.getsockname())
            self._fillers.append(filler)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.listener.getsockname()[1]}"

    def close(self) -> None:
        for filler in self._fillers:
            filler.close()
        self.listener.close()


def assert_a_second_close_waits_for_the_first(
    close: Callable[[], None], drain_owner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close()`` from a second thread must return only once the first has finished. The first is
    held in its wait for puts in flight (a wrapper around ``drain_owner.drain`` waits on an event)."""
    in_drain, release = threading.Event(), threading.Event()
    real_drain = drain_owner.drain

    def held_drain(timeout_s: float, **kwargs: object) -> None:
        in_drain.set()
        release.wait(30)
        real_drain(timeout_s, **kwargs)

    monkeypatch.setattr(drain_owner, "drain", held_drain)
    first = threading.Thread(target=close)
    first.start()
    assert in_drain.wait(30)
    second_done = threading.Event()
    second = threading.Thread(target=lambda: (close(), second_done.set()))
    second.start()
    try:
        assert not second_done.wait(0.5), "a second close() returned while the first was still closing"
    finally:
        release.set()
        first.join(30)
        second.join(30)
    assert second_done.is_set() and not first.is_alive()


@contextlib.contextmanager
def server_at_maxmemory(client: Client, redis_url: str) -> Iterator[None]:
    """The index server at its maxmemory (noeviction) with 50 small objects stored: every write
    refused, until the block ends (maxmemory lifted again)."""
    import redis

    client.put_many({f"m{i}": b"z" * 100 for i in range(50)})
    server = redis.Redis.from_url(redis_url)
    server.config_set("maxmemory-policy", "noeviction")
    server.config_set("maxmemory", int(server.info("memory")["used_memory"]) // 2)
    try:
        yield
    finally:
        server.config_set("maxmemory", 0)
        server.close()


def interrupt(proc: subprocess.Popen[bytes], *, timeout_s: float = 15.0) -> None:
    """Stop a CLI process this test started, as Ctrl-C does (SIGINT to its PID), then SIGKILL."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=10)


def stop_process(pid: int, *, timeout_s: float = 10.0) -> None:
    """SIGSTOP a process this test started, by its PID, and return once every one of its threads
    has stopped. kill() returns before they have: the stop reaches the threads as each is next
    scheduled, and on a loaded machine a thread woken meanwhile (a request that just came in) ran
    on and read the request a test then expected the stalled process to hold."""
    os.kill(pid, signal.SIGSTOP)

    def all_stopped() -> bool:
        states: list[str] = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])  # after "(comm)", which may hold spaces
        return bool(states) and all(state in "tT" for state in states)

    if not wait_until(all_stopped, timeout_s):
        os.kill(pid, signal.SIGCONT)  # the caller's finally may not be entered yet: nothing is left stopped
        raise AssertionError(f"process {pid} did not stop within {timeout_s} s of SIGSTOP")


def bench_module(name: str) -> Any:
    """benchmarks/<name>.py loaded by its path (benchmarks/ must be on sys.path for its own imports):
    a bare ``import gpu`` finds the tests' own gpu package in a whole run."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def in_forked_child(work: Callable[[], str], *, timeout_s: float = 30.0) -> str:
    """``work()``'s result in a forked child, or why there is none ("hung for ..." when it
    overran: the child is then killed by its PID)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running the parent's cleanups
        os.close(read_end)
        try:
            result = work()
        except BaseException as exc:
            result = f"raised {type(exc).__name__}: {exc}"
        os.write(write_end, result.encode()[:4000])
        os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + timeout_s
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_end)
            return f"hung for {timeout_s} s"
        time.sleep(0.02)
    with os.fdopen(read_end, "rb") as pipe:
        return pipe.read().decode()


def assert_all_read_back(client: Client, values: dict[str, np.ndarray]) -> None:
    """Every key of ``values`` reads back as its value, byte for byte."""
    for key, value in values.items():
        assert np.array_equal(client.get(key), value), key


def disk_jobs(agent: Agent) -> list[SpillJob]:
    """Spill jobs of every chunk file on ``agent``'s disk tier, as its disk pass would make them."""
    from mooncake_store.agent.spill import SpillJob

    disk = agent.disk
    assert disk is not None
    jobs = []
    for victim in agent.index.victim_candidates(agent.node_id, "disk"):
        entry = disk.entry(victim.alloc_id)
        assert entry is not None
        jobs.append(SpillJob(victim, 0, stored_bytes=entry.stored_bytes, footprint_bytes=entry.footprint_bytes))
    return jobs
