"""Object records the index holds that do not fit their bytes (written by hand or by another
build; review, thirty-sixth session): numpy's ValueError, TypeError or MemoryError escaped get and
get_many, a negative size made get_into read nothing and return that size, and a dimension of -1
gave the array another shape than the one recorded. Each is now a MooncakeError naming the
record: a ProtocolError for a record that cannot be right, and a MooncakeError with the size for
an object this process cannot allocate."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from mooncake_store import Client, LocalCluster
from mooncake_store.errors import MooncakeError, ProtocolError

VALUE = np.arange(100, dtype=np.uint8).reshape(10, 10)


@pytest.fixture
def stored(make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]) -> Client:
    client = make_client(make_cluster(1))
    client.put("k", VALUE)
    return client


def _set(client: Client, field: str, value: str) -> None:
    client.index.redis.hset(client.index.prefix + "o:k", field, value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("size", "-5"),
        ("size", str(1 << 70)),
        ("shape", "-1,100"),
        ("shape", "10,11"),
        ("shape", "0"),
        ("shape", str(1 << 70)),
        ("shape", ",".join(["1"] * 40) + ",100"),
        ("dtype", "zz"),
        ("dtype", "object"),
        ("dtype", "<V0"),
        ("dtype", "<f8"),
    ],
)
def test_a_record_that_does_not_fit_its_bytes_is_a_protocol_error(stored: Client, field: str, value: str) -> None:
    _set(stored, field, value)
    for read in (lambda: stored.get("k"), lambda: stored.get_many(["k"])):
        with pytest.raises(ProtocolError, match=r"malformed|do not fit"):
            read()
    if field == "size":  # get_into copies bytes by the size alone: the dtype and shape are not its business
        with pytest.raises(ProtocolError, match="the size"):
            stored.get_into("k", np.zeros(100, np.uint8))


def test_an_object_too_large_for_this_process_is_a_mooncake_error(stored: Client) -> None:
    _set(stored, "size", str(1 << 55))  # 32 PiB: no host has it
    for read in (lambda: stored.get("k"), lambda: stored.get_many(["k"])):
        with pytest.raises(MooncakeError, match=f"cannot allocate {1 << 55} B for key 'k'") as info:
            read()
        assert not isinstance(info.value, MemoryError)
    with pytest.raises(MooncakeError, match=f"out holds 100 B but key 'k' is {1 << 55} B"):
        stored.get_into("k", np.zeros(100, np.uint8))


def test_the_record_as_written_still_reads(stored: Client) -> None:
    assert np.array_equal(stored.get("k"), VALUE)
    assert stored.get("k").shape == (10, 10)
    stored.put("scalar", np.float32(2.5))
    assert stored.get("scalar").shape == () and stored.get("scalar") == np.float32(2.5)
    stored.put("empty", np.zeros((0, 3), np.int16))
    assert stored.get("empty").shape == (0, 3)
