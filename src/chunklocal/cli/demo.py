"""`chunklocal demo`: the reporter's scenario of vLLM issue 49980, end to end on the CPU.

Stages 1-2 below; stage 3 (the whole Llama-4 model served by chunklocal.LLM) is
in :mod:`chunklocal.cli.demo_model`.

One 36000-token prompt, attention_chunk_size 8192, pages of 16 tokens, engine
sized for max_num_seqs=1.  Stage 1 (this module): split it into virtual
batches, run the reference attention for one chunked layer on random data,
check sampled rows against a float64 dense per-token mask, show that buffers
sized by max_num_seqs overflow (numpy's own error) while ours fit, and print
the sizing table.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from chunklocal._validate import cdiv, positive_int
from chunklocal.cli.demo_model import max_positions, run_engine_demo
from chunklocal.cli.plan import REPORTER_CONFIG, format_plan, plan
from chunklocal.reference import reference_attention
from chunklocal.virtual_batches import VirtualBatches, make_virtual_batches

TOLERANCE = 1e-5


@dataclass
class Scenario:
    """One step's batch: queries, a paged KV cache and the request's block table."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    chunk_size: int


def reporter_scenario(seq_len: int = 36000, chunk_size: int = 8192, block_size: int = 16,
                      num_q_heads: int = 4, num_kv_heads: int = 1, head_dim: int = 64,
                      seed: int = 0) -> Scenario:
    """A single prefill of ``seq_len`` tokens; pages shuffled so the table matters."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = cdiv(seq_len, block_size)
    shape = (num_pages, block_size, num_kv_heads, head_dim)
    table = torch.randperm(num_pages, generator=gen).numpy().astype(np.int32)[None, :]
    return Scenario(
        q=torch.randn(seq_len, num_q_heads, head_dim, generator=gen),
        k_cache=torch.randn(shape, generator=gen),
        v_cache=torch.randn(shape, generator=gen),
        query_start_loc=np.array([0, seq_len], dtype=np.int32),
        seq_lens=np.array([seq_len], dtype=np.int32),
        block_table=table,
        chunk_size=chunk_size,
    )


def sample_rows(seq_len: int, chunk_size: int, count: int, seed: int = 0) -> np.ndarray:
    """Rows at and next to every chunk boundary, both ends, plus random ones."""
    boundaries = np.arange(chunk_size, seq_len, chunk_size)
    edges = np.concatenate([[0, 1, seq_len - 1], boundaries - 1, boundaries, boundaries + 1])
    rng = np.random.default_rng(seed)
    rows = np.concatenate([edges, rng.integers(0, seq_len, size=count)])
    return np.unique(rows[(rows >= 0) & (rows < seq_len)])


def dense_oracle_rows(sc: Scenario, rows: np.ndarray) -> torch.Tensor:
    """float64 attention of the given rows (one request from position 0) with the
    dense per-token mask ``k <= p and k // c == p // c``, read through the
    request's own block table; independent of the virtual-batch code."""
    seq_len = int(sc.seq_lens[0])
    block_size = sc.k_cache.shape[1]
    positions = torch.arange(seq_len)
    pages = torch.from_numpy(sc.block_table[0].astype(np.int64))[positions // block_size]
    keys = sc.k_cache[pages, positions % block_size].double()    # [s, Hkv, D]
    values = sc.v_cache[pages, positions % block_size].double()
    group = sc.q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(sc.q.shape[2])
    keys, values = keys.permute(1, 0, 2), values.permute(1, 0, 2)  # [H, s, D]
    outs = []
    for part in np.array_split(np.asarray(rows), max(1, cdiv(len(rows), 16))):
        p = torch.from_numpy(part.astype(np.int64))[:, None]
        mask = (positions <= p) & (positions // sc.chunk_size == p // sc.chunk_size)
        queries = sc.q[p[:, 0]].double().permute(1, 0, 2)              # [H, r, D]
        scores = (queries @ keys.transpose(1, 2)) * scale               # [H, r, s]
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        outs.append((probs @ values).permute(1, 0, 2))
    return torch.cat(outs)


def format_virtual_batches(vb: VirtualBatches) -> str:
    lines = [f"{'vb':>3} {'request':>7} {'query rows':>13} {'q':>5} {'kv_start':>8} "
             f"{'keys':>5}  local block table (first .. last page)"]
    for m in range(vb.num_batches):
        lo, hi = int(vb.query_start_loc[m]), int(vb.query_start_loc[m + 1])
        table = vb.block_table[m]
        lines.append(f"{m:>3} {int(vb.request[m]):>7} {f'{lo}..{hi - 1}':>13} {hi - lo:>5} "
                     f"{int(vb.kv_start[m]):>8} {int(vb.seq_lens[m]):>5}  "
                     f"[{table[0]}, {table[1]}, .. {table[-1]}] ({table.size} columns)")
    return "\n".join(lines)


def run_attention_demo(sc: Scenario, num_sampled: int = 48) -> float:
    """Split, run the reference attention, check sampled rows; return the max error."""
    block_size = sc.k_cache.shape[1]
    vb = make_virtual_batches(sc.query_start_loc, sc.seq_lens, sc.block_table,
                              sc.chunk_size, block_size)
    print(f"one request of {int(sc.seq_lens[0])} tokens, chunk {sc.chunk_size}, "
          f"block {block_size} -> {vb.num_batches} virtual batches")
    print(format_virtual_batches(vb))
    start = time.perf_counter()
    out = reference_attention(sc.q, sc.k_cache, sc.v_cache, sc.query_start_loc, sc.seq_lens,
                              sc.block_table, chunk_size=sc.chunk_size)
    elapsed = time.perf_counter() - start
    rows = sample_rows(int(sc.seq_lens[0]), sc.chunk_size, num_sampled)
    error = (out[rows].double() - dense_oracle_rows(sc, rows)).abs().max().item()
    heads = f"{sc.q.shape[1]}/{sc.k_cache.shape[2]} heads, dim {sc.q.shape[2]}, {sc.q.dtype}"
    print(f"\nreference attention, one layer ({heads}): {elapsed:.2f} s")
    print(f"max |error| vs float64 dense chunk mask on {len(rows)} sampled rows "
          f"(chunk boundaries included): {error:.2e} "
          f"({'OK' if error < TOLERANCE else 'FAIL'}, tolerance {TOLERANCE:g})")
    return error


def show_overflow(vb_seq_lens: np.ndarray, max_num_seqs: int, block_size: int,
                  our_bound: int) -> None:
    """Fill paged_kv_indptr the way engines do, in a max_num_seqs-sized and an our-sized buffer."""
    pages = cdiv(vb_seq_lens, block_size).astype(np.int32)
    num_batches = pages.size
    old = np.zeros(max_num_seqs + 1, dtype=np.int32)
    try:
        np.cumsum(pages, out=old[1:num_batches + 1])
        print("max_num_seqs-sized paged_kv_indptr: fits (no overflow on this batch)")
    except ValueError as err:
        print(f"expected failure (the bug of vLLM issue 49980): max_num_seqs-sized "
              f"paged_kv_indptr ({old.size} entries) for {num_batches} virtual batches -> "
              f"ValueError: {err}")
    ours = np.zeros(our_bound + 1, dtype=np.int32)
    np.cumsum(pages, out=ours[1:num_batches + 1])
    print(f"our paged_kv_indptr ({ours.size} entries): {ours[:num_batches + 1].tolist()}")


def print_sizing(config: dict | None = None) -> dict:
    print("published bound: what vLLM PR 50022 allocates for virtual batches, "
          "min(2N + cdiv(T, c), T), safe but not tight; ours is the exact maximum "
          "(docs/bounds.md)")
    result = plan(**(config or REPORTER_CONFIG))
    print(format_plan(result))
    return result


def device_name(text: str) -> str:
    """argparse ``type=`` for --device: a torch device of type cpu or cuda, kept as typed."""
    try:
        kind = torch.device(text).type
    except (RuntimeError, ValueError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu or cuda (e.g. cuda:0), got {text!r}")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="random data seed (default 0)")
    parser.add_argument("--num-q-heads", type=positive_int, default=4,
                        help="default 4 (GQA group 4)")
    parser.add_argument("--num-kv-heads", type=positive_int, default=1, help="default 1")
    parser.add_argument("--head-dim", type=positive_int, default=64, help="default 64")
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="serve this Llama-4 checkpoint instead of a random tiny one")
    parser.add_argument("--device", type=device_name, default="cpu",
                        help="cpu (torch reference) or cuda (FlashInfer, bf16)")
    parser.add_argument("--prompt-len", type=positive_int, default=36000, help="default 36000")
    parser.add_argument("--new-tokens", type=positive_int, default=32, help="default 32")
    parser.add_argument("--check-transformers", action="store_true", default=None,
                        help="compare logits with transformers (default: only for the "
                        "random model)")


def check_arguments(parser: argparse.ArgumentParser, args) -> None:
    """What one option's type cannot check; called by the CLI before :func:`main`."""
    if args.num_q_heads % args.num_kv_heads:
        parser.error(f"argument --num-q-heads: {args.num_q_heads} is not a multiple of "
                     f"--num-kv-heads {args.num_kv_heads}")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        what = "is not a directory" if not Path(args.model).is_dir() else "has no config.json"
        parser.error(f"argument --model: {args.model!r} {what} (want a Llama-4 checkpoint "
                     "directory with config.json)")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"argument --device: {args.device!r} but CUDA is not available")
    limit = max_positions(args.model)
    if args.prompt_len + args.new_tokens > limit:
        parser.error(f"argument --prompt-len: {args.prompt_len} + --new-tokens "
                     f"{args.new_tokens} tokens exceed the model's max_position_embeddings "
                     f"{limit}")


def main(args) -> int:
    cfg = REPORTER_CONFIG
    sc = reporter_scenario(seq_len=cfg["max_model_len"], chunk_size=cfg["chunk_size"],
                           block_size=cfg["block_size"], num_q_heads=args.num_q_heads,
                           num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                           seed=args.seed)
    print("== 1. chunked-local attention on the reporter's prompt ==")
    print("the reporter's prompt: the one 36000-token request of vLLM issue 49980 (Llama-4, "
          "attention_chunk_size 8192, pages of 16 tokens, engine sized for max_num_seqs=1)")
    error = run_attention_demo(sc)
    print("\n== 2. metadata buffers ==")
    result = print_sizing()
    print()
    vb = make_virtual_batches(sc.query_start_loc, sc.seq_lens, sc.block_table,
                              sc.chunk_size, cfg["block_size"])
    show_overflow(vb.seq_lens, cfg["max_num_seqs"], cfg["block_size"],
                  result["virtual_batches"]["ours"])
    print("\n== 3. the whole model, served by chunklocal.LLM ==")
    engine_ok = run_engine_demo(args.model, args.device, args.prompt_len, args.new_tokens,
                                args.seed, check_transformers=args.check_transformers)
    failed = [name for name, ok in (("attention vs the float64 mask", error < TOLERANCE),
                                    ("engine runs", engine_ok)) if not ok]
    print("\n" + (f"FAIL: {', '.join(failed)} (see above)" if failed else
                  "PASS: attention matches the dense mask, our buffers hold the step that "
                  "overflows max_num_seqs-sized ones, and the engine's checks passed"))
    return 1 if failed else 0
