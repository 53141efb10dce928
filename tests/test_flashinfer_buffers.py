"""FlashInfer's persistent metadata buffers: sizing, capacity backstop, values vs an oracle."""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunklocal.backends.base import EngineLimits
from chunklocal.backends.flashinfer.buffers import CapacityError, MetadataBuffers, write_step
from chunklocal.bounds.sizing import Capacity, group_capacities, slot_page_limits
from chunklocal.kv_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    Kind,
    attention_kinds,
    merge,
)
from chunklocal.virtual_batches import make_virtual_batches

BS = 16
REPORTER = EngineLimits(max_num_seqs=1, max_num_batched_tokens=36000, max_model_len=36000,
                        block_size=BS)


def chunked_spec(c=8192, bs=BS):
    return ChunkedLocalAttentionSpec(bs, 8, 128, torch.bfloat16, attention_chunk_size=c)


def full_spec(bs=BS, chunk=None):
    return FullAttentionSpec(bs, 8, 128, torch.bfloat16, attention_chunk_size=chunk)


# ----------------------------------------------------------------- oracle
def keys_expected(qsl, seq, table, chunk, bs):
    """Physical key slots each query row sees, from the per-token chunk rule."""
    rows = []
    for r in range(len(seq)):
        q = qsl[r + 1] - qsl[r]
        for p in range(seq[r] - q, seq[r]):
            lo = p // chunk * chunk if chunk else 0
            rows.append([int(table[r][k // bs]) * bs + k % bs for k in range(lo, p + 1)])
    return rows


def keys_from_metadata(qo_indptr, kv_indptr, last, indices, bs):
    """Physical key slots per query row, reading the arrays as FlashInfer does (causal)."""
    rows = []
    for m in range(len(kv_indptr) - 1):
        pages = indices[kv_indptr[m]:kv_indptr[m + 1]]
        kv_len = (len(pages) - 1) * bs + last[m]
        slots = [int(pages[k // bs]) * bs + k % bs for k in range(kv_len)]
        q = qo_indptr[m + 1] - qo_indptr[m]
        for i in range(q):
            rows.append(slots[: kv_len - (q - 1 - i)])
    return rows


@st.composite
def random_batch(draw, n_max=5, chunk=64, bs=BS, q_max=150, s_max=400):
    n = draw(st.integers(1, n_max))
    seq = [draw(st.integers(1, s_max)) for _ in range(n)]
    q = [draw(st.integers(1, min(s, q_max))) for s in seq]
    width = -(-max(seq) // bs)
    pool = np.random.default_rng(draw(st.integers(0, 2**31))).permutation(n * width + 7)
    table = pool[: n * width].reshape(n, width) + 1
    return np.concatenate([[0], np.cumsum(q)]), np.array(seq), table


# ----------------------------------------------------------------- sizing
# Expected sizes are literal numbers with their derivation, or brute force over every
# batch: never the bounds.* calls the sizing code itself makes.
def test_sizing_chunked_spec_on_the_reporters_config():
    # One 36000-token prefill: 36000 = 4 x 8192 + 3232 -> 5 virtual batches, and every page
    # read once: cdiv(36000, 16) = 2250 pages.
    assert attention_kinds(chunked_spec()) == (Kind.CHUNKED,)
    assert group_capacities(chunked_spec(), REPORTER) == {Kind.CHUNKED: Capacity(5, 2250)}


def test_sizing_full_spec_and_full_spec_carrying_a_chunk():
    assert attention_kinds(full_spec()) == (Kind.GLOBAL,)
    assert group_capacities(full_spec(), REPORTER) == {Kind.GLOBAL: Capacity(1, 2250)}
    # A full spec that carries a chunk (merged mode) counts as chunked AND keeps
    # whole-sequence room for its global layers.
    carried = full_spec(chunk=8192)
    assert attention_kinds(carried) == (Kind.CHUNKED, Kind.GLOBAL)
    assert group_capacities(carried, REPORTER) == {Kind.CHUNKED: Capacity(5, 2250),
                                                   Kind.GLOBAL: Capacity(1, 2250)}


def test_sizing_merged_group():
    merged = merge([chunked_spec(), full_spec()])
    assert attention_kinds(merged) == (Kind.CHUNKED, Kind.GLOBAL)
    caps = group_capacities(merged, EngineLimits(256, 8192, 131072, BS))
    # Global: 256 requests x cdiv(131072, 16) pages.
    assert caps[Kind.GLOBAL] == Capacity(256, 256 * 8192)
    # Chunked: 256 requests each straddling a boundary with 2 tokens = 512 virtual batches
    # (512 tokens); one more batch would cost a whole chunk of 8192 > the 7680 tokens left.
    assert caps[Kind.CHUNKED].batches == 512
    only_chunked = merge([chunked_spec(), chunked_spec()])
    assert attention_kinds(only_chunked) == (Kind.CHUNKED,)


def test_sizing_graph_layouts_widen_capacity():
    """Verify windows of 4 tokens at B = 8, c = 256, bs = 16: two slots per request, the first
    up to c + 3 = 259 keys (17 pages), the second up to c (16 pages): 16 slots, 8 x 33 = 264
    pages, where an eager step of these limits needs only 139 (8 x 16 + 11)."""
    limits = EngineLimits(8, 64, 1000, BS)
    spec = chunked_spec(c=256)
    assert group_capacities(spec, limits)[Kind.CHUNKED] == Capacity(16, 139)
    caps = group_capacities(spec, limits, graph_batch_sizes=(1, 8), query_lens=(1, 4))
    assert caps[Kind.CHUNKED] == Capacity(16, 264)
    # Each slot's page limit is attained: s = 515 straddles 512 with a first slot of
    # 256 + 3 keys (17 pages); s = 768 fills its last chunk (16 pages).  The padded steps of
    # those witnesses fit the capacity without growing (graphs on: growing would raise).
    table = np.arange(8 * 63, dtype=np.int32).reshape(8, 63)
    buffers = MetadataBuffers(caps[Kind.CHUNKED], BS, cuda_graphs=True, verify_rows=32)
    per_slot = []
    for s in (515, 768):
        step, _ = buffers.write_graph_step(np.full(8, s), table, 4, 256, True, 0)
        pages = np.diff(step.paged_kv_indptr.numpy())
        per_slot.append(pages.reshape(8, 2).max(0))
    assert np.maximum(*per_slot).tolist() == [17, 16] == list(slot_page_limits(256, 4, 1000, BS))


def brute_force_maxima(n_max, tokens, model_len, chunk, bs):
    """(virtual batches, local pages, requests, global pages): maxima over every batch."""
    requests = [(q, s) for s in range(1, model_len + 1) for q in range(1, s + 1)]
    best = [0, 0, 0, 0]
    for n in range(1, min(n_max, tokens) + 1):
        for batch in itertools.combinations_with_replacement(requests, n):
            q = np.array([r[0] for r in batch])
            if q.sum() > tokens:
                continue
            s = np.array([r[1] for r in batch])
            table = np.arange(n * model_len).reshape(n, model_len)
            vb = make_virtual_batches(np.concatenate([[0], np.cumsum(q)]), s, table, chunk, bs)
            found = (vb.num_batches, int((-(-vb.seq_lens // bs)).sum()), n,
                     int((-(-s // bs)).sum()))
            best = [max(a, b) for a, b in zip(best, found, strict=True)]
    return best


@pytest.mark.parametrize("n_max, tokens, model_len, chunk, bs", [
    (1, 6, 8, 2, 1), (2, 3, 8, 2, 2), (2, 6, 5, 4, 2), (2, 8, 8, 4, 1), (3, 5, 6, 2, 1),
    (2, 1, 7, 4, 4), (3, 9, 4, 4, 2),
])
def test_step_capacity_is_the_brute_force_maximum(n_max, tokens, model_len, chunk, bs):
    limits = EngineLimits(n_max, tokens, model_len, bs)
    spec = merge([chunked_spec(c=chunk, bs=bs), full_spec(bs=bs)])
    batches, local, reqs, whole = brute_force_maxima(n_max, tokens, model_len, chunk, bs)
    assert group_capacities(spec, limits) == {Kind.CHUNKED: Capacity(batches, local),
                                              Kind.GLOBAL: Capacity(reqs, whole)}


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_every_step_fits_the_capacity(data):
    """Any batch within the limits is written, right, into buffers that may not grow."""
    n_max = data.draw(st.integers(1, 4))
    tokens = data.draw(st.integers(n_max, 300))
    model_len = data.draw(st.integers(1, 400))
    limits = EngineLimits(n_max, tokens, model_len, BS)
    spec = merge([chunked_spec(c=64), full_spec()])
    n = data.draw(st.integers(1, n_max))
    seq = np.array([data.draw(st.integers(1, model_len)) for _ in range(n)])
    q = []
    for i, s in enumerate(seq):  # leave at least one token for each later request
        q.append(data.draw(st.integers(1, min(int(s), tokens - sum(q) - (n - 1 - i)))))
    qsl = np.concatenate([[0], np.cumsum(q)])
    table = np.arange(n * (-(-model_len // BS))).reshape(n, -1) + 1
    for kind, cap in group_capacities(spec, limits).items():
        buffers = MetadataBuffers(cap, BS, cuda_graphs=True)  # CapacityError if it overflows
        chunk = 64 if kind is Kind.CHUNKED else None
        step = write_step(buffers, qsl, seq, table, np.diff(qsl), chunk)
        assert step.num_batches <= cap.batches and step.num_pages <= cap.pages
        got = keys_from_metadata(step.qo_indptr.numpy(), step.paged_kv_indptr.numpy(),
                                 step.paged_kv_last_page_len.numpy(),
                                 step.paged_kv_indices.numpy(), BS)
        assert got == keys_expected(qsl, seq, table, chunk, BS)


# ------------------------------------------------------- capacity backstop
def reporter_step(buffers):
    return write_step(buffers, np.array([0, 36000]), np.array([36000]),
                      np.arange(2250)[None, :], np.array([36000]), 8192)


def test_capacity_backstop_grows_without_graphs(caplog):
    buffers = MetadataBuffers(Capacity(1, 512), BS, cuda_graphs=False, name="tiny")
    with caplog.at_level(logging.WARNING, logger="chunklocal.backends.flashinfer.buffers"):
        step = reporter_step(buffers)
        reporter_step(buffers)
    assert step.num_batches == 5 and step.num_pages == 2250
    assert buffers.capacity.batches >= 5 and buffers.capacity.pages >= 2250
    assert sum("growing" in r.message for r in caplog.records) == 1


def test_capacity_backstop_raises_with_graphs_and_keeps_buffers():
    buffers = MetadataBuffers(Capacity(1, 512), BS, cuda_graphs=True, name="tiny")
    before = {n: t.data_ptr() for n, t in buffers.gpu.items()}
    with pytest.raises(CapacityError) as err:
        reporter_step(buffers)
    assert err.value.buffer == "tiny.paged_kv_indptr"
    assert (err.value.bound, err.value.observed) == (2, 6)
    assert "2" in str(err.value) and "6" in str(err.value)
    # Enough slots but too few pages: the second check (page count known) fires.
    buffers = MetadataBuffers(Capacity(5, 512), BS, cuda_graphs=True, name="tiny")
    before = {n: t.data_ptr() for n, t in buffers.gpu.items()}
    with pytest.raises(CapacityError) as err:
        reporter_step(buffers)
    assert (err.value.buffer, err.value.bound, err.value.observed) == (
        "tiny.paged_kv_indices", 512, 2250)
    assert {n: t.data_ptr() for n, t in buffers.gpu.items()} == before


def test_reporter_config_reproduces_max_num_seqs_failure_and_passes_with_bounds():
    pages = np.array([512, 512, 512, 512, 202])  # 36000 tokens, c = 8192, bs = 16
    vllm_sized = np.zeros(REPORTER.max_num_seqs + 1, dtype=np.int32)
    # numpy < 2.x: "provided out is the wrong size for the accumulation";
    # numpy 2.4: "non-broadcastable output operand with shape (1,) ...".
    with pytest.raises(ValueError, match="wrong size for the accumulation|non-broadcastable"):
        np.cumsum(pages, out=vllm_sized[1:len(pages) + 1])
    caps = group_capacities(chunked_spec(), REPORTER)
    buffers = MetadataBuffers(caps[Kind.CHUNKED], BS, cuda_graphs=True)
    step = reporter_step(buffers)
    assert step.paged_kv_indptr.tolist() == [0, 512, 1024, 1536, 2048, 2250]
    assert step.paged_kv_last_page_len.tolist() == [16, 16, 16, 16, 36000 - 35984]
    assert step.qo_indptr.tolist() == [0, 8192, 16384, 24576, 32768, 36000]
    assert step.paged_kv_indices.tolist() == list(range(2250))


# ------------------------------------------------------ values vs oracle
@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from([None, 32, 64]), st.booleans())
def test_eager_step_matches_chunk_rule(data, chunk, decode_only):
    qsl, seq, table = data.draw(random_batch(q_max=1 if decode_only else 150))
    buffers = MetadataBuffers(Capacity(1, 1), BS)  # grows: eager mode
    step = write_step(buffers, qsl, seq, table, np.diff(qsl), chunk)
    got = keys_from_metadata(step.qo_indptr.numpy(), step.paged_kv_indptr.numpy(),
                             step.paged_kv_last_page_len.numpy(),
                             step.paged_kv_indices.numpy(), BS)
    assert got == keys_expected(qsl, seq, table, chunk, BS)
    assert (step.paged_kv_last_page_len.numpy() >= 1).all()
    assert (step.paged_kv_last_page_len.numpy() <= BS).all()


def graph_rows(step, mask, query_len, batch, two_slots):
    """Per real query row, the keys of the slot it reads (verify picks by mask)."""
    rows = keys_from_metadata(step.qo_indptr.numpy(), step.paged_kv_indptr.numpy(),
                              step.paged_kv_last_page_len.numpy(),
                              step.paged_kv_indices.numpy(), BS)
    if not two_slots:
        return rows
    pairs = np.array(rows, dtype=object).reshape(batch, 2, query_len)
    pick = mask.reshape(batch, query_len)
    return [pairs[r, 0 if pick[r, i] else 1, i] for r in range(batch) for i in range(query_len)]


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from([None, 32, 64]), st.sampled_from([1, 2, 4]))
def test_graph_step_matches_chunk_rule(data, chunk, query_len):
    batch = data.draw(st.integers(1, 5))
    real = data.draw(st.integers(0, batch))
    model_len = 300
    seq = np.zeros(batch, np.int64)
    seq[:real] = [data.draw(st.integers(query_len, model_len)) for _ in range(real)]
    width = -(-model_len // BS)
    table = np.arange(1, batch * width + 1).reshape(batch, width)[::-1].copy()
    two_slots = bool(chunk) and query_len > 1
    buffers = MetadataBuffers(Capacity(2 * batch, 2 * batch * width), BS, cuda_graphs=True,
                              verify_rows=batch * query_len)
    step, mask = buffers.write_graph_step(seq, table, query_len, chunk, two_slots, 0)
    got = graph_rows(step, mask, query_len, batch, two_slots)
    qsl = np.arange(real + 1) * query_len
    expected = keys_expected(qsl, seq[:real], table[:real], chunk, BS)
    assert got[: real * query_len] == expected
    # Padding rows read only the scratch page (0).
    for keys in got[real * query_len:]:
        assert {k // BS for k in keys} <= {0}


def test_verify_straddling_window_uses_two_slots():
    # c = 32, window of 4 ending at 34: positions 30, 31 | 32, 33.
    buffers = MetadataBuffers(Capacity(2, 8), BS, verify_rows=4)
    table = np.array([[5, 6, 7]])
    step, mask = buffers.write_graph_step(np.array([34]), table, 4, 32, True, 0)
    assert step.paged_kv_indptr.tolist() == [0, 3, 4]
    assert step.paged_kv_last_page_len.tolist() == [2, 2]
    assert step.paged_kv_indices.tolist() == [5, 6, 7, 7]
    assert mask.tolist() == [True, True, False, False]


def test_bad_table_is_refused_before_any_buffer_grows():
    # Five slots overflow a one-slot capacity (which would grow without graphs), and
    # slot 3 reads past a 3-column table: the ValueError must come first, with the
    # buffers, their sizes and their contents untouched.
    buffers = MetadataBuffers(Capacity(1, 512), BS, cuda_graphs=False, name="tiny")
    before = {n: (t.data_ptr(), t.numel(), t.clone()) for n, t in buffers.gpu.items()}
    mirrors = [{n: t.clone() for n, t in m.items()} for m in buffers.host]
    with pytest.raises(ValueError, match="slot 3 reads pages up to column 3 of a 3-column"):
        buffers.write_host([1] * 5, [BS] * 5, [0, 1, 2, 3, 4], [0] * 5,
                           np.zeros((1, 3), dtype=np.int32))
    assert (buffers.capacity.batches, buffers.capacity.pages) == (1, 512)
    for name, (ptr, numel, data) in before.items():
        t = buffers.gpu[name]
        assert (t.data_ptr(), t.numel()) == (ptr, numel) and torch.equal(t, data)
    for saved, m in zip(mirrors, buffers.host, strict=True):
        assert all(torch.equal(saved[n], m[n]) for n in saved)


def test_real_slots_need_real_table_rows_and_columns():
    buffers = MetadataBuffers(Capacity(4, 64), BS, cuda_graphs=False, name="tiny")
    with pytest.raises(ValueError, match="slot 0 reads pages up to column 0 of a 0-column"):
        buffers.write_host([1], [5], [0], [0], np.zeros((1, 0), np.int32))
    with pytest.raises(ValueError, match="slot 1 reads block-table row 2 of a 2-row table"):
        buffers.write_host([1, 1], [5, 5], [0, 0], [0, 2], np.zeros((2, 1), np.int32))
    # A padding slot (row -1) reads the scratch page and needs no table at all.
    step = buffers.write_host([1], [5], [0], [-1], np.zeros((1, 0), np.int32), scratch_page=7)
    assert step.paged_kv_indices.tolist() == [7]


def snapshot_state(buffers):
    return (buffers._next_set, (buffers.capacity.batches, buffers.capacity.pages),
            [{n: t.clone() for n, t in m.items()} for m in buffers.host])


def assert_state_unchanged(buffers, before):
    next_set, capacity, mirrors = before
    assert buffers._next_set == next_set
    assert (buffers.capacity.batches, buffers.capacity.pages) == capacity
    for saved, m in zip(mirrors, buffers.host, strict=True):
        assert all(torch.equal(saved[n], m[n]) for n in saved)


def test_negative_first_page_is_refused_not_read_from_the_end():
    # first_page -1 would index the table's last column (numpy negative indexing).
    buffers = MetadataBuffers(Capacity(4, 16), 2, cuda_graphs=False, name="tiny")
    before = snapshot_state(buffers)
    with pytest.raises(ValueError, match=r"tiny: slot 1 starts at block-table column -1"):
        buffers.write_host([1, 1], [2, 2], [0, -1], [0, 0], np.array([[10, 11, 12]]))
    assert_state_unchanged(buffers, before)
    # A padding slot (row -1) ignores its first_page.
    step = buffers.write_host([1, 1], [2, 2], [0, -1], [0, -1], np.array([[10, 11, 12]]),
                              scratch_page=3)
    assert step.paged_kv_indices.tolist() == [10, 3]


@pytest.mark.parametrize("dtype,value", [(np.int64, 2**32 + 7), (np.int64, 2**31),
                                         (np.int64, -(2**31) - 1), (np.uint32, 2**32 - 1),
                                         (np.uint64, 2**63 + 5)])
def test_page_ids_past_int32_are_refused_not_wrapped(dtype, value):
    # The mirrors hold int32 page ids: a wider id a real slot reads is an error naming
    # the slot and the value (write_host and write_graph_step, which calls it), raised
    # before a mirror is claimed or a buffer grows.
    buffers = MetadataBuffers(Capacity(1, 2), 2, cuda_graphs=False, name="tiny")
    table = np.array([[5, value], [6, 7]], dtype=dtype)
    before = snapshot_state(buffers)
    with pytest.raises(ValueError, match=rf"tiny: slot 0 reads block_table\[0, 1\] = {value}, "
                                         "which does not fit an int32"):
        buffers.write_host([1, 1], [4, 2], [0, 0], [0, 1], table)
    with pytest.raises(ValueError, match=rf"slot 0 reads block_table\[0, 1\] = {value}, "):
        buffers.write_graph_step(np.array([3, 2]), table, 1, 4, False, 0)
    assert_state_unchanged(buffers, before)
    # Only pages a real slot reads count: padding slots and unread columns may hold anything.
    step = buffers.write_host([1, 1], [2, 2], [0, 0], [-1, 1], table, scratch_page=9)
    assert step.paged_kv_indices.tolist() == [9, 6]


def test_cuda_graphs_flag_takes_only_booleans():
    with pytest.raises(ValueError, match="cuda_graphs must be True or False, got 'no'"):
        MetadataBuffers(Capacity(1, 1), BS, cuda_graphs="no")
