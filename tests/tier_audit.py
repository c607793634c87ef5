"""What each agent holds, tier by tier, against what the index lists on it: the arena tiers (host,
GPU) by the use and object count the agent publishes, the disk tier by those and by the chunk files
in its directory (tiers/disk_dir.chunk_file_paths: files named after their allocation ids). Tests
call it once the load is over (through wait_until: reservations, graves and leases take a while to
go) and assert that it finds nothing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mooncake_store import Client
from mooncake_store.tiers.disk_dir import chunk_file_paths
from mooncake_store.types import TierKind, TierUsage, footprint_bytes


@dataclass
class TierAudit:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was checked, and what was not and why

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        return "; ".join([*(f"PROBLEM {p}" for p in self.problems), *self.notes])


@dataclass
class _Listed:
    """What the index names on one tier of one node."""

    allocs: dict[int, str] = field(default_factory=dict)  # alloc id -> key
    raw_bytes: int = 0
    arena_bytes: int = 0  # footprints, as an arena counts them


def chunk_files(root: Path) -> tuple[dict[int, int], list[Path]]:
    """The chunk files under a disk tier's directory (alloc id -> file size) and its temp files."""
    files: dict[int, int] = {}
    temps: list[Path] = []
    for path in chunk_file_paths(root):
        if path.suffix == ".tmp":
            temps.append(path)
            continue
        try:
            files[int(path.stem, 16)] = path.stat().st_size
        except FileNotFoundError:
            continue  # removed while listed
    return files, temps


def audit_tiers(client: Client, nodes: list[str], *, disk_dirs: Mapping[str, str | Path] | None = None) -> TierAudit:
    """Each of ``nodes``' tiers against the index: the use and objects the agent publishes, and for
    a disk tier (its directory in ``disk_dirs``) the chunk files there, one per disk replica the
    index lists on the node, no more (space leaked) and no fewer (a replica naming no file), and
    no temp file left. A GPU tier is checked where a node has one; where none does, a note says so."""
    audit = TierAudit()
    listed: dict[tuple[str, TierKind], _Listed] = {}
    keys_on: dict[str, set[str]] = {}
    listing = client.index.list_keys("*")
    for entry in listing:
        for r in entry.replicas:
            on = listed.setdefault((r.node_id, r.tier), _Listed())
            if r.alloc_id in on.allocs:
                audit.problems.append(
                    f"{r.node_id} {r.tier}: alloc {r.alloc_id} named by {entry.key} and {on.allocs[r.alloc_id]}"
                )
            on.allocs[r.alloc_id] = entry.key
            on.raw_bytes += r.size_bytes
            on.arena_bytes += footprint_bytes(r.size_bytes)
            keys_on.setdefault(r.node_id, set()).add(entry.key)
    cluster_stat = client.stat()
    if cluster_stat.objects != len(listing):
        audit.problems.append(f"stat counts {cluster_stat.objects} objects, the index lists {len(listing)}")
    stat = {n.node_id: n for n in cluster_stat.nodes}
    table = client.index.nodes()
    gpu_nodes = 0
    for node_id in nodes:
        info = table.get(node_id)
        if info is None or node_id not in stat:
            audit.problems.append(f"{node_id}: not in the node table")
            continue
        if stat[node_id].objects != len(keys_on.get(node_id, ())):
            audit.problems.append(
                f"{node_id}: nobj counts {stat[node_id].objects} objects, the index names "
                f"{len(keys_on.get(node_id, ()))} there"
            )
        kinds = {t.tier for t in info.tiers}
        for (node, kind), on in listed.items():
            if node == node_id and kind not in kinds:
                audit.problems.append(
                    f"{node_id}: the index names {len(on.allocs)} replicas on a {kind} tier it has not"
                )
        for usage in info.tiers:
            on = listed.get((node_id, usage.tier), _Listed())
            if usage.tier == TierKind.DISK:
                _audit_disk(audit, node_id, usage, on, (disk_dirs or {}).get(node_id))
                continue
            gpu_nodes += usage.tier == TierKind.GPU
            audit.notes.append(
                f"{node_id} {usage.tier}: agent {usage.used_bytes} B/{usage.objects} obj, "
                f"index {on.arena_bytes} B/{len(on.allocs)} obj"
            )
            if (usage.used_bytes, usage.objects) != (on.arena_bytes, len(on.allocs)):
                audit.problems.append(
                    f"{node_id} {usage.tier}: the agent holds {usage.used_bytes} B in {usage.objects} objects, "
                    f"the index names {on.arena_bytes} B in {len(on.allocs)}"
                )
    if not gpu_nodes:
        audit.notes.append(f"gpu tier: none of {len(nodes)} agents has one, not checked")
    return audit


def _audit_disk(audit: TierAudit, node_id: str, usage: TierUsage, on: _Listed, root: str | Path | None) -> None:
    raw = usage.counters.get("raw_bytes", 0)
    if usage.objects != len(on.allocs) or raw != on.raw_bytes:
        audit.problems.append(
            f"{node_id} disk: the agent holds {usage.objects} files of {raw} raw B, the index names "
            f"{len(on.allocs)} replicas of {on.raw_bytes} B"
        )
    if root is None:
        audit.problems.append(f"{node_id} disk: no directory given, its files were not checked")
        return
    files, temps = chunk_files(Path(root))
    leaked = sorted(set(files) - set(on.allocs))
    missing = sorted(set(on.allocs) - set(files))
    if leaked:
        audit.problems.append(f"{node_id} disk: {len(leaked)} chunk files no replica names (allocs {leaked[:5]})")
    if missing:
        keys = [on.allocs[a] for a in missing[:5]]
        audit.problems.append(f"{node_id} disk: {len(missing)} disk replicas with no file (keys {keys})")
    if temps:
        audit.problems.append(f"{node_id} disk: temp files left: {[p.name for p in temps[:5]]}")
    stored = sum(files.values())
    footprints = sum(usage.room_for(size, otherwise=size) for size in files.values())
    if usage.counters.get("stored_bytes", 0) != stored or usage.used_bytes != footprints:
        audit.problems.append(
            f"{node_id} disk: the agent counts {usage.counters.get('stored_bytes', 0)} B stored in "
            f"{usage.used_bytes} B of blocks, its files are {stored} B in {footprints} B"
        )
    audit.notes.append(
        f"{node_id} disk: {len(files)} files ({stored} B), index {len(on.allocs)} replicas, agent {usage.objects} obj"
    )
