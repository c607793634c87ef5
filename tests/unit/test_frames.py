"""The wire format: header round trip and rejection of foreign or future frames."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from mooncake_store.errors import InvalidValue, ProtocolError, TransferError
from mooncake_store.transport import frames


def test_header_round_trip() -> None:
    raw = frames.pack(frames.Op.READ, 3, 2**63, 17, 4096)
    assert len(raw) == frames.HEADER_BYTES == 32
    assert frames.unpack(raw) == (frames.Op.READ, 3, 2**63, 17, 4096)


def test_bad_magic_and_version() -> None:
    raw = bytearray(frames.pack(frames.Op.PING))
    raw[0:2] = b"XX"
    with pytest.raises(ProtocolError, match="bad frame magic"):
        frames.unpack(bytes(raw))
    raw = bytearray(frames.pack(frames.Op.PING))
    raw[2] = 9
    with pytest.raises(ProtocolError, match="frame version 9"):
        frames.unpack(bytes(raw))


def test_send_and_receive_into_caller_memory() -> None:
    a, b = socket.socketpair()
    with a, b:
        payload = memoryview(bytes(range(256)) * 64)
        frames.send_all(a, frames.pack(frames.Op.WRITE, 0, 1, 2, len(payload)), payload)
        assert frames.unpack(frames.recv_exact(b, frames.HEADER_BYTES))[4] == len(payload)
        dest = bytearray(len(payload))
        frames.recv_into_exact(b, memoryview(dest))
        assert dest == payload
        a.close()
        with pytest.raises(TransferError, match="peer closed the connection after 0 of 10 B"):
            frames.recv_exact(b, 10)


def test_fields_that_do_not_fit_a_frame_are_invalid_value() -> None:
    """Negative or over-u64 fields (a caller's bug) name the fields, not struct's words."""
    with pytest.raises(InvalidValue, match=r"out of range: a=-1 \(0\.\.18446744073709551615\)$"):
        frames.pack(frames.Op.WRITE, 0, -1, 0, 5)
    with pytest.raises(InvalidValue, match=r"out of range: b=18446744073709551616 \(0\.\.18446744073709551615\)$"):
        frames.pack(frames.Op.READ, 0, 1, 1 << 64, 5)
    with pytest.raises(InvalidValue, match=r"op=256 \(0\.\.255\), arg=-2 \(0\.\.4294967295\)$"):
        frames.pack(256, -2)
    with pytest.raises(InvalidValue, match="reservation size -5"):
        frames.pack_reserve_entry(-5, b"x" * 16)


def test_id_lists_round_trip_and_refuse_what_does_not_fit() -> None:
    ids = [0, 1, 2**63, 2**64 - 1]
    assert frames.unpack_ids(frames.pack_ids(ids)) == ids
    assert frames.pack_ids([]) == b""
    with pytest.raises(InvalidValue, match=r"alloc id 18446744073709551616 is not an int in 0\.\.18446744073709551615"):
        frames.pack_ids([1, 2**64])
    with pytest.raises(InvalidValue, match="alloc id -1 is not"):
        frames.pack_ids([-1])
    with pytest.raises(InvalidValue, match="alloc id -3 is not"):  # not the valid numpy id before it
        frames.pack_ids([np.uint64(5), -3])
