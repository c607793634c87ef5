"""Loading the config tree from its layers: defaults < TOML file < MOONCAKE_* env < overrides."""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mooncake_store.config.checks import MIN_LOOP_S
from mooncake_store.config.tree import (
    _DEFAULT,
    _FIELDS,
    _FIELDS_BY_ENV,
    AgentConfig,
    ClientConfig,
    Config,
    _check,
    _check_disk,
    _check_heartbeat,
    _check_watermarks,
    _Source,
)
from mooncake_store.config.values import (
    ENV_PREFIX,
    NON_CONFIG_ENV_VARS,
)
from mooncake_store.errors import ConfigError

# --- layers -----------------------------------------------------------------------------------------


def _unknown(where: str, name: str, candidates: list[str]) -> ConfigError:
    hint = nearest_hint(name, candidates)
    return ConfigError(f"{where}: unknown key {name}{hint}")


def nearest_hint(name: str, candidates: list[str], fold: Callable[[str], str] = str.lower) -> str:
    """ " (did you mean X?)" for the nearest of ``candidates``, case aside: compared case-sensitively,
    CLIENT or HOST_BYTES was too far from client and host_bytes to get a hint at all."""
    folded = {fold(known): known for known in candidates}
    close = difflib.get_close_matches(fold(name), list(folded), n=1)
    return f" (did you mean {folded[close[0]]}?)" if close else ""


def _resolve_file(file: str | Path | None, env: Mapping[str, str]) -> tuple[Path | None, str]:
    """The config file to read, and how to name it in an error if it cannot be read."""
    if file is not None:
        if not isinstance(file, str | os.PathLike):
            raise ConfigError(
                f"config_file must be a path (str or os.PathLike), got {type(file).__name__} {file!r:.80}"
            )
        path = Path(file).expanduser()
        if not path.is_file():
            raise ConfigError(f"file {path}: does not exist or is not a file")
        return path, f"file {path}"
    from_env = env.get("MOONCAKE_CONFIG", "")
    if from_env:
        path = Path(from_env).expanduser()
        if not path.is_file():
            raise ConfigError(f"env MOONCAKE_CONFIG={from_env!r}: file does not exist or is not a file")
        return path, f"file {path}"
    # The default location follows the given env mapping, not the process's, so that callers passing
    # an explicit env (tests) get a hermetic load.
    # A relative XDG_CONFIG_HOME is to be ignored (the XDG base directory spec): taken from the
    # working directory, each directory a command ran in had a config file of its own.
    xdg = env.get("XDG_CONFIG_HOME", "")
    base = xdg if os.path.isabs(xdg) else (f"{env['HOME']}/.config" if env.get("HOME") else "")
    if base:
        path = Path(base) / "mooncake" / "config.toml"
        if path.is_file():
            return path, f"file {path}"
        if path.is_symlink() or path.exists():
            # Something is there but no file to read (a dangling link, a directory): silently
            # loading the defaults instead hid the operator's settings.
            raise ConfigError(f"file {path}: the default config file is there but is no file it can read")
    return None, ""


def config_file_path(env: Mapping[str, str] | None = None) -> Path | None:
    """The config file load_config reads when given none ($MOONCAKE_CONFIG, else
    $XDG_CONFIG_HOME/mooncake/config.toml or ~/.config/...), or None: for saying where a value came from."""
    return _resolve_file(None, os.environ if env is None else env)[0]


