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
TOKEN_VECTORS = [
    "609a1bd33c49b67b7441913b181c04e6",
    "02d316d358165ff71bbb68a453bb9d7a",
    "bf4d7993613b829534eb33f7d0e50059",
    "e0800d62c2c88ab23b10e4f1225d18f9",
]
TAIL_VECTOR = "9ecf5cca113a51e6703f42e803b4d8d3"  # ids 0..19: the 4-token tail after one full chunk
BLOCK_VECTORS = [
    "39aea3d0dd549f8169bb299dd816de7c",
    "a60a3ea3ecd250055c37e59b48d5056c",
    "298648bf043289b7e3aac28260b9a309",
]


def test_fixed_token_vectors() -> None:
    assert [d.hex() for d in token_chain(NS, list(range(64)), 16)] == TOKEN_VECTORS


def test_fixed_tail_and_block_hash_vectors() -> None:
    assert token_chain(NS, list(range(20)), 16, include_tail=True)[1].hex() == TAIL_VECTOR
    assert [d.hex() for d in block_hash_chain(NS, [b"\x01" * 32, "abc", 12345678901234567890])] == BLOCK_VECTORS


def test_documented_encoding() -> None:
    """The digest is exactly the encoding the module docstring writes down."""
    tokens = np.arange(16, dtype="<i8")
    ns = NS.encode()
    body = ROOT + struct.pack("<H", len(ns)) + ns + struct.pack("<BI", 1, 16) + tokens.tobytes()
    first = hashlib.blake2b(body, digest_size=16, person=PERSON).digest()
    assert token_chain(NS, tokens, 16)[0] == first
    tokens2 = np.arange(16, 32, dtype="<i8")
    body2 = first + struct.pack("<H", len(ns)) + ns + struct.pack("<BI", 1, 16) + tokens2.tobytes()
    assert token_chain(NS, np.arange(32), 16)[1] == hashlib.blake2b(body2, digest_size=16, person=PERSON).digest()


def test_input_types_agree() -> None:
    ids = list(range(100, 164))
    want = token_chain(NS, ids, 16)
    assert token_chain(NS, tuple(ids), 16) == want
    assert token_chain(NS, np.array(ids, dtype=np.int32), 16) == want
    assert token_chain(NS, np.array(ids, dtype=np.uint16), 16) == want
    torch = pytest.importorskip("torch", reason="torch not installed (the hf extra)")
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
