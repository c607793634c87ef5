"""Values of kinds the SDK met late: ndarray subclasses, masked arrays, torch tensors under
autograd or of many dimensions, ctypes arrays whose items are several bytes."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from mooncake_store import Client, InvalidValue, LocalCluster, connect
from mooncake_store.transport import frames


@pytest.fixture(params=["shm", "tcp"])
def client(request: pytest.FixtureRequest, shared_cluster: LocalCluster) -> Iterator[Client]:
    transports = ("shm", "tcp") if request.param == "shm" else ("tcp",)
    c = connect(shared_cluster.redis_url, namespace=shared_cluster.namespace, transports=transports)
    yield c
    c.close()


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix: users still have them
def test_a_matrix_is_stored_as_its_array_and_its_bytes_never_reach_the_agent_as_frames(client: Client) -> None:
    """np.matrix stays 2-D through reshape(-1): the byte view's len() was 1 for all its bytes. The
    put reserved 1 B; over TCP the WRITE announced 1 B and sent them all, and the agent read the
    rest as frames: a value holding a PING frame got the PING answered (ProtocolError "answered op
    129"), and one holding FREE or WRITE frames would have run them."""
    m = np.matrix(np.arange(6, dtype=np.float32).reshape(2, 3))
    client.put("s22-matrix", m)
    got = client.get("s22-matrix")
    assert type(got) is np.ndarray and got.shape == (2, 3) and np.array_equal(got, np.asarray(m))
    raw = b"\x00" + frames.pack(frames.Op.PING) + b"\x00" * 15
    injected = np.matrix(np.frombuffer(raw, np.uint8).reshape(1, len(raw)).copy())
    client.put("s22-inject", injected)
    assert bytes(client.get("s22-inject").tobytes()) == raw
    client.remove_many(["s22-matrix", "s22-inject"])


def test_a_masked_array_with_masked_values_is_refused_one_without_is_its_data(client: Client) -> None:
    with pytest.raises(InvalidValue, match=r"masked array .*filled"):
        client.put("s22-masked", np.ma.masked_array([1.0, 2.0, 3.0], mask=[0, 1, 0]))
    client.put("s22-masked", np.ma.masked_array([1.0, 2.0, 3.0]))
    assert client.get("s22-masked").tolist() == [1.0, 2.0, 3.0]
    client.remove("s22-masked")


def test_torch_tensors_past_the_dimension_limit_are_refused_like_arrays(client: Client) -> None:
    """The torch branch skipped the 32-dimension check: 40 dimensions were stored (an object numpy
    1.x cannot build), 65 failed with numpy's ValueError."""
    for ndim in (40, 65):
        with pytest.raises(InvalidValue, match=f"torch tensor has {ndim} dimensions; the limit is 32"):
            client.put("s22-dims", torch.zeros((1,) * ndim))


def test_get_into_a_tensor_under_autograd_is_refused_or_seen_by_it(client: Client) -> None:
    """Written through a numpy view, a tensor's version counter did not move: a tensor saved for a
    backward pass and overwritten gave wrong gradients with no error (40 for 8), and a leaf that
    requires grad was overwritten where torch itself refuses. Now a tensor that requires grad is
    refused, and any other is marked written, so autograd refuses a backward through it."""
    client.put("s22-grad", torch.full((3,), 10.0))
    w = torch.ones(3, requires_grad=True)
    a = w * 2
    with pytest.raises(InvalidValue, match="requires grad"):
        client.get_into("s22-grad", a)
    with pytest.raises(InvalidValue, match="requires grad"):
        client.get_into("s22-grad", w)
    x = torch.ones(3)
    loss = (w * x).sum()  # x is saved for w's gradient
    client.get_into("s22-grad", x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    out = torch.empty(3)
    client.get_many_into(["s22-grad"], [out])
    assert out.tolist() == [10.0] * 3 and out._version > 0
    client.remove("s22-grad")


def test_a_ctypes_array_of_multi_byte_items_is_filled_as_its_bytes(client: Client) -> None:
    """A union or packed-struct array exports format "B" with items of several bytes: len() counted
    items, so an 8 B object was refused for an 8 B array ("out holds 2 B"), and 2 B failed with
    numpy's broadcast ValueError over shm."""

    class Union(ctypes.Union):
        _fields_ = [("i", ctypes.c_int), ("f", ctypes.c_float)]

    client.put("s22-union", bytes(range(8)))
    out = (Union * 2)()
    assert client.get_into("s22-union", out) == 8
    assert bytes(out) == bytes(range(8))
    client.remove("s22-union")


def test_get_many_into_refuses_outputs_that_share_memory(client: Client) -> None:
    """One buffer given twice (or two views of one) kept only the last key's bytes, with no error."""
    client.put_many({"s23-a": b"a" * 8, "s23-b": b"b" * 8})
    shared = bytearray(8)
    with pytest.raises(InvalidValue, match=r"outs\[0\] and outs\[1\] share memory \(8 B overlap\)"):
        client.get_many_into(["s23-a", "s23-b"], [shared, shared])
    whole = np.zeros(12, np.uint8)
    with pytest.raises(InvalidValue, match=r"outs\[0\] and outs\[1\] share memory \(4 B overlap\)"):
        client.get_many_into(["s23-a", "s23-b"], [whole[4:], whole[:8]])
    assert shared == bytearray(8) and not whole.any()  # refused before any read
    rows = np.zeros((2, 8), np.uint8)  # rows of one array are disjoint: allowed
    assert client.get_many_into(["s23-a", "s23-b"], rows) == [8, 8]
    assert bytes(rows[0]) == b"a" * 8 and bytes(rows[1]) == b"b" * 8
    client.remove_many(["s23-a", "s23-b"])


def test_tensors_made_under_inference_mode_are_filled_and_stored(client: Client) -> None:
    """A tensor made under torch.inference_mode() has no version counter to bump: before torch 2.5
    the bump raised outside that mode, after a get_into that had filled it, and a worker thread of
    get_into_async is always outside it. Such tensors are read into and put like any other."""
    with torch.inference_mode():
        value = torch.arange(6, dtype=torch.float32)
        out, many_out, async_out = torch.empty(6), torch.empty(6), torch.empty(6)
    client.put("s22-inference", value)
    assert client.get_into("s22-inference", out) == 24
    client.get_many_into(["s22-inference"], [many_out])
    client.get_into_async("s22-inference", async_out).result(timeout=30)
    for filled in (out, many_out, async_out):
        assert filled.is_inference() and filled.tolist() == value.tolist()
    client.remove("s22-inference")


def test_records_and_unmakeable_tensor_shapes_are_invalid_values_and_store_nothing(client: Client) -> None:
    """numpy's RuntimeError (a record format it reads at another item size) and ValueError (an
    empty tensor of shape (0, 2**62)) escaped from the buffer checks."""
    padded = np.zeros(3, dtype=np.dtype({"names": ["a"], "formats": ["<i4"], "itemsize": 8}))
    record = np.rec.array([(1, 2.0)], dtype=[("a", "<i4"), ("b", "<f8")])[0]
    for key, value in (("s22-record", record), ("s22-padded", memoryview(padded))):
        with pytest.raises(InvalidValue, match="cannot store a value of type"):
            client.put(key, value)
        assert not client.exists(key)
    huge_empty = torch.empty(0, 2**62)
    with pytest.raises(InvalidValue, match=r"torch tensor of shape \(0, 4611686018427387904\) has no numpy form"):
        client.put("s22-huge-empty", huge_empty)
    client.put("s22-small", np.zeros(4, np.float32))
    with pytest.raises(InvalidValue, match=r"shape \(0, 4611686018427387904\)"):
        client.get_into("s22-small", huge_empty)
    client.remove("s22-small")


def test_a_batch_refusing_a_value_names_its_key(client: Client) -> None:
    """'array of shape (5,) is not C-contiguous' said nothing of which of fifty values."""
    values: dict[str, object] = {f"s22-batch/{i}": np.arange(10, dtype=np.float32) for i in range(50)}
    values["s22-batch/31"] = np.arange(10, dtype=np.float32)[::2]
    with pytest.raises(InvalidValue, match=r"^'s22-batch/31': array of shape \(5,\) is not C-contiguous"):
        client.put_many(values)
    values["s22-batch/31"] = np.arange(10, dtype=">f4")
    with pytest.raises(InvalidValue, match=r"^'s22-batch/31': dtype >f4 is big-endian"):
        client.put_many_async(values).result(timeout=30)
    assert not any(client.exists(key) for key in values)
    with pytest.raises(InvalidValue, match=r"^array of shape \(5,\)"):  # one value: the key is the call's own
        client.put("s22-batch/one", np.arange(10, dtype=np.float32)[::2])