def _read_file(path: Path) -> dict[str, tuple[object, _Source]]:
    source = _Source(kind="file", detail=str(path))
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"file {path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        # TOMLDecodeError, UnicodeDecodeError (TOML is UTF-8), and the bare ValueError tomllib lets
        # out for an integer of more digits than int() converts (4300).
        raise ConfigError(f"file {path}: not valid TOML ({exc})") from None
    except RecursionError:
        # tomllib reads nested arrays and inline tables by recursion: a few thousand levels
        # deep, "internal error: RecursionError" was all the command said.
        raise ConfigError(f"file {path}: not valid TOML (arrays or tables nested too deep to read)") from None
    found: dict[str, tuple[object, _Source]] = {}
    where = f"file {path}"
    for name, value in data.items():
        if name in ("client", "agent"):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {name}={value!r}: expected a table [{name}]")
            for sub, sub_value in value.items():
                key = f"{name}.{sub}"
                if key not in _FIELDS:
                    raise _unknown(where, key, list(_FIELDS))
                _set_once(found, where, key, (sub_value, source))
        elif name in _FIELDS:
            _set_once(found, where, name, (value, source))
        else:
            raise _unknown(where, name, [*_FIELDS, "client", "agent"])
    return found


def _set_once(found: dict[str, tuple[object, _Source]], where: str, key: str, entry: tuple[object, _Source]) -> None:
    """TOML refuses a key given twice in one spelling, not ``"agent.x" = 1`` beside ``[agent] x = 2``:
    the last one won, unsaid."""
    if key in found:
        raise ConfigError(f"{where}: {key} is set twice (as a dotted key and in its table): keep one")
    found[key] = entry


#: Older names of config keys, still read so that deployments setting them keep working; the key's own
#: variable wins when both are set. MOONCAKE_ZONE is what the client read before client.zone existed.
#: Variables that set several keys at once: MOONCAKE_ZONE is the node's zone, for its agent and
#: its clients alike (MOONCAKE_AGENT_ZONE / MOONCAKE_CLIENT_ZONE, when set, win for their side).
_ENV_ALIASES: dict[str, tuple[str, ...]] = {"MOONCAKE_ZONE": ("agent.zone", "client.zone")}


def _read_env(env: Mapping[str, str]) -> dict[str, tuple[object, _Source]]:
    found: dict[str, tuple[object, _Source]] = {}
    for var, keys in _ENV_ALIASES.items():
        for key in keys:
            if var in env and _FIELDS[key].env_var not in env:
                found[key] = (env[var], _Source(kind="env", detail=var))
    for var in sorted(env):  # sorted: the same first error on every run
        if not var.startswith(ENV_PREFIX) or var in NON_CONFIG_ENV_VARS or var in _ENV_ALIASES:
            continue
        spec = _FIELDS_BY_ENV.get(var)
        if spec is None:
            # Compared upper-cased: MOONCAKE_AGENT_host_bytes is a case away from its variable.
            hint = nearest_hint(var, list(_FIELDS_BY_ENV), fold=str.upper)
            raise ConfigError(
                f"env {var}: unknown variable{hint}; MOONCAKE_* variables must be config keys "
                f"or one of {', '.join(sorted(NON_CONFIG_ENV_VARS | _ENV_ALIASES.keys()))}"
            )
        if spec.key == "agent.node_id" and env[var] == "":
            # As --node-id "": a compose file's ${NODE} unset, and every restart a new node.
            raise ConfigError(
                f"env {var} is empty (an unset variable where it is set?): name this node, or leave the "
                "variable out for the default id (host name and process id)"
            )
        found[spec.key] = (env[var], _Source(kind="env", detail=var))
    return found


def _read_overrides(overrides: Mapping[str, object], flags: Mapping[str, str]) -> dict[str, tuple[object, _Source]]:
    found: dict[str, tuple[object, _Source]] = {}
    for raw_key, value in overrides.items():
        if value is None:
            continue  # an argparse flag that was not given
        key = raw_key.replace("-", "_")  # accept CLI spelling, agent.host-bytes
        if key not in _FIELDS:
            raise _unknown("override", raw_key, list(_FIELDS))
        found[key] = (value, _Source(kind="override", detail=flags.get(raw_key, "")))
    return found


def load_config(
    *,
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
    override_flags: Mapping[str, str] | None = None,
) -> Config:
    """Merge defaults < file < env < overrides into one validated :class:`Config`.

    ``env=None`` reads ``os.environ``; an override whose value is None counts as not given.
    ``override_flags`` names the command-line flag each override came from, for its errors
    (``--redis-url='...': ...`` rather than ``override redis_url=...``).
    """
    return explain_config(file=file, env=env, overrides=overrides, override_flags=override_flags)[0]


