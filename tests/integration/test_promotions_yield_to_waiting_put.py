"""Reads of disk objects promote them back to host memory, up to the host tier's high watermark.
A put waiting on the same node for room (its RESERVE refused, the node demoting to make it) found
each freed block taken again by the next promotion, and waited out its timeout while the node
moved objects to and fro."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from helpers import random_bytes

from mooncake_store import Client, LocalCluster

MiB = 1 << 20


def test_reads_promoting_from_disk_do_not_starve_a_waiting_put(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], tmp_path: Path
) -> None:
    cluster = make_cluster(0)
    disk = ["--disk", str(tmp_path / "disk"), "--disk-mem", str(256 * MiB)]
    marks = ["--high-watermark", "0.8", "--low-watermark", "0.5", "--no-spill"]
    cluster.add_agent(node_id="agent-0", extra_args=["--host-bytes", str(16 * MiB), *disk, *marks])
    client = make_client(cluster, timeout_s=8.0)
    # Short read leases: with the default 5 s, the host objects the loop reads would hold the
    # put's room by themselves.
    reader_client = make_client(cluster, lease_ms=200)
    values = {f"cold{i}": random_bytes(MiB, i) for i in range(48)}
    for key, value in values.items():
        client.put(key, value)
    on_disk = [k for k in values if str(client.object_meta(k).replicas[0].tier) == "disk"]
    assert len(on_disk) >= 24, on_disk
    stop = threading.Event()
    reads = [0]
    wrong: list[str] = []

    def read_round_robin() -> None:
        # Paced: a host object read again and again stays under a live lease, and neither moves
        # nor is evicted (rightly so); here each is read every second or so.
        deadline = time.monotonic() + 30
        while not stop.is_set() and time.monotonic() < deadline:
            for key in on_disk:
                if stop.wait(0.04):
                    return
                if not np.array_equal(reader_client.get(key), values[key]):
                    wrong.append(key)
                reads[0] += 1

    reader = threading.Thread(target=read_round_robin)
    reader.start()
    try:
        time.sleep(1.0)  # the reads' promotions under way
        big = random_bytes(6 * MiB, 99)
        client.put("big", big, preferred_node="agent-0")
    finally:
        stop.set()
        reader.join(timeout=30)
    assert np.array_equal(client.get("big"), big)
    assert reads[0] > 0 and not wrong, (reads, wrong)
