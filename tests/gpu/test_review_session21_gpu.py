"""GPU review (session 21), desk-checked against cupy's sources: a device array put with more
replicas than same-host GPU tiers, a read-only device array as get_into's out. Skipped without
cupy and a CUDA device (tests/gpu/conftest.py); the read-only check that needs no device is in
tests/unit/test_device_array_interface.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from mooncake_store import Client, InvalidValue, LocalCluster

MiB = 1 << 20


def test_a_device_put_with_more_replicas_than_gpu_tiers_is_staged_to_host(  # type: ignore[no-untyped-def]
    cupy, make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """One GPU tier and replicas=2: the put chose the GPU tier for having one, kept only GPU
    nodes as candidates and failed with NoCapacity, where the same bytes from host memory store
    on both nodes. It is staged to host memory once, as the README says of a device array with
    no GPU tier to take it."""
    cluster = make_cluster(0)
    cluster.add_agent(node_id="gpu-a", extra_args=["--host-bytes", str(32 * MiB), "--gpu-mem", str(16 * MiB)])
    cluster.add_agent(node_id="host-b", extra_args=["--host-bytes", str(32 * MiB)])
    client = make_client(cluster)
    host_x = np.arange(MiB // 4, dtype=np.float32)
    client.put("two", cupy.asarray(host_x), replicas=2)
    meta = client.object_meta("two")
    assert meta is not None
    assert sorted((r.node_id, str(r.tier)) for r in meta.replicas) == [("gpu-a", "host"), ("host-b", "host")]
    assert np.array_equal(client.get("two"), host_x)
    client.put("one", cupy.asarray(host_x))  # one replica still goes to the GPU tier
    one = client.object_meta("one")
    assert one is not None and [(r.node_id, str(r.tier)) for r in one.replicas] == [("gpu-a", "gpu")]


class _ReadOnlyView:
    """A device array whose producer says it must not be written (data[1] is True)."""

    def __init__(self, array: Any) -> None:
        self._owner = array  # the memory lives as long as the view: a put copies from it later
        iface = dict(array.__cuda_array_interface__)
        iface["data"] = (iface["data"][0], True)
        self.__cuda_array_interface__ = iface


def test_a_read_only_device_array_is_no_destination(  # type: ignore[no-untyped-def]
    cupy, gpu_cluster: LocalCluster, make_client: Callable[..., Client]
) -> None:
    client = make_client(gpu_cluster)
    client.put("src", np.arange(64, dtype=np.uint8))
    target = cupy.zeros(64, dtype=cupy.uint8)
    with pytest.raises(InvalidValue, match="is read-only"):
        client.get_into("src", _ReadOnlyView(target))
    assert not cupy.asnumpy(target).any()  # nothing was written
    client.put("from-read-only", _ReadOnlyView(cupy.arange(8, dtype=cupy.uint8)))  # a source is only read
    assert client.get("from-read-only").tolist() == list(range(8))
