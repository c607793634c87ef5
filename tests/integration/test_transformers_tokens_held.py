"""save_prefix and the tokens a cache holds from the prompt's start.

- A sliding-window cache that generated past its window after a prompt shorter than the window
  holds as many tokens as the prompt or more, but its first slots hold later tokens: it was saved
  as the prompt's KV, and restored 2.6 off the recompute's logits.
- A StaticCache is as long as its capacity: ids past the tokens a forward pass wrote were saved
  as chunks of zeros."""

from __future__ import annotations

import pytest
import torch
import transformers

# The tiny model of test_transformers.py, on one thread (its autouse fixture, imported to apply here).
from test_transformers import CONFIG, SEED, build_model, document, one_thread  # noqa: F401

from mooncake_store import Client, InvalidValue, PrefixCache
from mooncake_store.integrations.transformers import (
    cache_kwargs,
    kv_namespace,
    load_prefix,
    output_cache,
    save_prefix,
)

pytestmark = pytest.mark.timeout(180)

CHUNK = 16


def sliding_model(window: int) -> torch.nn.Module:
    torch.manual_seed(SEED)
    config = transformers.MistralConfig(**CONFIG, sliding_window=window)
    return transformers.MistralForCausalLM(config).eval()


def last_logits(model: torch.nn.Module, ids: torch.Tensor, past: object = None) -> torch.Tensor:
    with torch.no_grad():
        kw = cache_kwargs(model, past) if past is not None else {}
        return model(ids[None], use_cache=True, **kw).logits[0, -1]


def test_a_sliding_window_cache_that_generated_past_its_window_is_refused(client: Client) -> None:
    model = sliding_model(window=48)
    ids = document(40)  # within the window: after the prefill every layer holds all 40 tokens
    with torch.no_grad():
        out = model(ids[None], use_cache=True)
        past = output_cache(out)
        nxt = out.logits[0, -1].argmax()
        for _ in range(20):  # 60 tokens seen: the window keeps the last 47, from token 13
            out = model(nxt.view(1, 1), use_cache=True, **cache_kwargs(model, past))
            past = output_cache(out)
            nxt = out.logits[0, -1].argmax()
    assert past.layers[0].keys.shape[-2] >= len(ids)  # as long as the prompt: its length tells nothing
    with PrefixCache(client, kv_namespace(model), chunk_tokens=CHUNK) as cache:
        with pytest.raises(InvalidValue, match=r"holds 0 tokens from the prompt's start but input_ids has 40"):
            save_prefix(cache, ids, past)
        assert cache.match(ids) == 0  # nothing stored
        # The prompt's own prefill is saved, and restores exactly what a recompute computes.
        with torch.no_grad():
            assert save_prefix(cache, ids, output_cache(model(ids[None], use_cache=True))) == 2
        prompt = torch.cat([ids, document(45)[40:]])
        num_tokens, restored = load_prefix(cache, prompt, model)
        assert num_tokens == 2 * CHUNK
        assert torch.allclose(last_logits(model, prompt[num_tokens:], restored), last_logits(model, prompt), atol=1e-5)


def test_a_static_cache_is_saved_up_to_the_tokens_written_only(client: Client) -> None:
    model = build_model(CONFIG)
    ids = document(40)
    static = transformers.StaticCache(config=model.config, max_cache_len=128)
    with torch.no_grad():
        past = output_cache(model(ids[None], use_cache=True, **cache_kwargs(model, static)))
    longer = torch.cat([ids, torch.arange(30)])
    with PrefixCache(client, kv_namespace(model), chunk_tokens=CHUNK) as cache:
        with pytest.raises(InvalidValue, match=r"holds 40 tokens from the prompt's start but input_ids has 70"):
            save_prefix(cache, longer, past)
        assert cache.match(longer) == 0
        assert save_prefix(cache, ids, past) == 2
        prompt = torch.cat([ids, torch.tensor([3, 4, 5])])
        num_tokens, restored = load_prefix(cache, prompt, model)
        assert num_tokens == 2 * CHUNK
        assert torch.allclose(last_logits(model, prompt[num_tokens:], restored), last_logits(model, prompt), atol=1e-5)
