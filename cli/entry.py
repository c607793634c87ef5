"""The console script's entry point. The command's modules take about a second to import (typer,
rich, numpy, redis-py, the store); a Ctrl-C in that second printed a KeyboardInterrupt traceback
from inside an import. It exits 130 now, as a Ctrl-C does once the command runs."""

from __future__ import annotations

import sys

#: ExitCode.INTERRUPTED, not imported from exits.py: that import would be the one cut short.
INTERRUPTED = 130


def main() -> None:
    try:
        from mooncake_cli.main import main as run_command
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED)
    run_command()
