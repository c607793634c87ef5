"""The transformers integration: a prefix stored by one process, restored by another, continues
exactly as a full recompute would."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import transformers

from mooncake_store import Client, GpuUnavailable, InvalidValue, LocalCluster, ObjectPinned, PrefixCache
from mooncake_store.integrations.transformers import (
    cache_kwargs,
    kv_namespace,
    load_prefix,
    output_cache,
    save_prefix,
)

pytestmark = pytest.mark.timeout(180)

CONFIG = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "initializer_range": 0.2,  # larger than default: clearer argmax margins in a random model
}
CHUNK = 32
SEED = 1234


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The model runs on one thread here and in the storing process. MKL may use fewer threads than
    asked when the machine is busy (its dynamic mode), which splits a matmul's sums differently:
    under the full suite's load the restored logits once came out 1.4e-3 from the recompute's, in
    a model whose large initial weights amplify every rounding, against the 1e-5 this test holds
    them to (and meets on one thread, or on two on a quiet machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def build_model(config: dict) -> torch.nn.Module:
    torch.manual_seed(SEED)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()


def document(n: int) -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (n,), generator=torch.Generator().manual_seed(7))


def greedy(model: torch.nn.Module, ids: torch.Tensor, past: object, steps: int) -> tuple[torch.Tensor, list[int]]:
    """Next-token logits after ``ids`` (on top of ``past``), and a greedy continuation."""
    with torch.no_grad():
        kw = cache_kwargs(model, past) if past is not None else {}
        out = model(ids[None], use_cache=True, **kw)
        logits = out.logits[0, -1].clone()
        cache = output_cache(out)
        tokens = []
        nxt = logits.argmax()
        for _ in range(steps):
            tokens.append(int(nxt))
            out = model(nxt.view(1, 1), use_cache=True, **cache_kwargs(model, cache))
            cache = output_cache(out)
            nxt = out.logits[0, -1].argmax()
    return logits, tokens


STORER = textwrap.dedent(
    """
    import json, sys, torch, transformers
    from mooncake_store import connect, PrefixCache
    from mooncake_store.integrations.transformers import save_prefix, output_cache, kv_namespace
    url, ns, config, seed, chunk, n = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), *map(int, sys.argv[4:])
    torch.set_num_threads(1)  # as the test does: sums split the same way whatever the machine's load
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    ids = torch.randint(0, config["vocab_size"], (n,), generator=torch.Generator().manual_seed(7))
    client = connect(url, namespace=ns)
    cache = PrefixCache(client, kv_namespace(model), chunk_tokens=chunk)
    with torch.no_grad():
        out = model(ids[None], use_cache=True)
    print(json.dumps({"written": save_prefix(cache, ids, output_cache(out)), "namespace": cache.namespace}))
    cache.close(); client.close()
    """
)


def test_restored_in_another_process_matches_recompute(client: Client, cluster: LocalCluster) -> None:
    doc_tokens = 10 * CHUNK + 11  # 10 full chunks and a tail that is not stored
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            STORER,
            cluster.redis_url,
            cluster.namespace,
            json.dumps(CONFIG),
            str(SEED),
            str(CHUNK),
            str(doc_tokens),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    stored = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stored["written"] == 10

    model = build_model(CONFIG)
    cache = PrefixCache(client, kv_namespace(model), chunk_tokens=CHUNK)
    assert cache.namespace == stored["namespace"]
    question = torch.tensor([5, 17, 256, 3, 99, 42, 7, 8, 600, 12])
    prompt = torch.cat([document(doc_tokens), question])

    num_tokens, past = load_prefix(cache, prompt, model)
    assert num_tokens == 10 * CHUNK
    restored_logits, restored_tokens = greedy(model, prompt[num_tokens:], past, 16)
    full_logits, full_tokens = greedy(model, prompt, None, 16)

    torch.testing.assert_close(restored_logits, full_logits, rtol=1e-5, atol=1e-5)
    assert restored_tokens == full_tokens
    assert cache.refcounts(prompt)[:10] == [0] * 10  # load_prefix leaves nothing pinned
    cache.close()


def test_nothing_matches_and_nothing_rewritten(client: Client) -> None:
    model = build_model(CONFIG)
    cache = PrefixCache(client, kv_namespace(model), chunk_tokens=CHUNK)
    ids = document(3 * CHUNK)
    assert load_prefix(cache, ids, model) == (0, None)
    with torch.no_grad():
        out = model(ids[None], use_cache=True)
    assert save_prefix(cache, ids, output_cache(out)) == 3
    assert save_prefix(cache, ids, output_cache(out)) == 0
    # A prompt that is exactly the stored prefix restores all but its last chunk: the model needs
    # at least one token to compute.
    assert load_prefix(cache, ids, model)[0] == 2 * CHUNK
    assert load_prefix(cache, torch.cat([ids, ids[:1]])[None], model)[0] == 3 * CHUNK
    assert load_prefix(cache, ids[: CHUNK - 1], model) == (0, None)
    cache.close()


def test_a_load_with_another_dtype_than_saved_says_what_to_pass(client: Client) -> None:
    """get_into refuses staging of another dtype than the chunks' before any byte lands; the load
    says so in the model's terms, and leaves nothing pinned."""
    model = build_model(CONFIG)
    cache = PrefixCache(client, kv_namespace(model), chunk_tokens=CHUNK)
    ids = document(2 * CHUNK + 1)
    with torch.no_grad():
        save_prefix(cache, ids, output_cache(model(ids[None], use_cache=True)))
    with pytest.raises(
        InvalidValue, match=r"stored KV chunks are <f4 of shape .*, but this load asked for <f2 chunks .*: pass the"
    ):
        load_prefix(cache, ids, model, dtype=torch.float16)
    assert cache.refcounts(ids)[:2] == [0, 0]
    assert load_prefix(cache, ids, model)[0] == 2 * CHUNK
    cache.close()


