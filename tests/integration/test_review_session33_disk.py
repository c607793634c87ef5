"""A passing failure to open a chunk file (EMFILE: the agent out of file descriptors under load)
was taken for a damaged file: the only replica of an intact object was dropped from the index,
and the object was gone for good once descriptors were free again (review, thirty-third
session). Only a file gone or unreadable (ENOENT, EIO, ...) loses its replica now."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import run_in_threads, wait_until

from mooncake_store import Client, LocalCluster, connect
from mooncake_store.agent import ops
from mooncake_store.agent.node import Agent
from mooncake_store.errors import MooncakeError
from mooncake_store.tiers.disk import DiskTier
from mooncake_store.types import TierKind

KiB = 1 << 10
MiB = 1 << 20


def idle(agent: Agent) -> None:
    agent.pressure.run = lambda stop: stop.wait()  # type: ignore[method-assign]


def disk_agent(make_inproc_agent: Callable[..., Agent], tmp_path: Path) -> Agent:
    """An agent whose host tier demotes to its disk tier at once (relieve_host), nothing promoted
    back on a read, and no pressure loop of its own."""
    return make_inproc_agent(
        host_bytes=1 * MiB,
        disk_path=str(tmp_path / "disks"),
        disk_bytes=16 * MiB,
        high_watermark=0.3,
        low_watermark=0.01,
        promote_on_read=False,
        prepare=idle,
    )


def on_disk(agent: Agent, client: Client, key: str, value: np.ndarray) -> int:
    """Put ``key`` on ``agent`` and demote it to its disk tier; returns its disk allocation."""
    client.put(key, value, preferred_node=agent.node_id)
    agent.sync_once()
    agent.pressure.relieve_host()
    meta = agent.index.lookup([key], lease_ms=0).objects[0]
    assert meta is not None and meta.replicas[0].tier == TierKind.DISK
    return meta.replicas[0].alloc_id


def test_a_file_that_cannot_be_opened_for_a_moment_does_not_lose_the_object(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = disk_agent(make_inproc_agent, tmp_path)
    value = np.frombuffer(os.urandom(512 * KiB), np.uint8)
    client = connect(agent.index.url, namespace=agent.namespace, lease_ms=50, timeout_s=5)
    try:
        alloc_id = on_disk(agent, client, "kv", value)
        assert agent.disk is not None
        path = agent.disk.path_of(alloc_id)
        real_read_file = DiskTier._read_file
        faults = [1]

        def out_of_descriptors(at: Path, length: int) -> bytes:
            if at == path and faults:
                faults.pop()
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), str(at))
            return real_read_file(at, length)

        monkeypatch.setattr(DiskTier, "_read_file", staticmethod(out_of_descriptors))
        try:
            first = client.get("kv")  # the agent answers that it cannot read it; the client asks again
            assert first.tobytes() == value.tobytes()
        except MooncakeError as exc:
            print("first read:", repr(exc)[:300])  # or the read fails: no wrong bytes either way
        assert not faults, "the fault was never met"
        # The file is intact and nobody removed the object: the next read must serve it.
        assert path.exists() and path.read_bytes()
        got = client.get("kv")
        assert got.tobytes() == value.tobytes()
    finally:
        client.close()


def test_an_unreadable_chunk_file_is_reported_as_kept_not_gone(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file the agent cannot read for a reason of its own (here EACCES, what a non-root agent
    meets after `chmod 000`) is kept, and its reader was told "agent ... no longer holds
    allocation N", which is false and hid where the reason is. The READ's STALE reply now says
    the file is kept but could not be read (frames.STALE_UNREADABLE)."""
    agent = disk_agent(make_inproc_agent, tmp_path)
    value = np.frombuffer(os.urandom(512 * KiB), np.uint8)
    client = connect(agent.index.url, namespace=agent.namespace, lease_ms=50, timeout_s=5)
    try:
        alloc_id = on_disk(agent, client, "kv", value)
        assert agent.disk is not None
        path = agent.disk.path_of(alloc_id)
        real_read_file = DiskTier._read_file

        def denied(at: Path, length: int) -> bytes:
            if at == path:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(at))
            return real_read_file(at, length)

        monkeypatch.setattr(DiskTier, "_read_file", staticmethod(denied))
        with pytest.raises(MooncakeError) as info:
            client.get("kv")
        message = str(info.value)
        assert agent.disk.entry(alloc_id) is not None  # kept, as promised
        assert "no longer holds" not in message, f"misleading: {message}"
        assert "could not read its file now" in message and "the file is kept" in message, message
        monkeypatch.undo()  # readable again: the same object reads back
        assert client.get("kv").tobytes() == value.tobytes()
    finally:
        client.close()


