"""`mooncake doctor`: checks the things that break a cluster, one explained line each."""

from __future__ import annotations

import importlib.util
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from enum import StrEnum

import redis
import typer
from mooncake_cli.context import (
    JsonOpt,
    NamespaceOpt,
    RedisUrlOpt,
    Target,
    out,
    quiet_stdout,
    recorded_cluster_advice,
    require_stdout,
    resolve_target,
)
from mooncake_cli.exits import CliError, ExitCode, code_for
from rich.markup import escape

from mooncake_store.agent.self_check import who_answers
from mooncake_store.config import format_size
from mooncake_store.errors import MooncakeError
from mooncake_store.index import RedisIndex
from mooncake_store.index.connection import connect_redis
from mooncake_store.tiers.host import SHM_DIR
from mooncake_store.types import NodeInfo

#: Docker's default /dev/shm is 64 MiB: far too small for an arena, and the commonest setup mistake.
SHM_WARN_BYTES = 1 << 30
#: Leases, heartbeat deadlines, graves and the ages `stat` shows all run on the index server's
#: clock (hosts only measure durations, on their monotonic clocks): a host's skew changes none of
#: them. Past this it is still worth a warning: logs of this host and the server disagree.
SKEW_WARN_MS = 1000


class Status(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


_MARK = {Status.OK: "[green]✓[/green]", Status.WARN: "[yellow]![/yellow]", Status.FAIL: "[red]✗[/red]",
         Status.SKIP: "[dim]-[/dim]"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    detail: str


def _redis_checks(target: Target) -> tuple[list[Check], ExitCode | None]:
    """The index's checks, and the exit code its failure gives (None: it was reached)."""
    checks: list[Check] = []
    try:
        conn = connect_redis(target.redis_url, timeout_s=3.0, advice=recorded_cluster_advice(target))
    except MooncakeError as exc:
        # A URL the server refuses (a database it lacks) is bad input, as in every other command.
        return [Check("redis", Status.FAIL, str(exc))], code_for(exc)
    try:
        info = conn.info("server")
        name = info.get("server_name") or ("valkey" if "valkey_version" in info else "redis")
        version = info.get("valkey_version") or info.get("redis_version")
        checks.append(Check("redis", Status.OK, f"{name} {version} at {target.shown_url} (from {target.source})"))
        # Skew: the server's TIME against the midpoint of the round trip.
        before = time.time()
        secs, micros = conn.time()
        after = time.time()
        skew_ms = (secs + micros / 1e6 - (before + after) / 2) * 1000
        rtt_ms = (after - before) * 1000
        skew = abs(skew_ms)
        status = Status.OK if skew < SKEW_WARN_MS else Status.WARN
        checks.append(
            Check(
                "clock",
                status,
                f"skew against Redis {skew_ms:+.1f} ms (round trip {rtt_ms:.1f} ms); leases and heartbeats "
                "run on the server's clock, which must not step (slewed by chrony or ntpd)",
            )
        )
        index = RedisIndex(target.redis_url, namespace=target.namespace, timeout_s=3.0)
        evicting = index.eviction_unsafe()
        status = Status.WARN if evicting else Status.OK
        checks.append(Check("eviction", status, evicting or "maxmemory-policy noeviction: no index key is dropped"))
        try:
            nodes = index.nodes()
            now_ms = index.server_time_ms()
        finally:
            index.close()
        alive = [n for n in nodes.values() if n.heartbeat_deadline_ms >= now_ms]
        dead = sorted(n.node_id for n in nodes.values() if n.heartbeat_deadline_ms < now_ms)
        if not nodes:
            checks.append(
                Check(
                    "agents",
                    Status.FAIL,
                    f"no agent registered in namespace {target.namespace!r}: "
                    "start one with `mooncake agent` or `mooncake up`",
                )
            )
        else:
            cap = sum(t.capacity_bytes for n in alive for t in n.tiers)
            detail = f"{len(alive)} of {len(nodes)} alive in namespace {target.namespace!r}, {format_size(cap)} total"
            if dead:
                detail += f"; past their heartbeat deadline: {', '.join(dead[:5])}"
            checks.append(
                Check("agents", Status.OK if not dead and alive else Status.WARN if alive else Status.FAIL, detail)
            )
            if alive:
                checks.append(_endpoint_check(alive))
    except redis.RedisError as exc:
        checks.append(Check("redis", Status.FAIL, f"{target.shown_url} answered PING but then failed: {exc}"))
    finally:
        conn.close()
    return checks, None


#: How long (s) doctor waits for each agent's endpoint to answer its PING.
ENDPOINT_PING_S = 2.0


def _ping_problem(node: NodeInfo) -> str | None:
    """Why ``node``'s published endpoint does not reach it, or None."""
    astray = who_answers(node.tcp_endpoint, node.shm_name, timeout_s=ENDPOINT_PING_S)
    return None if astray is None else f"{node.node_id} at {node.tcp_endpoint} {astray}"


def _endpoint_check(alive: list[NodeInfo]) -> Check:
    """Each live agent's endpoint, dialled from here as a client dials it: a node whose address
    is wrong (an agent.advertise nothing listens on, another node's, a host out of reach from
    here) stays alive in the node table by its heartbeats, and every put or read sent to it fails."""
    with ThreadPoolExecutor(max_workers=min(16, len(alive))) as pool:
        problems = [p for p in pool.map(_ping_problem, alive) if p]
    if not problems:
        return Check("endpoints", Status.OK, f"{len(alive)} of {len(alive)} live agents answer at their endpoints")
    shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
    status = Status.FAIL if len(problems) == len(alive) else Status.WARN
    return Check("endpoints", status, f"{len(problems)} of {len(alive)} live agents unreachable from here: {shown}")


def _shm_check() -> Check:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError as exc:
        return Check(
            "shm",
            Status.FAIL,
            f"{SHM_DIR} is not available ({exc.strerror}): the shm transport and host arenas need it",
        )
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    writable = os.access(SHM_DIR, os.W_OK)
    detail = f"{SHM_DIR} {format_size(free)} free of {format_size(total)}"
    if not writable:
        return Check("shm", Status.FAIL, detail + "; not writable by this user")
    if total < SHM_WARN_BYTES:
        return Check("shm", Status.WARN, detail + "; small for arenas (in Docker raise shm_size)")
    return Check("shm", Status.OK, detail)


#: Where the kernel lists its verbs devices; without it libibverbs finds none, and pyverbs says
#: only "Failed to get devices list" (rdma-core's check_abi_version reads it first).
VERBS_SYSFS = "class/infiniband_verbs"


def _rdma_check() -> Check:
    if importlib.util.find_spec("pyverbs") is None:
        return Check("rdma", Status.SKIP, "pyverbs not installed (rdma-core's Python bindings): RDMA unavailable")
    sysfs = os.path.join(os.environ.get("SYSFS_PATH", "/sys"), VERBS_SYSFS)
    if not os.path.isdir(sysfs):
        why = f"no RDMA kernel support ({sysfs} missing: no RDMA device, or ib_uverbs not loaded)"
        return Check("rdma", Status.SKIP, why)
    try:
        import pyverbs.device as device  # type: ignore[import-not-found]

        names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in device.get_device_list()]
    except Exception as exc:  # any failure of a native binding means "no RDMA here", not a crash
        return Check("rdma", Status.WARN, f"pyverbs is installed but listing devices failed: {exc}")
    if not names:
        return Check("rdma", Status.SKIP, "pyverbs installed, no RDMA devices")
    # Said plainly: a ✓ beside devices read as "data goes over RDMA".
    found = f"devices: {', '.join(names)} (no RDMA transport is built yet: data goes over shm and tcp)"
    return Check("rdma", Status.OK, found)


def _gpu_check() -> Check:
    if importlib.util.find_spec("cupy") is None:
        return Check("gpu", Status.SKIP, "cupy not installed: no GPU tier (pip install 'mooncake-store[gpu]')")
    try:
        import cupy  # type: ignore[import-not-found]

        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no driver, no device: cupy raises its own runtime errors
        return Check("gpu", Status.WARN, f"cupy is installed but found no usable CUDA device: {exc}")
    if count < 1:  # a driver with every device hidden (CUDA_VISIBLE_DEVICES="") answers 0
        return Check("gpu", Status.WARN, "cupy is installed but sees no CUDA device: no GPU tier")
    return Check("gpu", Status.OK, f"{count} CUDA device(s) via cupy")


def doctor(
    ctx: typer.Context,
    as_json: JsonOpt = False,
    redis_url: RedisUrlOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Check the cluster and this machine, one explained line each.

    Redis reachable and its version, agents alive, each live agent's endpoint answering from here,
    clock skew against Redis, /dev/shm size, and the transports this machine has (shm, tcp, rdma via
    pyverbs, GPUs via cupy). Exits 2 for a bad Redis URL (a database the server lacks included), 4 when
    Redis cannot be reached, 1 when another check fails, 0 otherwise (warnings included).
    """
    require_stdout()
    checks: list[Check] = []
    failed: ExitCode | None = ExitCode.CANNOT_CONNECT
    try:
        target = resolve_target(ctx, redis_url, namespace)
    except CliError as exc:
        checks.append(Check("redis", Status.FAIL, str(exc)))
        # Its own code: 2 for a bad URL, 4 for no cluster to reach, 1 for a damaged state file (as
        # every other command gives; mapping all but 2 to 4 told a script to retry a file to delete).
        failed = exc.code
    else:
        redis_checks, failed = _redis_checks(target)
        checks.extend(redis_checks)
    checks.append(_shm_check())
    checks.append(Check("tcp", Status.OK, "always available (loopback and network)"))
    checks.append(_rdma_check())
    checks.append(_gpu_check())
    if failed is not None:
        code = failed
    else:
        code = ExitCode.ERROR if any(c.status == Status.FAIL for c in checks) else ExitCode.OK
    try:
        if as_json:
            out.print_json_document([{**asdict(c), "status": str(c.status)} for c in checks])
        else:
            width = max(len(c.name) for c in checks)
            for c in checks:
                out.print(f"{_MARK[c.status]} {c.name:<{width}}  {escape(c.detail)}", highlight=False)
    except BrokenPipeError:
        # `mooncake doctor | head -1`: the reader left, but a failed check still fails the command.
        quiet_stdout()
        raise typer.Exit(code) from None
    if code != ExitCode.OK:
        raise typer.Exit(code)
