"""Review session 9: puts that commit the checksum of their landed bytes (copy_and_hash, the agent's
DIGEST op, put_commit's "<put id>=<checksum>" arguments, the fallback for agents without DIGEST) and
close() cutting transfers in flight (TcpTransport.close, Cancel, PrefixCache.close), against a real
index server and real agents (in-process ones where an interleaving must be placed exactly).

Each test asserts the behaviour the README and the docstrings promise. The defects the pass found
(a put committed after close() returned, the same for a PrefixCache store, put_many to an agent
without DIGEST) were fixed in the same session; their tests say how. The others guard behaviour
worth keeping.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import redis
import xxhash
from helpers import wait_until

from mooncake_store import Client, MooncakeError
from mooncake_store.agent.node import Agent
from mooncake_store.client.prefix import PrefixCache
from mooncake_store.errors import StaleLocation
from mooncake_store.transport.frames import Op

MiB = 1 << 20


def _key(tag: str) -> str:
    return f"rv9-{tag}-{uuid.uuid4().hex[:8]}"


class _Runner:
    """Runs ``fn`` on a thread of its own (a caller's thread, not the client's pool)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self.exc: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._fn()
        except BaseException as exc:
            self.exc = exc
        finally:
            self.done.set()

    def outcome(self, timeout_s: float) -> str:
        assert self.done.wait(timeout_s), "the operation hung"
        return "ok" if self.exc is None else f"{type(self.exc).__name__}: {self.exc}"


def _quiet_agent(make_inproc_agent: Callable[..., Agent], **overrides: Any) -> Agent:
    """An in-process agent that sends nothing to the index on its own for minutes (no heartbeat,
    no sync, no pressure pass), so that a client blocked on the index server is the put under
    test, waiting in its put_commit (the only index call a put makes after its transfers)."""
    settings: dict[str, Any] = {
        "host_bytes": 64 * MiB,
        "reserve_timeout_s": 30.0,
        "heartbeat_interval_s": 600.0,
        "heartbeat_ttl_s": 1200.0,
        **overrides,
    }

    def prepare(agent: Agent) -> None:
        agent.pressure.run = lambda stop: stop.wait()  # type: ignore[method-assign]

    return make_inproc_agent(prepare=prepare, **settings)


#: How long a held call may wait on the server at most: the hold ends by CLIENT UNPAUSE once the
#: close() under test waits for it (_close_while_held), so its length opens no window under load.
HOLD_MS = 30_000


class _Hold:
    """A pause of the index server's writes (CLIENT PAUSE WRITE on a connection of its own, which
    outlives the test's clients), made at most once and never after it was released: a test that
    fails before its close() must not leave the session's server paused for the rest of HOLD_MS."""

    def __init__(self, url: str) -> None:
        self.r = redis.Redis.from_url(url)
        self.paused = threading.Event()
        self._released = False
        self._lock = threading.Lock()

    def pause(self) -> None:
        with self._lock:
            if not self._released and not self.paused.is_set():
                self.r.execute_command("CLIENT", "PAUSE", str(HOLD_MS), "WRITE")
                self.paused.set()

    def release(self) -> None:
        with self._lock:
            if not self._released:
                self._released = True
                try:
                    self.r.execute_command("CLIENT", "UNPAUSE")
                finally:
                    self.r.close()


