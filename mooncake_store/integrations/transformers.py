"""Hugging Face transformers integration: save a prompt's KV cache into a PrefixCache and restore
the longest stored prefix of a new prompt as a ``DynamicCache``, so only the suffix is prefilled.

::

    from mooncake_store.integrations.transformers import save_prefix, load_prefix, cache_kwargs
    save_prefix(cache, input_ids, past_key_values)          # every full chunk of input_ids (1-D ids)
    num_tokens, past = load_prefix(cache, input_ids, model) # (0, None) when nothing matches
    out = model(input_ids[num_tokens:][None], **cache_kwargs(model, past), use_cache=True)

Needs the ``hf`` extra (``pip install 'mooncake-store[hf]'``: torch and transformers). Works with
transformers 4.56+ and 5.x: their caches are read through ``cache.layers[i].keys/values`` (4.56+),
``cache.key_cache/value_cache`` (older 4.x) or the legacy tuple of (key, value) per layer, and
built with ``DynamicCache(config=...)`` (or ``DynamicCache()``) plus ``update(k, v, layer)``,
which every one of those versions has. transformers 5.x renamed the forward argument
``past_key_values`` to ``cache``; :func:`cache_kwargs` picks the name the model takes.

**Chunk layout.** One object per chunk holds every layer's K and V for the chunk's tokens, as
one C-contiguous tensor of shape ``(num_layers, 2, num_kv_heads, chunk_tokens, head_dim)`` in the
model's dtype (batch 1). One object per chunk rather than one per layer: a restore of N chunks is
N objects instead of 2·L·N, so the index records, the match chain, the pins and the per-object
costs of a read (lookup entry, allocation, checksum, a transfer) are divided by 2·L, and for the
chunk sizes that matter (256 tokens × all layers = MiBs) each transfer is large enough to run at
copy bandwidth. ``benchmarks/prefix.py`` measures both layouts. Per-layer objects would pay off
only for an engine that overlaps loading layer l+1 with computing layer l; transformers needs
the whole cache before the forward pass.

The namespace must name the layout (model, dtype, layers, KV heads, head dim, TP rank):
:func:`kv_namespace` builds one from a model.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from typing import Any

import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised by the demo's message
    raise ImportError(
        "mooncake_store.integrations.transformers needs torch and transformers: "
        "pip install 'mooncake-store[hf]' (CPU torch is enough)"
    ) from exc

from mooncake_store.client.buffers import as_source
from mooncake_store.client.prefix import PrefixCache
from mooncake_store.client.prefix_hash import MAX_NAMESPACE_BYTES, as_token_array, check_namespace
from mooncake_store.errors import DtypeMismatch, GpuUnavailable, InvalidValue
from mooncake_store.types import as_count

__all__ = ["cache_kwargs", "kv_layout", "kv_namespace", "load_prefix", "output_cache", "save_prefix"]


def _text_config(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", model_or_config)
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def kv_layout(model_or_config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a causal LM or its config."""
    cfg = _text_config(model_or_config)
    try:
        layers = int(cfg.num_hidden_layers)
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    except (AttributeError, TypeError, ValueError) as exc:  # a dict (config.to_dict()), a tokenizer, ...
        raise InvalidValue(
            f"kv_layout needs a transformers model or its PretrainedConfig, got {type(cfg).__name__}: {exc}"
        ) from None
    return layers, kv_heads, head_dim


