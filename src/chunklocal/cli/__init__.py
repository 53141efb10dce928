"""`chunklocal` command line: one module per subcommand, each with
``add_arguments(parser)``, ``main(args) -> int`` and optionally
``check_arguments(parser, args)``, which rejects bad arguments with parser.error
(exit status 2) before main does any work."""

from __future__ import annotations

import argparse

from chunklocal import __version__
from chunklocal.bounds import verify as verify_bounds
from chunklocal.cli import demo, plan

# subcommand -> (module, one-line help)
COMMANDS = {
    "demo": (demo, "run the reporter's 36000-token scenario end to end"),
    "plan": (plan, "print buffer sizes for an engine configuration"),
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
    return int(module.main(args) or 0)
