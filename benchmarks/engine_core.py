"""Engine core: where a step's time goes (host vs device), and what sampling costs.

1. ``steps``: a decode-heavy workload through ``LLM.generate`` (the engine core's loop),
   greedy, with each step split into host work before the device runs (schedule,
   prepare inputs, metadata build), the run itself (forward + sampling, synchronised
   by the sampled tokens' copy to the host) and host work after (postprocess, detok and
   publish).  ``overlap_bound`` = step time / max(host, step - host): the speed-up that
   overlapping step n+1's host work with step n's device work could give at most.
2. ``sampling``: the same workload with greedy, top-k/top-p, seeded and penalised
   requests (new tokens/s); on CUDA also with FlashInfer's sampler off (torch).
3. ``sampler``: the sampler alone on [rows, vocab] float32 logits (torch vs FlashInfer).
4. ``overlap``: the decode-heavy workload with ``async_scheduling`` off and on, alternated
   (same engine, same outputs checked), new tokens/s side by side.

GPU: python -m benchmarks.engine_core   CPU: python -m benchmarks.engine_core --shape tiny
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from benchmarks.common import base_parser, cpu_time_us, cuda_time_ms, format_table, write_json
from benchmarks.engine import SCOUT, SMOKE, write_random_checkpoint


def _timed(buckets, name, fn, sync=None):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if sync is not None:
                sync()
            buckets[name] += time.perf_counter() - start
    return wrapper


def step_breakdown(llm, prompts, new, device) -> dict:
    """Per-step host/device split of one generate() call (instrumented by wrapping)."""
    from chunklocal.engine.core import EngineCore

    buckets: dict = defaultdict(float)
    sync = torch.cuda.synchronize if device == "cuda" else None
    runner, sched = llm.runner, llm.scheduler
    builder = runner.builder
    saved = (sched.schedule, sched.postprocess, builder.prepare, builder.group_inputs,
             runner.run, EngineCore._publish, [b.build for b in runner.backends])
    sched.schedule = _timed(buckets, "schedule", sched.schedule)
    sched.postprocess = _timed(buckets, "postprocess", sched.postprocess)
    builder.prepare = _timed(buckets, "prepare", builder.prepare)
    builder.group_inputs = _timed(buckets, "group_inputs", builder.group_inputs)
    for backend in runner.backends:
        backend.build = _timed(buckets, "metadata_build", backend.build)
    runner.run = _timed(buckets, "run", runner.run, sync)
    EngineCore._publish = _timed(buckets, "publish", EngineCore._publish)
    try:
        start = time.perf_counter()
        llm.generate(prompts, max_new_tokens=new, ignore_eos=True, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        (sched.schedule, sched.postprocess, builder.prepare, builder.group_inputs, runner.run,
         EngineCore._publish, builds) = saved
        for backend, build in zip(runner.backends, builds, strict=True):
            backend.build = build
    steps = llm.last_stats.steps
    host_in_run = buckets["prepare"] + buckets["group_inputs"] + buckets["metadata_build"]
    host = buckets["schedule"] + host_in_run + buckets["postprocess"] + buckets["publish"]
    step = seconds / steps
    device_part = seconds - host
    return {"steps": steps, "seconds": seconds, "step_ms": 1e3 * step,
            **{f"{k}_ms": 1e3 * v / steps for k, v in sorted(buckets.items())},
            "host_ms": 1e3 * host / steps,
            "overlap_bound": seconds / max(host, device_part)}


def sampling_rows(llm, prompts, new, device) -> list:
    from chunklocal.engine.sampling import SamplingParams

    cases = {"greedy": dict(temperature=0.0),
             "top_k50_top_p0.95_T0.8": dict(temperature=0.8, top_k=50, top_p=0.95),
             "min_p0.05_T1": dict(temperature=1.0, min_p=0.05),
             "seeded_T0.8_top_p0.95": dict(temperature=0.8, top_p=0.95, seed=0),
             "repetition1.1_T0.8": dict(temperature=0.8, repetition_penalty=1.1),
             "logprobs5_greedy": dict(temperature=0.0, logprobs=5)}
    modes = [True, False] if llm.runner.sampler.use_flashinfer else [False]
    rows = []
    for flashinfer in modes:
        llm.runner.sampler.use_flashinfer = flashinfer
        for name, fields in cases.items():
            params = [SamplingParams(max_tokens=new, ignore_eos=True,
                                     **dict(fields, seed=i) if "seed" in fields else fields)
                      for i in range(len(prompts))]
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            made = sum(len(o.outputs[0].token_ids) for o in outs)
            assert made == new * len(prompts), (name, made)
            rows.append({"case": name, "sampler": "flashinfer" if flashinfer else "torch",
                         "new_tokens/s": made / seconds, "seconds": seconds})
            print(format_table(rows[-1:]), flush=True)
    llm.runner.sampler.use_flashinfer = modes[0]
    return rows


def overlap_rows(llm, prompts, new, device, rounds=2) -> list:
    """Sync loop vs async_scheduling on one engine, alternated; outputs must be equal."""
    rows, outputs = [], {}
    for _ in range(rounds):
        for overlap in (False, True):
            llm.async_scheduling = overlap
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            outs = llm.generate(prompts, max_new_tokens=new, ignore_eos=True, use_tqdm=False)
            seconds = time.perf_counter() - start
            if outputs.setdefault(overlap, outs) != outs or outputs.get(not overlap,
                                                                        outs) != outs:
                raise AssertionError("async_scheduling changed the outputs")
            rows.append({"async_scheduling": overlap, "new_tokens/s": len(prompts) * new /
                         seconds, "steps": llm.last_stats.steps, "seconds": seconds})
            print(format_table(rows[-1:]), flush=True)
    llm.async_scheduling = False
    return rows


def sampler_rows(device, num_rows, vocab, repeats) -> list:
    from chunklocal.engine.sampler import Sampler, sampling_row
    from chunklocal.engine.sampling import SamplingParams

    logits = torch.randn(num_rows, vocab, device=device)
    owner = np.arange(num_rows)
    rows = []
    for name, fields in {"T1": dict(temperature=1.0),
                         "top_k50_top_p0.9": dict(temperature=1.0, top_k=50, top_p=0.9),
                         "seeded_top_p0.9": dict(temperature=1.0, top_p=0.9, seed=1)}.items():
        params = SamplingParams(**fields)
        seqs = [SimpleNamespace(params=params, sampling_row=sampling_row(params), generator=None,
                                token_ids=[0], num_prompt_tokens=1) for _ in range(num_rows)]
        for flashinfer in ([True, False] if device == "cuda" else [False]):
            sampler = Sampler(device, use_flashinfer=flashinfer)
            if flashinfer and not sampler.use_flashinfer:
                continue

            def draw(s=sampler, q=seqs):
                return s(logits, q, owner)

            timing = cuda_time_ms(draw, repeats) if device == "cuda" else {
                k: (v / 1e3 if k != "n" else v) for k, v in cpu_time_us(draw, repeats).items()}
            rows.append({"case": name, "sampler": "flashinfer" if flashinfer else "torch",
                         "rows": num_rows, "vocab": vocab, "ms": timing["median"]})
    return rows


def main(argv=None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--shape", choices=["scout", "tiny"], default="scout",
                        help="scout: 4 Llama-4-Scout-shaped layers; tiny: the smoke model (CPU)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = dict(SCOUT if args.shape == "scout" else SMOKE)
    if args.vocab_size:
        shape["vocab_size"] = args.vocab_size
    repeats = args.repeats or 30
    if args.smoke:
        shape, repeats = SMOKE, 3
        args.num_prompts, args.prompt_len, args.new_tokens = 4, 16, 6
    import chunklocal

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        max_len = args.prompt_len + args.new_tokens
        write_random_checkpoint(model_dir, shape, max_len, device)
        if device == "cpu":
            torch.set_num_threads(1 if args.shape == "tiny" else torch.get_num_threads())
        llm = chunklocal.LLM(model_dir, device=device,
                             dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                             max_num_seqs=args.num_prompts, max_model_len=max_len,
                             max_num_batched_tokens=max(8192, args.prompt_len),
                             async_scheduling=False)  # the breakdown times runner.run;
        # overlap_rows switches it on and off itself
        rng = np.random.default_rng(0)
        prompts = rng.integers(0, shape["vocab_size"], (args.num_prompts, args.prompt_len))
        prompts = prompts.tolist()
        llm.generate(prompts[:2], max_new_tokens=2, use_tqdm=False)  # warm-up
        steps = step_breakdown(llm, prompts, args.new_tokens, device)
        print(format_table([steps]), flush=True)
        sampling = sampling_rows(llm, prompts, args.new_tokens, device)
        overlap = overlap_rows(llm, prompts, args.new_tokens, device)
        llm.core.shutdown()
    sampler = sampler_rows(device, args.num_prompts, shape["vocab_size"], repeats)
    print(format_table(sampler))
    path = write_json("engine_core_smoke" if args.smoke else "engine_core",
                      {"model": shape, "args": vars(args), "steps": steps,
                       "sampling": sampling, "overlap": overlap, "sampler": sampler,
                       "errors": []}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
