"""Bad input of every kind gets a clear MooncakeError naming the value and the limit."""

from __future__ import annotations

import array
import ctypes
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from mooncake_store import (
    MAX_KEY_BYTES,
    Client,
    ConnectError,
    DtypeMismatch,
    InvalidKey,
    InvalidValue,
    KeyNotFound,
    LocalCluster,
    MooncakeError,
    NoCapacity,
    TransferError,
    connect,
)


def test_object_bigger_than_any_arena_names_sizes(shared_client: Client) -> None:
    too_big = np.zeros((64 << 20) + 1, dtype=np.uint8)
    with pytest.raises(NoCapacity) as info:
        shared_client.put("huge", too_big)
    message = str(info.value)
    assert str(too_big.nbytes) in message and str(64 << 20) in message
    assert not shared_client.exists("huge")


def test_more_replicas_than_nodes(shared_client: Client) -> None:
    with pytest.raises(NoCapacity, match="replicas=3 needs 3 live nodes"):
        shared_client.put("r3", b"x", replicas=3)


def test_missing_key_is_key_not_found_and_key_error(shared_client: Client) -> None:
    with pytest.raises(KeyNotFound, match="'nope' not found"):
        shared_client.get("nope")
    with pytest.raises(KeyError):
        shared_client.get_into("nope", bytearray(10))
    assert shared_client.remove("nope") is False
    assert shared_client.exists("nope") is False


@pytest.mark.parametrize(
    ("key", "fragment"),
    [
        ("", "must not be empty"),
        ("x" * (MAX_KEY_BYTES + 1), f"the limit is {MAX_KEY_BYTES} B"),
        # A long key is quoted by its start, quotes closed, and its length.
        ("x" * (MAX_KEY_BYTES + 1), f"^key '{'x' * 60}'… \\({MAX_KEY_BYTES + 1} characters\\) is"),
        ("é" * (MAX_KEY_BYTES // 2 + 1), f"the limit is {MAX_KEY_BYTES} B"),
        ("a\x00b", "control character"),
        ("line\nbreak", "control character"),
        (b"bytes-key", "key must be str"),
        (42, "key must be str"),
        ("\ud800", "not valid UTF-8"),
    ],
)
def test_bad_keys(shared_client: Client, key: object, fragment: str) -> None:
    for call in (
        lambda: shared_client.put(key, b"x"),
        lambda: shared_client.get(key),
        lambda: shared_client.exists(key),
    ):  # type: ignore[arg-type]
        with pytest.raises(InvalidKey, match=fragment):
            call()


def test_key_at_the_limit_is_fine(shared_client: Client) -> None:
    key = "k" * MAX_KEY_BYTES
    shared_client.put(key, b"limit")
    assert shared_client.get(key).tobytes() == b"limit"


_WIDE_LONG_DOUBLE = int(np.dtype(np.longdouble).itemsize > 8)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (object(), "cannot store a value of type object"),
        ([1, 2, 3], "cannot store a value of type list"),
        (np.array(["a", "b"]), "not storable"),
        (np.array([1, None], dtype=object), "not storable"),
        (np.arange(10)[::2], "not C-contiguous"),
        (np.arange(4, dtype=">i4"), "big-endian"),
        ("text", "cannot store a value of type str"),
        # Where long double is wider than float64 its layout is the machine's own: read elsewhere,
        # other numbers (x87 80-bit here, IEEE quad on aarch64).
        *([(np.arange(4, dtype=np.longdouble), "laid out differently on each kind of machine")] * _WIDE_LONG_DOUBLE),
    ],
)
def test_bad_values(shared_client: Client, value: object, fragment: str) -> None:
    with pytest.raises(InvalidValue, match=fragment):
        shared_client.put("bad", value)
    assert not shared_client.exists("bad")


def test_batches_of_keys_in_a_set_are_refused(shared_client: Client) -> None:
    """Batch results come one per key in the keys' order, which a set does not keep: the caller
    could not tell which value or flag is whose. Nothing is read or removed."""
    shared_client.put("set/a", b"aa")
    shared_client.put("set/b", b"bbb")
    for call in (shared_client.get_many, shared_client.remove_many):
        with pytest.raises(InvalidValue, match="not a set: results come back in the keys' order"):
            call({"set/a", "set/b"})
    with pytest.raises(InvalidValue, match="not a frozenset"):
        shared_client.get_many_into(frozenset({"set/a"}), [bytearray(2)])
    assert shared_client.exists("set/a") and shared_client.exists("set/b")
    # A dict's keys keep their order and are taken.
    assert [bytes(v) for v in shared_client.get_many({"set/b": 0, "set/a": 0}.keys())] == [b"bbb", b"aa"]