def explain_config(
    *,
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
    override_flags: Mapping[str, str] | None = None,
) -> tuple[Config, dict[str, str]]:
    """:func:`load_config`, and where each dotted key's value came from: "default", "file PATH",
    "env VAR", or the flag (else "override") that set it (`mooncake config` shows them)."""
    environ: Mapping[str, str] = os.environ if env is None else env
    layered: dict[str, tuple[object, _Source]] = {}
    path, _ = _resolve_file(file, environ)
    if path is not None:
        layered.update(_read_file(path))
    layered.update(_read_env(environ))
    layered.update(_read_overrides(overrides or {}, override_flags or {}))

    defaults = Config()
    values: dict[str, object] = {}
    sources: dict[str, _Source] = {}
    for key, spec in _FIELDS.items():
        if key in layered:
            raw, source = layered[key]
            values[key] = _check(spec, raw, source)
            sources[key] = source
        else:
            holder = defaults if spec.section is None else getattr(defaults, spec.section)
            values[key] = getattr(holder, spec.name)
            sources[key] = _DEFAULT

    def as_given(key: str) -> object:
        """The value of ``key`` as the user wrote it (None: the default), for messages."""
        return layered.get(key, (None, _DEFAULT))[0]

    # A TTL given at or below the default interval, with no interval given: the interval follows
    # it (a third of it, so that two beats may be lost) rather than refusing a value the user
    # never set (`--heartbeat-ttl-s 1` exited 2 blaming the 1 s default interval).
    interval_key, ttl_key = "agent.heartbeat_interval_s", "agent.heartbeat_ttl_s"
    if sources[interval_key] is _DEFAULT and float(values[ttl_key]) <= float(values[interval_key]):  # type: ignore[arg-type]
        derived = float(values[ttl_key]) / 3  # type: ignore[arg-type]
        if derived < MIN_LOOP_S:
            # Refused in the TTL's name: the derived interval's own range check named a key the
            # user never set ("agent.heartbeat_interval_s=0.000666...: must be >= 0.001 s").
            raise ConfigError(
                f"{sources[ttl_key].label(ttl_key)}={as_given(ttl_key)!r}: must be >= {3 * MIN_LOOP_S:g} s "
                f"when {interval_key} is not set (the interval is then a third of the TTL, at least "
                f"{MIN_LOOP_S:g} s)"
            )
        values[interval_key] = derived
    # Checked here as well as in AgentConfig so the message can say where each of the two came from.
    _check_heartbeat(
        float(values["agent.heartbeat_interval_s"]),  # type: ignore[arg-type]
        float(values["agent.heartbeat_ttl_s"]),  # type: ignore[arg-type]
        sources["agent.heartbeat_interval_s"],
        sources["agent.heartbeat_ttl_s"],
        as_given=(as_given("agent.heartbeat_interval_s"), as_given("agent.heartbeat_ttl_s")),
    )

    _check_watermarks(
        float(values["agent.low_watermark"]),  # type: ignore[arg-type]
        float(values["agent.high_watermark"]),  # type: ignore[arg-type]
        sources["agent.low_watermark"],
        sources["agent.high_watermark"],
        as_given=(as_given("agent.low_watermark"), as_given("agent.high_watermark")),
    )
    _check_disk(
        str(values["agent.disk_path"]),
        int(values["agent.disk_bytes"]),  # type: ignore[call-overload]
        sources["agent.disk_path"],
        sources["agent.disk_bytes"],
        as_given=(as_given("agent.disk_path"), as_given("agent.disk_bytes")),
    )
    gpu_id_key = "agent.gpu_id"
    if sources[gpu_id_key] is not _DEFAULT and sources["agent.gpu_bytes"] is _DEFAULT:
        # As a disk directory without a capacity: a device named and no size given anywhere, the
        # agent ran with no GPU tier, saying nothing (one that cannot be made is an error). A size
        # of 0 given on purpose (a node without a GPU beside a shared file's device) still is none.
        raise ConfigError(
            f"{sources[gpu_id_key].label(gpu_id_key)}={as_given(gpu_id_key)!r}: names the GPU tier's device, but "
            "agent.gpu_bytes (--gpu-mem, env MOONCAKE_AGENT_GPU_BYTES) is not set, and without it there is no GPU "
            "tier: give its size as well, or leave the device out"
        )

    def section(name: str | None) -> dict[str, Any]:
        return {spec.name: values[key] for key, spec in _FIELDS.items() if spec.section == name}

    config = Config(
        **section(None),
        client=ClientConfig(**section("client")),
        agent=AgentConfig(**section("agent")),
    )
    return config, {key: source.describe() for key, source in sources.items()}


