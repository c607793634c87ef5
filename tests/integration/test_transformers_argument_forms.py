"""Arguments of the transformers integration that it could not read gave Python's errors, not
InvalidValue (a probe): save_prefix counted the ids (len()) before reading them, an int, a 0-d
tensor or a generator a TypeError, and copied a meta tensor out itself, a NotImplementedError;
kv_namespace read a dict's model_type (AttributeError) and pasted any tp_rank into the name
(-1, True, 1.5, None, "0/x": a path segment more); a quantized cache was told to pass what it had."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

# The tiny model of test_transformers.py, on one thread (its autouse fixture, imported to apply here).
from test_transformers import CHUNK, CONFIG, build_model, document, one_thread  # noqa: F401

from mooncake_store import Client, InvalidValue, PrefixCache
from mooncake_store.integrations.transformers import (
    cache_kwargs,
    kv_namespace,
    load_prefix,
    output_cache,
    save_prefix,
)

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        (5, "token ids must be a list, tuple, 1-D array or tensor of ints, got int"),
        (torch.tensor(5), "token ids must be a list, tuple, 1-D array or tensor of ints"),
        ((i for i in range(40)), "got generator"),
        (torch.empty(40, dtype=torch.long, device="meta"), "token ids on meta cannot be read"),
    ],
    ids=["int", "0-d tensor", "generator", "meta tensor"],
)
def test_token_ids_that_cannot_be_read_are_invalid_values_at_save_and_load(
    client: Client, ids: Any, match: str
) -> None:
    model = build_model(CONFIG)
    prompt = document(2 * CHUNK)
    with torch.no_grad():
        past = output_cache(model(prompt[None], use_cache=True))
    with PrefixCache(client, kv_namespace(model), chunk_tokens=CHUNK) as cache:
        with pytest.raises(InvalidValue, match=match):
            save_prefix(cache, ids, past)
        with pytest.raises(InvalidValue, match=match):
            load_prefix(cache, ids, model)
        assert save_prefix(cache, prompt, past) == 2  # the same cache takes good ids


@pytest.mark.parametrize("tp_rank", [-1, True, 1.5, None, "0/x"])
def test_kv_namespace_refuses_a_rank_that_is_not_a_count(tp_rank: Any) -> None:
    model = build_model(CONFIG)
    with pytest.raises(InvalidValue, match=r"tp_rank must be an int >= 0"):
        kv_namespace(model, tp_rank=tp_rank)
    assert kv_namespace(model, tp_rank=3).endswith("/tp3")
    assert kv_namespace(model, tp_rank=np.int64(3)).endswith("/tp3")  # a count from numpy, as elsewhere


def test_kv_namespace_refuses_a_config_dict_as_kv_layout_does() -> None:
    model = build_model(CONFIG)
    with pytest.raises(InvalidValue, match="needs a transformers model or its PretrainedConfig, got dict"):
        kv_namespace(model.config.to_dict())


def test_a_quantized_cache_is_refused_saying_such_caches_cannot_be_saved(client: Client) -> None:
    from transformers import QuantizedCache

    model = build_model(CONFIG)
    prompt = document(2 * CHUNK)
    with torch.no_grad():
        quantized = cache_kwargs(model, QuantizedCache("fp8", model.config))
        past = output_cache(model(prompt[None], use_cache=True, **quantized))
    refused = pytest.raises(InvalidValue, match=r"in a QuantizedCache, .*a quantized cache keeps its keys and values")
    with PrefixCache(client, kv_namespace(model), chunk_tokens=CHUNK) as cache, refused:
        save_prefix(cache, prompt, past)
