"""Promotion after a disk read runs off the connection that served the read (agent/promotions.py).

Real in-process Agents with a disk tier against the session's real Redis-compatible server, read by
a real client over TCP. The index call of a promotion's swap is held (the real call runs once the
test lets it), as a slow or unreachable index would hold it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import wait_until

from mooncake_store import Client, connect
from mooncake_store.agent import promotions
from mooncake_store.agent.node import Agent
from mooncake_store.types import TierKind

SIZE = 64 << 10


@pytest.fixture
def disk_agent(make_inproc_agent: Callable[..., Agent], tmp_path: Path) -> Agent:
    return make_inproc_agent(host_bytes=8 << 20, reserve_timeout_s=5.0, disk_path=str(tmp_path), disk_bytes=64 << 20)


@pytest.fixture
def client(disk_agent: Agent) -> Iterator[Client]:
    c = connect(disk_agent.index.url, namespace=disk_agent.namespace, timeout_s=20)
    yield c
    c.close()


class HeldPromotions:
    """The agent's promotion swaps wait for ``release`` (then run for real); ``swapping`` is set
    once the first one is waiting. ``offers`` records each read's offer to the promotion queue
    and whether it was queued: a READ offers its object once its reply is sent, so the reader may
    have its bytes before the offer is made."""

    def __init__(self, agent: Agent) -> None:
        self.swapping, self.release = threading.Event(), threading.Event()
        self.offers: list[tuple[int, bool]] = []
        real = agent.index.move_replica
        queue = agent.pressure.promotions
        real_offer = queue.offer

        def recorded_offer(disk_id: int, data: bytearray) -> bool:
            queued = real_offer(disk_id, data)
            self.offers.append((disk_id, queued))
            return queued

        queue.offer = recorded_offer  # type: ignore[method-assign]

        def held(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("promotion"):
                self.swapping.set()
                assert self.release.wait(30)
            return real(*args, **kwargs)

        agent.index.move_replica = held  # type: ignore[method-assign]


def value_of(key: str) -> np.ndarray:
    return np.full(SIZE, sum(key.encode()) % 251, dtype=np.uint8)


def put_on_disk(agent: Agent, client: Client, keys: list[str]) -> None:
    for key in keys:
        client.put(key, value_of(key))
    agent.sync_once()  # the puts' acks: their blocks are committed
    for victim in agent.index.victim_candidates(agent.node_id, str(TierKind.HOST)):
        location = agent.table.offset_of(victim.alloc_id)
        assert location is not None and agent.pressure.moves.demote_to_disk(victim, location[0])
    assert all(tier_of(client, key) == "disk" for key in keys)


def promoted(agent: Agent) -> int:
    return agent.pressure.counters[TierKind.DISK]["promotions"]


def tier_of(client: Client, key: str) -> str | None:
    meta = client.object_meta(key)
    return str(meta.replicas[0].tier) if meta is not None and len(meta.replicas) == 1 else None


def test_a_promotion_held_by_the_index_does_not_hold_the_next_read_of_its_connection(
    disk_agent: Agent, client: Client
) -> None:
    """The promotion used to run on the connection's thread after the reply went out: the client's
    next read on that connection waited for the promotion's index round trip (here held 30 s)."""
    put_on_disk(disk_agent, client, ["a", "b"])
    held = HeldPromotions(disk_agent)
    try:
        assert np.array_equal(client.get("a"), value_of("a"))  # from disk; its promotion waits
        assert held.swapping.wait(10), "no promotion after the disk read"
        got: list[np.ndarray] = []
        second = threading.Thread(target=lambda: got.append(client.get("b")), daemon=True)
        second.start()
        second.join(timeout=10)
        assert not second.is_alive(), "the next read waited for the held promotion"
        assert np.array_equal(got[0], value_of("b"))
    finally:
        held.release.set()
    # Both promotions land once the index answers: the second read's was queued behind the first.
    assert wait_until(lambda: tier_of(client, "a") == "host" and tier_of(client, "b") == "host", 10)
    # Counted once the swap's call returns, just after the index shows it.
    assert wait_until(lambda: promoted(disk_agent) == 2, 5), promoted(disk_agent)


def test_promotions_are_bounded_in_bytes_and_not_queued_twice(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With room for one and a half objects queued: while the first promotion is held, a second
    read of the same object and a read of another are served from disk and not queued; the other
    object stays on disk, whole, and its next read promotes it."""
    monkeypatch.setattr(promotions, "MAX_QUEUED_BYTES", SIZE + SIZE // 2)
    agent = make_inproc_agent(host_bytes=8 << 20, reserve_timeout_s=5.0, disk_path=str(tmp_path), disk_bytes=64 << 20)
    client = connect(agent.index.url, namespace=agent.namespace, timeout_s=20)
    try:
        put_on_disk(agent, client, ["a", "b"])
        held = HeldPromotions(agent)
        try:
            assert np.array_equal(client.get("a"), value_of("a"))
            assert held.swapping.wait(10), "no promotion after the disk read"
            assert np.array_equal(client.get("a"), value_of("a"))  # again from disk: queued already
            assert np.array_equal(client.get("b"), value_of("b"))  # no room in the queue
            # The READs offer after their replies: released before b's offer was made (twice in
            # loaded 3-worker runs), a's promotion had left the queue, and b's was taken.
            assert wait_until(lambda: len(held.offers) == 3, 10), held.offers
        finally:
            held.release.set()
        assert [queued for _, queued in held.offers] == [True, False, False], held.offers
        assert wait_until(lambda: tier_of(client, "a") == "host" and promoted(agent) == 1, 10), (
            client.object_meta("a"),
            agent.pressure.counters[TierKind.DISK],
        )
        assert tier_of(client, "b") == "disk"
        assert np.array_equal(client.get("b"), value_of("b"))
        assert wait_until(lambda: tier_of(client, "b") == "host" and promoted(agent) == 2, 10), promoted(agent)
    finally:
        client.close()


def test_a_chunk_file_swapped_on_disk_is_dropped_when_a_spill_reads_it(disk_agent: Agent, client: Client) -> None:
    """A spill to a peer's disk sends the file as stored; one that no longer matches what was stored
    (another sound file put in its place) was skipped and kept, and chosen again at every pass.
    Its replica is dropped now, as a read's would be."""
    from mooncake_store.agent.payloads import read_payload
    from mooncake_store.agent.spill_jobs import SpillJob

    put_on_disk(disk_agent, client, ["a", "b"])
    disk = disk_agent.disk
    assert disk is not None
    victims = {v.key: v for v in disk_agent.index.victim_candidates(disk_agent.node_id, str(TierKind.DISK))}
    disk.path_of(victims["a"].alloc_id).write_bytes(disk.path_of(victims["b"].alloc_id).read_bytes())
    job = SpillJob(victim=victims["a"], offset=0)
    assert read_payload(disk_agent, job, TierKind.DISK, TierKind.DISK) is None
    assert client.object_meta("a") is None, "the swapped file's replica is still listed"
    assert np.array_equal(client.get("b"), value_of("b"))
