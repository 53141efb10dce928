"""The KV pools section of `chunklocal plan`: what the engine's planner
(:func:`chunklocal.bounds.kv_pools.plan_kv_pools`, the call ``LLM`` makes) allocates for a
layer pattern, given ``--num-kv-blocks`` or a KV memory budget (``--kv-memory-gib``).

The default pattern is Llama-4 Scout's: 48 layers, every 4th global (NoPE), the others
chunked, 8 KV heads of 128, bf16 (2 bytes).
"""

from __future__ import annotations

import argparse

from chunklocal._validate import positive_int
from chunklocal.bounds.kv_pools import GIB, PageShape, plan_kv_pools
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
             kv_dtype_bytes: int = 2) -> dict:
    """The pools, JSON-ready.  A budget is all for KV (no weights, fraction 1); with
    ``num_kv_blocks`` alone no memory limit is checked."""
    if (num_kv_blocks is None) == (kv_memory_gib is None):
        raise ValueError("pass exactly one of num_kv_blocks and kv_memory_gib")
    if kv_memory_gib is not None and not kv_memory_gib > 0:
        raise ValueError(f"kv_memory_gib must be positive, got {kv_memory_gib}")
    page = 2 * block_size * num_kv_heads * head_dim * kv_dtype_bytes
    layers_of = layer_counts(num_layers, global_every)
    specs = {kind: PageShape(page, chunk_size if kind is Kind.CHUNKED else None)
             for kind in layers_of}
    available = int(kv_memory_gib * GIB) if kv_memory_gib is not None else 1 << 80
    result = plan_kv_pools(layers_of, specs, hybrid=hybrid, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens,
                           max_model_len=max_model_len, block_size=block_size,
                           available=available, num_kv_blocks=num_kv_blocks,
                           fraction=1.0)
    return dict(
        layers={kind.value: n for kind, n in layers_of.items()}, hybrid=hybrid,
        page_bytes_per_layer=page, num_kv_blocks=result.num_kv_blocks,
        total_bytes=result.total_bytes, requests_fit=result.requests_fit(),
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
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "KV pools", "print the pools the engine allocates (Llama-4 Scout's layers by default)")
    size = group.add_mutually_exclusive_group()
    size.add_argument("--num-kv-blocks", type=positive_int, default=None,
                      help="pages of the global (or merged) pool, as LLM(num_kv_blocks=...)")
    size.add_argument("--kv-memory-gib", type=float, default=None,
                      help="GiB for the KV cache (every pool, scratch pages included)")
    group.add_argument("--hybrid-kv-cache", action=argparse.BooleanOptionalAction,
                       default=True, help="separate global and chunked groups (default on)")
    group.add_argument("--global-every", type=int, default=SCOUT["global_every"],
                       help="every k-th layer is global, 0: none (default 4)")
    for flag, key in (("--num-layers", "num_layers"), ("--num-kv-heads", "num_kv_heads"),
                      ("--head-dim", "head_dim"), ("--kv-dtype-bytes", "kv_dtype_bytes")):
        group.add_argument(flag, type=positive_int, default=SCOUT[key],
                           help=f"default {SCOUT[key]} (Scout)")


def from_args(args) -> dict | None:
    """The pools section for parsed arguments, or None when no size was asked for."""
    if args.num_kv_blocks is None and args.kv_memory_gib is None:
        return None
    if args.global_every < 0:
        raise ValueError(f"global_every must be >= 0, got {args.global_every}")
    return kv_pools(max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    max_model_len=args.max_model_len, chunk_size=args.chunk_size,
                    block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                    kv_memory_gib=args.kv_memory_gib, hybrid=args.hybrid_kv_cache,
                    num_layers=args.num_layers, global_every=args.global_every,
                    num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                    kv_dtype_bytes=args.kv_dtype_bytes)
