"""What a step must cost at the least, and where a measured step's device time went.

* :func:`decode_bytes`: the bytes one decode step must read: every dense weight (attention,
  shared experts, dense MLPs, norms, the LM head), the routed experts the step's tokens
  actually chose (counted in an eager step, see :class:`RoutingCounter`), and the KV each
  request's query reads (its chunk in chunked layers, its whole context in global ones).
  Divided by the copy rate measured in the same run it is the step's floor.
* :func:`prefill_flops`: the useful FLOPs of a prefill: 2 per weight per token for the dense
  weights and the ``top_k`` experts each token uses, plus causal attention (4 * heads *
  head_dim per (query, visible key) pair, within the chunk on chunked layers).
* :func:`kernel_profile`: ``torch.profiler`` over a few steps: device time per kernel and the
  device's idle time per step (the profiled span less the union of kernel intervals), and
  per kernel class (:func:`kernel_class`: issue 19's table) time and launches per step.
"""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np
import torch


def weight_bytes(model) -> tuple[int, list[tuple[int, int]]]:
    """(bytes of every weight outside the routed experts, [(num_experts, bytes of one
    routed expert)] per MoE layer).  A stacked shared expert (slot E) counts as dense."""
    from chunklocal.models.loader import weights
    from chunklocal.models.moe import MoE

    total = sum(t.numel() * t.element_size() for t in weights(model).values())
    moe = []
    for module in model.modules():
        if isinstance(module, MoE):
            ex = module.experts
            stack = [ex.w13, ex.w2, ex.w13_scale, ex.w2_scale]
            per = sum(t[0].numel() * t.element_size() for t in stack if t is not None)
            moe.append((module.num_local, per))
            total -= per * module.num_local
    return total, moe


def param_counts(model) -> tuple[int, int]:
    """(weights every prefill token uses: all but the embedding, the LM head and the routed
    experts; one routed expert's weights summed over the MoE layers).  FP8 scales left out."""
    from chunklocal.models.moe import MoE

    dense = sum(p.numel() for name, p in model.named_parameters()
                if "embed_tokens" not in name and "lm_head" not in name)
    expert = 0
    for module in model.modules():
        if isinstance(module, MoE):
            ex = module.experts
            expert += ex.w13[0].numel() + ex.w2[0].numel()
            dense -= (ex.w13[0].numel() + ex.w2[0].numel()) * module.num_local
    return dense, expert


class RoutingCounter:
    """Distinct experts chosen per MoE call while active (wraps ``models.routing.route``
    and turns route_triton's fused routing off, which would not call it; it syncs, so
    only for untimed eager steps)."""

    def __init__(self):
        self.distinct: list[int] = []

    def __enter__(self):
        from chunklocal.models import route_triton, routing

        self._module, self._route = routing, routing.route
        self._fused, route_triton.FUSED_ENABLED = route_triton.FUSED_ENABLED, False

        def counting(x, router, top_k):
            expert, score = self._route(x, router, top_k)
            self.distinct.append(int(expert.unique().numel()))
            return expert, score

        routing.route = counting
        return self

    def __exit__(self, *exc):
        from chunklocal.models import route_triton

        self._module.route = self._route
        route_triton.FUSED_ENABLED = self._fused


class BalancedRouting:
    """Spread routing for benchmarks on dummy weights (issue 19: a random model's tokens
    collapse onto a few experts per layer, where a trained router spreads them): while
    active, ``models.routing.ROUTING_SIMULATION`` is "balanced" -- token ``t`` of the ``i``-th
    MoE call goes to experts ``(t * top_k + j + i) mod E``, so a step of ``T`` tokens
    touches ``min(E, T * top_k)`` experts of every layer, scored with the router's own
    logits for those experts (the router GEMM still runs).  Device-side and shape-static:
    graphs captured while it is active replay it.  Enter it before the engine is built
    (graph capture).  A server's engine process takes the same strategy from
    ``CHUNKLOCAL_MOE_ROUTING_SIMULATION_STRATEGY=balanced`` (benchmarks/serve.py
    ``--routing``)."""

    def __enter__(self):
        from chunklocal.models import routing

        self._module, self._saved = routing, routing.ROUTING_SIMULATION
        routing.ROUTING_SIMULATION = "balanced"
        return self

    def __exit__(self, *exc):
        self._module.ROUTING_SIMULATION = self._saved


def routing(mode: str):
    """The context a benchmark runs its engines in: "balanced" (:class:`BalancedRouting`)
    or "model" (the weights' own routing)."""
    import contextlib

    if mode not in ("balanced", "model"):
        raise ValueError(f"routing must be 'balanced' or 'model', got {mode!r}")
    return BalancedRouting() if mode == "balanced" else contextlib.nullcontext()


