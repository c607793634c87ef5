"""Inputs a Python caller passes that are legitimate, or mistakes it should hear about in the
store's words (an SDK review of 2026-12-07): numpy integers and bools where ints and bools are
taken, ints too large for a block hash or a token id, raw char buffers as values, a destination
that is not contiguous, and one buffer of bytes where a sequence of chunks belongs."""

from __future__ import annotations

import ctypes
import pickle

import numpy as np
import pytest
import torch  # a test requirement (pyproject test extra): its absence is a failure, not a skip

from mooncake_store import ConfigError, InvalidValue, KeyNotFound
from mooncake_store.client.buffers import as_destination, as_source
from mooncake_store.client.prefix_chunks import is_sequence_or_stack
from mooncake_store.client.prefix_hash import MAX_BLOCK_HASH_BYTES, as_token_array, block_hash_bytes
from mooncake_store.config import load_config
from mooncake_store.tiers.gpu_arrays import parse_device
from mooncake_store.types import as_count, is_bool


def test_numpy_bools_are_bools_under_numpy_2s_name_too() -> None:
    """The test was of the type's name "bool_", which numpy 2 renamed "bool": np.True_ passed as
    a count, and include_tail=np.True_ was refused as 'must be a bool, got bool'."""
    for value in (True, False, np.True_, np.bool_(False), np.array([True])[0]):
        assert is_bool(value), repr(value)
        assert as_count(value) is None
    for value in (1, 0, np.int64(1), np.uint8(0), "True", None, 1.0):
        assert not is_bool(value), repr(value)


def test_a_block_hash_may_be_a_numpy_integer_and_names_the_block_its_int_does() -> None:
    assert block_hash_bytes(np.int64(12)) == block_hash_bytes(12) == block_hash_bytes("12") == b"12"
    assert block_hash_bytes(np.uint64(2**64 - 1)) == str(2**64 - 1).encode()
    assert block_hash_bytes(-5) == b"-5"
    for flag in (True, np.True_):
        with pytest.raises(InvalidValue, match="not bool"):
            block_hash_bytes(flag)  # type: ignore[arg-type]


def test_an_int_block_hash_too_long_is_refused_by_its_size_before_it_is_written_out() -> None:
    """2**20000 raised Python's bare ValueError ('Exceeds the limit (4300 digits) for integer
    string conversion') from str() before the size check."""
    assert len(block_hash_bytes(10 ** (MAX_BLOCK_HASH_BYTES - 1))) == MAX_BLOCK_HASH_BYTES
    with pytest.raises(InvalidValue, match=rf"1\.\.{MAX_BLOCK_HASH_BYTES} B .* got {MAX_BLOCK_HASH_BYTES + 1} B"):
        block_hash_bytes(10**MAX_BLOCK_HASH_BYTES)
    with pytest.raises(InvalidValue, match="got an int of 20001 bits"):
        block_hash_bytes(2**20000)


def test_a_token_id_past_int64_is_named_even_where_numpy_made_the_list_floats() -> None:
    """[2**63, 1, 2, 3] is float64 to numpy 2 (uint64 beside int64): the refusal said the ids
    were no integers."""
    for ids, too_large in (([2**63, 1, 2, 3], 2**63), ([2**63] * 4, 2**63), ((-(2**63) - 1, 5), -(2**63) - 1)):
        with pytest.raises(InvalidValue, match=rf"token id {too_large} does not fit in int64"):
            as_token_array(ids)
    with pytest.raises(InvalidValue, match="token ids must be integers, got dtype float64"):
        as_token_array([1.0, 2.0])
    assert as_token_array([2**63 - 1, -(2**63)]).tolist() == [2**63 - 1, -(2**63)]


def test_raw_char_buffers_are_stored_as_the_bytes_they_hold() -> None:
    """A ctypes string buffer and a memoryview cast to "c" were refused as 'dtype |S1 is not
    storable', though the README says raw bytes on either side are bytes (and they fill as such)."""
    cases = [
        (ctypes.create_string_buffer(b"hello", 8), b"hello\x00\x00\x00"),
        (memoryview(b"ab\x00c").cast("c"), b"ab\x00c"),
        ((ctypes.c_char * 0)(), b""),
    ]
    for value, held in cases:
        source = as_source(value)
        assert (source.dtype, source.shape, bytes(source.view)) == ("|u1", (len(held),), held)
    # numpy's own string arrays stay refused: their items are text, not bytes.
    with pytest.raises(InvalidValue, match=r"dtype \|S1 is not storable"):
        as_source(np.array([b"a", b"b"], dtype="S1"))


def test_a_destination_tensor_that_is_not_contiguous_is_not_told_to_call_contiguous() -> None:
    """.contiguous() is a copy: followed, get_into filled it, answered the bytes written, and the
    tensor stayed as it was. As a value, .contiguous() is right (the copy is what is stored)."""
    view = torch.zeros(12)[::2]
    with pytest.raises(InvalidValue, match=r"out \(torch tensor of shape \(6,\)\) is not contiguous") as refused:
        as_destination(view)
    assert "copy filled instead" in str(refused.value)
    with pytest.raises(InvalidValue, match=r"torch tensor of shape \(6,\) is not contiguous; call \.contiguous\(\)"):
        as_source(view)


def test_one_buffer_of_bytes_is_no_sequence_of_chunks() -> None:
    """PrefixCache.store(ids, b"abcdefgh") split the bytes into ints, one "chunk" each."""
    for one in (b"abcdefgh", bytearray(8), memoryview(b"ab"), "text"):
        assert not is_sequence_or_stack(one)
    for many in ([b"ab", b"cd"], (np.zeros(4),), np.zeros((2, 4)), torch.zeros(2, 4)):
        assert is_sequence_or_stack(many)


def test_a_boolean_option_takes_the_ints_its_refusal_names() -> None:
    """verify_checksum=0 was refused as 'not a boolean (use true/false, yes/no, on/off or 1/0)'."""
    assert load_config(env={}, overrides={"client.verify_checksum": 0}).client.verify_checksum is False
    assert load_config(env={}, overrides={"client.verify_checksum": 1}).client.verify_checksum is True
    for bad in (2, -1, 0.0):
        with pytest.raises(ConfigError, match="not a boolean"):
            load_config(env={}, overrides={"client.verify_checksum": bad})


def test_key_not_found_carries_its_key_through_pickling() -> None:
    err = KeyNotFound("key 'k' not found", key="k")
    again = pickle.loads(pickle.dumps(err))
    assert (again.key, str(again), isinstance(again, KeyError)) == ("k", "key 'k' not found", True)


def test_a_bad_device_names_cpu_among_the_choices() -> None:
    with pytest.raises(InvalidValue, match=r"'cuda', 'cuda:N', a device index or 'cpu' \(host memory\), got 'gpu'"):
        parse_device("gpu")
