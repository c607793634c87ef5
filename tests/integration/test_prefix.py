"""PrefixCache against a real server and real agents: match, store, load, pins, sharing."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial

import numpy as np
import pytest
from helpers import beat_since, wait_until
from redis_proxy import RedisProxy

from mooncake_store import (
    Client,
    ConfigError,
    InvalidValue,
    LocalCluster,
    MooncakeError,
    ObjectPinned,
    PrefixCache,
    connect,
)

pytestmark = pytest.mark.timeout(120)

C = 16  # tokens per chunk
NS = "test-model/f32/L2/kv2/d16/tp0"


def chunk_arrays(n: int, *, tokens: int = C, width: int = 64, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((2, tokens, width)).astype(np.float32) for _ in range(n)]


def ids(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


def test_store_match_load_roundtrip(client: Client) -> None:
    cache = PrefixCache(client, NS, chunk_tokens=C)
    tokens = ids(8 * C + 5)  # 8 full chunks and a tail
    chunks = chunk_arrays(8)
    assert cache.match(tokens) == 0
    assert cache.store(tokens, chunks) == 8
    assert cache.store(tokens, chunks) == 0  # existing chunks are not rewritten
    assert cache.match(tokens) == 8 * C
    assert cache.match(tokens[: 3 * C + 7]) == 3 * C
    assert cache.match(np.r_[tokens[: 5 * C], [7] * 40]) == 5 * C  # diverges in chunk 5
    assert cache.match(tokens, max_tokens=4 * C + 3) == 4 * C
    with cache.load(tokens) as hit:
        assert hit.num_tokens == 8 * C and hit.num_chunks == 8
        for got, want in zip(hit.chunks, chunks, strict=True):
            np.testing.assert_array_equal(got, want)
        assert cache.refcounts(tokens) == [1] * 8 + [0]  # the tail (5 tokens) was not stored
    assert hit.released
    assert cache.refcounts(tokens) == [0] * 9
    cache.close()


def test_tail_only_when_asked(client: Client) -> None:
    cache = PrefixCache(client, NS, chunk_tokens=C)
    tokens = ids(2 * C + 5)
    cache.store(tokens, chunk_arrays(2))
    assert cache.match(tokens) == 2 * C
    tail = np.zeros((2, 5, 64), np.float32)
    assert cache.store(tokens, [*chunk_arrays(2), tail], include_tail=True) == 1
    assert cache.match(tokens) == 2 * C + 5
    with cache.load(tokens) as hit:
        assert hit.num_tokens == 2 * C + 5 and hit.chunks[-1].shape == (2, 5, 64)
    cache.close()


def test_load_into_buffers_and_async(client: Client) -> None:
    cache = PrefixCache(client, NS, chunk_tokens=C)
    tokens = ids(4 * C)
    chunks = chunk_arrays(4)
    cache.store(tokens, lambda i: chunks[i])
    staging = np.empty((6, *chunks[0].shape), np.float32)
    with cache.load(tokens, outs=lambda n: list(staging[:n])) as hit:
        assert hit.num_chunks == 4
    np.testing.assert_array_equal(staging[:4], np.stack(chunks))
    with cache.load_async(tokens).result(timeout=30) as hit:
        assert hit.num_tokens == 4 * C
    with cache.load(ids(4 * C, start=10_000)) as miss:
        assert miss.num_tokens == 0 and miss.chunks == []
    cache.close()


def test_block_hashes_instead_of_tokens(client: Client) -> None:
    cache = PrefixCache(client, NS, chunk_tokens=C)
    hashes = [b"h0" * 16, b"h1" * 16, b"h2" * 16]
    assert cache.store(block_hashes=hashes, chunks=chunk_arrays(3)) == 3
    assert cache.match(block_hashes=hashes) == 3 * C
    assert cache.match(block_hashes=[*hashes[:2], b"other"]) == 2 * C
    assert cache.match(block_hashes=[b"other", *hashes[1:]]) == 0  # a chain, not a set
    cache.close()


def test_match_stops_at_a_removed_middle_chunk(client: Client) -> None:
    cache = PrefixCache(client, NS, chunk_tokens=C)
    tokens = ids(10 * C)
    cache.store(tokens, chunk_arrays(10))
    assert client.remove(cache.keys(tokens)[6])
    assert cache.match(tokens) == 6 * C
    with cache.load(tokens) as hit:
        assert hit.num_chunks == 6
    assert cache.store(tokens, chunk_arrays(10)) == 1  # only the gap is written again
    assert cache.match(tokens) == 10 * C
    cache.close()


def test_match_skips_chunks_on_a_killed_agent(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(2, heartbeat_ttl_s=1.5)
    client = make_client(cluster)
    cache = PrefixCache(client, NS, chunk_tokens=C)
    tokens = ids(8 * C)
    chunks = chunk_arrays(8)
    assert cache.store(tokens[: 4 * C], chunks, preferred_node="agent-0") == 4
    assert cache.store(tokens, chunks, preferred_node="agent-1") == 4
    assert cache.match(tokens) == 8 * C
    cluster.agent("agent-1").kill()
    deadline = time.monotonic() + 10
    while cache.match(tokens) != 4 * C and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cache.match(tokens) == 4 * C
    with cache.load(tokens) as hit:
        assert hit.num_chunks == 4
    cluster.agent("agent-0").kill()
    deadline = time.monotonic() + 10
    while cache.match(tokens) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cache.match(tokens) == 0
    cache.close()


def test_pinned_chunks_survive_remove_replace_and_eviction(client: Client) -> None:
    cache = PrefixCache(client, NS, chunk_tokens=C)
    tokens = ids(3 * C)
    chunks = chunk_arrays(3)
    cache.store(tokens, chunks)
    keys = cache.keys(tokens)
    hit = cache.load(tokens)
    with pytest.raises(ObjectPinned):
        client.remove(keys[1])
    with pytest.raises(ObjectPinned):
        client.put(keys[1], np.zeros(4, np.float32))
    (meta,) = client.index.lookup([keys[1]], lease_ms=0).objects
    assert meta is not None
    replica = meta.replicas[0]
    # What the agent's pressure handling does to a victim: refused while the chunk is pinned.
    assert client.index.evict(keys[1], node_id=replica.node_id, alloc_id=replica.alloc_id) == "PINNED"
    second = cache.load(tokens)  # two requests share one chunk: refcount 2
    assert cache.refcounts(tokens) == [2, 2, 2]
    hit.release()
    assert cache.refcounts(tokens) == [1, 1, 1]
    with pytest.raises(ObjectPinned):
        client.remove(keys[1])
    second.release()
    np.testing.assert_array_equal(client.get(keys[1]), chunks[1])
    # A victim's read leases have run out (the loads and the get above took 5 s ones): as then.
    for key in keys:
        client.index.redis.hset(client.index.prefix + "o:" + key, "lease_until", 0)
    # Unpinned, it may go, but only as a leaf: chunk 2 hangs off it, so it goes first.
    assert client.index.evict(keys[1], node_id=replica.node_id, alloc_id=replica.alloc_id) == "PARENT"
    (leaf,) = client.index.lookup([keys[2]], lease_ms=0).objects
    assert leaf is not None
    leaf_replica = leaf.replicas[0]
    assert client.index.evict(keys[2], node_id=leaf_replica.node_id, alloc_id=leaf_replica.alloc_id) == "OK"
    assert client.index.evict(keys[1], node_id=replica.node_id, alloc_id=replica.alloc_id) == "OK"
    assert cache.match(tokens) == C
    cache.close()


def test_pins_are_renewed_while_held(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    client = make_client(make_cluster(1))
    # Renewed every third of a lease: a renewer 0.8 s late (a loaded machine) still keeps them.
    cache = PrefixCache(client, NS, chunk_tokens=C, pin_lease_s=1.2)
    tokens = ids(2 * C)
    cache.store(tokens, chunk_arrays(2))
    with cache.load(tokens) as hit:
        time.sleep(2.6)  # more than two leases
        assert cache.refcounts(tokens) == [1, 1]
        with pytest.raises(ObjectPinned):
            client.remove(hit.keys[0])
    assert client.remove(cache.keys(tokens)[0])
    cache.close()


def test_a_store_longer_than_its_claims_keeps_them_from_another_writer(client: Client) -> None:
    """A store's claims (claim_ttl_s) are renewed while it writes: a store whose chunks take three
    claim ttls to produce keeps a second writer of the same prompt out (BUSY: it writes nothing).
    Before, the claims ran out mid-store and the second writer claimed and wrote every chunk again."""
    # Renewed every third of a ttl: a renewer 0.4 s late (a loaded machine) still keeps them.
    first = PrefixCache(client, NS, chunk_tokens=C, claim_ttl_s=0.6)
    second = PrefixCache(client, NS, chunk_tokens=C, claim_ttl_s=0.6)
    tokens = ids(4 * C, start=70_000)
    chunks = chunk_arrays(4, seed=3)
    rival: list[int] = []

    def slow_chunk(i: int) -> np.ndarray:
        time.sleep(0.45)  # four chunks: 1.8 s, three ttls
        if i == 3:  # the first writer's claims are 1.8 s old: a rival store of the same prompt
            rival.append(second.store(tokens, chunk_arrays(4, seed=4)))
        return chunks[i]

    assert first.store(tokens, slow_chunk) == 4
    assert rival == [0], "the rival claimed and wrote chunks the first writer held"
    with first.load(tokens) as hit:  # the first writer's bytes, not the rival's
        assert hit.num_chunks == 4
        for got, want in zip(hit.chunks, chunks, strict=True):
            np.testing.assert_array_equal(got, want)
    assert second.store(tokens, chunks) == 0  # stored now, and its claims released
    first.close()
    second.close()


CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from mooncake_store import connect, PrefixCache
    url, ns, model_ns = sys.argv[1:4]
    client = connect(url, namespace=ns)
    cache = PrefixCache(client, model_ns, chunk_tokens=16, pin_lease_s=1.0)
    hit = cache.load(np.arange(48))
    print("PINNED", hit.num_chunks, flush=True)
    time.sleep(120)
    """
)


