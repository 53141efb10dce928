"""backends/flashinfer/ragged.py: the global layers' split, the gathered blocks of earlier
keys and the pinned staging.  The chunked split is checked against its definition in
tests/test_prefill_benchmarks.py."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import prefill_common as pc
from chunklocal.backends.flashinfer.ragged import PinnedArrays, ragged_split, split_earlier

BS = 16


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), chunk=st.sampled_from([32, 256]))
def test_a_global_layers_split_is_the_chunked_split_with_one_chunk(seed, chunk):
    """Without a chunk a request is one segment: the split equals the chunked one's for a
    chunk longer than every request (computed through the virtual batches)."""
    rng = np.random.default_rng(seed)
    b = pc.random_batch(rng, chunk, 16 * 5 * chunk // BS + 2, max_tokens=300)
    whole = -(-int(b.seq_lens.max()) // BS) * BS
    got = ragged_split(b.query_start_loc, b.seq_lens, b.block_table, None, BS)
    want = ragged_split(b.query_start_loc, b.seq_lens, b.block_table, whole, BS)
    assert got.num_batches == want.num_batches == b.seq_lens.shape[0]
    for name in ("qo_indptr", "paged_rows"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "last_page_len"):
        np.testing.assert_array_equal(getattr(got.paged, name), getattr(want.paged, name))
    # every row with earlier keys is one whose request had keys before the step
    earlier = b.seq_lens - np.diff(b.query_start_loc)
    row_req = np.repeat(np.arange(earlier.shape[0]), np.diff(b.query_start_loc))
    np.testing.assert_array_equal(got.paged_rows, np.flatnonzero(earlier[row_req] > 0))


def _pairs_of_paged(rows, p) -> list[tuple[int, int]]:
    """(step row, cache row) of every earlier key a paged part reads, by its definition."""
    out = []
    for j in range(p.qo_indptr.shape[0] - 1):
        pages = p.kv_indices[p.kv_indptr[j]:p.kv_indptr[j + 1]]
        keys = (len(pages) - 1) * BS + int(p.last_page_len[j]) if len(pages) else 0
        cache = [int(pages[i // BS]) * BS + i % BS for i in range(keys)]
        out += [(int(r), c) for r in rows[p.qo_indptr[j]:p.qo_indptr[j + 1]] for c in cache]
    return out


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), chunk=st.sampled_from([None, 32, 256]),
       min_rows=st.integers(1, 40), max_keys=st.integers(1, 600),
       max_blocks=st.integers(1, 5))
def test_gathered_blocks_and_paged_part_read_each_earlier_key_once(seed, chunk, min_rows,
                                                                   max_keys, max_blocks):
    """split_earlier: the (row, key) pairs of the paged part and of every gathered block
    are exactly the split's earlier-key pairs, each once; only segments of min_rows
    queries or more are gathered, and one keeps a paged prefix only once the blocks are
    full; at most max_blocks blocks of at most max_keys keys, a segment at most one piece
    of each, their rows their segments' rows in order."""
    rng = np.random.default_rng(seed)
    b = pc.random_batch(rng, chunk or 64, 16 * 5 * (chunk or 64) // BS + 2, max_tokens=300)
    split = ragged_split(b.query_start_loc, b.seq_lens, b.block_table, chunk, BS)
    parts = split_earlier(split, BS, min_rows, max_keys, max_blocks)
    want = sorted(_pairs_of_paged(split.paged_rows, split.paged))
    got = _pairs_of_paged(parts.paged_rows, parts.paged)
    total = sum(int(b_.cache_rows.shape[0]) for b_ in parts.blocks)
    q_paged = np.diff(parts.paged.qo_indptr)
    assert (q_paged < min_rows).all() or total == max_blocks * max_keys
    assert len(parts.blocks) <= max_blocks
    for block in parts.blocks:
        q_lens, k_lens = np.diff(block.qo_indptr), np.diff(block.kv_indptr)
        assert 0 < block.cache_rows.shape[0] <= max_keys and (q_lens >= min_rows).all()
        assert (k_lens > 0).all() and block.rows.shape[0] == block.qo_indptr[-1]
        for j in range(q_lens.shape[0]):
            keys = block.cache_rows[block.kv_indptr[j]:block.kv_indptr[j + 1]].tolist()
            got += [(int(r), c) for r in block.rows[block.qo_indptr[j]:block.qo_indptr[j + 1]]
                    for c in keys]
    assert sorted(got) == want
    big = np.diff(split.paged.qo_indptr) >= min_rows
    assert len(parts.blocks) == -(-total // max_keys) and (total > 0) == bool(big.any())


def test_pinned_arrays_keep_one_buffer_an_array_and_grow_it():
    host = PinnedArrays(pin=False)
    a = host.put("qo", np.arange(5, dtype=np.int32))
    b = host.put("kv", np.arange(7, 12, dtype=np.int64))
    assert a.tolist() == list(range(5)) and a.dtype == torch.int32
    assert b.tolist() == list(range(7, 12)) and b.dtype == torch.int64
    again = host.put("qo", np.array([9, 8], dtype=np.int32))  # fits: the same storage
    assert again.tolist() == [9, 8] and again.data_ptr() == a.data_ptr()
    assert b.tolist() == list(range(7, 12))  # another name is another buffer
    big = host.put("qo", np.arange(100, dtype=np.int32))  # grown
    assert big.tolist() == list(range(100))
