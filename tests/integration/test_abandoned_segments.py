"""An agent killed without its stop (SIGKILL, the OOM killer) leaves its arena in /dev/shm, and a
restarted agent of the same node creates its own under a new name: each crash leaked an arena's
memory until /dev/shm filled and agents could not start. An agent now holds a lock on its arena
for as long as it maps it, and removes the arenas of earlier agents of its node id that no process
holds (once registered, or at once when /dev/shm has no room for its own) and, once registered,
those of other ids the node table no longer lists (the default id is host-pid: each restart is
another node)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import wait_until

from mooncake_store import LocalCluster
from mooncake_store.agent.node import Agent
from mooncake_store.index.client import RedisIndex
from mooncake_store.tiers.host import SHM_DIR, HostArena, segment_name, sweep_abandoned_segments

MiB = 1 << 20


def dead_pid() -> int:
    """The pid of a process that has exited (its agent died)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    return int(proc.stdout)


@pytest.fixture
def made() -> Iterator[list[Path]]:
    paths: list[Path] = []
    yield paths
    for path in paths:
        path.unlink(missing_ok=True)


def test_an_agent_removes_the_arenas_earlier_agents_of_its_node_left(
    make_inproc_agent: Callable[..., Agent], made: list[Path]
) -> None:
    namespace, node_id = f"t-{uuid.uuid4().hex[:10]}", f"sw-{uuid.uuid4().hex[:6]}"
    left = SHM_DIR / segment_name(namespace, node_id, pid=dead_pid(), incarnation="0123456789ab")
    left.write_bytes(b"\x00" * 4096)  # a crashed agent's: no process holds it
    # A crashed agent of another id (the default id is host-pid: every restart is a node of its
    # own), whose record is gone: it was left for good, one arena per crash.
    other = SHM_DIR / segment_name(namespace, "vm-4242", pid=dead_pid(), incarnation="0123456789ab")
    other.write_bytes(b"\x00" * 4096)
    elsewhere = SHM_DIR / segment_name(namespace + "x", "vm-4242", pid=dead_pid(), incarnation="0123456789ab")
    elsewhere.write_bytes(b"\x00" * 4096)  # another namespace's: its own agents sweep it
    made.extend([left, other, elsewhere])
    held = HostArena.create(segment_name(namespace, node_id, incarnation="feedfeedfeed"), MiB, prefault=False)
    held_other = HostArena.create(segment_name(namespace, "vm-77", incarnation="feedfeedfeed"), MiB, prefault=False)
    try:  # arenas this process maps: live agents (stalled, say) keep their own
        agent = make_inproc_agent(namespace=namespace, node_id=node_id)
        assert not left.exists(), "the dead agent's arena was left in /dev/shm"
        assert not other.exists(), "a crashed agent's arena of another node id was left in /dev/shm"
        assert elsewhere.exists() and held.path.exists() and held_other.path.exists()
        assert (SHM_DIR / agent.arena.name).exists()
    finally:
        held.close()
        held_other.close()


def test_the_sweep_keeps_what_the_node_table_names_and_other_nodes_without_one(made: list[Path]) -> None:
    """A dead node not yet reaped is still listed: same-host clients may read its arena until its
    deadline, so it goes at a later start. Without the table only the node's own arenas go."""
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    listed = SHM_DIR / segment_name(namespace, "dead-listed", pid=dead_pid(), incarnation="0123456789ab")
    unlisted = SHM_DIR / segment_name(namespace, "dead-reaped", pid=dead_pid(), incarnation="0123456789ab")
    lookalike = SHM_DIR / segment_name(namespace, "me.1", pid=dead_pid(), incarnation="0123456789ab")
    for path in (listed, unlisted, lookalike):
        path.write_bytes(b"\x00" * 4096)
        made.append(path)
    assert sweep_abandoned_segments(namespace, "me", keep="mine") == []  # no table: another node's stay
    removed = sweep_abandoned_segments(namespace, "me", keep="mine", listed=frozenset({listed.name}))
    assert sorted(removed) == sorted([unlisted.name, lookalike.name])
    assert listed.exists() and not unlisted.exists() and not lookalike.exists()


def test_the_sweep_keeps_the_arenas_of_a_namespace_whose_name_extends_its_own(made: list[Path]) -> None:
    """Names join namespace and node id, both of which may hold dots: with a dot between them the
    sweep of namespace "n" took "n.b"'s dead arenas (not in n's node table) as its own
    namespace's, and removed them while n.b's clients could still read them; and namespace "n"
    with node "b.c" named the segment of namespace "n.b"'s node "c"."""
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    nested = SHM_DIR / segment_name(namespace + ".b", "dead", pid=dead_pid(), incarnation="0123456789ab")
    nested.write_bytes(b"\x00" * 4096)
    made.append(nested)
    assert sweep_abandoned_segments(namespace, "me", keep="mine", listed=frozenset()) == []
    assert nested.exists()
    assert segment_name(namespace, "b.c", pid=1) != segment_name(namespace + ".b", "c", pid=1)


def test_the_sweep_removes_its_own_nodes_arenas_named_as_an_earlier_version_named_them(made: list[Path]) -> None:
    """Segments were named mooncake.<namespace>.<node>.<pid>-<incarnation> before the namespace's
    length went in: a crashed predecessor of this node under the earlier version left one, which
    no sweep recognised any more (kept until a reboot). Another node's stays: such a name does not
    say where its namespace ends."""
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    pid = dead_pid()
    own = SHM_DIR / f"mooncake.{namespace}.me.{pid}-0123456789ab"
    others = SHM_DIR / f"mooncake.{namespace}.someone.{pid}-0123456789ab"
    for path in (own, others):
        path.write_bytes(b"\x00" * 4096)
        made.append(path)
    assert sweep_abandoned_segments(namespace, "me", keep="mine", listed=frozenset()) == [own.name]
    assert others.exists()


