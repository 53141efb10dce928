"""Decode steps with and without async scheduling, through the engine core (GPU; issue 19).

``decode_floor`` times ``ModelRunner.run`` alone, so a step's host work (input preparation,
the attention plan, sampling's launch, the tokens' copy back) adds to its device time.  With
``LLM(async_scheduling=True)`` (engine/overlap.py) the loop launches step n+1 before step n's
tokens reach the host, so that host work hides behind the device's.  This script measures
the decode step both ways on one engine, alternated, through ``LLM.generate``:

    decode ms = (time of ``--new`` tokens - time of 1 token) / (``--new`` - 1)

for ``--batches`` prompts of ``--context`` random tokens each (dummy weights, spread routing:
``floors.routing``; with ``--routing model`` the outputs are checked equal between the
modes and rounds).  Full-size Scout FP8 by
default (``--model``, as benchmarks/decode_floor.py names them).  With balanced routing each
row also has ``floor_ms``: the bytes a decode step at the run's mean position must read
(``floors.decode_bytes``: every weight, the ``min(E, batch * top_k)`` experts each MoE layer
touches, the KV) at the copy rate measured at the start of the same run, and ``share`` =
floor / decode time.

    python -m benchmarks.overlap_decode --batches 1 64 --out $OUT
    python -m benchmarks.overlap_decode --batches 1 --profile --out $OUT   # + device idle
    python -m benchmarks.overlap_decode --smoke        # CPU: checks the logic

``--profile`` adds, per mode, one more ``--new``-token generate under torch.profiler: device
busy and idle ms per decode step (idle: gaps between kernels inside the span) and the kernel
classes per step.  At batch 1 async scheduling hid 1.6 of the 3.2 ms the synchronous loop
spends outside the graph replay (2026-12-02); the idle figure says whether the rest is the
device waiting for the host.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import floors
from benchmarks.common import base_parser, format_table, guarded, write_json
from benchmarks.decode_floor import MODELS, measure_rates, step_floor, write_config


def timed_generate(llm, prompts, new: int, device) -> tuple[float, list]:
    from chunklocal.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def floor_ms(llm, batch: int, args, rates) -> float | None:
    """The decode step's byte floor at the copy rate (balanced routing only: a model's
    own routing touches experts this script does not count)."""
    if args.routing != "balanced":
        return None
    _, moe = floors.weight_bytes(llm.model)
    top_k = llm.config.num_experts_per_tok
    distinct = [min(num_experts, batch * top_k) for num_experts, _ in moe]
    positions = np.full(batch, args.context + args.new // 2, dtype=np.int64)
    return step_floor(llm, positions, distinct, rates)[1]


def batch_rows(llm, batch: int, args, device, rates) -> list[dict]:
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, llm.config.vocab_size, (batch, args.context)).tolist()
    timed_generate(llm, prompts, args.new, device)  # warm-up: graphs, plans, prefix cache
    per_mode: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, list] = {}
    for _ in range(args.rounds):
        for overlap in (False, True):
            llm.async_scheduling = overlap
            full, outs = timed_generate(llm, prompts, args.new, device)
            first, _ = timed_generate(llm, prompts, 1, device)
            per_mode[overlap].append((full - first) / (args.new - 1) * 1e3)
            if args.routing == "model" and outputs.setdefault(overlap, outs) != outs:
                raise AssertionError(f"batch {batch}: outputs changed between rounds")
    llm.async_scheduling = False
    if args.routing == "model" and outputs[False] != outputs[True]:
        raise AssertionError(f"batch {batch}: async_scheduling changed the outputs")
    floor = floor_ms(llm, batch, args, rates)
    rows = [{"model": args.model, "batch": batch, "context": args.context,
             "async_scheduling": overlap, "decode_ms": statistics.median(ms),
             "min_ms": min(ms), "max_ms": max(ms), "floor_ms": floor,
             "share": None if floor is None else floor / statistics.median(ms)}
            for overlap, ms in per_mode.items()]
    if args.profile:
        for row in rows:
            llm.async_scheduling = row["async_scheduling"]
            row["profile"] = per_decode_step(floors.kernel_profile(
                lambda: timed_generate(llm, prompts, args.new, device), 1, device), args.new)
        llm.async_scheduling = False
    return rows


def per_decode_step(profile: dict, new: int) -> dict:
    """A profile of one ``new``-token generate, its per-call figures per decode step (the
    cached prompt's one-token prefill is counted in, a step among ``new``)."""
    out = {key: value / new for key, value in profile.items() if isinstance(value, float)}
    out["classes_per_step"] = {cls: {k: v / new for k, v in row.items()}
                               for cls, row in profile.get("classes_per_step", {}).items()}
    return out


def main(argv=None) -> int:
    import chunklocal

    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default="scout-fp8", choices=sorted(MODELS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    parser.add_argument("--profile", action="store_true",
                        help="device busy / idle ms per step and kernel classes, per mode")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="LLM's (vLLM's default 0.9); the largest batch needs more")
    parser.add_argument("--routing", choices=("balanced", "model"), default="balanced",
                        help="balanced: spread routing (floors.BalancedRouting), whose expert "
                        "choice counts MoE calls, so outputs are compared only with 'model'")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.batches, args.context, args.new = "smoke", [1, 3], 20, 5
        args.rounds, args.routing = 1, "model"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows: list[dict] = []
    errors: list = []
    rates = measure_rates(device)
    with tempfile.TemporaryDirectory() as tmp, floors.routing(args.routing):
        path = write_config(Path(tmp) / args.model, args.model)
        llm = chunklocal.LLM(path, device=str(device), load_format="dummy",
                             dtype=None if device.type == "cuda" else torch.float32,
                             max_num_seqs=max(args.batches),
                             max_model_len=args.context + args.new + 16,
                             kv_cache_dtype=args.kv_cache_dtype,
                             gpu_memory_utilization=args.gpu_memory_utilization)
        for batch in args.batches:
            rows += guarded(f"batch {batch}",
                            lambda b=batch: batch_rows(llm, b, args, device, rates),
                            errors) or []
            print(format_table(rows[-2:]), flush=True)
        llm.shutdown()
    path = write_json("overlap_decode_smoke" if args.smoke else "overlap_decode",
                      {"args": vars(args), "rates": rates, "rows": rows, "errors": errors},
                      args.out)
    print(f"wrote {path}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
