"""Review session 13 (inputs): wrong arguments of the SDK that escaped as raw TypeErrors,
AttributeErrors or ModuleNotFoundErrors from deep inside, or were taken for something else (a
node id of the wrong type reported as no room, an empty batch that skipped the checks its items
would meet). Each now gets a MooncakeError naming the value. Real server and agents.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from mooncake_store import Client, ConfigError, InvalidValue, LocalCluster, MooncakeError, connect
from mooncake_store.client.client import Client as ClientClass
from mooncake_store.client.prefix import PrefixCache
from mooncake_store.embedded import EmbeddedServer, ServerError


def test_a_bfloat16_object_read_without_torch_says_what_to_install(
    shared_cluster: LocalCluster, make_client: Callable[..., Client]
) -> None:
    """A bfloat16 object comes back as a torch tensor; a reader without torch (the base install)
    got ModuleNotFoundError from get and lost the whole batch of get_many."""
    import torch  # a test requirement (the test install's hf extra): its absence is a failure, not a skip

    client = make_client(shared_cluster)
    client.put("bf/0", torch.arange(64, dtype=torch.bfloat16))
    reader = f"""
import sys
sys.modules["torch"] = None  # as where torch is not installed
from mooncake_store import InvalidValue, connect
with connect({shared_cluster.redis_url!r}, namespace={shared_cluster.namespace!r}) as c:
    for call in (lambda: c.get("bf/0"), lambda: c.get_many(["bf/0"])):
        try:
            call()
            print("no error")
        except InvalidValue as exc:
            print("InvalidValue:", exc)
    import numpy
    print("get_into", c.get_into("bf/0", numpy.zeros(64, numpy.int16)), c.get_into("bf/0", bytearray(128)))
"""
    done = subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 3, done.stdout
    for line in lines[:2]:
        assert line.startswith("InvalidValue: a bfloat16 object of shape (64,) comes back as a torch tensor"), line
        assert "install torch, or read its bits with get_into into an int16, uint16 or uint8 buffer" in line
    assert lines[2] == "get_into 128 128", lines[2]  # the ways the message points to work


def test_prefix_cache_arguments_of_the_wrong_kind_are_refused_by_name(shared_client: Client) -> None:
    cache = PrefixCache(shared_client, "inputs-13", chunk_tokens=4)
    tokens = list(range(8))
    for chunks in (None, 5, (c for c in [b"x", b"y"])):
        with pytest.raises(InvalidValue, match="chunks must be a sequence of chunk arrays or a callable"):
            cache.store(tokens, chunks)  # type: ignore[arg-type]
    assert cache.store(tokens, [np.full(16, i, np.uint8) for i in range(2)]) == 2
    with pytest.raises(
        InvalidValue, match=r"outs is int; a sequence of output buffers \(or an array of a row each\) is wanted"
    ):
        cache.load(tokens, outs=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidValue, match=r"outs\(n\) returned NoneType; a sequence of output buffers"):
        cache.load(tokens, outs=lambda n: None)  # type: ignore[arg-type,return-value]
    # The refused loads released their pins: the chunks can be replaced (a pinned one cannot).
    key = cache.keys(tokens)[0]
    shared_client.put(key, np.zeros(16, np.uint8))
    with cache.load(tokens) as hit:
        assert hit.num_chunks == 2
    cache.close()


def test_transports_and_config_of_the_wrong_type_are_config_errors(shared_cluster: LocalCluster) -> None:
    url, ns = shared_cluster.redis_url, shared_cluster.namespace
    with pytest.raises(ConfigError, match=r"transports must be a name or an iterable of names .* got int: 5"):
        connect(url, namespace=ns, transports=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"transports must be a name or an iterable of names .* got int: 5"):
        ClientClass(url, namespace=ns, transports=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"transports must be names .* got int: 1"):
        connect(url, namespace=ns, transports=["tcp", 1])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="config must be a ClientConfig, got dict"):
        ClientClass(url, namespace=ns, config={"timeout_s": 1})  # type: ignore[arg-type]
    with connect(url, namespace=ns, transports="tcp") as one:  # one name is one transport
        assert [str(t) for t in one.transports] == ["tcp"]


def test_connect_refuses_transport_names_as_the_caller_gave_them(shared_cluster: LocalCluster) -> None:
    """connect() handed the names to the config as one comma-joined text: a refusal quoted
    client.transports='udp,tcp' rather than the tuple passed, and a name with a comma in it
    ('shm, tcp') was taken as two, where Client() refuses it."""
    url, ns = shared_cluster.redis_url, shared_cluster.namespace
    with pytest.raises(ConfigError, match=r"client\.transports=\('udp', 'tcp'\): unknown transport 'udp'"):
        connect(url, namespace=ns, transports=("udp", "tcp"))
    for make in (connect, ClientClass):
        with pytest.raises(ConfigError, match=r"unknown transport 'shm, tcp'"):
            make(url, namespace=ns, transports=["shm, tcp"])


def test_put_options_are_checked_before_anything_else_even_for_an_empty_batch(shared_client: Client) -> None:
    """A preferred_node of the wrong type was reported as NoCapacity ('preferred node 5 is not a
    live agent', exit code 5 in the CLI: no room); an empty batch skipped the checks."""
    with pytest.raises(InvalidValue, match=r"preferred_node must be a node id .* got int: 5"):
        shared_client.put("opt/0", b"x", preferred_node=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidValue, match=r"replicas must be an int in 1\.\.16, got 0"):
        shared_client.put_many({}, replicas=0)
    with pytest.raises(InvalidValue, match="preferred_node must be a node id"):
        shared_client.put_many({}, preferred_node=object())  # type: ignore[arg-type]
    assert not shared_client.exists("opt/0")


def test_get_async_takes_device_as_get_does(shared_client: Client) -> None:
    """The README points device loaders to get (or get_async); get_async took no device."""
    shared_client.put("async/dev", np.arange(10, dtype=np.int32))
    assert np.array_equal(shared_client.get_async("async/dev", device=None).result(timeout=30), np.arange(10))
    try:
        expected: BaseException | None = None
        shared_client.get("async/dev", device="cuda:0")
    except MooncakeError as exc:  # no GPU here: the same refusal from both
        expected = exc
    future = shared_client.get_async("async/dev", device="cuda:0")
    if expected is None:
        assert future.result(timeout=30) is not None
    else:
        with pytest.raises(type(expected)):
            future.result(timeout=30)


def test_embedded_server_arguments_are_server_errors_and_leave_no_temp_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ServerError, match=r"port='6379': not an int in 0\.\.65535"):
        EmbeddedServer(port="6379")  # type: ignore[arg-type]
    with pytest.raises(ServerError, match="startup_timeout_s=None: must be a number > 0"):
        EmbeddedServer(startup_timeout_s=None)  # type: ignore[arg-type]
    with pytest.raises(MooncakeError, match="num_agents must be an int >= 0, got '2'"):
        LocalCluster(num_agents="2")  # type: ignore[arg-type]
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    # A temp root of this test's own: the other xdist worker's servers make theirs in /tmp meanwhile.
    temp_root = tmp_path / "temp"
    temp_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp_root))
    before = set(temp_root.glob("mooncake-redis-*"))
    with pytest.raises(ServerError, match=f"persist_dir='{a_file}': cannot be made a directory"):
        EmbeddedServer(persist_dir=a_file).start()
    with pytest.raises(ServerError, match=r"host='bad\.invalid': cannot listen there"):  # was socket.gaierror
        EmbeddedServer(host="bad.invalid").start()
    assert set(temp_root.glob("mooncake-redis-*")) - before == set(), "a temp dir left by a failed start"
