"""reference_attention / paged_causal_attention against the float64 dense-mask oracle."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import dense_chunked_attention

from chunklocal import reference
from chunklocal.reference import paged_causal_attention, reference_attention


@st.composite
def attention_batches(draw):
    block = draw(st.sampled_from([1, 2, 4, 8]))
    chunk = block * draw(st.integers(1, 5))
    n = draw(st.integers(1, 5))
    seq, query = [], []
    for _ in range(n):
        kind = draw(st.sampled_from(["any", "boundary", "pad", "decode"]))
        if kind == "boundary":  # context / end exactly on a chunk boundary (+-1)
            context = max(chunk * draw(st.integers(0, 3)) + draw(st.sampled_from([-1, 0, 1])), 0)
            q = max(draw(st.sampled_from([1, chunk - 1, chunk, chunk + 1, 2 * chunk])), 1)
        else:
            context = draw(st.integers(0, 4 * chunk))
            q = {"any": draw(st.integers(0, 3 * chunk)), "pad": 0, "decode": 1}[kind]
        seq.append(context + q)
        query.append(q)
    width = max(-(-s // block) for s in seq) + draw(st.integers(0, 2))
    spare = draw(st.integers(0, 3))
    num_pages = n * width + spare + 1
    perm = np.asarray(draw(st.permutations(range(num_pages))))
    table = perm[: n * width].reshape(n, width)
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([4, 8]))
    start = draw(st.integers(0, 2))
    qsl = np.concatenate([[start], start + np.cumsum(query)])
    seed = draw(st.integers(0, 2**16))
    return dict(qsl=qsl, seq=np.asarray(seq), table=table, chunk=chunk, block=block,
                shape=(num_pages, kv_heads, group * kv_heads, head_dim), seed=seed,
                extra_rows=draw(st.integers(0, 2)))


def make_tensors(b, dtype=torch.float64):
    num_pages, kv_heads, q_heads, head_dim = b["shape"]
    gen = torch.Generator().manual_seed(b["seed"])
    rows = int(b["qsl"][-1]) + b["extra_rows"]
    q = torch.randn(rows, q_heads, head_dim, generator=gen, dtype=torch.float64)
    cache = (num_pages, b["block"], kv_heads, head_dim)
    k = torch.randn(cache, generator=gen, dtype=torch.float64)
    v = torch.randn(cache, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def check_batch(b, chunked=True):
    q, k, v = make_tensors(b)
    chunk = b["chunk"] if chunked else None
    scale = 0.37
    out = reference_attention(q, k, v, b["qsl"], b["seq"], b["table"], chunk_size=chunk,
                              scale=scale)
    want = dense_chunked_attention(q, k, v, b["qsl"], b["seq"], b["table"], chunk, scale)
    assert out.dtype == torch.float64 and out.shape == q.shape
    torch.testing.assert_close(out, want, atol=1e-10, rtol=0)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(attention_batches())
def test_chunked_matches_dense_oracle(b):
    check_batch(b)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(attention_batches())
def test_causal_matches_dense_oracle(b):
    check_batch(b, chunked=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(attention_batches(), st.integers(1, 5), st.integers(6, 2000))
def test_tiny_tiles_and_groups(b, tile_rows, budget):
    """Many tiles, many groups, padded tiles and keys: same answer."""
    with mock.patch.object(reference, "_TILE_ROWS", tile_rows), \
            mock.patch.object(reference, "_GROUP_BUDGET", budget):
        check_batch(b)


def test_kv_start_offsets_inside_first_page():
    """Keys may start mid-page: position kv_start sits at slot kv_start % block_size."""
    gen = torch.Generator().manual_seed(1)
    block, kv_heads, head_dim = 4, 1, 8
    k = torch.randn(10, block, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(10, block, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    q = torch.randn(3, 2, head_dim, generator=gen, dtype=torch.float64)
    # One row: 5 keys from absolute position 6 on; position 6 is slot 2 of page 7.
    table = np.array([[7, 2, 5]])
    out = paged_causal_attention(q, k, v, [0, 3], [5], table, kv_start=[6])
    # The same keys written by hand to positions 0..4 (pages 0, 1) of a copy.
    k2, v2 = k.clone(), v.clone()
    for j in range(5):
        page, slot = table[0, (2 + j) // block], (2 + j) % block
        k2[j // block, j % block], v2[j // block, j % block] = k[page, slot], v[page, slot]
    want = dense_chunked_attention(q, k2, v2, [0, 3], [5], np.array([[0, 1]]), None, None)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2),
                                        (torch.float16, 4e-3)])
def test_lower_precision_dtypes(dtype, atol):
    b = dict(qsl=np.array([0, 9, 10, 30]), seq=np.array([12, 5, 30]),
             table=np.arange(24).reshape(3, 8)[:, ::-1].copy(), chunk=8, block=4,
             shape=(24, 2, 4, 16), seed=3, extra_rows=0)
    q, k, v = make_tensors(b, dtype)
    out = reference_attention(q, k, v, b["qsl"], b["seq"], b["table"], chunk_size=8)
    assert out.dtype == dtype
    want = dense_chunked_attention(q, k, v, b["qsl"], b["seq"], b["table"], 8)
    torch.testing.assert_close(out.double(), want, atol=atol, rtol=0)


def test_torch_index_inputs_padding_rows_and_untouched_rows():
    b = dict(qsl=np.array([2, 2, 7, 7]), seq=np.array([4, 9, 0]),
             table=np.array([[3, 1, 0], [4, 5, 2], [0, 0, 0]]), chunk=4, block=4,
             shape=(6, 1, 2, 8), seed=5, extra_rows=3)
    q, k, v = make_tensors(b)
    args = [torch.from_numpy(b[x]).to(torch.int32) for x in ("qsl", "seq", "table")]
    out = reference_attention(q, k, v, *args, chunk_size=4)
    want = dense_chunked_attention(q, k, v, b["qsl"], b["seq"], b["table"], 4)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    assert not out[:2].any() and not out[7:].any()


def _good():
    q = torch.zeros(4, 2, 8)
    k = torch.zeros(5, 4, 1, 8)
    return dict(q=q, k_cache=k, v_cache=k.clone(), query_start_loc=[0, 4], seq_lens=[6],
                block_table=np.array([[1, 2]]))


@pytest.mark.parametrize("change,message", [
    (dict(q=torch.zeros(4, 16)), r"q must be \[tokens"),
    (dict(k_cache=torch.zeros(5, 4, 8)), r"k_cache must be"),
    (dict(v_cache=torch.zeros(5, 4, 1, 4)), r"v_cache shape"),
    (dict(q=torch.zeros(4, 2, 4)), r"head_dim 4"),
    (dict(q=torch.zeros(4, 3, 8), k_cache=torch.zeros(5, 4, 2, 8),
          v_cache=torch.zeros(5, 4, 2, 8)), r"num_q_heads 3.*num_kv_heads 2"),
    (dict(q=torch.zeros(4, 2, 8, dtype=torch.int32)), r"floating point"),
    (dict(query_start_loc=[0, 5]), r"request 0.*query length 5.*seq_len 6|ends at 5"),
    (dict(query_start_loc=[0, 6], seq_lens=[6]), r"query_start_loc ends at 6.*4 rows"),
    (dict(block_table=np.array([[1, 5]])), r"request 0.*block_table\[0, 1\] = 5"),
    (dict(block_table=np.array([[-1, 2]])), r"request 0.*block_table\[0, 0\] = -1"),
    (dict(block_table=np.array([[1]])), r"request 0.*seq_len 6.*2 pages.*1 columns"),
])
def test_bad_input(change, message):
    kwargs = {**_good(), **change}
    with pytest.raises(ValueError, match=message):
        reference_attention(**kwargs, chunk_size=4)
    with pytest.raises(ValueError, match=message):
        reference_attention(**kwargs)


def test_kv_start_validation():
    g = _good()
    args = (g["q"], g["k_cache"], g["v_cache"], g["query_start_loc"], g["seq_lens"],
            g["block_table"])
    with pytest.raises(ValueError, match=r"request 0: kv_start -1"):
        paged_causal_attention(*args, kv_start=[-1])
    with pytest.raises(ValueError, match=r"kv_start has 2 entries"):
        paged_causal_attention(*args, kv_start=[0, 0])
    with pytest.raises(ValueError, match=r"request 0: kv_start offset 3.*3 pages"):
        paged_causal_attention(*args, kv_start=[3])


def test_unused_table_entries_may_be_junk():
    """Columns past a row's pages (and clipped repeats) are never dereferenced."""
    b = dict(qsl=np.array([0, 3, 4]), seq=np.array([3, 1]),
             table=np.array([[2, 10**6, -7], [1, 99, 99]]), chunk=4, block=4,
             shape=(3, 1, 1, 8), seed=7, extra_rows=0)
    q, k, v = make_tensors(b)
    out = reference_attention(q, k, v, b["qsl"], b["seq"], b["table"], chunk_size=4)
    want = dense_chunked_attention(q, k, v, b["qsl"], b["seq"], b["table"], 4)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)


