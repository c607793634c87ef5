"""A peer whose disk tier cannot write the chunk files spilled to it (its filesystem full: ENOSPC
though its --disk-mem says there is room; gone read-only, EIO, its directory removed) refuses each
file at its WRITE, after granting the RESERVE. The sender counted such a job neither moved nor
unsent: it was neither placed elsewhere nor evicted, the peer was not left out for the rest of the
pass, and every pass sent the same files there again (hundreds a minute, each a WARNING in the
peer's log) while the sender's disk stayed above its high watermark. Now the refused jobs come
back as unsent (placed again: elsewhere, else evicted; a peer that refused a whole batch is asked
nothing more in that pass, one that refused a file for a moment keeps its later batches), and
the peer's disk tier offers no room for a while after a failed write (tiers/disk.py: room()), so
the next spills are refused at their RESERVE and nothing is sent to it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import disk_jobs, put_on_disk, random_bytes, replicas_of, small_tmpfs, wait_until

from mooncake_store import Client, LocalCluster
from mooncake_store.agent.node import Agent
from mooncake_store.types import TierKind

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def make_agent(make_peer_agent: Callable[..., Agent], tmp_path: Path) -> Callable[..., Agent]:
    """In-process agents of one namespace with a disk tier each; pressure passes run when called."""

    def make(disk_bytes: int, **overrides: object) -> Agent:
        return make_peer_agent(disk_path=str(tmp_path / "disks"), disk_bytes=disk_bytes, **overrides)

    return make


def break_disk_writes(agent: Agent) -> list[int]:
    """Make every chunk file write of ``agent``'s disk tier fail with an OSError (a file stands
    where each of its shard directories goes: EEXIST, as root too); the list counts the writes of
    spilled files it is asked for from then on."""
    disk = agent.disk
    assert disk is not None
    for shard in range(256):
        (disk.root / f"{shard:02x}").write_bytes(b"")
    asked: list[int] = []
    write_blob = disk.write_blob

    def counted(alloc_id: int, blob: bytes | bytearray | memoryview) -> object:
        asked.append(alloc_id)
        return write_blob(alloc_id, blob)

    disk.write_blob = counted  # type: ignore[method-assign]
    return asked


def test_chunk_files_a_peer_refuses_at_their_writes_come_back_unsent(make_agent: Callable[..., Agent]) -> None:
    sender = make_agent(8 * MiB)
    peer = make_agent(8 * MiB)
    keys = [f"k{i}" for i in range(4)]
    for i, key in enumerate(keys):
        put_on_disk(sender, key, random_bytes(128 * KiB, seed=i))
    asked = break_disk_writes(peer)
    node = sender.index.nodes()[peer.node_id]
    spiller = sender.pressure._spiller

    result = spiller.spill(node, disk_jobs(sender), tier=TierKind.DISK)
    assert result.refused and not result.moved, result
    assert sorted(job.victim.key for job in result.unsent) == keys, (
        f"jobs the peer refused at their WRITEs were neither moved nor handed back: {result}"
    )
    assert asked, "the peer was asked to write none of the files"
    for key in keys:  # still here, where they were
        assert [(r.node_id, r.tier) for r in replicas_of(sender, key)] == [(sender.node_id, TierKind.DISK)]
    assert peer.disk is not None
    # The peer's disk offers no room now, though its accounting is untouched (nothing is stored).
    assert peer.disk.room() == 0 and peer.disk.free_bytes == peer.disk.capacity_bytes
    assert peer.disk.promised_bytes == 0, "the refused files' reservations were not given back"

    # The next spill there (its node table row still shows the room) is refused at its RESERVE:
    # no file is sent to be refused again.
    before = len(asked)
    again = spiller.spill(node, disk_jobs(sender), tier=TierKind.DISK)
    assert again.refused and sorted(job.victim.key for job in again.unsent) == keys, again
    assert len(asked) == before, f"{len(asked) - before} more file(s) sent to a disk whose writes fail"


def test_a_pass_whose_only_peer_refuses_its_files_still_gets_the_disk_under_its_mark(
    make_agent: Callable[..., Agent],
) -> None:
    """Pressure passes over the disk tier, with the only peer's disk failing its writes: the files
    it refused at their WRITEs stay for the next pass, whose RESERVEs the peer refuses (its disk
    offers no room after a failed write), and they are evicted (this node's disk is a cache), as
    for a peer out of room, rather than sent there again at every pass."""
    sender = make_agent(1 * MiB, high_watermark=0.5, low_watermark=0.3)
    peer = make_agent(8 * MiB)
    for i in range(6):
        put_on_disk(sender, f"k{i}", random_bytes(128 * KiB, seed=i))
    disk = sender.disk
    assert disk is not None and disk.used_bytes > 0.5 * disk.capacity_bytes
    asked = break_disk_writes(peer)

    for _ in range(3):  # bounded: the second pass finds the peer refusing its RESERVEs
        sender.pressure.relieve_disk()
        if disk.used_bytes <= 0.5 * disk.capacity_bytes:
            break
    assert asked, "nothing was spilled to the peer"
    assert disk.used_bytes <= 0.5 * disk.capacity_bytes, (
        f"the disk is still at {disk.used_bytes} of {disk.capacity_bytes} B after a pass whose peer refused "
        f"{len(asked)} file(s) at their writes"
    )


def test_a_peer_that_refuses_one_write_for_a_moment_still_gets_the_rest(make_agent: Callable[..., Agent]) -> None:
    """A refusal of one file of a batch (the peer's inbox busy with other senders' files for a
    moment) hands that file back alone: the peer keeps its later batches, and the file is sent
    again. Taken for a failing peer, every batch queued for it was evicted, though it had room."""
    sender = make_agent(2 * MiB, high_watermark=0.5, low_watermark=0.1)
    peer = make_agent(64 * MiB)
    keys = [f"k{i}" for i in range(10)]
    for i, key in enumerate(keys):
        put_on_disk(sender, key, random_bytes(128 * KiB, seed=i))
    sender.pressure._spiller._batch_bytes = 300 * KiB  # a few files a batch
    inbox = peer.inbox
    assert inbox is not None
    real_staging = inbox.staging
    asked: list[int] = []

    def busy_once(alloc_id: int, offset: int, length: int) -> object:
        asked.append(alloc_id)
        return None if len(asked) == 1 else real_staging(alloc_id, offset, length)

    inbox.staging = busy_once  # type: ignore[method-assign]
    sender.pressure.relieve_disk()
    assert len(asked) > 1, "the peer was asked for no file after its one refusal"
    gone = [key for key in keys if not replicas_of(sender, key)]
    assert gone == [], f"{len(gone)} object(s) evicted ({gone}) after one refused write by a peer with room"
    assert sender.disk is not None and sender.disk.used_bytes <= 0.5 * sender.disk.capacity_bytes


# ---- a disk full for real (a tmpfs), with agent processes ---- ----------------
@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs with 1 MiB left, as other programs' data leaves a disk."""
    with small_tmpfs(tmp_path / "mnt", left_bytes=1 * MiB) as mount:
        yield mount


def test_a_peer_whose_disk_is_full_is_not_sent_the_same_files_at_every_pass(
    full_tmpfs: Path,
    tmp_path: Path,
    make_cluster: Callable[..., LocalCluster],
    make_client: Callable[..., Client],
) -> None:
    logs = tmp_path / "logs"
    cluster = make_cluster(0, host_bytes=4 * MiB, log_dir=logs)
    cluster.add_agent(
        node_id="n2",
        extra_args=["--disk", str(full_tmpfs), "--disk-mem", "8MiB", "--high-watermark", "0.9", "--no-prefault"],
    )
    own = ["--disk", str(tmp_path / "own"), "--disk-mem", "2MiB", "--high-watermark", "0.5", "--low-watermark", "0.3"]
    cluster.add_agent(node_id="n1", extra_args=[*own, "--no-prefault"])
    client = make_client(cluster, timeout_s=10)
    for i in range(13):  # the peer's host tier near its mark: the disk is where n1's files go
        client.put(f"h{i}", random_bytes(256 * KiB, seed=100 + i), preferred_node="n2")

    def put_cold(keys: range) -> None:  # cold objects on n1, which demotes them to its disk, past its mark there
        for i in keys:
            client.put(f"k{i}", random_bytes(256 * KiB, seed=i), preferred_node="n1")
            time.sleep(0.05)

    def refusals() -> int:
        return (logs / "n2.log").read_text().count("refused: cannot write")

    def n1_disk_under_its_mark(since: float) -> bool:
        """As n1 published it in a heartbeat after ``since`` (an older one may predate the files)."""
        (node,) = [n for n in client.stat().nodes if n.node_id == "n1"]
        disk = next(t for t in node.tiers if str(t.tier) == "disk")
        return node.heartbeat_age_s < time.monotonic() - since and disk.used_bytes <= 0.5 * disk.capacity_bytes

    puts = 30
    put_cold(range(puts))
    assert wait_until(lambda: refusals() > 0, 30), "the peer was never sent a file: the scenario did not happen"
    # n1's disk gets under its high watermark: what the peer refused went elsewhere or was evicted
    # (it stayed at 1.8 of its 2 MiB, the same files sent to the peer at every pass).
    since = time.monotonic()
    assert wait_until(lambda: n1_disk_under_its_mark(since), 30), (
        f"n1's disk stayed above its high watermark; the peer refused {refusals()} file(s)"
    )
    # A put pinned to n1 lands: it holds nothing but cold objects, which it may evict.
    client.put("new", random_bytes(1 * MiB, seed=999), preferred_node="n1")
    put_cold(range(puts, puts + 8))  # more pressure on n1's disk
    since = time.monotonic()
    assert wait_until(lambda: n1_disk_under_its_mark(since), 30), f"the peer refused {refusals()} file(s)"
    # The peer was not sent the same files at every pass: fewer refusals than files n1 ever had
    # (the peer offers no room for a while after a failed write, and a pass leaves out a peer
    # once it refuses; before, the refusals went on at about 50 a second).
    assert refusals() <= puts, f"the peer was sent {refusals()} files it could not write, of {puts + 8} put"
