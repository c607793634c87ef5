"""`mooncake agent`: one node agent in the foreground (what each node of a real cluster runs)."""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Annotated

import typer
from mooncake_cli.context import NamespaceOpt, RedisUrlOpt, err, globals_of, out
from mooncake_cli.exits import CliError, ExitCode
from mooncake_cli.state import load_state

from mooncake_store.config import (
    Config,
    agent_flag_names,
    agent_flag_overrides,
    explain_config,
    format_size,
    redact_url,
)
from mooncake_store.watchdog import stop_on_signals

if TYPE_CHECKING:
    from mooncake_store.agent.node import Agent


def agent(
    ctx: typer.Context,
    host_mem: Annotated[
        str | None,
        typer.Option("--host-mem", help="Host-DRAM arena size: 512MiB, 1GiB, 1073741824 (bytes). Default 1GiB."),
    ] = None,
    node_id: Annotated[
        str | None, typer.Option("--node-id", help="Node id, unique in the namespace. Default HOSTNAME-PID.")
    ] = None,
    listen: Annotated[
        str | None,
        typer.Option("--listen", help="HOST:PORT of the data server; use 0.0.0.0:PORT for peers on other hosts."),
    ] = None,
    advertise: Annotated[
        str | None,
        typer.Option("--advertise", help="HOST:PORT that peers dial, when it differs from --listen (0.0.0.0:PORT)."),
    ] = None,
    zone: Annotated[str | None, typer.Option("--zone", help="Topology zone (rack) label. Default 'default'.")] = None,
    disk: Annotated[str | None, typer.Option("--disk", help="Directory of the compressed disk tier.")] = None,
    disk_mem: Annotated[
        str | None, typer.Option("--disk-mem", help="Disk tier capacity (compressed bytes), e.g. 20GiB.")
    ] = None,
    gpu_mem: Annotated[
        str | None,
        typer.Option("--gpu-mem", help="GPU tier size on --gpu-id, e.g. 8GiB (needs cupy and a CUDA device)."),
    ] = None,
    gpu_id: Annotated[int | None, typer.Option("--gpu-id", help="CUDA device of the GPU tier. Default 0.")] = None,
    high_watermark: Annotated[
        float | None, typer.Option("--high-watermark", help="Tier use (0..1) past which objects move. Default 0.90.")
    ] = None,
    low_watermark: Annotated[
        float | None, typer.Option("--low-watermark", help="Tier use (0..1) moves stop at. Default 0.75.")
    ] = None,
    heartbeat_ttl_s: Annotated[
        float | None,
        typer.Option("--heartbeat-ttl-s", help="Seconds after the last heartbeat that the node counts as dead."),
    ] = None,
    reserve_timeout_s: Annotated[
        float | None,
        typer.Option("--reserve-timeout-s", help="Seconds after which an uncommitted reservation is reclaimed."),
    ] = None,
    no_prefault: Annotated[
        bool, typer.Option("--no-prefault", help="Do not touch the host arena's pages at start.")
    ] = False,
    no_spill: Annotated[bool, typer.Option("--no-spill", help="Never push objects to peers under pressure.")] = False,
    no_spill_shm: Annotated[
        bool, typer.Option("--no-spill-shm", help="Spill to same-host peers over TCP, not shared memory.")
    ] = False,
    redis_url: RedisUrlOpt = None,
    namespace: NamespaceOpt = None,
    # "\\[": the help text is rich markup, which would take "[agent]" for a style tag and drop it.
    config_file: Annotated[str | None, typer.Option("--config", help="TOML config file (\\[agent] section).")] = None,
    ready_json: Annotated[
        bool, typer.Option("--ready-json", help="Print one line READY {json} on stdout once serving (for scripts).")
    ] = False,
) -> None:
    """Run one node agent in the foreground (what docker-compose and real nodes run).

    It joins the cluster at the Redis URL and serves this node's memory until SIGTERM or Ctrl-C; then it
    deregisters and removes its shared-memory segment.
    """
    g = globals_of(ctx)

    def load(redis_url: str | None, namespace: str | None) -> tuple[Config, dict[str, str]]:
        return explain_config(
            file=config_file,
            overrides=agent_flag_overrides(
                redis_url=redis_url,
                namespace=namespace,
                host_bytes=host_mem,
                node_id=node_id,
                listen=listen,
                zone=zone,
                advertise=advertise,
                disk=disk,
                disk_mem=disk_mem,
                gpu_mem=gpu_mem,
                gpu_id=gpu_id,
                high_watermark=high_watermark,
                low_watermark=low_watermark,
                heartbeat_ttl_s=heartbeat_ttl_s,
                reserve_timeout_s=reserve_timeout_s,
                no_prefault=no_prefault,
                no_spill=no_spill,
                no_spill_shm=no_spill_shm,
            ),
            override_flags=agent_flag_names(host_flag="--host-mem"),
        )

    config, sources = load(
        g.redis_url if redis_url is None else redis_url, g.namespace if namespace is None else namespace
    )
    if not config.redis_url:
        # No cluster named anywhere (flag, env, config file): join the one `mooncake up` recorded
        # here, if it runs, as the other commands find it (the banner below says which it joined),
        # in the namespace given anywhere (flag, env, config file; "default" too), else its own.
        state = load_state()
        if state is not None and state.running():
            named = sources["namespace"] != "default"
            config, _ = load(state.redis_url, config.namespace if named else state.namespace)
    if not config.redis_url:
        raise CliError(
            "an agent needs a cluster: pass --redis-url, set MOONCAKE_REDIS_URL, or start one here with "
            "`mooncake up --detach`",
            ExitCode.CANNOT_CONNECT,
        )
    # Imported here: every other command (put, get, ls, ...) would load the agent's ~40 modules
    # for nothing, and the CLI's start-up is most of a short command's time.
    from mooncake_store.agent.node import Agent

    stop = threading.Event()
    stop_on_signals(stop)
    node = Agent(config.agent, redis_url=config.redis_url, namespace=config.namespace)
    try:
        _serve(node, config, stop, ready_json=ready_json)
    finally:
        node.stop()
    err.print(f"agent {node.node_id} stopped")


def _serve(node: Agent, config: Config, stop: threading.Event, *, ready_json: bool) -> None:
    """Start ``node`` and serve until ``stop``; a stop asked for while its arena was made, or
    while its start waited for its node id, ends it before it serves."""
    from mooncake_store.agent.takeover import StartCancelled

    if stop.is_set():
        return
    try:
        node.start(stop)
    except StartCancelled:
        return
    info = node.node_info()
    if ready_json:
        ready = {
            "node_id": node.node_id,
            "endpoint": info.tcp_endpoint,
            "shm_name": info.shm_name,
            "disk_dir": str(node.disk.root.resolve()) if node.disk is not None else "",  # as the module's
            "pid": info.pid,
        }
        print("READY " + json.dumps(ready), flush=True)
    else:
        out.print(
            f"[green]✓[/green] agent {node.node_id} serving {info.tcp_endpoint}, "
            f"{format_size(config.agent.host_bytes)} host arena /dev/shm/{info.shm_name}, "
            f"zone {config.agent.zone}, index {redact_url(config.redis_url)} namespace {config.namespace}"
        )
    node.run_until(stop)  # a MooncakeError (taken over while stalled) exits 1 through main's handler
