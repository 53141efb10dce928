"""The engine's prefill against its FLOP floor, per kernel class (GPU; issue 20, item 2).

For each ``--models`` geometry (as benchmarks/decode_floor.py names them; full-size Scout FP8
by default, dummy weights with spread routing: ``floors.routing``) and each ``--prompts``
length (8192 and 32768), one prompt is prefilled for real, ``--chunk`` tokens a step
(the engine's ``max_num_batched_tokens``), and timed.  Its floor counts each FLOP at the rate
of the unit that does it, both measured at the start of the same run:

* linear layers: 2 FLOPs per weight per token (dense weights, and the ``top_k`` routed
  experts each token uses), at the **FP8** matmul rate (``torch._scaled_mm``, row-wise
  scales, 8192^3; the faster of its promoting and fast-accumulation forms) for FP8 weights
  and the **bf16** rate for the others;
* attention: 4 * heads * head_dim per (query, visible key) pair (within the chunk on chunked
  layers), at the bf16 rate;
* the LM head on the last position only.

Then torch.profiler over ``--profile-steps`` steps of fresh ``--chunk``-token prompts (prefix
0) gives device time per kernel class (``floors.kernel_class``), each GEMM and attention
class beside its FLOPs in that step and its share of its own unit's rate, and the device's
idle time per step.  Issue 20's target: the prefill at 70% of its floor at 8k and 32k.
Each length is timed twice: through ``ModelRunner.run`` a step at a time (``prefill_s``,
``share``: the host builds each step while the device waits) and through ``LLM.generate``
(``prefill_s_loop``, ``share_loop``: the engine's loop, which overlaps a step's host work
with the step before it where ``async_scheduling`` is on, its default at one rank).

    python -m benchmarks.prefill_profile --out $OUT
    python -m benchmarks.prefill_profile --models scout4 maverick4 --prompts 8192 --out $OUT
    python -m benchmarks.prefill_profile --smoke       # CPU: checks the logic
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import floors
from benchmarks.common import (
    base_parser,
    cuda_time_ms,
    format_table,
    guarded,
    measure_matmul_flops,
    write_json,
)
from benchmarks.decode_floor import MODELS, run_prompt, write_config

#: kernel classes whose FLOPs the step's split names (the others are bandwidth or overhead)
FP8_CLASSES = ("FP8 GEMMs, Triton (experts and dense)", "dense GEMMs, FP8")


def measure_fp8_matmul_flops(device, n: int = 8192, repeats: int = 20,
                             fast_accum: bool = False) -> float:
    """FP8 (e4m3) matrix-product rate with row-wise scales into bf16, FLOP/s: what the
    engine's FP8 linear layers run on (cuBLASLt through ``torch._scaled_mm``), with the
    partial sums promoted to float32 or (``fast_accum``) not."""
    fp8 = torch.float8_e4m3fn
    a = torch.randn(n, n, device=device).to(fp8)
    b = torch.randn(n, n, device=device).to(fp8).t()  # column-major, as _scaled_mm wants
    sa = torch.ones(n, 1, device=device)
    sb = torch.ones(1, n, device=device)
    ms = cuda_time_ms(lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16,
                                               use_fast_accum=fast_accum),
                      repeats=repeats)["median"]
    return 2 * n**3 / (ms * 1e-3)


def measure_rates(device) -> dict:
    """The floor's rates: bf16, and FP8 as the faster of the promoting and the
    fast-accumulation products (CHUNKLOCAL_FP8_FAST_ACCUM may run either, and a floor at
    the slower one would credit a variant for changing the yardstick); both recorded."""
    if device.type == "cuda":
        fp8 = {f"fp8_{form}_flops_per_s": measure_fp8_matmul_flops(device, fast_accum=fast)
               for form, fast in (("promoted", False), ("fast_accum", True))}
        return {"bf16_flops_per_s": measure_matmul_flops(device),
                "fp8_flops_per_s": max(fp8.values()), **fp8}
    return {"bf16_flops_per_s": 1e11, "fp8_flops_per_s": 2e11}  # smoke: the logic only


def linear_params(model) -> dict:
    """Weights a prefill token multiplies by, split by kind and dtype: ``dense_fp8``,
    ``dense_16`` (every weight but the embedding, the LM head and the routed experts; a
    shared expert stacked into the experts' slot E too) and ``expert_fp8`` / ``expert_16``
    (one routed expert, summed over the MoE layers)."""
    from chunklocal.models.moe import MoE

    out = dict.fromkeys(("dense_fp8", "dense_16", "expert_fp8", "expert_16"), 0)
    experts = set()
    for module in model.modules():
        if isinstance(module, MoE):
            ex = module.experts
            for w in (ex.w13, ex.w2):
                experts.add(id(w))
                out["expert_fp8" if w.element_size() == 1 else "expert_16"] += w[0].numel()
                if module.stacked:  # slot E: the shared expert, every token's
                    out["dense_fp8" if w.element_size() == 1 else "dense_16"] += w[-1].numel()
    for name, p in model.named_parameters():
        if id(p) in experts or "embed_tokens" in name or "lm_head" in name or p.dim() < 2:
            continue  # norms and scales (1-d) do no matmul work
        out["dense_fp8" if p.element_size() == 1 else "dense_16"] += p.numel()
    return out


def prefill_split(config, layer_kinds, params: dict, prompt_len: int,
                  prefix: int = 0) -> dict:
    """FLOPs of ``prompt_len`` new tokens after ``prefix`` cached ones, by unit: ``fp8``,
    ``bf16`` (linear layers by weight dtype) and ``attention``; the LM head once."""
    top_k = config.num_experts_per_tok
    fp8 = 2.0 * prompt_len * (params["dense_fp8"] + top_k * params["expert_fp8"])
    bf16 = 2.0 * prompt_len * (params["dense_16"] + top_k * params["expert_16"])
    bf16 += 2.0 * config.vocab_size * config.hidden_size
    total = floors.prefill_flops(config, layer_kinds, prefix + prompt_len, 0, 0)
    before = floors.prefill_flops(config, layer_kinds, prefix, 0, 0) if prefix else \
        2.0 * config.vocab_size * config.hidden_size
    return {"fp8": fp8, "bf16": bf16, "attention": total - before}


def floor_seconds(split: dict, rates: dict) -> float:
    return (split["fp8"] / rates["fp8_flops_per_s"]
            + (split["bf16"] + split["attention"]) / rates["bf16_flops_per_s"])


def random_prompt(llm, prompt_len: int, seed: int) -> list[int]:
    """``prompt_len`` token ids drawn from the model's vocabulary, seeded by ``seed``."""
    return np.random.default_rng(seed).integers(0, llm.config.vocab_size,
                                                prompt_len).tolist()


def prefill_once(llm, prompt_len: int, seq_id: int, steps: int | None = None) -> int:
    """A random ``prompt_len`` prompt (seeded by ``seq_id``) through ``run_prompt``."""
    return run_prompt(llm, seq_id, random_prompt(llm, prompt_len, seq_id), steps)


def prefill_through_loop(llm, prompt_len: int, seed: int) -> tuple[float, int]:
    """Seconds for a random ``prompt_len`` prompt through ``LLM.generate`` (one token
    out): the engine core's loop, which with ``async_scheduling`` (on by default at one
    rank) builds step n+1's inputs and plans while the device runs step n, where
    ``run_prompt`` waits for each step's token first; and the steps it took."""
    prompt = random_prompt(llm, prompt_len, seed)
    start = time.perf_counter()
    llm.generate([prompt], max_new_tokens=1, ignore_eos=True, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.last_stats
    if stats is None or stats.prompt_tokens != prompt_len:
        raise RuntimeError(f"LLM.generate prefilled {stats and stats.prompt_tokens} tokens, "
                           f"not {prompt_len}")
    return seconds, stats.steps


def model_rows(model: str, args, rates, device) -> list[dict]:
    import chunklocal

    with tempfile.TemporaryDirectory() as tmp:
        llm = chunklocal.LLM(write_config(Path(tmp) / model, model), device=str(device),
                             load_format="dummy",
                             dtype=None if device.type == "cuda" else torch.float32,
                             max_num_seqs=2, max_model_len=max(args.prompts) + 16,
                             max_num_batched_tokens=args.chunk, enable_prefix_caching=False,
                             gpu_memory_utilization=0.9)
    params = linear_params(llm.model)
    prefill_once(llm, args.chunk, 10**6)  # warm-up: kernels, plans, autotune
    rows = []
    for n, prompt_len in enumerate(args.prompts):
        start = time.perf_counter()
        steps = prefill_once(llm, prompt_len, n)
        seconds = time.perf_counter() - start
        split = prefill_split(llm.config, llm.layer_kinds, params, prompt_len)
        floor = floor_seconds(split, rates)
        rows.append({"model": model, "prompt_len": prompt_len, "steps": steps,
                     "prefill_s": seconds, "floor_s": floor, "share": floor / seconds,
                     **{f"{unit}_tflop": flops / 1e12 for unit, flops in split.items()}})
        print(format_table(rows[-1:]), flush=True)
    ids = iter(range(10**6 + 1, 10**7))
    profile = floors.kernel_profile(
        lambda: prefill_once(llm, args.chunk, next(ids), steps=1),
        args.profile_steps, device)
    llm.scheduler.abort_all()
    # The same lengths through the engine's own loop (after the direct runs: its thread
    # then drives the scheduler), a warm-up call first for the thread's start.
    prefill_through_loop(llm, args.chunk, 2 * 10**6)
    for n, row in enumerate(rows):
        row["prefill_s_loop"], row["steps_loop"] = prefill_through_loop(
            llm, row["prompt_len"], 2 * 10**6 + 1 + n)
        row["share_loop"] = row["floor_s"] / row["prefill_s_loop"]
        print(f"{model} {row['prompt_len']} through LLM.generate: {row['prefill_s_loop']:.4f} s"
              f" = {row['share_loop']:.1%} of the floor", flush=True)
    step = prefill_split(llm.config, llm.layer_kinds, params, args.chunk)
    rows[-1]["profile"] = profile | {
        "step_flops": step, "class_rates": class_rates(profile, step, rates,
                                                       fp8_experts=params["expert_fp8"] > 0)}
    llm.shutdown()
    return rows


def class_rates(profile: dict, step: dict, rates: dict, fp8_experts: bool) -> dict:
    """Per unit of one profiled step (FP8 GEMMs, bf16 GEMMs, attention): its FLOPs (the
    step's split) over the time of its kernel classes, and that as a share of the unit's
    measured rate.  The grouped expert GEMMs count with FP8 when the experts are FP8."""
    classes = profile["classes_per_step"]
    fp8 = FP8_CLASSES + (("expert GEMMs",) if fp8_experts else ())
    bf16 = ("dense GEMMs, bf16",) + (() if fp8_experts else ("expert GEMMs",))
    groups = {"fp8": [c for c in classes if c in fp8],
              "bf16": [c for c in classes if c in bf16],
              "attention": [c for c in classes if c == "attention"]}
    out = {}
    for unit, names in groups.items():
        ms = sum(classes[c]["ms"] for c in names)
        if not names or ms <= 0 or step[unit] <= 0:
            continue
        rate = step[unit] / (ms * 1e-3)
        peak = rates["fp8_flops_per_s" if unit == "fp8" else "bf16_flops_per_s"]
        out[unit] = {"classes": names, "ms": ms, "tflops_per_s": rate / 1e12,
                     "share_of_rate": rate / peak}
    return out


def main(argv=None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["scout-fp8"], choices=sorted(MODELS))
    parser.add_argument("--prompts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--routing", choices=("balanced", "model"), default="balanced")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.prompts, args.chunk, args.profile_steps = ["smoke"], [40, 90], 32, 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rates = measure_rates(device)
    rows: list[dict] = []
    errors: list = []
    name = "prefill_profile_smoke" if args.smoke else "prefill_profile"
    with floors.routing(args.routing):
        for model in args.models:
            rows += guarded(model, lambda m=model: model_rows(m, args, rates, device),
                            errors) or []
            write_json(name, {"args": vars(args), "rates": rates, "rows": rows,
                              "errors": errors}, args.out)
    for row in rows:
        if "profile" in row:
            print(row["model"], "per step of", args.chunk, "tokens:",
                  {unit: f"{v['share_of_rate']:.0%} of its rate in {v['ms']:.2f} ms"
                   for unit, v in row["profile"]["class_rates"].items()})
            gaps = row["profile"].get("idle_gaps_per_step")
            if gaps:  # launch-sized gaps against a host that fell behind
                print("  idle gaps per step:", {k: f"{v['gaps']:.0f} = {v['ms']:.2f} ms"
                                                for k, v in gaps.items()})
                for gap in row["profile"].get("largest_idle_gaps", [])[:3]:  # who waited
                    print(f"  {gap['us']} us after {gap['after'][:50]} before {gap['before'][:50]}")
    path = write_json(name, {"args": vars(args), "rates": rates, "rows": rows,
                             "errors": errors}, args.out)
    print(f"wrote {path}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
