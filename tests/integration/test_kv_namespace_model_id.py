"""kv_namespace(model, model_id=...) takes the id as given, and so refuses at once one that no
PrefixCache namespace could hold: a 3000-character id made a 3039 B namespace, which the
PrefixCache then refused (256 B at most), far from where the id was passed."""

from __future__ import annotations

import pytest
import torch
import transformers

from mooncake_store import InvalidValue
from mooncake_store.client.prefix_hash import MAX_NAMESPACE_BYTES, check_namespace
from mooncake_store.integrations.transformers import kv_namespace


@pytest.fixture(scope="module")
def model() -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    with torch.device("meta"):  # no weights needed: a model_id names them
        return transformers.LlamaForCausalLM(config)


def test_a_model_id_too_long_for_a_namespace_is_refused_naming_the_room(model: transformers.PreTrainedModel) -> None:
    layout = kv_namespace(model, model_id="m").removeprefix("m")  # "/float32/L2/kv2/d8/tp0"
    room = MAX_NAMESPACE_BYTES - len(layout)
    longest = "é" * (room // 2)  # two bytes each: the room is counted in bytes, not characters
    assert check_namespace(kv_namespace(model, model_id=longest)) == longest + layout
    with pytest.raises(InvalidValue, match=rf"model_id is {2 * (room // 2) + 2} B of UTF-8; .* room for {room} B"):
        kv_namespace(model, model_id=longest + "é")
    with pytest.raises(InvalidValue, match=r"model_id is 3000 B of UTF-8"):
        kv_namespace(model, model_id="x" * 3000)


def test_a_model_id_not_text_or_with_a_control_character_is_refused(model: transformers.PreTrainedModel) -> None:
    with pytest.raises(InvalidValue, match=r"model_id must be text naming the weights, got int 7"):
        kv_namespace(model, model_id=7)  # type: ignore[arg-type]
    with pytest.raises(InvalidValue, match=r"control character"):
        kv_namespace(model, model_id="run\n7")
