"""Tensor-parallel decode steps at Llama-4 Scout geometry against each GPU's memory floor.

Model: Scout's text geometry (hidden 5120, 40/8 heads of 128, 48 layers, every layer
MoE with 16 experts of inner size 8192, top-1, a shared expert, every 4th layer a
global NoPE layer, c = 8192, vocab 202048), bf16, ``load_format="dummy"``: random
weights made on each rank, nothing read from disk.  One engine per MoE scheme
("tp": every expert split by its inner size; "ep": 16 / N whole experts per rank).

Each cell (batch B, context L) times ``llm.runner.execute`` on a hand-made decode
step: B requests of L tokens each with their own KV pages (the KV content is left
as it is: decode reads the same bytes whatever they hold), so no prefill is run.
The time is the engine's: pickling and sending the step to every rank, each rank's
metadata build and (graph-replayed) forward, and rank 0's tokens coming back.

Floor, per GPU: the bytes that GPU must read in one step (its slices of the
attention, shared-expert and LM-head weights, the routed experts it holds -- with
uniform top-1 routing of B tokens, E_local * (1 - (1 - 1/E)^B) of them --, the router
and norms, and its KV heads' pages: L tokens of the global layers, the current chunk
of the chunked ones) at the device-to-device copy rate measured in the same run.
All-reduce: per call, timed in a CUDA graph by separate NCCL processes before the
engines start (B x hidden bf16), times the 2 x layers + 1 calls of a step.  Cells
whose KV does not fit next to the weights run the largest batch that fits.

    python -m benchmarks.tp_decode --tensor-parallel-size 2 --out benchmarks/results/h200x2
    python -m benchmarks.tp_decode --smoke   # CPU, gloo, tiny model: checks the logic
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import base_parser, format_table, guarded, machine_info, write_json

SCOUT = dict(hidden_size=5120, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
             num_hidden_layers=48, intermediate_size=8192, intermediate_size_mlp=16384,
             num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1,
             vocab_size=202048, attention_chunk_size=8192, rms_norm_eps=1e-5)
SMOKE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_hidden_layers=4, intermediate_size=64, intermediate_size_mlp=128,
             num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1,
             vocab_size=512, attention_chunk_size=32, rms_norm_eps=1e-5)
BLOCK = 16


def write_config(path: Path, shape: dict, max_len: int, weights: bool) -> None:
    """config.json (bf16); ``weights``: also random safetensors (tiny models only)."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    layers = shape["num_hidden_layers"]
    config = Llama4TextConfig(**shape, no_rope_layers=[int((i + 1) % 4 != 0)
                                                       for i in range(layers)],
                              max_position_embeddings=max_len, bos_token_id=None,
                              eos_token_id=None, pad_token_id=None)
    config.dtype = "bfloat16"
    path.mkdir(parents=True, exist_ok=True)
    if weights:
        torch.manual_seed(0)
        Llama4ForCausalLM(config).save_pretrained(str(path))
    else:
        config.save_pretrained(str(path))


# -- all-reduce and copy-rate probe (its own processes, before any engine) ---------------------
def _probe_rank(rank, size, init_file, tokens, hidden, queue):
    import torch.distributed as dist

    from benchmarks.common import cuda_time_ms, measure_copy_bytes_per_s

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:  # forked: one thread (a parent's OpenMP team does not survive the fork)
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=size)
    out = {"allreduce_us": {}, "allreduce_eager_us": {}}
    dtype = torch.bfloat16 if cuda else torch.float32
    for t in tokens:
        x = torch.ones(t, hidden, dtype=dtype, device=device)
        if cuda:
            out["allreduce_eager_us"][t] = 1e3 * cuda_time_ms(lambda x=x: dist.all_reduce(x),
                                                              repeats=50)["median"]
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):  # NCCL warm-up on the capture stream
                dist.all_reduce(x)
            torch.cuda.synchronize()
            graph, calls = torch.cuda.CUDAGraph(), 20
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    dist.all_reduce(x)
            out["allreduce_us"][t] = 1e3 * cuda_time_ms(graph.replay, repeats=20)["median"] / calls
        else:
            start = time.perf_counter()
            for _ in range(20):
                dist.all_reduce(x)
            out["allreduce_us"][t] = out["allreduce_eager_us"][t] = \
                (time.perf_counter() - start) / 20 * 1e6
    if rank == 0:
        if cuda:
            out["copy_bytes_per_s"] = measure_copy_bytes_per_s(device)
            out["gpu_bytes"] = torch.cuda.get_device_properties(device).total_memory
        else:
            src = torch.ones(1 << 26, dtype=torch.uint8)
            dst = torch.empty_like(src)
            start = time.perf_counter()
            for _ in range(10):
                dst.copy_(src)
            out["copy_bytes_per_s"] = 2 * src.numel() * 10 / (time.perf_counter() - start)
            out["gpu_bytes"] = None
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def probe(size: int, tokens, hidden: int) -> dict:
    ctx = torch.multiprocessing.get_context("spawn" if torch.cuda.is_available() else "fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_probe_rank, args=(r, size, f"{tmp}/store", list(tokens),
                                                       hidden, queue)) for r in range(size)]
        for p in procs:
            p.start()
        result = queue.get(timeout=600)
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return result


