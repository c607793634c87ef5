"""``python -m mooncake_store.agent --redis-url URL --host-bytes N [--node-id ID] [--listen H:P] [--zone Z]``

Runs one node agent until SIGTERM/SIGINT, then deregisters and removes its shared-memory segment.
Prints one line ``READY {json}`` on stdout once it serves and is registered.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from types import FrameType

from mooncake_store.agent.node import Agent
from mooncake_store.config import load_config
from mooncake_store.errors import MooncakeError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mooncake_store.agent", description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", help="index server (env MOONCAKE_REDIS_URL)")
    p.add_argument("--namespace", help="key namespace (env MOONCAKE_NAMESPACE; default 'default')")
    p.add_argument("--host-bytes", help="host-DRAM arena size, e.g. 1GiB (default 1GiB)")
    p.add_argument("--node-id", help="node id (default HOSTNAME-PID)")
    p.add_argument("--listen", help="HOST:PORT for the data/control server (default 127.0.0.1:0)")
    p.add_argument("--zone", help="topology zone label (default 'default')")
    p.add_argument("--heartbeat-ttl-s", help="seconds after the last heartbeat that the node counts as dead")
    p.add_argument("--reserve-timeout-s", help="seconds after which an uncommitted reservation is reclaimed")
    p.add_argument("--no-prefault", action="store_true", help="do not touch the arena's pages at start")
    p.add_argument("--config", help="TOML config file")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        config = load_config(
            file=args.config,
            overrides={
                "redis_url": args.redis_url,
                "namespace": args.namespace,
                "agent.host_bytes": args.host_bytes,
                "agent.node_id": args.node_id,
                "agent.listen": args.listen,
                "agent.zone": args.zone,
                "agent.heartbeat_ttl_s": args.heartbeat_ttl_s,
                "agent.reserve_timeout_s": args.reserve_timeout_s,
                "agent.prefault": False if args.no_prefault else None,
            },
        )
        if not config.redis_url:
            raise MooncakeError("no Redis URL: pass --redis-url or set MOONCAKE_REDIS_URL")
        agent = Agent(config.agent, redis_url=config.redis_url, namespace=config.namespace)
    except MooncakeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        agent.start()
        ready = {
            "node_id": agent.node_id,
            "endpoint": agent.server.endpoint,
            "shm_name": agent.arena.name,
            "pid": agent.node_info().pid,
        }
        print("READY " + json.dumps(ready), flush=True)
        while not stop.wait(0.5):
            pass
    except MooncakeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        agent.stop()
        return 1
    agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
