"""Where the memory profile's activation reserve goes: the live allocations at its peak.

``gpu_memory_utilization`` leaves the KV pools what the weights, the largest step's peak
(``engine/runner_setup.py`` ``profile_run``), the CUDA graphs and the memory outside torch
do not take (engine/memory.py).  On full-size Scout FP8 the largest step (8192 tokens over
``max_num_seqs`` prompts) reserved 1.97 GiB, and the 1k/1k capacity stopped at 292 of the
302 sequences issue 23 asks for: this names what that peak holds.  It builds the engine as
``benchmarks.long_context --part capacity`` does, records torch's allocator history during
the profile's first step only, and reports the allocations live at the moment of the peak,
summed by the innermost frame of this project (or of FlashInfer) that made them.

    python -m benchmarks.activation_peak --out OUT

GPU only (the CPU profiles nothing).
"""

from __future__ import annotations

import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

from benchmarks.common import base_parser, format_table, write_json
from chunklocal.bounds.kv_pools import GIB

OURS = ("chunklocal", "flashinfer", "benchmarks")


def live_at_peak(events) -> tuple[int, list[dict]]:
    """(peak bytes above the start, the allocations live at that moment) from an allocator
    trace: dicts with ``action`` ("alloc", "free_completed", others ignored), ``addr``,
    ``size`` and ``frames``.  Frees of blocks allocated before the trace began are ignored
    (the peak is measured from the trace's start, as ``peak_of`` measures it)."""
    live: dict[int, dict] = {}
    total = best = 0
    best_live: list[dict] = []
    for event in events:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > best:
                best, best_live = total, list(live.values())
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    return best, best_live


def site(frames) -> str:
    """The innermost frame in this project or FlashInfer: ``file:line function``."""
    for frame in frames:
        name = frame.get("filename", "")
        if any(part in name for part in OURS):
            short = name[name.find("chunklocal"):] if "chunklocal" in name else name
            return f"{short}:{frame.get('line')} {frame.get('name')}"
    return "elsewhere"


def by_site(allocations) -> list[dict]:
    sizes, counts = Counter(), Counter()
    for a in allocations:
        key = site(a.get("frames", []))
        sizes[key] += a["size"]
        counts[key] += 1
    return [{"site": k, "gib": v / GIB, "blocks": counts[k]} for k, v in sizes.most_common()]


def main(argv=None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--max-seqs", type=int, default=320)
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.97)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("activation_peak needs a GPU (the CPU profiles nothing)")
        return 0
    from benchmarks import decode_floor, long_context
    from chunklocal.engine import memory, runner_setup

    recorded: dict = {}
    plain = memory.peak_of

    def recording(mem, run):  # the profile's first call is the largest step
        if recorded:
            return plain(mem, run)
        torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
        try:
            recorded["peak"] = plain(mem, run)
        finally:
            recorded["snapshot"] = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
        return recorded["peak"]

    runner_setup.peak_of = recording
    with tempfile.TemporaryDirectory() as tmp:
        path = decode_floor.write_config(Path(tmp) / "scout-fp8", "scout-fp8")
        llm = long_context.engine(path, torch.device("cuda"), args.kv_cache_dtype,
                                  args.max_seqs, 2048, args.gpu_memory_utilization)
    budget = long_context.memory_gib(llm)
    events = [e for trace in recorded["snapshot"]["device_traces"] for e in trace]
    peak, live = live_at_peak(events)
    sites = by_site(live)
    print(f"peak_of: {recorded['peak'] / GIB:.3f} GiB; from the trace {peak / GIB:.3f} GiB")
    print(format_table(sites[:25]))
    path = write_json("activation_peak", {"args": vars(args), "budget_gib": budget,
                                          "peak_of_gib": recorded["peak"] / GIB,
                                          "trace_peak_gib": peak / GIB, "sites": sites},
                      args.out)
    print(f"wrote {path}")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
