"""`chunklocal` command line: one module per subcommand, each with
``add_arguments(parser)``, ``main(args) -> int`` and optionally
``check_arguments(parser, args)``, which rejects bad arguments with parser.error
(exit status 2) before main does any work.  Only the subcommand that runs is imported, so
``chunklocal --version`` and ``--help`` import no torch."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from chunklocal import __version__

# subcommand -> (module, one-line help)
COMMANDS = {
    "demo": ("chunklocal.cli.demo", "run the reporter's 36000-token scenario end to end"),
    "plan": ("chunklocal.cli.plan", "print buffer sizes for an engine configuration"),
    "serve": ("chunklocal.server.cli", "OpenAI-compatible HTTP server for a checkpoint"),
    "verify-bounds": ("chunklocal.bounds.verify",
                      "check the closed-form bounds against brute force"),
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="chunklocal", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"chunklocal {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    # The top-level parser has no option taking a value: the first word is the subcommand.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    subparsers, module = {}, None
    for name, (module_name, help_text) in COMMANDS.items():
        p = subparsers[name] = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
    args = parser.parse_args(argv)
    assert module is not None  # argparse refused any other command
    check = getattr(module, "check_arguments", None)
    if check is not None:
        check(subparsers[args.command], args)
    try:
        return int(module.main(args) or 0)
    except BrokenPipeError:  # `chunklocal plan ... | head`: the reader left, not an error
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
