"""The transformers integration on models it cannot handle (review, thirty-third session): each
is an InvalidValue saying why, not torch's own error from deep inside."""

from __future__ import annotations

import pytest
import torch
import transformers

from mooncake_store import Client, InvalidValue, PrefixCache
from mooncake_store.integrations.transformers import kv_namespace, output_cache, save_prefix


def test_kv_namespace_of_a_model_with_weights_on_the_meta_device_asks_for_a_model_id() -> None:
    """accelerate's device_map offload leaves parameters on the meta device: the weights digest
    failed with torch's NotImplementedError ("Cannot copy out of meta tensor")."""
    config = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    with pytest.raises(InvalidValue, match=r"meta device .* model_id="):
        kv_namespace(model)
    assert kv_namespace(model, model_id="tiny-llama").startswith("tiny-llama/")


def test_save_prefix_of_a_cache_whose_keys_and_values_differ_is_refused(client: Client) -> None:
    """DeepSeek-V3's cache (multi-head latent attention) holds keys and values of different head
    dims: save_prefix failed inside torch.stack with a bare RuntimeError."""
    config = transformers.DeepseekV3Config(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=8,
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    ids = torch.arange(40)
    with torch.no_grad():
        past = output_cache(model(ids[None], use_cache=True))
    cache = PrefixCache(client, "s33-mla/f32/L2/kv4/d16/tp0", chunk_tokens=16)
    try:
        with pytest.raises(InvalidValue, match=r"keys and values are not alike \(layer 0: keys \(1, "):
            save_prefix(cache, ids, past)
        assert cache.match(ids) == 0  # nothing was stored
    finally:
        cache.close()


def test_one_checkpoint_under_another_rope_is_another_kv_namespace(client: Client) -> None:
    """The cached keys are stored after the rotation: one checkpoint loaded with another rope_theta
    (or a rope scaling that stretches its context) computes other keys for the same prompt. Only
    the weights and the layout were digested, so both got one namespace and load_prefix of one
    restored the other's keys, silently wrong (review, thirty-fourth session)."""
    from mooncake_store.integrations.transformers import load_prefix

    chunk = 8
    cfg = {
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    torch.manual_seed(0)
    a = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    b_cfg = transformers.LlamaConfig(**cfg, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    b = transformers.LlamaForCausalLM(b_cfg).eval()
    b.load_state_dict(a.state_dict())  # the same checkpoint
    prompt = torch.arange(3 * chunk + 1) % 100
    with torch.no_grad():
        past_a = output_cache(a(prompt[None], use_cache=True))
    assert kv_namespace(a) != kv_namespace(b)
    cache_a = PrefixCache(client, kv_namespace(a), chunk_tokens=chunk)
    cache_b = PrefixCache(client, kv_namespace(b), chunk_tokens=chunk)
    try:
        save_prefix(cache_a, prompt, past_a)
        assert load_prefix(cache_b, prompt, b)[0] == 0
        assert load_prefix(cache_a, prompt, a)[0] == 3 * chunk  # its own still restores
    finally:
        cache_a.close()
        cache_b.close()
