"""The transformers integration (review, thirty-fifth session):
- kv_namespace digested the weights and the rotary settings only: the same weights under a config
  whose other fields change the cached KV (rms_norm_eps, hidden_act) got one namespace, and
  load_prefix restored the other config's KV, silently wrong. It now digests every config field
  but those that cannot change a key or value (an attention kernel's name, token ids, ...);
- a DynamicCache no forward pass filled, and a config given as a dict, were AttributeErrors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

# The tiny model of test_transformers.py, built with one seed (so with the same weights for every
# config of one shape), on one thread (its autouse fixture, imported to apply here too).
from test_transformers import CHUNK, CONFIG, build_model, one_thread  # noqa: F401

from mooncake_store import Client, InvalidValue, PrefixCache
from mooncake_store.integrations.transformers import kv_namespace, load_prefix, output_cache, save_prefix

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("change", [{"rms_norm_eps": 0.5}, {"hidden_act": "gelu"}], ids=["eps", "act"])
def test_a_config_change_that_changes_the_kv_is_another_namespace(client: Client, change: dict[str, Any]) -> None:
    stored_model, loading_model = build_model(CONFIG), build_model({**CONFIG, **change})
    ids = torch.randint(0, 1000, (2 * CHUNK + 1,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        fresh = output_cache(loading_model(ids[None], use_cache=True))
        stored = output_cache(stored_model(ids[None], use_cache=True))
    assert not torch.allclose(fresh.layers[-1].keys, stored.layers[-1].keys, atol=1e-3)  # other KV
    assert kv_namespace(stored_model) != kv_namespace(loading_model)
    with PrefixCache(client, kv_namespace(stored_model), chunk_tokens=CHUNK) as cache:
        assert save_prefix(cache, ids, stored) == 2
    with PrefixCache(client, kv_namespace(loading_model), chunk_tokens=CHUNK) as other:
        assert load_prefix(other, ids, loading_model) == (0, None)  # nothing of the other config's


def test_a_config_change_that_leaves_the_kv_alone_keeps_the_namespace() -> None:
    """An attention kernel's name, the cache flag and the token ids change no cached number: the
    caches stay shared between processes that set them differently."""
    plain = build_model(CONFIG)
    other = build_model({**CONFIG, "use_cache": False, "pad_token_id": 3, "eos_token_id": 5})
    other.config._attn_implementation = "eager"
    assert kv_namespace(plain) == kv_namespace(other)


def test_a_cache_no_forward_pass_filled_is_refused(client: Client) -> None:
    model = build_model(CONFIG)
    with PrefixCache(client, kv_namespace(model), chunk_tokens=CHUNK) as cache:
        empty = transformers.DynamicCache(config=model.config)
        with pytest.raises(InvalidValue, match=r"layer 0's keys are .* not a \(batch, kv_heads, seq, head_dim\)"):
            save_prefix(cache, torch.arange(2 * CHUNK + 1), empty)
        three_d = tuple((torch.zeros(2, 8, 16), torch.zeros(2, 8, 16)) for _ in range(2))
        with pytest.raises(InvalidValue, match=r"layer 0's keys are \(2, 8, 16\)"):
            save_prefix(cache, torch.arange(8), three_d)


def test_a_config_given_as_a_dict_is_refused(client: Client) -> None:
    model = build_model(CONFIG)
    with PrefixCache(client, kv_namespace(model), chunk_tokens=CHUNK) as cache:
        ids = torch.arange(2 * CHUNK + 1)
        with torch.no_grad():
            save_prefix(cache, ids, output_cache(model(ids[None], use_cache=True)))
        with pytest.raises(InvalidValue, match=r"needs a transformers model or its PretrainedConfig, got dict"):
            load_prefix(cache, ids, config=model.config.to_dict())


def test_a_long_model_name_in_another_script_is_cut_by_bytes(client: Client) -> None:
    """A name past 96 B keeps its tail and a digest of the whole, within 96 B: the tail was 48
    characters, of a four-byte script 192 B, which with the layout brought the namespace to the
    edge of the 256 B a PrefixCache takes."""
    model = build_model(CONFIG)
    model.config._name_or_path = "/models/" + "𝔪" * 200
    namespace = kv_namespace(model)
    name = namespace.split("@")[0]
    assert name.startswith("...𝔪") and len(name.encode()) <= 96, name
    with PrefixCache(client, namespace, chunk_tokens=CHUNK) as cache:
        assert cache.namespace == namespace


def test_a_config_the_digest_cannot_order_asks_for_a_model_id() -> None:
    """A config field holding a dict of int and str keys cannot be sorted for the digest: a bare
    TypeError from json.dumps."""
    model = build_model(CONFIG)
    model.config.custom_table = {1: "a", "b": 2}
    with pytest.raises(InvalidValue, match=r"cannot be digested for kv_namespace .* pass model_id="):
        kv_namespace(model)
    assert kv_namespace(model, model_id="tiny").startswith("tiny/")
