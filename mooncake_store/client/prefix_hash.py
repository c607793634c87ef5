"""Chunk keys of the prefix cache: a chained, seed-free digest over token ids or engine block hashes.

Chunk ``i`` of a prompt (tokens ``[i*C, (i+1)*C)`` for ``chunk_tokens = C``) is named by

    d_i = BLAKE2b(digest_size=16, person=b"mooncake-pfx-v2")(
              d_{i-1}                         16 bytes; 16 zero bytes for i = 0
           || u16le(len(ns)) || ns            the namespace, UTF-8
           || kind                            1 byte: 0x03 token ids as int32, 0x01 token ids as
                                              int64, 0x02 an engine block hash
           || u32le(n) || payload)            n token ids as int32 little-endian (4n bytes) when
                                              every id of the chunk fits in int32, else as int64
                                              little-endian (8n bytes); or the n bytes of the
                                              block hash

and stored under the key ``pfx:<namespace>:<hex(d_i)>``. Because every link folds in the one
before it, a chunk's key names the whole prefix up to and including the chunk: two prompts share
chunk ``i`` only if they agree on every token before its end. The namespace (model, dtype, layer
count, KV heads, head dim, TP rank: whatever fixes the KV layout) is folded into every link, so
two models never share a chunk. BLAKE2b is in every Python's hashlib and takes no seed, so keys
are the same across processes, machines and Python versions (never ``hash()``). The fixed vectors
in ``tests/unit/test_prefix_hash.py`` break when any of this changes; change ``PERSON`` too then.

Token ids travel as int32 because real vocabularies are far below 2**31 and hashing is the larger
part of a match over a long prompt: half the bytes make the chain about twice as fast to compute
(about 0.8 ms for 512 chunks of 256 tokens on a 2-core EPYC instead of 1.7 ms). Which width a chunk
uses depends only on that chunk's ids, so a prompt's keys stay a prefix of a longer prompt's keys.
(v1 hashed every id as int64; BLAKE3 was measured too and is no faster on 1 KiB messages.)

An engine block hash (vLLM, SGLang, LMCache compute their own) may be ``bytes`` (taken as is),
``str`` (its UTF-8 bytes) or ``int`` (its decimal text); it stands for one full chunk.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from mooncake_store.errors import InvalidValue
from mooncake_store.types import MAX_KEY_BYTES, as_count, is_bool, is_collection_not_text

PERSON = b"mooncake-pfx-v2"
DIGEST_BYTES = 16
ROOT = bytes(DIGEST_BYTES)
KIND_TOKENS = 0x01  # token ids as int64 (a chunk with an id outside int32)
KIND_BLOCK_HASH = 0x02
KIND_TOKENS32 = 0x03  # token ids as int32
_I32 = np.iinfo(np.int32)
KEY_PREFIX = "pfx:"
#: Room left in a key for the namespace: "pfx:" + ns + ":" + 32 hex digits <= MAX_KEY_BYTES.
MAX_NAMESPACE_BYTES = 256
MAX_BLOCK_HASH_BYTES = 1024

BlockHash = bytes | str | int


def check_namespace(namespace: object) -> str:
    if not isinstance(namespace, str) or not namespace:
        raise InvalidValue(f"prefix namespace must be non-empty text, got {namespace!r:.80}")
    try:
        raw = namespace.encode("utf-8", errors="strict")
    except UnicodeEncodeError as exc:  # a lone surrogate: not text the index can hold
        raise InvalidValue(f"prefix namespace {namespace!r:.80} is not valid UTF-8 text: {exc.reason}") from None
    if len(raw) > MAX_NAMESPACE_BYTES:
        raise InvalidValue(f"prefix namespace is {len(raw)} B of UTF-8; the limit is {MAX_NAMESPACE_BYTES} B")
    if any(ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F for ch in namespace):
        raise InvalidValue(f"prefix namespace {namespace!r:.80} contains a control character")
    assert len(KEY_PREFIX) + len(raw) + 1 + 2 * DIGEST_BYTES <= MAX_KEY_BYTES
    return namespace


def as_token_array(token_ids: Any) -> np.ndarray:
    """``token_ids`` (list, tuple, 1-D numpy array or CPU torch tensor of ints) as int64 little-endian."""
    if hasattr(token_ids, "detach") and hasattr(token_ids, "cpu"):  # torch tensor, without importing torch
        try:
            token_ids = token_ids.detach().cpu().numpy()
        except (RuntimeError, NotImplementedError, TypeError) as exc:  # a meta tensor has no data, say
            raise InvalidValue(f"token ids on {getattr(token_ids, 'device', '?')} cannot be read: {exc}") from None
    try:
        array = np.asarray(token_ids)
    except (ValueError, TypeError) as exc:  # lists of uneven lengths, say: no array at all
        raise InvalidValue(f"token ids must be a flat sequence of integers, got {token_ids!r:.80}: {exc}") from None
    if array.ndim == 0:  # a str, an int, a generator (which it cannot take: read twice)
        raise InvalidValue(
            "token ids must be a list, tuple, 1-D array or tensor of ints, got "
            f"{type(token_ids).__name__}: {token_ids!r:.80}"
        )
    if array.ndim != 1:
        raise InvalidValue(f"token ids must be 1-D, got shape {array.shape}")
    if array.size == 0:
        return np.empty(0, dtype="<i8")
    if array.dtype.kind not in "iu":
        # Python ints past int64 become objects, or floats where they fit uint64 beside negative
        # ones or int64 ones ([2**63, 1]): the ids were integers, one too large.
        ids = token_ids if isinstance(token_ids, list | tuple) else array.tolist()
        if array.dtype.kind in "fO" and all(type(t) is int for t in ids):
            too_large = next((t for t in ids if not -(1 << 63) <= t < 1 << 63), None)
            if too_large is not None:
                raise InvalidValue(f"token id {too_large} does not fit in int64")
        raise InvalidValue(f"token ids must be integers, got dtype {array.dtype}")
    if array.dtype.kind == "u" and array.dtype.itemsize == 8 and int(array.max()) > np.iinfo(np.int64).max:
        raise InvalidValue(f"token id {int(array.max())} does not fit in int64")
    return np.ascontiguousarray(array, dtype="<i8")


def _header(namespace: str) -> bytes:
    raw = namespace.encode("utf-8")
    return struct.pack("<H", len(raw)) + raw


def _link(prev: bytes, header: bytes, kind: int, count: int, payload: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=PERSON)
    h.update(prev)
    h.update(header)
    h.update(struct.pack("<BI", kind, count))
    h.update(payload)
    return h.digest()


def _fits_int32(tokens: np.ndarray) -> bool:
    return bool(tokens.size == 0 or (int(tokens.min()) >= _I32.min and int(tokens.max()) <= _I32.max))


def token_chain(namespace: str, token_ids: Any, chunk_tokens: int, *, include_tail: bool = False) -> list[bytes]:
    """Digests of the full chunks of ``token_ids`` (and of the partial last one with ``include_tail``)."""
    check_namespace(namespace)
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise InvalidValue(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    tokens = as_token_array(token_ids)
    full, tail = divmod(len(tokens), chunk_tokens)
    count = full + (1 if include_tail and tail else 0)
    if _fits_int32(tokens):
        narrow = tokens.astype("<i4")
        wide: np.ndarray | None = None
    else:
        narrow, wide = None, tokens  # rare: decide chunk by chunk below
    header = _header(namespace)
    # The common case, inlined: a copy of one keyed-up hash object (cheaper than constructing one
    # with its parameters) and two updates per chunk.
    base = hashlib.blake2b(digest_size=DIGEST_BYTES, person=PERSON)
    link32 = header + struct.pack("<BI", KIND_TOKENS32, chunk_tokens)
    view32 = memoryview(narrow).cast("B") if narrow is not None else None
    step32 = chunk_tokens * 4
    out: list[bytes] = []
    prev = ROOT
    for i in range(count):
        n = chunk_tokens if i < full else tail
        if view32 is not None:
            h = base.copy()
            h.update(prev + (link32 if n == chunk_tokens else header + struct.pack("<BI", KIND_TOKENS32, n)))
            h.update(view32[i * step32 : i * step32 + n * 4])
            prev = h.digest()
        else:
            assert wide is not None
            chunk = wide[i * chunk_tokens : i * chunk_tokens + n]
            if _fits_int32(chunk):
                prev = _link(prev, header, KIND_TOKENS32, n, memoryview(chunk.astype("<i4")).cast("B"))
            else:
                prev = _link(prev, header, KIND_TOKENS, n, memoryview(chunk).cast("B"))
        out.append(prev)
    return out


def block_hash_bytes(block_hash: BlockHash) -> bytes:
    if isinstance(block_hash, bytes | bytearray | memoryview):
        raw = bytes(block_hash)
    elif is_bool(block_hash):
        raise InvalidValue("a block hash must be bytes, str or int, not bool")
    elif (number := as_count(block_hash)) is not None:
        # An int (a numpy integer too: what an engine's hash array yields) is hashed as its decimal
        # text, so 12, "12" and b"12" name one block. Measured before it is written out: str() of
        # an int past 4300 digits raises a bare ValueError (Python's limit on such conversions).
        # 4 bits a digit: within 4300 digits, and past the limit before any number that fits.
        digits = len(str(number)) if number.bit_length() <= 4 * MAX_BLOCK_HASH_BYTES else None
        if digits is None or digits > MAX_BLOCK_HASH_BYTES:
            shown = f"{digits} B" if digits is not None else f"an int of {number.bit_length()} bits"
            raise InvalidValue(
                f"a block hash must be 1..{MAX_BLOCK_HASH_BYTES} B (an int counts its decimal digits), got {shown}"
            )
        raw = str(number).encode()
    elif isinstance(block_hash, str):
        try:
            raw = block_hash.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate (bytes.decode(errors="surrogateescape"))
            raise InvalidValue(
                f"a str block hash must be UTF-8 text, got {block_hash!r:.80}: {exc.reason} at {exc.start}; "
                "pass the hash as bytes instead"
            ) from None
    else:
        raise InvalidValue(f"a block hash must be bytes, str or int, got {type(block_hash).__name__}")
    if not raw or len(raw) > MAX_BLOCK_HASH_BYTES:
        raise InvalidValue(f"a block hash must be 1..{MAX_BLOCK_HASH_BYTES} B, got {len(raw)} B")
    return raw


def block_hash_chain(namespace: str, block_hashes: Sequence[BlockHash]) -> list[bytes]:
    """Digests for engine-supplied block hashes, one full chunk each."""
    check_namespace(namespace)
    if not is_collection_not_text(block_hashes):
        # One engine digest passed by mistake would be hashed as one chunk per byte or character.
        raise InvalidValue(f"block_hashes must be a sequence of block hashes, got {type(block_hashes).__name__}")
    header = _header(namespace)
    out: list[bytes] = []
    prev = ROOT
    for block_hash in block_hashes:
        raw = block_hash_bytes(block_hash)
        prev = _link(prev, header, KIND_BLOCK_HASH, len(raw), raw)
        out.append(prev)
    return out


def chunk_key(namespace: str, digest: bytes) -> str:
    return f"{KEY_PREFIX}{namespace}:{digest.hex()}"


def chain_keys(namespace: str, digests: Sequence[bytes]) -> list[str]:
    head = f"{KEY_PREFIX}{namespace}:"
    return [head + d.hex() for d in digests]
