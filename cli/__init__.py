"""The `mooncake` command line (typer + rich)."""
