"""A chunk file spilled to a peer and found damaged there before the peer's sync learnt its key (its
swap had landed in the index, so readers were already sent to it): the peer refused the read,
counted the file corrupt, and never dropped its replica, so every later read failed on it as long
as the peer ran, and it kept its disk room (a disk-tier probe of 2026-12-07: 28-39 of 46 damaged
objects still listed 30 s later). Now the replica leaves the index once the sync names its key."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import disk_jobs, put_on_disk, random_bytes, replicas_of

from mooncake_store import Client, KeyNotFound
from mooncake_store.agent.node import Agent
from mooncake_store.errors import MooncakeError
from mooncake_store.types import TierKind

KiB, MiB = 1 << 10, 1 << 20


def test_a_peer_file_damaged_before_its_sync_is_dropped_once_the_sync_names_it(
    make_peer_agent: Callable[..., Agent], clients: Callable[..., Client], tmp_path: Path
) -> None:
    sender = make_peer_agent(disk_path=str(tmp_path / "disks"), disk_bytes=8 * MiB)
    peer = make_peer_agent(disk_path=str(tmp_path / "disks"), disk_bytes=8 * MiB)
    client = clients(sender, timeout_s=5)
    kept = random_bytes(128 * KiB, seed=1)
    put_on_disk(sender, "damaged", random_bytes(128 * KiB, seed=0))
    put_on_disk(sender, "kept", kept)
    result = sender.pressure._spiller.spill(sender.index.nodes()[peer.node_id], disk_jobs(sender), tier=TierKind.DISK)
    assert len(result.moved) == 2, result
    (replica,) = replicas_of(peer, "damaged")
    assert replica.node_id == peer.node_id and "damaged" not in peer.disk_keys.values()  # not synced yet
    assert peer.disk is not None
    path = peer.disk.path_of(replica.alloc_id)
    path.write_bytes(path.read_bytes()[:100])  # truncated behind the peer's back

    with pytest.raises(MooncakeError):
        client.get("damaged")  # refused by the peer: damaged, its key not known there yet
    peer.sync_once()  # the swap's ack names the key: the damaged replica leaves the index
    assert replicas_of(peer, "damaged") == []
    with pytest.raises(KeyNotFound):
        client.get("damaged")  # a miss, no longer a failure
    assert peer.pressure.counters[TierKind.DISK]["corrupt"] == 1
    assert client.stat().corrupt == 1
    assert (client.get("kept") == kept).all()
