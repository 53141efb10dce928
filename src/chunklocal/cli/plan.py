"""`chunklocal plan`: how big each per-step metadata buffer must be.

A kernel without a chunk mask sees one problem per *virtual batch*, so every
buffer with one entry per request (FlashInfer's ``qo_indptr``,
``paged_kv_indptr``, ``paged_kv_last_page_len``) needs one entry per virtual
batch.  An engine that sizes them from ``max_num_seqs`` overflows as soon as a
request spans more chunks than that (vLLM issue 49980).  This module compares,
per buffer, that sizing, vLLM PR 50022's published bound and ours, and whether
the ``max_num_seqs`` sizing overflows on a worst-case batch (one that needs our
bound, which is attained when exact).  "Ours" is what the FlashInfer backend
allocates: :func:`chunklocal.bounds.sizing.backend_capacities`, the same call the
backend makes, with the room of its CUDA-graph layouts (``--no-cuda-graphs`` to
leave it out, ``--num-speculative-tokens`` for verify windows).  With ``--num-kv-blocks`` or
``--kv-memory-gib`` it also prints the KV pools the engine allocates (:mod:`.plan_pools`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

from chunklocal._validate import as_int, cdiv, check_chunk_geometry, positive_int
from chunklocal.backends.base import EngineLimits, Kind
from chunklocal.bounds import max_virtual_batches, published_virtual_batches_bound
from chunklocal.bounds.sizing import SpecShape, backend_capacities
from chunklocal.cli import plan_pools

# The reporter's configuration in vLLM issue 49980.
REPORTER_CONFIG = dict(max_num_seqs=1, max_num_batched_tokens=36000, max_model_len=36000,
                       chunk_size=8192, block_size=16)


@dataclass(frozen=True)
class BufferRow:
    """Entries of one buffer under each sizing."""

    buffer: str
    max_num_seqs_sized: int
    published: int
    ours: int

    @property
    def overflows(self) -> bool:
        """Whether the max_num_seqs sizing is too small for a worst-case batch."""
        return self.max_num_seqs_sized < self.ours


def virtual_batch_counts(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                         chunk_size: int) -> tuple[int, int]:
    """(published bound, our bound) on the virtual batches of one step."""
    published = published_virtual_batches_bound(max_num_seqs, max_num_batched_tokens,
                                                chunk_size)
    ours = max_virtual_batches(max_num_seqs, max_num_batched_tokens, chunk_size, max_model_len)
    return published, ours


def buffer_rows(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                chunk_size: int, block_size: int, *, cuda_graphs: bool = True,
                num_speculative_tokens: int = 0) -> list[BufferRow]:
    """One row per FlashInfer metadata buffer of a chunked-local layer group.

    The max_num_seqs sizing is what a request-count-sized engine allocates:
    indptrs N + 1, last_page_len N, indices N * cdiv(max_model_len, block_size).
    The published indices size follows PR 50022: pages <= V * cdiv(c, bs),
    never below the old size (global layers may share the group).  The last
    row is the indices buffer of a merged group (global and chunked layers in
    one KV group), which must hold whole sequences for its global layers.
    """
    for name, value in (("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_model_len", max_model_len)):
        if as_int(value, name) <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if as_int(num_speculative_tokens, "num_speculative_tokens") < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
    check_chunk_geometry(chunk_size, block_size)
    n = max_num_seqs
    published, _ = virtual_batch_counts(n, max_num_batched_tokens, max_model_len, chunk_size)
    old_pages = n * cdiv(max_model_len, block_size)
    published_pages = max(old_pages, published * cdiv(chunk_size, block_size))
    chunked, merged = (allocated(SpecShape(chunk_size, block_size, has_global), max_num_seqs,
                                 max_num_batched_tokens, max_model_len, cuda_graphs,
                                 num_speculative_tokens).capacities
                       for has_global in (False, True))
    ours = chunked[Kind.CHUNKED].buffer_lengths()
    # A merged group (hybrid KV cache off) serves global layers from the same block
    # table, so its global layers' indices hold whole sequences: never below the old size.
    merged_pages = max(c.buffer_lengths()["paged_kv_indices"] for c in merged.values())
    return [
        BufferRow("qo_indptr", n + 1, published + 1, ours["qo_indptr"]),
        BufferRow("paged_kv_indptr", n + 1, published + 1, ours["paged_kv_indptr"]),
        BufferRow("paged_kv_last_page_len", n, published, ours["paged_kv_last_page_len"]),
        BufferRow("paged_kv_indices", old_pages, published_pages, ours["paged_kv_indices"]),
        BufferRow("paged_kv_indices (merged)", old_pages, published_pages, merged_pages),
    ]


def allocated(spec, max_num_seqs, max_num_batched_tokens, max_model_len, cuda_graphs,
              num_speculative_tokens):
    """The backend's own sizing call for an engine of these limits (see module doc)."""
    limits = EngineLimits(max_num_seqs, max_num_batched_tokens, max_model_len, spec.block_size)
    verify_len = num_speculative_tokens + 1 if num_speculative_tokens else None
    return backend_capacities(spec, limits, cuda_graphs, verify_len)


