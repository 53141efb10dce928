"""Decode and prefill steps of Llama-4 geometries against their floors, in one run (GPU).

Models (random weights, ``load_format="dummy"``: only config.json is written):

* ``scout4``: Scout's published text config at 4 layers (16 experts top-1 + the shared
  expert on every layer, 3 chunked RoPE layers + 1 global NoPE layer), bf16;
* ``maverick4``: Maverick's geometry at 4 layers (128 experts, MoE every other layer,
  dense MLP 16384 on the others), bf16;
* ``scout-fp8``: full-size Scout (48 layers) with the community FP8-dynamic quantization.

For each (batch, context) cell the requests' KV pages are allocated as a prefill would leave
them, without computing it (the cache holds zeros: the step reads the same bytes), then
``--steps`` decode steps are timed with CUDA graphs and eagerly (``ModelRunner.run``: host
preparation, the forward, sampling and the copy of the tokens to the host).  A cell whose KV
does not fit runs the largest batch that does.  The floor of a step is the bytes it must read
(benchmarks/floors.py: dense weights, the experts its tokens chose -- counted in an untimed
eager step --, the LM head, the KV) at the copy rate measured in the same run; of a prefill,
its FLOPs at the matmul rate measured in the same run.  Each row also gives the step's CUDA
graph replayed alone (``graph_replay_ms``) and the step's time outside it
(``outside_graph_ms``: host preparation, input copies, sampling, the tokens' copy back).
``--profile`` adds torch.profiler's device time per kernel and the device's idle time per
step, for graphs and eager.
``--alternate N``: the chunked model against the same weights with chunking off (both read the
same KV at contexts under the chunk), N alternated repeats, the spread reported.

    python -m benchmarks.decode_floor --models scout4 maverick4 --profile --alternate 5
    python -m benchmarks.decode_floor --models scout-fp8 --batches 1 16 64 --contexts 1024
    python -m benchmarks.decode_floor --smoke          # CPU: checks the logic
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

from benchmarks import floors
from benchmarks.common import (
    base_parser,
    format_table,
    guarded,
    measure_copy_bytes_per_s,
    measure_matmul_flops,
    write_json,
)
from benchmarks.fp8_dummy import FP8_DYNAMIC, SCOUT_TEXT, write_llama4_config
from benchmarks.fp8_dummy import SMOKE as SMOKE_TEXT
from benchmarks.host_step import sampled_without_model

FOUR = dict(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0])
MODELS = {
    "scout4": (dict(FOUR, moe_layers=[0, 1, 2, 3]), None),
    "maverick4": (dict(FOUR, num_local_experts=128, interleave_moe_layer_step=2,
                       moe_layers=[1, 3]), None),
    "scout-fp8": ({}, FP8_DYNAMIC),
    # Scout FP8's first 12 layers: every per-layer kernel at full size, in an H100's 80 GB
    # (26 GB of layers); a per-layer A/B where no H200 is lent
    "scout-fp8-12": (dict(num_hidden_layers=12, moe_layers=list(range(12)),
                          no_rope_layers=[int((i + 1) % 4 != 0) for i in range(12)]),
                     FP8_DYNAMIC),
    "smoke": (SMOKE_TEXT, None),
}


def write_config(path: Path, model: str, chunked: bool = True) -> Path:
    text_changes, quant = MODELS[model]
    text = {**SCOUT_TEXT, **text_changes}
    if not chunked:  # every layer global, the same weights
        text.update(attention_chunk_size=None,
                    layer_types=["full_attention"] * text["num_hidden_layers"])
    return write_llama4_config(path, text, quant)


def make_llm(path, device, max_num_seqs, max_model_len, num_kv_blocks, kv_cache_dtype="auto"):
    import chunklocal

    return chunklocal.LLM(path, device=str(device), load_format="dummy",
                          dtype=None if device.type == "cuda" else torch.float32,
                          kv_cache_dtype=kv_cache_dtype,
                          max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          max_num_batched_tokens=max(8192, max_num_seqs),
                          num_kv_blocks=num_kv_blocks, cuda_graphs=device.type == "cuda")


def admit(llm, seq_id: int, prompt: list[int], params):
    """A request of ``prompt`` straight into the engine's scheduler (no client, no core)."""
    from chunklocal.engine.sampler import sampling_row
    from chunklocal.engine.sequence import Sequence

    seq = Sequence(seq_id, prompt, params, len(llm.groups))
    seq.sampling_row = sampling_row(params)
    llm.scheduler.add(seq)
    return seq


