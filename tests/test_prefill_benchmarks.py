"""CPU checks of the issue-14 prefill scripts: batch generation, the float32 reference,
the error accounting, the ragged/paged split and the Flex paged block mask, each
against definitions written here or the float64 oracle (tests/oracle.py), plus
the scripts' --quick runs end to end."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import dense_chunked_attention

from benchmarks import prefill_common as pc
from benchmarks import prefill_ragged as pr

BS = 16


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), chunk=st.sampled_from([32, 48, 256, 8192]),
       max_tokens=st.sampled_from([16, 100, 8192]))
def test_random_batch_invariants(seed, chunk, max_tokens):
    rng = np.random.default_rng(seed)
    pool = 16 * 5 * chunk // BS + 2  # room for 16 requests of up to 5 chunks
    b = pc.random_batch(rng, chunk, pool, max_tokens=max_tokens)
    q, seq, table = b.query_lens, b.seq_lens.astype(np.int64), b.block_table
    assert b.query_start_loc[0] == 0 and 1 <= q.shape[0] <= 16
    assert (q >= 1).all() and (q > 1).any(), "every request queries; one is a prefill"
    assert q.sum() <= max_tokens and (seq >= q).all()
    pages = -(-seq // BS)
    assert table.shape == (q.shape[0], pages.max())
    used = np.arange(table.shape[1])[None, :] < pages[:, None]
    ids = table[used]
    assert (ids >= 1).all() and (ids < pool).all() and np.unique(ids).size == ids.size
    assert (table[~used] == 0).all()


def test_reference_matches_float64_oracle():
    rng = np.random.default_rng(3)
    b = pc.random_batch(rng, 32, 64, max_reqs=4, max_tokens=96)
    k, v = pc.random_pool(64, "cpu", 1)
    q = pc.random_queries(b.num_tokens, "cpu", 2)
    ref = pc.reference(q, k.float(), v.float(), b, pr.SCALE)
    oracle = dense_chunked_attention(q, k, v, b.query_start_loc, b.seq_lens, b.block_table,
                                     chunk_size=b.chunk, scale=pr.SCALE)
    assert (ref.double() - oracle).abs().max() < 1e-5


def test_row_errors_count_pairs_rows_and_nonfinite():
    ref = torch.randn(6, 4, 8)
    out = ref.clone()
    out[1, 2] *= 1.10          # 10 % off: counted
    out[1, 3] *= 1.04          # 4 % off: under the 5 % threshold
    out[4, 0, 5] = float("nan")
    s = pc.summarize(pc.row_errors(out, ref))
    assert (s["pairs"], s["pairs_off"], s["rows_off"], s["nonfinite_pairs"]) == (24, 2, 2, 1)
    assert s["worst"] == math.inf and (s["worst_row"], s["worst_head"]) == (4, 0)
    total = pc.merge_summary(pc.merge_summary(None, s), pc.summarize(pc.row_errors(ref, ref)))
    assert (total["pairs"], total["pairs_off"], total["worst"]) == (48, 2, math.inf)


def _split_by_definition(b):
    """Per query row: does it see cached keys of its chunk, and which pages hold them."""
    rows = {}
    qsl, seq = b.query_start_loc.astype(np.int64), b.seq_lens.astype(np.int64)
    for i in range(seq.shape[0]):
        context = seq[i] - (qsl[i + 1] - qsl[i])
        for r in range(qsl[i], qsl[i + 1]):
            p = context + r - qsl[i]
            start = p // b.chunk * b.chunk
            first_in_step = max(start, context)
            earlier = first_in_step - start
            if earlier:
                pages = b.block_table[i, start // BS: -(-first_in_step // BS)].tolist()
                rows[r] = (pages, earlier)
    return rows


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), chunk=st.sampled_from([32, 64, 256]))
def test_ragged_split_matches_definition(seed, chunk):
    rng = np.random.default_rng(seed)
    b = pc.random_batch(rng, chunk, 16 * 5 * chunk // BS + 2, max_tokens=300)
    split = pr.ragged_split(b)
    want = _split_by_definition(b)
    assert split.paged_rows.tolist() == sorted(want)
    p = split.paged
    got = {}
    for j in range(p.qo_indptr.shape[0] - 1):
        pages = p.kv_indices[p.kv_indptr[j]:p.kv_indptr[j + 1]].tolist()
        keys = (len(pages) - 1) * BS + int(p.last_page_len[j])
        for r in split.paged_rows[p.qo_indptr[j]:p.qo_indptr[j + 1]]:
            got[int(r)] = (pages, keys)
    assert got == want
    # Ragged rows: every virtual batch's own rows, in order, covering the step.
    assert split.qo_indptr[0] == 0 and split.qo_indptr[-1] == b.num_tokens
    # Slots of the step's own keys.
    slots = pr.step_slots(b)
    qsl, seq = b.query_start_loc, b.seq_lens.astype(np.int64)
    for i in range(seq.shape[0]):
        for r in range(qsl[i], qsl[i + 1]):
            pos = seq[i] - (qsl[i + 1] - qsl[i]) + r - qsl[i]
            assert slots[r] == b.block_table[i, pos // BS] * BS + pos % BS


@pytest.mark.parametrize("seed", range(3))
def test_ragged_plus_paged_merge_equals_oracle(seed):
    rng = np.random.default_rng(seed)
    b = pc.random_batch(rng, 32, 64, max_reqs=5, max_tokens=120)
    k, v = pc.random_pool(64, "cpu", seed)
    q = pc.random_queries(b.num_tokens, "cpu", seed + 1)
    slots = torch.from_numpy(pr.step_slots(b))
    k_new, v_new = (x.flatten(0, 1).index_select(0, slots) for x in (k, v))
    out = pr.torch_ragged_paged(pr.ragged_split(b), q, k_new, v_new, k, v)
    oracle = dense_chunked_attention(q, k, v, b.query_start_loc, b.seq_lens, b.block_table,
                                     chunk_size=b.chunk, scale=pr.SCALE)
    err = (out.double() - oracle).norm(dim=-1) / oracle.norm(dim=-1)
    assert err.max() < 1e-2  # bf16 output rounding is ~2e-3


def test_merge_states_torch_edge_cases():
    v_a, v_b = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    s_a = torch.tensor([[1.0, -math.inf]] * 3)
    s_b = torch.tensor([[-math.inf, 2.0]] * 3)
    v, s = pr.merge_states_torch(v_a, s_a, v_b, s_b)
    assert torch.equal(v[:, 0], v_a[:, 0]) and torch.equal(v[:, 1], v_b[:, 1])
    assert torch.equal(s, torch.tensor([[1.0, 2.0]] * 3))
    equal = pr.merge_states_torch(v_a, torch.zeros(3, 2), v_b, torch.zeros(3, 2))
    assert torch.allclose(equal[0], (v_a + v_b) / 2) and torch.allclose(equal[1], torch.ones(3, 2))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), chunk=st.sampled_from([32, 64]),
       q_block=st.sampled_from([16, 32]))
def test_flex_paged_block_mask(seed, chunk, q_block):
    """Listed blocks cover every visible (row, key); "full" blocks are visible throughout;
    mask_mod equals the chunk rule on the pages the step reads."""
    rng = np.random.default_rng(seed)
    pool = 16 * 5 * chunk // BS + 2
    b = pc.random_batch(rng, chunk, pool, max_tokens=200)
    m = pr.flex_paged_mask(b, pool, q_block=q_block)
    t, n = b.num_tokens, pool * BS
    # Definition: row (request i, position p) sees slot s iff s holds position k of request i
    # with k <= p and k // c == p // c (through the request's own table).
    want = np.zeros((t, n), bool)
    qsl, seq = b.query_start_loc, b.seq_lens.astype(np.int64)
    for i in range(seq.shape[0]):
        for r in range(qsl[i], qsl[i + 1]):
            p = seq[i] - (qsl[i + 1] - qsl[i]) + r - qsl[i]
            keys = np.arange(p // chunk * chunk, p + 1)
            want[r, b.block_table[i, keys // BS] * BS + keys % BS] = True
    mod = pr.flex_mask_mod(m, chunk, "cpu")
    got = mod(0, 0, torch.arange(t)[:, None], torch.arange(n)[None, :]).numpy()
    assert (got == want).all()
    listed = np.zeros((t, n), bool)
    for j in range(m.kv_num.shape[2]):
        rows = slice(j * q_block, (j + 1) * q_block)
        for page in m.kv_idx[0, 0, j, :m.kv_num[0, 0, j]]:
            listed[rows, page * BS:(page + 1) * BS] = True
        for page in m.full_idx[0, 0, j, :m.full_num[0, 0, j]]:
            assert want[rows, page * BS:(page + 1) * BS].all(), "a full block is masked"
            listed[rows, page * BS:(page + 1) * BS] = True
    assert not (want & ~listed).any(), "a visible key lies outside the listed blocks"


def test_stress_quick_run(tmp_path):
    from benchmarks import prefill_stress

    out = tmp_path / "stress.json"
    assert prefill_stress.main(["--quick", "--out", str(out)]) == 0
    data = pc.load(out)
    assert data["errors"] == [] and data["summary"]["random_batches_done"] == 6
    torch_ = data["summary"]["torch"]
    assert torch_["rows_off_total"] == 0 and 0 < torch_["worst"] < 1e-2
    assert data["reporter"]["per_kernel"]["torch"]["reps_differing_bitwise_from_first"] == 0


def test_ragged_quick_run(tmp_path):
    out = tmp_path / "ragged.json"
    assert pr.main(["--quick", "--out", str(out)]) == 0
    rows = pc.load(out)["rows"]
    assert [r["paged_rows"] > 0 for r in rows] == [False, True]
    for r in rows:
        assert r["torch"]["merged_vs_ref"]["rows_off"] == 0
        assert r["torch"]["merged_vs_ref"]["worst"] < 1e-2
