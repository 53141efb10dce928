"""`chunklocal` command line: one module per subcommand, each with
``add_arguments(parser)``, ``main(args) -> int`` and optionally
``check_arguments(parser, args)``, which rejects bad arguments with parser.error
(exit status 2) before main does any work."""

from __future__ import annotations

import argparse
import os
import sys

from chunklocal import __version__
from chunklocal.bounds import verify as verify_bounds
from chunklocal.cli import demo, plan
from chunklocal.server import cli as serve

# subcommand -> (module, one-line help)
COMMANDS = {
    "demo": (demo, "run the reporter's 36000-token scenario end to end"),
    "plan": (plan, "print buffer sizes for an engine configuration"),
    "serve": (serve, "OpenAI-compatible HTTP server for a checkpoint"),
    "verify-bounds": (verify_bounds, "check the closed-form bounds against brute force"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="chunklocal", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"chunklocal {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    subparsers = {}
    for name, (module, help_text) in COMMANDS.items():
        p = subparsers[name] = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
    args = parser.parse_args(argv)
    module = COMMANDS[args.command][0]
    check = getattr(module, "check_arguments", None)
    if check is not None:
        check(subparsers[args.command], args)
    try:
        return int(module.main(args) or 0)
    except BrokenPipeError:  # `chunklocal plan ... | head`: the reader left, not an error
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