@pytest.fixture
def hold_on_the_server(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> Iterator[Callable[[Client, str], _Hold]]:
    """``hold_on_the_server(client, call)`` makes the client's next index ``call`` (put_start,
    put_commit) wait on the server: just before it goes out, the index server's writes are
    paused, then the real call runs and blocks there. The hold's ``paused`` is set once the pause
    is in force; _close_while_held lifts it, and so does the end of the test, however it ended:
    this fixture comes after the agents and clients, so its teardown runs before theirs (an
    agent's stop writes to the index)."""
    holds: list[_Hold] = []

    def hold_on(client: Client, call: str) -> _Hold:
        real = getattr(client.index, call)
        hold = _Hold(client.index.url)
        holds.append(hold)

        def pause_then_call(*args: Any, **kwargs: Any) -> Any:
            hold.pause()
            return real(*args, **kwargs)

        setattr(client.index, call, pause_then_call)
        return hold

    yield hold_on
    for hold in holds:
        hold.release()


def _waiting_in(thread: threading.Thread, function: str) -> bool:
    """Whether ``thread`` is now inside a call of ``function`` (by name, anywhere on its stack)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def _close_while_held(close: Callable[[], None], hold: _Hold) -> None:
    """Call ``close`` while the held call still waits on the server, and return when it has:
    close() runs on a thread of its own, and the pause is lifted once close() waits for the puts
    under way (InFlight.drain), or has returned without waiting. A fixed pause could lapse under
    load before close() was called, and the test would pass without its case."""
    closer = _Runner(close)
    try:
        reached = wait_until(lambda: closer.done.is_set() or _waiting_in(closer.thread, "drain"), 10.0)
        assert reached, "close() neither returned nor waited for the puts under way"
    finally:
        hold.release()
    assert closer.outcome(30) == "ok"


def _blocked_on_the_server(hold: _Hold, client: Client) -> bool:
    """Whether one of ``client``'s own index connections is blocked on the server. INFO's
    blocked_clients would count any client the server-wide pause holds (other tests' agents share
    the server); CLIENT LIST's addr says which connections are this client's."""
    pool = client.index.redis.connection_pool
    with pool._lock:  # the script connections are checked out of the pool and never returned
        conns = [*pool._available_connections, *pool._in_use_connections]
    ours: set[str] = set()
    for conn in conns:
        sock = getattr(conn, "_sock", None)
        with contextlib.suppress(OSError, AttributeError):  # closed or closing meanwhile
            host, port = sock.getsockname()[:2]
            ours.add(f"{host}:{port}")
    return any(c["addr"] in ours and "b" in c["flags"] for c in hold.r.client_list())


def _wait_blocked(hold: _Hold, runner: _Runner, client: Client) -> None:
    """Until the held call of ``client`` waits on the server (one of its connections is blocked)."""
    assert hold.paused.wait(10) or runner.done.is_set(), "the held call was never made"
    assert not runner.done.is_set(), f"the operation ended before its call was held: {runner.outcome(0)}"
    reached = wait_until(lambda: _blocked_on_the_server(hold, client), 5.0)
    assert reached, "the held call never reached the server"


def _live_index_connections(client: Client) -> int:
    """Index connections the client still holds open (its script connections)."""
    return sum(1 for conn in client.index._script_conns if getattr(conn, "_sock", None) is not None)


# ---- close() against a put that is past its transfers ------------------------------------------------


def test_a_put_past_its_transfers_is_not_committed_after_close_returned(
    make_inproc_agent: Callable[..., Agent],
    clients: Callable[..., Client],
    hold_on_the_server: Callable[[Client, str], _Hold],
) -> None:
    """README: 'Operations already under way in other threads end at once with [client is
    closed] ... A put cut short this way stores nothing; one that had already committed stays
    stored.' A put on the caller's own thread (put(), not put_async) whose bytes have landed but
    whose commit has not run yet is neither: close() cuts its (idle) agent connections, closes the
    index and returns, and the put then reopens an index connection, commits and returns None: an
    object appears, and a write reports success, after close() returned. The connection it
    reopened stays open in a closed client (a leak). Here the index server holds the put's
    put_commit (CLIENT PAUSE WRITE, issued just before the call, lifted once close() has begun)
    to place close() in that window.

    Fixed (client/in_flight.py): a put counts itself in from put_start to its commit or revoke,
    a commit does not start once the client is closed, and close() waits for the puts counted in
    before it closes the index. This put's commit was already on the server when close() was
    called, so it commits, and close() returns only after it did: the put's outcome (stored, and
    no error; or nothing stored and "client is closed") is settled when close() returns, and no
    index connection is open afterwards."""
    agent = _quiet_agent(make_inproc_agent)
    observer = clients(agent)
    r = observer.index.redis
    value = np.random.default_rng(9).integers(0, 256, 24 * MiB, dtype=np.uint8)
    client = clients(agent, transports=("tcp",))
    client.put(_key("warm"), b"x")  # node table and connections in place
    key = _key("late")
    hold = hold_on_the_server(client, "put_commit")
    runner = _Runner(lambda: client.put(key, value))
    _wait_blocked(hold, runner, client)
    assert not r.exists(observer.index.prefix + "o:" + key), "committed before the hold"
    _close_while_held(client.close, hold)
    stored_at_close = observer.exists(key)
    outcome = runner.outcome(30)
    stored = observer.exists(key)
    leaked = _live_index_connections(client)
    expected = "ok" if stored_at_close else "MooncakeError: client is closed"
    assert stored == stored_at_close and outcome == expected and not leaked, (
        f"a put under way at close() ended with {outcome!r}; stored when close() returned: "
        f"{stored_at_close}, later: {stored}; {leaked} open index connection(s) in the closed client"
    )


def test_a_put_whose_put_start_waits_on_the_index_at_close_stores_nothing_and_says_closed(
    make_inproc_agent: Callable[..., Agent],
    clients: Callable[..., Client],
    hold_on_the_server: Callable[[Client, str], _Hold],
) -> None:
    """A put whose put_start is held on the index server (CLIENT PAUSE WRITE) when close() is
    called: close() cuts its agent connections and waits for it (client/in_flight.py); the put's
    transfers then fail, its commit is refused, and its pending record is revoked before the index
    is closed. It ends with "client is closed", nothing is stored, no pending record is left, and
    no index connection is open in the closed client."""
    agent = _quiet_agent(make_inproc_agent)
    observer = clients(agent)
    r, prefix = observer.index.redis, observer.index.prefix
    client = clients(agent, transports=("tcp",))
    client.put(_key("warm"), b"x")
    key = _key("early")
    value = np.random.default_rng(3).integers(0, 256, 8 * MiB, dtype=np.uint8)
    hold = hold_on_the_server(client, "put_start")
    runner = _Runner(lambda: client.put(key, value))
    _wait_blocked(hold, runner, client)
    _close_while_held(client.close, hold)
    outcome = runner.outcome(30)
    assert outcome == "MooncakeError: client is closed", outcome
    assert not observer.exists(key)
    assert not r.keys(prefix + "pend:*"), "the cut put's pending record was left behind"
    assert _live_index_connections(client) == 0


def test_close_waits_for_a_cut_put_to_revoke_its_pending_record(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """close() cuts a put's transfers and then waits for the put's index work (client/in_flight.py):
    the cut put revokes its pending record before the index is closed. Without that wait the
    index closed first and the record stayed until its TTL (3 x timeout_s), naming a reservation
    no put would commit. The put's write is held (a wrapper that waits for close() to begin, and
    a little longer, then calls the real write, which the close has cut)."""
    agent = _quiet_agent(make_inproc_agent)
    observer = clients(agent)
    r, prefix = observer.index.redis, observer.index.prefix
    client = clients(agent, transports=("tcp",))
    client.put(_key("warm"), b"x")
    real_write = client._tcp.write_from
    writing = threading.Event()

    def write_after_close(*args: Any, **kwargs: Any) -> Any:
        writing.set()
        assert wait_until(lambda: client._closed, 10)
        time.sleep(0.3)  # close() would be done by now, had it not waited for this put
        return real_write(*args, **kwargs)

    client._tcp.write_from = write_after_close  # type: ignore[method-assign]
    key = _key("cut")
    runner = _Runner(lambda: client.put(key, np.ones(MiB, np.uint8)))
    assert writing.wait(10), "the put never wrote"
    assert r.keys(prefix + "pend:*"), "no pending record while the put writes"
    client.close()
    assert runner.outcome(10) == "MooncakeError: client is closed"
    assert not r.keys(prefix + "pend:*"), "close() closed the index before the cut put revoked its record"
    assert not observer.exists(key)


def test_a_prefix_store_past_its_transfers_is_not_committed_after_cache_close_returned(
    make_inproc_agent: Callable[..., Agent],
    clients: Callable[..., Client],
    hold_on_the_server: Callable[[Client, str], _Hold],
) -> None:
    """README: PrefixCache 'close() ... ends the cache's loads and stores under way at once with
    MooncakeError("PrefixCache is closed")'. The Cancel it fires only shuts down agent
    connections; a store whose chunks have landed goes on to put_commit, which checks nothing, so
    its chunks are committed after close() returned and store() reports them written.

    Fixed as for the client's close() (client/in_flight.py): the commit already on the server ends
    before PrefixCache.close() returns, and the store's outcome matches what is stored then."""
    agent = _quiet_agent(make_inproc_agent)
    observer = clients(agent)
    r = observer.index.redis
    client = clients(agent, transports=("tcp",))
    client.put(_key("warm"), b"x")
    chunks = [np.full(4 * MiB, i, np.uint8) for i in range(4)]
    tokens = list(range(16))
    cache = PrefixCache(client, "rv9-late", chunk_tokens=4)
    hold = hold_on_the_server(client, "put_commit")
    runner = _Runner(lambda: cache.store(tokens, chunks))
    _wait_blocked(hold, runner, client)
    assert not any(r.exists(observer.index.prefix + "o:" + k) for k in cache.keys(tokens))  # plain reads: not paused
    _close_while_held(cache.close, hold)
    stored_at_close = [observer.exists(k) for k in cache.keys(tokens)]
    outcome = runner.outcome(30)
    stored = [observer.exists(k) for k in cache.keys(tokens)]
    expected = "ok" if all(stored_at_close) else "MooncakeError: PrefixCache is closed"
    assert stored == stored_at_close and outcome == expected, (
        f"a store under way at PrefixCache.close() ended with {outcome!r}; chunks stored when "
        f"close() returned: {stored_at_close}, later: {stored}"
    )


