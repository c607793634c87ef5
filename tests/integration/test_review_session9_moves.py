"""Review session 9 (moves, busy agents, close): spill swaps whose answer was lost and that
LocalMoves.resolve / settle() decide later (e37edc9), a failed pressure pass handing its writer's
request back (24ac7fb), puts counting themselves in until their commit (cf48426,
client/in_flight.py), and agents at their connection limit (f4d044d, agent/refusals.py).

Real Redis-compatible server, real agents: in-process ones where an interleaving must be placed
exactly, agent processes (their own main(), module constants set in that process) where the
connection limit matters. Faults come from outside the component under test only: a TCP proxy
between one agent and the index server that loses a script's reply and then stays down, a wrapper
around the client's transport call that only orders a close() after it (it calls the real one),
and raw sockets on the agent's port.

Each test asserts what the README and the docstrings promise. The defects the pass found were
fixed in the same session, except one kept as a strict xfail (a counter: nothing is lost), fixed
in the tenth (the index's record of landed swaps: write_swaps in index/lua/prelude.lua).
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import redis
from helpers import NEED, counter, fill, wait_until
from patched_agent import agent_port_fds, connect_raw, read_reply
from redis_proxy import QUIET, RedisProxy, idle_pressure

from mooncake_store import Client, LocalCluster, MooncakeError, connect
from mooncake_store.agent.node import Agent
from mooncake_store.client.prefix import PrefixCache
from mooncake_store.errors import AgentBusy
from mooncake_store.index.schema import decode_replicas
from mooncake_store.transport import frames
from mooncake_store.transport.frames import Op, Status
from mooncake_store.transport.tcp import PeerConnections
from mooncake_store.types import TierKind

KiB = 1 << 10
MiB = 1 << 20


def sha(agent: Agent, script: str) -> str:
    return str(agent.index._scripts[script].sha)


def replicas_on(r: redis.Redis, prefix: str, keys: list[str], node_id: str) -> dict[str, int]:
    """key -> alloc id of its replica on ``node_id``, read from the records (no lookup: no lease)."""
    out: dict[str, int] = {}
    for key in keys:
        raw = r.hget(prefix + "o:" + key, "replicas")
        for rep in decode_replicas(raw) if raw is not None else ():
            if rep.node_id == node_id:
                out[key] = rep.alloc_id
    return out


# ---- e37edc9: a spill swap whose answer was lost, settled after the peer freed the object -------
def test_a_landed_spill_whose_object_was_removed_before_settle_is_still_counted(
    proxied_agent: Callable[..., Agent],
    direct_agent: Callable[..., Agent],
    client_of: Callable[[str], Client],
    proxy: RedisProxy,
    namespace: str,
) -> None:
    """e37edc9 says the sender's spills_out now matches the peer's spills_in also when the swap's
    answer was lost: settle() counts a target 'once the index names it', where naming includes the
    target node's graveyard (the object removed or replaced since). Here the swap of a spill batch
    lands on the server, its reply is lost and the sender's index stays out of reach. Meanwhile a
    client removes the three spilled objects (no reader holds a lease, so their graves on the peer
    are due at once) and the peer syncs twice: the first sync commits the spills (spills_in 3),
    the second takes the due graves out of gc:<peer> (into gcout:) and frees them. When the
    sender's index is back, settle() finds the targets neither in the records nor in gc:<peer>,
    takes them for swaps that never landed, and drops them from its list: spills_out stays 0 for
    good while the peer says 3 came in. The same gap (gcout: not asked) applies to a local
    target whose grave this agent's own sync drained before settle() ran. Fixed: the swap leaves a
    record (landed:<mover>, kept two minutes) that settle() asks too."""
    a = proxied_agent(namespace, spill_to_peers=True)
    b = direct_agent(namespace, host_bytes=16 * MiB)
    client = client_of(namespace)
    values = fill(client, a)
    r, prefix = client.index.redis, client.index.prefix
    rule = proxy.drop_reply(sha(a, "move_replicas"))
    proxy.down_after_reply_of(sha(a, "move_replicas"))
    with pytest.raises(MooncakeError):
        a.pressure.relieve_host()
    assert rule.hits == 1, "the injected fault did not fire"
    b.sync_once()  # commits the swapped reservations (its ack list): counted as spills in
    on_b = replicas_on(r, prefix, list(values), b.node_id)
    assert len(on_b) == NEED, on_b
    assert counter(b, TierKind.HOST, "spills_in") == NEED
    assert counter(a, TierKind.HOST, "spills_out") == 0, "counted before the index confirmed it"
    assert client.remove_many(list(on_b)) == [True] * NEED
    b.sync_once()  # the due graves leave gc:<b> and are freed
    b.sync_once()  # ... and that reply is confirmed
    still_buried = r.zmscore(prefix + "gc:" + b.node_id, [str(x) for x in on_b.values()])
    assert all(s is None for s in still_buried), f"graves not drained yet: {still_buried}"
    proxy.up()
    assert a.pressure.moves.settle() == 0, "settle() freed something of a spill (the peer's to free)"
    assert a.pressure.moves.settle() == 0
    out, into = counter(a, TierKind.HOST, "spills_out"), counter(b, TierKind.HOST, "spills_in")
    assert out == into == NEED, (
        f"{a.node_id} spills_out={out}, {b.node_id} spills_in={into}: the batch landed on {b.node_id} "
        "(its sync committed it) and its objects were removed afterwards; settle() asked gc: only, "
        "which the peer's sync had already drained, and wrote the spills off as never landed"
    )


def test_a_landed_spill_whose_object_was_removed_under_a_lease_is_counted_by_settle(
    proxied_agent: Callable[..., Agent],
    direct_agent: Callable[..., Agent],
    client_of: Callable[[str], Client],
    proxy: RedisProxy,
    namespace: str,
) -> None:
    """Guard (passes): the graveyard case e37edc9 covers. As above, but a reader looked the
    spilled objects up before they were removed, so their graves on the peer wait for the lease
    and stay in gc:<peer>: settle() finds them there and counts the batch once, frees nothing, and
    every object not removed still reads back whole."""
    a = proxied_agent(namespace, spill_to_peers=True)
    b = direct_agent(namespace, host_bytes=16 * MiB)
    client = client_of(namespace)
    values = fill(client, a)
    r, prefix = client.index.redis, client.index.prefix
    rule = proxy.drop_reply(sha(a, "move_replicas"))
    proxy.down_after_reply_of(sha(a, "move_replicas"))
    with pytest.raises(MooncakeError):
        a.pressure.relieve_host()
    assert rule.hits == 1, "the injected fault did not fire"
    b.sync_once()
    on_b = replicas_on(r, prefix, list(values), b.node_id)
    assert len(on_b) == NEED, on_b
    for key in on_b:
        assert np.array_equal(client.get(key), values[key])  # a lease (lease_ms) on each
    assert client.remove_many(list(on_b)) == [True] * NEED
    b.sync_once()  # nothing due yet: the graves stay in gc:<b>
    proxy.up()
    assert a.pressure.moves.settle() == 0
    assert a.pressure.moves.settle() == 0
    assert counter(a, TierKind.HOST, "spills_out") == counter(b, TierKind.HOST, "spills_in") == NEED
    for key, value in values.items():
        if key not in on_b:
            assert np.array_equal(client.get(key), value), key


# ---- cf48426: a PrefixCache store refused at entered() ------------------------------------------
def test_a_prefix_store_refused_at_count_in_gives_its_room_back(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """PutPath._put_once: when a put cannot count itself in because it was interrupted meanwhile,
    'closed meanwhile: its room goes back' (abandon, started=False). For a store of a PrefixCache
    closed between the store's RESERVE and its count-in, the interruption is the cache's Cancel,
    which the storing thread still runs under: abandon's FREE takes a connection under that
    Cancel, Cancel.hold refuses it (MooncakeError "PrefixCache is closed"), abandon swallows the
    error, and the chunks' reservations stay on the agent until its reserve timeout (30 s here),
    while the client, which stays open after PrefixCache.close(), could have freed them at once.
    On a full node other writers wait for that room meanwhile. The close is placed by a wrapper
    around the client's PeerConnections.reserve that calls the real one and then closes the cache
    on another thread."""
    agent = make_inproc_agent(prepare=idle_pressure, **{**QUIET, "host_bytes": 16 * MiB})
    client = clients(agent, transports=("tcp",))
    client.put(f"warm-{uuid.uuid4().hex[:6]}", b"x")  # node table and the agent's pool in place
    agent.sync_once()
    baseline = agent.table.usage()[0]
    cache = PrefixCache(client, f"rv9-moves-{uuid.uuid4().hex[:6]}", chunk_tokens=4)
    peer = client._tcp.peer(client._node_table()[agent.node_id].tcp_endpoint)
    real_reserve = peer.reserve
    closed = threading.Event()

    def reserve_then_close(*args: Any, **kwargs: Any) -> Any:
        got = real_reserve(*args, **kwargs)
        if not closed.is_set():
            closer = threading.Thread(target=cache.close, daemon=True)
            closer.start()
            closer.join(10)
            closed.set()
        return got

    peer.reserve = reserve_then_close  # type: ignore[method-assign]
    tokens = list(range(16))
    chunks = [np.full(MiB, i, np.uint8) for i in range(4)]
    try:
        with pytest.raises(MooncakeError, match="PrefixCache is closed"):
            cache.store(tokens, chunks)
    finally:
        peer.reserve = real_reserve  # type: ignore[method-assign]
    assert closed.is_set(), "the close was not placed after the RESERVE"
    assert not any(client.exists(k) for k in cache.keys(tokens)), "a chunk was stored after close()"
    assert agent.table.reserved_deadlines(), "nothing was reserved: the interleaving did not happen"
    # abandon() sends that FREE from a thread of its own (the storing thread owes its caller the
    # error at once), so it may land a moment after store() raised: syncs, each freeing what a FREE
    # expired, for up to 5 s. A refused FREE leaves the reservations until the 30 s reserve timeout.
    deadline = time.monotonic() + 5.0
    while True:
        agent.sync_once()
        held = agent.table.reserved_deadlines()
        if not held or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    used = agent.table.usage()[0]
    assert not held and used == baseline, (
        f"the store refused at count-in left {len(held)} reservation(s) ({used - baseline} B) on the agent, "
        f"held until its reserve timeout ({agent.config.reserve_timeout_s:g} s) though the client is open: "
        "the FREE of abandon() was refused by the PrefixCache's cancelled Cancel"
    )


def test_a_refused_write_that_declares_a_huge_length_and_sends_nothing_does_not_hold_its_slot(
    start_agent: Callable[..., LocalCluster],
) -> None:
    """README: 'one past the limit gets BUSY (with the limit) in reply to its first request, then
    the close (a refused WRITE's payload is read and dropped first, for as long as a served one
    could take ...)'. A served WRITE that sends nothing is cut after the server's timeout (each recv
    is bounded by it; 2 s here), whatever length it declared. A refused one is not: its linger is
    REFUSE_LINGER_S + length / MIN_RATE_BPS from the header, taken as given (here 1 TiB: about
    twelve days at 1 MiB/s), and only the client's own close ends it. Two such connections (the
    agent's MAX_REFUSALS set to 2, 16 by default) hold every refusal slot: the next client past
    the limit is closed without a reply, so PeerConnections raises a TransferError instead of
    AgentBusy, and the two descriptors stay open in the agent."""
    cluster = start_agent({"MAX_CONNECTIONS": 1, "MAX_REFUSALS": 2, "timeout_s": 2.0})
    held = connect_raw(cluster)
    held.sendall(frames.pack(Op.PING))
    assert read_reply(held)[1] == Status.OK
    fds_before = agent_port_fds(cluster)
    silent: list[socket.socket] = []
    peer = PeerConnections(cluster.agents[0].endpoint, timeout_s=5, max_idle=1)
    try:
        for _ in range(2):
            sock = connect_raw(cluster)
            silent.append(sock)
            sock.sendall(frames.pack(Op.WRITE, 0, 12345, 0, 1 << 40))  # and not one payload byte
            assert read_reply(sock)[:3] == (Op.WRITE | frames.REPLY_BIT, Status.BUSY, 1)
        # Past REFUSE_LINGER_S (1 s) and the server's own timeout (2 s) for a silent request: due
        # ~3 s from now, waited for up to 15 s (a loaded machine's agent may close them late).
        wait_until(lambda: agent_port_fds(cluster) == fds_before, 15)
        fds_after = agent_port_fds(cluster)
        try:
            peer.ping()
            outcome = "served"
        except AgentBusy:
            outcome = "AgentBusy"
        except MooncakeError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
    finally:
        peer.close()
        for sock in silent:
            sock.close()
        held.close()
    assert outcome == "AgentBusy" and fds_after == fds_before, (
        f"two refused WRITEs that sent nothing for 15 s still hold {fds_after - fds_before} descriptor(s) "
        f"in the agent, and the next client past the limit got {outcome!r} instead of BUSY"
    )


def test_a_refused_write_that_trickles_its_payload_is_closed_within_the_drain_cap(
    start_agent: Callable[..., LocalCluster],
) -> None:
    """The same slot held another way: a refused WRITE declaring 2**63 B that sends a byte every
    0.3 s. Each byte renewed its idle deadline and its linger ran for the length it declared, so
    it held its refusal for good. The drain now waits for at most REFUSE_DRAIN_MAX_BYTES of
    payload (1 MiB here, at MIN_RATE_BPS 1 MiB/s: closed ~2 s after the reply)."""
    cluster = start_agent({"MAX_CONNECTIONS": 1, "REFUSE_DRAIN_MAX_BYTES": MiB, "timeout_s": 1.0})
    held = connect_raw(cluster)
    try:
        held.sendall(frames.pack(Op.PING))
        assert read_reply(held)[1] == Status.OK
        with connect_raw(cluster) as sock:
            sock.sendall(frames.pack(Op.WRITE, 0, 12345, 0, (1 << 63) - 1))
            assert read_reply(sock)[:3] == (Op.WRITE | frames.REPLY_BIT, Status.BUSY, 1)
            replied = time.monotonic()
            closed_after = None
            while time.monotonic() - replied < 8.0:
                try:
                    sock.sendall(b"x")
                except OSError:  # reset: the agent closed it, and a byte arrived after
                    closed_after = time.monotonic() - replied
                    break
                time.sleep(0.3)
    finally:
        held.close()
    assert closed_after is not None, "a refused WRITE trickling its payload held its slot for 8 s"


def take_the_only_slot(busy: LocalCluster) -> socket.socket:
    """A connection that the agent at MAX_CONNECTIONS=1 admitted. The writer's pooled connection,
    closed just before, leaves the agent's count only once its serving thread has seen the close,
    which a loaded machine can put off: until then a new connection is turned away (BUSY)."""
    deadline = time.monotonic() + 10
    while True:
        held = connect_raw(busy)
        held.sendall(frames.pack(Op.PING))
        if read_reply(held)[1] == Status.OK:
            return held
        held.close()
        assert time.monotonic() < deadline, "the writer's closed connection still holds the only slot"
        # Each refusal lingers ~1 s in the agent, which keeps 16 at most (past that it closes new
        # connections unanswered): a few tries a second stay well under that.
        time.sleep(0.2)


def test_a_get_with_replicas_on_a_busy_agent_and_a_healthy_one_reads_the_healthy_one(
    start_agent: Callable[..., LocalCluster], make_inproc_agent: Callable[..., Agent], redis_url: str
) -> None:
    """Guard (passes): a key with replicas on an agent at its connection limit and on one with
    room is read from the latter, alone and in a batch, over TCP; only a key whose every replica is
    on the busy agent fails, with AgentBusy naming the limit."""
    busy = start_agent({"MAX_CONNECTIONS": 1})
    namespace = busy.namespace
    make_inproc_agent(namespace=namespace, host_bytes=16 * MiB, reserve_timeout_s=30.0)
    writer = connect(redis_url, namespace=namespace, transports=("tcp",))
    try:
        both = {f"both-{i}": np.full(4096, i, np.uint8) for i in range(6)}
        writer.put_many(both, replicas=2)
        only = np.full(4096, 99, np.uint8)
        writer.put("only-busy", only, preferred_node=busy.agents[0].node_id)
    finally:
        writer.close()
    reader = connect(redis_url, namespace=namespace, transports=("tcp",), timeout_s=5.0)
    held = take_the_only_slot(busy)
    try:
        got = reader.get_many(list(both))
        assert all(np.array_equal(g, v) for g, v in zip(got, both.values(), strict=True))
        assert np.array_equal(reader.get("both-0"), both["both-0"])
        with pytest.raises(AgentBusy, match="connection limit of 1"):
            reader.get_many([*both, "only-busy"])
    finally:
        held.close()
        reader.close()
