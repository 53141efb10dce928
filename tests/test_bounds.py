"""Exact bounds: every closed form equals the true maximum (tight and safe).

Oracle: make_virtual_batches on concrete batches.  Tightness: each witness batch
is within the limits and reaches the closed form exactly (so a closed form
lowered by one fails).  Safety: exhaustive enumeration of small batches and
random batches never exceed it.
"""

from __future__ import annotations

import argparse
import itertools
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunklocal import bounds
from chunklocal.backends.base import EngineLimits
from chunklocal.bounds import closed_forms
from chunklocal.bounds import verify as verify_bounds
from chunklocal.kv_spec import ChunkedLocalAttentionSpec, FullAttentionSpec, merge
from chunklocal.virtual_batches import make_virtual_batches


def measure(queries, seqs, chunk, block_size):
    """(virtual batches, local pages, q_local of each virtual batch) of a concrete batch."""
    queries, seqs = np.asarray(queries, np.int64), np.asarray(seqs, np.int64)
    qsl = np.concatenate([[0], np.cumsum(queries)])
    width = max(int(-(-seqs.max(initial=1) // block_size)), 1)
    vb = make_virtual_batches(qsl, seqs, np.zeros((len(seqs), width), np.int64), chunk,
                              block_size)
    pages = int((-(-vb.seq_lens.astype(np.int64) // block_size)).sum())
    return vb.num_batches, pages, vb.query_lens


def assert_within(queries, seqs, n_max, tokens, model_len):
    assert 1 <= len(queries) <= n_max and sum(queries) <= tokens
    assert all(1 <= q <= s for q, s in zip(queries, seqs, strict=True))
    if model_len is not None:
        assert max(seqs) <= model_len


# (N, T, c, L, bs): the configs and edges (L <= c, T < N, T < 2N, bs not dividing L).
CONFIGS = [
    (1, 36000, 8192, 36000, 16), (256, 8192, 8192, 131072, 16), (4, 100, 16, 10, 4),
    (5, 3, 4, 20, 2), (5, 7, 4, 20, 2), (3, 50, 8, 8, 8), (3, 50, 8, 9, 8), (2, 40, 6, 23, 3),
    (1, 1, 1, 1, 1), (7, 200, 1, 13, 1), (3, 64, 4, None, 2), (2, 9, 3, 1, 3), (8, 19, 5, 17, 5),
]


def test_reporter_config_exact_numbers():
    assert bounds.max_virtual_batches(1, 36000, 8192, 36000) == 5
    assert bounds.max_local_pages(1, 36000, 8192, 36000, 16) == 2250
    assert bounds.published_virtual_batches_bound(1, 36000, 8192) == 7
    sizes = bounds.buffer_sizes(8192, EngineLimits(1, 36000, 36000, 16))
    assert (sizes.num_batches, sizes.indptr_len, sizes.num_pages) == (5, 6, 2250)
    assert bounds.max_virtual_batches(256, 8192, 8192, 131072) == 512
    assert bounds.published_virtual_batches_bound(256, 8192, 8192) == 513


@pytest.mark.parametrize("n_max,tokens,chunk,model_len,block_size", CONFIGS)
def test_witnesses_reach_bounds_exactly(n_max, tokens, chunk, model_len, block_size):
    bound = bounds.max_virtual_batches(n_max, tokens, chunk, model_len)
    queries, seqs = bounds.witness_virtual_batches(n_max, tokens, chunk, model_len)
    assert_within(queries, seqs, n_max, tokens, model_len)
    reached = measure(queries, seqs, chunk, block_size)[0]
    assert reached == bound and reached > bound - 1

    bound = bounds.max_local_pages(n_max, tokens, chunk, model_len, block_size)
    queries, seqs = bounds.witness_local_pages(n_max, tokens, chunk, model_len, block_size)
    assert_within(queries, seqs, n_max, tokens, model_len)
    assert measure(queries, seqs, chunk, block_size)[1] == bound

    if model_len is not None:
        bound = bounds.max_global_pages(n_max, tokens, model_len, block_size)
        queries, seqs = bounds.witness_global_pages(n_max, tokens, model_len, block_size)
        assert_within(queries, seqs, n_max, tokens, model_len)
        assert sum(-(-s // block_size) for s in seqs) == bound
        assert bounds.max_group_pages(n_max, tokens, chunk, model_len, block_size) == max(
            bound, bounds.max_local_pages(n_max, tokens, chunk, model_len, block_size))


def _exhaustive_maxima(chunk, model_len, block_size, max_n, max_t):
    """Max batches/pages over every multiset of <= max_n requests, by make_virtual_batches."""
    kinds = [(q, s) for s in range(1, model_len + 1) for q in range(1, min(s, max_t) + 1)]
    vb = make_virtual_batches(np.concatenate([[0], np.cumsum([q for q, _ in kinds])]),
                              np.array([s for _, s in kinds]),
                              np.zeros((len(kinds), -(-model_len // block_size)), np.int64), chunk,
                              block_size)
    per_batches = np.bincount(vb.request, minlength=len(kinds))
    per_pages = np.bincount(vb.request, weights=-(-vb.seq_lens // block_size),
                            minlength=len(kinds))
    q_of = np.array([q for q, _ in kinds])
    best = {}
    for size in range(1, max_n + 1):
        combos = np.array(list(itertools.combinations_with_replacement(range(len(kinds)),
                                                                       size)))
        used, batches, pages = (q_of[combos].sum(1), per_batches[combos].sum(1),
                                per_pages[combos].sum(1))
        for tokens in range(1, max_t + 1):
            fits = used <= tokens
            for n in range(size, max_n + 1):
                old = best.get((n, tokens), (0, 0))
                best[(n, tokens)] = (max(old[0], int(batches[fits].max(initial=0))),
                                     max(old[1], int(pages[fits].max(initial=0))))
    return best


@pytest.mark.parametrize("chunk,block_size", [(1, 1), (2, 1), (2, 2), (3, 1), (4, 2), (4, 4)])
@pytest.mark.parametrize("model_len", [1, 2, 3, 5, 8, 9])
def test_closed_forms_equal_exhaustive_maximum(chunk, block_size, model_len):
    max_n, max_t = 3, 9
    best = _exhaustive_maxima(chunk, model_len, block_size, max_n, max_t)
    knapsack = verify_bounds.request_tables(chunk, model_len, block_size, min(model_len, max_t))
    dp_batches = verify_bounds.combine(knapsack["batches"], max_n, max_t)
    dp_pages = verify_bounds.combine(knapsack["local_pages"], max_n, max_t)
    for (n, tokens), (batches, pages) in best.items():
        assert bounds.max_virtual_batches(n, tokens, chunk, model_len) == batches
        assert bounds.max_local_pages(n, tokens, chunk, model_len, block_size) == pages
        assert (dp_batches[n, tokens], dp_pages[n, tokens]) == (batches, pages)


def test_small_sweep_has_no_violations():
    total = verify_bounds.sweep(6, 48, [1, 2, 3, 4, 6, 8], workers=1, progress=False)
    assert total["configs"] > 50_000
    assert verify_bounds.violations(total) == 0
    assert total["batches_published_unsafe"] == 0 and total["local_pages_published_unsafe"] == 0
    assert total["batches_tighter"] > 0


@st.composite
def limits_and_batch(draw, big=False):
    chunk = draw(st.sampled_from([1024, 8192]) if big else st.integers(1, 16))
    block_size = draw(st.sampled_from([b for b in range(1, min(chunk, 16) + 1) if chunk % b == 0]))
    n_max = draw(st.integers(1, 8))
    tokens = draw(st.integers(1, 40000 if big else 80))
    model_len = draw(st.integers(1, 70000 if big else 90))
    n = draw(st.integers(1, min(n_max, tokens)))
    queries, seqs, left = [], [], tokens
    for i in range(n):
        q = draw(st.integers(1, min(model_len, left - (n - 1 - i))))
        left -= q
        queries.append(q)
        seqs.append(draw(st.integers(q, model_len)))
    return (n_max, tokens, chunk, model_len, block_size), queries, seqs


@settings(max_examples=300, deadline=None)
@given(limits_and_batch())
def test_random_batches_never_exceed_bounds(case):
    (n_max, tokens, chunk, model_len, block_size), queries, seqs = case
    batches, pages, _ = measure(queries, seqs, chunk, block_size)
    assert batches <= bounds.max_virtual_batches(n_max, tokens, chunk, model_len)
    assert batches <= bounds.published_virtual_batches_bound(n_max, tokens, chunk)
    assert pages <= bounds.max_local_pages(n_max, tokens, chunk, model_len, block_size)
    global_pages = sum(-(-s // block_size) for s in seqs)
    assert global_pages <= bounds.max_global_pages(n_max, tokens, model_len, block_size)
    assert max(pages, global_pages) <= bounds.max_group_pages(n_max, tokens, chunk, model_len,
                                                              block_size)


@settings(max_examples=40, deadline=None)
@given(limits_and_batch(big=True))
def test_random_large_batches_never_exceed_bounds(case):
    (n_max, tokens, chunk, model_len, block_size), queries, seqs = case
    batches, pages, _ = measure(queries, seqs, chunk, block_size)
    assert batches <= bounds.max_virtual_batches(n_max, tokens, chunk, model_len)
    assert pages <= bounds.max_local_pages(n_max, tokens, chunk, model_len, block_size)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.integers(1, 3000), st.integers(1, 64), st.integers(1, 5000),
       st.sampled_from([1, 2, 4, 8]))
def test_vectorised_formulas_match_public_functions(n_max, tokens, chunk, model_len, block_size):
    chunk *= block_size
    grid = np.array([[n_max]]), np.array([[tokens]])
    assert closed_forms._virtual_batches_formula(*grid, chunk, model_len)[0, 0] == \
        bounds.max_virtual_batches(n_max, tokens, chunk, model_len)
    assert closed_forms._local_pages_formula(*grid, chunk, model_len, block_size)[0, 0] == \
        bounds.max_local_pages(n_max, tokens, chunk, model_len, block_size)
    # No L means L never binds: the same as any L >= T + c.
    assert bounds.max_virtual_batches(n_max, tokens, chunk) == \
        bounds.max_virtual_batches(n_max, tokens, chunk, tokens + chunk)
    assert bounds.max_local_pages(n_max, tokens, chunk, None, block_size) == \
        bounds.max_local_pages(n_max, tokens, chunk, tokens + chunk, block_size)


def test_without_chunking_sizes_are_plain():
    assert bounds.max_virtual_batches(256, 8192, None, 131072) == 256
    assert bounds.max_virtual_batches(256, 100, None, 131072) == 100
    assert bounds.max_local_pages(256, 8192, None, 131072, 16) == 256 * 8192
    assert bounds.max_verify_batches(256, 3, None, 131072) == 256
    assert bounds.max_verify_batches_of_length(256, 3, None, 4, 131072) == 256
    assert bounds.max_verify_batches_of_length(256, 3, None, 2, 131072) == 0
    assert bounds.max_uniform_verify_batches(256, 3, None, 131072) == 256
    limits = EngineLimits(256, 8192, 131072, 16)
    spec = FullAttentionSpec(16, 8, 128, torch.bfloat16)
    sizes = bounds.buffer_sizes(spec, limits)
    assert (sizes.indptr_len, sizes.last_page_len_len, sizes.num_pages) == (257, 256, 2097152)
    assert bounds.buffer_sizes(None, limits) == sizes


def test_buffer_sizes_for_local_and_merged_specs():
    limits = EngineLimits(1, 36000, 36000, 16)
    local = ChunkedLocalAttentionSpec(16, 8, 128, torch.bfloat16, attention_chunk_size=8192)
    merged = merge([local, FullAttentionSpec(16, 8, 128, torch.bfloat16)])
    local_sizes = bounds.buffer_sizes(local, limits, num_draft_tokens=3)
    assert (local_sizes.indptr_len, local_sizes.num_pages, local_sizes.global_pages) == (6, 2250, 0)
    assert (local_sizes.verify_batches, local_sizes.uniform_verify_batches) == (2, 2)
    merged_sizes = bounds.buffer_sizes(merged, limits)
    assert (merged_sizes.indptr_len, merged_sizes.global_pages) == (6, 2250)
    big = EngineLimits(256, 8192, 131072, 16)
    sizes = bounds.buffer_sizes(merge([local, FullAttentionSpec(16, 8, 128, torch.bfloat16)]), big)
    assert (sizes.indptr_len, sizes.local_pages, sizes.num_pages) == (513, 131808, 2097152)


def test_verify_counts_for_llama4_chunk():
    # q = k + 1 <= c: a window across a boundary gives two pieces per request; for odd k
    # they can be equal halves, so the uniform-decode count doubles too.
    args = dict(max_model_len=131072, max_num_batched_tokens=8192)
    for k, uniform in [(0, 256), (1, 512), (2, 256), (3, 512), (4, 256), (7, 512)]:
        expected = 256 if k == 0 else 512
        assert bounds.max_verify_batches(256, k, 8192, **args) == expected
        assert bounds.max_uniform_verify_batches(256, k, 8192, **args) == uniform
    assert bounds.max_verify_batches(4, 3, 8192, max_model_len=8192) == 4  # L <= c: no split
    assert bounds.max_verify_batches_of_length(4, 3, 8192, 2, 131072) == 8
    assert bounds.max_verify_batches_of_length(4, 3, 8192, 5, 131072) == 0


def test_verify_without_model_len_is_unbounded_model_len():
    for chunk, k in itertools.product([1, 2, 3, 7, 16], range(0, 40)):
        huge = 10 * (k + chunk)
        assert bounds.max_verify_batches(3, k, chunk) == \
            bounds.max_verify_batches(3, k, chunk, huge)
        assert bounds.max_uniform_verify_batches(3, k, chunk) == \
            bounds.max_uniform_verify_batches(3, k, chunk, huge)
        for ell in range(1, k + 2):
            assert bounds.max_verify_batches_of_length(3, k, chunk, ell) == \
                bounds.max_verify_batches_of_length(3, k, chunk, ell, huge)


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 5, 8])
def test_verify_counts_equal_every_placement(chunk):
    """Every start position of one request, split by make_virtual_batches."""
    for model_len in sorted({1, 2, chunk, chunk + 1, chunk + 2, 2 * chunk + 1, 3 * chunk + 3}):
        for k in range(0, min(3 * chunk + 2, model_len - 1) + 1):
            q = k + 1
            seqs = np.arange(q, model_len + 1)
            vb = make_virtual_batches(np.arange(len(seqs) + 1) * q, seqs,
                                      np.zeros((len(seqs), model_len), np.int64), chunk, 1)
            lengths = vb.query_lens
            pieces = np.bincount(vb.request, minlength=len(seqs))
            n_max = 3
            assert bounds.max_verify_batches(n_max, k, chunk, model_len) == n_max * pieces.max()
            best_uniform = 0
            for ell in range(1, q + 1):
                per = np.bincount(vb.request[lengths == ell], minlength=len(seqs)).max()
                best_uniform = max(best_uniform, per)
                assert bounds.max_verify_batches_of_length(n_max, k, chunk, ell,
                                                           model_len) == n_max * per
                wq, ws = bounds.witness_verify_batches_of_length(n_max, k, chunk, ell, model_len)
                if per:
                    assert int((measure(wq, ws, chunk, 1)[2] == ell).sum()) == n_max * per
            assert bounds.max_uniform_verify_batches(n_max, k, chunk,
                                                     model_len) == n_max * best_uniform
            wq, ws = bounds.witness_uniform_verify_batches(n_max, k, chunk, model_len)
            assert np.bincount(measure(wq, ws, chunk, 1)[2]).max() == n_max * best_uniform
            wq, ws = bounds.witness_verify_batches(n_max, k, chunk, model_len)
            assert_within(wq, ws, n_max, n_max * q, model_len)
            assert measure(wq, ws, chunk, 1)[0] == n_max * pieces.max()


@pytest.mark.parametrize("call,fragment", [
    (lambda: bounds.max_virtual_batches(0, 10, 4, 10), "max_num_seqs"),
    (lambda: bounds.max_virtual_batches(1, -1, 4, 10), "max_num_batched_tokens"),
    (lambda: bounds.max_virtual_batches(1, 10, 4.0, 10), "chunk_size"),
    (lambda: bounds.max_virtual_batches(True, 10, 4, 10), "max_num_seqs"),
    (lambda: bounds.max_virtual_batches(1, 10, 4, 0), "max_model_len"),
    (lambda: bounds.max_local_pages(1, 10, 12, 10, 8), "not a multiple of block_size 8"),
    (lambda: bounds.max_local_pages(1, 10, 8, 10, 0), "block_size"),
    (lambda: bounds.max_local_pages(1, 10, None, None, 8), "max_model_len"),
    (lambda: bounds.max_verify_batches(1, -1, 8), "num_draft_tokens"),
    (lambda: bounds.max_verify_batches(1, 9, 8, max_model_len=9), "max_model_len 9"),
    (lambda: bounds.max_verify_batches(1, 9, 8, max_num_batched_tokens=5), "tokens 5"),
    (lambda: bounds.max_verify_batches_of_length(1, 3, 8, 0), "query_len"),
])
def test_bad_arguments_raise_value_error_naming_them(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()


def test_cli_small_sweep_and_plot(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    verify_bounds.add_arguments(parser)
    png = tmp_path / "bounds.png"
    args = parser.parse_args(["--max-n", "3", "--max-t", "20", "--chunks", "1-3,5",
                              "--workers", "1", "--quiet", "--plot", str(png)])
    assert verify_bounds.main(args) == 0
    out = capsys.readouterr().out
    assert "violations (closed form != brute-force maximum): 0" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="want '1-16'"):
        verify_bounds.parse_int_list("1-x")


def _exact_by_python_ints(n_max, tokens, chunk, model_len, block_size):
    """The closed forms of bounds.py written out in Python ints (no numpy, no wrap-around)."""
    n = min(n_max, tokens)
    k = (model_len - 1) // chunk
    first = min(n, tokens - n) if k >= 1 else 0
    batches = n + first + min((tokens - n - first) // chunk, first * max(k - 1, 0))
    seq_pages = -(-model_len // block_size)
    base = min(chunk // block_size, seq_pages)
    cap = seq_pages - base
    first = min(n, tokens - n) if cap >= 1 else 0
    local = n * base + first + min((tokens - n - first) // block_size, first * max(cap - 1, 0))
    return batches, local, n * seq_pages


@pytest.mark.parametrize("n_max,tokens,chunk,model_len,block_size", [
    (2**33, 2**62, 1, 2**62, 1),       # reviewer's case: numpy int64 wrapped to 0
    (2**20, 2**62, 2**10, 2**62, 1),
    (2**32, 2**32, 2**20, 2**40, 1),    # global pages 2**72: past int64
    (2**70, 2**80, 2**30, 2**90, 2**4),  # every input past int64
    (3, 2**64 + 7, 8, 2**64, 4),
])
def test_huge_limits_are_exact_python_ints(n_max, tokens, chunk, model_len, block_size):
    batches, local, glob = _exact_by_python_ints(n_max, tokens, chunk, model_len, block_size)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy overflow warning either
        got = (bounds.max_virtual_batches(n_max, tokens, chunk, model_len),
               bounds.max_local_pages(n_max, tokens, chunk, model_len, block_size),
               bounds.max_global_pages(n_max, tokens, model_len, block_size),
               bounds.max_local_pages(n_max, tokens, None, model_len, block_size))
    assert got == (batches, local, glob, glob)
    assert all(type(x) is int for x in got)
    assert bounds.max_virtual_batches(2**33, 2**62, 1, 2**62) == 4611686018427387904
    assert bounds.max_global_pages(2**32, 2**32, 2**40, 1) == 2**72
    # numpy integer inputs take the same exact path
    assert bounds.max_virtual_batches(np.int64(2**33), np.int64(2**62), np.int64(1),
                                      np.int64(2**62)) == 4611686018427387904
    sizes = bounds.buffer_sizes(chunk, EngineLimits(n_max, tokens, model_len, block_size))
    assert (sizes.num_batches, sizes.local_pages, sizes.global_pages) == (batches, local, 0)


@pytest.mark.parametrize("spec_or_chunk", [8.0, "8", [8], object()])
def test_buffer_sizes_rejects_what_is_not_a_spec_or_chunk(spec_or_chunk):
    with pytest.raises(ValueError, match=r"spec_or_chunk must be a KV spec.*got"):
        bounds.buffer_sizes(spec_or_chunk, EngineLimits(2, 100, 64, 4))


def test_max_group_pages_flag_takes_only_booleans():
    with pytest.raises(ValueError, match="has_global_layers must be True or False, got 'no'"):
        bounds.max_group_pages(4, 64, 16, 256, 4, has_global_layers="no")
    assert bounds.max_group_pages(4, 64, 16, 256, 4, has_global_layers=np.bool_(False)) == \
        bounds.max_local_pages(4, 64, 16, 256, 4)


@given(st.integers(1, 20_000), st.data())
@settings(max_examples=300, deadline=None)
def test_piecewise_buckets_pad_a_step_by_less_than_an_eighth(max_tokens, data):
    """bounds.sizing.piecewise_buckets: every step size up to max_tokens has a bucket, the
    largest is max_tokens itself, and the padding stays under 16 rows up to 128 tokens and
    under T / 8 beyond (the docstring's bound, which a coarser spacing breaks)."""
    from chunklocal.bounds.sizing import piecewise_buckets

    buckets = piecewise_buckets(max_tokens)
    assert buckets[-1] == max_tokens and list(buckets) == sorted(set(buckets))
    tokens = data.draw(st.integers(1, max_tokens))
    bucket = next(b for b in buckets if b >= tokens)
    assert bucket - tokens < (16 if tokens <= 128 else tokens / 8), (tokens, bucket)
    assert len(buckets) <= 8 + 8 * max(0, (max_tokens // 128).bit_length())


def test_piecewise_buckets_refuse_no_tokens():
    from chunklocal.bounds.sizing import piecewise_buckets

    with pytest.raises(ValueError, match="max_tokens must be at least 1, got 0"):
        piecewise_buckets(0)