def test_get_into_wrong_out(shared_client: Client) -> None:
    shared_client.put("ten", np.arange(10, dtype=np.int64))
    with pytest.raises(InvalidValue, match="out holds 79 B but key 'ten' is 80 B"):
        shared_client.get_into("ten", bytearray(79))
    with pytest.raises(InvalidValue, match="read-only"):
        shared_client.get_into("ten", bytes(80))
    with pytest.raises(InvalidValue, match="not C-contiguous"):
        shared_client.get_into("ten", np.zeros(40, np.int64)[::2])
    with pytest.raises(InvalidValue, match="writable buffer"):
        shared_client.get_into("ten", "nope")
    big = np.zeros(100, np.int64)
    assert shared_client.get_into("ten", big) == 80  # larger buffers are fine: the byte count says how much
    assert big[:10].tolist() == list(range(10))


def test_get_into_a_typed_buffer_of_another_dtype_is_refused_and_writes_nothing(shared_client: Client) -> None:
    """get_into copies bytes as they are: float32 bytes in a float16 array would read as other
    numbers without a word. A typed destination must have the stored dtype; raw bytes on either
    side (a bytearray, a uint8 array, bytes stored) are bytes."""
    values = np.linspace(-1, 1, 16, dtype=np.float32)
    shared_client.put("f32", values)
    shared_client.put("raw", values.tobytes())
    wrong = np.full(32, 7, np.float16)
    with pytest.raises(InvalidValue, match="key 'f32' holds <f4 but out has dtype <f2"):
        shared_client.get_into("f32", wrong)
    assert (wrong == 7).all(), "a refused get_into wrote into its buffer"
    with pytest.raises(InvalidValue, match="holds <f4 but out has dtype <i4"):
        shared_client.get_into("f32", array.array("i", bytes(64)))  # a typed buffer that is not numpy
    others = [np.zeros(16, np.float32), np.full(32, 7, np.int16)]
    with pytest.raises(InvalidValue, match="holds <f4 but out has dtype <i2"):
        shared_client.get_many_into(["f32", "f32"], others)
    assert (others[1] == 7).all() and not others[0].any(), "a refused batch wrote into its buffers"
    raw = np.zeros(64, np.uint8)
    assert shared_client.get_into("f32", raw) == 64 and raw.tobytes() == values.tobytes()
    typed = np.zeros(16, np.float32)
    assert shared_client.get_into("raw", typed) == 64 and (typed == values).all()
    same = array.array("f", bytes(64))
    assert shared_client.get_into("f32", same) == 64 and list(same) == values.tolist()
    chars = ctypes.create_string_buffer(64)  # a ctypes string buffer (format "<c") is raw bytes
    assert shared_client.get_into("f32", chars) == 64 and chars.raw == values.tobytes()


def test_get_into_a_bfloat16_object_takes_a_bfloat16_tensor_its_bits_or_raw_bytes(shared_client: Client) -> None:
    """Where nothing names bfloat16 (numpy, cupy) its bits live in 2-byte integers, both ways."""
    import torch  # a test requirement (the test install's hf extra): its absence is a failure, not a skip

    stored = torch.linspace(-2, 2, 8, dtype=torch.bfloat16)
    bits = stored.view(torch.int16).numpy()
    shared_client.put("bf16", stored)
    with pytest.raises(DtypeMismatch, match="holds bfloat16 but out has dtype <f2") as info:
        shared_client.get_into("bf16", torch.zeros(8, dtype=torch.float16))
    assert (info.value.stored, info.value.out) == ("bfloat16", "<f2")
    with pytest.raises(InvalidValue, match="holds bfloat16 but out has dtype <i4"):
        shared_client.get_into("bf16", np.zeros(4, np.int32))
    out = torch.zeros(8, dtype=torch.bfloat16)
    assert shared_client.get_into("bf16", out) == 16 and torch.equal(out, stored)
    for container in (np.zeros(8, np.int16), np.zeros(8, np.uint16), bytearray(16)):
        assert shared_client.get_into("bf16", container) == 16 and bytes(container) == bits.tobytes()
    shared_client.put("bits", bits.view(np.uint16))  # bfloat16 stored from numpy, as its bits
    back = torch.zeros(8, dtype=torch.bfloat16)
    assert shared_client.get_into("bits", back) == 16 and torch.equal(back, stored)