def fill(llm, batch: int, context: int, new: int) -> int:
    """Admit ``batch`` requests of ``context`` tokens and give them their pages as a
    prefill would (nothing is computed: the scheduler and block manager run, the model
    does not); how many fit at once.  Requests that wait for pages are dropped."""
    from chunklocal.engine.sampling import SamplingParams

    sched = llm.scheduler
    sched.abort_all()
    # fill may decode a few tokens of early requests while later ones still prefill
    params = SamplingParams(max_tokens=new + 64, ignore_eos=True, temperature=0.0)
    rng = np.random.default_rng(batch * 7919 + context)
    for i in range(batch):
        admit(llm, i, rng.integers(0, llm.config.vocab_size, context).tolist(), params)
    while sched.waiting or any(len(s.token_ids) - s.num_computed > 1 for s in sched.running):
        step = sched.schedule()
        if sched.waiting and all(n == 1 for n in step.num_new):  # the pool is full
            for seq in list(sched.waiting):
                sched.abort(seq)
        sched.postprocess(step, sampled_without_model(step, token=1), frozenset())
    return len(sched.running)


def step_times(llm, steps: int, device) -> list[tuple[float, int]]:
    """(milliseconds, tokens) of the next ``steps`` steps the scheduler makes, each timed
    around ``ModelRunner.run`` (host preparation, forward, sampling, tokens on the host)."""
    runner, sched = llm.runner, llm.scheduler
    times = []
    for _ in range(steps):
        batch = sched.schedule()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = runner.run(batch)  # returns host tokens: the step is over
        times.append(((time.perf_counter() - start) * 1e3, int(sum(batch.num_new))))
        sched.postprocess(batch, out.tokens, frozenset())
    return times


def timed_steps(llm, steps: int, graphs: bool, device) -> list[float]:
    """Milliseconds of ``steps`` decode steps of every running request."""
    runner = llm.runner
    saved, runner.graphs = runner.graphs, runner.graphs if graphs else None
    try:
        return [ms for ms, _ in step_times(llm, steps, device)]
    finally:
        runner.graphs = saved


def replay_only_ms(graphs, replays_before, reps: int, device) -> float | None:
    """Median milliseconds of replaying, alone, the CUDA graph the timed steps used (the
    captured kernels and the gaps between them), or None without graphs.  A graph step's
    time less this is what the step spends outside its graph: the host's preparation, the
    static inputs' copies, sampling and the tokens' copy back.  Replaying again rewrites the
    same KV slots with the same values."""
    if graphs is None:
        return None
    used = graphs.replays - replays_before
    if not used:
        return None
    graph = graphs.graphs[used.most_common(1)[0][0]]
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        graph.replay()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def step_floor(llm, positions: np.ndarray, distinct_experts, rates) -> tuple[dict, float]:
    """(bytes by part, floor ms) of a decode step of ``llm`` whose queries sit at
    ``positions`` (floors.decode_bytes), at the copy rate of ``rates``."""
    spec = llm.groups[0].spec
    kv_per_key = 2 * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
    need = floors.decode_bytes(llm.model, llm.config, llm.layer_kinds, positions,
                               distinct_experts, kv_per_key)
    return need, need["bytes"] / rates["copy_bytes_per_s"] * 1e3


