"""Review of the read path (session 4): each test fails on the code as reviewed, for the reason its
docstring gives. Real Redis, real agents (in-process where an interleaving must be placed)."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import numpy as np
import pytest

from mooncake_store import Client, connect
from mooncake_store.agent.node import Agent
from mooncake_store.errors import InvalidValue, TransferError


def _key(tag: str) -> str:
    return f"rv4g-{tag}-{uuid.uuid4().hex[:8]}"


def test_same_host_read_after_agent_restart_with_same_segment_name(
    make_inproc_agent: Callable[..., Agent], redis_url: str
) -> None:
    """ShmTransport caches mapped segments by name only (shm.py segment/reachable). An agent that
    restarted under the same node id and pid (PID 1 in its container, an embedded agent restarted
    in its process) created a new arena under the same name; a client that mapped the first one
    kept copying out of the old, unlinked inode, so a get of a new object returned the bytes of an
    object the previous incarnation held at that offset (no error, no checksum check by default).
    Fixed since: the incarnation is part of the segment name."""
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    node_id = f"rv-{uuid.uuid4().hex[:6]}"
    first = make_inproc_agent(namespace=namespace, node_id=node_id)
    reader = connect(redis_url, namespace=namespace)
    try:
        old = b"\xaa" * 8192
        old_key = _key("old")
        reader.put(old_key, old)
        assert reader.get(old_key).tobytes() == old  # the reader maps the first arena
        first_name = first.arena.name
        first.stop()
        second = make_inproc_agent(namespace=namespace, node_id=node_id)
        # Same node id, same pid: before the fix the same segment name, over a new arena. Each
        # incarnation now names its own segment.
        assert second.arena.name != first_name
        new = b"\x55" * 8192
        key = _key("new")
        with connect(redis_url, namespace=namespace) as writer:
            writer.put(key, new)
            assert writer.get(key).tobytes() == new  # a fresh client reads the new arena
        got = reader.get(key)
        assert got.tobytes() == new, f"read {got[:4].tobytes()!r}... from the previous incarnation's arena"
    finally:
        reader.close()


def test_get_many_train_verifies_checksum_like_get(make_inproc_agent: Callable[..., Agent], redis_url: str) -> None:
    """gets.py _read_targets: objects read in a pipelined TCP train are never checked against their
    checksum, while _read_object checks every other read when verify_checksum is on. With a
    corrupted replica, get(key) fails cleanly but get_many([key, other]) returns the bad bytes."""
    agent = make_inproc_agent()
    client: Client = connect(redis_url, namespace=agent.namespace, transports=("tcp",), verify_checksum=True)
    try:
        a, b = _key("a"), _key("b")
        client.put_many({a: b"\x11" * 4096, b: b"\x22" * 4096})
        meta = client.object_meta(a)
        assert meta is not None and meta.checksum
        view = agent.arena.view(meta.replicas[0].offset, 4)
        view[:] = b"\xff\xff\xff\xff"  # a fault in the agent's memory: the stored bytes no longer match
        view.release()
        with pytest.raises(TransferError, match="checksum"):
            client.get(a)
        try:
            got = client.get_many([a, b])
        except TransferError:
            return  # the fixed behaviour: the batch fails the same way the single get does
        pytest.fail(f"get_many returned {got[0][:4].tobytes()!r}... for {a!r} without checking its checksum")
    finally:
        client.close()


@pytest.mark.parametrize("dtype", [object, "M8[s]"])
def test_get_into_refuses_out_dtypes_without_a_byte_layout(shared_client: Client, dtype: object) -> None:
    """buffers.py as_destination checks only writability and contiguity. An object array passes
    (memoryview exports it as bytes), so get_into writes raw bytes over its PyObject pointers (here
    zeros, so NULLs; any other object's bytes make wild pointers); a datetime64 array raises a bare
    ValueError from numpy instead of an InvalidValue naming the dtype (DESIGN.md §3.6)."""
    key = _key("dst")
    shared_client.put(key, bytes(24))
    out = np.empty(3, dtype=dtype)
    with pytest.raises(InvalidValue):
        shared_client.get_into(key, out)
