"""Why chunklocal/__init__.py imports lazily: fresh-process import times, side by side.

Each statement runs in its own new interpreter (``repeats`` times; median reported), so
nothing is cached between them.  ``import chunklocal`` with lazy exports is compared with
importing what plain top-level imports would pull in (the engine, hence torch).

    python -m benchmarks.import_time
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

STATEMENTS = {
    "import chunklocal (lazy exports)": "import chunklocal",
    "chunklocal.max_virtual_batches (bounds/, numpy only)":
        "import chunklocal; chunklocal.max_virtual_batches",
    "import torch": "import torch",
    "chunklocal.LLM (what plain top-level imports would load)": "import chunklocal; chunklocal.LLM",
}
TIMER = "import time; t = time.perf_counter(); {}; print(time.perf_counter() - t)"


def measure(statement: str, repeats: int) -> float:
    runs = [float(subprocess.run([sys.executable, "-c", TIMER.format(statement)], check=True,
                                 capture_output=True, text=True).stdout) for _ in range(repeats)]
    return statistics.median(runs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    for label, statement in STATEMENTS.items():
        print(f"{measure(statement, args.repeats):8.3f} s  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
