"""Dense (unpaged) copies of a batch for the alternatives: FlexAttention and SDPA.

Every case of issue 6 has one query length for all requests, so queries become
[B, Hq, Lq, D].  Keys and values are gathered from the paged pool into
[B, Hkv, Lk, D] windows that start at ``kv_offset`` (the first chunk a request's
queries touch, or 0 without chunking): the alternatives get contiguous memory
and no page table, which only flatters them.  The gather is not timed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks import workloads as wl


@dataclass
class DenseBatch:
    q: torch.Tensor  # [B, Hq, Lq, D]
    k: torch.Tensor  # [B, Hkv, Lk, D]
    v: torch.Tensor
    q_rel: torch.Tensor  # [B] position of query row 0 relative to the key window start
    kv_len: torch.Tensor  # [B] valid keys in each window
    chunk: int | None

    def mask_mod(self):
        q_rel, chunk = self.q_rel, self.chunk

        def chunked(b, h, q_idx, kv_idx):
            qp = q_rel[b] + q_idx
            keep = kv_idx <= qp
            if chunk is not None:
                keep = keep & (kv_idx // chunk == qp // chunk)
            return keep

        return chunked

    def dense_mask(self) -> torch.Tensor:
        """[B, 1, Lq, Lk] boolean: True where a query may see a key."""
        lq, lk = self.q.shape[2], self.k.shape[2]
        qp = self.q_rel[:, None, None] + torch.arange(lq, device=self.q.device)[None, :, None]
        kp = torch.arange(lk, device=self.q.device)[None, None, :]
        keep = kp <= qp
        if self.chunk is not None:
            keep &= kp // self.chunk == qp // self.chunk
        return keep[:, None]

    def packed(self, out: torch.Tensor) -> torch.Tensor:
        """[B, Hq, Lq, D] -> [B * Lq, Hq, D] in the batch's row order."""
        return out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3])


def to_dense(batch: wl.Batch, q, k_cache, v_cache, chunk: int | None) -> DenseBatch:
    qlens = batch.query_lens
    if not np.all(qlens == qlens[0]):
        raise ValueError("dense layout needs one query length for all requests, got "
                         f"{sorted(set(qlens.tolist()))}")
    nreq, lq = batch.num_reqs, int(qlens[0])
    seq = batch.seq_lens.astype(np.int64)
    context = seq - lq
    offset = (context // chunk) * chunk if chunk is not None else np.zeros_like(seq)
    kv_len = seq - offset
    lk = int(kv_len.max())
    block = k_cache.shape[1]
    dev = q.device
    pos = torch.from_numpy(offset).to(dev)[:, None] + torch.arange(lk, device=dev)[None, :]
    # Positions past a request's end read its last page (masked out anyway).
    page_col = torch.clamp(pos // block, max=batch.block_table.shape[1] - 1)
    table = torch.from_numpy(batch.block_table.astype(np.int64)).to(dev)
    pages = torch.gather(table, 1, page_col)
    slot = pos % block
    k = k_cache[pages, slot].permute(0, 2, 1, 3).contiguous()  # [B, Hkv, Lk, D]
    v = v_cache[pages, slot].permute(0, 2, 1, 3).contiguous()
    qd = q.view(nreq, lq, q.shape[1], q.shape[2]).transpose(1, 2).contiguous()
    q_rel = torch.from_numpy(context - offset).to(dev)
    return DenseBatch(qd, k, v, q_rel, torch.from_numpy(kv_len).to(dev), chunk)


def sdpa(dense: DenseBatch, mask: torch.Tensor, expand_kv: bool):
    """SDPA with a dense boolean mask; GQA by ``enable_gqa`` or by repeating K/V heads."""
    k, v = dense.k, dense.v
    if expand_kv:
        group = dense.q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return lambda: F.scaled_dot_product_attention(dense.q, k, v, attn_mask=mask)
    return lambda: F.scaled_dot_product_attention(dense.q, k, v, attn_mask=mask,
                                                  enable_gqa=True)


def flex(dense: DenseBatch, compiled: bool):
    """FlexAttention with the chunked block mask; the block mask is built once, untimed."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, _, lq, _ = dense.q.shape
    lk = dense.k.shape[2]
    block_mask = create_block_mask(dense.mask_mod(), B=b, H=None, Q_LEN=lq, KV_LEN=lk,
                                   device=dense.q.device)
    fn = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    return lambda: fn(dense.q, dense.k, dense.v, block_mask=block_mask, enable_gqa=True)


def reference_rows(dense: DenseBatch, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of the first, middle and last query row of up to ``rows`` requests.

    Returns (reference [n, Hq, D], index of those rows in the packed output).
    """
    b, hq, lq, d = dense.q.shape
    group = hq // dense.k.shape[1]
    picks = np.unique(np.linspace(0, b - 1, min(rows, b)).astype(np.int64))
    refs, index = [], []
    mask = None
    for i in picks:  # a handful of rows, setup only
        for r in sorted({0, lq // 2, lq - 1}):
            qp = int(dense.q_rel[i]) + r
            kp = torch.arange(dense.k.shape[2], device=dense.q.device)
            mask = kp <= qp
            if dense.chunk is not None:
                mask &= kp // dense.chunk == qp // dense.chunk
            qv = dense.q[i, :, r].double()  # [Hq, D]
            kk = dense.k[i][:, mask].double().repeat_interleave(group, 0)  # [Hq, n, D]
            vv = dense.v[i][:, mask].double().repeat_interleave(group, 0)
            w = torch.softmax((kk @ qv[:, :, None]).squeeze(-1) / d**0.5, dim=-1)
            refs.append((w[:, None, :] @ vv).squeeze(1))
            index.append(int(i) * lq + r)
    return torch.stack(refs), torch.tensor(index, device=dense.q.device)


def relative_error(out_rows: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst row's ||out - ref|| / ||ref||: a row that sees one key is exact and has the
    largest norm, so one norm over all rows would hide the others' error."""
    out = out_rows.double()
    if not torch.isfinite(out).all():
        return float("nan")
    diff = (out - ref).flatten(1).norm(dim=1)
    return float((diff / ref.flatten(1).norm(dim=1)).max())
