"""The prefix chain's key function: fixed vectors, so that any change to it breaks here."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from mooncake_store.client.prefix_hash import (
    PERSON,
    ROOT,
    block_hash_chain,
    chain_keys,
    chunk_key,
    token_chain,
)
from mooncake_store.errors import InvalidValue

NS = "llama-3-8b/bf16/tp0"

# Fixed vectors: token ids 0..63 in chunks of 16 under NS, and the engine block hashes below.
# Regenerating them is a format change: every stored prefix cache becomes unreachable.
# (v2: token ids hashed as int32 where a chunk's ids fit, see prefix_hash.py.)
TOKEN_VECTORS = [
    "fb2464a5e3625e2ba6257ee31e6f16a0",
    "18e104adccb6d89971554d2314e875c3",
    "3a96ec7fd919b54aebf054cdf239e0d3",
    "548d68f969539976d8758ecda9d1fae4",
]
TAIL_VECTOR = "61788b4c2989bc59d0780105021fa3c0"  # ids 0..19: the 4-token tail after one full chunk
BLOCK_VECTORS = [
    "0100051fccb98524f5ec6e901fb0a085",
    "41a4de3002531842e21c195bba248a8b",
    "c4887a2dc57c540b24d0054345f3cddd",
]
# ids 0..14, 2**40, 0..15: the first chunk holds an id past int32 and is hashed as int64.
WIDE_VECTORS = ["0bf0c7f338c83659d2e0e7ac464bacf6", "050b7af2dbe2bb416fd80b7a851c8626"]


def test_fixed_token_vectors() -> None:
    assert [d.hex() for d in token_chain(NS, list(range(64)), 16)] == TOKEN_VECTORS


def test_fixed_tail_and_block_hash_vectors() -> None:
    assert token_chain(NS, list(range(20)), 16, include_tail=True)[1].hex() == TAIL_VECTOR
    assert [d.hex() for d in block_hash_chain(NS, [b"\x01" * 32, "abc", 12345678901234567890])] == BLOCK_VECTORS


def test_documented_encoding() -> None:
    """The digest is exactly the encoding the module docstring writes down."""
    tokens = np.arange(16, dtype="<i8")
    ns = NS.encode()
    body = ROOT + struct.pack("<H", len(ns)) + ns + struct.pack("<BI", 3, 16) + tokens.astype("<i4").tobytes()
    first = hashlib.blake2b(body, digest_size=16, person=PERSON).digest()
    assert token_chain(NS, tokens, 16)[0] == first
    tokens2 = np.arange(16, 32, dtype="<i8")
    body2 = first + struct.pack("<H", len(ns)) + ns + struct.pack("<BI", 3, 16) + tokens2.astype("<i4").tobytes()
    assert token_chain(NS, np.arange(32), 16)[1] == hashlib.blake2b(body2, digest_size=16, person=PERSON).digest()
    # A chunk with an id outside int32 is hashed as int64 (kind 0x01); the next one is int32 again.
    wide = np.array([*range(15), 2**40], dtype="<i8")
    body3 = ROOT + struct.pack("<H", len(ns)) + ns + struct.pack("<BI", 1, 16) + wide.tobytes()
    w0 = hashlib.blake2b(body3, digest_size=16, person=PERSON).digest()
    body4 = w0 + struct.pack("<H", len(ns)) + ns + struct.pack("<BI", 3, 16) + tokens.astype("<i4").tobytes()
    w1 = hashlib.blake2b(body4, digest_size=16, person=PERSON).digest()
    assert token_chain(NS, [*wide.tolist(), *range(16)], 16) == [w0, w1]
    assert [d.hex() for d in [w0, w1]] == WIDE_VECTORS


def test_int32_boundaries() -> None:
    """Ids at the int32 limits stay int32; one past them switches that chunk alone to int64."""
    lo, hi = -(2**31), 2**31 - 1
    ns = NS.encode()
    edge = np.array([lo, hi], dtype="<i8")
    body = ROOT + struct.pack("<H", len(ns)) + ns + struct.pack("<BI", 3, 2) + edge.astype("<i4").tobytes()
    assert token_chain(NS, edge, 2)[0] == hashlib.blake2b(body, digest_size=16, person=PERSON).digest()
    past = np.array([0, hi + 1], dtype="<i8")
    body = ROOT + struct.pack("<H", len(ns)) + ns + struct.pack("<BI", 1, 2) + past.tobytes()
    assert token_chain(NS, past, 2)[0] == hashlib.blake2b(body, digest_size=16, person=PERSON).digest()
    # Prefix property across a wide chunk: a prompt's keys are a prefix of a longer prompt's keys.
    ids = [1, hi + 1, 3, 4, 5, 6]
    assert token_chain(NS, ids[:4], 2) == token_chain(NS, ids, 2)[:2]


def test_input_types_agree() -> None:
    ids = list(range(100, 164))
    want = token_chain(NS, ids, 16)
    assert token_chain(NS, tuple(ids), 16) == want
    assert token_chain(NS, np.array(ids, dtype=np.int32), 16) == want
    assert token_chain(NS, np.array(ids, dtype=np.uint16), 16) == want
    import torch

    assert token_chain(NS, torch.tensor(ids), 16) == want


def test_chaining_and_namespaces() -> None:
    a = token_chain(NS, list(range(64)), 16)
    b = token_chain(NS, [999, *range(1, 64)], 16)
    assert all(x != y for x, y in zip(a, b, strict=True))  # a change in chunk 0 changes every later key
    assert token_chain(NS, list(range(32)), 16) == a[:2]  # a prefix's keys are a prefix of the keys
    assert not set(token_chain("other-model", list(range(64)), 16)) & set(a)
    assert token_chain(NS, list(range(40)), 16) == a[:2]  # the tail is dropped unless asked for
    assert len(token_chain(NS, list(range(40)), 16, include_tail=True)) == 3
    assert token_chain(NS, [], 16) == []


def test_keys() -> None:
    digest = token_chain(NS, list(range(16)), 16)[0]
    assert chunk_key(NS, digest) == f"pfx:{NS}:{digest.hex()}"
    assert chain_keys(NS, [digest]) == [chunk_key(NS, digest)]


@pytest.mark.parametrize(
    ("ns", "ids", "chunk", "match"),
    [
        ("", [1], 16, "non-empty"),
        ("x" * 300, [1], 16, "limit of 256|the limit is 256"),
        ("a\nb", [1], 16, "control"),
        (NS, [[1, 2]], 16, "1-D"),
        (NS, [[1, 2], [3]], 16, "flat sequence of integers"),  # uneven: numpy makes no array of it
        (NS, [1.5], 16, "integers"),
        (NS, [1], 0, "chunk_tokens"),
    ],
)
def test_bad_input(ns: str, ids: object, chunk: int, match: str) -> None:
    with pytest.raises(InvalidValue, match=match):
        token_chain(ns, ids, chunk)


def test_bad_block_hashes() -> None:
    with pytest.raises(InvalidValue, match="bytes, str or int"):
        block_hash_chain(NS, [1.0])  # type: ignore[list-item]
    with pytest.raises(InvalidValue, match=r"1\.\.1024 B"):
        block_hash_chain(NS, [b""])
