"""One Llama-4 MoE layer: grouped GEMMs vs all experts on all tokens vs the floor (GPU).

Geometries (bf16, random weights, std 1/sqrt(fan-in); a random router spreads tokens
about evenly): Scout (hidden 5120, inner 8192, 16 experts, top-1) and Maverick (the
same with 128 experts), each with Llama-4's shared expert.  At each token count:

* ``grouped``: models/moe.py, shared expert as transformers holds it (three GEMMs);
* ``stacked``: the same routed GEMMs, shared expert dense on slot E of the stacks
  (gate and up in one GEMM);
* ``fused``: the shared expert as group E of the same two grouped GEMMs;
* ``all_experts``: the bmm over every expert on every token (unchosen experts with
  score 0) that the model ran for steps of at most 64 tokens and under capture;
* ``gemms_only``: just the two grouped GEMMs on tokens already sorted (what routing,
  sorting, gathering and scattering add is the difference to ``grouped``);
* ``triton``: ``grouped`` with models/moe_triton.py's kernel for the routed GEMMs, and
  ``triton_gemms``: that kernel's two GEMMs alone, the best of ``TRITON_CONFIGS``
  (reported in ``triton_config``; the layer itself runs the kernel's defaults).

Each runs eagerly and replayed from a CUDA graph (``*_graph_ms``).  The floor of a step
is the larger of its bytes (the experts actually routed to, the shared expert, the
router and the activations) at the copy rate and its FLOPs at the bf16 matmul rate,
both measured in the same run.  Every variant is checked against ``all_experts``
(relative norm < 2e-2) before it is timed.
"""

from __future__ import annotations

import sys
import time

import torch

from benchmarks import common
from benchmarks.common import cuda_time_ms, format_table, guarded, write_json
from chunklocal.models import moe_triton
from chunklocal.models.moe import MoE, expert_mm
from chunklocal.models.routing import sort_by_expert

GEOMETRIES = {  # hidden, inner, experts, top-k
    "scout": (5120, 8192, 16, 1),
    "maverick": (5120, 8192, 128, 1),
}
SMOKE_GEOMETRIES = {"scout": (64, 32, 16, 1), "maverick": (64, 32, 128, 2)}
TOKENS = (1, 16, 64, 256, 1024, 4096)
VARIANTS = ("grouped", "stacked", "fused", "all_experts", "gemms_only", "triton",
            "triton_gemms")
LAYERS = ("grouped", "stacked", "fused", "triton")
TRITON_CONFIGS = [  # block_m, block_n, block_k, num_warps, num_stages
    (16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 256, 4, 3), (16, 32, 256, 4, 4),
    (16, 128, 64, 4, 5), (32, 64, 128, 4, 4), (64, 128, 64, 4, 3)]


def make_layers(hidden, inner, num_experts, top_k, device, dtype):
    """Three MoE modules on one set of weights (views, no copies), plus the raw stacks."""
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, fan_in):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen) / fan_in ** 0.5

    w13 = randn(num_experts + 1, 2 * inner, hidden, fan_in=hidden)  # slot E: shared expert
    w2 = randn(num_experts + 1, hidden, inner, fan_in=inner)
    router = randn(num_experts, hidden, fan_in=hidden)
    layers = {}
    for name in LAYERS:
        with torch.device("meta"):
            layer = MoE(num_experts, top_k, hidden, inner, torch.nn.SiLU(),
                        fuse_max_tokens=1 << 30 if name == "fused" else 0)
        layer.router.weight = torch.nn.Parameter(router, requires_grad=False)
        if name == "triton":
            layer.triton_max_pairs = 1 << 30
        if name in ("grouped", "triton"):
            ex, sh = layer.experts, layer.shared_expert
            ex.w13 = torch.nn.Parameter(w13[:num_experts], requires_grad=False)
            ex.w2 = torch.nn.Parameter(w2[:num_experts], requires_grad=False)
            sh.gate_proj.weight = torch.nn.Parameter(w13[-1, :inner], requires_grad=False)
            sh.up_proj.weight = torch.nn.Parameter(w13[-1, inner:], requires_grad=False)
            sh.down_proj.weight = torch.nn.Parameter(w2[-1], requires_grad=False)
        else:
            layer.experts.w13 = torch.nn.Parameter(w13, requires_grad=False)
            layer.experts.w2 = torch.nn.Parameter(w2, requires_grad=False)
            layer.shared_expert, layer.stacked = None, True
        layers[name] = layer
    return layers, w13, w2, router


