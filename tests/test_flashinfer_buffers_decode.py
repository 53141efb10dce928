"""The host fast paths: pure-decode chunked layers and whole requests on global layers.

``MetadataBuffers.write_decode_chunked`` is checked two ways on random
decode-only batches (padding rows, ragged contexts, lengths on and next to chunk
and page boundaries, int32 and int64 tables): against the general path
(write_host on graph_slots) array for array, and against the per-token chunk
rule written out independently here.  ``write_whole_requests`` (global layers)
is checked against the general path and the same rule without chunks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunklocal.backends.flashinfer.buffers import MetadataBuffers, write_step
from chunklocal.backends.flashinfer.graph_layout import graph_slots, verify_use_first
from chunklocal.bounds.sizing import Capacity, slot_page_limits

GEOMETRIES = [(32, 4), (64, 16), (48, 16), (16, 16), (8192, 16)]


@st.composite
def decode_batch(draw, padding: bool, geometries=tuple(GEOMETRIES)):
    chunk, bs = draw(st.sampled_from(geometries))
    n = draw(st.integers(1, 9))
    near_boundary = st.builds(lambda k, d: max(k * chunk + d, 1),
                              st.integers(0, 4), st.integers(-2, 2))
    near_page = st.builds(lambda k, d: max(k * bs + d, 1), st.integers(0, 40), st.integers(-1, 1))
    real = st.one_of(st.integers(1, 5 * chunk), near_boundary, near_page)
    pad = st.integers(-3, 0)
    seq = [draw(st.one_of(real, pad) if padding else real) for _ in range(n)]
    longest = max(max(seq), 1)
    width = -(-longest // bs) + draw(st.integers(0, 3))
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    table = (rng.permutation(n * width + 11)[: n * width] + 1).reshape(n, width).astype(dtype)
    seq_dtype = draw(st.sampled_from([np.int32, np.int64]))
    return np.array(seq, seq_dtype), table, chunk, bs, draw(st.integers(0, 3))


def general_path(seq, table, chunk, bs, scratch):
    buffers = MetadataBuffers(Capacity(1, 1), bs)
    kv, first, rows = graph_slots(seq.astype(np.int64), 1, chunk, bs, False)
    return buffers.write_host(np.ones(seq.shape[0]), kv, first, rows, table, scratch)


def arrays(step):
    return [step.qo_indptr.numpy().copy(), step.paged_kv_indptr.numpy().copy(),
            step.paged_kv_last_page_len.numpy().copy(), step.paged_kv_indices.numpy().copy()]


def assert_same(fast, general):
    assert (fast.num_batches, fast.num_pages) == (general.num_batches, general.num_pages)
    for got, want in zip(arrays(fast), arrays(general), strict=True):
        assert got.dtype == want.dtype == np.int32
        np.testing.assert_array_equal(got, want)


def keys_by_rule(seq, table, chunk, bs, scratch):
    """Physical key slots of each request's decode query, from the per-token rule."""
    out = []
    for r, s in enumerate(seq.tolist()):
        if s <= 0:  # padding: one key of the scratch page
            out.append([scratch * bs])
            continue
        p = s - 1
        out.append([int(table[r, k // bs]) * bs + k % bs for k in range(p // chunk * chunk, s)])
    return out


def keys_read(step, bs):
    indptr, last = step.paged_kv_indptr.numpy(), step.paged_kv_last_page_len.numpy()
    indices = step.paged_kv_indices.numpy()
    out = []
    for m in range(step.num_batches):
        pages = indices[indptr[m]:indptr[m + 1]]
        kv_len = (len(pages) - 1) * bs + int(last[m])
        out.append([int(pages[k // bs]) * bs + k % bs for k in range(kv_len)])
    return out


@settings(max_examples=150, deadline=None)
@given(st.booleans(), st.data())
def test_fast_decode_matches_general_path_and_chunk_rule(padding, data):
    seq, table, chunk, bs, scratch = data.draw(decode_batch(padding))
    buffers = MetadataBuffers(Capacity(1, 1), bs)  # grows: eager mode
    fast = buffers.write_decode_chunked(seq, table, chunk, scratch)
    assert_same(fast, general_path(seq, table, chunk, bs, scratch))
    assert keys_read(fast, bs) == keys_by_rule(seq, table, chunk, bs, scratch)
    assert fast.qo_indptr.tolist() == list(range(seq.shape[0] + 1))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=2, max_size=6), st.data())
def test_steps_in_sequence_on_one_buffer_set(kinds, data):
    """Decode and mixed steps alternate mirror sets and sizes; each step's arrays stay right."""
    buffers = MetadataBuffers(Capacity(2, 8), 16)
    for decode, padding in kinds:
        seq, table, chunk, _, scratch = data.draw(decode_batch(padding and decode, ((64, 16),)))
        if decode:
            got = write_step(buffers, np.arange(seq.shape[0] + 1), seq, table,
                             np.ones(seq.shape[0], np.int64), chunk)
            assert_same(got, general_path(seq, table, chunk, 16, 0))
        else:
            q = np.minimum(seq, 3)
            qsl = np.concatenate([[0], np.cumsum(q)])
            got = write_step(buffers, qsl, seq, table, q, chunk)
            assert got.qo_indptr.numpy()[-1] == q.sum()


def test_fast_decode_rejects_a_too_narrow_table_like_the_general_path():
    seq, table = np.array([40, 10]), np.arange(1, 9).reshape(2, 4)  # 40 keys need 3 pages of 16
    buffers = MetadataBuffers(Capacity(2, 8), 16)
    ok = buffers.write_decode_chunked(seq, table, 32)
    assert ok.paged_kv_indices.tolist() == [3, 5]  # chunk [32, 40) is page 2; page 0 of row 1
    with pytest.raises(ValueError, match="slot 0 reads pages up to column 4 of a 4-column"):
        buffers.write_decode_chunked(np.array([70, 10]), table, 64)
    with pytest.raises(ValueError) as general:
        general_path(np.array([70, 10]), table, 64, 16, 0)
    assert "slot 0 reads pages up to column 4 of a 4-column" in str(general.value)


def test_fast_decode_keeps_buffers_frozen_under_graphs():
    from chunklocal.backends.flashinfer.buffers import CapacityError

    buffers = MetadataBuffers(Capacity(2, 4), 16, cuda_graphs=True, name="tiny")
    table = np.arange(1, 41).reshape(2, 20)
    with pytest.raises(CapacityError, match="tiny.paged_kv_indices"):
        buffers.write_decode_chunked(np.array([100, 100]), table, 8192)  # 14 pages > 4
    with pytest.raises(CapacityError, match="tiny.paged_kv_indptr"):
        buffers.write_decode_chunked(np.array([1, 1, 1]), np.ones((3, 1), np.int32), 8192)


@settings(max_examples=100, deadline=None)
@given(st.data(), st.sampled_from([4, 16]), st.sampled_from([np.int32, np.int64]),
       st.integers(0, 40))
def test_whole_requests_match_general_path_and_causal_rule(data, bs, dtype, spare_columns):
    n = data.draw(st.integers(1, 8))
    seq = np.array([data.draw(st.one_of(st.integers(1, 200),
                                        st.builds(lambda k, d: max(k * bs + d, 1),
                                                  st.integers(0, 12), st.integers(-1, 1))))
                    for _ in range(n)])
    q = np.array([data.draw(st.integers(1, int(s))) for s in seq])
    width = -(-int(seq.max()) // bs) + spare_columns  # many spare columns: the general path
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    table = (rng.permutation(n * width + 5)[: n * width] + 1).reshape(n, width).astype(dtype)
    buffers = MetadataBuffers(Capacity(1, 1), bs)
    got = buffers.write_whole_requests(q, seq, table)
    want = MetadataBuffers(Capacity(1, 1), bs).write_host(q, seq, np.zeros(n, np.int64),
                                                          np.arange(n), table)
    assert_same(got, want)
    expected = [[int(table[r, k // bs]) * bs + k % bs for k in range(s)]
                for r, s in enumerate(seq.tolist())]
    assert keys_read(got, bs) == expected
    qsl = np.concatenate([[0], np.cumsum(q)])
    assert got.qo_indptr.tolist() == qsl.tolist()
    # write_step routes a global step whose every request has queries here.
    step = write_step(buffers, qsl, seq, table, q, None)
    assert_same(step, want)


def test_whole_requests_reject_like_the_general_path():
    buffers = MetadataBuffers(Capacity(2, 8), 16)
    table = np.arange(1, 5).reshape(2, 2)
    with pytest.raises(ValueError, match="slot 1 reads 0 keys"):
        buffers.write_whole_requests(np.array([1, 1]), np.array([5, 0]), table)
    with pytest.raises(ValueError, match="slot 0 reads pages up to column 2 of a 2-column"):
        buffers.write_whole_requests(np.array([1, 1]), np.array([33, 5]), table)


# ------------------------------------------------ graph layouts need query_len <= chunk
def test_graph_layout_rejects_a_window_longer_than_the_chunk():
    """Two slots cover a window only if it touches at most two chunks (query_len <= c).

    Before the check, chunk 2 with a 5-token window at positions 1..5 laid out
    slots in which position 1 read no keys at all.
    """
    seq = np.array([6])
    message = r"query_len 5 .*chunk size 2"
    with pytest.raises(ValueError, match=message):
        slot_page_limits(2, 5, 16, 1)
    with pytest.raises(ValueError, match=message):
        graph_slots(seq, 5, 2, 1, True)
    with pytest.raises(ValueError, match=message):
        graph_slots(torch.from_numpy(seq), 5, 2, 1, False)
    with pytest.raises(ValueError, match=message):
        verify_use_first(seq, 5, 2)
    buffers = MetadataBuffers(Capacity(4, 32), 1, verify_rows=8)
    table = np.arange(8).reshape(1, 8)
    with pytest.raises(ValueError, match=message):
        buffers.write_graph_step(seq, table, 5, 2, True, 0)


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 6])
def test_graph_slots_give_each_window_row_its_chunk(chunk):
    """query_len <= c (the accepted range): every row sees exactly its chunk's keys."""
    for query_len in range(1, chunk + 1):
        seq = np.arange(query_len, 4 * chunk + query_len, dtype=np.int64)
        two = len(slot_page_limits(chunk, query_len, int(seq.max()), 1)) == 2
        kv, first, _ = graph_slots(seq, query_len, chunk, 1, two)
        slots = 2 if two else 1
        mask = verify_use_first(seq, query_len, chunk) if two else np.zeros(
            (seq.size, query_len), bool)
        for r, s in enumerate(seq.tolist()):
            for i in range(query_len):
                slot = r * slots + (0 if mask[r, i] else slots - 1)
                seen = int(kv[slot]) - query_len + i + 1  # bottom-right causal in the slot
                start = int(first[slot])
                p = s - query_len + i
                assert list(range(start, start + seen)) == list(range(p // chunk * chunk, p + 1))


def test_graph_layout_accepts_windows_up_to_the_chunk():
    assert slot_page_limits(2, 2, 16, 1) == (3, 2)
    assert slot_page_limits(None, 50, 16, 1) == (16,)  # no chunking: no limit
    kv, first, rows = graph_slots(np.array([6, 0]), 50, None, 1, False)
    assert kv.tolist() == [6, 0] and rows.tolist() == [0, -1]