def _record_sdpa(monkeypatch):
    calls = []
    original = reference.F.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        calls.append((q.shape, k.shape))
        return original(q, k, v, **kwargs)

    monkeypatch.setattr(reference.F, "scaled_dot_product_attention", recording)
    return calls


def test_many_requests_do_not_mean_many_kernel_calls(monkeypatch):
    """Vectorised over rows: 200 decodes are one batched call, not 200."""
    calls = _record_sdpa(monkeypatch)
    n = 200
    seq = np.arange(1, n + 1) % 37 + 1
    b = dict(qsl=np.arange(n + 1), seq=seq, table=np.arange(n * 10).reshape(n, 10), chunk=16,
             block=4, shape=(n * 10, 2, 4, 8), seed=11, extra_rows=0)
    check_batch(b)
    assert len(calls) == 1


def test_memory_per_group_stays_within_budget(monkeypatch):
    """A long prefill is processed in groups whose padded work fits the budget."""
    calls = _record_sdpa(monkeypatch)
    monkeypatch.setattr(reference, "_GROUP_BUDGET", 1 << 20)
    seq_len, chunk, heads, kv_heads, dim = 3000, 1024, 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(seq_len, heads, dim, generator=gen)
    k = torch.randn(750, 4, kv_heads, dim, generator=gen)
    v = torch.randn_like(k)
    table = torch.randperm(750, generator=gen)[None]
    out = reference_attention(q, k, v, [0, seq_len], [seq_len], table, chunk_size=chunk)
    assert len(calls) > 1 and max(q_shape[0] for q_shape, _ in calls) > 1
    for (g, hq, q_pad, _), (_, hkv, k_pad, _) in calls:
        elements = g * (k_pad * (q_pad * hq + 2 * hkv * dim) + q_pad * 2 * hq * dim)
        assert g == 1 or elements <= reference._GROUP_BUDGET  # one tile always goes
    rows = [0, 1023, 1024, 1025, 2047, 2048, 2999]
    want = dense_chunked_attention(q, k, v, [0, seq_len], [seq_len], table, chunk)
    torch.testing.assert_close(out[rows].double(), want[rows], atol=2e-6, rtol=0)


@pytest.mark.parametrize("num_pages,message", [
    (1.5, r"num_pages must be an integer, got 1.5"),
    ("3", r"num_pages must be an integer"),
    (True, r"num_pages must be an integer"),
    (-1, r"num_pages must be non-negative, got -1"),
])
def test_plan_rejects_bad_num_pages(num_pages, message):
    with pytest.raises(ValueError, match=message):
        reference.plan_paged_attention([0, 1], [2], [[0]], block_size=2, num_kv_heads=1,
                                       head_dim=4, num_pages=num_pages)


def test_plan_accepts_integer_num_pages():
    plan = reference.plan_paged_attention([0, 1], [2], [[0]], block_size=2, num_kv_heads=1,
                                          head_dim=4, num_pages=np.int64(1))
    assert plan.pages_end == 1
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = 1 is not a page .*\(0..0\)"):
        reference.plan_paged_attention([0, 1], [2], [[1]], block_size=2, num_kv_heads=1,
                                       head_dim=4, num_pages=1)