def test_bad_replicas_argument(shared_client: Client) -> None:
    with pytest.raises(InvalidValue, match=r"replicas must be an int in 1\.\.16"):
        shared_client.put("r", b"x", replicas=0)


def test_connect_without_url_says_how_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_REDIS_URL", raising=False)
    monkeypatch.setenv("MOONCAKE_CONFIG", "/nonexistent/mooncake.toml")
    with pytest.raises(MooncakeError) as info:
        connect()
    assert "MOONCAKE_REDIS_URL" in str(info.value) or "mooncake.toml" in str(info.value)


def test_connect_to_nothing_is_connect_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectError, match=f"cannot reach Redis at redis://127.0.0.1:{port}"):
        connect(f"redis://127.0.0.1:{port}/0", timeout_s=2.0)


def test_bad_url_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(MooncakeError, match="http://x"):
        connect("http://x")


def test_closed_client_refuses(shared_cluster: LocalCluster) -> None:
    own = connect(shared_cluster.redis_url, namespace=shared_cluster.namespace)
    own.close()
    with pytest.raises(MooncakeError, match="closed"):
        own.get("x")


def test_a_chunk_that_names_itself_as_its_chain_parent_is_refused(shared_client: Client) -> None:
    with pytest.raises(InvalidValue, match="chain_parent links loop: 'self/0' -> 'self/0'"):
        shared_client.put_many({"self/0": b"x"}, chain_pos={"self/0": 0}, chain_parent={"self/0": "self/0"})
    assert not shared_client.exists("self/0")


def test_chain_parent_links_that_loop_within_a_batch_are_refused_before_anything_is_stored(
    shared_client: Client,
) -> None:
    """a -> b -> c -> a: every chunk of the loop counts a stored child, so none is ever a leaf and
    eviction can never take one (a cluster full of them refused every put). Refused whole, before
    any reservation."""
    keys = ["loop/a", "loop/b", "loop/c", "loop/d"]
    parents = {"loop/a": "loop/b", "loop/b": "loop/c", "loop/c": "loop/a", "loop/d": "loop/a"}
    with pytest.raises(InvalidValue, match="chain_parent links loop: 'loop/a' -> 'loop/b' -> 'loop/c' -> 'loop/a'"):
        shared_client.put_many(
            {k: b"x" * 100 for k in keys}, chain_pos={k: i for i, k in enumerate(keys)}, chain_parent=parents
        )
    assert [shared_client.exists(k) for k in keys] == [False] * 4


@pytest.mark.parametrize("how", ["parent-stored-later", "parent-replaced", "deep"])
def test_a_chain_parent_that_would_close_a_loop_through_stored_chunks_is_refused(
    shared_client: Client, how: str
) -> None:
    """Loops made across calls, which no check of one batch sees: put_commit.lua refuses the link
    that closes the loop (status LOOP, InvalidValue here); what was stored stays as it was."""
    c = shared_client
    k = [f"xloop-{how}/{i}" for i in range(3)]
    if how == "parent-stored-later":
        c.put_many({k[0]: b"a"}, chain_pos={k[0]: 1}, chain_parent={k[0]: k[1]})  # its parent not stored yet
        closing = {k[1]: k[0]}
    elif how == "parent-replaced":
        c.put(k[1], b"root")
        c.put_many({k[0]: b"a"}, chain_pos={k[0]: 1}, chain_parent={k[0]: k[1]})
        closing = {k[1]: k[0]}  # the root stored again, now under its own child
    else:
        c.put_many(
            {k[0]: b"0", k[1]: b"1", k[2]: b"2"},
            chain_pos={k[0]: 0, k[1]: 1, k[2]: 2},
            chain_parent={k[1]: k[0], k[2]: k[1]},
        )
        closing = {k[0]: k[2]}  # the head stored again under the chain's last chunk
    before = {key: c.object_meta(key) for key in k}
    (key, parent) = next(iter(closing.items()))
    with pytest.raises(
        InvalidValue, match=f"chain_parent of {key!r} is {parent!r}, out of order with the chunks stored"
    ):
        c.put_many({key: b"new"}, chain_pos={key: 5}, chain_parent=closing)
    after = {key: c.object_meta(key) for key in k}
    assert [m.version if m else None for m in after.values()] == [m.version if m else None for m in before.values()]


