"""An agent's look at the address it publishes (agent.advertise) before it registers: peers dial
that address for this node, and one that another agent answers (a copy-pasted address in a
compose file or a config) sent every put for this node to that agent, which refused them as
reservations of an agent "restarted since". One that does not answer here may still be right
(behind NAT an address need not reach back into its own host), so that is only logged."""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass

from mooncake_store.errors import ConfigError, MooncakeError, ProtocolError, TransferTimeout
from mooncake_store.tiers.host import segment_digest
from mooncake_store.transport.tcp import PeerConnections, parse_endpoint

log = logging.getLogger("mooncake.agent")

#: How long (s) the agent waits for its own advertised address to answer.
ADVERTISE_CHECK_S = 2.0
#: The least time (s) the RESP probe of a silent endpoint gets once the PING's wait has used the
#: budget: a Redis server answers a PING within a round trip.
RESP_PROBE_MIN_S = 0.25


@dataclass(frozen=True, slots=True)
class Astray:
    """Why an endpoint does not reach the agent it should: ``answered`` is False when nothing
    answers there, True when something else does (another agent, or another protocol: another
    service, or an agent of another build); ``detail`` says it in words."""

    answered: bool
    detail: str

    def __str__(self) -> str:
        return self.detail


def who_answers(endpoint: str, arena_name: str, *, timeout_s: float) -> Astray | None:
    """None when the agent whose arena is ``arena_name`` answers a PING at ``endpoint`` (or an
    agent of a build whose PING names no arena); else why not. The agent checks its own
    advertised address with it, `doctor` every node's."""
    deadline = time.monotonic() + timeout_s
    peer = PeerConnections(endpoint, timeout_s=timeout_s, max_idle=0)
    try:
        _, arena_digest = peer.identify()
    except ProtocolError as exc:  # something listens there: another service, or another build
        return Astray(True, f"answers, but not in this build's protocol ({exc})")
    except TransferTimeout as exc:
        # Connected, and silent: a Redis server waits for the end of a line that our frame never
        # sends (an --advertise copied from the Redis URL was taken, with a warning only).
        # What the PING's wait left of the budget, at least RESP_PROBE_MIN_S: with the whole
        # timeout again, a silent endpoint took twice it (an agent's start, each doctor check).
        if speaks_resp(endpoint, timeout_s=max(RESP_PROBE_MIN_S, deadline - time.monotonic())):
            return Astray(True, "answers, but as a Redis server (RESP), not in this build's protocol")
        return Astray(False, f"does not answer ({exc})")
    except MooncakeError as exc:
        return Astray(False, f"does not answer ({exc})")
    finally:
        peer.close()
    if arena_digest and arena_digest != segment_digest(arena_name):
        return Astray(True, "is answered by another agent")
    return None


def speaks_resp(endpoint: str, *, timeout_s: float) -> bool:
    """Whether ``endpoint`` answers a RESP PING as a Redis-compatible server does (PONG, or an
    error such as NOAUTH)."""
    host, port = parse_endpoint(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            reply = sock.recv(64)
    except OSError:
        return False
    return reply.startswith((b"+PONG", b"-"))


def check_advertised(advertise: str, arena_name: str, *, timeout_s: float = ADVERTISE_CHECK_S) -> None:
    """ConfigError when ``advertise`` is answered by another agent than the one whose arena is
    ``arena_name``, or by something speaking another protocol; a warning when nothing answers."""
    astray = who_answers(advertise, arena_name, timeout_s=timeout_s)
    if astray is not None and astray.answered:
        # Something else answers there: peers would send this node's reads and writes to it.
        raise ConfigError(
            f"agent.advertise={advertise!r} {astray}: peers would send this node's reads and writes there; "
            "give this node's own address (--advertise HOST:PORT)"
        )
    if astray is not None:
        log.warning(
            "agent.advertise=%s %s to this agent's own PING: peers that cannot reach it will not reach this node "
            "(behind NAT that may be as intended)",
            advertise,
            astray,
        )
