"""The bytes a spill or a repair sends for a job not written straight from the host arena
(agent/spill.py): a GPU object copied to host memory, a chunk file as stored, or, when the copy
lands in another tier than the one it is read from (a repair with no peer that has the source's
tier: agent/repairs.py), the object in the form the peer's tier keeps: the plain bytes for its
host or GPU tier (decoded from a chunk file here; a host object's go from the arena as they are),
a chunk file for its disk tier (which the peer decodes and checks before it answers,
agent/inbox.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mooncake_store.agent.spill_jobs import SpillJob
from mooncake_store.errors import MooncakeError
from mooncake_store.tiers.chunk_format import CorruptChunk, encode_chunk
from mooncake_store.types import TierKind

if TYPE_CHECKING:
    from mooncake_store.agent.node import Agent

log = logging.getLogger("mooncake.agent")

Payload = bytes | bytearray


def read_payload(agent: Agent, job: SpillJob, source: TierKind, target: TierKind) -> Payload | None:
    """What ``job`` (an object in this agent's ``source`` tier) sends to a peer's ``target`` tier;
    None when there is nothing to send (freed meanwhile, or a damaged chunk file, whose replica
    is then dropped as a read's is). Host to host or GPU never comes here: those bytes go from the arena."""
    alloc_id = job.victim.alloc_id
    try:
        if source == TierKind.DISK:
            if target == TierKind.DISK:
                assert agent.disk is not None
                try:
                    return agent.disk.read_blob(alloc_id)  # as stored: the peer checks it whole
                except CorruptChunk:  # no longer the file that was stored: dropped, as a read's is
                    agent.check_disk_replica(alloc_id)
                    return None
            return agent.read_disk(alloc_id)  # decoded and checked here
        if source == TierKind.GPU:
            got = agent.read_gpu(alloc_id)
            if got is None or target != TierKind.DISK:
                return None if got is None else got[0]
            # The whole allocation came back: the file holds the object only.
            return _chunk_file(agent, job, memoryview(got[0])[: job.victim.size_bytes])
        # A host object comes here only for a peer's disk tier: into its host or GPU tier the
        # bytes go straight from the arena (spill.py: sent_from_arena).
        assert target == TierKind.DISK, target
        view = agent.arena.view(job.offset, job.victim.size_bytes)
        try:
            return _chunk_file(agent, job, view)
        finally:
            view.release()
    except MooncakeError as exc:  # freed meanwhile, or unreadable: nothing to send
        log.info("copy of %s to a peer's %s tier: %s", job.victim.key, target, exc)
        return None


def _chunk_file(agent: Agent, job: SpillJob, plain: memoryview) -> bytes:
    """``plain`` as the chunk file a disk tier stores, made by this agent's own tier if it has one."""
    itemsize = agent.itemsize_of(job.victim.dtype)
    if agent.disk is not None:
        return agent.disk.encode(plain, itemsize=itemsize)[0]
    return encode_chunk(plain, itemsize=itemsize)[0]


def with_payloads(
    agent: Agent, batch: list[SpillJob], source: TierKind, target: TierKind, payloads: dict[int, Payload]
) -> list[SpillJob]:
    """The jobs of a batch not sent from the host arena with their bytes read into ``payloads`` (by
    alloc id): one device-to-host copy each (fenced against frees), or the chunk file as stored
    (the sizes as the files now are), or the object in the form of another tier (read_payload).
    What cannot be read stays where it is."""
    out: list[SpillJob] = []
    for job in batch:
        payload = read_payload(agent, job, source, target)
        if payload is None:
            continue  # freed meanwhile, or damaged: nothing to send
        if target != TierKind.DISK and len(payload) < job.victim.size_bytes:
            # Plain bytes short of the object (a file that decoded to another size than the index
            # says): the reservation would be filled in part and swapped in as whole.
            log.warning("copy of %s: %d B read for %d B", job.victim.key, len(payload), job.victim.size_bytes)
            continue
        payloads[job.victim.alloc_id] = payload
        stored = len(payload) if target == TierKind.DISK else None
        out.append(SpillJob(job.victim, job.offset, stored_bytes=stored, footprint_bytes=job.footprint_bytes))
    return out
