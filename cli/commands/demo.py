"""`mooncake demo`: the scenario-A demo, ``python -m mooncake_store.demo`` under the CLI's name.

The demo owns its options and its checks (argparse, the message when torch/transformers are
missing, its exit codes); this command only hands it the arguments, so the two never drift apart.
"""

from __future__ import annotations

import typer

#: Every argument after `demo`, --help included, goes to the demo's own parser.
CONTEXT_SETTINGS = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def demo(ctx: typer.Context) -> None:
    """Scenario A: long-document Q&A on a small LM, prefill vs restore from the store.

    Computes a document's KV cache once and restores it for later questions (also from another
    process), comparing restore time with prefill time. Starts its own embedded cluster; needs
    the 'hf' extra (torch, transformers). Options: `mooncake demo --help`.
    """
    from mooncake_store import demo as scenario

    try:
        code = scenario.main(list(ctx.args), prog="mooncake demo")
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed by it
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    raise typer.Exit(code)