def test_the_sweep_takes_no_name_of_another_namespace_for_its_own_earlier_one(made: list[Path]) -> None:
    """Namespace "<len>.<ns>"'s earlier name for a node is namespace <ns>'s name for it now: an
    agent of "3.ns1" removed the dead arena of "ns1"'s agent-0 as its own predecessor's, while
    ns1's shm clients could still read it until its deadline (a probe, 3 of 3)."""
    other = f"t{uuid.uuid4().hex[:8]}"
    pid = dead_pid()
    theirs = SHM_DIR / segment_name(other, "agent-0", pid=pid, incarnation="0123456789ab")
    theirs.write_bytes(b"\x00" * 4096)
    made.append(theirs)
    lookalike = f"{len(other)}.{other}"
    assert theirs.name == f"mooncake.{lookalike}.agent-0.{pid}-0123456789ab"  # its earlier name for agent-0
    assert sweep_abandoned_segments(lookalike, "agent-0", keep="mine", listed=frozenset()) == []
    assert theirs.exists()
    assert sweep_abandoned_segments(other, "agent-0", keep="mine", listed=frozenset()) == [theirs.name]


def test_a_node_restarted_after_each_crash_holds_one_arena(make_cluster: Callable[..., LocalCluster]) -> None:
    """Real agent processes killed with SIGKILL and started again under the same node id (once
    the dead one's deadline has passed), their segments left in place as a crash leaves them
    (LocalCluster removes them only at its stop)."""
    cluster = make_cluster(0, heartbeat_ttl_s=1.5)
    prefix = segment_name(cluster.namespace, "crashy", pid=0)[:-2]  # up to the pid

    def arenas() -> set[str]:
        return {p.name for p in SHM_DIR.glob(prefix + ".*")}

    index = RedisIndex(cluster.redis_url, namespace=cluster.namespace, timeout_s=10.0)
    try:
        for _ in range(3):
            cluster.add_agent(node_id="crashy").kill()
            assert wait_until(lambda: index.nodes()["crashy"].heartbeat_deadline_ms < index.server_time_ms(), 10)
        assert len(arenas()) >= 1
        cluster.add_agent(node_id="crashy")
        assert len(arenas()) == 1, sorted(arenas())
    finally:
        index.close()


def test_an_arena_being_created_is_never_swept(made: list[Path]) -> None:
    """The lock was taken only once the arena was sized and prefaulted (seconds for a large one),
    and an agent of the same node id starting meanwhile (a second cluster in the namespace, a
    demo) swept the new, live segment away: the agent then advertised a name no reader could open."""
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    name = segment_name(namespace, "agent-0", incarnation="creating")
    made.append(SHM_DIR / name)
    creator = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from mooncake_store.tiers.host import HostArena\n"
            f"arena = HostArena.create({name!r}, 256 << 20, prefault=True)\n"
            "print('created', flush=True)\n"
            "sys.stdin.read()\n"  # held until the test has looked
            "arena.close()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert creator.stdout is not None
        removed: list[str] = []
        for _ in range(3000):  # sweeps until it is created, as often as starts could (bounded)
            removed += sweep_abandoned_segments(namespace, "agent-0", keep="another agent's")
            if select.select([creator.stdout], [], [], 0.002)[0] or creator.poll() is not None:
                break
        assert creator.stdout.readline().strip() == "created"
        assert removed == [], f"the sweep removed a segment being created: {removed}"
        assert (SHM_DIR / name).exists()
        assert not list(SHM_DIR.glob(f".{name}*")), "the hidden name it was created under was left"
    finally:
        if creator.poll() is None:
            assert creator.stdin is not None
            creator.stdin.close()
            creator.wait(timeout=30)
    assert not (SHM_DIR / name).exists()


RESTART_IN_SMALL_SHM = """
from mooncake_store import LocalCluster
MiB = 1 << 20
with LocalCluster(0, host_bytes=40 * MiB, heartbeat_ttl_s=2.0) as cluster:
    cluster.add_agent(node_id="s").kill()
    cluster.add_agent(node_id="s")
    print("restarted", flush=True)
"""


def test_an_agent_restarts_after_a_crash_in_a_dev_shm_with_room_for_one_arena() -> None:
    """The new arena was made before the dead incarnation's was swept (at registration), and a
    full /dev/shm failed the start: with /dev/shm holding less than two arenas (a container's shm
    size, a pod's memory emptyDir kept across restarts) the restart failed with NoCapacity, and
    every later one, since only a started agent sweeps. Run in a mount namespace of its own with a
    64 MiB /dev/shm and 40 MiB arenas (as root; else in a user namespace of its own, which may
    mount a tmpfs where the kernel allows unprivileged user namespaces)."""
    unshare = ["unshare", "-m", "--propagation", "private"] if os.geteuid() == 0 else ["unshare", "-Urm"]
    script = "mount -t tmpfs -o size=64m tmpfs /dev/shm && exec " + f'{sys.executable} -c "$0"'
    child = subprocess.Popen(
        [*unshare, "sh", "-c", script, RESTART_IN_SMALL_SHM],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()  # by its pid; its LocalCluster's agents exit with their parent
            child.wait(timeout=30)
    assert child.returncode == 0 and "restarted" in out, err[-2000:]