# ---- agents that predate DIGEST ----------------------------------------------------------------------


def _predating_digest(agent: Agent) -> None:
    """Serve DIGEST as an agent built before the op did (6b0a153's _dispatch): an unknown op,
    answered BAD_REQUEST, and the connection closed."""
    server = agent.server
    serve = server._dispatch

    def dispatch(conn: socket.socket, started: float, op: int, arg: int, a: int, b: int, c: int) -> bool:
        if op == Op.DIGEST:
            server._bad_request(conn, op)
            return False
        return serve(conn, started, op, arg, a, b, c)

    server._dispatch = dispatch  # type: ignore[method-assign]


@pytest.mark.parametrize("stripe_bytes", [4 * MiB, MiB], ids=["one-stripe", "striped"])
def test_a_put_to_an_agent_without_digest_commits_the_source_checksum(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client], stripe_bytes: int
) -> None:
    """The fallback for an agent that answers DIGEST with BAD_REQUEST: the source's hash, which
    a verifying read accepts (the value was left alone, as documented)."""
    agent = make_inproc_agent(host_bytes=32 * MiB, prepare=_predating_digest)
    client = clients(agent, transports=("tcp",), verify_checksum=True, stripe_bytes=stripe_bytes)
    value = np.random.default_rng(1).integers(0, 256, 3 * MiB, dtype=np.uint8)
    key = _key("old")
    client.put(key, value)
    meta = client.object_meta(key)
    assert meta is not None and meta.checksum == xxhash.xxh3_64_intdigest(value)
    assert bytes(client.get(key).tobytes()) == value.tobytes()