def kv_namespace(model: Any, *, model_id: str | None = None, tp_rank: int = 0) -> str:
    """A PrefixCache namespace naming the model and its KV layout, e.g.
    ``meta-llama/Llama-3-8B@3f9a1c0e52d7/bfloat16/L32/kv8/d128/tp0``. ``model_id``, when given,
    names the weights as it is. Otherwise the model's name (``config._name_or_path``, else its
    type) comes with a digest of its weights and of its config (all but the fields that cannot
    change a cached key or value: _kv_settings): two checkpoints saved in turn under one path, an
    adapter that keeps its base model's name, or one checkpoint run with another ``rope_theta``,
    ``rope_scaling`` (its cached keys are stored after the rotation), ``rms_norm_eps`` or
    ``hidden_act`` must not restore each other's KV caches."""
    if model_id is not None and not isinstance(model_id, str):
        raise InvalidValue(f"model_id must be text naming the weights, got {type(model_id).__name__} {model_id!r:.80}")
    # Pasted into the namespace as given, -1, True, 1.5, None and "0/x" (a path segment more) made
    # namespaces no other rank's matched, with no word.
    rank = as_count(tp_rank)  # a numpy integer too, as counts are taken everywhere
    if rank is None or rank < 0:
        raise InvalidValue(f"tp_rank must be an int >= 0 (this process's tensor-parallel rank), got {tp_rank!r:.40}")
    # First: a dict (config.to_dict()) is refused as kv_layout refuses it, not an AttributeError.
    layers, kv_heads, head_dim = kv_layout(model)
    cfg = _text_config(model)
    name = model_id
    if not name:
        named = getattr(getattr(model, "config", None), "_name_or_path", "") or cfg.model_type
        name = f"{_short_name(named)}@{_weights_digest(model, extra=_kv_settings(cfg))}"
    dtype = str(getattr(model, "dtype", "float32")).removeprefix("torch.")
    layout = f"/{dtype}/L{layers}/kv{kv_heads}/d{head_dim}/tp{rank}"
    given = len(model_id.encode(errors="replace")) if model_id else 0
    if given + len(layout) > MAX_NAMESPACE_BYTES:
        # Taken as given, a long one made a namespace the PrefixCache then refused, far from here.
        raise InvalidValue(
            f"model_id is {given} B of UTF-8; with the KV layout after it ({layout!r}) a namespace has "
            f"room for {MAX_NAMESPACE_BYTES - len(layout)} B of it (a PrefixCache namespace holds at most "
            f"{MAX_NAMESPACE_BYTES} B)"
        )
    return check_namespace(name + layout)  # a model_id with a control character fails here, not later


#: A model name longer than this (a deep local path) keeps its tail and a digest of the whole:
#: a namespace holds at most 256 B, and the layout and weights digest follow the name.
_MAX_NAME_CHARS = 96


