"""A get_into read again because its object was replaced while it was read (its lease ran short,
or a replica failed) judges the new object: one the destination cannot hold is refused, but the
first read had already filled the destination. The refusal said nothing of it, and the README
promised a dtype refusal "writes nothing" (a probe of 2026-12-07: a float32 destination raised
DtypeMismatch with every element overwritten by the float32 object before it). Each read is made
to need a second attempt here, and the object is replaced in between."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from mooncake_store import Client
from mooncake_store.agent.node import Agent
from mooncake_store.errors import DtypeMismatch, InvalidValue

N = 64 << 10


def _replaced_after_the_first_read(reader: Client, writer: Client, key: str, new: np.ndarray) -> None:
    """The reader's first read of ``key`` goes through, and is then to be made again (as after a
    replica that failed), with ``key`` replaced by ``new`` in between."""
    gets = reader._gets
    first = gets._read_targets

    def once(*args: Any, **kwargs: Any) -> tuple[list[int], Any]:
        gets._read_targets = first  # type: ignore[method-assign]
        retry, error = first(*args, **kwargs)
        writer.put(key, new)
        return retry + [i for i, _, _ in args[0]], error

    gets._read_targets = once  # type: ignore[method-assign]


@pytest.mark.parametrize(
    ("new", "refusal", "said"),
    [
        (np.arange(N, dtype=np.int32), DtypeMismatch, r"holds <i4 but out has dtype <f4"),
        (np.zeros(2 * N, np.float32), InvalidValue, rf"out holds {4 * N} B but key 'k' is {8 * N} B"),
    ],
)
def test_a_refusal_after_a_first_read_says_what_the_destination_holds(
    make_inproc_agent: Callable[..., Agent],
    clients: Callable[..., Client],
    new: np.ndarray,
    refusal: type[InvalidValue],
    said: str,
) -> None:
    agent = make_inproc_agent()
    reader, writer = clients(agent), clients(agent)
    old = np.full(N, 1.5, np.float32)
    writer.put("k", old)
    out = np.zeros(N, np.float32)
    _replaced_after_the_first_read(reader, writer, "k", new)
    with pytest.raises(refusal, match=said) as caught:
        reader.get_into("k", out)
    assert "replaced by that object while it was read, and out holds what was read of the one before" in str(
        caught.value
    )
    assert np.array_equal(out, old)  # what the message says out holds
    # A destination refused before any read is still untouched, and says nothing of the kind.
    untouched = np.zeros(N, np.float32)
    with pytest.raises(refusal, match=said) as first_refusal:
        reader.get_into("k", untouched)
    assert "while it was read" not in str(first_refusal.value)
    assert not untouched.any()
