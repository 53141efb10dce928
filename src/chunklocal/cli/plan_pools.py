"""The KV pools section of `chunklocal plan`: what the engine's planner
(:func:`chunklocal.bounds.kv_pools.plan_kv_pools`, the call ``LLM`` makes) allocates for a
layer pattern, given ``--num-kv-blocks``, a KV memory budget (``--kv-memory-gib``), or
``--gpu-memory-utilization`` of a device of ``--device-memory-gib`` (less ``--weights-gib``
and ``--activations-gib``, which the engine measures: engine/memory.py), and what one
request of max_model_len needs.  The settings are checked as ``LLM`` checks them: one
:class:`~chunklocal.engine.config.EngineConfig`.

The default pattern is Llama-4 Scout's: 48 layers, every 4th global (NoPE), the others
chunked, 8 KV heads of 128, bf16 (2 bytes).
"""

from __future__ import annotations

import argparse
from typing import Any

from chunklocal._validate import positive_int
from chunklocal.bounds.kv_pools import GIB, PageShape, plan_kv_pools
from chunklocal.engine.config import EngineConfig
from chunklocal.engine.memory import PROFILE_HEADROOM, MemoryBudget
from chunklocal.kv_spec import Kind

SCOUT = dict(num_layers=48, global_every=4, num_kv_heads=8, head_dim=128, kv_dtype_bytes=2)


def layer_counts(num_layers: int, global_every: int) -> dict[Kind, int]:
    """Layers of each kind: layer i is global when (i + 1) % global_every == 0 (0: none)."""
    n_global = num_layers // global_every if global_every else 0
    counts = {Kind.CHUNKED: num_layers - n_global, Kind.GLOBAL: n_global}
    return {kind: n for kind, n in counts.items() if n}


