"""FA2 and FA3 prefill through FlashInferBackend, side by side, against float32 (issue 14).

What it runs, in one process, each output NaN-poisoned before the kernel and
compared per (row, head) with ``chunklocal.reference`` in float32:

1. ceilings: bf16 8192^3 matmul rate (the floor every TFLOP/s is compared with);
2. timing: the reporter's prompt (36000 tokens, c = 8192) and the 8 x 8192 case
   of BENCHMARKS.md Q1, useful TFLOP/s per kernel (median of ``--repeats``);
3. the reporter's prompt ``--reporter-reps`` times per kernel (default 50) on fixed
   inputs: rows off by > 5 %, worst error, and how many repetitions differ bit
   for bit from the first (a race shows up there long before it reaches 5 %);
   with ``--contention`` every other repetition runs while bf16 matmuls occupy
   SMs from a second stream, so work tiles start at other times;
4. ``--batches`` random chunked-local steps (default 500; c from 256 to 8192, 1-16
   requests, ragged prefixes and query lengths, distinct random pages), the same
   inputs for every kernel; every third one contended when ``--contention``.

40 query / 8 KV heads, head dim 128, bf16, page 16.  ``--quick`` is the CPU smoke
run: tiny chunks, a few batches, the torch reference standing in for the kernel.

Run: ``python -m benchmarks.prefill_stress --out results/prefill_stress.json``
(GPU); ``python -m benchmarks.prefill_stress --quick --out /tmp`` (CPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import prefill_common as pc
from benchmarks import workloads as wl

SCALE = wl.HEAD_DIM ** -0.5
#: Kernel name -> FlashInferBackend(prefill_backend=...).  "auto" is the shipped FA3 opt-in.
KERNELS = {"fa2": "fa2", "fa3": "auto", "torch": None}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file (ends in .json) or directory (default benchmarks/results)")
    p.add_argument("--kernels", default=None,
                   help="comma list: fa2, fa3 (default both; 'torch' with --quick)")
    p.add_argument("--batches", type=int, default=None, help="random batches (default 500)")
    p.add_argument("--reporter-reps", type=int, default=None, help="default 50")
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions per case")
    p.add_argument("--max-tokens", type=int, default=8192, help="query tokens per random batch")
    p.add_argument("--pool-pages", type=int, default=65536, help="KV pool for random batches")
    p.add_argument("--random-budget-s", type=float, default=150.0,
                   help="stop the random batches after this many seconds (recorded)")
    p.add_argument("--deadline-s", type=float, default=270.0,
                   help="no new random batch after this many seconds since the start "
                        "(JIT included), so a wall-clock limit keeps the results")
    p.add_argument("--contention", action=argparse.BooleanOptionalAction, default=None,
                   help="run some repetitions next to matmuls on a second stream (GPU default on)")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", "--smoke", action="store_true", dest="quick",
                   help="CPU smoke: tiny sizes, torch reference as the kernel, no timing")
    args = p.parse_args(argv)
    quick = args.quick
    args.device = "cpu" if quick else "cuda"
    args.kernels = (args.kernels or ("torch" if quick else "fa2,fa3")).split(",")
    args.batches = args.batches if args.batches is not None else (6 if quick else 500)
    args.reporter_reps = args.reporter_reps if args.reporter_reps is not None else (
        2 if quick else 50)
    args.contention = (not quick) if args.contention is None else args.contention
    if quick:
        args.max_tokens, args.pool_pages, args.skip_timing = 192, 512, True
    bad = [k for k in args.kernels if k not in ("fa2", "fa3", "torch")]
    if bad:
        p.error(f"unknown kernel(s) {bad}: use fa2, fa3 (GPU) or torch (--quick)")
    if not quick and "torch" in args.kernels:
        p.error("kernel 'torch' is the CPU stand-in; use it with --quick")
    return args


class Runner:
    """One prefill kernel: a FlashInferBackend per chunk size (or the torch stand-in)."""

    def __init__(self, kernel: str, limits, device):
        self.kernel, self.limits, self.device = kernel, limits, device
        self._backends = {}
        self.resolved = None  # FlashInfer's backend after plan(), recorded in the JSON

    def prepare(self, batch: pc.StressBatch, q, k, v, out):
        """Host work for ``batch`` (build + plan); returns the forward alone, for timing."""
        args = (batch.query_start_loc, batch.seq_lens, batch.block_table)
        if self.kernel == "torch":
            from chunklocal.reference import reference_attention

            return lambda: out.copy_(reference_attention(q, k, v, *args, chunk_size=batch.chunk,
                                                         scale=SCALE))
        backend = self._backends.get(batch.chunk)
        if backend is None:
            # "fa3" runs as prefill_backend="auto", the opt-in that ships; plan() must
            # resolve it to FlashInfer's fa3 on sm90 (checked by the caller via .resolved).
            backend = pc.make_backend(batch.chunk, KERNELS[self.kernel], self.limits,
                                      self.device)
            self._backends[batch.chunk] = backend
        md = backend.build(*args)
        wrapper = next(iter(md.wrappers.values()))
        self.resolved = getattr(wrapper, "_backend", self.resolved)
        return lambda: backend.forward(md, q, k, v, SCALE, out=out)

    def __call__(self, batch: pc.StressBatch, q, k, v, contention=None):
        """The kernel's output for ``batch``, NaN-poisoned first (unwritten rows stay NaN).

        With ``contention``, its matmuls are queued after the host work and just before
        the kernel, so the two overlap on the device."""
        import torch

        out = torch.full_like(q, float("nan"))
        forward = self.prepare(batch, q, k, v, out)
        if contention is not None:
            contention.start()
        forward()
        if contention is not None:
            contention.join()
        return out


class Contention:
    """bf16 matmuls queued on a second stream right before a kernel, to perturb timing."""

    def __init__(self, device, n: int = 8192, count: int = 2):
        import torch

        self.torch = torch
        self.stream = torch.cuda.Stream(device=device)
        self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        self.count = count

    def start(self):
        torch = self.torch
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(self.count):
                torch.matmul(self.a, self.a, out=self.c)

    def join(self):
        self.torch.cuda.current_stream().wait_stream(self.stream)


def timing(args, runners, rate):
    """Useful TFLOP/s of each kernel on the reporter's prompt and the 8 x 8192 case:
    the forward alone (build and plan once, outside the timed region)."""
    import torch

    from benchmarks.common import cuda_time_ms
    from benchmarks.steps import random_inputs

    reporter = pc.reporter_batch(seed=args.seed)
    eight = wl.chunked_prefills(8, 8192)
    cases = [("reporter: 36000 tokens, c=8192", reporter, None),
             ("8 x 8192 behind 2.7k-74k prefixes", pc.StressBatch(
                 eight.query_start_loc, eight.seq_lens, eight.block_table, wl.CHUNK), eight)]
    rows = []
    for name, batch, wl_batch in cases:
        if wl_batch is None:
            k, v = pc.random_pool(int(batch.block_table.max()) + 1, args.device, args.seed)
            q = pc.random_queries(batch.num_tokens, args.device, args.seed + 1)
        else:
            q, k, v = random_inputs(wl_batch, args.device, wl.BLOCK, seed=args.seed)
        flops = wl.useful_attention_flops(batch, batch.chunk)
        row = {"case": name, "useful_TFLOP": flops / 1e12}
        out = torch.empty_like(q)
        for kernel, runner in runners.items():
            forward = runner.prepare(batch, q, k, v, out)  # build + plan once, untimed
            forward()  # JIT on first use
            ms = cuda_time_ms(forward, repeats=args.repeats, warmup=3)["median"]
            row[f"{kernel}_ms"] = ms
            row[f"{kernel}_TFLOP/s"] = flops / (ms * 1e-3) / 1e12
            row[f"{kernel}_of_matmul"] = flops / (ms * 1e-3) / rate
            row[f"{kernel}_backend"] = runner.resolved
        if "fa2_ms" in row and "fa3_ms" in row:
            row["fa2/fa3"] = row["fa2_ms"] / row["fa3_ms"]
        rows.append(row)
        print(f"[timing] {row}", flush=True)
        del q, k, v, out
    return rows


def reporter_reps(args, runners, contention):
    """The reporter's prompt ``--reporter-reps`` times per kernel on fixed inputs."""
    import torch

    tokens, chunk = (600, 256) if args.quick else (36000, wl.CHUNK)
    batch = pc.reporter_batch(tokens, chunk, seed=args.seed)
    k, v = pc.random_pool(int(batch.block_table.max()) + 1, args.device, args.seed)
    q = pc.random_queries(tokens, args.device, args.seed + 1)
    t0 = time.perf_counter()
    ref = pc.reference(q, k.float(), v.float(), batch, SCALE)
    result = {"tokens": tokens, "chunk": chunk, "reps": args.reporter_reps,
              "reference_s": time.perf_counter() - t0, "per_kernel": {}}
    for kernel, runner in runners.items():
        first, stats = None, {"quiet": None, "contended": None}
        distinct, max_diff_pairs = 0, 0
        for rep in range(args.reporter_reps):
            contended = contention is not None and rep % 2 == 1
            out = runner(batch, q, k, v, contention if contended else None)
            key = "contended" if contended else "quiet"
            stats[key] = pc.merge_summary(stats[key], pc.summarize(pc.row_errors(out, ref)))
            if first is None:
                first = out.clone()
            elif not torch.equal(out, first):
                distinct += 1
                max_diff_pairs = max(max_diff_pairs, int((out != first).any(-1).sum()))
        total = pc.merge_summary(stats["quiet"], stats["contended"]) if stats["contended"] \
            else stats["quiet"]
        result["per_kernel"][kernel] = {**total, "quiet": stats["quiet"],
                                        "contended": stats["contended"],
                                        "reps_differing_bitwise_from_first": distinct,
                                        "max_pairs_differing_from_first": max_diff_pairs,
                                        "flashinfer_backend": runner.resolved}
        print(f"[reporter x{args.reporter_reps}] {kernel}: rows off {total['rows_off']}, "
              f"worst {total['worst']:.2e}, bitwise-distinct reps {distinct}", flush=True)
    return result


