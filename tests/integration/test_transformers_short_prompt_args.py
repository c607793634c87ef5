"""load_prefix checked its arguments only once a prompt held a chunk: for a prompt shorter than
one (or a max_tokens below one), a bad dtype=, device= or config= returned (0, None), and an
engine's misconfiguration went unseen until a longer prompt came."""

from __future__ import annotations

from typing import Any

import pytest

# The tiny model of test_transformers.py, on one thread (its autouse fixture, imported to apply here).
from test_transformers import CHUNK, CONFIG, build_model, document, one_thread  # noqa: F401

from mooncake_store import Client, InvalidValue, MooncakeError, PrefixCache
from mooncake_store.integrations.transformers import kv_namespace, load_prefix

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "nonsense"}, r"not a torch dtype .*'nonsense'"),
        ({"device": "banana"}, r"device='banana'.*not a torch device"),
        ({"model": None, "config": {"num_hidden_layers": 2}}, r"needs a transformers model or its PretrainedConfig"),
    ],
    ids=["dtype", "device", "config"],
)
@pytest.mark.parametrize("short", ["prompt", "max_tokens"])
def test_bad_arguments_are_refused_whatever_the_prompt_length(
    client: Client, kwargs: dict[str, Any], match: str, short: str
) -> None:
    model = build_model(CONFIG)
    args: dict[str, Any] = {"model": model, **kwargs}
    ids, limit = (document(CHUNK - 1), None) if short == "prompt" else (document(3 * CHUNK), CHUNK - 1)
    with PrefixCache(client, kv_namespace(model), chunk_tokens=CHUNK) as cache:
        with pytest.raises(InvalidValue, match=match):
            load_prefix(cache, ids, args.pop("model"), max_tokens=limit, **args)
        assert load_prefix(cache, ids, model, max_tokens=limit) == (0, None)  # good arguments: a miss


@pytest.mark.parametrize("output", [("logits", "cache"), {"logits": 1}, None], ids=["tuple", "dict", "none"])
def test_output_cache_refuses_an_output_without_a_cache_by_name(output: Any) -> None:
    """A return_dict=False tuple (or anything else without a cache) was an AttributeError from
    inside output_cache, which said nothing of what to pass."""
    from mooncake_store.integrations.transformers import output_cache

    with pytest.raises(InvalidValue, match=r"use_cache=True and return_dict=True"):
        output_cache(output)


def test_a_closed_cache_is_refused_whatever_the_prompt_length(client: Client) -> None:
    """load_prefix on a closed PrefixCache answered a prompt shorter than a chunk with a miss,
    (0, None), and refused only longer ones: an engine that closed its cache too early saw misses."""
    model = build_model(CONFIG)
    cache = PrefixCache(client, kv_namespace(model), chunk_tokens=CHUNK)
    cache.close()
    for ids in (document(CHUNK - 1), document(3 * CHUNK)):
        with pytest.raises(MooncakeError, match="PrefixCache is closed"):
            load_prefix(cache, ids, model)
