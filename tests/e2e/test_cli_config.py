"""`mooncake config`: the values in effect and the layer each came from (default < file < env <
flag), with a URL's password hidden and a bad value refused as everywhere else."""

from __future__ import annotations

import json
from pathlib import Path

from .conftest import Mooncake, assert_one_line_error


def _write_config(mooncake: Mooncake, text: str) -> Path:
    path = Path(mooncake.env["XDG_CONFIG_HOME"]) / "mooncake" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_each_value_names_the_layer_it_came_from(mooncake: Mooncake) -> None:
    path = _write_config(mooncake, 'namespace = "from-file"\n[agent]\nhost_bytes = "2GiB"\nzone = "file-zone"\n')
    env = {"MOONCAKE_AGENT_ZONE": "env-zone", "MOONCAKE_REDIS_URL": "redis://:sekrit@127.0.0.1:6399/0"}
    result = mooncake.ok("--namespace", "from-flag", "config", "--json", env=env)
    doc = json.loads(result.stdout)
    values = doc["values"]
    assert doc["config_file"] == str(path)
    assert values["namespace"] == {"value": "from-flag", "source": "--namespace"}
    assert values["agent.host_bytes"] == {"value": 2 << 30, "source": f"file {path}"}
    assert values["agent.zone"] == {"value": "env-zone", "source": "env MOONCAKE_AGENT_ZONE"}
    assert values["client.timeout_s"]["source"] == "default"
    assert values["redis_url"]["source"] == "env MOONCAKE_REDIS_URL"
    assert "sekrit" not in result.stdout.decode() and "***" in values["redis_url"]["value"]
    # The table says the same for people.
    rows = {line.split()[0]: line for line in mooncake.ok("config", env=env).stdout.decode().splitlines() if line}
    assert "2.0 GiB" in rows["agent.host_bytes"] and f"file {path}" in rows["agent.host_bytes"]
    assert rows["agent.zone"].split()[1:] == ["env-zone", "env", "MOONCAKE_AGENT_ZONE"]


def test_a_bad_value_is_the_usual_usage_error(mooncake: Mooncake) -> None:
    result = mooncake("config", env={"MOONCAKE_AGENT_HOST_BYTES": "2x"})
    assert_one_line_error(result, 2, "env MOONCAKE_AGENT_HOST_BYTES='2x': not a size")


def test_into_a_pipe_each_row_is_whole_however_long_its_path(mooncake: Mooncake) -> None:
    """The "from" column folded into a pipe of 80 columns: a config file's path came out in pieces
    on two lines, and could not be copied back out. Into a pipe each row is whole, as `ls`'s are."""
    long_dir = Path(mooncake.env["XDG_CONFIG_HOME"]) / ("a-directory-whose-name-is-long-" * 3)
    path = long_dir / "config.toml"
    long_dir.mkdir(parents=True)
    path.write_text('[agent]\nzone = "file-zone"\n')
    shown = mooncake.ok("config", env={"MOONCAKE_CONFIG": str(path), "COLUMNS": "80"}).stdout.decode()
    (row,) = [line for line in shown.splitlines() if line.startswith("agent.zone ")]
    assert row.split()[1:] == ["file-zone", "file", str(path)], row
