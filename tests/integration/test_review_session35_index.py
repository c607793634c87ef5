"""Index records not of this build's making (review, thirty-fifth session): a JSON number past
float range (1e999, which json.dumps writes as Infinity) decodes to a float int() cannot take, and
a node row holding one escaped decode_node as a bare OverflowError: the row was not left out, and
every put, get and stat of the namespace failed. Deep nesting exhausted the parser's stack
(RecursionError) the same way. Both are ProtocolErrors naming the record now, and the row is left
out as any malformed one is (test_review_session29_index.py)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from mooncake_store import Client, LocalCluster


@pytest.mark.parametrize("field", ["used", "capacity"])
def test_a_node_row_with_an_infinite_usage_number_is_left_out(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], field: str
) -> None:
    cluster = make_cluster(1)
    client = make_client(cluster)
    prefix = client.index.prefix
    real = json.loads(client.index.redis.hget(prefix + "nodes", cluster.agents[0].node_id))
    ghost = dict(real, node_id="ghost", shm_name="none")
    ghost["tiers"] = [dict(t, **{field: 1e999}) for t in real["tiers"]]  # json.dumps writes Infinity
    client.index.redis.hset(prefix + "nodes", "ghost", json.dumps(ghost))
    client._node_table(refresh=True)
    client.put("k", b"value")
    assert client.get("k").tobytes() == b"value"
    assert [n.node_id for n in client.stat().nodes] == [cluster.agents[0].node_id]


def test_a_node_row_nested_past_the_parser_is_left_out(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(1)
    client = make_client(cluster)
    client.index.redis.hset(client.index.prefix + "nodes", "deep", "[" * 100_000 + "]" * 100_000)
    client._node_table(refresh=True)
    client.put("k", b"value")
    assert client.get("k").tobytes() == b"value"
    assert [n.node_id for n in client.stat().nodes] == [cluster.agents[0].node_id]


def test_key_patterns_match_characters_not_bytes(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """The server's MATCH takes bytes: `?` was one byte of UTF-8, so `ключ-?` listed nothing
    beside a key `ключ-ü`, and a class `[к]` matched neither of that letter's two bytes."""
    cluster = make_cluster(1)
    client = make_client(cluster)
    for key in ("ключ-ü", "ключ-a", "ключ-üü", "other"):
        client.put(key, b"v")

    def listed(pattern: str) -> list[str]:
        return [entry.key for entry in client.index.list_keys(pattern)]

    assert listed("ключ-?") == ["ключ-a", "ключ-ü"]
    assert listed("[к]люч-ü") == ["ключ-ü"]
    assert listed("ключ-[^a]*") == ["ключ-ü", "ключ-üü"]
    assert listed("*") == ["other", "ключ-a", "ключ-ü", "ключ-üü"]