def test_another_model_shares_nothing(client: Client) -> None:
    model = build_model(CONFIG)
    other = build_model({**CONFIG, "num_key_value_heads": 4})
    cache = PrefixCache(client, kv_namespace(model), chunk_tokens=CHUNK)
    ids = document(2 * CHUNK + 1)
    with torch.no_grad():
        save_prefix(cache, ids, output_cache(model(ids[None], use_cache=True)))
    assert kv_namespace(other) != kv_namespace(model)
    other_cache = PrefixCache(client, kv_namespace(other), chunk_tokens=CHUNK)
    assert load_prefix(other_cache, ids, other) == (0, None)
    assert load_prefix(cache, ids, model)[0] == 2 * CHUNK
    other_cache.close()
    cache.close()


@pytest.mark.parametrize("window_layers", [1, 2], ids=["hybrid", "all-sliding"])
def test_a_sliding_window_cache_is_refused_not_stored_as_other_tokens(client: Client, window_layers: int) -> None:
    """A sliding-window layer keeps only its last tokens: chunk 0 cut from it was the KV of other
    tokens, stored without a word and restored as the prompt's start (logits 0.08 off the
    recompute), or a bare torch error when the chunk came out short."""
    torch.manual_seed(SEED)
    config = transformers.Qwen2Config(
        **{k: v for k, v in CONFIG.items() if k != "initializer_range"},
        use_sliding_window=True,
        sliding_window=24,
        max_window_layers=2 - window_layers,  # layers from this index on slide
    )
    model = transformers.Qwen2ForCausalLM(config).eval()
    cache = PrefixCache(client, kv_namespace(model), chunk_tokens=16)
    ids = document(40)
    with torch.no_grad():
        past = output_cache(model(ids[None], use_cache=True))
    with pytest.raises(InvalidValue, match="but input_ids has 40: every layer must hold every token"):
        save_prefix(cache, ids, past)
    assert cache.match(ids) == 0  # nothing stored
    cache.close()


def test_two_checkpoints_under_one_name_share_nothing(client: Client) -> None:
    """The namespace named a model by its path alone: two checkpoints saved in turn to one
    directory (or an adapter keeping its base model's name) restored each other's KV caches, with
    logits 0.23 off. Its weights' digest now comes with the name; a model_id is taken as given."""
    first = build_model(CONFIG)
    torch.manual_seed(SEED + 1)
    second = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    for model in (first, second):
        model.config._name_or_path = "/checkpoints/run-7"
    assert kv_namespace(first) != kv_namespace(second)
    assert kv_namespace(first).startswith("/checkpoints/run-7@") and kv_namespace(first) == kv_namespace(first)
    assert kv_namespace(first, model_id="run-7") == kv_namespace(second, model_id="run-7")  # as the caller says
    cache = PrefixCache(client, kv_namespace(first), chunk_tokens=CHUNK)
    ids = document(2 * CHUNK + 1)
    with torch.no_grad():
        save_prefix(cache, ids, output_cache(first(ids[None], use_cache=True)))
    second_cache = PrefixCache(client, kv_namespace(second), chunk_tokens=CHUNK)
    assert load_prefix(second_cache, ids, second) == (0, None)
    second_cache.close()
    cache.close()


