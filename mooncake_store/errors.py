"""Every error the store raises, as one tree under :class:`MooncakeError`.

::

    MooncakeError
    ├── ConfigError            bad config value, file or environment variable
    ├── InvalidKey             (also ValueError)  empty, too long, not UTF-8 text, control characters
    ├── InvalidValue           (also ValueError)  unsupported buffer, dtype, shape, or wrong ``out`` size
    │   └── DtypeMismatch      ``out``'s dtype is not the stored one (get_into writes nothing)
    ├── KeyNotFound            (also KeyError)    no COMPLETE replica on a live node
    ├── NoCapacity             no node (or tier) has room; message names the sizes
    ├── ObjectPinned           remove/replace of an object whose refcount is above zero
    ├── ConnectError           Redis or an agent cannot be reached
    │   └── AgentBusy          the agent is up but at its connection limit (it answered BUSY)
    ├── ProtocolError          a malformed or unexpected frame on the wire, or index record
    ├── TransferError          a peer failed or died mid-transfer
    │   ├── StaleLocation      the replica's generation no longer matches (freed or moved); retry
    │   └── TransferTimeout    a peer took longer than the timeout (each recv, or a whole reply)
    ├── ReservationExpired     a put took longer than the agent's reservation timeout, or its node left
    ├── NotPicklable           (also TypeError)   a Client was pickled: connect() in each process
    ├── GpuUnavailable         no usable CUDA device (cupy missing, no driver, no such device)
    └── ServerError            the embedded Redis-compatible server failed to start or stop
        └── PortInUse          the port it was given is another process's

Messages carry the offending value and the limit it broke, for example
``need 33554432 B on host; node a1 has 1048576/1073741824 B free``.
"""

from __future__ import annotations

from collections.abc import Sequence


class MooncakeError(Exception):
    """Base of every error raised by mooncake-store."""


class ConfigError(MooncakeError):
    """A configuration value, file or environment variable is invalid."""


class InvalidKey(MooncakeError, ValueError):
    """A key is not acceptable text."""


class InvalidValue(MooncakeError, ValueError):
    """A buffer, dtype, shape or output buffer is not acceptable."""


class DtypeMismatch(InvalidValue):
    """``get_into`` was given a typed buffer of another dtype than the object's (``stored``,
    ``out``: numpy's ``dtype.str``, or ``bfloat16``)."""

    # Defaults, so that it pickles (rebuilt as cls(message), its attributes then restored): a
    # process pool's worker that raised it broke the pool instead.
    def __init__(self, message: str, *, stored: str = "", out: str = "") -> None:
        super().__init__(message)
        self.stored = stored
        self.out = out


class KeyNotFound(MooncakeError, KeyError):
    """No readable replica of the key exists. ``key``: the key not found (a KeyError's args[0] is
    its message here, which quotes the key cut short)."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return str(self.args[0]) if self.args else "key not found"


class NoCapacity(MooncakeError):
    """No node has room for the object. ``permanent`` is True when waiting cannot help (the object
    is larger than every arena, or too few nodes exist for the replicas asked for).
    ``free_bytes``: what the refusing agent said it could still take, when one refused, and
    ``largest_bytes`` its largest free block (the free room may be in pieces). ``batch_limit``:
    for a batch the cluster cannot hold at once even empty, how many of its first objects, in
    order, the nodes would keep under their high watermarks (None otherwise)."""

    def __init__(
        self,
        message: str,
        *,
        permanent: bool = False,
        free_bytes: int | None = None,
        largest_bytes: int | None = None,
        batch_limit: int | None = None,
    ) -> None:
        super().__init__(message)
        self.permanent = permanent
        self.free_bytes = free_bytes
        self.largest_bytes = largest_bytes
        self.batch_limit = batch_limit


class ObjectPinned(MooncakeError):
    """The object is pinned (refcount above zero) and cannot be removed or moved. In a batch,
    ``pinned`` names the keys refused and ``done`` those of the batch that went through."""

    def __init__(self, message: str, *, pinned: Sequence[str] = (), done: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.pinned = list(pinned)
        self.done = list(done)


class ConnectError(MooncakeError):
    """Redis or an agent could not be reached."""


class AgentBusy(ConnectError):
    """An agent is up but at its connection limit: it answered BUSY and closed the connection."""


class ProtocolError(MooncakeError):
    """A frame on the wire is malformed or unexpected, or an index record is not of this build's
    making (written by hand or by another build)."""


class TransferError(MooncakeError):
    """A transfer to or from a peer failed."""


class TransferTimeout(TransferError):
    """A peer made no progress within timeout_s (stalled, or the network is)."""


class StaleLocation(TransferError):
    """A replica location no longer holds the object it was looked up for."""


class ReservationExpired(MooncakeError):
    """The agent reclaimed a reservation before the put committed. ``node_gone``: rather, a
    replica's node left the node table, missed its deadline or restarted meanwhile."""

    def __init__(self, message: str, *, node_gone: bool = False) -> None:
        super().__init__(message)
        self.node_gone = node_gone


class NotPicklable(MooncakeError, TypeError):
    """An object that holds connections and mappings (a Client) was pickled: it is also a
    TypeError, as pickle's own refusals are, for code (multiprocessing, Ray) that catches those."""


class GpuUnavailable(MooncakeError):
    """No usable CUDA device (cupy missing, no driver, or no such device)."""


class ServerError(MooncakeError):
    """The embedded Redis-compatible server could not be started or stopped."""


class PortInUse(ServerError):
    """The port the embedded server was given is held by another process (a usage error: the
    command line names another port, or none)."""


def exit_status(exc: BaseException) -> int:
    """The exit status a command ends with for ``exc``: the `mooncake` CLI's codes (cli/exits.py),
    which `python -m mooncake_store.agent` shares: 2 bad input, 3 key not found, 4 cannot connect,
    5 no room, 1 anything else. Order matters: KeyNotFound is also a KeyError, InvalidKey and
    InvalidValue are also ValueErrors."""
    if isinstance(exc, KeyNotFound):
        return 3
    if isinstance(exc, ConfigError | InvalidKey | InvalidValue):
        return 2
    if isinstance(exc, ConnectError):
        return 4
    if isinstance(exc, NoCapacity):
        return 5
    return 1


def signal_exit_status(signum: int) -> int:
    """The exit status of a command that a signal stopped, once it has cleaned up: 128 + the
    signal's number, as a shell reports a process that signal ended (130 Ctrl-C, 143 SIGTERM, 129
    SIGHUP), so a script can tell a `kill` from a Ctrl-C, and either from a failure."""
    return 128 + signum