@pytest.mark.parametrize("field", ["chain_pos", "chain_parent"])
def test_chain_metadata_for_keys_outside_the_batch_is_refused(shared_client: Client, field: str) -> None:
    """A position or parent link naming a key the batch does not put (a stale or misspelt key)
    was silently dropped, and the chunk it was meant for stored without it."""
    links = {"chain_pos": {"out/a": 0, "out/zz": 1}, "chain_parent": {"out/zz": "out/a"}}
    kwargs = {field: links[field]} | ({"chain_pos": {"out/a": 0}} if field == "chain_parent" else {})
    with pytest.raises(InvalidValue, match=f"{field} names 1 key\\(s\\) not in this put: \\['out/zz'\\]"):
        shared_client.put_many({"out/a": b"a"}, **kwargs)  # type: ignore[arg-type]
    assert not shared_client.exists("out/a")


def test_chain_positions_must_grow_from_parent_to_child(shared_client: Client) -> None:
    """Positions order a chain's links, which is what keeps them from looping: a chunk with a parent
    needs a position after its parent's (in the batch, or as stored) and before its stored
    children's."""
    c = shared_client
    with pytest.raises(InvalidValue, match="'ord/b' has a chain_parent but no chain_pos"):
        c.put_many({"ord/b": b"b"}, chain_parent={"ord/b": "ord/a"})
    with pytest.raises(InvalidValue, match=r"chain_pos of 'ord/b' is 1, not after that of its parent 'ord/a', 2"):
        c.put_many({"ord/a": b"a", "ord/b": b"b"}, chain_pos={"ord/a": 2, "ord/b": 1}, chain_parent={"ord/b": "ord/a"})
    c.put_many({"ord/a": b"a"}, chain_pos={"ord/a": 2})
    with pytest.raises(InvalidValue, match="chain_parent of 'ord/b' is 'ord/a', out of order with the chunks stored"):
        c.put_many({"ord/b": b"b"}, chain_pos={"ord/b": 2}, chain_parent={"ord/b": "ord/a"})  # parent stored at 2
    c.put_many({"ord/b": b"b"}, chain_pos={"ord/b": 3}, chain_parent={"ord/b": "ord/a"})
    with pytest.raises(InvalidValue, match="chain_parent of 'ord/a' is 'ord/z', out of order with the chunks stored"):
        c.put_many({"ord/a": b"a"}, chain_pos={"ord/a": 3}, chain_parent={"ord/a": "ord/z"})  # its child is at 3
    c.put_many({"ord/a": b"a2"}, chain_pos={"ord/a": 1}, chain_parent={"ord/a": "ord/z"})
    assert c.get("ord/a").tobytes() == b"a2"


def test_storing_a_long_chain_again_costs_its_commit_a_few_lookups_per_chunk(shared_client: Client) -> None:
    """The loop check first walked a chunk's ancestors whenever the chunk had stored children, so
    storing a chain again (after its node died, or to replace it) cost put_commit O(n^2) lookups in
    one script: 2048 chunks held the server for seconds, and every other client got BUSY. Counted
    here in the server's own command statistics (every command a script runs is counted)."""
    c = shared_client
    keys = [f"long/{i:05d}" for i in range(1024)]
    chain = {
        "chain_pos": {k: i for i, k in enumerate(keys)},
        "chain_parent": {k: keys[i - 1] for i, k in enumerate(keys) if i > 0},
    }
    c.put_many({k: b"x" for k in keys}, **chain)  # type: ignore[arg-type]

    def hgets() -> int:
        return int(c.index.redis.info("commandstats").get("cmdstat_hget", {}).get("calls", 0))

    before = hgets()
    c.put_many({k: b"y" for k in keys}, **chain)  # type: ignore[arg-type]
    spent = hgets() - before
    assert spent < 20 * len(keys), f"storing {len(keys)} chunks again took {spent} HGETs"
    assert c.get(keys[-1]).tobytes() == b"y"
    c.remove_many(keys)