def test_every_read_sharing_an_unreadable_files_copy_is_told_it_is_kept(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """READs of one disk object at once share one decoded copy (agent/read_budget.py): the first
    reads the file, the others wait for it. When that read met a file kept but not readable now,
    only the first READ was answered so; the ones waiting found no copy and were told the agent
    no longer held the allocation. Here the file's read waits (bounded) until every other READ has
    come to share it, so that each READ but the first is one that waited."""
    readers = 4
    agent = disk_agent(make_inproc_agent, tmp_path)
    # The READs that wait for the copy wait up to this long (2 s): under load the last reader may
    # come later than that after the first, and the first would be answered that the budget is full.
    monkeypatch.setattr(ops, "READ_BUDGET_WAIT_S", 20.0)
    value = np.frombuffer(os.urandom(512 * KiB), np.uint8)
    clients = [
        connect(agent.index.url, namespace=agent.namespace, transports=("tcp",), max_retries=0, timeout_s=30)
        for _ in range(readers)
    ]
    try:
        alloc_id = on_disk(agent, clients[0], "kv", value)
        clients[0].put("warm", np.zeros(4 * KiB, np.uint8), preferred_node=agent.node_id)
        for client in clients:  # each one's connection to the agent made before the READs
            assert not client.get("warm").any()
        assert agent.disk is not None
        path = agent.disk.path_of(alloc_id)
        real_read_file = DiskTier._read_file
        budget = agent.server._read_budget
        sharing: list[int] = []

        def denied_once_all_share(at: Path, length: int) -> bytes:
            if at != path:
                return real_read_file(at, length)

            def users() -> int:
                held = budget._copies.get(alloc_id)
                return held.users if held is not None else 0

            wait_until(lambda: users() >= readers, timeout_s=15)
            sharing.append(users())
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(at))

        monkeypatch.setattr(DiskTier, "_read_file", staticmethod(denied_once_all_share))
        start = threading.Barrier(readers)
        messages: list[str] = []

        def read(i: int) -> None:
            start.wait(timeout=30)
            with pytest.raises(MooncakeError) as info:
                clients[i].get("kv")
            messages.append(str(info.value))

        assert not run_in_threads(read, readers)
        assert sharing == [readers], f"the READs did not all come to share one copy: {sharing}"
        assert len(messages) == readers
        for message in messages:
            assert "no longer holds" not in message, f"misleading: {message}"
            assert "could not read its file now" in message and "the file is kept" in message, message
        assert agent.disk.entry(alloc_id) is not None
        monkeypatch.setattr(DiskTier, "_read_file", staticmethod(real_read_file))
        assert clients[1].get("kv").tobytes() == value.tobytes()
    finally:
        for client in clients:
            client.close()