def kv_keys(context: np.ndarray, layer_kinds, chunk_size: int | None) -> int:
    """Keys all layers read for queries at positions ``context`` (one per request)."""
    from chunklocal.backends.base import Kind

    keys = 0
    for kind in layer_kinds:
        if kind is Kind.CHUNKED and chunk_size:
            keys += int((context % chunk_size + 1).sum())
        else:
            keys += int((context + 1).sum())
    return keys


def decode_bytes(model, config, layer_kinds, positions: np.ndarray, distinct_experts,
                 kv_bytes_per_key: int) -> dict:
    """Bytes of one decode step whose queries sit at ``positions``; ``distinct_experts``:
    experts chosen per MoE layer in this step (None: every expert)."""
    dense, moe = weight_bytes(model)
    if distinct_experts is None:
        distinct_experts = [n for n, _ in moe]
    routed = sum(d * per for d, (_, per) in zip(distinct_experts, moe, strict=True))
    kv = kv_keys(positions, layer_kinds, config.attention_chunk_size) * kv_bytes_per_key
    return {"dense_bytes": dense, "routed_bytes": routed, "kv_bytes": kv,
            "bytes": dense + routed + kv}


def prefill_flops(config, layer_kinds, prompt_len: int, dense_params: int,
                  expert_params: int) -> float:
    """Useful FLOPs of one ``prompt_len`` prefill (``dense_params``: weights every token
    uses, LM head excluded -- only the last position needs logits; ``expert_params``: one
    routed expert's weights, summed over MoE layers)."""
    from chunklocal.backends.base import Kind

    pos = np.arange(prompt_len, dtype=np.int64)
    per_pair = 4 * config.num_attention_heads * config.head_dim
    pairs = sum(int(((pos % config.attention_chunk_size) if kind is Kind.CHUNKED
                     and config.attention_chunk_size else pos).sum() + prompt_len)
                for kind in layer_kinds)
    linear = 2.0 * prompt_len * (dense_params + config.num_experts_per_tok * expert_params)
    return linear + per_pair * pairs + 2.0 * config.vocab_size * config.hidden_size


#: (class, pattern) in order, first match wins, over full CUDA kernel names as the profiler
#: gives them (names seen on the H200 with torch 2.11: cuBLASLt's ``nvjet_sm90_*``, with
#: ``qq`` for FP8 operands; CUTLASS's grouped GEMM under ``torch._scaled_grouped_mm``).
KERNEL_CLASSES = (
    # moe_triton's FP8 kernel runs the routed experts and (as one group) the dense layers;
    # gemv_triton's GEMV the steps of one row a group (its 16-bit form, off by default, is
    # counted here too: one kernel name for both)
    ("FP8 GEMMs, Triton (experts and dense)", r"_fp8_splitk_kernel|_gemv_kernel|_gemv_mma_kernel"),
    # route_triton's pair bookkeeping (sort by expert, group ends) in one launch, from the
    # router's logits with the fused routing (or its GEMM too), and its sum of each token's
    # expert outputs
    ("MoE routing, Triton", r"_sort_pairs|_route_pairs|_router_pairs_kernel|_combine_kernel"),
    # before the GEMM classes: an FP8 KV cache's attention kernel carries ``__nv_fp8_e4m3`` in
    # its name, which the FP8 GEMMs' pattern took (the twentieth session's H200 profile of
    # Scout FP8 put 48 launches a batch-1 step, 0.64 ms, in "dense GEMMs, FP8", which that
    # step has none of, and none in attention); split-KV's merge is attention's too
    ("attention", r"flashinfer::Batch|MergeStates|Attention|flash_fwd|fmha"),
    ("expert GEMMs", r"GroupProblemShap|_grouped_gemm_kernel|grouped_mm|moe"),
    ("dense GEMMs, FP8", r"nvjet\w*qq|_scaled_mm|f8f8|e4m3"),
    ("dense GEMMs, bf16", r"nvjet|gemm|Gemm|cutlass|sm90_xmma|cublas"),
    ("sampling", r"Sampling|TopK|TopP|argmax|ArgMax|softmax|Softmax|multinomial"),
    ("KV writes", r"index_copy|index_put|scatter|AppendPaged|append_paged|_write_kv_kernel"),
    ("quantization (amax)", r"reduce_kernel.*(Max|max)|amax|quant"),
    ("norms, reductions", r"reduce_kernel|rms|norm|Norm|_splitk_sum_kernel"),
    ("copies", r"direct_copy|copy_kernel|Memcpy|memcpy|cat_|CatArray"),
    ("gathers", r"index_elementwise|gather|index_select|indexSelect"),
    ("elementwise", r"elementwise|Elementwise|Memset|fill"),
)
_CLASS_RES = [(name, re.compile(pattern)) for name, pattern in KERNEL_CLASSES]


