"""save_prefix of a cache with linear-attention, state-space or convolution layers, whose state
sums up every earlier token: where they replace attention (Qwen3-Next, Jamba, LFM2) it was an
AttributeError from inside save_prefix; where they run beside it in one layer (Falcon-H1, Zamba),
the keys and values were stored and restored beside an empty state, the next-token logits 0.04
off the recompute's."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import transformers

# The tiny model's sizes of test_transformers.py, on one thread (its autouse fixture, imported to apply here).
from test_transformers import CONFIG, SEED, document, one_thread  # noqa: F401

from mooncake_store import Client, InvalidValue, PrefixCache
from mooncake_store.integrations.transformers import kv_namespace, load_prefix, output_cache, save_prefix

pytestmark = pytest.mark.timeout(180)

CHUNK = 16


def lfm2() -> torch.nn.Module:
    """Convolution layers instead of attention in some layers."""
    config = transformers.Lfm2Config(
        vocab_size=CONFIG["vocab_size"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention"],
    )
    return transformers.Lfm2ForCausalLM(config)


def falcon_h1() -> torch.nn.Module:
    """A state-space mixer beside attention in every layer."""
    config = transformers.FalconH1Config(
        vocab_size=CONFIG["vocab_size"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_chunk_size=16,
        initializer_range=0.2,
    )
    return transformers.FalconH1ForCausalLM(config)


@pytest.mark.parametrize("build", [lfm2, falcon_h1], ids=["conv-instead", "ssm-beside"])
def test_a_cache_with_state_layers_is_refused(client: Client, build: Callable[[], torch.nn.Module]) -> None:
    torch.manual_seed(SEED)
    model = build().eval()
    ids = document(2 * CHUNK + 1)
    with torch.no_grad():
        past = output_cache(model(ids[None], use_cache=True))
    with PrefixCache(client, kv_namespace(model), chunk_tokens=CHUNK) as cache:
        with pytest.raises(
            InvalidValue, match=r"layer 0 of the KV cache is a \w+, which holds a recurrent or convolution"
        ):
            save_prefix(cache, ids, past)
        assert cache.match(ids) == 0  # nothing stored


def test_chunks_of_a_model_with_state_layers_are_not_restored(client: Client) -> None:
    """Chunks stored before save_prefix refused such a cache (the keys and values alone, as it laid
    them out) were restored into a cache whose state was empty: refused before any read."""
    torch.manual_seed(SEED)
    model = falcon_h1().eval()
    ids = document(2 * CHUNK + 1)
    with torch.no_grad():
        past = output_cache(model(ids[None], use_cache=True))
    keys_values = [(layer.keys, layer.values) for layer in past.layers]

    def chunk(i: int) -> torch.Tensor:
        s = slice(i * CHUNK, (i + 1) * CHUNK)
        return torch.stack([torch.stack((k[0, :, s, :], v[0, :, s, :])) for k, v in keys_values]).contiguous()

    with PrefixCache(client, kv_namespace(model), chunk_tokens=CHUNK) as cache:
        assert cache.store(ids, chunk) == 2
        with pytest.raises(InvalidValue, match=r"layer 0 of the KV cache is a \w+, which holds a recurrent"):
            load_prefix(cache, ids, model)
        assert cache.refcounts(ids)[:2] == [0, 0]  # nothing left pinned
