"""`mooncake config`: every configuration value in effect here, and the layer it came from."""

from __future__ import annotations

from typing import Any

import typer
from mooncake_cli.context import JsonOpt, NamespaceOpt, RedisUrlOpt, explain_here, out, require_stdout, wide_out
from mooncake_cli.state import load_state, state_path
from rich.table import Table
from rich.text import Text

from mooncake_store.config import config_file_path, format_size, redact_url


def _flat(values: dict[str, Any]) -> dict[str, Any]:
    """Config.as_dict()'s nested sections as dotted keys ("agent.host_bytes")."""
    flat: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, dict):
            flat.update({f"{name}.{sub}": sub_value for sub, sub_value in value.items()})
        else:
            flat[name] = value
    return flat


def _shown(key: str, value: Any) -> str:
    if value is None:
        return "(none)"
    if value == "":
        return '""'
    if isinstance(value, bool):
        return str(value).lower()  # as TOML and the env variables spell it
    if key.endswith("_bytes") and isinstance(value, int):
        return f"{format_size(value)} ({value} B)" if value >= 1024 else f"{value} B"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def config(
    ctx: typer.Context,
    as_json: JsonOpt = False,
    redis_url: RedisUrlOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Show every configuration value in effect for this shell, and where each came from: the
    default, the config file, a MOONCAKE_* variable, a flag, or (the URL, and the namespace when
    none is given) the cluster `mooncake up` recorded here, as the other commands take them.

    Layers, lowest first: defaults, the config file ($MOONCAKE_CONFIG, else
    $XDG_CONFIG_HOME/mooncake/config.toml where that is an absolute path, else
    ~/.config/mooncake/config.toml), MOONCAKE_* variables, flags. A value that fails its check is
    an error here too, naming the layer. Agents started by `mooncake up` take their own flags on
    top of this (see `mooncake up --help`). The password of a URL is never shown."""
    require_stdout()
    loaded, sources = explain_here(ctx, redis_url, namespace)
    values = _flat(loaded.as_dict())
    file = config_file_path()
    state = load_state() if loaded.redis_url is None else None
    if loaded.redis_url is not None:
        cluster = "the index at redis_url"
    elif state is not None:
        cluster = f"the cluster recorded in {state_path()}"
        # What the other commands use with no URL given (context.resolve_target): the recorded
        # cluster's URL, and its namespace unless one was given anywhere. Shown as the defaults,
        # the namespace read "default" while `ls` and `get` worked in the recorded one.
        recorded = f"state file {state_path()}"
        values["redis_url"], sources["redis_url"] = redact_url(state.redis_url), recorded
        if sources["namespace"] == "default":
            values["namespace"], sources["namespace"] = state.namespace, recorded
    else:
        cluster = "none: no redis_url, and no cluster recorded (`mooncake up` starts one)"
    if as_json:
        out.print_json_document(
            {
                "config_file": str(file) if file else None,
                "cluster": cluster,
                "values": {key: {"value": values[key], "source": sources[key]} for key in sources},
            }
        )
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    table.add_column("key", no_wrap=True)
    table.add_column("value", overflow="fold")
    table.add_column("from", style="dim", overflow="fold")
    for key, source in sources.items():
        # Text, never markup: a value such as a path or a namespace may hold "[...]".
        emphasis = "" if source == "default" else "bold"
        table.add_row(Text(key), Text(_shown(key, values[key])), Text(source, style=emphasis))
    out.print(Text.assemble(("config file ", "dim"), str(file) if file else "(none found)"))
    out.print(Text.assemble(("commands talk to ", "dim"), cluster))
    # Into a pipe or a file, each row whole on its line (a path folded there could not be copied
    # back out); on a terminal, folded to its width.
    (out if out.is_terminal else wide_out).print(table)