def random_batches(args, runners, contention, log, checkpoint=None):
    """``--batches`` random steps, the same inputs for every kernel; stops at the time
    budget or the script's deadline, and hands partial results to ``checkpoint``."""
    chunks = (32, 48, 64) if args.quick else pc.STRESS_CHUNKS
    rng = np.random.default_rng(args.seed)
    k, v = pc.random_pool(args.pool_pages, args.device, args.seed + 7)
    kf, vf = k.float(), v.float()
    per_kernel = {kernel: None for kernel in runners}
    per_chunk: dict = {}
    worst: list = []
    t0, done, contended_count, tokens = time.perf_counter(), 0, 0, 0

    def result():
        return {"target": args.batches, "batches_done": done, "query_rows": tokens,
                "contended_batches": contended_count, "seconds": time.perf_counter() - t0,
                "per_kernel": per_kernel, "per_chunk": per_chunk,
                "batches_with_rows_off": worst[:50]}

    for i in range(args.batches):
        now = time.perf_counter()
        if now - t0 > args.random_budget_s or now - args.start > args.deadline_s:
            log(f"random batches: time budget or deadline reached after {done}")
            break
        if checkpoint is not None and done and done % 50 == 0:
            checkpoint(result())
        batch = pc.random_batch(rng, int(rng.choice(chunks)), args.pool_pages,
                                max_tokens=args.max_tokens)
        q = pc.random_queries(batch.num_tokens, args.device, args.seed + 1000 + i)
        ref = pc.reference(q, kf, vf, batch, SCALE)
        contended = contention is not None and i % 3 == 2
        contended_count += contended
        for kernel, runner in runners.items():
            out = runner(batch, q, k, v, contention if contended else None)
            s = pc.summarize(pc.row_errors(out, ref))
            per_kernel[kernel] = pc.merge_summary(per_kernel[kernel], s)
            key = f"{kernel} c={batch.chunk}"
            per_chunk[key] = pc.merge_summary(per_chunk.get(key), s)
            if s["pairs_off"]:
                worst.append({"batch": i, "kernel": kernel, "contended": bool(contended),
                              **batch.describe(), **s})
        done += 1
        tokens += batch.num_tokens
    return result()


