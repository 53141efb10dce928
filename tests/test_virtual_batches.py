"""make_virtual_batches: published cases, a per-token brute-force oracle, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import token_split_oracle

from chunklocal import VirtualBatches, make_virtual_batches
from chunklocal.virtual_batches import validate_batch


def consecutive_table(seq_lens, block_size):
    """The published cases' table: request i owns ids i*W .. i*W + W - 1."""
    width = -(-max(seq_lens) // block_size)
    return np.arange(len(seq_lens) * width).reshape(len(seq_lens), width)


def qsl_of(query_lens, start=0):
    return np.concatenate([[start], start + np.cumsum(query_lens)]).astype(np.int64)


# (q, s, c, bs, q_local, k_local, tables): vLLM's published cases, numbers from the issue.
PUBLISHED = [
    ([4, 10, 5], [6, 17, 9], 4, 2, [2, 2, 1, 4, 4, 1, 4, 1], [4, 2, 4, 4, 4, 1, 4, 1],
     [[0, 1], [2, 3], [11, 12], [13, 14], [15, 16], [17, 17], [20, 21], [22, 23]]),
    ([8], [12], 4, 2, [4, 4], [4, 4], [[2, 3], [4, 5]]),
    ([7], [10], 4, 2, [1, 4, 2], [4, 4, 2], [[0, 1], [2, 3], [4, 4]]),
    ([4], [6], 10, 2, [4], [6], [[0, 1, 2, 2, 2]]),
    ([6, 6], [8, 8], 4, 4, [2, 4, 2, 4], [4, 4, 4, 4], [[0], [1], [2], [3]]),
    ([1], [5], 4, 2, [1], [1], [[2, 2]]),
]


@pytest.mark.parametrize("q,s,c,bs,q_local,k_local,tables", PUBLISHED)
def test_published_cases(q, s, c, bs, q_local, k_local, tables):
    vb = make_virtual_batches(qsl_of(q), s, consecutive_table(s, bs), c, bs)
    assert isinstance(vb, VirtualBatches)
    assert vb.num_batches == len(q_local)
    np.testing.assert_array_equal(vb.query_start_loc, qsl_of(q_local))
    np.testing.assert_array_equal(vb.query_lens, q_local)
    np.testing.assert_array_equal(vb.seq_lens, k_local)
    np.testing.assert_array_equal(vb.block_table, tables)
    for name in ("query_start_loc", "seq_lens", "block_table", "kv_start", "request"):
        assert getattr(vb, name).dtype == np.int32, name


def test_first_published_case_kv_start_and_request():
    # Request 0: context 2 -> chunks 0, 1; request 1: context 7 -> chunks 1..4;
    # request 2: context 4 -> chunks 1, 2 (c = 4).
    vb = make_virtual_batches(qsl_of([4, 10, 5]), [6, 17, 9],
                              consecutive_table([6, 17, 9], 2), 4, 2)
    np.testing.assert_array_equal(vb.kv_start, [0, 4, 4, 8, 12, 16, 4, 8])
    np.testing.assert_array_equal(vb.request, [0, 0, 1, 1, 1, 1, 2, 2])
    # The vLLM code comment's example line is wrong; the prefix sum is this.
    np.testing.assert_array_equal(vb.query_start_loc, [0, 2, 4, 5, 9, 13, 14, 18, 19])


def check_against_token_oracle(qsl, seq, table, chunk, block):
    vb = make_virtual_batches(qsl, seq, table, chunk, block)
    expected = token_split_oracle(qsl, seq, table, chunk, block)
    vqsl = vb.query_start_loc.astype(np.int64)
    assert vb.num_batches == len(vb.seq_lens) == len(vb.kv_start) == len(vb.request)
    assert vb.block_table.shape == (vb.num_batches, chunk // block)
    assert vqsl[0] == qsl[0] and vqsl[-1] == qsl[-1]
    assert (np.diff(vqsl) >= 1).all(), "every virtual batch holds a query"
    covered = []
    for m in range(vb.num_batches):
        q_local, k_local = int(vqsl[m + 1] - vqsl[m]), int(vb.seq_lens[m])
        for j, row in enumerate(range(int(vqsl[m]), int(vqsl[m + 1]))):
            want = expected[row - int(qsl[0])]
            assert want["row"] == row
            assert vb.request[m] == want["request"]
            assert vb.kv_start[m] == want["kv_start"]
            assert vb.kv_start[m] + k_local == want["kv_end"]
            # Bottom-right aligned causal inside the virtual batch puts query j here:
            assert vb.kv_start[m] + k_local - q_local + j == want["position"]
            assert vb.block_table[m].tolist() == want["pages"]
            covered.append(row)
        if m:  # one virtual batch per (request, chunk), in request then chunk order
            assert (vb.request[m - 1], vb.kv_start[m - 1]) < (vb.request[m], vb.kv_start[m])
    assert covered == [w["row"] for w in expected]
    return vb


@st.composite
def batches(draw, max_requests=6):
    block = draw(st.sampled_from([1, 2, 4, 8, 16]))
    chunk = block * draw(st.integers(1, 6))
    n = draw(st.integers(0, max_requests))
    seq, query = [], []
    for _ in range(n):
        kind = draw(st.sampled_from(["any", "boundary", "pad", "decode"]))
        if kind == "boundary":  # context or end exactly on a chunk boundary (+-1)
            context = chunk * draw(st.integers(0, 4)) + draw(st.sampled_from([-1, 0, 1]))
            context = max(context, 0)
            q = draw(st.sampled_from([1, chunk - 1, chunk, chunk + 1, 2 * chunk]))
            q = max(q, 1)
        else:
            context = draw(st.integers(0, 5 * chunk))
            q = {"any": draw(st.integers(0, 3 * chunk + 2)), "pad": 0, "decode": 1}[kind]
        seq.append(context + q)
        query.append(q)
    width = max([-(-s // block) for s in seq] + [0]) + draw(st.integers(0, 2))
    pages = draw(st.permutations(range(n * width))) if n * width else []
    table = np.asarray(pages, dtype=np.int64).reshape(n, width)
    start = draw(st.integers(0, 3))
    return qsl_of(query, start), np.asarray(seq, dtype=np.int64), table, chunk, block


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_matches_per_token_oracle(batch):
    check_against_token_oracle(*batch)


def test_padding_requests_produce_nothing():
    qsl, seq = qsl_of([0, 3, 0, 2]), np.array([5, 3, 0, 9])
    vb = check_against_token_oracle(qsl, seq, consecutive_table(seq, 2), 4, 2)
    np.testing.assert_array_equal(vb.request, [1, 3, 3])
    np.testing.assert_array_equal(vb.seq_lens, [3, 4, 1])
    empty = make_virtual_batches([0, 0, 0], [0, 7], Z(2, 4), 4, 2)
    assert empty.num_batches == 0 and empty.query_start_loc.tolist() == [0]
    assert empty.block_table.shape == (0, 2)


def test_exact_chunk_boundaries():
    # Prefill ending exactly on a boundary, then the decode that opens the next chunk.
    vb = check_against_token_oracle(qsl_of([8, 1]), np.array([8, 9]),
                                    consecutive_table([8, 9], 2), 4, 2)
    np.testing.assert_array_equal(vb.query_lens, [4, 4, 1])
    np.testing.assert_array_equal(vb.seq_lens, [4, 4, 1])
    np.testing.assert_array_equal(vb.kv_start, [0, 4, 8])
    # A prefill whose context ends exactly on a boundary starts a fresh chunk.
    vb = check_against_token_oracle(qsl_of([3]), np.array([11]), consecutive_table([11], 2), 4, 2)
    np.testing.assert_array_equal(vb.query_lens, [3])
    np.testing.assert_array_equal(vb.seq_lens, [3])


@pytest.mark.parametrize("chunk,expected_batches", [(4, 3), (8, 2), (16, 1), (64, 1)])
def test_chunk_smaller_and_larger_than_sequence(chunk, expected_batches):
    seq = np.array([12])
    vb = check_against_token_oracle(qsl_of([12]), seq, consecutive_table(seq, 4), chunk, 4)
    assert vb.num_batches == expected_batches


NUMPY_INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
TORCH_INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16,
              torch.uint32, torch.uint64]


@pytest.mark.parametrize("dtype", NUMPY_INTS + TORCH_INTS, ids=str)
def test_every_int_dtype_and_torch_inputs(dtype):
    q, s, c, bs, *_ = PUBLISHED[0]
    args = (qsl_of(q), np.array(s), consecutive_table(s, bs))
    want = make_virtual_batches(*args, c, bs)
    if isinstance(dtype, torch.dtype):
        args = tuple(torch.from_numpy(a.astype(np.int64)).to(dtype) for a in args)
    else:
        args = tuple(a.astype(dtype) for a in args)
    got = make_virtual_batches(*args, c, bs)
    for name in ("query_start_loc", "seq_lens", "block_table", "kv_start", "request"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    assert got.num_batches == want.num_batches


def test_python_lists_and_non_contiguous_tensor():
    table = torch.arange(36).reshape(9, 4).T  # [4, 9] with non-unit strides
    vb = make_virtual_batches([0, 4, 14, 19, 20], [6, 17, 9, 2], table[:, :9], 4, 2)
    assert vb.num_batches == 9
    np.testing.assert_array_equal(vb.block_table[0], table[0, :2].numpy())


I32 = 2**31


def Z(*shape):
    return np.zeros(shape, dtype=np.int64)


BAD_INPUTS = [
    # (query_start_loc, seq_lens, block_table, chunk, block, message regex)
    ([-1, 2], [3], Z(1, 2), 4, 2, r"query_start_loc\[0\].*-1"),
    ([0, 3, 2], [3, 3], Z(2, 2), 4, 2, r"request 1.*3 -> 2"),
    ([0, 2, 7], [3, 4], Z(2, 2), 4, 2, r"request 1.*query length 5.*seq_len 4"),
    ([0, 1], [-2], Z(1, 2), 4, 2, r"request 0.*-2"),
    ([0, 1], [3], Z(1, 2), 0, 2, r"chunk_size.*0"),
    ([0, 1], [3], Z(1, 2), -4, 2, r"chunk_size.*-4"),
    ([0, 1], [3], Z(1, 2), 6, 4, r"chunk_size 6.*block_size 4"),
    ([0, 1], [3], Z(1, 2), 4, 0, r"block_size.*0"),
    ([0, 1], [3], Z(1, 2), 4.5, 2, r"chunk_size.*4\.5"),
    ([0, 1, 2], [3, 9], Z(2, 4), 4, 2, r"request 1.*seq_len 9.*5 pages.*4 columns"),
    ([0, 1, 2], [3], Z(1, 2), 4, 2, r"query_start_loc has 3 entries.*1 requests"),
    ([0, 1], [3], Z(2, 2), 4, 2, r"block_table has 2 rows.*1 requests"),
    ([0, 1], [3.0], Z(1, 2), 4, 2, r"seq_lens must hold integers"),
    ([[0, 1]], [3], Z(1, 2), 4, 2, r"query_start_loc must be 1-D"),
    ([0, 1], [3], Z(2), 4, 2, r"block_table must be 2-D"),
    # values that do not fit the int32 outputs / int64 arithmetic: no silent wrap-around
    ([0, 1], [I32 + 5], Z(1, 3), 2**30, 2**30, r"request 0.*2147483653"),
    ([0, 1], [3], np.array([[5, I32]]), 4, 2, r"request 0.*block_table\[0, 1\].*2147483648"),
    ([0, 1], np.array([2**64 - 1], dtype=np.uint64), Z(1, 2), 4, 2,
     r"seq_lens\[0\].*18446744073709551615"),
]


@pytest.mark.parametrize("qsl,seq,table,chunk,block,message", BAD_INPUTS)
def test_bad_input_raises_value_error_and_changes_nothing(qsl, seq, table, chunk, block,
                                                          message):
    before = [np.array(x, copy=True) for x in (qsl, seq, table)]
    with pytest.raises(ValueError, match=message):
        make_virtual_batches(qsl, seq, table, chunk, block)
    for old, new in zip(before, (qsl, seq, table), strict=True):
        np.testing.assert_array_equal(old, np.asarray(new))


def test_docs_picture_example():
    """docs/virtual_batches.md: s=10, q=7, c=4, bs=2, table [7, 3, 9, 1, 4] (worked by hand)."""
    vb = check_against_token_oracle(qsl_of([7]), np.array([10]), np.array([[7, 3, 9, 1, 4]]),
                                    4, 2)
    np.testing.assert_array_equal(vb.query_start_loc, [0, 1, 5, 7])
    np.testing.assert_array_equal(vb.seq_lens, [4, 4, 2])
    np.testing.assert_array_equal(vb.block_table, [[7, 3], [9, 1], [4, 4]])
    np.testing.assert_array_equal(vb.kv_start, [0, 4, 8])
    np.testing.assert_array_equal(vb.request, [0, 0, 0])


@pytest.mark.parametrize("as_tensor", [False, True])
def test_rejected_tensor_inputs_are_unchanged(as_tensor):
    qsl, seq, table = np.array([0, 2, 9]), np.array([3, 5]), np.arange(6).reshape(2, 3)
    args = [torch.from_numpy(a.copy()) if as_tensor else a.copy() for a in (qsl, seq, table)]
    with pytest.raises(ValueError, match=r"request 1: query length 7 exceeds seq_len 5"):
        make_virtual_batches(*args, 4, 2)
    for old, new in zip((qsl, seq, table), args, strict=True):
        np.testing.assert_array_equal(old, np.asarray(new))


def test_device_tensors_are_refused():
    seq = torch.tensor([3], device="meta")
    with pytest.raises(ValueError, match=r"seq_lens must be on the CPU.*meta"):
        make_virtual_batches([0, 1], seq, Z(1, 2), 4, 2)


@pytest.mark.parametrize("value", [2**31, 2**32 + 5, -(2**31) - 1])
def test_page_ids_outside_int32_are_refused_not_wrapped(value):
    # Kernels take int32 page ids: a wider table whose id would wrap is an error
    # naming the request and the entry, in every path that validates a batch.
    table = np.array([[1, 2], [3, value]], dtype=np.int64)
    with pytest.raises(ValueError, match=rf"request 1: block_table\[1, 1\] = {value} "):
        make_virtual_batches([0, 1, 2], [1, 17], table, 32, 16)
    with pytest.raises(ValueError, match=rf"request 1: block_table\[1, 1\] = {value} "):
        validate_batch([0, 1, 2], [1, 17], table, 16)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, torch.int32], ids=str)
def test_negative_page_ids_in_used_columns_are_refused(dtype):
    # A page a request reads (column < cdiv(seq_len, block_size)) must be a page id,
    # in every path that validates a batch (backends, make_virtual_batches).
    def table(rows):
        arr = np.array(rows, dtype=np.int64)
        return torch.from_numpy(arr).to(dtype) if isinstance(dtype, torch.dtype) else \
            arr.astype(dtype)

    with pytest.raises(ValueError, match=r"request 0: block_table\[0, 1\] = -1 is not a page"):
        validate_batch([0, 1], [3], table([[5, -1]]), 2)
    with pytest.raises(ValueError, match=r"request 0: block_table\[0, 0\] = -1 is not a page"):
        make_virtual_batches([0, 1], [2], table([[-1]]), 4, 2)
    # The first offending request is named, with its first negative used column.
    with pytest.raises(ValueError, match=r"request 2: block_table\[2, 1\] = -7 "):
        validate_batch([0, 1, 1, 2], [3, 0, 4], table([[5, 6, -1], [-1, -1, -1],
                                                       [8, -7, -3]]), 2)
    # Unused columns (padding past the pages a request reads) and the rows of
    # seq_len-0 requests may hold anything.
    padded = table([[5, 6, -1], [-1, -1, -1], [7, -1, -1], [1, 2, 3]])
    vb = make_virtual_batches([0, 1, 1, 2, 3], [3, 0, 2, 6], padded, 4, 2)
    np.testing.assert_array_equal(vb.block_table, [[5, 6], [7, -1], [3, 3]])


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_negative_page_check_matches_a_per_entry_rule(data):
    """validate_batch refuses a table iff some column a request reads is negative."""
    n = data.draw(st.integers(1, 4))
    block = data.draw(st.sampled_from([1, 2, 4]))
    width = data.draw(st.integers(1, 4))
    seq = [data.draw(st.integers(0, width * block)) for _ in range(n)]
    table = np.array(data.draw(st.lists(st.lists(st.sampled_from([-3, -1, 0, 2]),
                                                 min_size=width, max_size=width),
                                        min_size=n, max_size=n)), dtype=np.int32)
    bad = [(i, j) for i in range(n) for j in range(-(-seq[i] // block)) if table[i, j] < 0]
    if not bad:
        validate_batch([0] * (n + 1), seq, table, block)
        return
    i, j = bad[0]
    with pytest.raises(ValueError, match=rf"request {i}: block_table\[{i}, {j}\] = "
                                         rf"{table[i, j]} is not a page"):
        validate_batch([0] * (n + 1), seq, table, block)


@pytest.mark.parametrize("args,name", [
    (([0, 1, 2], [2, 2], [[1, 2], [3]]), "block_table"),
    (([0, 1, 2], [2, [2]], [[1], [3]]), "seq_lens"),
])
def test_ragged_inputs_name_the_argument(args, name):
    with pytest.raises(ValueError, match=rf"{name} must be a \d-D int array, got a ragged"):
        make_virtual_batches(*args, 4, 2)


def test_validate_batch_keeps_an_int32_table_without_copying():
    """The FlashInfer backend gathers pages from the table validate_batch returns."""
    table = np.arange(8, dtype=np.int32).reshape(2, 4)
    assert validate_batch([0, 1, 2], [4, 4], table, 2)[2] is table
    tensor = torch.from_numpy(table)
    assert np.shares_memory(validate_batch([0, 1, 2], [4, 4], tensor, 2)[2], table)