def decode_cell(llm, model, batch, context, args, rates, device) -> dict:
    fitted = fill(llm, batch, context, 3 * args.steps + 16)
    row = {"model": model, "batch": fitted, "asked_batch": batch, "context": context}
    if fitted == 0:
        return row | {"error": "no request fits the KV pool"}
    timed_steps(llm, 3, True, device)  # warm-up (graph replays, FlashInfer plans)
    graphs = llm.runner.graphs
    before = graphs.replays.copy() if graphs is not None else None
    graph = timed_steps(llm, args.steps, True, device)
    replay_ms = replay_only_ms(graphs, before, args.steps, device)
    timed_steps(llm, 2, False, device)
    with floors.RoutingCounter() as routing:
        timed_steps(llm, 1, False, device)
    eager = timed_steps(llm, args.steps, False, device)
    positions = np.fromiter((s.num_computed for s in llm.scheduler.running), np.int64)
    need, floor_ms = step_floor(llm, positions, routing.distinct or None, rates)
    row.update(graph_ms=statistics.median(graph), eager_ms=statistics.median(eager),
               floor_ms=floor_ms, experts_per_moe_layer=routing.distinct, **need)
    row.update(graph_share=floor_ms / row["graph_ms"], eager_share=floor_ms / row["eager_ms"])
    if replay_ms is not None:  # the step's time inside its graph, and outside it
        row.update(graph_replay_ms=replay_ms, outside_graph_ms=row["graph_ms"] - replay_ms)
    if args.profile and batch in args.profile_batches:
        for mode in ("graphs", "eager"):
            row[f"profile_{mode}"] = floors.kernel_profile(
                lambda m=mode: timed_steps(llm, 1, m == "graphs", device), 5, device)
    llm.scheduler.abort_all()
    return row


def run_prompt(llm, seq_id: int, prompt: list[int], steps: int | None = None) -> int:
    """Admit ``prompt`` (one greedy token out) and run ``steps`` scheduler steps (every
    one, by default), each through ``ModelRunner.run`` (the tokens reach the host: the
    step is over); how many ran."""
    from chunklocal.engine.sampling import SamplingParams

    sched, runner = llm.scheduler, llm.runner
    admit(llm, seq_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0))
    ran = 0
    while sched.has_work() and (steps is None or ran < steps):
        batch = sched.schedule()
        sched.postprocess(batch, runner.run(batch).tokens, frozenset())
        ran += 1
    return ran


def prefill_cell(llm, model, prompt_len, rates, device) -> dict:
    """One ``prompt_len`` prompt, prefilled for real in steps of max_num_batched_tokens."""
    llm.scheduler.abort_all()
    prompt = np.random.default_rng(1).integers(0, llm.config.vocab_size, prompt_len).tolist()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    steps = run_prompt(llm, 0, prompt)
    seconds = time.perf_counter() - start
    dense, expert = floors.param_counts(llm.model)
    flops = floors.prefill_flops(llm.config, llm.layer_kinds, prompt_len, dense, expert)
    floor_s = flops / rates["matmul_flops_per_s"]
    return {"model": model, "prompt_len": prompt_len, "steps": steps, "prefill_s": seconds,
            "tflops_per_s": flops / seconds / 1e12, "floor_s": floor_s,
            "share": floor_s / seconds}