def main(argv=None) -> int:
    args = parse_args(argv)
    args.start = time.perf_counter()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("prefill_stress needs CUDA (use --quick on the CPU)", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    limits = pc.engine_limits(16, 65536, 131072)
    runners = {kernel: Runner(kernel, limits, args.device) for kernel in args.kernels}
    payload = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                        if k != "start"},
               "threshold": pc.OFF_THRESHOLD, "errors": []}
    name = "prefill_stress_quick" if args.quick else "prefill_stress"

    def log(msg):
        print(msg, flush=True)

    def phase(key, fn):
        t0 = time.perf_counter()
        try:
            payload[key] = fn()
        except Exception as exc:  # noqa: BLE001 - keep the other phases' results
            import traceback

            traceback.print_exc()
            payload["errors"].append({"phase": key, "error": f"{type(exc).__name__}: {exc}"})
        payload.setdefault("phase_seconds", {})[key] = time.perf_counter() - t0
        path = pc.save(payload, args.out, name)
        log(f"{key}: {payload['phase_seconds'][key]:.1f} s; wrote {path}")

    rate = None
    if args.device == "cuda":
        from benchmarks.common import measure_matmul_flops

        rate = measure_matmul_flops("cuda", 8192)
        payload["ceilings"] = {"matmul_flops": rate}
        log(f"bf16 matmul: {rate / 1e12:.0f} TFLOP/s")
    contention = Contention(args.device) if args.contention else None
    if not args.skip_timing:
        phase("timing", lambda: timing(args, runners, rate))
    phase("reporter", lambda: reporter_reps(args, runners, contention))
    def checkpoint(partial):
        payload["random"] = partial
        pc.save(payload, args.out, name)

    phase("random", lambda: random_batches(args, runners, contention, log, checkpoint))
    fa3 = runners.get("fa3")
    if fa3 is not None and fa3.resolved not in (None, "fa3"):
        payload["errors"].append({"phase": "check", "error": f"prefill_backend='auto' ran "
                                  f"FlashInfer's {fa3.resolved!r}, not fa3 (not sm90?)"})
    if rate is not None:
        payload["ceilings"]["matmul_flops_end"] = measure_matmul_flops("cuda", 8192)
    payload["summary"] = summary(payload)
    log(f"summary: {payload['summary']}")
    pc.save(payload, args.out, name)
    return 1 if payload["errors"] else 0


def summary(payload) -> dict:
    """Per kernel: rows off and worst error over everything, and the batch counts."""
    out = {}
    rep, rnd = payload.get("reporter", {}), payload.get("random", {})
    for kernel, r in (rep.get("per_kernel") or {}).items():
        b = (rnd.get("per_kernel") or {}).get(kernel) or {}
        out[kernel] = {"rows_off_total": r["rows_off"] + b.get("rows_off", 0),
                       "worst": max(r["worst"], b.get("worst", 0.0)),
                       "reporter_reps_bitwise_distinct": r["reps_differing_bitwise_from_first"]}
    out["random_batches_done"] = rnd.get("batches_done", 0)
    out["random_query_rows"] = rnd.get("query_rows", 0)
    out["reporter_reps"] = rep.get("reps", 0)
    return out


if __name__ == "__main__":
    sys.exit(main())