def test_pin_of_a_killed_client_expires(client: Client, cluster: LocalCluster) -> None:
    cache = PrefixCache(client, NS, chunk_tokens=C)
    tokens = ids(3 * C)
    cache.store(tokens, chunk_arrays(3))
    key = cache.keys(tokens)[0]
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, cluster.redis_url, cluster.namespace, NS],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().split() == ["PINNED", "3"]
        time.sleep(1.5)  # past the 1 s lease: the live child keeps renewing
        with pytest.raises(ObjectPinned):
            client.remove(key)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        killed = time.monotonic()
        while time.monotonic() - killed < 10:
            try:
                assert client.remove(key)
                break
            except ObjectPinned:
                time.sleep(0.1)
        else:
            pytest.fail("the pin of a killed client never expired")
        assert cache.refcounts(tokens)[1:] == [0, 0]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()
    cache.close()


def test_concurrent_requests_store_a_shared_prefix_once(
    cluster: LocalCluster, make_client: Callable[..., Client]
) -> None:
    num_chunks, requests = 12, 8
    tokens = ids(num_chunks * C)
    chunks = chunk_arrays(num_chunks, width=1024)  # 128 KiB each
    one_copy = sum(c.nbytes for c in chunks)
    observer = make_client(cluster)
    used_before = observer.stat().used_bytes
    barrier = threading.Barrier(requests)
    written: list[int] = []
    matched: list[int] = []

    def request(k: int) -> None:
        client = make_client(cluster)
        cache = PrefixCache(client, NS, chunk_tokens=C)
        question = np.r_[tokens, [50_000 + k] * 5]
        barrier.wait()
        if cache.match(question) < num_chunks * C:
            written.append(cache.store(question, chunks))
        with cache.load(question) as hit:
            matched.append(hit.num_tokens)
        cache.close()

    threads = [threading.Thread(target=request, args=(k,)) for k in range(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sum(written) == num_chunks  # every chunk written by exactly one request
    assert len(matched) == requests
    prefix = observer.index.prefix
    assert int(observer.index.redis.get(prefix + "version")) == num_chunks  # commits ever made
    assert len(observer.index.list_keys("pfx:*")) == num_chunks
    # The agents publish their arena use with each heartbeat (1 s): waited for from every node,
    # not slept on (a beat late on a loaded machine showed the use of before the stores).
    stored_at = time.monotonic()
    nodes = [n.node_id for n in observer.stat().nodes]
    assert wait_until(lambda: all(beat_since(observer, stored_at, n) for n in nodes), 15)
    grown = observer.stat().used_bytes - used_before
    assert one_copy <= grown < one_copy * 1.1, (grown, one_copy)


def test_a_store_over_chunks_a_hit_pins_on_a_dead_node_writes_the_rest_and_does_not_raise(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """Client A holds a hit on 8 chunks; the node holding the last 4 dies. Client B's store of the
    same prompt claims those 4 (unreadable) and writes them, but their records are still pinned by
    A's hit until the reaper drops them: the commit refused them and store() raised ObjectPinned,
    failing B's request. It now returns what it wrote; once A lets go, the prompt is whole again."""
    cluster = make_cluster(2, heartbeat_ttl_s=3.0)
    holder, writer = (
        PrefixCache(make_client(cluster), NS, chunk_tokens=C),
        PrefixCache(make_client(cluster), NS, chunk_tokens=C),
    )
    tokens = ids(8 * C)
    chunks = chunk_arrays(8)
    assert holder.store(tokens[: 4 * C], chunks, preferred_node="agent-0") == 4
    assert holder.store(tokens, chunks, preferred_node="agent-1") == 4
    hit = holder.load(tokens)
    assert hit.num_chunks == 8
    cluster.agent("agent-1").kill()
    deadline = time.monotonic() + 10
    while writer.match(tokens) != 4 * C and time.monotonic() < deadline:
        time.sleep(0.05)
    assert writer.match(tokens) == 4 * C
    written = writer.store(tokens, chunks, preferred_node="agent-0")  # raised ObjectPinned
    assert 0 <= written <= 4
    hit.release()
    deadline = time.monotonic() + 15
    while writer.match(tokens) != 8 * C and time.monotonic() < deadline:
        writer.store(tokens, chunks, preferred_node="agent-0")
        time.sleep(0.1)
    assert writer.match(tokens) == 8 * C
    holder.close()
    writer.close()


def test_a_renewal_taken_before_a_load_cut_its_hit_pins_only_what_the_hit_still_holds(client: Client) -> None:
    """load() cuts a hit short when a chunk cannot be read after all, unpinning the tail. A
    renewal pass that had read the hit's whole key list before the cut pinned the tail again after
    the unpin, ownerless for a whole lease (the chunks could not be removed or replaced). The
    renewal reads the keys when it runs, under the hit's lock, and load() cuts them under it."""
    cache = PrefixCache(client, NS + "/renew-cut", chunk_tokens=C)
    tokens = ids(8 * C, start=7000)
    cache.store(tokens, chunk_arrays(8))
    hit = cache.load(tokens)
    renewal = partial(cache._pin_held, hit)  # as the renewal loop takes it, before the cut
    with hit._pin_lock:  # the cut, as load() makes it
        hit.keys = hit.keys[:4]
    cache.index.unpin(cache.keys(tokens)[4:], pin_id=hit.pin_id)
    cache._renew(hit, hit._pin_lock, renewal)
    assert cache.refcounts(tokens) == [1, 1, 1, 1, 0, 0, 0, 0]
    hit.release()
    assert cache.refcounts(tokens) == [0] * 8
    cache.close()


def test_a_claim_release_that_fails_does_not_hide_a_stored_prompt(
    client_of: Callable[[str], Client],
    proxied_agent: Callable[..., object],
    proxy: RedisProxy,
    namespace: str,
    redis_url: str,
) -> None:
    """store() released its claims in a finally without catching the index's error: a release
    that failed (the index out of reach a moment) made a store that had written every chunk raise,
    or hid the error the store itself had met. The claims run out by their ttl anyway."""
    proxied_agent(namespace)  # an agent for the chunks (its index link is the proxy's too)
    client = connect(proxy.url, namespace=namespace, timeout_s=5.0)
    try:
        cache = PrefixCache(client, NS, chunk_tokens=C, claim_ttl_s=2.0)
        tokens = ids(4 * C, start=9000)
        proxy.drop_reply(str(cache.index._scripts["prefix_release"].sha))
        proxy.down_after_reply_of(str(cache.index._scripts["prefix_release"].sha))
        assert cache.store(tokens, chunk_arrays(4)) == 4  # raised: the release's lost reply
        proxy.up()
        assert cache.match(tokens) == 4 * C
        cache.close()
    finally:
        client.close()


def test_a_match_of_a_chain_longer_than_the_limit_matches_up_to_it(client: Client) -> None:
    """store() takes a chain of any length, but match() and load() raised for one over 65,536
    chunks instead of matching its first 65,536."""
    from mooncake_store.index.prefix import MAX_CHAIN_CHUNKS, PrefixIndex

    keys = [f"never-stored/{i}" for i in range(MAX_CHAIN_CHUNKS + 1)]
    assert PrefixIndex(client.index).match(keys).num_chunks == 0


@pytest.mark.parametrize("lease_s", [0.6, 600.0])
def test_the_renewal_thread_ends_with_its_client(
    cluster: LocalCluster, make_client: Callable[..., Client], lease_s: float
) -> None:
    """A cache's renewal thread ran on after its client was closed (failing every third of a
    lease) until the cache itself was closed; and then, until the twenty-eighth session, it looked
    at its client only when it woke, every third of the lease: with a 600 s lease it outlived
    client.close() by up to 200 s, holding the cache and client."""
    client = make_client(cluster)
    cache = PrefixCache(client, NS + "/renewer", chunk_tokens=C, pin_lease_s=lease_s, claim_ttl_s=lease_s)
    tokens = ids(2 * C, start=11_000)
    cache.store(tokens, chunk_arrays(2))
    hit = cache.load(tokens)
    renewer = cache._renewer
    assert renewer is not None and renewer.is_alive()
    client.close()
    renewer.join(timeout=5)
    assert not renewer.is_alive(), "the renewal thread outlived its client"
    assert hit.num_chunks == 2
    cache.close()


def test_a_cache_on_a_closed_client_says_the_client_is_closed(
    shared_cluster: LocalCluster, make_client: Callable[..., Client]
) -> None:
    """Once its client was closed, every PrefixCache call failed with ConnectError ("the index
    client for redis://... is closed"), which reads as a network fault an engine retries; the
    README promises MooncakeError("client is closed"), as the client's own calls raise."""
    client = make_client(shared_cluster)
    cache = PrefixCache(client, "closed-client/f32/L1/kv1/d8/tp0", chunk_tokens=C)
    cache.store(ids(2 * C), chunk_arrays(2))
    client.close()
    calls: list[Callable[[], object]] = [
        partial(cache.match, ids(2 * C)),
        partial(cache.store, ids(3 * C), chunk_arrays(3)),
        partial(cache.load, ids(2 * C)),
        partial(cache.refcounts, ids(2 * C)),
    ]
    for call in calls:
        with pytest.raises(MooncakeError) as info:
            call()
        assert type(info.value) is MooncakeError and str(info.value) == "client is closed", info.value
    cache.close()


def test_prefix_cache_arguments_are_checked_and_stacked_chunks_are_taken(client: Client) -> None:
    """A PrefixCache given no client failed with a raw AttributeError; token ids of the wrong kind
    were "must be 1-D, got shape ()" whatever they were, and ints past int64 "must be integers";
    a stacked array of chunks (a row each) was refused where Client.get_many_into takes one."""
    with pytest.raises(ConfigError, match=r"client must be a mooncake_store Client .* got NoneType"):
        PrefixCache(None, "t", chunk_tokens=C)  # type: ignore[arg-type]
    cache = PrefixCache(client, f"t-{uuid.uuid4().hex[:8]}", chunk_tokens=C)
    try:
        with pytest.raises(InvalidValue, match="got str: 'abc'"):
            cache.match("abc")  # type: ignore[arg-type]
        with pytest.raises(InvalidValue, match=f"token id {2**70} does not fit in int64"):
            cache.match([2**70] * C)
        stacked = np.stack(chunk_arrays(3, seed=7))
        assert cache.store(ids(3 * C), stacked) == 3
        with cache.load(ids(3 * C), outs=np.zeros_like(stacked)) as hit:
            assert hit.num_chunks == 3
            assert all(np.array_equal(got, want) for got, want in zip(hit.chunks, stacked, strict=True))
    finally:
        cache.close()


def test_counts_may_be_numpy_integers_and_include_tail_must_be_a_bool(client: Client) -> None:
    """Counts that come out of numpy arithmetic (np.int64) were refused where an int is taken
    (replicas, chunk_tokens, max_tokens); include_tail="no" was taken as true. Bools are still no
    counts."""
    cache = PrefixCache(client, f"t-{uuid.uuid4().hex[:8]}", chunk_tokens=np.int64(C), replicas=np.int32(1))
    try:
        assert type(cache.chunk_tokens) is int and cache.chunk_tokens == C
        assert cache.store(ids(2 * C), chunk_arrays(2)) == 2
        assert cache.match(ids(2 * C), max_tokens=np.int64(C)) == C
        with pytest.raises(InvalidValue, match="include_tail must be a bool, got str: 'no'"):
            cache.match(ids(2 * C), include_tail="no")  # type: ignore[arg-type]
        with pytest.raises(InvalidValue, match="max_tokens must be an int >= 0, got True"):
            cache.match(ids(2 * C), max_tokens=True)
    finally:
        cache.close()
    client.put("np-replicas", b"x", replicas=np.int64(1))  # type: ignore[arg-type]
    meta = client.object_meta("np-replicas")
    assert meta is not None and len(meta.replicas) == 1
    with pytest.raises(InvalidValue, match=r"replicas must be an int in 1\.\.16, got True"):
        client.put("np-replicas", b"x", replicas=True)
