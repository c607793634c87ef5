"""The batch calls on a worker thread (get_many_async, get_many_into_async, put_many_async), against
the session's real cluster: what they return and refuse is what the calls themselves do, through
the future; what they are given is taken as it is when they are called."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from mooncake_store import Client, InvalidKey, InvalidValue, KeyNotFound


def test_batch_calls_run_on_a_worker_and_take_their_arguments_as_they_are_then(shared_client: Client) -> None:
    tag = uuid.uuid4().hex[:8]
    keys = [f"ab-{tag}-{i}" for i in range(3)]
    values = {k: np.full(1000, i, np.uint8) for i, k in enumerate(keys)}
    items = dict(values)
    fut = shared_client.put_many_async(items)
    items.clear()  # the call took the items as they were
    assert fut.result(timeout=30) is None
    wanted = list(keys)
    got = shared_client.get_many_async(wanted)
    wanted.append("not-asked")  # nor does a later change of the keys count
    assert [a.tolist() for a in got.result(timeout=30)] == [values[k].tolist() for k in keys]
    outs = np.zeros((3, 1000), np.uint8)  # one stacked array, a row per key
    assert shared_client.get_many_into_async(keys, outs).result(timeout=30) == [1000] * 3
    assert all(np.array_equal(outs[i], values[k]) for i, k in enumerate(keys))
    assert shared_client.get_many_async([*keys, f"ab-{tag}-missing"]).result(timeout=30)[-1] is None


def test_batch_calls_on_a_worker_refuse_through_the_future(shared_client: Client) -> None:
    with pytest.raises(InvalidKey):
        shared_client.get_many_async(["ok", ""]).result(timeout=30)
    with pytest.raises(InvalidValue, match="pass a list of keys"):
        shared_client.get_many_async("one-key").result(timeout=30)  # type: ignore[arg-type]
    with pytest.raises(KeyNotFound):
        shared_client.get_many_into_async([f"ab-missing-{uuid.uuid4().hex}"], [bytearray(8)]).result(timeout=30)
    with pytest.raises(InvalidValue, match=r"replicas must be an int in 1\.\.16"):
        shared_client.put_many_async({"k": b"x"}, replicas=0).result(timeout=30)
