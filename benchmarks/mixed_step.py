"""Mixed steps, eager against piecewise CUDA graphs: step time and device idle (issue 20).

Traffic: ``--decodes`` requests (63) decoding at ``--context`` (1024) tokens, beside one
request whose random ``--prompt``-token (8192) prompt prefills one ``--chunk`` (2048) per
step; when it ends, the next such request starts.  Every timed step is 63 decodes plus a
2048-token chunk at a prefix of 0, 2k, 4k or 6k tokens, the step a busy server runs most.
The engine's ``max_num_batched_tokens`` is decodes + chunk, so the scheduler makes exactly
that step.  (The tenth session's H200 run had one long prompt whose prefix grew to about
75k tokens by the profile, so its attention was the global layer's long prefix.)  Dummy
weights with spread routing (``floors.routing``), the 4-layer Scout geometry by default
(``--model``, as benchmarks/decode_floor.py names them).

One engine, its piecewise graphs captured at start-up (engine/piecewise_graphs.py, switched
on here); the two modes alternate in blocks of ``--steps`` steps (the long prompt's prefix,
bounded by ``--prompt``): "eager" runs the step's forward op by op,
"piecewise" replays the segments with the attention between them.  Step time is
``ModelRunner.run`` (host preparation, forward, sampling, the tokens on the host); then
torch.profiler gives the device's busy and idle time per step in each mode.  Issue 20's
target: idle at most 10% of the step.

``--loop-prompts`` (8) adds rows of the same traffic through the engine's own loop
(``LLM.generate``, async scheduling; :func:`loop_rows`): eager steps collected before the
next is planned (the default) against overlapped (``CHUNKLOCAL_OVERLAP_EAGER=1``), eager
and piecewise, with the device's idle share over the whole run.

    python -m benchmarks.mixed_step --out $OUT
    python -m benchmarks.mixed_step --smoke          # CPU: eager only, checks the logic
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks import floors
from benchmarks.common import base_parser, format_table, guarded, write_json
from benchmarks.decode_floor import MODELS, admit, fill, step_times, write_config


def total_steps(args) -> int:
    """Steps the run makes at most: warm-up, timed blocks and profiles, per mode."""
    return 4 * args.repeats * args.steps + 8


def make_engine(path, device, args):
    import chunklocal
    from chunklocal.engine import piecewise_graphs

    piecewise_graphs.PIECEWISE_ENABLED = device.type == "cuda"  # read at graph capture
    steps = total_steps(args)
    max_len = max(args.context + steps + 64, args.prompt + 1)
    pages = (args.decodes * -(-(args.context + steps + 64) // 16) + -(-max_len // 16)
             + args.decodes + 16)
    return chunklocal.LLM(path, device=str(device), load_format="dummy",
                          dtype=None if device.type == "cuda" else torch.float32,
                          max_num_seqs=args.decodes + 1, max_model_len=max_len,
                          max_num_batched_tokens=args.decodes + args.chunk,
                          num_kv_blocks=pages, cuda_graphs=device.type == "cuda")


class LongPrompts:
    """Keeps one request prefilling: before each step, if none is, a new one of
    ``length`` random tokens (one sampled token, then it ends)."""

    def __init__(self, llm, length: int, first_id: int):
        self.llm, self.length, self.next_id = llm, length, first_id
        self.rng = np.random.default_rng(0)

    def ensure(self) -> None:
        from chunklocal.engine.sampling import SamplingParams

        sched = self.llm.scheduler
        if sched.waiting or any(s.is_prefilling for s in sched.running):
            return
        prompt = self.rng.integers(0, self.llm.config.vocab_size, self.length).tolist()
        admit(self.llm, self.next_id, prompt, SamplingParams(max_tokens=1, temperature=0.0))
        self.next_id += 1


def mixed_steps(llm, longs: LongPrompts, count: int, piecewise: bool,
                device) -> list[tuple[float, int]]:
    """(ms, tokens) of ``count`` steps, with the piecewise graphs or eagerly."""
    runner = llm.runner
    saved = runner.piecewise
    runner.piecewise = saved if piecewise else None
    times = []
    try:
        for _ in range(count):
            longs.ensure()
            times += step_times(llm, 1, device)
        return times
    finally:
        runner.piecewise = saved


def loop_prompts(llm, args, seed: int):
    """The engine-loop rows' requests: ``--decodes`` prompts of ``--context`` tokens that
    decode until the long prompts are done, then ``--loop-prompts`` prompts of ``--prompt``
    tokens (one new token each) that prefill ``--chunk`` tokens a step beside them.  Each
    ``seed`` its own random prompts: the prefix cache (on by default) serves none of them."""
    from chunklocal.engine.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = llm.config.vocab_size
    # the decodes' own prefills take about decodes * context / chunk steps first
    steps = -(-args.decodes * args.context // args.chunk) + args.loop_prompts * -(
        -args.prompt // args.chunk)
    prompts = [rng.integers(0, vocab, args.context).tolist() for _ in range(args.decodes)]
    prompts += [rng.integers(0, vocab, args.prompt).tolist() for _ in range(args.loop_prompts)]
    params = [SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)] * args.decodes
    params += [SamplingParams(max_tokens=1, temperature=0.0)] * args.loop_prompts
    return prompts, params


def loop_rows(llm, args, modes, device) -> list[dict]:
    """The same traffic through the engine's own loop (``LLM.generate``, async scheduling),
    so the host's work for step n+1 may run while the device runs step n: with each eager
    step collected before the next is planned (the default) and with eager steps overlapped
    (the backends' ``overlaps_eager_steps``, ``CHUNKLOCAL_OVERLAP_EAGER=1``), each eagerly
    and with piecewise graphs.  Wall time and steps of one generate; device busy / idle of
    a second one under the profiler (idle share over the whole run: most of its steps carry
    a prefill chunk beside decodes, ``mixed_steps`` counts them)."""
    import time

    runner = llm.runner
    saved = runner.piecewise, [b.overlaps_eager_steps for b in runner.backends]
    launches: list[tuple[bool, bool]] = []
    real_launch = runner.launch

    def counting(batch, prev=None):
        launches.append((prev is not None, max(batch.num_new) > 1 and min(batch.num_new) == 1))
        return real_launch(batch, prev)

    runner.launch = counting
    rows = []
    try:
        seeds = iter(range(1, 100))
        prompts, params = loop_prompts(llm, args, next(seeds))
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: the loop's first uses
        for mode in modes:
            for overlap in (False, True):
                runner.piecewise = saved[0] if mode == "piecewise" else None
                for backend in runner.backends:
                    backend.overlaps_eager_steps = overlap
                launches.clear()
                prompts, params = loop_prompts(llm, args, next(seeds))
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                wall = time.perf_counter() - start
                steps = len(launches)
                row = {"model": args.model, "mode": f"loop, {mode}",
                       "overlap_eager": overlap, "steps": steps,
                       "mixed_steps": sum(m for _, m in launches),
                       "launched_in_flight": sum(p for p, _ in launches),
                       "step_ms": wall * 1e3 / max(steps, 1)}
                prompts, params = loop_prompts(llm, args, next(seeds))
                profile = floors.kernel_profile(
                    lambda p=prompts, q=params: llm.generate(p, q, use_tqdm=False), 1, device)
                busy, idle = (profile.get("device_busy_ms_per_step"),
                              profile.get("device_idle_ms_per_step"))
                if busy is not None and idle is not None:
                    row.update(busy_ms=busy / steps, idle_ms=idle / steps,
                               idle_share=idle / (busy + idle))
                rows.append(row)
                print(format_table([row]), flush=True)
    finally:
        runner.launch = real_launch
        runner.piecewise = saved[0]
        for backend, value in zip(runner.backends, saved[1], strict=True):
            backend.overlaps_eager_steps = value
    return rows


def run(args, device) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        llm = make_engine(write_config(Path(tmp) / args.model, args.model), device, args)
    fitted = fill(llm, args.decodes, args.context, total_steps(args) + 32)
    longs = LongPrompts(llm, args.prompt, args.decodes)
    modes = ("eager", "piecewise") if llm.runner.piecewise is not None else ("eager",)
    for mode in modes:  # warm-up: first-use costs of each mode
        mixed_steps(llm, longs, 2, mode == "piecewise", device)
    times: dict[str, list[float]] = {m: [] for m in modes}
    tokens = set()
    for _ in range(args.repeats):
        for mode in modes:
            for ms, n in mixed_steps(llm, longs, args.steps, mode == "piecewise", device):
                times[mode].append(ms)
                tokens.add(n)
    rows = []
    for mode in modes:
        profile = floors.kernel_profile(
            lambda m=mode: mixed_steps(llm, longs, 1, m == "piecewise", device), 3, device)
        row = {"model": args.model, "mode": mode, "decodes": fitted, "chunk": args.chunk,
               "step_ms": statistics.median(times[mode]),
               "min_ms": min(times[mode]), "max_ms": max(times[mode])}
        busy, idle = (profile.get("device_busy_ms_per_step"),
                      profile.get("device_idle_ms_per_step"))
        if busy is not None and idle is not None:
            row.update(busy_ms=busy, idle_ms=idle, idle_share=idle / (busy + idle))
        row["classes_per_step"] = profile["classes_per_step"]
        rows.append(row)
    if llm.runner.piecewise is not None:
        rows[-1]["replays_by_bucket"] = dict(llm.runner.piecewise.replays)
    if args.loop_prompts:
        llm.scheduler.abort_all()
        rows += loop_rows(llm, args, modes, device)
    llm.shutdown()
    return {"rows": rows, "step_tokens": sorted(tokens),
            "long_prompts": longs.next_id - args.decodes}


def main(argv=None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default="scout4", choices=sorted(MODELS))
    parser.add_argument("--decodes", type=int, default=63)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=8192,
                        help="tokens of each long prompt (it prefills --chunk a step)")
    parser.add_argument("--steps", type=int, default=5, help="steps per mode per block")
    parser.add_argument("--routing", choices=("balanced", "model"), default="balanced")
    parser.add_argument("--loop-prompts", type=int, default=8,
                        help="long prompts of the engine-loop rows (0: none; loop_rows)")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or 3
    if args.smoke:
        args.model, args.decodes, args.context, args.chunk, args.prompt = "smoke", 3, 40, 24, 72
        args.steps, args.repeats, args.loop_prompts = 2, 1, min(args.loop_prompts, 2)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    errors: list = []
    with floors.routing(args.routing):
        result = guarded("mixed steps", lambda: run(args, device), errors)
    result = result or {"rows": [], "step_tokens": [], "long_prompts": 0}
    print(format_table([{k: v for k, v in r.items() if not isinstance(v, dict)}
                        for r in result["rows"]]))
    path = write_json("mixed_step_smoke" if args.smoke else "mixed_step",
                      {"args": vars(args), **result, "errors": errors}, args.out)
    print(f"wrote {path}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
