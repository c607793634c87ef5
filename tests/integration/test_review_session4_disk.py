"""Review of the disk tier and the agent's moves through it (session 4, disk).

Each test fails on the code as reviewed, for the reason its docstring gives. Real agents (in this
process, and one agent subprocess), real disk tiers in a temporary directory, the session's real
Redis/Valkey. Failures of the index are injected on the agent's index client, as in
tests/integration/test_moves_cut_short.py; the pressure loop is stubbed so that the test alone
moves objects (as the pressure loop would).
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from mooncake_store import connect
from mooncake_store.agent.node import Agent
from mooncake_store.errors import ConnectError, MooncakeError
from mooncake_store.transport.tcp import TcpTransport
from mooncake_store.types import Replica, TierKind

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


def _no_pressure_loop(agent: Agent) -> None:
    agent.pressure.run = lambda stop: stop.wait()  # type: ignore[method-assign]


@pytest.fixture
def make_disk_agent(make_inproc_agent: Callable[..., Agent], tmp_path: Path) -> Callable[..., Agent]:
    def make(**overrides: object) -> Agent:
        settings: dict[str, object] = {"host_bytes": 8 * MiB, "disk_path": str(tmp_path), "disk_bytes": 16 * MiB}
        settings.update(overrides)
        return make_inproc_agent(prepare=_no_pressure_loop, **settings)

    return make


def _host_victim(agent: Agent, key: str) -> tuple[object, int]:
    (victim,) = [c for c in agent.index.victim_candidates(agent.node_id, "host") if c.key == key]
    location = agent.table.offset_of(victim.alloc_id)
    assert location is not None
    return victim, location[0]


def _demote(agent: Agent, key: str) -> int:
    victim, offset = _host_victim(agent, key)
    assert agent.pressure.moves.demote_to_disk(victim, offset)  # type: ignore[arg-type]
    meta = agent.index.lookup([key], lease_ms=0).objects[0]
    assert meta is not None
    (replica,) = meta.replicas
    assert replica.tier == TierKind.DISK
    return replica.alloc_id


def test_a_second_agent_refused_for_a_live_node_id_leaves_the_live_agents_chunk_files_alone(
    make_disk_agent: Callable[..., Agent], redis_url: str, tmp_path: Path
) -> None:
    """A second agent started by mistake with a live agent's --node-id (same namespace, same --disk
    directory) is refused at registration ("held by a live agent"), but its DiskTier was built first
    and DiskTier._clear_leftovers() (tiers/disk.py:99-104) deleted every chunk file under
    <disk>/<node id>: the live agent's only copy of a demoted object is gone, while the index still
    lists it. A refused start must leave the live agent's data alone."""
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    node_id = f"rv4d-{uuid.uuid4().hex[:6]}"
    agent = make_disk_agent(namespace=namespace, node_id=node_id)
    key = f"live-{uuid.uuid4().hex[:6]}"
    value = np.arange(MiB // 2, dtype=np.float16)
    with connect(redis_url, namespace=namespace) as client:
        client.put(key, value, preferred_node=node_id)
        disk_id = _demote(agent, key)
        assert agent.disk is not None
        path = agent.disk.path_of(disk_id)
        assert path.exists()

        cmd = [
            sys.executable, "-m", "mooncake_store.agent",
            "--redis-url", redis_url, "--namespace", namespace, "--node-id", node_id,
            "--host-bytes", "4MiB", "--no-prefault", "--disk", str(tmp_path), "--disk-mem", "16MiB",
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:  # it must not have started; stop it by its own pid
                proc.kill()
                proc.wait(timeout=10)
        assert proc.returncode != 0, err  # refused: the node id is held by a live agent

        assert path.exists(), "the refused second agent deleted the live agent's chunk file"
        np.testing.assert_array_equal(client.get(key), value)


def test_a_demotion_whose_answer_is_lost_keeps_a_file_buried_under_a_live_lease(
    make_disk_agent: Callable[..., Agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """demote_to_disk's swap lands but its answer is lost; before the agent asks the index again, a
    reader looks the object up (a lease on the new disk location) and the object is removed (its
    file goes to the graveyard, due when that lease ends). LocalMoves._index_names()
    (since folded into LocalMoves.resolve) read "not named" and _drop_target deletes the file at once: the reader,
    within its lease, gets STALE instead of the bytes (DESIGN.md §3.3). settle() asks the graveyard
    for exactly this case (cba3bab); the immediate path does not. The same path frees a promotion's
    or a GPU demotion's host block under a live lease (_swap_into)."""
    lease_ms = 2000
    agent = make_disk_agent()
    key = f"buried-{uuid.uuid4().hex[:6]}"
    value = np.arange(MiB // 2, dtype=np.float16)
    with connect(agent.index.url, namespace=agent.namespace) as client:
        client.put(key, value, preferred_node=agent.node_id)
        victim, offset = _host_victim(agent, key)
        real_swap = agent.index.move_replica
        leased: list[Replica] = []

        def lost_answer(key_: str, **kwargs: object) -> str:
            assert real_swap(key_, **kwargs) == "OK"  # type: ignore[arg-type]
            # A reader's lookup, then a remove, both before the agent asks again.
            meta = agent.index.lookup([key_], lease_ms=lease_ms).objects[0]
            assert meta is not None
            leased.extend(meta.replicas)
            assert agent.index.remove([key_]) == [1]
            raise ConnectError("connection lost before the answer (injected)")

        monkeypatch.setattr(agent.index, "move_replica", lost_answer)
        agent.pressure.moves.demote_to_disk(victim, offset)  # type: ignore[arg-type]
        monkeypatch.undo()

        (replica,) = leased
        assert replica.tier == TierKind.DISK and replica.node_id == agent.node_id
        disk_id = replica.alloc_id
        assert agent.index.buried(agent.node_id, [disk_id]) == {disk_id}, "its grave is due when the lease ends"
        # The reader, within its lease, reads the location it was given.
        dest = bytearray(value.nbytes)
        transport = TcpTransport(timeout_s=5.0, connections_per_peer=1, stripe_bytes=1 << 62)
        try:
            transport.read_into(agent.server.endpoint, disk_id, 0, memoryview(dest))
        except MooncakeError as exc:
            pytest.fail(f"the chunk file was deleted while a reader's lease still protects it: {exc}")
        finally:
            transport.close()
        np.testing.assert_array_equal(np.frombuffer(dest, dtype=np.float16), value)

        # Once the lease has run out, the graveyard frees it: no file is left behind.
        time.sleep(lease_ms / 1000 + 0.2)
        agent.sync_once()
        assert agent.disk is not None and agent.disk.entry(disk_id) is None
        assert not agent.disk.path_of(disk_id).exists() and disk_id not in agent.disk_keys
