"""Entry point of the `mooncake` console script (filled in by the CLI issue)."""

from __future__ import annotations


def main() -> None:
    raise SystemExit("the mooncake CLI is not built yet")
