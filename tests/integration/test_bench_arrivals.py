"""benchmarks/spill_bench.py learns of each batch landing on B from keyspace events instead of polling
B's object count: its watcher must count every member a swap adds, once, and time each swap."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from mooncake_store import LocalCluster
from mooncake_store.index.client import RedisIndex

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import spill_bench  # noqa: E402

#: What move_replicas.lua does to B's object set for one batch: one SADD of all its objects.
ADD_BATCH = """
local members = {}
for i = 1, tonumber(ARGV[2]) do members[i] = ARGV[1] .. i end
redis.call('SADD', KEYS[1], unpack(members))
"""


def test_arrivals_are_counted_once_each_and_stamped_per_swap() -> None:
    with LocalCluster(num_agents=0) as cluster:  # a private server: the test turns keyspace events on
        index = RedisIndex(cluster.redis_url, namespace=cluster.namespace)
        try:
            on_b = index.prefix + "nobj:B"
            index.redis.sadd(index.prefix + "nobj:A", "elsewhere")
            sub = spill_bench.subscribe_arrivals(index, on_b)
            t0 = time.perf_counter()
            sent: list[float] = []

            def swaps() -> None:
                for step in range(3):
                    time.sleep(0.05)
                    sent.append(time.perf_counter() - t0)
                    index.redis.eval(ADD_BATCH, 1, on_b, f"s{step}-", 10)
                index.redis.sadd(on_b, "s0-1")  # already there: no arrival
                index.redis.sadd(index.prefix + "nobj:A", "other")  # another node's set: not watched

            writer = threading.Thread(target=swaps)
            writer.start()
            try:
                points = spill_bench.watch_arrivals(
                    sub, t0, lambda: int(index.redis.scard(on_b)), what="test swaps", limit_s=30
                )
            finally:
                writer.join()
                sub.close()
            counts = [n for _, n in points]
            stamps = [t for t, _ in points]
            # Every added member once (not the one already there, not another node's); how the
            # arrivals group into steps depends on timing, which a test does not assert.
            assert counts[-1] == 30 and counts == sorted(set(counts)), points
            assert stamps == sorted(stamps) and stamps[1] >= sent[0], (points, sent)
        finally:
            index.close()