def kv_pools(*, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
             chunk_size: int, block_size: int, num_kv_blocks: int | None = None,
             kv_memory_gib: float | None = None, hybrid: bool = True, num_layers: int = 48,
             global_every: int = 4, num_kv_heads: int = 8, head_dim: int = 128,
             kv_dtype_bytes: int = 2, device_memory_gib: float | None = None,
             gpu_memory_utilization: float = 0.9, weights_gib: float = 0.0,
             activations_gib: float = 0.0, layers_of: dict[Kind, int] | None = None) -> dict:
    """The pools, JSON-ready.  ``kv_memory_gib`` is all for KV (no weights, fraction 1);
    ``device_memory_gib``: the engine's budget, ``gpu_memory_utilization`` of it less the
    weights and activations; with ``num_kv_blocks`` alone no memory limit is checked.
    ``layers_of``: layers of each kind (a checkpoint's), instead of the pattern."""
    if sum(x is not None for x in (num_kv_blocks, kv_memory_gib, device_memory_gib)) != 1:
        raise ValueError("pass exactly one of num_kv_blocks, kv_memory_gib and "
                         "device_memory_gib")
    for name, value in (("kv_memory_gib", kv_memory_gib),
                        ("device_memory_gib", device_memory_gib)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")
    for name, value in (("weights_gib", weights_gib), ("activations_gib", activations_gib)):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    page = 2 * block_size * num_kv_heads * head_dim * kv_dtype_bytes
    layers_of = layers_of or layer_counts(num_layers, global_every)
    specs = {kind: PageShape(page, chunk_size if kind is Kind.CHUNKED else None)
             for kind in layers_of}
    limits: dict[str, Any] = dict(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                  max_model_len=max_model_len, block_size=block_size)
    budget = None
    if device_memory_gib is not None:
        total = int(device_memory_gib * GIB)  # the engine keeps its headroom free too
        budget = MemoryBudget(gpu_memory_utilization, total, int(weights_gib * GIB),
                              int(activations_gib * GIB), headroom=int(PROFILE_HEADROOM * total))
        result = plan_kv_pools(layers_of, specs, hybrid=hybrid, available=budget.requested,
                               weight_bytes=budget.weights, reserved_bytes=budget.reserved,
                               fraction=1.0, budget_note=budget.note(), **limits)
    else:
        available = int(kv_memory_gib * GIB) if kv_memory_gib is not None else 1 << 80
        result = plan_kv_pools(layers_of, specs, hybrid=hybrid, available=available,
                               num_kv_blocks=num_kv_blocks, fraction=1.0, **limits)
    # One request of max_model_len: each pool's need (the planner's own), plus scratch.
    one = plan_kv_pools(layers_of, specs, hybrid=hybrid, available=1 << 80,
                        num_kv_blocks=max(g.need for g in result.groups), fraction=1.0,
                        **dict(limits, max_num_seqs=1))
    return dict(
        layers={kind.value: n for kind, n in layers_of.items()}, hybrid=hybrid,
        page_bytes_per_layer=page, num_kv_blocks=result.num_kv_blocks,
        total_bytes=result.total_bytes, requests_fit=result.requests_fit(),
        budget=None if budget is None else dict(
            gpu_memory_utilization=budget.utilization, device_bytes=budget.total,
            requested_bytes=budget.requested, weight_bytes=budget.weights,
            activation_bytes=budget.activations, headroom_bytes=budget.headroom),
        one_request=dict(pages={g.name: g.need for g in one.groups},
                         bytes=sum(g.need * g.page_bytes for g in one.groups)),
        groups=[dict(name=g.name, pages=g.pages, need=g.need, layers=g.layers,
                     bytes=g.bytes, requests_fit=g.requests_fit()) for g in result.groups])


def format_pools(pools: dict, max_model_len: int) -> str:
    layers = ", ".join(f"{n} {kind}" for kind, n in pools["layers"].items())
    lines = [f"KV pools ({'hybrid' if pools['hybrid'] else 'merged'}; layers: {layers}; "
             f"{pools['page_bytes_per_layer']} bytes per page per layer): "
             f"num_kv_blocks={pools['num_kv_blocks']}, "
             f"{pools['total_bytes'] / GIB:.2f} GiB incl. one scratch page per group",
             f"{'group':<10}{'layers':>7}{'pages':>10}{'per request':>13}{'GiB':>9}"
             f"  requests of max_model_len {max_model_len}"]
    for g in pools["groups"]:
        lines.append(f"{g['name']:<10}{g['layers']:>7}{g['pages']:>10}{g['need']:>13}"
                     f"{g['bytes'] / GIB:>9.2f}  {g['requests_fit']}")
    lines.append(f"requests of max_model_len {max_model_len} that fit at once: "
                 f"{pools['requests_fit']}")
    one = pools["one_request"]
    lines.append(f"one request of max_model_len {max_model_len} needs "
                 f"{one['bytes'] / GIB:.2f} GiB of KV: " +
                 ", ".join(f"{name} {n} pages" for name, n in one["pages"].items()))
    if pools["budget"] is not None:
        b = pools["budget"]
        lines.insert(1, f"budget: gpu_memory_utilization {b['gpu_memory_utilization']} of "
                     f"{b['device_bytes'] / GIB:.1f} GiB = {b['requested_bytes'] / GIB:.2f} "
                     f"GiB, less {b['weight_bytes'] / GIB:.2f} GiB of weights and "
                     f"{b['activation_bytes'] / GIB:.2f} GiB of activations")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "KV pools", "print the pools the engine allocates (Llama-4 Scout's layers by default)")
    size = group.add_mutually_exclusive_group()
    size.add_argument("--num-kv-blocks", type=positive_int, default=None,
                      help="pages of the global (or merged) pool, as LLM(num_kv_blocks=...)")
    size.add_argument("--kv-memory-gib", type=float, default=None,
                      help="GiB for the KV cache (every pool, scratch pages included)")
    size.add_argument("--device-memory-gib", type=float, default=None,
                      help="the device's total GiB: the engine's budget, "
                      "--gpu-memory-utilization of it less weights and activations")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="fraction (0, 1] of --device-memory-gib (default 0.9, vLLM's)")
    group.add_argument("--weights-gib", type=float, default=None,
                       help="GiB of weights per rank (with --device-memory-gib; default: "
                       "--model's, else 0)")
    group.add_argument("--model", default=None, metavar="DIR",
                       help="a checkpoint directory: its config.json gives the layers, KV "
                       "heads, head_dim, chunk size and dtype, and its weights' size "
                       "(in --dtype) the default --weights-gib")
    group.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16",
                                                               "float32"],
                       help="with --model: the weights' (and KV's) dtype (default bfloat16, "
                       "as the engine on a GPU)")
    group.add_argument("--activations-gib", type=float, default=0.0,
                       help="GiB of peak activations and CUDA graphs, as the engine profiles "
                       "them (with --device-memory-gib; default 0)")
    group.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                       help="fp8: 1-byte pages (overrides --kv-dtype-bytes; default auto)")
    group.add_argument("--hybrid-kv-cache", action=argparse.BooleanOptionalAction,
                       default=True, help="separate global and chunked groups (default on)")
    group.add_argument("--global-every", type=int, default=SCOUT["global_every"],
                       help="every k-th layer is global, 0: none (default 4)")
    for flag, key in (("--num-layers", "num_layers"), ("--num-kv-heads", "num_kv_heads"),
                      ("--head-dim", "head_dim"), ("--kv-dtype-bytes", "kv_dtype_bytes")):
        group.add_argument(flag, type=positive_int, default=SCOUT[key],
                           help=f"default {SCOUT[key]} (Scout)")