def test_a_model_tuned_past_its_first_layer_gets_its_own_namespace() -> None:
    """The weights' digest covered the first values of the first four tensors only (for Llama the
    embeddings and layer 0's attention): a model tuned in any later layer, a merged LoRA on the
    top layers say, got its base model's namespace and restored its base model's KV caches."""
    base = build_model(CONFIG)
    tuned = build_model(CONFIG)
    with torch.no_grad():
        # A merged LoRA on the last layer's MLP: every value of one late tensor moves a little.
        late = tuned.model.layers[1].mlp.down_proj.weight
        late.add_(1e-3 * torch.randn_like(late))
    assert kv_namespace(tuned) != kv_namespace(base)
    assert kv_namespace(build_model(CONFIG)) == kv_namespace(base)  # the same weights: the same one


def test_a_model_from_a_deep_path_gets_a_namespace_a_cache_takes() -> None:
    """A model loaded from a local path of a few hundred bytes made a namespace PrefixCache refused
    (its limit is 256 B); a long name keeps its tail and a digest of the whole."""
    model = build_model(CONFIG)
    model.config._name_or_path = "/models/" + "very-deep/" * 40 + "llama-tiny"
    other = build_model(CONFIG)
    other.config._name_or_path = "/models/" + "very-deep/" * 39 + "other/llama-tiny"
    assert len(kv_namespace(model).encode()) <= 256
    assert kv_namespace(model).startswith("...") and "/llama-tiny#" in kv_namespace(model)
    assert kv_namespace(model) != kv_namespace(other)


def test_chunks_of_another_layout_with_as_many_bytes_are_not_restored(client: Client) -> None:
    """get_into checks bytes only: under one hand-written namespace, a model with 2 KV heads of
    head dim 16 and one with 4 of head dim 8 have chunks of the same size, and the second restored
    the first's KV as its own without a word (its greedy tokens then differ from a recompute).
    The stored shape is compared first; and a save cannot extend a chain with another layout."""
    small_heads = build_model({**CONFIG, "num_key_value_heads": 4, "num_attention_heads": 8})
    model = build_model(CONFIG)
    cache = PrefixCache(client, "hand-written/tp0", chunk_tokens=CHUNK)
    ids = document(3 * CHUNK + 1)
    with torch.no_grad():
        save_prefix(cache, ids[: 2 * CHUNK + 1], output_cache(model(ids[None, : 2 * CHUNK + 1], use_cache=True)))
        with pytest.raises(InvalidValue, match=r"stored KV chunks are <f4 of shape \(2, 2, 2, 32, 16\)"):
            load_prefix(cache, ids, small_heads)
        assert cache.refcounts(ids)[:2] == [0, 0]  # refused before the load: nothing pinned
        with pytest.raises(InvalidValue, match=r"has shape \(2, 2, 4, 32, 8\), but chunk 0 \(stored before\)"):
            save_prefix(cache, ids, output_cache(small_heads(ids[None], use_cache=True)))
    assert load_prefix(cache, ids, model)[0] == 2 * CHUNK
    cache.close()


def test_token_ids_as_a_batch_of_one_from_numpy_or_lists_are_loaded(client: Client) -> None:
    """Tokenizers return (1, n) ids; load_prefix unwrapped only torch's, so numpy ids or a list of
    lists missed every stored chunk (0, None) while save_prefix refused the same input."""
    model = build_model(CONFIG)
    cache = PrefixCache(client, kv_namespace(model), chunk_tokens=CHUNK)
    ids = document(2 * CHUNK + 1)
    with torch.no_grad():
        save_prefix(cache, ids.numpy()[None], output_cache(model(ids[None], use_cache=True)))
    for given in (ids[None], ids.numpy()[None], [ids.tolist()], ids.tolist()):
        assert load_prefix(cache, given, model)[0] == 2 * CHUNK
    with pytest.raises(InvalidValue, match="max_tokens must be an int >= 0, got -5"):
        load_prefix(cache, ids, model, max_tokens=-5)
    cache.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch has no CUDA device")