def test_a_password_in_the_index_url_stays_out_of_its_errors() -> None:
    """The index's errors name the server they could not reach, with the URL's password as ***:
    they end up in logs and on terminals."""
    from mooncake_store.embedded import EmbeddedServer
    from mooncake_store.index.client import RedisIndex

    secret = "hunter2-index"
    server = EmbeddedServer().start()
    try:
        server.client().config_set("requirepass", secret)
        url = server.url.replace("redis://", f"redis://default:{secret}@", 1)
        index = RedisIndex(url, namespace="redact")
        assert index.nodes() == {}  # the password is used to connect ...
    finally:
        server.stop()
    try:
        errors: list[str] = []
        calls = (
            index.nodes,
            index.server_time_ms,
            lambda: index.pending_graves("A"),
            lambda: index.victim_candidates("A", "host"),  # a script call, with its retry
        )
        for call in calls:
            with pytest.raises(ConnectError) as info:
                call()
            errors.append(str(info.value))
        index.close()
        with pytest.raises(ConnectError) as info:
            index.nodes()
        errors.append(str(info.value))
    finally:
        index.close()
    for message in errors:  # ... and never shown
        assert secret not in message, message
        assert f"default:***@127.0.0.1:{server.port}" in message, message


def test_a_put_that_no_allowed_transport_can_carry_stores_nothing(shared_cluster: LocalCluster) -> None:
    """README: transports=... forces a path. A get honoured it, a put did not: a client allowed
    only rdma (no agent here takes it) sent its bytes over TCP anyway and stored an object it
    could not read back. Now the put fails, naming the transports, and stores nothing."""
    with connect(shared_cluster.redis_url, namespace=shared_cluster.namespace, transports=("rdma",)) as client:
        with pytest.raises(
            TransferError,
            match=r"no allowed transport \('rdma',\) reaches an agent for a put of 'rd/0': shm is not allowed; "
            r"tcp is not allowed; rdma is not built yet",
        ):
            client.put("rd/0", np.arange(1000, dtype=np.int32))
        assert not client.exists("rd/0")


def test_a_get_that_no_allowed_transport_can_carry_says_which_are_not_allowed(
    shared_cluster: LocalCluster, shared_client: Client
) -> None:
    """An rdma-only client's get blamed the replica ("its segment cannot be mapped here") for an
    arena that maps fine: the cause is that neither shm nor tcp is allowed, as its put says."""
    shared_client.put("rd/get", np.arange(10, dtype=np.int32))
    rdma_only = connect(shared_cluster.redis_url, namespace=shared_cluster.namespace, transports=("rdma",))
    with rdma_only as client, pytest.raises(TransferError) as info:
        client.get("rd/get")
    message = str(info.value)
    assert "reaches a replica of 'rd/get': shm is not allowed; tcp is not allowed; rdma is not built yet" in message
    assert "cannot be mapped" not in message


def test_a_shm_only_get_of_a_replica_on_disk_says_why_it_cannot_be_read(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    """Only its agent reads a disk tier, over TCP: a shm-only client was told "no allowed transport
    reaches a replica of 'cold' (on agent-0)", with nothing on the tier or the way out."""
    cluster = make_cluster(0)
    cluster.add_agent(
        node_id="agent-0",
        extra_args=["--host-bytes", str(16 << 20), "--disk", str(tmp_path / "disk"), "--disk-mem", str(64 << 20)],
    )
    value = np.arange(1 << 20, dtype=np.int32)  # 4 MiB
    with connect(cluster.redis_url, namespace=cluster.namespace) as writer:
        writer.put("cold", value)
        for i in range(3):  # past the high watermark: the coldest goes to disk
            writer.put(f"warm/{i}", value)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            meta = writer.object_meta("cold")
            if meta is not None and [str(r.tier) for r in meta.replicas] == ["disk"]:
                break
            time.sleep(0.1)
        assert meta is not None and [str(r.tier) for r in meta.replicas] == ["disk"], meta
        shm_only = connect(cluster.redis_url, namespace=cluster.namespace, transports=("shm",))
        why = r"agent-0's disk tier: a disk tier is read by its agent only, over tcp"
        with shm_only, pytest.raises(TransferError, match=why):
            shm_only.get("cold")
        assert np.array_equal(writer.get("cold"), value)  # over tcp, from its agent