def plan(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, chunk_size: int,
         block_size: int, cuda_graphs: bool = True, num_speculative_tokens: int = 0) -> dict:
    """Everything `chunklocal plan` prints, as one JSON-ready dict."""
    config = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                  max_model_len=max_model_len, chunk_size=chunk_size, block_size=block_size,
                  cuda_graphs=cuda_graphs, num_speculative_tokens=num_speculative_tokens)
    rows = buffer_rows(max_num_seqs, max_num_batched_tokens, max_model_len, chunk_size,
                       block_size, cuda_graphs=cuda_graphs,
                       num_speculative_tokens=num_speculative_tokens)
    published, ours = virtual_batch_counts(max_num_seqs, max_num_batched_tokens, max_model_len,
                                           chunk_size)
    sizes = allocated(SpecShape(chunk_size, block_size, False), max_num_seqs,
                      max_num_batched_tokens, max_model_len, cuda_graphs, num_speculative_tokens)
    return dict(config=config,
                virtual_batches=dict(max_num_seqs_sized=max_num_seqs, published=published,
                                     ours=ours),
                cuda_graphs=dict(batch_sizes=list(sizes.graph_batch_sizes),
                                 query_lens=list(sizes.graph_query_lens) if cuda_graphs else [],
                                 verify_use_first_rows=sizes.verify_rows),
                buffers=[dict(asdict(r), overflows=r.overflows) for r in rows])


def format_plan(result: dict) -> str:
    """The human-readable table of :func:`plan`."""
    cfg, vb = result["config"], result["virtual_batches"]
    lines = [
        "config: " + " ".join(f"{k}={v}" for k, v in cfg.items()),
        f"virtual batches per step: max_num_seqs sizing {vb['max_num_seqs_sized']}, "
        f"published bound {vb['published']}, ours {vb['ours']}",
        graph_line(result["cuda_graphs"]),
        "",
        f"{'buffer':<27}{'max_num_seqs':>14}{'published':>11}{'ours':>8}  max_num_seqs overflows?",
    ]
    for row in result["buffers"]:
        lines.append(f"{row['buffer']:<27}{row['max_num_seqs_sized']:>14}{row['published']:>11}"
                     f"{row['ours']:>8}  {'YES' if row['overflows'] else 'no'}")
    return "\n".join(lines)


def graph_line(graphs: dict) -> str:
    if not graphs["batch_sizes"]:
        return "CUDA graphs: off (ours: eager steps only)"
    sizes = graphs["batch_sizes"]
    shown = ", ".join(map(str, sizes)) if len(sizes) <= 8 else \
        f"{sizes[0]}, {sizes[1]}, .., {sizes[-1]} ({len(sizes)} sizes)"
    return (f"CUDA graphs: batch sizes {shown}, query lengths "
            f"{', '.join(map(str, graphs['query_lens']))} (their slot room is in ours)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg = REPORTER_CONFIG
    for flag, key, help_text in (
        ("--max-num-seqs", "max_num_seqs", "requests per step (N)"),
        ("--max-num-batched-tokens", "max_num_batched_tokens", "tokens per step (T)"),
        ("--max-model-len", "max_model_len", "longest sequence (L)"),
        ("--chunk-size", "chunk_size", "attention_chunk_size (c)"),
        ("--block-size", "block_size", "tokens per KV page (bs)"),
    ):
        parser.add_argument(flag, type=positive_int, default=cfg[key],
                            help=f"{help_text}; default {cfg[key]} (the reporter's config)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="include the room of the CUDA-graph layouts (default: on, as the "
                        "engine on a GPU)")
    parser.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                        help="draft tokens per verify window (default 0)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan_pools.add_arguments(parser)


def main(args) -> int:
    try:
        plan_pools.apply_checkpoint(args)  # --model: the checkpoint's layers and chunk
        result = plan(args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len,
                      args.chunk_size, args.block_size, args.cuda_graphs,
                      args.num_speculative_tokens)
        pools = plan_pools.from_args(args)
    except ValueError as err:
        print(f"chunklocal plan: error: {err}", file=sys.stderr)
        return 2
    if pools is not None:
        result["kv_pools"] = pools
    text = format_plan(result)
    if pools is not None:
        text += "\n\n" + plan_pools.format_pools(pools, args.max_model_len)
    print(json.dumps(result, indent=2) if args.json else text)
    return 0
