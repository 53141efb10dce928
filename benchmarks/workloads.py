"""The batches every benchmark runs on, described once (issue 6's cases).

A batch is the engine's view of one step: ``query_start_loc`` [N+1], ``seq_lens``
[N] and a ``block_table`` [N, W] of page ids, all int32 numpy.  Page ids point
into a pool of ``num_pages`` pages.  The pages a chunked layer reads (those of
the chunks a request's queries touch) get distinct ids while the pool has room; earlier
pages wrap around the pool, so a global layer over 128k-token contexts can be
timed without 69 GB of KV (it reads real, mostly uncached memory either way).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CHUNK = 8192
BLOCK = 16
NUM_Q_HEADS = 40
NUM_KV_HEADS = 8
HEAD_DIM = 128


class StepLens:
    """Lengths read off a step's ``query_start_loc`` [N+1] and ``seq_lens`` [N] (mixin for
    the dataclasses that hold them: ``Batch`` here, ``prefill_common.StressBatch``)."""

    query_start_loc: np.ndarray
    seq_lens: np.ndarray

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])


@dataclass(frozen=True)
class Batch(StepLens):
    name: str
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    num_pages: int


def make_batch(name: str, query_lens, seq_lens, *, chunk: int = CHUNK, block: int = BLOCK,
               max_pages: int | None = None, table_width: int | None = None) -> Batch:
    query_lens = np.asarray(query_lens, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    qsl = np.zeros(len(seq_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=qsl[1:])
    pages = -(-seq_lens // block)
    width = int(table_width or pages.max())
    # First logical page of the chunks the queries touch: those pages are read.
    local_first = ((seq_lens - query_lens) // chunk) * chunk // block
    local_pages = pages - local_first
    offsets = np.cumsum(local_pages) - local_pages
    needed = int(local_pages.sum())
    pool = needed if max_pages is None else max(1, min(needed, int(max_pages)))
    logical = np.arange(width, dtype=np.int64)[None, :]
    table = (offsets[:, None] + logical - local_first[:, None]) % pool
    return Batch(name, qsl.astype(np.int32), seq_lens.astype(np.int32),
                 table.astype(np.int32), pool)


def decode_ragged_contexts(n: int = 256, lo: int = 1024, hi: int = 131072, **kw) -> Batch:
    """``n`` decodes whose total lengths run evenly from ``lo`` to ``hi`` tokens."""
    seq = np.linspace(lo, hi, n).astype(np.int64)
    return make_batch(f"{n} decodes, context {lo // 1024}k..{hi // 1024}k",
                      np.ones(n, np.int64), seq, **kw)


def decode_local(n: int = 256, *, full_chunks: bool, chunk: int = CHUNK, **kw) -> Batch:
    """``n`` decodes three chunks in, with local KV 1..chunk (ragged) or all == chunk."""
    local = np.full(n, chunk) if full_chunks else np.linspace(1, chunk, n).astype(np.int64)
    seq = 3 * chunk + local
    label = "full chunks" if full_chunks else f"local KV 1..{chunk}"
    return make_batch(f"{n} decodes, {label}", np.ones(n, np.int64), seq, chunk=chunk, **kw)


def single_prefill(tokens: int = 36000, **kw) -> Batch:
    return make_batch(f"1 prefill of {tokens}", [tokens], [tokens], **kw)


def chunked_prefills(n: int = 8, q: int = 8192, chunk: int = CHUNK, **kw) -> Batch:
    """``n`` chunked-prefill steps of ``q`` tokens each, behind prefixes that straddle chunks."""
    context = (np.arange(n, dtype=np.int64) * 5 * chunk) // 4 + chunk // 3
    return make_batch(f"{n} x {q}-token chunked prefills with prefix",
                      np.full(n, q), context + q, chunk=chunk, **kw)


def mixed(prefills: int = 32, prefill_len: int = 256, decodes: int = 224,
          hi: int = 131072, **kw) -> Batch:
    """Chunked prefills (prefix 0..32k) followed by decodes (context 1k..hi)."""
    prefix = np.linspace(0, 32768, prefills).astype(np.int64)
    dec = np.linspace(1024, hi, decodes).astype(np.int64)
    q = np.concatenate([np.full(prefills, prefill_len), np.ones(decodes, np.int64)])
    s = np.concatenate([prefix + prefill_len, dec])
    return make_batch(f"{prefills} prefills of {prefill_len} + {decodes} decodes", q, s, **kw)


def useful_attention_flops(batch: Batch, chunk: int | None, num_q_heads: int = NUM_Q_HEADS,
                           head_dim: int = HEAD_DIM) -> float:
    """4 * D * Hq * (keys seen, summed over query rows), counting only unmasked pairs.

    A causal problem of q rows over k keys (bottom-right aligned) has rows that
    see k - q + 1 .. k keys: q * k - q * (q - 1) / 2 pairs.  With chunking the
    problems are the virtual batches.
    """
    if chunk is None:
        q, k = batch.query_lens.astype(np.int64), batch.seq_lens.astype(np.int64)
    else:
        from chunklocal.virtual_batches import make_virtual_batches

        vb = make_virtual_batches(batch.query_start_loc, batch.seq_lens, batch.block_table,
                                  chunk, BLOCK)
        q, k = vb.query_lens.astype(np.int64), vb.seq_lens.astype(np.int64)
    pairs = int((q * k - q * (q - 1) // 2).sum())
    return 4.0 * head_dim * num_q_heads * pairs


def kv_tokens_read(batch: Batch, chunk: int | None) -> int:
    """Keys each request's attention reads (the last query row's window), summed."""
    s = batch.seq_lens.astype(np.int64)
    q = batch.query_lens.astype(np.int64)
    if chunk is None:
        return int(s.sum())
    first_chunk_start = ((s - q) // chunk) * chunk
    return int((s - first_chunk_start).sum())
