"""Prefill: the step's own keys from its own K/V (ragged), earlier keys paged (issue 14, item 2).

A chunked prefill today reads every key through the paged cache, including the
keys this step has just written.  The prototype splits each virtual batch (one
chunk's slice of a request's queries, rows ``[a, b)`` with keys ``[chunk_start, b)``):

* in-step keys ``[a, b)``: causal, square, straight from the step's contiguous K/V
  (``BatchPrefillWithRaggedKVCacheWrapper``, ``kv_indptr == qo_indptr``);
* earlier keys ``[chunk_start, a)``: every row sees all of them (non-causal), through
  the paged cache (``BatchPrefillWithPagedKVCacheWrapper``), only for the virtual
  batches that have any (the first chunk of a request whose prefix is not
  chunk-aligned);
* the two partial results merged by log-sum-exp (``flashinfer.merge_state``, log2
  LSE as both wrappers return it) on those rows.

Both halves are cut at chunk boundaries like everything else.  Per case and kernel
(fa2, fa3) it checks the merged output per (row, head) against the paged-only
output of ``FlashInferBackend`` (what ships) and both against the float32
reference, and times paged-only vs ragged + paged + merge (CUDA events, median),
as useful TFLOP/s and as a share of the bf16 matmul rate measured in the same run.

``--flex`` adds FlexAttention over the *paged* cache: the pool viewed as one
sequence of pages, a block mask with one KV block per page (16 keys) listing, per
128-row query block, the pages its rows read (full pages need no mask), and a
mask_mod that maps a physical slot back to (request, position) and applies the
chunk rule.  ``--quick`` runs the host split and torch stand-ins on the CPU.

Cases: the reporter's prompt (36000 tokens, c = 8192) and 8 x 8192 behind
prefixes of 2.7k-74k (BENCHMARKS.md Q1).  40/8 heads x 128, bf16, page 16.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks import prefill_common as pc
from benchmarks import workloads as wl
from chunklocal.backends.flashinfer.ragged import RaggedSplit
from chunklocal.backends.flashinfer.ragged import ragged_split as split_step

SCALE = wl.HEAD_DIM ** -0.5


# --------------------------------------------------------------------- host split
def ragged_split(batch: pc.StressBatch, block: int = wl.BLOCK) -> RaggedSplit:
    """The engine's split (backends/flashinfer/ragged.py) of a stress batch."""
    return split_step(batch.query_start_loc, batch.seq_lens, batch.block_table, batch.chunk,
                      block)