def alternate(path, device, args, rates) -> list[dict]:
    """The chunked model against the same weights unchunked: ``args.alternate`` repeats of
    ``args.steps`` steps each, alternated, graphs and eager.  Both engines stay loaded when
    the device holds two; otherwise (full-size Scout: 105 GiB of weights each) every repeat
    loads one engine, measures it and frees it before the other loads."""
    batch, context = args.alternate_batch, args.alternate_context
    new = args.alternate * args.steps * 2 + 32
    paths = {"chunked": path, "unchunked": write_config(
        path.parent / (path.name + "-unchunked"), args.models[0], False)}
    pages = batch * -(-(context + new + 80) // 16)

    def load(name):
        llm = make_llm(paths[name], device, batch, context + new + 80, pages,
                       args.kv_cache_dtype)
        if fill(llm, batch, context, new) != batch:
            raise RuntimeError("the alternation's batch does not fit")
        timed_steps(llm, 3, True, device)
        return llm

    free_before = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    llms = {"chunked": load("chunked")}
    if device.type == "cuda":  # a second engine needs what the first took, and some slack
        free_after = torch.cuda.mem_get_info(device)[0]
        resident = free_after > 1.2 * (free_before - free_after)
    else:
        resident = True
    resident = resident and not args.alternate_reload
    if resident:
        llms["unchunked"] = load("unchunked")
    runs = {(n, m): [] for n in paths for m in ("graphs", "eager")}
    for _ in range(args.alternate):
        for name in paths:
            llm = llms.get(name) or load(name)
            for mode in ("graphs", "eager"):
                runs[(name, mode)].append(statistics.median(
                    timed_steps(llm, args.steps, mode == "graphs", device)))
            if not resident:
                llm.shutdown()
                llms.clear()
                del llm
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    rows = []
    for (name, mode), medians in runs.items():
        rows.append({"model": name, "mode": mode, "batch": batch, "context": context,
                     "resident": resident, "median_ms": statistics.median(medians),
                     "min_ms": min(medians), "max_ms": max(medians), "repeats_ms": medians})
    for mode in ("graphs", "eager"):
        a, b = (runs[("chunked", mode)], runs[("unchunked", mode)])
        rows.append({"model": "chunked / unchunked", "mode": mode,
                     "median_ms": statistics.median(a) / statistics.median(b)})
    for llm in llms.values():
        llm.shutdown()
    del llms
    gc.collect()
    return rows


def measure_rates(device) -> dict:
    if device.type == "cuda":
        return {"copy_bytes_per_s": measure_copy_bytes_per_s(device),
                "matmul_flops_per_s": measure_matmul_flops(device)}
    src = torch.ones(1 << 24, dtype=torch.uint8)  # smoke only: the numbers mean nothing
    start = time.perf_counter()
    src.clone()
    copy = 2 * src.numel() / (time.perf_counter() - start)
    a = torch.randn(256, 256)
    start = time.perf_counter()
    a @ a
    return {"copy_bytes_per_s": copy, "matmul_flops_per_s": 2 * 256**3 /
            (time.perf_counter() - start)}


def kv_bytes(llm) -> int:
    """Bytes of the engine's KV pools (every group, every layer reading it)."""
    layers = [0] * len(llm.groups)
    for kind in llm.layer_kinds:
        layers[llm.runner.kind_to_group[kind]] += 1
    return sum((grp.num_blocks + 1) * grp.spec.page_size_bytes * n
               for grp, n in zip(llm.groups, layers, strict=True))


def make_llm_with_kv(path, device, max_num_seqs, max_model_len, fraction=0.8,
                     kv_cache_dtype="auto"):
    """An engine whose KV pool holds every request at max_model_len if that fits, else
    ``fraction`` of the memory left after the weights (LLM's default budget is 40%)."""
    whole = max_num_seqs * -(-max_model_len // 16)
    try:
        return make_llm(path, device, max_num_seqs, max_model_len, whole, kv_cache_dtype)
    except ValueError as err:  # does not fit: measure what is left, then size from it
        print(f"{whole} KV pages do not fit ({err}); sizing from free memory", flush=True)
    llm = make_llm(path, device, max_num_seqs, max_model_len, None, kv_cache_dtype)
    if device.type != "cuda":
        return llm
    now = max(g.num_blocks for g in llm.groups)  # num_kv_blocks: the global group's size
    free = torch.cuda.mem_get_info(device)[0]
    target = min(whole, int(now * (1 + fraction * free / kv_bytes(llm))))
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    last: Exception | None = None
    for pages in (target, None):
        try:
            return make_llm(path, device, max_num_seqs, max_model_len, pages, kv_cache_dtype)
        except (ValueError, torch.OutOfMemoryError) as err:
            print(f"{pages} KV pages failed ({type(err).__name__}: {err})", flush=True)
            last = err
            gc.collect()
            torch.cuda.empty_cache()
    # The default size loaded before the first engine shut down; the H100 (28th session)
    # refused it the second time at batch 16 / 1M and 64 / 131k: say why, not "unreachable"
    raise RuntimeError(f"no KV pool loaded for batch {max_num_seqs} at max_model_len "
                       f"{max_model_len}, the default included (it loaded once before "
                       "the first engine's memory was returned)") from last


def run_model(model, path, args, rates, device, rows, prefill, errors, save) -> None:
    """Every (context, batch) decode cell and the prefill of one model, on one engine."""
    max_len = max(args.contexts + [args.prefill]) + 3 * args.steps + 96
    llm = guarded(model, lambda: make_llm_with_kv(path, device, max(args.batches), max_len,
                                                  kv_cache_dtype=args.kv_cache_dtype), errors)
    if llm is None:
        return
    for context in args.contexts:
        for batch in args.batches:
            row = guarded(f"{model} b{batch} c{context}", lambda b=batch, c=context:
                          decode_cell(llm, model, b, c, args, rates, device), errors)
            if row:
                rows.append(row)
                print(format_table([{k: v for k, v in row.items()
                                     if not isinstance(v, dict | list)}]), flush=True)
            save()  # after every cell, so a time limit keeps what was measured
    if args.prefill:
        row = guarded(f"{model} prefill", lambda: prefill_cell(
            llm, model, args.prefill, rates, device), errors)
        if row:
            prefill.append(row)
            print(format_table([row]), flush=True)
    llm.shutdown()


def main(argv=None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["scout4", "maverick4"],
                        choices=sorted(MODELS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    parser.add_argument("--prefill", type=int, default=32768, help="prompt tokens (0: none)")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per mode")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--alternate", type=int, default=0)
    parser.add_argument("--alternate-batch", type=int, default=64)
    parser.add_argument("--alternate-context", type=int, default=1024)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                        help="the KV pages' dtype (the floor counts their bytes)")
    parser.add_argument("--alternate-reload", action="store_true",
                        help="load one engine per repeat even when the device holds two")
    parser.add_argument("--routing", choices=("balanced", "model"), default="balanced",
                        help="balanced: floors.BalancedRouting (spread, as trained routers)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.batches, args.contexts, args.prefill = ["smoke"], [1, 3], [40, 70], 90
        args.steps, args.profile_batches = 2, [3]
        args.alternate, args.alternate_batch, args.alternate_context = 2, 3, 40
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rates = measure_rates(device)
    rows, prefill, alternation, errors = [], [], [], []
    name = "decode_floor_smoke" if args.smoke else "decode_floor"

    def save():
        return write_json(name, {"args": vars(args), "rates": rates, "decode": rows,
                                 "prefill": prefill, "alternate": alternation,
                                 "errors": errors}, args.out)

    with tempfile.TemporaryDirectory() as tmp, floors.routing(args.routing):
        for model in args.models:
            run_model(model, write_config(Path(tmp) / model, model), args, rates, device,
                      rows, prefill, errors, save)
            gc.collect()  # the engine is gone with run_model's frame: free its memory
            if device.type == "cuda":
                torch.cuda.empty_cache()
            save()
        if args.alternate:
            path = Path(tmp) / args.models[0]
            alternation.extend(guarded("alternate", lambda: alternate(
                path, device, args, rates), errors) or [])
            print(format_table([{k: v for k, v in r.items() if k != "repeats_ms"}
                                for r in alternation]), flush=True)
    print(f"wrote {save()}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
