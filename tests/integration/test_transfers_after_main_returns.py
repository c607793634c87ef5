"""Threads still running once the main thread returned (Python waits for non-daemon ones, and
runs queued *_async calls): concurrent.futures takes no new work then, and every striped TCP
transfer (past stripe_bytes, 4 MiB) failed as "TCP transport is closed", the client open (a
probe: 15 of 15). The stripes no pool thread takes run on the caller's thread instead."""

from __future__ import annotations

import subprocess
import sys

from mooncake_store import LocalCluster

SCRIPT = """
import sys, threading, time
import numpy as np
from mooncake_store import connect

client = connect(sys.argv[1], namespace=sys.argv[2], transports=("tcp",))
value = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)
client.put("after-main/big", value)
results = []

def worker(n):
    time.sleep(0.3)  # the main thread has returned by now
    for _ in range(3):
        try:
            client.put(f"after-main/{n}", value)
            results.append("ok" if np.array_equal(client.get(f"after-main/{n}"), value) else "WRONG BYTES")
        except Exception as exc:
            results.append(f"{type(exc).__name__}: {exc}")
    if n == 0:
        time.sleep(1.0)
        print(sorted(set(results)), len(results), flush=True)
        client.remove_many(["after-main/big", "after-main/0", "after-main/1", "after-main/2"])

for n in range(3):
    threading.Thread(target=worker, args=(n,)).start()
"""


def test_striped_tcp_transfers_in_threads_that_outlive_the_main_thread_succeed(shared_cluster: LocalCluster) -> None:
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, shared_cluster.redis_url, shared_cluster.namespace],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "['ok'] 9", run.stdout + run.stderr[-2000:]
