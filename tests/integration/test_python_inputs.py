"""The SDK review's findings of 2026-12-07, end to end against a real cluster: an unhashable key,
a raw char buffer as a value, a non-contiguous destination tensor, ``device="cpu"``, the key a
KeyNotFound carries, PrefixCache's numpy bools and one buffer given as its chunks, and the
cluster's repr (see tests/unit/test_caller_inputs.py for the checks alone)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import pytest
import torch  # a test requirement (pyproject test extra): its absence is a failure, not a skip

from mooncake_store import Client, InvalidKey, InvalidValue, KeyNotFound, LocalCluster, PrefixCache


def test_an_unhashable_key_is_an_invalid_key_not_a_type_error(shared_client: Client) -> None:
    """put built {key: value} before it checked the key: 'unhashable type: bytearray'."""
    for key in (bytearray(b"k"), ["k"], {"k": 1}):
        with pytest.raises(InvalidKey, match=rf"key must be str, got {type(key).__name__}"):
            shared_client.put(key, b"v")  # type: ignore[arg-type]
        with pytest.raises(InvalidKey, match=rf"key must be str, got {type(key).__name__}"):
            shared_client.put_async(key, b"v").result(timeout=30)  # type: ignore[arg-type]


def test_a_ctypes_string_buffer_round_trips_as_its_bytes(shared_client: Client) -> None:
    key = "inputs/ctypes-chars"
    value = ctypes.create_string_buffer(b"kv-chunk", 16)
    shared_client.put(key, value)
    try:
        got = shared_client.get(key)
        assert (got.dtype, got.tobytes()) == (np.dtype(np.uint8), bytes(value))
        into = ctypes.create_string_buffer(16)
        assert shared_client.get_into(key, into) == 16
        assert into.raw == value.raw
    finally:
        shared_client.remove(key)


def test_a_non_contiguous_destination_tensor_is_refused_and_left_as_it_was(shared_client: Client) -> None:
    key = "inputs/strided-out"
    shared_client.put(key, np.arange(6, dtype=np.float32))
    try:
        out = torch.zeros(12)[::2]
        with pytest.raises(InvalidValue, match="not contiguous: get_into fills memory in place") as refused:
            shared_client.get_into(key, out)
        assert "call .contiguous()" not in str(refused.value)
        assert torch.equal(out, torch.zeros(6))
        # What the refusal advises: fill a contiguous tensor, then copy it into the view.
        whole = torch.empty(6)
        assert shared_client.get_into(key, whole) == 24
        out.copy_(whole)
        assert out.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    finally:
        shared_client.remove(key)


def test_device_cpu_is_host_memory_and_a_missing_key_is_named_on_its_error(shared_client: Client) -> None:
    key = "inputs/cpu-device"
    shared_client.put(key, np.arange(4, dtype=np.int16))
    try:
        for got in (shared_client.get(key, device="cpu"), shared_client.get_async(key, device="cpu").result(30)):
            assert isinstance(got, np.ndarray) and got.tolist() == [0, 1, 2, 3]
    finally:
        shared_client.remove(key)
    with pytest.raises(KeyNotFound) as missing:
        shared_client.get(key)
    assert missing.value.key == key
    with pytest.raises(KeyNotFound) as missing:
        shared_client.get_many_into(["inputs/there-is-none", key], [bytearray(8), bytearray(8)])
    assert missing.value.key == "inputs/there-is-none"


def test_prefix_cache_takes_numpy_bools_and_refuses_one_buffer_as_its_chunks(shared_client: Client) -> None:
    cache = PrefixCache(shared_client, "inputs-prefix", chunk_tokens=4)
    try:
        tokens = list(range(10))
        assert cache.keys(tokens, include_tail=np.True_) == cache.keys(tokens, include_tail=True)
        assert len(cache.keys(tokens, include_tail=np.False_)) == 2
        with pytest.raises(InvalidValue, match=r"chunks must be a sequence of chunk arrays .* got bytes"):
            cache.store(tokens[:8], b"abcdefgh")
        assert cache.match(tokens[:8]) == 0  # nothing was stored
        hashes = [np.int64(7), np.int64(8)]
        assert cache.keys(block_hashes=hashes) == cache.keys(block_hashes=[7, 8])
    finally:
        cache.close()


def test_a_local_cluster_says_what_it_is(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(num_agents=1, host_bytes=16 << 20)
    assert repr(cluster) == f"<LocalCluster {cluster.redis_url} namespace={cluster.namespace!r} agents=1/1 alive>"
    cluster.stop()
    assert repr(cluster) == f"<LocalCluster 1 agent(s) namespace={cluster.namespace!r} not started>"