# -- floor ------------------------------------------------------------------------------------
def floor_bytes(shape: dict, n: int, moe: str, batch: int, context: int) -> dict:
    """Bytes one GPU reads in a decode step of ``batch`` requests of ``context`` tokens."""
    h, d, bf16 = shape["hidden_size"], shape["head_dim"], 2
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    kv_local = max(1, kv // n)
    e, inner, layers = shape["num_local_experts"], shape["intermediate_size"], \
        shape["num_hidden_layers"]
    attn = (heads // n * d * h * 2 + 2 * kv_local * d * h) * bf16  # q, o; k, v
    shared = 3 * h * (inner // n) * bf16
    expert = 3 * h * inner * bf16  # one whole expert
    hit = 1 - (1 - 1 / e) ** (batch * shape["num_experts_per_tok"])  # share of experts used
    routed = (e // n * expert if moe == "ep" else e * expert / n) * hit
    router_norms = (e * h + 2 * h) * bf16
    weights = layers * (attn + shared + routed + router_norms) + shape["vocab_size"] // n * h * \
        bf16 + batch * h * bf16
    c = shape["attention_chunk_size"]
    global_layers = sum(1 for i in range(layers) if (i + 1) % 4 == 0)
    local_tokens = (context - 1) % c + 1
    kv_bytes = batch * 2 * kv_local * d * bf16 * (global_layers * context
                                                  + (layers - global_layers) * local_tokens)
    return {"weights": weights, "kv": kv_bytes, "total": weights + kv_bytes}


# -- hand-made decode steps -------------------------------------------------------------------
def decode_step(llm, batch: int, context: int):
    """A DeviceStep of ``batch`` requests at position ``context - 1``, own pages each."""
    from chunklocal.engine.model_runner import StepInputs
    from chunklocal.engine.tp_runner import DeviceStep, greedy_views
    from chunklocal.kv_spec import needs_global_pages

    pages = -(-context // BLOCK)
    positions = np.full(batch, context - 1, dtype=np.int64)
    inputs = StepInputs(np.arange(batch, dtype=np.int64) % 1000, positions,
                        np.arange(batch + 1, dtype=np.int32),
                        np.full(batch, context, dtype=np.int32), np.arange(batch),
                        np.arange(batch), np.zeros(batch, dtype=np.int64))
    tables, slots = [], []
    for grp in llm.groups:
        table = np.zeros((batch, pages), dtype=np.int32)
        first = 0
        if not needs_global_pages(grp.spec):  # chunked group: the current chunk's pages only
            first = (context - 1) // grp.spec.attention_chunk_size * \
                grp.spec.attention_chunk_size // BLOCK
        own = pages - first
        if batch * own > grp.num_blocks:
            raise ValueError(f"{grp.num_blocks} pages cannot hold {batch} x {own}")
        table[:, first:] = np.arange(batch * own, dtype=np.int32).reshape(batch, own)
        tables.append(table)
        slots.append(table[:, -1].astype(np.int64) * BLOCK + (context - 1) % BLOCK)
    return DeviceStep(inputs, tables, slots, greedy_views(batch), None)


def engine_kv_bytes(shape, n, batch, context, max_batched) -> tuple[int, int]:
    """(num_kv_blocks, KV bytes per GPU) of an engine for ``batch`` requests of ``context``
    tokens, as LLM sizes its pools: the global pool num_kv_blocks pages, the chunked one
    min(num_kv_blocks, batch x the pages a chunk plus a step's tokens span), one scratch
    page each, every layer of a group."""
    pages = -(-(context + 16) // BLOCK)
    c = shape["attention_chunk_size"]
    local_need = min(-(-(c - 1 + max_batched) // BLOCK), pages)
    page = BLOCK * max(1, shape["num_key_value_heads"] // n) * shape["head_dim"] * 2 * 2
    layers = shape["num_hidden_layers"]
    global_layers = sum(1 for i in range(layers) if (i + 1) % 4 == 0)
    blocks = batch * pages
    chunked = min(blocks, batch * local_need)
    return blocks, page * ((blocks + 1) * global_layers + (chunked + 1) * (layers - global_layers))


def plan_cells(args, shape, probe_out):
    """Per context: the (asked, run) batches and the engine's num_kv_blocks and batch limit.
    A batch whose KV does not fit beside the weights and ~8 GiB of activations and graphs
    (90% of the GPU) shrinks to the largest that does."""
    n = args.tensor_parallel_size
    weights = floor_bytes(shape, n, "tp", 4096, 1)["weights"]  # every local expert held
    room = math.inf
    if probe_out["gpu_bytes"]:
        room = 0.9 * probe_out["gpu_bytes"] - weights - (8 << 30)
    plans = []
    for context in args.contexts:
        cells = []
        for batch in args.batches:
            b = batch
            while b > 1 and engine_kv_bytes(shape, n, b, context, max(512, b))[1] > room:
                b -= 1 if b <= 16 else 8
            cells.append((batch, b))
        limit = max(b for _, b in cells)
        blocks = engine_kv_bytes(shape, n, limit, context, max(512, limit))[0]
        plans.append((context, cells, limit, blocks))
    return plans


def allreduce_us(probe_out, batch: int) -> float:
    """Per-call time of the smallest probed size holding ``batch`` tokens."""
    sizes = sorted(probe_out["allreduce_us"].items())
    return next((us for t, us in sizes if t >= batch), sizes[-1][1])


def run_cells(args, shape, model_dir, probe_out, rows, save):
    import chunklocal
    from chunklocal.engine.tp_runner import run_device_step

    n = args.tensor_parallel_size
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for moe in args.moe:
        for context, cells, limit, blocks in plan_cells(args, shape, probe_out):
            kw = dict(device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                      max_num_seqs=limit, max_num_batched_tokens=max(512, limit),
                      max_model_len=context + 16, block_size=BLOCK, num_kv_blocks=blocks,
                      tensor_parallel_size=n, moe_parallel=moe, cuda_graphs=not args.eager,
                      load_format=args.load_format)
            start = time.perf_counter()
            llm = chunklocal.LLM(model_dir, **kw)
            load_s = time.perf_counter() - start
            for asked, batch in cells:
                step = decode_step(llm, batch, context)
                for _ in range(3):
                    run_device_step(llm.runner, step)
                graphs_before = llm.runner.graph_steps
                times = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    run_device_step(llm.runner, step)
                    times.append((time.perf_counter() - t0) * 1e3)
                floor = floor_bytes(shape, n, moe, batch, context)
                floor_ms = floor["total"] / probe_out["copy_bytes_per_s"] * 1e3
                calls = 2 * shape["num_hidden_layers"] + 1
                step_ms = statistics.median(times)
                rows.append(dict(
                    moe=moe, batch=batch, batch_asked=asked, context=context,
                    step_ms=round(step_ms, 3),
                    p90_ms=round(sorted(times)[int(0.9 * (len(times) - 1))], 3),
                    floor_ms=round(floor_ms, 3), floor_share=round(floor_ms / step_ms, 3),
                    weights_gb=round(floor["weights"] / 1e9, 2),
                    kv_gb=round(floor["kv"] / 1e9, 2),
                    allreduce_ms=round(calls * allreduce_us(probe_out, batch) / 1e3, 3),
                    allreduce_calls=calls,
                    graph_replayed=llm.runner.graph_steps > graphs_before,
                    load_s=round(load_s, 1)))
                print(format_table(rows[-1:]), flush=True)
                save()
            llm.shutdown()
            del llm


def main(argv=None) -> int:
    parser = base_parser(__doc__.split("\n")[0])
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--moe", type=lambda s: s.split(","), default=["tp", "ep"])
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")],
                        default=[64, 256])
    parser.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1024, 32768])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--load-format", default="dummy")
    args = parser.parse_args(argv)
    shape = dict(SCOUT, num_hidden_layers=args.layers)
    if args.smoke:
        shape, args.batches, args.contexts, args.steps = SMOKE, [2, 4], [20, 70], 3
        args.load_format = "auto"
    rows, errors = [], []
    name = "tp_decode_smoke" if args.smoke else f"tp_decode_tp{args.tensor_parallel_size}"
    payload = {"machine": machine_info(), "shape": shape, "args": vars(args) | {"out": None},
               "rows": rows, "errors": errors}

    def save():
        write_json(name, payload, args.out)

    tokens = sorted(set(args.batches) | {1, 16, 64, 256, 4096})
    payload["probe"] = probe_out = guarded(
        "probe", lambda: probe(args.tensor_parallel_size, tokens, shape["hidden_size"]), errors)
    save()
    if probe_out is None:
        return 1
    print(json.dumps(probe_out, default=str), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "scout"
        write_config(model_dir, shape, max(args.contexts) + 64, weights=args.smoke)
        guarded("cells", lambda: run_cells(args, shape, model_dir, probe_out, rows, save),
                errors)
    save()
    print(format_table(rows))
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