def step_slots(batch: pc.StressBatch, block: int = wl.BLOCK) -> np.ndarray:
    """Cache slot (page * block + offset) of every query token of the step, int64 [T]."""
    q = batch.query_lens.astype(np.int64)
    req = np.repeat(np.arange(q.shape[0]), q)
    pos = (batch.seq_lens.astype(np.int64) - q)[req] \
        + np.arange(int(q.sum())) - batch.query_start_loc[:-1].astype(np.int64)[req]
    return batch.block_table[req, pos // block].astype(np.int64) * block + pos % block


def merge_states_torch(v_a, s_a, v_b, s_b):
    """LSE merge of two partial attention states (log2 LSE), as flashinfer.merge_state."""
    import torch

    s_max = torch.maximum(s_a, s_b)
    s_max = torch.where(torch.isinf(s_max), torch.zeros_like(s_max), s_max)
    w_a, w_b = torch.exp2(s_a - s_max), torch.exp2(s_b - s_max)
    total = w_a + w_b
    v = (v_a.float() * (w_a / total)[..., None] + v_b.float() * (w_b / total)[..., None])
    return v.to(v_a.dtype), torch.log2(total) + s_max


# --------------------------------------------------------------------- flex, paged
@dataclass(frozen=True)
class FlexPagedMask:
    """Block lists for FlexAttention over the pool (one KV block per page), numpy.

    ``kv_num`` / ``kv_idx``: partial pages per 128-row query block (mask_mod decides),
    ``full_num`` / ``full_idx``: pages every row of the block sees whole.
    ``row_req`` / ``row_pos``: request and position of each query row;
    ``page_req`` / ``page_pos``: request and first position of each pool page the
    step reads (-1 elsewhere).
    """

    kv_num: np.ndarray
    kv_idx: np.ndarray
    full_num: np.ndarray
    full_idx: np.ndarray
    row_req: np.ndarray
    row_pos: np.ndarray
    page_req: np.ndarray
    page_pos: np.ndarray
    q_block: int


def flex_paged_mask(batch: pc.StressBatch, num_pages: int, q_block: int = 128,
                    block: int = wl.BLOCK) -> FlexPagedMask:
    """Setup code (a loop over virtual batches and the query blocks they touch)."""
    from chunklocal.virtual_batches import make_virtual_batches

    vb = make_virtual_batches(batch.query_start_loc, batch.seq_lens, batch.block_table,
                              batch.chunk, block)
    t = batch.num_tokens
    q = batch.query_lens.astype(np.int64)
    row_req = np.repeat(np.arange(q.shape[0]), q)
    row_pos = (batch.seq_lens.astype(np.int64) - q)[row_req] + np.arange(t) \
        - batch.query_start_loc[:-1].astype(np.int64)[row_req]
    page_req = np.full(num_pages, -1, np.int64)
    page_pos = np.full(num_pages, -1, np.int64)
    n_qb = -(-t // q_block)
    partial = [[] for _ in range(n_qb)]
    full = [[] for _ in range(n_qb)]
    for m in range(vb.num_batches):
        r0, r1 = int(vb.query_start_loc[m]), int(vb.query_start_loc[m + 1])
        start, keys = int(vb.kv_start[m]), int(vb.seq_lens[m])
        pages = vb.block_table[m, : -(-keys // block)].astype(np.int64)
        if (page_req[pages] >= 0).any():
            raise ValueError("a pool page is read by two (request, chunk) pairs")
        page_req[pages] = vb.request[m]
        page_pos[pages] = start + block * np.arange(pages.shape[0])
        first_pos = start + keys - (r1 - r0)  # position of row r0
        for j in range(r0 // q_block, (r1 - 1) // q_block + 1):
            lo, hi = max(r0, j * q_block), min(r1, (j + 1) * q_block)
            min_pos, max_pos = first_pos + lo - r0, first_pos + hi - 1 - r0
            needed = (max_pos - start) // block + 1
            whole = lo == j * q_block and hi == min((j + 1) * q_block, t)
            n_full = (min_pos - start + 1) // block if whole else 0
            full[j].extend(pages[:n_full].tolist())
            partial[j].extend(pages[n_full:needed].tolist())

    def pack(lists):
        # BlockMask wants the index rows as wide as the number of KV blocks (pages).
        idx = np.zeros((1, 1, n_qb, num_pages), np.int32)
        for j, x in enumerate(lists):
            idx[0, 0, j, : len(x)] = x
        return np.array([[[len(x) for x in lists]]], np.int32), idx

    kv_num, kv_idx = pack(partial)
    full_num, full_idx = pack(full)
    return FlexPagedMask(kv_num, kv_idx, full_num, full_idx, row_req, row_pos, page_req,
                         page_pos, q_block)


def flex_mask_mod(mask: FlexPagedMask, chunk: int, device, block: int = wl.BLOCK):
    import torch

    row_req, row_pos, page_req, page_pos = (torch.from_numpy(a).to(device) for a in (
        mask.row_req, mask.row_pos, mask.page_req, mask.page_pos))

    def mask_mod(b, h, q_idx, kv_idx):
        page = kv_idx // block
        key_pos = page_pos[page] + kv_idx % block
        qp = row_pos[q_idx]
        return (page_req[page] == row_req[q_idx]) & (key_pos <= qp) & (
            key_pos // chunk == qp // chunk)

    return mask_mod


def flex_block_mask(mask: FlexPagedMask, chunk: int, num_pages: int, device,
                    block: int = wl.BLOCK):
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    def dev(a):
        return torch.from_numpy(a).to(device)

    return BlockMask.from_kv_blocks(
        dev(mask.kv_num), dev(mask.kv_idx), dev(mask.full_num), dev(mask.full_idx),
        BLOCK_SIZE=(mask.q_block, block), mask_mod=flex_mask_mod(mask, chunk, device, block),
        seq_lengths=(int(mask.row_req.shape[0]), num_pages * block))


def flex_forward(q, k_cache, v_cache, block_mask, compiled: bool, kernel_options=None):
    """Flex over the pool: q [T, Hq, D] -> [T, Hq, D]; the pool is a strided view."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    fn = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    qd = q.permute(1, 0, 2).unsqueeze(0)
    kd = k_cache.flatten(0, 1).permute(1, 0, 2).unsqueeze(0)
    vd = v_cache.flatten(0, 1).permute(1, 0, 2).unsqueeze(0)
    opts = kernel_options or None

    def run():
        out = fn(qd, kd, vd, block_mask=block_mask, scale=SCALE, enable_gqa=True,
                 kernel_options=opts)
        return out.squeeze(0).permute(1, 0, 2)

    return run


# --------------------------------------------------------------------- kernels
class RaggedPaged:
    """FlashInfer ragged (in-step keys) + paged (earlier keys) + merge, one kernel."""

    def __init__(self, kernel: str, device, workspace_bytes: int = 256 << 20):
        import flashinfer
        import torch

        self.kernel, self.device = kernel, device
        ws = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self.ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=kernel)
        self.paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=kernel)
        try:
            self.merge = flashinfer.merge_state
        except AttributeError:  # older FlashInfer: the torch merge (recorded as merge_impl)
            self.merge = merge_states_torch

    def plan(self, split: RaggedSplit, dtype) -> float:
        """Plan both wrappers (host arrays); returns the host seconds it took."""
        import torch

        kw = dict(q_data_type=dtype, kv_data_type=dtype, sm_scale=SCALE)
        heads = (wl.NUM_Q_HEADS, wl.NUM_KV_HEADS, wl.HEAD_DIM)
        t0 = time.perf_counter()
        qo = torch.from_numpy(split.qo_indptr)
        self.ragged.plan(qo, qo, *heads, causal=True, **kw)
        self.has_paged = split.paged_rows.size > 0
        if self.has_paged:
            p = split.paged
            self.paged.plan(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (
                p.qo_indptr, p.kv_indptr, p.kv_indices, p.last_page_len)),
                *heads, wl.BLOCK, causal=False, **kw)
            self.rows = torch.from_numpy(split.paged_rows).to(self.device)
        return time.perf_counter() - t0

    def parts(self, q, k_new, v_new, k_cache, v_cache):
        """Callables for the timed pieces: ragged, paged part, merge, and all of it."""
        import torch

        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)

        def ragged():
            return self.ragged.run(q, k_new, v_new, out=out, lse=lse, return_lse=True)

        def paged():
            return self.paged.run(q.index_select(0, self.rows), (k_cache, v_cache),
                                  return_lse=True)

        def merge(part):
            v, _ = self.merge(out.index_select(0, self.rows), lse.index_select(0, self.rows),
                              *part)
            out.index_copy_(0, self.rows, v)

        def total():
            ragged()
            if self.has_paged:
                merge(paged())
            return out

        return ragged, (paged if self.has_paged else None), merge, total


def _attention_lse(q, keys, values, causal: bool):
    """float32 attention of q [L, Hq, D] over keys/values [K, Hkv, D]: out, log2 LSE."""
    import math

    import torch

    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, 1).permute(1, 2, 0)      # [Hq, D, K]
    v = values.float().repeat_interleave(group, 1).permute(1, 0, 2)    # [Hq, K, D]
    scores = (q.float().permute(1, 0, 2) @ k) * SCALE                   # [Hq, L, K]
    if causal:  # bottom-right aligned
        length, n = scores.shape[1], scores.shape[2]
        keep = torch.arange(n)[None, :] <= torch.arange(length)[:, None] + (n - length)
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ v
    return out.permute(1, 0, 2), (lse / math.log(2)).T


def torch_ragged_paged(split: RaggedSplit, q, k_new, v_new, k_cache, v_cache):
    """CPU stand-in for RaggedPaged (loops over virtual batches): the same split and merge."""
    import torch

    out = torch.empty(q.shape, dtype=torch.float32)
    lse = torch.empty(q.shape[:2], dtype=torch.float32)
    qo = split.qo_indptr
    for m in range(qo.shape[0] - 1):
        a, b = int(qo[m]), int(qo[m + 1])
        out[a:b], lse[a:b] = _attention_lse(q[a:b], k_new[a:b], v_new[a:b], causal=True)
    if split.paged_rows.size:
        p, rows = split.paged, torch.from_numpy(split.paged_rows)
        qp = q.index_select(0, rows)
        part_out = torch.empty(qp.shape, dtype=torch.float32)
        part_lse = torch.empty(qp.shape[:2], dtype=torch.float32)
        for i in range(p.kv_indptr.shape[0] - 1):
            pages = torch.from_numpy(p.kv_indices[p.kv_indptr[i]:p.kv_indptr[i + 1]].astype(
                np.int64))
            n = (pages.shape[0] - 1) * wl.BLOCK + int(p.last_page_len[i])
            a, b = int(p.qo_indptr[i]), int(p.qo_indptr[i + 1])
            keys, vals = k_cache[pages].flatten(0, 1)[:n], v_cache[pages].flatten(0, 1)[:n]
            part_out[a:b], part_lse[a:b] = _attention_lse(qp[a:b], keys, vals, causal=False)
        merged, _ = merge_states_torch(out[rows], lse[rows], part_out, part_lse)
        out[rows] = merged
    return out.to(q.dtype)


# --------------------------------------------------------------------- driver
KERNELS = {"fa2": "fa2", "fa3": "auto"}  # FlashInferBackend's prefill_backend for paged-only


def cases(quick: bool, seed: int):
    if quick:
        return [("fresh prompt 600, c=256", pc.reporter_batch(600, 256, seed=seed)),
                ("3 prefills behind unaligned prefixes, c=64",
                 _prefixed(np.array([40, 100, 64]), np.array([37, 150, 70]), 64))]
    eight = wl.chunked_prefills(8, 8192)
    return [("reporter: 36000 tokens, c=8192", pc.reporter_batch(seed=seed)),
            ("8 x 8192 behind 2.7k-74k prefixes",
             pc.StressBatch(eight.query_start_loc, eight.seq_lens, eight.block_table, wl.CHUNK))]


def _prefixed(q_lens, prefixes, chunk):
    b = wl.make_batch("prefixed", q_lens, prefixes + q_lens, chunk=chunk)
    return pc.StressBatch(b.query_start_loc, b.seq_lens, b.block_table, chunk)


def run_case(name, batch, args, rate):
    import torch

    from benchmarks.common import cuda_time_ms

    gpu = args.device == "cuda"
    num_pages = int(batch.block_table.max()) + 1
    k_cache, v_cache = pc.random_pool(num_pages, args.device, args.seed)
    q = pc.random_queries(batch.num_tokens, args.device, args.seed + 1)
    slots = torch.from_numpy(step_slots(batch)).to(args.device)
    k_new = k_cache.flatten(0, 1).index_select(0, slots)  # the step's own K/V, contiguous
    v_new = v_cache.flatten(0, 1).index_select(0, slots)
    split = ragged_split(batch)
    ref = pc.reference(q, k_cache.float(), v_cache.float(), batch, SCALE)
    flops = wl.useful_attention_flops(batch, batch.chunk)
    row = {"case": name, "tokens": batch.num_tokens, "virtual_batches": split.num_batches,
           "paged_rows": int(split.paged_rows.size), "useful_TFLOP": flops / 1e12}

    def timed(fn):
        return cuda_time_ms(fn, repeats=args.repeats, warmup=3)["median"] if gpu else None

    def rate_of(ms):
        return None if ms is None or rate is None else flops / (ms * 1e-3) / rate

    for kernel in args.kernels:
        res = {}
        if gpu:
            limits = pc.engine_limits(16, max(batch.num_tokens, 1), int(batch.seq_lens.max()))
            backend = pc.make_backend(batch.chunk, KERNELS[kernel], limits, args.device)
            t0 = time.perf_counter()
            md = backend.build(batch.query_start_loc, batch.seq_lens, batch.block_table)
            res["paged_build_ms"] = (time.perf_counter() - t0) * 1e3
            paged_out = torch.full_like(q, float("nan"))

            def paged_only(md=md, backend=backend, out=paged_out):
                return backend.forward(md, q, k_cache, v_cache, SCALE, out=out)

            paged_only()
            rp = RaggedPaged(kernel, args.device)
            res["ragged_plan_ms"] = rp.plan(split, torch.bfloat16) * 1e3
            res["merge_impl"] = getattr(rp.merge, "__module__", "?")
            ragged, paged, merge, total = rp.parts(q, k_new, v_new, k_cache, v_cache)
            merged = total().clone()
            res["paged_only_ms"] = timed(paged_only)
            res["ragged_total_ms"] = timed(total)
            res["ragged_part_ms"] = timed(ragged)
            if paged is not None:
                res["paged_part_ms"] = timed(paged)
                part = paged()
                res["merge_ms"] = timed(lambda part=part, merge=merge: merge(part))
            res["paged_only_of_matmul"] = rate_of(res["paged_only_ms"])
            res["ragged_total_of_matmul"] = rate_of(res["ragged_total_ms"])
            res["ragged/paged_only"] = res["ragged_total_ms"] / res["paged_only_ms"]
        else:  # CPU stand-ins: the reference as "paged-only", torch loops for the split
            from chunklocal.reference import reference_attention

            paged_out = reference_attention(q, k_cache, v_cache, batch.query_start_loc,
                                            batch.seq_lens, batch.block_table,
                                            chunk_size=batch.chunk, scale=SCALE)
            merged = torch_ragged_paged(split, q, k_new, v_new, k_cache, v_cache)
        res["merged_vs_paged_only"] = pc.summarize(pc.row_errors(merged, paged_out.float()))
        res["merged_vs_ref"] = pc.summarize(pc.row_errors(merged, ref))
        res["paged_only_vs_ref"] = pc.summarize(pc.row_errors(paged_out, ref))
        row[kernel] = res
        print(f"[{name}] {kernel}: {json.dumps(res, default=str)}", flush=True)
    # Flex runs after the caller has saved the row: its compile may hit a time limit.
    return row, lambda: run_flex(batch, q, k_cache, v_cache, ref, args, timed, rate_of)


def run_flex(batch, q, k_cache, v_cache, ref, args, timed, rate_of):
    res = {}
    try:
        t0 = time.perf_counter()
        mask = flex_paged_mask(batch, k_cache.shape[0])
        block_mask = flex_block_mask(mask, batch.chunk, k_cache.shape[0], args.device)
        res["mask_build_s"] = time.perf_counter() - t0
        res["kv_blocks_listed"] = int(mask.kv_num.sum() + mask.full_num.sum())
        res["full_blocks"] = int(mask.full_num.sum())
        opts = json.loads(args.flex_options) if args.device == "cuda" else None
        fn = flex_forward(q, k_cache, v_cache, block_mask, compiled=args.device == "cuda",
                          kernel_options=opts)
        t0 = time.perf_counter()
        out = fn()
        res["first_call_s"] = time.perf_counter() - t0  # compile on the GPU
        res["vs_ref"] = pc.summarize(pc.row_errors(out, ref))
        res["ms"] = timed(fn)
        res["of_matmul"] = rate_of(res["ms"])
    except Exception as exc:  # noqa: BLE001 - a Flex failure must not lose the other rows
        res["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    print(f"[flex] {json.dumps(res, default=str)}", flush=True)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file (ends in .json) or directory (default benchmarks/results)")
    p.add_argument("--kernels", default="fa2,fa3", help="comma list: fa2, fa3")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--flex", action="store_true", help="also FlexAttention over the paged cache")
    p.add_argument("--flex-options", default='{"BLOCK_M": 64, "BLOCK_N": 16}',
                   help="FlexAttention kernel_options (JSON); BLOCK_N must divide the page")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", "--smoke", action="store_true", dest="quick",
                   help="CPU: host split + torch stand-ins")
    args = p.parse_args(argv)
    args.kernels = ["torch"] if args.quick else args.kernels.split(",")
    args.device = "cpu" if args.quick else "cuda"
    import torch

    if not args.quick and not torch.cuda.is_available():
        print("prefill_ragged needs CUDA (use --quick on the CPU)", file=sys.stderr)
        return 2
    payload = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "rows": [], "errors": []}
    rate = None
    if args.device == "cuda":
        from benchmarks.common import measure_matmul_flops

        rate = measure_matmul_flops("cuda", 8192)
        payload["ceilings"] = {"matmul_flops": rate}
    name = "prefill_ragged_quick" if args.quick else "prefill_ragged"
    for case_name, batch in cases(args.quick, args.seed):
        flex = None
        try:
            row, flex = run_case(case_name, batch, args, rate)
            payload["rows"].append(row)
        except Exception as exc:  # noqa: BLE001 - keep the other case
            import traceback

            traceback.print_exc()
            payload["errors"].append({"case": case_name, "error": f"{type(exc).__name__}: {exc}"})
        print(f"wrote {pc.save(payload, args.out, name)}", flush=True)
        if args.flex and flex is not None:
            row["flex"] = flex()
            pc.save(payload, args.out, name)
        del flex
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return 1 if payload["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
