"""A relative XDG_CONFIG_HOME or XDG_STATE_HOME is ignored, as the XDG base directory spec asks:
taken from the working directory, each directory a command ran in read a config file of its own,
and `mooncake down` run elsewhere than `mooncake up` found no cluster to stop."""

from __future__ import annotations

from pathlib import Path

import pytest
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
