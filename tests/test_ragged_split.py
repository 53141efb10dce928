"""backends/flashinfer/ragged.py: the global layers' split and the pinned staging.  The
chunked split is checked against its definition in tests/test_prefill_benchmarks.py."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import prefill_common as pc
from chunklocal.backends.flashinfer.ragged import PinnedArrays, ragged_split

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
