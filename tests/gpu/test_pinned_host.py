"""Host memory page-locked for device copies: an agent with a GPU tier pins its own arena (its
demotions copy into it), a client pins an agent's arena on its first device read of a host-tier
object, and every pinning is undone before its mapping goes away, once the copies through it end."""

from __future__ import annotations

import gc
import threading
import uuid

import numpy as np
import pytest
from helpers import run_in_threads

from mooncake_store import Client, LocalCluster, MooncakeError, connect
from mooncake_store.tiers.gpu_arrays import host_pointer, memcpy
from mooncake_store.tiers.host import HostArena, SharedSegment

MiB = 1 << 20
#: cudaPointerAttributes.type: cudaMemoryTypeUnregistered, cudaMemoryTypeHost
UNREGISTERED, REGISTERED_HOST = 0, 1


def memory_type(cupy, pointer: int) -> int:  # type: ignore[no-untyped-def]
    return int(cupy.cuda.runtime.pointerGetAttributes(pointer).type)


def new_arena(size: int) -> HostArena:
    return HostArena.create(f"mooncake-test-pin-{uuid.uuid4().hex}", size)


def test_arena_pins_copies_and_unpins_before_unmap(cupy) -> None:  # type: ignore[no-untyped-def]
    for round_ in range(3):  # a new mapping may reuse the last one's addresses: no stale pinning
        arena = new_arena(8 * MiB)
        try:
            assert arena.pin_for_devices() and arena.pinned
            with arena.device_view(0, 8 * MiB) as whole:
                base = host_pointer(whole)
            assert memory_type(cupy, base) == REGISTERED_HOST
            data = np.random.default_rng(round_).integers(0, 256, 3 * MiB, dtype=np.uint8)
            dev = cupy.asarray(data)
            with arena.device_view(MiB, 3 * MiB) as view:  # device to pinned host
                memcpy(host_pointer(view), int(dev.data.ptr), 3 * MiB, 0)
                assert np.array_equal(np.frombuffer(view, np.uint8), data)
            # A memset queued on the default stream: the copy must land after it. (On a non-blocking
            # stream of its own, as the copies once ran, it did not: this failed on an H200.)
            back = cupy.zeros(3 * MiB, dtype=cupy.uint8)
            with arena.device_view(MiB, 3 * MiB) as view:  # and pinned host to device
                memcpy(int(back.data.ptr), host_pointer(view), 3 * MiB, 0)
            assert np.array_equal(cupy.asnumpy(back), data)
        finally:
            arena.close()
        assert not arena.pinned
        assert memory_type(cupy, base) == UNREGISTERED  # unregistered, then unmapped


def test_a_pinned_mapping_dropped_without_close_is_unpinned(cupy) -> None:  # type: ignore[no-untyped-def]
    """A client dropped without close() must not leave its mapping of an agent's arena registered
    after the pages are unmapped: the next mapping at that address would inherit it."""
    arena = new_arena(8 * MiB)
    try:
        segment = SharedSegment.attach(arena.name, arena.size_bytes)
        assert segment.pin_for_devices(0)
        with segment.device_view(0, 1) as first:
            base = host_pointer(first)
        assert memory_type(cupy, base) == REGISTERED_HOST
        del segment, first
        gc.collect()
        assert memory_type(cupy, base) == UNREGISTERED
    finally:
        arena.close()


def test_close_waits_for_the_copies_through_the_pinning(cupy) -> None:  # type: ignore[no-untyped-def]
    """Copies racing a close either finish with the right bytes or are refused as closed; none
    runs through a range unregistered (or unmapped) under it."""
    block = 4 * MiB
    arena = new_arena(8 * block)
    pattern = np.arange(8 * block, dtype=np.uint32).astype(np.uint8)
    with arena.device_view(0, 8 * block) as whole:
        np.frombuffer(whole, np.uint8)[:] = pattern
    assert arena.pin_for_devices()
    started = threading.Barrier(5)
    outcomes: list[str] = []

    def reader(worker: int) -> None:
        dest = cupy.empty(block, dtype=cupy.uint8)
        started.wait(timeout=30)
        for i in range(40):
            offset = ((worker + i) % 8) * block
            try:
                with arena.device_view(offset, block) as view:
                    memcpy(int(dest.data.ptr), host_pointer(view), block, 0)
            except MooncakeError as exc:
                assert "closed" in str(exc), exc
                outcomes.append("refused")
                return
            assert np.array_equal(cupy.asnumpy(dest), pattern[offset : offset + block])
        outcomes.append("done")

    closer = threading.Thread(target=lambda: (started.wait(timeout=30), arena.close()))
    closer.start()
    assert run_in_threads(reader, 4) == []
    closer.join(timeout=60)
    assert not closer.is_alive() and not arena.pinned
    assert len(outcomes) == 4, outcomes


def test_device_reads_pin_the_agents_arena_unless_told_not_to(
    cupy,
    gpu_cluster: LocalCluster,
    make_client,  # type: ignore[no-untyped-def]
) -> None:
    pinning: Client = make_client(gpu_cluster)
    plain: Client = make_client(gpu_cluster, pin_shared_arenas=False)
    value = np.random.default_rng(5).integers(0, 256, 5 * MiB + 7, dtype=np.uint8)
    pinning.put("to-device", value)
    node = pinning._node_table()["gpu-0"]
    assert node.labels["host_pinned"] == "1"  # the agent pinned its own arena for demotions
    segments = {}
    for client, pinned in ((pinning, True), (plain, False)):
        got = client.get("to-device", device="cuda:0")
        assert np.array_equal(cupy.asnumpy(got), value)
        segments[pinned] = client._shm._segments[node.shm_name]
        assert segments[pinned].pinned is pinned
    pinning.close()  # unpins, then unmaps
    assert segments[True].closed and not segments[True].pinned
    assert np.array_equal(cupy.asnumpy(plain.get("to-device", device="cuda:0")), value)


@pytest.mark.parametrize("size", [MiB, 16 * MiB])
def test_pinned_round_trip_through_the_store(cupy, gpu_cluster: LocalCluster, make_client, size: int) -> None:  # type: ignore[no-untyped-def]
    client: Client = make_client(gpu_cluster)
    values = {f"p/{size}/{i}": np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(3)}
    for key, value in values.items():
        client.put(key, value)
    for key, value in values.items():
        out = cupy.zeros(size, dtype=cupy.uint8)
        assert client.get_into(key, out) == size
        assert np.array_equal(cupy.asnumpy(out), value), key


def test_a_client_sharing_its_process_with_the_agent_pins_its_own_mapping(
    cupy,
    make_inproc_agent,
    redis_url: str,  # type: ignore[no-untyped-def]
) -> None:
    """The agent's arena and the client's mapping of it are two address ranges over the same pages
    in one process: each is registered on its own, and both copy right."""
    agent = make_inproc_agent(host_bytes=16 * MiB, gpu_bytes=8 * MiB, reserve_timeout_s=10.0, prefault=True)
    assert agent.arena.pinned
    value = np.random.default_rng(9).integers(0, 256, 2 * MiB, dtype=np.uint8)
    with connect(redis_url, namespace=agent.namespace) as client:
        client.put("same-process", value)
        assert np.array_equal(cupy.asnumpy(client.get("same-process", device="cuda:0")), value)
        assert client._shm._segments[agent.arena.name].pinned
