"""``python -m mooncake_store.agent --redis-url URL --host-bytes N [--node-id ID] [--listen H:P] [--zone Z]``

Runs one node agent until SIGTERM/SIGINT, then deregisters and removes its shared-memory segment.
Prints one line ``READY {json}`` on stdout once it serves and is registered.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading

from mooncake_store.agent.node import Agent
from mooncake_store.agent.takeover import StartCancelled
from mooncake_store.config import agent_flag_names, agent_flag_overrides, load_config
from mooncake_store.errors import ConfigError, MooncakeError, exit_status
from mooncake_store.watchdog import stop_on_signals, watch_parent

#: Exit codes, as the `mooncake` CLI's (cli/exits.py, errors.exit_status): 2 for bad input, 4 no
#: Redis, 5 no room (/dev/shm, the disk), 1 any other failure.
EXIT_USAGE = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mooncake_store.agent", description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", help="index server (env MOONCAKE_REDIS_URL)")
    p.add_argument("--namespace", help="key namespace (env MOONCAKE_NAMESPACE; default 'default')")
    # --host-mem as `mooncake agent` and docker-compose spell it; --host-bytes as this module always has.
    p.add_argument(
        "--host-bytes", "--host-mem", dest="host_bytes", help="host-DRAM arena size, e.g. 1GiB (default 1GiB)"
    )
    p.add_argument("--node-id", help="node id (default HOSTNAME-PID)")
    p.add_argument("--listen", help="HOST:PORT for the data/control server (default 127.0.0.1:0)")
    p.add_argument("--advertise", help="HOST:PORT that peers dial, when it differs from --listen (0.0.0.0:7000)")
    p.add_argument("--zone", help="topology zone label (default 'default')")
    p.add_argument("--heartbeat-ttl-s", help="seconds after the last heartbeat that the node counts as dead")
    p.add_argument("--reserve-timeout-s", help="seconds after which an uncommitted reservation is reclaimed")
    p.add_argument("--no-prefault", action="store_true", help="do not touch the arena's pages at start")
    p.add_argument("--disk", help="directory of the compressed disk tier (needs --disk-mem)")
    p.add_argument("--disk-mem", help="capacity of the disk tier, e.g. 20GiB (compressed bytes on disk)")
    p.add_argument("--gpu-mem", help="GPU tier size on --gpu-id (needs cupy and a CUDA device)")
    p.add_argument("--gpu-id", help="CUDA device of the GPU tier (default 0)")
    p.add_argument("--high-watermark", help="fraction of a tier past which the agent moves objects (0.90)")
    p.add_argument("--low-watermark", help="fraction it moves objects down to (0.75)")
    p.add_argument("--no-spill", action="store_true", help="never push objects to peers under pressure")
    p.add_argument("--no-spill-shm", action="store_true", help="spill to same-host peers over TCP, not shared memory")
    p.add_argument("--config", help="TOML config file")
    p.add_argument(
        "--exit-with-parent",
        type=int,
        metavar="PID",
        help="stop, as on SIGTERM, once PID is no longer this process's parent (LocalCluster passes its own)",
    )
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.exit_with_parent is not None and args.exit_with_parent <= 0:
        print(f"error: --exit-with-parent must be a process id > 0, got {args.exit_with_parent}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    stop = threading.Event()
    # Before the arena is made: a signal while it was prefaulted (seconds for gigabytes) killed
    # the agent by its default action, its arena left in /dev/shm. A hang-up too (its terminal
    # closed, as `mooncake agent` takes it).
    stop_on_signals(stop)
    try:
        config = load_config(
            file=args.config,
            overrides=agent_flag_overrides(
                redis_url=args.redis_url,
                namespace=args.namespace,
                host_bytes=args.host_bytes,
                node_id=args.node_id,
                listen=args.listen,
                zone=args.zone,
                advertise=args.advertise,
                disk=args.disk,
                disk_mem=args.disk_mem,
                gpu_mem=args.gpu_mem,
                gpu_id=args.gpu_id,
                high_watermark=args.high_watermark,
                low_watermark=args.low_watermark,
                heartbeat_ttl_s=args.heartbeat_ttl_s,
                reserve_timeout_s=args.reserve_timeout_s,
                no_prefault=args.no_prefault,
                no_spill=args.no_spill,
                no_spill_shm=args.no_spill_shm,
            ),
            override_flags=agent_flag_names(),
        )
        if not config.redis_url:
            raise ConfigError("no Redis URL: pass --redis-url or set MOONCAKE_REDIS_URL")
        agent = Agent(config.agent, redis_url=config.redis_url, namespace=config.namespace)
    except MooncakeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_status(exc)  # as the `mooncake` CLI's: 4 no Redis, 5 no room for the arena
    if args.exit_with_parent is not None:
        watch_parent(args.exit_with_parent, stop, what="agent")
    try:
        if stop.is_set():
            return 0  # told to stop while its arena was made: the finally below removes it
        agent.start(stop)
        ready = {
            "node_id": agent.node_id,
            "endpoint": agent.server.endpoint,
            "shm_name": agent.arena.name,
            "disk_dir": str(agent.disk.root.resolve()) if agent.disk is not None else "",  # for any cwd
            "pid": agent.node_info().pid,
        }
        print("READY " + json.dumps(ready), flush=True)
        agent.run_until(stop)
    except StartCancelled:
        return 0  # a stop asked for while the start waited
    except MooncakeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_status(exc)  # e.g. 2 for another agent's --advertise
    finally:
        # Whatever ended the run (a bug's exception included): deregister and remove the segment.
        agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