def test_running_out_of_file_descriptors_for_a_moment_does_not_lose_an_object(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """The same with a real EMFILE: the process's descriptor limit lowered to what is open while a
    disk object is read, then raised again."""
    import resource

    agent = disk_agent(make_inproc_agent, tmp_path)
    values = {k: np.frombuffer(os.urandom(300 * KiB), np.uint8) for k in ("warm", "kv")}
    client = connect(agent.index.url, namespace=agent.namespace, lease_ms=50, timeout_s=5)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        for key, value in values.items():
            client.put(key, value, preferred_node=agent.node_id)
        agent.sync_once()
        agent.pressure.relieve_host()
        found = agent.index.lookup(list(values), lease_ms=0).objects
        assert all(m is not None and m.replicas[0].tier == TierKind.DISK for m in found)
        assert client.get("warm").tobytes() == values["warm"].tobytes()  # connections made and pooled
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) - 3, hard))
        try:
            client.get("kv")
        except MooncakeError as exc:
            print("first read:", repr(exc)[:300])  # this read may fail
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert client.get("kv").tobytes() == values["kv"].tobytes()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        client.close()


def test_a_client_out_of_descriptors_gets_a_mooncake_error_not_an_oserror(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """A client that could not open a socket to an agent (EMFILE) raised the OSError of
    socket.socket() itself, from deep in the connection pool."""
    import resource

    cluster = make_cluster(1)
    writer = make_client(cluster)
    value = np.frombuffer(os.urandom(64 * KiB), np.uint8)
    writer.put("k", value)
    reader = make_client(cluster, transports=("tcp",), timeout_s=2)
    assert reader.object_meta("k") is not None  # its index connection is open; no agent connection yet
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) - 1, hard))
    try:
        with pytest.raises(MooncakeError) as info:
            reader.get("k")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert not isinstance(info.value, OSError)
    assert reader.get("k").tobytes() == value.tobytes()  # and the client works once it can


def test_freeing_a_settled_spill_still_held_in_the_inbox_forgets_its_key(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """A spilled file whose swap was acked while its reservation was held (after a rollback) is
    still in the inbox's table when the graveyard frees it: the inbox freed it, and its key stayed
    in disk_keys, where holds() took it for memory the agent still had."""
    agent = make_inproc_agent(host_bytes=MiB, disk_path=str(tmp_path / "disks"), disk_bytes=16 * MiB, prepare=idle)
    assert agent.inbox is not None
    allocs = agent.inbox.reserve([(4 * KiB, b"p" * 16)])
    assert allocs is not None
    alloc_id = allocs[0].alloc_id
    agent.inbox.table.hold_reservations(60_000)
    assert agent.inbox.settle([alloc_id]) == [alloc_id]
    agent.disk_keys[alloc_id] = "k"  # as the sync records a settled file's key
    assert alloc_id in agent.inbox  # held: freed only once its hold is over
    agent.free_allocations([alloc_id])
    assert alloc_id not in agent.disk_keys


def test_no_memory_to_decode_a_file_keeps_it(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A MemoryError for the staging buffer a byte-shuffled file (2-byte dtypes) decodes through
    escaped DiskTier.decode_into, and read_disk, into the connection's handler, which answers
    MooncakeErrors only; the file is kept and the read answers that it cannot be had now."""
    agent = disk_agent(make_inproc_agent, tmp_path)
    value = np.frombuffer(os.urandom(512 * KiB), np.float16)  # float16: shuffled on disk
    client = connect(agent.index.url, namespace=agent.namespace, lease_ms=50, timeout_s=5)
    try:
        alloc_id = on_disk(agent, client, "kv", value)
        assert agent.disk is not None
        real_empty = np.empty

        def no_memory_for_planes(shape: object, dtype: object = float, *args: object, **kwargs: object) -> np.ndarray:
            if shape == value.nbytes and dtype is np.uint8:  # the planes of this object's file only
                raise MemoryError
            return real_empty(shape, dtype, *args, **kwargs)  # type: ignore[call-overload, no-any-return]

        monkeypatch.setattr(np, "empty", no_memory_for_planes)
        with pytest.raises(MooncakeError, match="no memory now for the 524288 B its byte planes decode through"):
            agent.disk.read_into(alloc_id, memoryview(bytearray(value.nbytes)))
        assert agent.read_disk(alloc_id) is None
        monkeypatch.setattr(np, "empty", real_empty)
        assert client.get("kv").tobytes() == value.tobytes()
    finally:
        client.close()
