"""Review of the prefix cache (session 4): pins, their renewal and release, load into buffers,
input checks and the transformers namespace.

Real Redis/Valkey, real agents (the session's shared cluster), the real PrefixCache and Client.
Nothing of the component under review is stubbed; where an interleaving must be placed exactly, the
test does it through an input the public API takes (an array-like token sequence).
"""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest
import torch
import transformers

from mooncake_store import Client, InvalidValue, MooncakeError, PrefixCache
from mooncake_store.client.prefix import PrefixHit
from mooncake_store.integrations.transformers import kv_namespace, load_prefix, output_cache, save_prefix

pytestmark = pytest.mark.timeout(180)

C = 16  # tokens per chunk


def fresh_ns() -> str:
    return f"review-{uuid.uuid4().hex[:8]}/f32/L2/kv2/d16/tp0"


def ids(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


def chunk_arrays(n: int, *, width: int = 64, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((2, C, width)).astype(np.float32) for _ in range(n)]


class GatedTokens:
    """Token ids as an array-like whose conversion waits for a gate: it holds a load() after its
    open-check and before its match, the way a long prompt's hashing does."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens
        self.entered = threading.Event()
        self.gate = threading.Event()

    def __len__(self) -> int:
        return len(self.tokens)

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        self.entered.set()
        assert self.gate.wait(30)
        return self.tokens if dtype is None else self.tokens.astype(dtype)


def test_a_hit_released_during_a_renewal_pass_is_not_pinned_again(shared_client: Client) -> None:
    """_renew_loop snapshots the held hits under the lock, then pins each outside it: a hit released
    between the snapshot and its pin call gets its pin back (ZADD in prefix_pin.lua) after its
    unpin, so the chunk stays pinned (unremovable, unevictable) for a whole lease after release."""
    cache = PrefixCache(shared_client, fresh_ns(), chunk_tokens=C, pin_lease_s=0.6)  # renewed every 0.2 s
    tokens = ids(C)
    cache.store(tokens, chunk_arrays(1))
    pins_key = cache.index.prefix + "pins:" + cache.keys(tokens)[0]
    redis = shared_client.index.redis
    leaked: list[int] = []
    try:
        for _ in range(10):  # bounded; one round shows it unless the machine stalls the renewer
            hits = [cache.load(tokens) for _ in range(150)]
            # Wait for a renewal pass to begin: it renews in load order, so the first hit's pin
            # expiry moves first.
            first = redis.zscore(pins_key, hits[0].pin_id)
            deadline = time.monotonic() + 5
            while redis.zscore(pins_key, hits[0].pin_id) == first and time.monotonic() < deadline:
                pass
            for hit in reversed(hits):  # against the renewer's order: the two runs cross mid-way
                hit.release()
            time.sleep(0.05)  # let the pass that began before the releases finish
            left = cache.refcounts(tokens)[0]
            if left:
                leaked.append(left)
                break
        # Every hit is released, yet pins remain until their renewed lease runs out.
        assert not leaked, f"{leaked[0]} pin(s) of released hits were renewed after their release"
    finally:
        cache.close()


def test_a_hit_loaded_while_the_cache_closes_is_unpinned_by_its_release(shared_client: Client) -> None:
    """close() snapshots the held hits, releases them, then sets _closed; a load() already past its
    open-check pins its chunks after that snapshot, and its release() then skips the unpin because
    the cache is closed (_release: ``if hit.keys and not self._closed``). The chunk stays pinned
    for a full pin lease after the caller released it (30 s by default), refusing remove/evict."""
    cache = PrefixCache(shared_client, fresh_ns(), chunk_tokens=C)
    tokens = ids(2 * C)
    cache.store(tokens, chunk_arrays(2))
    keys = cache.keys(tokens)
    gated = GatedTokens(tokens)
    result: list[object] = []

    def load() -> None:
        try:
            result.append(cache.load(gated))
        except MooncakeError as exc:  # refusing the load because the cache closed is fine too
            result.append(exc)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        assert gated.entered.wait(10)  # the load is past _check_open
        cache.close()  # the client stays open
        gated.gate.set()
        loader.join(timeout=30)
        assert not loader.is_alive()
        (outcome,) = result
        if isinstance(outcome, PrefixHit):
            outcome.release()
        assert cache.index.refcounts(keys) == [0, 0], f"{outcome!r} was released yet still pins its chunks"
        assert shared_client.remove(keys[1])
    finally:
        gated.gate.set()
        loader.join(timeout=30)
        for hit in result:
            if isinstance(hit, PrefixHit):  # don't leave a 30 s pin on the shared cluster
                cache.index.unpin(hit.keys, pin_id=hit.pin_id)


def test_load_into_buffers_too_small_is_an_error_not_a_silent_miss(shared_client: Client) -> None:
    """_read_into catches every MooncakeError from get_many_into to keep the readable run when a
    node died; InvalidValue (a buffer smaller than the chunk) is one, so a caller whose staging
    has the wrong dtype or shape gets a 0-token hit and recomputes forever, with no error at all."""
    cache = PrefixCache(shared_client, fresh_ns(), chunk_tokens=C)
    tokens = ids(3 * C)
    cache.store(tokens, chunk_arrays(3))  # float32 chunks, 8 KiB each
    # Half the bytes: the model's dtype was wrong (refused for its dtype), or raw staging too small.
    wrong_dtype = np.empty((3, 2, C, 64), np.float16)
    too_small = np.empty((3, chunk_arrays(1)[0].nbytes // 2), np.uint8)
    try:
        for staging, says in ((wrong_dtype, "holds <f4 but out has dtype <f2"), (too_small, "8192")):
            with pytest.raises(InvalidValue, match=says):
                hit = cache.load(tokens, outs=list(staging))
                hit.release()
                pytest.fail(f"load into too-small buffers returned {hit!r} instead of raising")
            assert cache.refcounts(tokens) == [0, 0, 0]
    finally:
        cache.close()


@pytest.mark.parametrize(
    ("call", "names"),
    [
        (lambda client, ns: PrefixCache(client, ns, pin_lease_s=float("nan")), "nan"),
        (lambda client, ns: PrefixCache(client, ns, claim_ttl_s="30"), "30"),  # type: ignore[arg-type]
        (lambda client, ns: PrefixCache(client, ns, chunk_tokens=C).match(ids(4 * C), max_tokens=40.0), "40.0"),
    ],
    ids=["nan-lease", "str-ttl", "float-max-tokens"],
)
def test_bad_prefix_cache_arguments_are_invalid_value_naming_the_value(
    shared_client: Client, call: object, names: str
) -> None:
    """Invariant 6: a bad argument is a MooncakeError naming the value, not a ValueError/TypeError
    from int(), ``<=`` or a slice deep inside."""
    with pytest.raises(MooncakeError, match=names):
        call(shared_client, fresh_ns())  # type: ignore[operator]


def test_load_prefix_never_restores_the_kv_of_another_model(shared_client: Client) -> None:
    """kv_namespace falls back to ``config.model_type`` when the model has no name or path (a model
    built from a config, then given its weights from a state dict): two models with different
    weights and one layout share a namespace, and load_prefix of one restores the KV cache that
    the other computed, so its continuation is silently wrong."""
    config = {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip
    torch.manual_seed(1)
    a = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    torch.manual_seed(2)
    b = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    assert not torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    prompt = torch.arange(3 * C + 1) % 100
    cache_a = PrefixCache(shared_client, kv_namespace(a), chunk_tokens=C)
    cache_b = PrefixCache(shared_client, kv_namespace(b), chunk_tokens=C)
    try:
        with torch.no_grad():
            past_a = output_cache(a(prompt[None], use_cache=True))
        save_prefix(cache_a, prompt, past_a)
        num_tokens, _ = load_prefix(cache_b, prompt, b)
        assert num_tokens == 0, (
            f"model b restored {num_tokens} tokens of model a's KV cache: both under {cache_b.namespace!r}"
        )
    finally:
        shared_client.remove_many(cache_a.keys(prompt))  # the shared cluster outlives this test
        cache_a.close()
        cache_b.close()