def all_experts(x, router, w13, w2, top_k):
    """Every expert on every token, unchosen scores 0 (shape-static: the old path)."""
    num_experts = router.shape[0]
    logits = torch.nn.functional.linear(x, router)
    top_logit, expert = torch.topk(logits, top_k, dim=1)
    score = torch.zeros_like(logits).scatter_(1, expert, torch.sigmoid(top_logit.float())
                                              .to(x.dtype))
    rows = score.t().unsqueeze(-1) * x.unsqueeze(0)
    gate, up = torch.bmm(rows, w13[:num_experts].transpose(1, 2)).chunk(2, dim=-1)
    routed = torch.bmm(torch.nn.functional.silu(gate) * up, w2[:num_experts].transpose(1, 2))
    gate, up = torch.nn.functional.linear(x, w13[-1]).chunk(2, dim=-1)
    shared = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[-1])
    return shared + routed.sum(0)


def gemms_only(x, router, w13, w2, top_k, mm=expert_mm):
    """The two grouped GEMMs alone, on rows sorted (outside the timing) by expert."""
    expert = torch.topk(torch.nn.functional.linear(x, router), top_k, dim=1).indices
    order, offs = sort_by_expert(expert, router.shape[0])
    rows = x[order // top_k].contiguous()
    num_experts = router.shape[0]

    def run():
        gate, up = mm(rows, w13[:num_experts], offs).chunk(2, dim=-1)
        return mm(torch.nn.functional.silu(gate) * up, w2[:num_experts], offs)
    return run


def best_triton_gemms(x, router, w13, w2, top_k, args, reference):
    """The fastest of TRITON_CONFIGS for the two GEMMs (each checked first)."""
    from chunklocal.models.moe_triton import grouped_mm_small

    best = None
    for config in TRITON_CONFIGS[: 2 if args.smoke else None]:
        bm, bn, bk, warps, stages = config

        def mm(a, w, offs, c=(bm, bn, bk, warps, stages)):
            return grouped_mm_small(a, w, offs, block_m=c[0], block_n=c[1], block_k=c[2],
                                    num_warps=c[3], num_stages=c[4])
        fn = gemms_only(x, router, w13, w2, top_k, mm)
        err = rel_norm(fn(), reference)
        if not err < 2e-2:
            raise AssertionError(f"triton config {config}: relative error {err}")
        ms = args.time_ms(fn)
        if best is None or ms < best[0]:
            best = (ms, list(config))
    return best


def rel_norm(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def floor(x, router, top_k, hidden, inner, ceilings):
    """Bytes and FLOPs a step must move / do, and the floor time from the ceilings."""
    tokens, num_experts = x.shape[0], router.shape[0]
    expert = torch.topk(torch.nn.functional.linear(x, router), top_k, dim=1).indices
    touched = int(expert.unique().numel())
    elem = x.element_size()
    expert_bytes = 3 * hidden * inner * elem
    nbytes = (touched + 1) * expert_bytes + router.numel() * elem + 2 * x.numel() * elem
    flops = (2 * tokens * (top_k + 1) * 3 * hidden * inner
             + 2 * tokens * num_experts * hidden)
    row = {"experts_touched": touched, "floor_GB": nbytes / 1e9, "GFLOP": flops / 1e9}
    if ceilings:
        row["bytes_floor_ms"] = nbytes / ceilings["copy_bytes_per_s"] * 1e3
        row["flops_floor_ms"] = flops / ceilings["matmul_flops"] * 1e3
        row["floor_ms"] = max(row["bytes_floor_ms"], row["flops_floor_ms"])
    return row


def graph_of(fn, device):
    """Capture ``fn()`` (after a warm-up on a side stream); return the graph's replay."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.empty_cache()  # the graph's private pool must not sit beside eager leftovers
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def run_case(geometry, shape, tokens, layers, stacks, ceilings, args):
    hidden, inner, num_experts, top_k = shape
    w13, w2, router = stacks
    gen = torch.Generator(device=args.device).manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=args.device, dtype=args.dtype, generator=gen)
    row = {"geometry": geometry, "experts": num_experts, "top_k": top_k, "tokens": tokens}
    row.update(floor(x, router, top_k, hidden, inner, ceilings))
    triton = args.device == "cuda" and moe_triton.available(x)
    layer_names = [n for n in LAYERS if n != "triton" or triton]
    fns = {name: (lambda m=layers[name]: m(x)) for name in layer_names}
    fns["all_experts"] = lambda: all_experts(x, router, w13, w2, top_k)
    fns["gemms_only"] = gemms_only(x, router, w13, w2, top_k)
    with torch.no_grad():
        expected = fns["all_experts"]()
        for name in layer_names:
            row[f"{name}_rel_err"] = err = rel_norm(fns[name](), expected)
            if not err < 2e-2:
                raise AssertionError(f"{geometry} {tokens} tokens: {name} relative error {err}")
        if triton and "triton_gemms" in args.variants:
            row["triton_gemms_ms"], row["triton_config"] = best_triton_gemms(
                x, router, w13, w2, top_k, args, fns["gemms_only"]())
        for name in args.variants:
            if name not in fns:
                continue
            row[f"{name}_ms"] = args.time_ms(fns[name])
            if args.device == "cuda" and not args.no_graphs:
                graph = graph_of(fns[name], args.device)
                row[f"{name}_graph_ms"] = args.time_ms(graph.replay)
                del graph
                torch.cuda.empty_cache()
            if "floor_ms" in row:
                best = row.get(f"{name}_graph_ms", row[f"{name}_ms"])
                row[f"{name}_floor_share"] = row["floor_ms"] / best
        if "floor_ms" in row and "triton_gemms_ms" in row:
            row["triton_gemms_floor_share"] = row["floor_ms"] / row["triton_gemms_ms"]
    return row


def run_geometry(geometry, tokens, ceilings, args, rows, errors, save):
    shape = (SMOKE_GEOMETRIES if args.smoke else GEOMETRIES)[geometry]
    layers, *stacks = make_layers(*shape, args.device, args.dtype)
    for n in tokens:
        row = guarded(f"{geometry} {n}", lambda n=n: run_case(
            geometry, shape, n, layers, stacks, ceilings, args), errors)
        if row:
            rows.append(row)
            print(format_table([row]), flush=True)
        save()


def timer(args):
    if args.device == "cuda":
        return lambda fn: cuda_time_ms(fn, repeats=args.repeats or 20, warmup=3)["median"]

    def cpu_ms(fn):  # smoke only: checks the logic, the number means nothing
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return cpu_ms


def main(argv=None) -> int:
    parser = common.device_parser(__doc__.splitlines()[0])
    parser.add_argument("--geometry", nargs="+", choices=sorted(GEOMETRIES),
                        default=sorted(GEOMETRIES, reverse=True))
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help=f"token counts per step (default {' '.join(map(str, TOKENS))})")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--no-graphs", action="store_true", help="eager timings only")
    args = common.parse_device_args(parser, argv)
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    args.time_ms = timer(args)
    tokens = args.tokens or ((1, 5, 40) if args.smoke else TOKENS)
    if min(tokens) < 1:
        parser.error(f"--tokens must be positive, got {tokens}")
    errors, rows = [], []
    ceilings = common.measure_ceilings(args.smoke) if args.device == "cuda" else {}
    name = "moe_smoke" if args.smoke else "moe"
    if sorted(args.geometry) != sorted(GEOMETRIES):  # a split run must not overwrite another
        name += "_" + "_".join(args.geometry)

    def save():
        return write_json(name, {"ceilings": ceilings, "rows": rows, "errors": errors,
                                 "args": {k: v for k, v in vars(args).items()
                                          if k not in ("time_ms", "dtype")}}, args.out)

    for geometry in args.geometry:
        guarded(geometry, lambda g=geometry: run_geometry(g, tokens, ceilings, args, rows, errors,
                                                          save), errors)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    columns = ["geometry", "tokens", "experts_touched", "floor_ms"] + [
        f"{v}_{s}" for v in args.variants for s in ("ms", "graph_ms")]
    print(format_table(rows, columns))
    print(f"wrote {save()}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
