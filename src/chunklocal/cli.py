"""`chunklocal` command line: each subcommand lives in the module that does its job."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help).  Each module provides
# add_arguments(parser) and main(args) -> int, and may provide
# check_arguments(parser, args), which rejects bad arguments with parser.error
# (exit status 2) before main does any work.
_COMMANDS = {
    "demo": ("chunklocal.demo", "run the reporter's 36000-token scenario end to end"),
    "plan": ("chunklocal.sizing", "print buffer sizes for an engine configuration"),
    "verify-bounds": ("chunklocal.verify_bounds",
                      "check the closed-form bounds against brute force"),
    "serve": ("chunklocal.server.cli", "OpenAI-compatible HTTP server for a checkpoint"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="chunklocal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    subparsers = {}
    for name, (module, help_text) in _COMMANDS.items():
        p = subparsers[name] = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    module = importlib.import_module(args._module)
    check = getattr(module, "check_arguments", None)
    if check is not None:
        check(subparsers[args.command], args)
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
