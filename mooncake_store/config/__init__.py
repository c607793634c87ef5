"""One configuration tree for the client and the agent, loaded once per process.

Layers, lowest to highest precedence::

    defaults  <  TOML file  <  MOONCAKE_* environment  <  explicit overrides (CLI flags)

The file is ``file=`` if given, else ``$MOONCAKE_CONFIG``, else ``$XDG_CONFIG_HOME/mooncake/config.toml``
(``~/.config/mooncake/config.toml``) when it exists. Its layout::

    redis_url = "redis://127.0.0.1:6379/0"
    namespace = "default"
    [client]
    timeout_s = 10.0
    [agent]
    host_bytes = "4GiB"

Environment variables are ``MOONCAKE_REDIS_URL``, ``MOONCAKE_NAMESPACE``, ``MOONCAKE_CLIENT_<FIELD>`` and
``MOONCAKE_AGENT_<FIELD>``. Overrides use dotted keys (``{"agent.host_bytes": "1GiB"}``).

Every mistake raises :class:`ConfigError` naming the key, the bad value and the layer it came from, e.g.
``env MOONCAKE_AGENT_HOST_BYTES='12x': not a size (examples: 512MiB, 1GiB, 1073741824)``. A typo must
never be silently ignored: a misspelt ``host_bytes`` would otherwise leave an agent with the 1 GiB default.
"""

from __future__ import annotations

from mooncake_store.config.loader import (
    agent_flag_names,
    agent_flag_overrides,
    config_file_path,
    explain_config,
    load_config,
)
from mooncake_store.config.tree import (
    AgentConfig,
    ClientConfig,
    Config,
)
from mooncake_store.config.values import (
    CONFIG_TRANSPORTS,
    ENV_PREFIX,
    NON_CONFIG_ENV_VARS,
    format_size,
    is_ascii_digits,
    is_wildcard_host,
    parse_size,
    redact_url,
    split_host_port,
)

__all__ = [
    "CONFIG_TRANSPORTS",
    "ENV_PREFIX",
    "NON_CONFIG_ENV_VARS",
    "AgentConfig",
    "ClientConfig",
    "Config",
    "agent_flag_names",
    "agent_flag_overrides",
    "config_file_path",
    "explain_config",
    "format_size",
    "is_ascii_digits",
    "is_wildcard_host",
    "load_config",
    "parse_size",
    "redact_url",
    "split_host_port",
]