def kernel_class(name: str) -> str:
    """Issue 19's kernel class of a CUDA kernel name (``other`` when none matches)."""
    return next((cls for cls, pattern in _CLASS_RES if pattern.search(name)), "other")


#: Kernels (and launching ops) a profile keeps, by device time (launches for ops): enough
#: to see the small launches of a decode step (about 60 per layer), not only its GEMMs.
KERNELS_KEPT = 60


def kernel_profile(step, num_steps: int, device) -> dict:
    """Run ``step()`` ``num_steps`` times under torch.profiler: device ms per kernel (the
    top ``KERNELS_KEPT``), per issue-19 class with launches, per launching torch op (eager
    steps only: a graph replay's kernels have no launching op; it names the ops whose
    small kernels are worth fusing), and device idle ms per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(num_steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    per_kernel, launches = defaultdict(float), defaultdict(int)
    named: list[tuple[float, float, str]] = []  # (start us, end us, kernel) of each launch
    by_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            named.append((event.time_range.start, event.time_range.end, event.name))
            per_kernel[event.name] += (event.time_range.end - event.time_range.start) / 1e3
            launches[event.name] += 1
        for kernel in getattr(event, "kernels", None) or ():
            row = by_op[event.name]
            row[0] += kernel.duration / 1e3 / num_steps
            row[1] += 1 / num_steps
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:KERNELS_KEPT]
    result = {"kernels_ms_per_step": {name[:120]: ms / num_steps for name, ms in top},
              "kernel_launches_per_step": {name[:120]: launches[name] / num_steps
                                           for name, _ in top}}
    if by_op:
        ops = sorted(by_op.items(), key=lambda kv: -kv[1][1])[:KERNELS_KEPT]
        result["launches_by_op_per_step"] = {op: {"ms": ms, "launches": n}
                                             for op, (ms, n) in ops}
    classes: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, ms in per_kernel.items():
        row = classes[kernel_class(name)]
        row[0] += ms / num_steps
        row[1] += launches[name] / num_steps
    result["classes_per_step"] = {cls: {"ms": ms, "launches": n} for cls, (ms, n) in
                                  sorted(classes.items(), key=lambda kv: -kv[1][0])}
    if named:
        busy, span = busy_and_span([(start, end) for start, end, _ in named])
        result.update(device_busy_ms_per_step=busy / 1e3 / num_steps,
                      device_idle_ms_per_step=(span - busy) / 1e3 / num_steps)
        result.update(idle_gaps(named, num_steps))
    return result


#: upper ends (us) of the idle gaps' size classes: launch gaps between queued kernels are a
#: few microseconds; a host that falls behind (a sync, a long host step) leaves longer ones
GAP_CLASSES_US = (5.0, 20.0, 100.0, float("inf"))


def idle_gaps(named, num_steps: int, largest: int = 8) -> dict:
    """The device's idle time split by gap length: per step, how many gaps of each
    :data:`GAP_CLASSES_US` class and their ms; and the ``largest`` gaps with the kernels
    either side (``named``: (start us, end us, kernel name))."""
    named = sorted(named)
    gaps, end, before = [], named[0][1], named[0][2]
    for start, stop, name in named[1:]:
        if start > end:
            gaps.append((start - end, before, name))
        if stop >= end:
            end, before = stop, name
    classes, low = {}, 0.0
    for high in GAP_CLASSES_US:
        inside = [g for g, _, _ in gaps if low <= g < high]
        label = f"{low:g}-{high:g}us" if high != float("inf") else f">={low:g}us"
        classes[label] = {"gaps": len(inside) / num_steps, "ms": sum(inside) / 1e3 / num_steps}
        low = high
    top = sorted(gaps, key=lambda g: -g[0])[:largest]
    return {"idle_gaps_per_step": classes,
            "largest_idle_gaps": [{"us": round(g, 1), "after": a[:80], "before": b[:80]}
                                  for g, a, b in top]}


def busy_and_span(spans) -> tuple[float, float]:
    """(length of the union of the [start, end) intervals, last end - first start)."""
    spans = sorted(spans)
    busy, (start, end) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy, start = busy + end - start, s
        end = max(end, e)
    busy += end - start
    return busy, max(e for _, e in spans) - spans[0][0]
