"""mypy over src/chunklocal (settings: pyproject's [tool.mypy]), as CI runs it.

Attribute and call errors (a misspelt field, a wrong keyword, a name that does not
exist) always fail.  Every other error must be listed in tools/mypy-baseline.txt, one
line per error without its line number (``path: [code] message``), so edits elsewhere in
a file do not churn it; an error not listed fails, and listed errors that disappeared
are reported so that the baseline only shrinks (``--update`` rewrites it).

    python tools/typecheck.py            # check
    python tools/typecheck.py --update   # rewrite the baseline from the current errors
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "tools" / "mypy-baseline.txt"
#: Never baselined: the errors a rename or a wrong call signature makes.
FATAL = {"attr-defined", "union-attr", "call-arg", "call-overload", "name-defined"}
_ERROR = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+)(?::\d+)?: error: (?P<msg>.*?)"
                    r"\s+\[(?P<code>[a-z-]+)\]$")


def mypy_errors() -> list[tuple[str, str, str, str]]:
    """(path, line, code, message) of every mypy error, in mypy's order."""
    run = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary",
                          "--hide-error-context", "--no-pretty", "--show-error-codes"],
                         cwd=ROOT, capture_output=True, text=True)
    if run.returncode not in (0, 1) or "error:" in run.stderr:
        sys.exit(f"mypy failed to run (exit {run.returncode}):\n{run.stderr}{run.stdout}")
    found = [m for m in map(_ERROR.match, run.stdout.splitlines()) if m]
    if run.returncode == 1 and not found:
        sys.exit(f"mypy reported errors this script cannot read:\n{run.stdout}")
    return [(m["path"].replace("\\", "/"), m["line"], m["code"], m["msg"]) for m in found]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite the baseline")
    args = parser.parse_args()
    errors = mypy_errors()
    fatal = [e for e in errors if e[2] in FATAL]
    rest = [(f"{path}:{line}", f"{path}: [{code}] {msg}") for path, line, code, msg in errors
            if code not in FATAL]
    lines = Counter(key for _, key in rest)
    for path, line, code, msg in fatal:
        print(f"{path}:{line}: error: {msg}  [{code}]  (never baselined)")
    if args.update:
        BASELINE.write_text("".join(f"{line}\n" for line in sorted(lines.elements())))
        print(f"{BASELINE.relative_to(ROOT)}: {sum(lines.values())} errors")
        return 1 if fatal else 0
    known = Counter(BASELINE.read_text().splitlines()) if BASELINE.exists() else Counter()
    known.pop("", None)
    new, gone = lines - known, known - lines
    for where, key in rest:
        if key in new:
            print(f"new: {where}: {key.split(': ', 1)[1]}")
    if gone:
        print(f"note: {sum(gone.values())} baseline errors are fixed; shrink the baseline "
              "with: python tools/typecheck.py --update")
        for line in sorted(gone.elements()):
            print(f"  fixed: {line}")
    print(f"typecheck: {len(fatal)} attribute/call errors, {sum(new.values())} new errors, "
          f"{sum((lines & known).values())} baselined")
    return 1 if fatal or new else 0


if __name__ == "__main__":
    sys.exit(main())
