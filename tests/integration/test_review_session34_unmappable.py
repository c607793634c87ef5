"""A same-host arena this process cannot map (mmap refused: ENOMEM under an address-space limit, as
a container's limit or vm.max_map_count gives it): the read and the put go over TCP, as the agents'
own peer mappings fall back. A bare OSError escaped get and put."""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from cuda_stand_in import HostBackedDeviceArray, HostRuntime, stand_in_cupy

from mooncake_store import Client, LocalCluster

MiB = 1 << 20


@contextlib.contextmanager
def address_space_left(spare: int) -> Iterator[None]:
    """This process may map only ``spare`` bytes more (RLIMIT_AS), for the block's length."""
    status = Path("/proc/self/status").read_text().splitlines()
    size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size + spare, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_a_read_and_a_put_to_an_arena_that_cannot_be_mapped_go_over_tcp(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(2, host_bytes=256 * MiB)
    writer = make_client(cluster, transports=("tcp",))
    writer.put("a", np.full(1000, 1, dtype=np.uint8), preferred_node="agent-0")
    writer.put("b", np.full(1000, 2, dtype=np.uint8), preferred_node="agent-1")
    client = make_client(cluster)  # shm and tcp
    assert (client.get("a") == 1).all()  # agent-0's arena mapped, the client's threads started
    into_device = make_client(cluster, pin_shared_arenas=False)  # the stand-in pins nothing
    into_device.get("a")
    backing = np.zeros(1000, np.uint8)
    with address_space_left(64 * MiB):  # not agent-1's 256 MiB arena
        assert (client.get("b") == 2).all()
        client.put("c", np.full(1000, 3, dtype=np.uint8), preferred_node="agent-1")
        with stand_in_cupy(HostRuntime()):  # a device read: the agent copies it out over TCP
            assert into_device.get_into("b", HostBackedDeviceArray(backing, (1000,))) == 1000
    assert (backing == 2).all()
    assert (writer.get("c") == 3).all()
    assert agent_1_shm_name(client) not in client._shm._segments  # it was not mapped after all


def agent_1_shm_name(client: Client) -> str:
    return client._node_table()["agent-1"].shm_name