def _short_name(name: str) -> str:
    if len(name.encode()) <= _MAX_NAME_CHARS:
        return name
    digest = hashlib.blake2b(name.encode(errors="replace"), digest_size=6).hexdigest()
    # The tail is cut by bytes, not characters: 48 characters of another script took up to 192 B,
    # and the namespace then passed the 256 B a PrefixCache takes.
    tail = name.encode(errors="replace")[-(_MAX_NAME_CHARS // 2) :].decode(errors="ignore")
    return f"...{tail}#{digest}"


#: Config fields that cannot change a cached key or value: names, token ids, what a forward pass
#: returns, how attention is computed (the same numbers by another kernel), generation defaults.
#: Every other field is digested (kv_namespace): a field missed there restores a model's cache
#: into another's, silently wrong, while one digested needlessly costs only hits.
_NOT_KV_FIELDS = frozenset(
    {
        "_name_or_path", "_commit_hash", "architectures", "transformers_version", "model_type", "dtype",
        "torch_dtype", "use_bfloat16", "use_cache", "return_dict", "output_attentions",
        "output_hidden_states", "output_router_logits", "torchscript", "id2label", "label2id",
        "problem_type", "finetuning_task", "tokenizer_class", "prefix", "task_specific_params",
        "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
        "_attn_implementation", "_attn_implementation_autoset", "attn_implementation",
        "_attn_implementation_internal", "max_length", "min_length", "do_sample", "early_stopping",
        "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
        "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
        "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate",
        "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
        "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
        "chunk_size_feed_forward", "tf_legacy_loss", "initializer_range",
    }
)  # fmt: skip


def _kv_settings(cfg: Any) -> bytes:
    """The config's fields that may change a cached key or value, as bytes for the digest: the
    same weights under another ``rope_theta`` or ``rope_scaling`` (keys are cached after the
    rotation), ``rms_norm_eps`` (in layer 0's keys already) or ``hidden_act`` (in every later
    layer's) cache other KV for the same prompt."""
    fields = cfg.to_dict() if callable(getattr(cfg, "to_dict", None)) else dict(vars(cfg))
    settings = {k: v for k, v in fields.items() if k not in _NOT_KV_FIELDS}
    try:
        return json.dumps(settings, sort_keys=True, default=str).encode()
    except (TypeError, ValueError) as exc:  # a dict of int and str keys cannot be sorted, say
        raise InvalidValue(f"the model's config cannot be digested for kv_namespace ({exc}): pass model_id=") from None


def _weights_digest(model: Any, *, per_tensor: int = 64, extra: bytes = b"") -> str:
    """A short digest of every parameter's name and shape and of ``per_tensor`` values spread over
    each: two models that differ in any layer (a fine-tune of the top layers, a merged LoRA) get
    different digests, and it stays cheap for any model size (one small gather per tensor). Only
    the first few values of the first few tensors counted once, so a model tuned past layer 0
    restored its base model's KV caches."""
    digest = hashlib.blake2b(digest_size=6)
    digest.update(extra)
    named = getattr(model, "named_parameters", None)
    with torch.no_grad():
        for name, param in named() if callable(named) else ():
            if getattr(param, "is_meta", False):
                # Offloaded (accelerate's device_map) or not loaded yet: no values to read, and a
                # digest of names and shapes alone would tell no fine-tune from its base model.
                raise InvalidValue(
                    f"parameter {name!r} of the model is on the meta device (offloaded, or not loaded): its "
                    "weights cannot be digested to name the model; pass kv_namespace(model, model_id=...) "
                    "naming these weights"
                )
            flat = param.detach().reshape(-1)
            step = max(1, flat.numel() // per_tensor)
            digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
            digest.update(flat[::step][:per_tensor].float().cpu().numpy().tobytes())
    return digest.hexdigest()


def cache_kwargs(model: Any, past: Any) -> dict[str, Any]:
    """``{"cache": past}`` for models whose forward takes ``cache`` (transformers 5.x), else
    ``{"past_key_values": past}``."""
    params = inspect.signature(model.forward).parameters
    return {"cache": past} if "cache" in params else {"past_key_values": past}


def output_cache(output: Any) -> Any:
    """The cache a forward pass returned (``output.cache`` on 5.x, ``past_key_values`` before)."""
    if isinstance(output, dict) and "cache" in output:
        return output["cache"]
    cache = getattr(output, "cache", None)
    if cache is None:
        cache = getattr(output, "past_key_values", None)
    if cache is None:
        # A tuple (return_dict=False) lays its fields out by the model's own order, which names
        # none of them: an AttributeError from here said nothing of what to pass.
        raise InvalidValue(
            f"the forward pass's output is a {type(output).__name__} with no cache in it: call the model "
            "with use_cache=True and return_dict=True (the default), or pass the cache itself"
        )
    return cache


def _refuse_state_layers(past: Any) -> None:
    """A linear-attention, state-space or convolution layer (Qwen3-Next, Jamba, LFM2), or one that
    runs such a mixer beside attention (Falcon-H1, Zamba), holds a state that sums up every earlier
    token: no prefix of such a model can be restored from per-token KV chunks. The first met as an
    AttributeError at a save; the second had its keys and values stored, and restored beside an
    empty state, silently wrong."""
    for i, layer in enumerate(getattr(past, "layers", ())):
        if not hasattr(layer, "keys") or hasattr(layer, "recurrent_states") or hasattr(layer, "conv_states"):
            raise InvalidValue(
                f"layer {i} of the KV cache is a {type(layer).__name__}, which holds a recurrent or "
                "convolution state (instead of or beside per-token keys and values): a model with such "
                "layers cannot restore a prefix from stored KV chunks"
            )


def _layers(past: Any) -> list[tuple[Any, Any]]:
    """(key, value) tensors per layer, each (batch, kv_heads, seq, head_dim), for any cache form."""
    if hasattr(past, "layers"):  # transformers 4.56+ and 5.x
        _refuse_state_layers(past)
        layers = [(layer.keys, layer.values) for layer in past.layers]
    elif hasattr(past, "key_cache"):  # earlier 4.x DynamicCache
        layers = list(zip(past.key_cache, past.value_cache, strict=True))
    elif isinstance(past, tuple | list):  # legacy tuple of (key, value) per layer
        layers = [(kv[0], kv[1]) for kv in past]
    else:
        raise InvalidValue(f"cannot read a KV cache of type {type(past).__name__}")
    # Checked here, not met as an AttributeError or IndexError further on: a DynamicCache(config=...)
    # no forward pass has filled holds None per layer, a legacy tuple may hold 3-D tensors.
    for i, (k, v) in enumerate(layers):
        for what, t in (("keys", k), ("values", v)):
            if len(getattr(t, "shape", ())) != 4:
                shape = tuple(t.shape) if hasattr(t, "shape") else type(t).__name__
                raise InvalidValue(
                    f"layer {i}'s {what} are {shape} in a {type(past).__name__}, not a (batch, kv_heads, "
                    "seq, head_dim) tensor: pass the cache a forward pass over input_ids returned (a "
                    "quantized cache keeps its keys and values packed, and a layer that shares another's "
                    "KV, num_kv_shared_layers, keeps none: neither can be saved)"
                )
    return layers


def _held_from_start(past: Any, layers: list[tuple[Any, Any]]) -> list[int]:
    """Per layer, how many tokens from the first its keys hold, in order from slot 0. The length
    of its tensor alone told neither case apart: a sliding-window layer that has seen more tokens
    than it keeps (a prompt shorter than the window, then generated tokens past it) is as long as
    the prompt or longer, but starts at a later token; a static layer is as long as its capacity,
    written or not. Where a layer counts the tokens it has seen (``get_seq_length``, transformers
    4.56+), it holds them from slot 0 only if there are no more of them than slots."""
    counted = [getattr(layer, "get_seq_length", None) for layer in getattr(past, "layers", ())]
    held = []
    for i, (k, _) in enumerate(layers):
        slots = int(k.shape[-2])
        seen = counted[i]() if i < len(counted) and callable(counted[i]) else slots
        seen = int(seen)  # a 0-d tensor on static layers
        held.append(seen if seen <= slots else 0)
    return held


def _token_ids(input_ids: Any) -> np.ndarray:
    """One sequence of ids as the PrefixCache reads them (as_token_array): a batch of one,
    ``(1, n)``, from torch, numpy or nested lists (what tokenizers return) is unwrapped. Read
    here, before save_prefix counts them: an int, a 0-d tensor or a generator was a TypeError from
    len(), and a meta tensor copied out here a NotImplementedError, not the InvalidValue a load gave."""
    ids = input_ids
    shape = getattr(ids, "shape", None)
    if shape is None and isinstance(ids, list | tuple) and ids and isinstance(ids[0], list | tuple):
        shape = (len(ids), len(ids[0]))
    if shape is not None and len(shape) == 2:
        if shape[0] != 1:
            raise InvalidValue(f"input_ids has batch {shape[0]}; pass one sequence (1-D ids)")
        ids = ids[0]
    return as_token_array(ids)


def _check_cache(what: str, cache: object) -> None:
    if not isinstance(cache, PrefixCache):  # a Client, say: an AttributeError from deep inside
        raise InvalidValue(f"{what} needs a PrefixCache (PrefixCache(client, namespace)), got {type(cache).__name__}")
    # Open, before any other answer: a closed cache answered a load of a prompt shorter than a
    # chunk with a miss, as if nothing were stored.
    cache._check_open()


def save_prefix(cache: PrefixCache, input_ids: Any, past_key_values: Any) -> int:
    """Store every full chunk of ``input_ids`` from the KV cache a forward pass over them returned.
    Chunks already stored are neither copied out nor written. Returns the chunks written."""
    _check_cache("save_prefix", cache)
    ids = _token_ids(input_ids)
    layers = _layers(past_key_values)
    if not layers:
        raise InvalidValue("the KV cache has no layers")
    if layers[0][0].shape[0] != 1:
        raise InvalidValue(f"the KV cache has batch {layers[0][0].shape[0]}; save one sequence at a time")
    # Every layer must hold every token of input_ids from the first: a sliding-window layer keeps
    # only its last ones, and chunk 0 cut from it was other tokens' KV, stored without a word.
    held = sorted(set(_held_from_start(past_key_values, layers)))
    if held[0] < len(ids):
        shown = held[0] if len(held) == 1 else f"{held[0]} to {held[-1]} (by layer)"
        raise InvalidValue(
            f"the KV cache holds {shown} tokens from the prompt's start but input_ids has {len(ids)}: "
            "every layer must hold every token of input_ids (a sliding-window layer that has seen more "
            "tokens than its window, prompt and generated ones, keeps only its last ones; a static "
            "cache holds only the tokens a forward pass wrote into it)"
        )
    # One (kv_heads, seq, head_dim) shape for every key and value: a cache whose keys and values
    # differ (multi-head latent attention, as DeepSeek-V3's) failed inside torch.stack, and
    # kv_layout's namespace could never match it at a load.
    shapes = {(tuple(k.shape[1:2]) + tuple(k.shape[3:]), tuple(v.shape[1:2]) + tuple(v.shape[3:])) for k, v in layers}
    if len(shapes) > 1 or any(ks != vs for ks, vs in shapes):
        k, v = layers[0]
        raise InvalidValue(
            f"the KV cache's keys and values are not alike (layer 0: keys {tuple(k.shape)}, values "
            f"{tuple(v.shape)}; {len(shapes)} layout(s) over {len(layers)} layers): only caches whose every key "
            "and value is (batch, kv_heads, seq, head_dim) of one shape can be saved (a multi-head latent "
            "attention cache, as DeepSeek-V3's, is not)"
        )
    size = cache.chunk_tokens

    def chunk(i: int) -> Any:
        s = slice(i * size, (i + 1) * size)
        with torch.no_grad():
            out = torch.stack([torch.stack((k[0, :, s, :], v[0, :, s, :])) for k, v in layers])
        return out.detach().to("cpu").contiguous()

    return cache.store(ids, chunk)


#: What a load whose chunks are not the layout it asks for is told to pass.
_PASS_WHAT_WAS_SAVED = "pass the model, or the dtype= and config= they were saved with"


def _verified_chunks(cache: PrefixCache, ids: Any, count: int, shape: tuple[int, ...], dtype: Any) -> int:
    """How many of the first ``count`` chunks of ``ids`` are stored with this load's layout (one
    index round trip, no lease). get_into checks bytes only: a chunk of another layout with as
    many bytes (another config under a hand-written namespace, or a chain extended by one) was
    restored as KV without a word, and one larger than the staging failed with the bare sizes.
    A first chunk of another layout is an error; a later one ends the prefix there."""
    keys = cache.keys(ids, include_tail=False)[:count]
    want = (as_source(torch.empty(0, dtype=dtype)).dtype, shape)
    metas = cache.client.index.lookup(keys, lease_ms=0).objects if keys else []
    for i, meta in enumerate(metas):
        if meta is None:
            return i
        if (meta.dtype, tuple(meta.shape)) != want:
            if i == 0:
                raise InvalidValue(
                    f"the stored KV chunks are {meta.dtype} of shape {tuple(meta.shape)}, but this load asked for "
                    f"{want[0]} chunks of shape {shape} (layers, K/V, KV heads, tokens, head dim): "
                    f"{_PASS_WHAT_WAS_SAVED}"
                )
            return i
    return len(metas)


def _load_device(model: Any, device: Any) -> Any:
    """Where the restored cache goes; a CUDA device torch cannot use is refused before any read
    (torch's own AssertionError came after every chunk had been transferred)."""
    try:
        target = torch.device(device if device is not None else (model.device if model is not None else "cpu"))
    except (RuntimeError, TypeError) as exc:  # torch's own words for "banana"
        raise InvalidValue(f"load_prefix(device={device!r:.40}): not a torch device: {exc}") from None
    if target.type == "cuda" and not torch.cuda.is_available():
        raise GpuUnavailable(f"load_prefix(device={str(target)!r}): this torch build or machine has no CUDA device")
    if target.type == "cuda" and target.index is not None and target.index >= torch.cuda.device_count():
        # As for no device at all: torch's own error came at the first .to(), after every read.
        raise GpuUnavailable(
            f"load_prefix(device={str(target)!r}): torch sees {torch.cuda.device_count()} CUDA device(s) "
            f"(0..{torch.cuda.device_count() - 1})"
        )
    return target


def _load_dtype(model: Any, config: Any, dtype: Any) -> Any:
    """The dtype of the chunks a load asks for: ``dtype``, else the model's, else the config's."""
    if dtype is None and model is not None:
        dtype = model.dtype
    elif dtype is None:
        # transformers 5 names it dtype and warns on any read of torch_dtype, even where dtype is
        # None (a config that names none); 4.x names it torch_dtype.
        named = "dtype" if hasattr(config, "dtype") else "torch_dtype"
        dtype = getattr(config, named, None) or torch.float32
    given = dtype
    if isinstance(dtype, str):  # configs may carry "float16"
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidValue(f"load_prefix(dtype=...): not a torch dtype (torch.float16, 'bfloat16', ...): {given!r:.60}")
    return dtype


class _FewerUsable(Exception):
    """Raised from a load's outs(n): only the first ``usable`` of the n matched chunks have the
    layout asked for (a private signal: the load releases its pins, and is made again shorter)."""

    def __init__(self, usable: int) -> None:
        super().__init__(usable)
        self.usable = usable


def load_prefix(
    cache: PrefixCache,
    input_ids: Any,
    model: Any = None,
    *,
    config: Any = None,
    dtype: Any = None,
    device: Any = None,
    max_tokens: int | None = None,
) -> tuple[int, Any]:
    """Restore the longest stored prefix of ``input_ids`` as a ``DynamicCache``.

    Returns ``(num_tokens, cache)``, or ``(0, None)`` when nothing matches. At most
    ``len(input_ids) - 1`` tokens are restored (or ``max_tokens``), so the model always has a
    suffix to compute the next token's logits from. The stored chunks' layout is checked once
    they are matched and pinned (one index round trip; pinned, none can be replaced before it is
    read); the chunks are then read straight into one staging tensor (no intermediate copies)
    and laid out per layer.
    """
    from transformers import DynamicCache

    _check_cache("load_prefix", cache)
    if model is None and config is None:
        raise InvalidValue("load_prefix needs the model (or its config) to know the KV layout")
    wanted = as_count(max_tokens) if max_tokens is not None else None
    if max_tokens is not None and (wanted is None or wanted < 0):
        raise InvalidValue(f"max_tokens must be an int >= 0, got {max_tokens!r:.40}")
    ids = _token_ids(input_ids)
    limit = len(ids) - 1 if wanted is None else min(wanted, len(ids) - 1)
    # Every argument is checked before a prompt too short for a chunk returns: a bad device= or
    # dtype= went unseen on short prompts, and failed only once a longer one came.
    layers, kv_heads, head_dim = kv_layout(model if model is not None else config)
    dtype = _load_dtype(model, config, dtype)
    device = _load_device(model, device)
    cfg = model.config if model is not None else config
    try:
        past = DynamicCache(config=cfg)
    except TypeError:  # before 4.56
        past = DynamicCache()
    # Built before any read: chunks of such a model (stored before save_prefix refused them) would
    # be restored beside an empty state.
    _refuse_state_layers(past)
    if limit < cache.chunk_tokens:
        return 0, None
    size = cache.chunk_tokens
    shape = (layers, 2, kv_heads, size, head_dim)
    staging: list[Any] = []

    def outs(n: int) -> list[Any]:
        # Matched and pinned: a chunk checked now is the one read (checked before the load, one
        # replaced in between by another layout of as many bytes was restored as this model's KV).
        usable = _verified_chunks(cache, ids, n, shape, dtype)
        if usable < n:
            raise _FewerUsable(usable)
        staging[:] = [torch.empty((n, *shape), dtype=dtype)]
        return list(staging[0].unbind(0))

    chunks = limit // size
    for _ in range(3):  # a later chunk of another layout ends the prefix there: loaded again, shorter
        try:
            with cache.load(ids, outs=outs, include_tail=False, max_tokens=chunks * size) as hit:
                n = hit.num_chunks
            break
        except _FewerUsable as fewer:
            chunks = fewer.usable
        except DtypeMismatch as exc:  # a guard: the check above runs on the pinned chunks first
            raise InvalidValue(
                f"the stored KV chunks are {exc.stored}, but this load asked for {exc.out} chunks: "
                f"{_PASS_WHAT_WAS_SAVED}"
            ) from None
    else:
        n = 0  # the chain kept changing under the loads: a miss
    if n == 0:
        return 0, None
    data = staging[0][:n]
    for layer in range(layers):
        k = data[:, layer, 0].transpose(0, 1).reshape(1, kv_heads, n * size, head_dim)
        v = data[:, layer, 1].transpose(0, 1).reshape(1, kv_heads, n * size, head_dim)
        past.update(k.to(device), v.to(device), layer)
    return n * size, past
