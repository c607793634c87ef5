"""The config tree (frozen dataclasses), its table of fields, and the checks that span several fields.

The per-value checks live in ``checks.py`` and the field and source types in ``fields.py``; the table
itself is built here because it is derived from the dataclasses, which check themselves on creation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from mooncake_store.config.checks import _KIND_NAMES, _check, _fail, _type_ok
from mooncake_store.config.fields import _CODE, _build_fields, _Field, _Source

# Re-exported (the redundant alias marks it so): loader.py takes _DEFAULT, like the table, from here.
from mooncake_store.config.fields import _DEFAULT as _DEFAULT
from mooncake_store.config.values import is_wildcard_host, redact_url, split_host_port
from mooncake_store.errors import ConfigError

# --- the tree ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientConfig:
    transports: tuple[str, ...] = ("shm", "tcp")  # subset of CONFIG_TRANSPORTS, tried in this order
    timeout_s: float = 10.0  # every socket operation and wait
    lease_ms: int = 5000  # read lease granted by a lookup
    tcp_connections: int = 4  # connections per peer for large objects
    stripe_bytes: int = 4 << 20  # objects above this are split across connections
    io_threads: int = 8  # runs the futures of get_async/put_async
    max_retries: int = 3
    verify_checksum: bool = False
    # Device reads of same-host host-tier objects page-lock the agent's mapped arena on first use
    # (cudaHostRegister, a one-time cost per arena): host to device then runs at DMA speed.
    pin_shared_arenas: bool = True
    # The writer's topology zone: placement prefers the least loaded node of this zone. Also read
    # from MOONCAKE_ZONE (loader._ENV_ALIASES), the variable the client used before this field.
    zone: str = "default"

    def __post_init__(self) -> None:
        _validate_instance(self, "client")


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentConfig:
    node_id: str = ""  # "" -> derived at start
    host_bytes: int = 1 << 30
    listen: str = "127.0.0.1:0"  # HOST:PORT of the TCP transport
    advertise: str = ""  # HOST:PORT peers should dial ("" -> the bound address of listen)
    zone: str = "default"
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 5.0  # must exceed heartbeat_interval_s
    reserve_timeout_s: float = 30.0  # reservations never committed are reclaimed after this
    sync_interval_s: float = 0.2
    prefault: bool = True
    # Memory pressure: past high_watermark of a tier's capacity the agent moves its coldest
    # objects (demote to its next tier, else spill to a peer, else evict) until under low_watermark.
    high_watermark: float = 0.90
    low_watermark: float = 0.75
    pressure_interval_s: float = 0.2
    spill_to_peers: bool = True
    # A peer on this host gets spilled host-tier objects by one memcpy into its shared arena
    # (the shm path, as a same-host client put); false: every spill goes over TCP.
    spill_shm: bool = True
    disk_path: str = ""  # "" -> no disk tier
    disk_bytes: int = 0  # capacity of the disk tier (what its files take on the filesystem)
    promote_on_read: bool = True  # a read of a disk replica brings the object back to host memory
    gpu_bytes: int = 0  # 0 -> no GPU tier
    gpu_id: int = 0

    def __post_init__(self) -> None:
        _validate_instance(self, "agent")

    def check_published_endpoint(self) -> None:
        """Peers dial the published endpoint, and a wildcard bind address (0.0.0.0, ::) dialled from
        another host is that host itself: the node would be unreachable, or, with the same fixed
        port on every node, clients would talk to the wrong agent. Checked by the agent and by
        `mooncake up` before it starts anything, not when a config is loaded: a client loading the
        same file has no use for the agent's endpoint."""
        host, listen_port = split_host_port(self.listen, what="agent.listen")
        if self.advertise:
            if listen_port == 0:
                # The port bound is any free one, a new one at each start: none a fixed advertised
                # port (or a port mapping onto it) could name.
                raise ConfigError(
                    f"agent.advertise={self.advertise!r} names a port, but agent.listen={self.listen!r} binds "
                    "any free port (0), which the advertised one cannot match: give agent.listen that port "
                    "(--listen HOST:PORT), or leave agent.advertise out"
                )
            return
        if is_wildcard_host(host):
            raise ConfigError(
                f"agent.listen={self.listen!r} binds every interface, and peers cannot dial {host}: set "
                "agent.advertise (--advertise HOST:PORT, env MOONCAKE_AGENT_ADVERTISE) to an address of this "
                "node that peers can reach"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    redis_url: str | None = None  # redis://, rediss:// or unix://; None -> an embedded server
    namespace: str = "default"  # prefix of every Redis key, so deployments can share one server
    client: ClientConfig = field(default_factory=ClientConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.client, ClientConfig):
            raise ConfigError(f"client={self.client!r}: expected a ClientConfig")
        if not isinstance(self.agent, AgentConfig):
            raise ConfigError(f"agent={self.agent!r}: expected an AgentConfig")
        _validate_instance(self, None)

    def as_dict(self) -> dict[str, Any]:
        """Plain nested dict (password redacted), for `mooncake config` and logs."""
        out = asdict(self)
        if self.redis_url is not None:
            out["redis_url"] = redact_url(self.redis_url)
        return out


# --- field table ------------------------------------------------------------------------------------

_FIELDS: dict[str, _Field] = _build_fields(((None, Config), ("client", ClientConfig), ("agent", AgentConfig)))
_FIELDS_BY_ENV: dict[str, _Field] = {spec.env_var: spec for spec in _FIELDS.values()}


# --- checks that span fields, for the dataclasses and for loader.py --------------------------------


def _validate_instance(obj: object, section: str | None) -> None:
    """Checks for dataclasses built in code (tests, embedding apps): strict types, same ranges."""
    for f in fields(obj):  # type: ignore[arg-type]
        spec = _FIELDS.get(f.name if section is None else f"{section}.{f.name}")
        if spec is None:
            continue  # the nested client/agent sections validate themselves
        value = getattr(obj, f.name)
        if not _type_ok(spec.kind, value):
            wanted = _KIND_NAMES[spec.kind]
            raise _fail(spec, value, _CODE, f"expected {wanted}, got {type(value).__name__}")
        if spec.kind == "optstr" and value == "":
            raise _fail(spec, value, _CODE, "use None, not an empty string, for no URL")
        _check(spec, value, _CODE)
    if section == "agent":
        assert isinstance(obj, AgentConfig)
        _check_heartbeat(obj.heartbeat_interval_s, obj.heartbeat_ttl_s, _CODE, _CODE)
        _check_watermarks(obj.low_watermark, obj.high_watermark, _CODE, _CODE)
        _check_disk(obj.disk_path, obj.disk_bytes, _CODE, _CODE)


@dataclass(frozen=True, slots=True)
class _Side:
    """One of two values that must be in order: its key, value, text as given, source, and what
    it must be against the other ("must be below")."""

    key: str
    value: object
    raw: object
    src: _Source
    must: str


def _refuse_pair(first: _Side, second: _Side) -> ConfigError:
    """The error for two values out of order. It blames ``first``, unless only ``second`` was set:
    then the other's default is not the mistake."""
    blamed, other = (second, first) if first.src == _DEFAULT and second.src != _DEFAULT else (first, second)
    against = f"{other.key}={other.value!r} (from {other.src.describe()})"
    return _fail(_FIELDS[blamed.key], blamed.raw, blamed.src, f"{blamed.must} {against}")


def _check_watermarks(
    low: float, high: float, low_src: _Source, high_src: _Source, *, as_given: tuple[object, object] = (None, None)
) -> None:
    """``as_given`` is (low, high) as the user wrote them, so the message quotes their text."""
    # With low >= high the agent would start moving objects and never reach its stopping point.
    if low < high:
        return
    low_raw = low if as_given[0] is None else as_given[0]
    high_raw = high if as_given[1] is None else as_given[1]
    raise _refuse_pair(
        _Side("agent.low_watermark", low, low_raw, low_src, "must be below"),
        _Side("agent.high_watermark", high, high_raw, high_src, "must be above"),
    )


def _check_disk(
    path: str, size: int, path_src: _Source, size_src: _Source, *, as_given: tuple[object, object] = (None, None)
) -> None:
    """The disk tier needs both its directory and its capacity; one without the other is a mistake
    (the agent would otherwise silently run with no disk tier). ``as_given``: (path, size) as written."""
    path_raw = path if as_given[0] is None else as_given[0]
    size_raw = size if as_given[1] is None else as_given[1]
    if size and not path:
        raise _fail(
            _FIELDS["agent.disk_bytes"],
            size_raw,
            size_src,
            "needs agent.disk_path (the directory of the disk tier, --disk) to be set as well",
        )
    if path and not size:
        raise _fail(
            _FIELDS["agent.disk_path"],
            path_raw,
            path_src,
            f"needs agent.disk_bytes > 0 (the disk tier's capacity, --disk-mem), but agent.disk_bytes={size_raw!r} "
            f"(from {size_src.describe()})",
        )


def _check_heartbeat(
    interval: float,
    ttl: float,
    interval_src: _Source,
    ttl_src: _Source,
    *,
    as_given: tuple[object, object] = (None, None),
) -> None:
    """``as_given`` is (interval, TTL) as the user wrote them, so the message quotes their text."""
    # A TTL at or below the interval lets a healthy node's entry expire between two heartbeats.
    if ttl <= interval:
        interval_raw = interval if as_given[0] is None else as_given[0]
        ttl_raw = ttl if as_given[1] is None else as_given[1]
        raise _refuse_pair(
            _Side("agent.heartbeat_ttl_s", ttl, ttl_raw, ttl_src, "must be greater than"),
            _Side("agent.heartbeat_interval_s", interval, interval_raw, interval_src, "must be below"),
        )
