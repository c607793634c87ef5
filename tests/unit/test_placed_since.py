"""A client's ledger of the reservations its node table does not show yet (client/placed.py): a
node's row counts what was reserved before it was published, the ledger what came after."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import node_row

from mooncake_store.client import placed
from mooncake_store.client.placed import PlacedSince
from mooncake_store.types import NodeInfo, TierKind, footprint_bytes

KiB = 1 << 10


def _row(node_id: str, heartbeat_ms: int) -> NodeInfo:
    return dataclasses.replace(node_row(node_id), last_heartbeat_ms=heartbeat_ms)


def test_what_a_row_was_published_after_is_counted_and_what_it_shows_is_not() -> None:
    ledger = PlacedSince()
    ledger.note("a", TierKind.HOST, 100 * KiB, at_ms=1_000)
    ledger.note("a", TierKind.HOST, 1, at_ms=2_000)  # counted as the 64 B unit it takes
    ledger.note("b", TierKind.HOST, 300 * KiB, at_ms=1_500)
    ledger.note("a", TierKind.GPU, 7 * KiB, at_ms=2_500)
    nodes = {"a": _row("a", 500), "b": _row("b", 500)}
    assert ledger.unseen(nodes, TierKind.HOST, now_ms=3_000) == {"a": 100 * KiB + footprint_bytes(1), "b": 300 * KiB}
    assert ledger.unseen(nodes, TierKind.GPU, now_ms=3_000) == {"a": 7 * KiB}
    # a's heartbeat at 1.8 s showed its first reservation; b's at 1.5 s its only one (reserved then)
    nodes = {"a": _row("a", 1_800), "b": _row("b", 1_600)}
    assert ledger.unseen(nodes, TierKind.HOST, now_ms=3_000) == {"a": footprint_bytes(1)}
    # A row read before that heartbeat (a cached table) no longer sees what was dropped: smaller
    # room for a while is the only error the ledger makes, never larger.
    assert ledger.unseen({"a": _row("a", 0)}, TierKind.HOST, now_ms=3_000) == {"a": footprint_bytes(1)}


def test_nodes_not_in_the_table_are_kept_a_while_and_then_forgotten() -> None:
    ledger = PlacedSince()
    ledger.note("gone", TierKind.HOST, KiB, at_ms=1_000)
    assert ledger.unseen({}, TierKind.HOST, now_ms=2_000) == {}
    assert ledger.unseen({"gone": _row("gone", 0)}, TierKind.HOST, now_ms=2_000) == {"gone": KiB}
    ledger.unseen({}, TierKind.HOST, now_ms=1_000 + placed.KEEP_MS + 1)
    assert ledger.unseen({"gone": _row("gone", 0)}, TierKind.HOST, now_ms=2_000) == {}


def test_the_ledger_is_bounded_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placed, "MAX_ENTRIES", 4)
    ledger = PlacedSince()
    for i in range(10):
        ledger.note("a", TierKind.HOST, KiB, at_ms=1_000 + i)
    assert ledger.unseen({"a": _row("a", 0)}, TierKind.HOST, now_ms=2_000) == {"a": 4 * KiB}


def test_rows_are_compared_by_their_own_heartbeat() -> None:
    ledger = PlacedSince()
    for node in ("a", "b"):
        ledger.note(node, TierKind.HOST, KiB, at_ms=1_000)
    fresh = dataclasses.replace(_row("a", 0), last_heartbeat_ms=1_001)
    assert ledger.unseen({"a": fresh, "b": _row("b", 999)}, TierKind.HOST, now_ms=2_000) == {"b": KiB}