def test_a_load_onto_cuda_without_cuda_is_refused_before_any_read(client: Client) -> None:
    """torch's AssertionError ("Torch not compiled with CUDA enabled") came after every chunk had
    been transferred; GpuUnavailable (a MooncakeError) now comes first."""
    model = build_model(CONFIG)
    cache = PrefixCache(client, kv_namespace(model), chunk_tokens=CHUNK)
    ids = document(2 * CHUNK + 1)
    with torch.no_grad():
        save_prefix(cache, ids, output_cache(model(ids[None], use_cache=True)))
    with pytest.raises(GpuUnavailable, match=r"device='cuda'"):
        load_prefix(cache, ids, model, device="cuda")
    cache.close()


def test_a_load_onto_a_cuda_index_torch_lacks_is_refused_before_any_read(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """device="cuda:7" on a one-GPU machine passed the check (CUDA is there) and failed in torch
    at the first .to(), after every chunk had been read. torch's device queries stand in for a
    machine with one GPU; the check runs before the load touches a device."""
    model = build_model(CONFIG)
    cache = PrefixCache(client, kv_namespace(model), chunk_tokens=CHUNK)
    ids = document(2 * CHUNK + 1)
    with torch.no_grad():
        save_prefix(cache, ids, output_cache(model(ids[None], use_cache=True)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    before = client.stat().hits
    with pytest.raises(GpuUnavailable, match=r"device='cuda:7'\): torch sees 1 CUDA device\(s\) \(0\.\.0\)"):
        load_prefix(cache, ids, model, device="cuda:7")
    assert client.stat().hits == before  # nothing was read
    cache.close()


def test_the_layout_is_checked_on_the_pinned_chunks_that_are_then_read(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layout was checked before the load pinned the chunks: another writer replacing the
    chain in between with chunks of another layout and as many bytes had them restored as this
    model's KV (a review made the swap right after the check). The check now runs on the matched,
    pinned chunks, which nobody can remove or replace until the read is done."""
    import mooncake_store.integrations.transformers as integration

    model = build_model(CONFIG)
    cache = PrefixCache(client, kv_namespace(model), chunk_tokens=CHUNK)
    ids = document(2 * CHUNK + 1)
    with torch.no_grad():
        save_prefix(cache, ids, output_cache(model(ids[None], use_cache=True)))
    check = integration._verified_chunks
    replaced: list[str] = []

    def check_then_replace(*args: object) -> int:
        usable = check(*args)  # type: ignore[arg-type]
        for key in cache.keys(ids)[:2]:  # another writer removes the chunks to store its own
            try:
                client.remove(key)
                replaced.append("removed")
            except ObjectPinned:
                replaced.append("pinned")
        return usable

    monkeypatch.setattr(integration, "_verified_chunks", check_then_replace)
    assert load_prefix(cache, ids, model)[0] == 2 * CHUNK
    assert replaced == ["pinned", "pinned"]
    cache.close()


def test_bad_arguments_of_load_and_save_are_invalid_values(client: Client) -> None:
    """A Client for the cache, a dtype torch does not have and a device it cannot parse were an
    AttributeError or torch's RuntimeError; a numpy count for max_tokens was refused."""
    model = build_model(CONFIG)
    cache = PrefixCache(client, kv_namespace(model), chunk_tokens=CHUNK)
    ids = document(2 * CHUNK + 1)
    with torch.no_grad():
        past = output_cache(model(ids[None], use_cache=True))
    with pytest.raises(InvalidValue, match=r"save_prefix needs a PrefixCache .*got Client"):
        save_prefix(client, ids, past)  # type: ignore[arg-type]
    save_prefix(cache, ids, past)
    with pytest.raises(InvalidValue, match=r"load_prefix needs a PrefixCache .*got Client"):
        load_prefix(client, ids, model)  # type: ignore[arg-type]
    with pytest.raises(InvalidValue, match=r"not a torch dtype .*'nonsense'"):
        load_prefix(cache, ids, model, dtype="nonsense")
    with pytest.raises(InvalidValue, match=r"device='banana'.*not a torch device"):
        load_prefix(cache, ids, model, device="banana")
    assert load_prefix(cache, ids, model, dtype="torch.float32")[0] == 2 * CHUNK
    assert load_prefix(cache, ids, model, max_tokens=np.int64(CHUNK))[0] == CHUNK
    assert cache.refcounts(ids)[:2] == [0, 0]
    cache.close()
