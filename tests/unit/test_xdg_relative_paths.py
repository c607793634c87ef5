"""A relative XDG_CONFIG_HOME or XDG_STATE_HOME is ignored, as the XDG base directory spec asks:
taken from the working directory, each directory a command ran in read a config file of its own,
and `mooncake down` run elsewhere than `mooncake up` found no cluster to stop. A relative
MOONCAKE_STATE_DIR is refused, for the same reason."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers import mooncake_bin
from mooncake_cli.exits import CliError, ExitCode
from mooncake_cli.state import state_dir

from mooncake_store.config import config_file_path


def test_a_relative_xdg_config_home_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    for base in (home / ".config", work / "rel"):
        (base / "mooncake").mkdir(parents=True)
        (base / "mooncake" / "config.toml").write_text("[client]\n")
    monkeypatch.chdir(work)
    in_home = home / ".config" / "mooncake" / "config.toml"
    assert config_file_path({"XDG_CONFIG_HOME": "rel", "HOME": str(home)}) == in_home
    absolute = work / "rel"
    in_absolute = absolute / "mooncake" / "config.toml"
    assert config_file_path({"XDG_CONFIG_HOME": str(absolute), "HOME": str(home)}) == in_absolute


def test_a_relative_xdg_state_home_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_STATE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_STATE_HOME", "rel")
    assert state_dir() == tmp_path / "home" / ".local" / "state" / "mooncake"
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "abs"))
    assert state_dir() == tmp_path / "abs" / "mooncake"


def test_a_relative_mooncake_state_dir_is_refused_naming_the_absolute_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MOONCAKE_STATE_DIR=rel/dir was taken from each command's working directory: `mooncake up`
    recorded its cluster under one directory, and `mooncake stat` from another said there was no
    cluster. Unlike a relative XDG_STATE_HOME (the spec says to ignore it) it is the store's own
    setting, so it is refused rather than passed over for another directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MOONCAKE_STATE_DIR", "rel/dir")
    with pytest.raises(CliError, match=r"MOONCAKE_STATE_DIR='rel/dir' is a relative path") as refused:
        state_dir()
    assert refused.value.code == ExitCode.USAGE
    assert f"MOONCAKE_STATE_DIR={tmp_path / 'rel' / 'dir'}" in str(refused.value)
    # Through the command line: exit 2 with that line, and nothing made in the working directory.
    env = {**os.environ, "MOONCAKE_STATE_DIR": "rel/dir"}
    done = subprocess.run([mooncake_bin(), "stat"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "is a relative path" in done.stderr, (done.returncode, done.stderr)
    assert not (tmp_path / "rel").exists()
    monkeypatch.setenv("MOONCAKE_STATE_DIR", str(tmp_path / "abs"))
    assert state_dir() == tmp_path / "abs"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MOONCAKE_STATE_DIR", "~/state")
    assert state_dir() == tmp_path / "home" / "state"
