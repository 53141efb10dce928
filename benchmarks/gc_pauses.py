"""Garbage-collection pauses of a loaded engine, its start-up heap unfrozen against frozen.

One engine (``--model DIR``, or the tests' tiny checkpoint written to a temporary
directory), built with ``CHUNKLOCAL_GC_FREEZE=0``; then ``--repeats`` rounds alternate two
modes: *unfrozen* (``gc.unfreeze()``: every object is in the generations a collection
walks) and *frozen* (``chunklocal._gc.freeze_startup_heap``: what the engine does at the end
of start-up).  In each round: one full collection timed alone (``gc.collect()``), then
``--requests`` requests of ``--prompt-tokens`` random ids and ``--max-tokens`` greedy new
tokens through ``LLM.generate``, with every collection the interpreter starts timed by
``gc.callbacks`` (by generation).  The outputs of a mode's rounds are kept until the mode's
next round, as a client keeps what it received, so the heap grows as a serving process's
does and the interpreter's own thresholds decide when a full collection runs.

    python -m benchmarks.gc_pauses --out OUT [--device cuda --model DIR] [--repeats 3]
    python -m benchmarks.gc_pauses --smoke

No floor: a pause is time the step loop does not run, so the target is zero; the table
gives the full collection's time and the longest pause per generation in each mode.
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import device_parser, format_table, write_json

MODES = ("unfrozen", "frozen")


class PauseTimer:
    """Every collection's duration, by generation, while installed in ``gc.callbacks``."""

    def __init__(self):
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._start = 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses[info["generation"]].append((time.perf_counter() - self._start) * 1e3)

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def set_mode(mode: str) -> None:
    from chunklocal import _gc

    gc.unfreeze()
    if mode == "frozen":
        _gc.freeze_startup_heap(enabled=True)


def one_round(llm, mode, args, rng, kept: dict) -> dict:
    kept[mode] = None  # this mode's previous outputs die now, before the mode is set
    set_mode(mode)
    start = time.perf_counter()
    gc.collect()
    full_ms = (time.perf_counter() - start) * 1e3
    prompts = [[rng.randrange(1, args.vocab) for _ in range(args.prompt_tokens)]
               for _ in range(args.requests)]
    with PauseTimer() as timer:
        start = time.perf_counter()
        kept[mode] = llm.generate(prompts, max_new_tokens=args.max_tokens,
                                  ignore_eos=True, use_tqdm=False)
        wall = time.perf_counter() - start
    row = {"mode": mode, "full_collect_ms": full_ms, "wall_s": wall,
           "frozen_objects": gc.get_freeze_count()}
    for gen, values in timer.pauses.items():
        row[f"gen{gen}_count"] = len(values)
        row[f"gen{gen}_max_ms"] = max(values, default=0.0)
        row[f"gen{gen}_sum_ms"] = sum(values)
    return row


def summary(rounds: list[dict]) -> list[dict]:
    rows = []
    for mode in MODES:
        mine = [r for r in rounds if r["mode"] == mode]
        rows.append({"mode": mode, "rounds": len(mine),
                     "full_collect_ms_median": statistics.median(r["full_collect_ms"]
                                                                 for r in mine),
                     "gen2_count": sum(r["gen2_count"] for r in mine),
                     "gen2_max_ms": max(r["gen2_max_ms"] for r in mine),
                     "gen1_max_ms": max(r["gen1_max_ms"] for r in mine),
                     "gen0_max_ms": max(r["gen0_max_ms"] for r in mine),
                     "wall_s_median": statistics.median(r["wall_s"] for r in mine),
                     "frozen_objects": max(r["frozen_objects"] for r in mine)})
    return rows


def main(argv=None) -> int:
    parser = device_parser(__doc__.splitlines()[0], cpu_help="the tiny model runs anywhere")
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint directory (default: the tests' tiny one)")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    args.repeats = 3 if args.repeats is None else args.repeats
    if args.smoke:
        args.requests, args.repeats = 8, 1
    os.environ["CHUNKLOCAL_GC_FREEZE"] = "0"  # the rounds choose
    import chunklocal

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            from benchmarks.serve import make_tiny

            path = Path(tmp) / "tiny"
            make_tiny(path)
        llm = chunklocal.LLM(str(path), device=args.device, max_model_len=256,
                             max_num_seqs=64)
        args.vocab = min(llm.config.vocab_size, 300)
        kept: dict = {}
        one_round(llm, "unfrozen", args, rng, kept)  # warm-up, not reported
        rounds = [one_round(llm, mode, args, rng, kept)
                  for _ in range(args.repeats) for mode in MODES]
        gc.unfreeze()
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds,
               "rows": summary(rounds), "errors": []}
    print(format_table(payload["rows"]), flush=True)
    write_json("gc_pauses_smoke" if args.smoke else "gc_pauses", payload, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
