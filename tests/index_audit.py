"""An audit of the index's bookkeeping: every rule the Lua scripts keep between them, checked over
one whole namespace of a real server. Tests call it after the scripts under test have run (and
while nothing else writes the namespace) and assert that it finds nothing."""

from __future__ import annotations

import json
import time

from mooncake_store.index.client import RedisIndex
from mooncake_store.index.schema import decode_replicas


def _scan(index: RedisIndex, what: str) -> list[str]:
    return [k[len(index.prefix) :] for k in index.redis.scan_iter(match=index.prefix + what, count=1000)]


def audit_index(index: RedisIndex) -> list[str]:
    """The problems found: the keys set, nobj:<node>, tobj:<node>:<tier>, gc:<node>, acks:<node>,
    the children counts and kids sets and pending records, each against the object records."""
    r, p = index.redis, index.prefix
    problems: list[str] = []
    objects: dict[str, dict[str, str]] = {}
    for name in _scan(index, "o:*"):
        objects[name[2:]] = r.hgetall(p + name)
    keys = set(r.smembers(p + "keys"))
    if keys != set(objects):
        problems.append(f"keys set {sorted(keys)} != object records {sorted(objects)}")
    named: set[tuple[str, str]] = set()
    parents: dict[str, int] = {}
    for key, rec in objects.items():
        for rep in decode_replicas(rec.get("replicas", "[]")):
            named.add((rep.node_id, str(rep.alloc_id)))
            if not r.sismember(p + "nobj:" + rep.node_id, key):
                problems.append(f"{key} has a replica on {rep.node_id} but is not in nobj:{rep.node_id}")
            tier_set = f"tobj:{rep.node_id}:{rep.tier}"
            if not r.sismember(p + tier_set, key):
                problems.append(f"{key} has a replica on {rep.node_id}'s {rep.tier} tier but is not in {tier_set}")
            if r.zscore(p + "gc:" + rep.node_id, str(rep.alloc_id)) is not None:
                problems.append(f"{key} names alloc {rep.alloc_id} on {rep.node_id}, which is in its graveyard")
        if rec.get("chain_parent"):
            parents[rec["chain_parent"]] = parents.get(rec["chain_parent"], 0) + 1
    for name in _scan(index, "nobj:*"):
        node = name[5:]
        for key in r.smembers(p + name):
            reps = decode_replicas(objects[key]["replicas"]) if key in objects else ()
            if not any(rep.node_id == node for rep in reps):
                problems.append(f"nobj:{node} lists {key}, which has no replica there")
    for name in _scan(index, "tobj:*"):
        node, _, tier = name[5:].rpartition(":")
        for key in r.smembers(p + name):
            reps = decode_replicas(objects[key]["replicas"]) if key in objects else ()
            if not any(rep.node_id == node and str(rep.tier) == tier for rep in reps):
                problems.append(f"{name} lists {key}, which has no replica on that tier")
    for name in _scan(index, "acks:*"):
        node = name[5:]
        for ack in r.lrange(p + name, 0, -1):
            alloc = ack.partition("\t")[0]
            if (node, alloc) not in named and r.zscore(p + "gc:" + node, alloc) is None:
                problems.append(f"acks:{node} acks alloc {alloc}, which no object names and no grave holds")
    children = {k: int(v) for k, v in r.hgetall(p + "children").items()}
    if children != parents:
        problems.append(f"children counts {children} != chain parents of the stored objects {parents}")
    kids = {name[5:]: r.smembers(p + name) for name in _scan(index, "kids:*")}
    named_kids: dict[str, set[str]] = {}
    for key, rec in objects.items():
        if rec.get("chain_parent"):
            named_kids.setdefault(rec["chain_parent"], set()).add(key)
    if kids != named_kids:
        problems.append(f"kids sets {kids} != the stored chunks naming each parent {named_kids}")
    for name in _scan(index, "pend:*"):
        if r.type(p + name) != "hash":
            continue  # a move's guard record
        entry = json.loads(r.hget(p + name, "entry") or "{}")
        for rep in entry.get("replicas", []):
            if (rep[0], str(rep[4])) in named:
                problems.append(f"{name} is still pending although an object names its alloc {rep[4]}")
    return problems


def settled_audit(index: RedisIndex, timeout_s: float = 5.0) -> list[str]:
    """audit_index once the namespace holds still: agents may be between the steps of a move (the
    audit reads key by key, not atomically), so it is taken again until it finds nothing or
    ``timeout_s`` passes; returns the last problems found."""
    deadline = time.monotonic() + timeout_s
    while True:
        problems = audit_index(index)
        if not problems or time.monotonic() >= deadline:
            return problems
        time.sleep(0.1)