def apply_checkpoint(args) -> None:
    """With ``--model``: the checkpoint's shape in place of the pattern flags (and its
    chunk in place of --chunk-size), read as ``LLM`` reads it (no tensor data: the weights'
    size from the config's shapes, FP8 where the checkpoint's quantization says)."""
    if args.model is None:
        args.layers_of = None
        return
    import torch

    from chunklocal.engine.llm_args import check_model
    from chunklocal.models.llama4_config import layer_kind, read_config
    from chunklocal.models.loader import plan_load

    ckpt = read_config(check_model(args.model))
    c = ckpt.text
    kinds = [layer_kind(c, i) for i in range(c.num_hidden_layers)]
    args.layers_of = {kind: kinds.count(kind) for kind in Kind if kind in kinds}
    args.chunk_size = c.attention_chunk_size or args.max_model_len
    args.num_kv_heads, args.head_dim = c.num_key_value_heads, c.head_dim
    dtype = getattr(torch, args.dtype)
    args.kv_dtype_bytes = torch.empty((), dtype=dtype).element_size()
    if args.weights_gib is None:
        args.weights_gib = plan_load(args.model, ckpt, "dummy").weight_bytes(dtype) / GIB


def engine_config(args) -> EngineConfig:
    """The settings as ``LLM`` would take them, checked the same way (ValueError)."""
    return EngineConfig(max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, block_size=args.block_size,
                        num_kv_blocks=args.num_kv_blocks, cuda_graphs=args.cuda_graphs,
                        hybrid_kv_cache=args.hybrid_kv_cache,
                        num_speculative_tokens=args.num_speculative_tokens,
                        kv_cache_dtype=args.kv_cache_dtype,
                        gpu_memory_utilization=args.gpu_memory_utilization)


def from_args(args) -> dict | None:
    """The pools section for parsed arguments, or None when no size was asked for."""
    cfg = engine_config(args)
    if args.num_kv_blocks is None and args.kv_memory_gib is None \
            and args.device_memory_gib is None:
        return None
    if args.global_every < 0:
        raise ValueError(f"global_every must be >= 0, got {args.global_every}")
    fp8 = cfg.kv_cache_dtype != "auto"
    return kv_pools(max_num_seqs=cfg.max_num_seqs,
                    max_num_batched_tokens=cfg.max_num_batched_tokens,
                    max_model_len=int(args.max_model_len), chunk_size=args.chunk_size,
                    block_size=cfg.block_size, num_kv_blocks=cfg.num_kv_blocks,
                    kv_memory_gib=args.kv_memory_gib, hybrid=cfg.hybrid_kv_cache,
                    num_layers=args.num_layers, global_every=args.global_every,
                    num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                    kv_dtype_bytes=1 if fp8 else args.kv_dtype_bytes,
                    device_memory_gib=args.device_memory_gib,
                    gpu_memory_utilization=cfg.gpu_memory_utilization,
                    weights_gib=args.weights_gib or 0.0, activations_gib=args.activations_gib,
                    layers_of=args.layers_of)
