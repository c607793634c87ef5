"""Review of spills under faults (session 4): a peer killed mid-spill, the index stalling mid-spill.

Real agent processes (LocalCluster) and the session's real Valkey. Where the test plays the
sending agent, it runs the spill protocol exactly as agent/spill.py does: a guard record, RESERVE
with SPILL_FLAG on the peer, the WRITE, then the real move_replicas.lua swap.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import numpy as np
import redis
from helpers import guarded_spill_copy, wait_until

from mooncake_store import Client, LocalCluster
from mooncake_store.index.schema import encode_replica

MiB = 1 << 20
SIZE = 1 * MiB

#: Holds the index server for ARGV[1] seconds of CPU (TIME is frozen inside a script; os.clock is
#: not). Shorter than the server's busy-reply threshold (5 s), so nothing is answered meanwhile.
STALL = "local s = os.clock() while os.clock() - s < tonumber(ARGV[1]) do end return 1"


def test_a_sync_reply_lost_in_an_index_stall_does_not_free_a_spilled_in_object(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """A spill's swap lands; right after it the index stalls for longer than the receiving agent's
    Redis timeout. The receiver's sync, queued behind the stall, is executed by the server (its ack
    list drained, agent_sync.lua) after the agent has given up on the reply: the ack is gone for
    good. At the reservation's deadline the next sync finds the guard gone ("G") and no ack, and
    frees the block that the index names as the object's only replica. The next put reuses it and
    a reader of the spilled object gets the new object's bytes (DESIGN.md §3.3, §3.4)."""
    # b's index timeout is max(2, heartbeat_ttl) = 3 s; the stall (3.6 s) outlasts a sync sent in
    # its first 0.6 s, and stays short of a reap (deadline + grace = 6 s after the last heartbeat).
    cluster = make_cluster(0, heartbeat_ttl_s=3.0, reserve_timeout_s=1.0)
    a = cluster.add_agent(node_id="a", extra_args=["--host-bytes", str(32 * MiB)])
    b = cluster.add_agent(node_id="b", extra_args=["--host-bytes", str(8 * MiB)])
    client = make_client(cluster, timeout_s=20.0)
    # The copy, as a's spiller makes it: guard, RESERVE (spill) on b, WRITE.
    old, new, guard = guarded_spill_copy(client, a, b, size=SIZE, guard_ttl_ms=300_000)

    # The swap, then at once (same connection, one write: nothing runs in between) the stall.
    stall = redis.Redis.from_url(cluster.redis_url, socket_timeout=30)
    try:
        pipe = stall.pipeline(transaction=False)
        pipe.eval(
            client.index._scripts["move_replicas"].script,
            0,
            client.index.prefix,
            a.node_id,
            "obj",
            str(old.alloc_id),
            json.dumps(encode_replica(new)),
            guard,
        )
        pipe.eval(STALL, 0, 3.6)
        swapped, _ = pipe.execute()
    finally:
        stall.close()
    assert [s.decode() if isinstance(s, bytes) else s for s in swapped] == ["OK"]

    # b's reservation deadline has passed; give its syncs and heartbeats a moment after the stall.
    time.sleep(1.5)
    nodes = client.index
    assert wait_until(lambda: nodes.nodes()[b.node_id].heartbeat_deadline_ms > nodes.server_time_ms(), 5.0)
    meta = client.object_meta("obj")
    assert meta is not None and [(r.node_id, r.alloc_id) for r in meta.replicas] == [(b.node_id, new.alloc_id)]

    # Another object on b: it must not land in the block the index names for "obj".
    client.put("intruder", np.full(SIZE, 0x55, dtype=np.uint8), preferred_node=b.node_id)
    got = client.get("obj")
    assert np.array_equal(got, np.full(SIZE, 0xAA, dtype=np.uint8)), (
        f"'obj' (spilled to b, alloc {new.alloc_id} at offset {new.offset}) read back as bytes "
        f"0x{int(got[0]):02x}: b freed the block after its sync's reply (with the swap's ack) was "
        "lost in the index stall, and reused it"
    )
