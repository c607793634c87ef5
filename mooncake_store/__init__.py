"""mooncake-store: a distributed, tiered KV-cache store for LLM inference.

from mooncake_store import LocalCluster, connect
with LocalCluster(num_agents=2, host_bytes=256 << 20) as cluster:
    client = connect(cluster.redis_url)
    client.put("k", array)
    array = client.get("k")
"""

from mooncake_store.client.client import Client, connect
from mooncake_store.client.cluster import LocalCluster
from mooncake_store.client.prefix import PrefixCache, PrefixHit
from mooncake_store.client.stats import ClusterStats, NodeStats
from mooncake_store.errors import (
    AgentBusy,
    ConfigError,
    ConnectError,
    DtypeMismatch,
    GpuUnavailable,
    InvalidKey,
    InvalidValue,
    KeyNotFound,
    MooncakeError,
    NoCapacity,
    NotPicklable,
    ObjectPinned,
    PortInUse,
    ProtocolError,
    ReservationExpired,
    ServerError,
    StaleLocation,
    TransferError,
    TransferTimeout,
)
from mooncake_store.types import MAX_KEY_BYTES

__all__ = [
    "MAX_KEY_BYTES",
    "AgentBusy",
    "Client",
    "ClusterStats",
    "ConfigError",
    "ConnectError",
    "DtypeMismatch",
    "GpuUnavailable",
    "InvalidKey",
    "InvalidValue",
    "KeyNotFound",
    "LocalCluster",
    "MooncakeError",
    "NoCapacity",
    "NodeStats",
    "NotPicklable",
    "ObjectPinned",
    "PortInUse",
    "PrefixCache",
    "PrefixHit",
    "ProtocolError",
    "ReservationExpired",
    "ServerError",
    "StaleLocation",
    "TransferError",
    "TransferTimeout",
    "connect",
]
__version__ = "0.1.0"