def agent_flag_overrides(
    *,
    redis_url: str | None,
    namespace: str | None,
    host_bytes: str | None,
    node_id: str | None,
    listen: str | None,
    zone: str | None,
    advertise: str | None,
    disk: str | None,
    disk_mem: str | None,
    gpu_mem: str | None,
    gpu_id: int | None,
    high_watermark: float | None,
    low_watermark: float | None,
    heartbeat_ttl_s: float | None,
    reserve_timeout_s: float | None,
    no_prefault: bool,
    no_spill: bool,
    no_spill_shm: bool,
) -> dict[str, object]:
    """The config overrides an agent's command-line flags make, for both entry points (``python -m
    mooncake_store.agent`` and ``mooncake agent``), so that neither can forget one. A flag not
    given (None, or a switch left off) leaves the file's or the environment's value standing."""
    if node_id == "":
        # An unset shell variable (--node-id "$NODE"): taken as "not given", every restart
        # registered a new node under the derived id (host and pid), as --redis-url "" would.
        raise ConfigError(
            "--node-id is empty (an unset shell variable?): name this node, or leave the flag out for the "
            "default id (host name and process id)"
        )
    return {
        "redis_url": redis_url,
        "namespace": namespace,
        "agent.host_bytes": host_bytes,
        "agent.node_id": node_id,
        "agent.listen": listen,
        "agent.zone": zone,
        "agent.advertise": advertise,
        "agent.disk_path": disk,
        "agent.disk_bytes": disk_mem,
        "agent.gpu_bytes": gpu_mem,
        "agent.gpu_id": gpu_id,
        "agent.high_watermark": high_watermark,
        "agent.low_watermark": low_watermark,
        "agent.heartbeat_ttl_s": heartbeat_ttl_s,
        "agent.reserve_timeout_s": reserve_timeout_s,
        "agent.prefault": False if no_prefault else None,
        "agent.spill_to_peers": False if no_spill else None,
        "agent.spill_shm": False if no_spill_shm else None,
    }


def agent_flag_names(*, host_flag: str = "--host-bytes") -> dict[str, str]:
    """The command-line flag of each override agent_flag_overrides makes, for its errors
    (``--disk-mem='12XB': ...`` rather than ``override agent.disk_bytes='12XB': ...``).
    ``host_flag``: the arena size's flag (``--host-mem`` in the ``mooncake`` CLI)."""
    return {
        "redis_url": "--redis-url",
        "namespace": "--namespace",
        "agent.host_bytes": host_flag,
        "agent.node_id": "--node-id",
        "agent.listen": "--listen",
        "agent.zone": "--zone",
        "agent.advertise": "--advertise",
        "agent.disk_path": "--disk",
        "agent.disk_bytes": "--disk-mem",
        "agent.gpu_bytes": "--gpu-mem",
        "agent.gpu_id": "--gpu-id",
        "agent.high_watermark": "--high-watermark",
        "agent.low_watermark": "--low-watermark",
        "agent.heartbeat_ttl_s": "--heartbeat-ttl-s",
        "agent.reserve_timeout_s": "--reserve-timeout-s",
        "agent.prefault": "--no-prefault",
        "agent.spill_to_peers": "--no-spill",
        "agent.spill_shm": "--no-spill-shm",
    }
