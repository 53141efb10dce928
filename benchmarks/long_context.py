"""Long context and capacity on one GPU: a 1M-token prompt, and concurrent 1k/1k requests.

Issue 23, deliverable 5, on full-size Scout FP8 (``benchmarks.decode_floor``'s dummy-weight
model: 48 layers, hybrid KV, FP8 weights; spread routing, ``floors.BalancedRouting``):

* ``--part long``: one request of ``--prompt`` tokens (default 1,048,576) and ``--new``
  tokens (256), FP8 KV (``--kv-cache-dtype``), ``max_num_seqs=1``.  The prompt is prefilled
  for real in chunks of ``max_num_batched_tokens`` (8192), then decoded with CUDA graphs.
  Reported: prefill seconds and prompt tokens/s, TPOT (median decode step) at that context,
  peak device memory (torch's allocator) and the engine's KV pages per group.
* ``--part capacity``: for each KV dtype (auto = bf16, and fp8), the engine sized by
  ``gpu_memory_utilization`` with ``max_model_len`` 2048: how many 1k-prompt / 1k-output
  requests fit at once (``max_num_seqs`` = ``--max-seqs``; the requests that get pages), and
  the decode step at that batch with 1k contexts.

Each part writes its JSON after every row, so a time limit keeps what was measured.  The
1M prefill alone takes minutes on an H200 (about 1.3e17 FLOPs of global-layer attention):
run the parts in separate calls.

    python -m benchmarks.long_context --part long --out OUT
    python -m benchmarks.long_context --part capacity --out OUT
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import base_parser, format_table, guarded, write_json


def engine(path, device, kv_dtype, max_num_seqs, max_model_len, utilization):
    import chunklocal

    cuda = device.type == "cuda"
    return chunklocal.LLM(path, device=str(device), load_format="dummy",
                          dtype=None if cuda else torch.float32, kv_cache_dtype=kv_dtype,
                          max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          max_num_batched_tokens=8192 if cuda else 64,
                          gpu_memory_utilization=utilization, cuda_graphs=cuda)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: Prefill steps between progress reports (a line and the partial row in the JSON): a device
#: call's time limit then still shows how far the prefill got and at what rate (the first
#: H200 attempt, 2026-12-02, ran 330 s and left nothing).
PROGRESS_EVERY = 8


def long_row(path, device, args, progress=lambda row: None) -> dict:
    """Prefill one ``args.prompt``-token request for real, then decode ``args.new`` tokens;
    ``progress(partial row)`` every PROGRESS_EVERY prefill steps."""
    from benchmarks.decode_floor import admit
    from chunklocal.engine.sampling import SamplingParams

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    llm = engine(path, device, args.kv_cache_dtype, 1, args.prompt + args.new,
                 args.gpu_memory_utilization)
    sched, runner = llm.scheduler, llm.runner
    params = SamplingParams(max_tokens=args.new, ignore_eos=True, temperature=0.0)
    prompt = np.random.default_rng(0).integers(0, llm.config.vocab_size, args.prompt).tolist()
    seq = admit(llm, 0, prompt, params)
    sync(device)
    built_s = time.perf_counter() - t0
    start, prefill_steps, decode_ms = time.perf_counter(), 0, []
    while sched.has_work():
        batch = sched.schedule()
        decoding = seq.num_computed >= len(prompt)
        step_start = time.perf_counter()
        sched.postprocess(batch, runner.run(batch).tokens, frozenset())
        if decoding:
            decode_ms.append((time.perf_counter() - step_start) * 1e3)
        else:
            prefill_steps += 1
            prefill_s = time.perf_counter() - start
            if prefill_steps % PROGRESS_EVERY == 0:
                done = min(seq.num_computed, len(prompt))
                progress({"kv_cache_dtype": args.kv_cache_dtype, "prompt_tokens": args.prompt,
                          "partial": True, "engine_build_s": built_s,
                          "prefilled_tokens": done, "prefill_s": prefill_s,
                          "prefill_tok_per_s": done / prefill_s})
    row = {"kv_cache_dtype": args.kv_cache_dtype, "prompt_tokens": args.prompt,
           "engine_build_s": built_s, "new_tokens": len(seq.token_ids) - len(prompt),
           "prefill_steps": prefill_steps,
           "prefill_s": prefill_s, "prefill_tok_per_s": args.prompt / prefill_s,
           "tpot_ms": statistics.median(decode_ms) if decode_ms else None,
           "kv_pages_per_group": [g.num_blocks for g in llm.groups]}
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    llm.shutdown()
    return row


def memory_gib(llm) -> dict | None:
    """Where ``gpu_memory_utilization`` went (GiB): what the KV pools could not take."""
    from chunklocal.bounds.kv_pools import GIB

    budget = llm.memory_budget
    if budget is None:  # the CPU: a RAM budget, nothing profiled
        return None
    return {name: getattr(budget, name) / GIB for name in
            ("total", "weights", "activations", "graphs", "outside_torch", "cached",
             "headroom")} | {
        "requested": budget.requested / GIB, "kv": llm.kv_pools.total_bytes / GIB}


def capacity_row(path, device, kv_dtype, args) -> dict:
    """How many 1k/1k requests the pools hold at once, and the decode step at that batch."""
    from benchmarks import decode_floor

    start = time.perf_counter()
    llm = engine(path, device, kv_dtype, args.max_seqs, 2048, args.gpu_memory_utilization)
    startup_s = time.perf_counter() - start  # weights, memory profile, graph capture
    fitted = decode_floor.fill(llm, args.max_seqs, args.context, args.steps + 16)
    decode_floor.timed_steps(llm, 3, True, device)
    steps = decode_floor.timed_steps(llm, args.steps, True, device)
    row = {"kv_cache_dtype": kv_dtype, "max_model_len": 2048, "context": args.context,
           "asked": args.max_seqs, "fit": fitted, "decode_ms": statistics.median(steps),
           "out_tok_per_s": fitted / statistics.median(steps) * 1e3,
           "kv_pages_per_group": [g.num_blocks for g in llm.groups],
           "startup_s": startup_s, "memory_gib": memory_gib(llm)}
    llm.shutdown()
    return row


def main(argv=None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("long", "capacity"), required=True)
    parser.add_argument("--prompt", type=int, default=1 << 20)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--capacity-dtypes", nargs="+", choices=("auto", "fp8"),
                        default=["auto", "fp8"], help="--part capacity: a row per KV dtype")
    # 1M tokens of FP8 KV (25.1 GiB) next to 105.2 GiB of weights need about 0.97
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.97)
    parser.add_argument("--max-seqs", type=int, default=1024)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = "scout-fp8"
    if args.smoke:
        model, args.prompt, args.new, args.max_seqs, args.context = "smoke", 300, 4, 6, 40
        args.steps = 2
    elif device.type == "cpu":
        parser.error("the full-size run needs CUDA; on the CPU only --smoke works")
    rows, errors = [], []
    name = f"long_context_{args.part}" + ("_smoke" if args.smoke else "")

    def save():
        return write_json(name, {"args": vars(args), "rows": rows, "errors": errors}, args.out)

    from benchmarks import decode_floor, floors

    with tempfile.TemporaryDirectory() as tmp, floors.BalancedRouting():
        path = decode_floor.write_config(Path(tmp) / model, model)

        def replace_partial(row):  # the latest progress row gives way to the next row
            rows[:] = [r for r in rows if not r.get("partial")] + [row]

        def progress(partial):
            replace_partial(partial)
            print(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in partial.items()), flush=True)
            save()

        cases = [("long", lambda: long_row(path, device, args, progress))] \
            if args.part == "long" else [
            (f"capacity {d}", lambda d=d: capacity_row(path, device, d, args))
            for d in dict.fromkeys(args.capacity_dtypes)]
        for case, fn in cases:
            row = guarded(case, fn, errors)
            if row:
                replace_partial(row)
                print(format_table([row]), flush=True)
            save()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"wrote {save()}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