def test_put_many_to_an_agent_without_digest_stores_every_key(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """The commit keeps agents that predate DIGEST working: 'an agent that predates DIGEST
    (BAD_REQUEST) gets the source's hash as before'. Such an agent answers BAD_REQUEST and closes
    the connection, but the client returns that connection to its pool ('dropped from the pool by
    _acquire's readable() check'); a put_many writes its values one after the other, and the next
    WRITE goes out on the connection the agent is closing: 'Connection reset by peer', and the
    whole batch fails. (Confirmed against a real agent process built from 6b0a153: every
    put_many of 8 x 64 KiB failed.)
    Fixed: BAD_REQUEST to DIGEST is raised inside the call (_NoDigest), so the connection is
    dropped rather than pooled, and the pool stops asking that agent for DIGEST."""
    agent = make_inproc_agent(host_bytes=32 * MiB, prepare=_predating_digest)
    client = clients(agent, transports=("tcp",), verify_checksum=True)
    failures: list[str] = []
    for trial in range(8):
        items = {_key(f"old-{trial}-{i}"): np.full(64 << 10, i, np.uint8) for i in range(8)}
        try:
            client.put_many(items)
        except MooncakeError as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
            continue
        for key, value in items.items():
            assert bytes(client.get(key).tobytes()) == value.tobytes()
    assert not failures, f"put_many to an agent without DIGEST failed {len(failures)}/8 times: {failures[:2]}"


# ---- DIGEST on the wire ------------------------------------------------------------------------------


def test_digest_is_stale_for_a_freed_reservation_and_for_a_range_outside_it(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """DIGEST hashes only a live host-tier reservation's own range: beyond it, or once freed, it
    is STALE (StaleLocation), never a hash of another object's bytes."""
    agent = make_inproc_agent(host_bytes=8 * MiB)
    client = clients(agent, transports=("tcp",))
    peer = client._tcp.peer(agent.server.endpoint)
    (res,) = peer.reserve([(4096, uuid.uuid4().bytes)], node_id=agent.node_id)
    data = memoryview(bytes(range(256)) * 16)
    assert peer.write(res.alloc_id, res.offset, data, digest=True) == xxhash.xxh3_64_intdigest(data)
    assert peer.digest(res.alloc_id, res.offset, 4096) == xxhash.xxh3_64_intdigest(data)
    with pytest.raises(StaleLocation):
        peer.digest(res.alloc_id, res.offset, 4097)
    peer.free([res.alloc_id])
    agent.table.free([res.alloc_id])
    with pytest.raises(StaleLocation):
        peer.digest(res.alloc_id, res.offset, 4096)


# ---- close() from a callback of the cache's own futures ---------------------------------------------
def test_prefix_cache_close_from_a_load_async_callback_closes_it(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """A done-callback of load_async runs on the cache's worker thread; PrefixCache.close() there
    joined its own pool, which raises "cannot join current thread" (swallowed by the future's
    callback machinery, the cache left half closed). It closes now, as Client.close() does from a
    callback of its own futures."""
    agent = _quiet_agent(make_inproc_agent)
    client = clients(agent)
    cache = PrefixCache(client, "rv9-callback", chunk_tokens=4)
    tokens = list(range(8))
    cache.store(tokens, [np.full(64, i, np.uint8) for i in range(2)])
    outcome: list[BaseException | None] = []
    closed = threading.Event()

    def close_here(_future: object) -> None:
        try:
            cache.close()
            outcome.append(None)
        except BaseException as exc:  # recorded: the future's machinery would swallow it
            outcome.append(exc)
        finally:
            closed.set()

    future = cache.load_async(tokens)
    future.add_done_callback(close_here)
    assert closed.wait(10), "close() from the callback hung"
    assert outcome == [None], f"close() from a load_async callback raised {outcome[0]!r}"
    assert future.result().num_tokens == 8
    with pytest.raises(MooncakeError, match="PrefixCache is closed"):
        cache.load(tokens)
