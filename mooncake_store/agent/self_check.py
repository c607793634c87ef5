"""An agent's look at the address it publishes (agent.advertise) before it registers: peers dial
that address for this node, and one that another agent answers (a copy-pasted address in a
compose file or a config) sent every put for this node to that agent, which refused them as
reservations of an agent "restarted since". One that does not answer here may still be right
(behind NAT an address need not reach back into its own host), so that is only logged."""

from __future__ import annotations

import logging

from mooncake_store.errors import ConfigError, MooncakeError, ProtocolError
from mooncake_store.tiers.host import segment_digest
from mooncake_store.transport.tcp import PeerConnections

log = logging.getLogger("mooncake.agent")

#: How long (s) the agent waits for its own advertised address to answer.
ADVERTISE_CHECK_S = 2.0


#: What :func:`who_answers` says of an endpoint another agent answers.
ANOTHER_AGENT = "is answered by another agent"
#: What it says (before the reason) of one that answers in another protocol: another service, or
#: an agent of a build that speaks another version.
NOT_OUR_PROTOCOL = "answers, but not in this build's protocol"


def who_answers(endpoint: str, arena_name: str, *, timeout_s: float) -> str | None:
    """None when the agent whose arena is ``arena_name`` answers a PING at ``endpoint`` (or an
    agent of a build whose PING names no arena); else why not: "does not answer (...)", or
    ANOTHER_AGENT. The agent checks its own advertised address with it, `doctor` every node's."""
    peer = PeerConnections(endpoint, timeout_s=timeout_s, max_idle=0)
    try:
        _, arena_digest = peer.identify()
    except ProtocolError as exc:  # something listens there: another service, or another build
        return f"{NOT_OUR_PROTOCOL} ({exc})"
    except MooncakeError as exc:
        return f"does not answer ({exc})"
    finally:
        peer.close()
    if arena_digest and arena_digest != segment_digest(arena_name):
        return ANOTHER_AGENT
    return None


def check_advertised(advertise: str, arena_name: str, *, timeout_s: float = ADVERTISE_CHECK_S) -> None:
    """ConfigError when ``advertise`` is answered by another agent than the one whose arena is
    ``arena_name``, or by something speaking another protocol; a warning when nothing answers."""
    problem = who_answers(advertise, arena_name, timeout_s=timeout_s)
    if problem == ANOTHER_AGENT or (problem or "").startswith(NOT_OUR_PROTOCOL):
        # Something else answers there: peers would send this node's reads and writes to it.
        who = f"{ANOTHER_AGENT}, not this one" if problem == ANOTHER_AGENT else problem
        raise ConfigError(
            f"agent.advertise={advertise!r} {who}: peers would send this node's reads and writes there; "
            "give this node's own address (--advertise HOST:PORT)"
        )
    if problem is not None:
        log.warning(
            "agent.advertise=%s %s to this agent's own PING: peers that cannot reach it will not reach this node "
            "(behind NAT that may be as intended)",
            advertise,
            problem,
        )
