"""A node's uptime in stat: the counters count from its start. A dead node's ran on with the clock
("up 19s" for an agent SIGKILLed 8 s earlier); it now ends at the node's last heartbeat."""

from __future__ import annotations

from mooncake_store.client.stats import build_stats
from mooncake_store.types import NodeInfo, TransportKind

NOW_MS = 1_000_000


def _node(node_id: str, *, started_ms: int, last_heartbeat_ms: int, deadline_ms: int) -> NodeInfo:
    return NodeInfo(
        node_id=node_id, host="h", host_id="h", zone="z", pid=1, tcp_endpoint="127.0.0.1:1", shm_name="",
        transports=(TransportKind.TCP,), tiers=(), heartbeat_deadline_ms=deadline_ms, started_ms=started_ms,
        last_heartbeat_ms=last_heartbeat_ms,
    )  # fmt: skip


def test_a_dead_nodes_uptime_ends_at_its_last_heartbeat_a_live_ones_runs_to_now() -> None:
    nodes = {
        "live": _node("live", started_ms=NOW_MS - 19_000, last_heartbeat_ms=NOW_MS - 500, deadline_ms=NOW_MS + 2_500),
        "dead": _node("dead", started_ms=NOW_MS - 19_000, last_heartbeat_ms=NOW_MS - 8_000, deadline_ms=NOW_MS - 5_000),
        "unknown": _node("unknown", started_ms=0, last_heartbeat_ms=NOW_MS - 8_000, deadline_ms=NOW_MS - 5_000),
        # An older agent that records no heartbeat time: its uptime is all that is known.
        "no_beat": _node("no_beat", started_ms=NOW_MS - 19_000, last_heartbeat_ms=0, deadline_ms=NOW_MS - 5_000),
    }
    stats = build_stats(nodes, {}, 0, {}, now_ms=NOW_MS)
    by_id = {n.node_id: n for n in stats.nodes}
    assert by_id["live"].alive and by_id["live"].uptime_s == 19.0
    assert not by_id["dead"].alive and by_id["dead"].uptime_s == 11.0
    assert by_id["unknown"].uptime_s == 0.0
    assert by_id["no_beat"].uptime_s == 19.0
