"""Holds the dependency direction of DESIGN.md §5 by parsing every import in the package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mooncake_store"
CLI = ROOT / "cli"

# layer -> layers (top-level subpackages or modules of mooncake_store) it may import
ALLOWED: dict[str, set[str]] = {
    "types": {"errors"},
    "errors": set(),
    "config": {"errors", "types"},
    "embedded": {"errors", "config", "watchdog", "server_procs"},
    # How the embedded server's processes are stopped (a process group of its own).
    "server_procs": {"watchdog"},
    # Run by path as its own process: the standard library only.
    "watchdog": set(),
    "policy": {"errors", "types"},
    "tiers": {"errors", "types", "config"},
    "transport": {"errors", "types", "config", "tiers"},
    "index": {"errors", "types", "config"},
    # The agent exits with the process that started it through the same stdlib-only watchdog.
    "agent": {"errors", "types", "config", "index", "transport", "tiers", "policy", "watchdog"},
    "client": {"errors", "types", "config", "index", "transport", "tiers", "policy", "embedded"},
    "integrations": {"errors", "types", "config", "client"},
}
#: What the CLI (cli/, installed as mooncake_cli) may import. DESIGN.md §5 draws cli -> client,
#: agent; the CLI departs from it for three things no client call gives: `doctor` asks the index
#: itself (RedisIndex: the server's version, clock, maxmemory policy) and opens a bare connection
#: first (connect_redis, also used by `up` and the error advice), and `up`/`down` find and remove
#: agents' arena segments in /dev/shm (tiers.host's SHM_DIR and name pattern). `mooncake agent`
#: stops on signals as `python -m mooncake_store.agent` does (watchdog.stop_on_signals).
CLI_ALLOWED = {"client", "agent", "config", "errors", "types", "embedded", "index", "tiers", "watchdog"}


def _layer(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _imported_layers(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            # A relative import inside the package: resolved from the importing module's place.
            base = path.relative_to(ROOT).with_suffix("").parts[: -node.level]
            names = [".".join((*base, *(node.module.split(".") if node.module else ())))]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "mooncake_store" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_layers_import_only_downwards() -> None:
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = _layer(path)
        if layer in ("__init__", "__main__", "demo"):
            continue  # the public facade and entry points may use everything
        allowed = ALLOWED.get(layer)
        assert allowed is not None, f"{path} is in an unknown layer {layer!r}: add it to ALLOWED"
        for imported in _imported_layers(path) - {layer}:
            if imported not in allowed:
                violations.append(f"{path.relative_to(ROOT)} ({layer}) imports {imported}")
    assert not violations, "\n".join(violations)


def test_tiers_and_transport_never_import_index() -> None:
    for sub in ("tiers", "transport", "policy"):
        for path in (PACKAGE / sub).rglob("*.py"):
            assert "index" not in _imported_layers(path), path
            assert "redis" not in _top_level_imports(path), f"{path}: only index/ talks to Redis"


def test_the_cli_imports_only_what_it_is_allowed() -> None:
    violations = [
        f"{path.relative_to(ROOT)} imports mooncake_store.{imported}"
        for path in sorted(CLI.rglob("*.py"))
        for imported in _imported_layers(path) - CLI_ALLOWED - {"__version__"}
    ]
    assert not violations, "\n".join(violations)


def _top_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_policy_does_no_io() -> None:
    forbidden = {"socket", "redis", "subprocess", "os", "time", "mmap", "threading"}
    for path in (PACKAGE / "policy").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not {a.name.split(".")[0] for a in node.names} & forbidden, path
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] not in forbidden, path
