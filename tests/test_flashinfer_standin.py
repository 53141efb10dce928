"""The FlashInfer 0.7.2.post1 stand-in (tests/flashinfer_standin.py): signatures, math, graph
buffers read at run time, strict checks, and the sampling function the engine calls."""

from __future__ import annotations

import ast
import inspect
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import flashinfer_standin
import numpy as np
import pytest
import torch

from chunklocal.reference import reference_attention

WHEEL = Path(__file__).resolve().parents[1] / ".whl/flashinfer_python-0.7.2.post1-py3-none-any.whl"
P, D_ = "BatchPrefillWithPagedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper"
R = "BatchPrefillWithRaggedKVCacheWrapper"
# 0.7.2.post1's parameter lists (annotations dropped), copied from the wheel's source.
EXPECTED = {
    ("prefill", P, "__init__"): "self, float_workspace_buffer, kv_layout='NHD', use_cuda_graph=False, qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None, backend='auto', jit_args=None, jit_kwargs=None, variant_owns_mask=False",  # noqa: E501
    ("prefill", P, "plan"): "self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode='NONE', use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type='float16', kv_data_type=None, o_data_type=None, non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len=0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None, max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False, uniform_q_len=None",  # noqa: E501
    ("prefill", P, "run"): "self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None, return_lse=False, lse_base='log2', lse_layout='NH', enable_pdl=None, window_left=None, sinks=None, kv_cache_sf=None, skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None, uses_spcompress=None",  # noqa: E501
    ("decode", D_, "__init__"): "self, float_workspace_buffer, kv_layout='NHD', use_cuda_graph=False, use_tensor_cores=False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None, backend='auto', jit_args=None",  # noqa: E501
    ("decode", D_, "plan"): "self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *deprecated_positional_args, **kwargs",  # noqa: E501
    ("decode", D_, "_plan_impl"): "self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *, pos_encoding_mode='NONE', window_left=-1, window_right=0, logits_soft_cap=None, q_data_type='float16', kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None, non_blocking=True, block_tables=None, seq_lens=None, fixed_split_size=None, disable_split_kv=False, q_len_per_req=1, is_causal=None",  # noqa: E501
    ("decode", D_, "run"): "self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None, return_lse=False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=None, skip_softmax_threshold_scale_factor=None, kv_cache_sf=None",  # noqa: E501
    ("prefill", R, "__init__"): "self, float_workspace_buffer, kv_layout='NHD', use_cuda_graph=False, qo_indptr_buf=None, kv_indptr_buf=None, custom_mask_buf=None, mask_indptr_buf=None, backend='auto', jit_args=None, jit_kwargs=None, variant_owns_mask=False",  # noqa: E501
    ("prefill", R, "plan"): "self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode='NONE', use_fp16_qk_reduction=False, window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None, q_data_type='float16', kv_data_type=None, o_data_type=None, non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len=0, max_item_len_ptr=None, fixed_split_size=None, disable_split_kv=False, seq_lens=None, seq_lens_q=None, max_token_per_sequence=None, max_sequence_kv=None, v_indptr=None, o_indptr=None, uniform_q_len=None",  # noqa: E501
    ("prefill", R, "run"): "self, q, k, v, *args, q_scale=None, k_scale=None, v_scale=None, o_scale=None, out=None, lse=None, return_lse=False, lse_base='log2', lse_layout='NH', enable_pdl=None, kv_cache_sf=None",  # noqa: E501
    ("cascade", None, "merge_state"): "v_a, s_a, v_b, s_b",
    ("sampling", None, "top_k_top_p_sampling_from_logits"): "logits, top_k, top_p, indices=None, filter_apply_order='top_k_first', deterministic=True, generator=None, check_nan=False, seed=None, offset=None",  # noqa: E501
    ("activation", None, "silu_and_mul"): "input, out=None, enable_pdl=None",
}
HQ, HKV, HD, PS = 40, 8, 16, 4  # GQA 5:1 as Llama-4's 40/8


@pytest.fixture
def fi(monkeypatch):
    return flashinfer_standin.install(monkeypatch)


def fmt_signature(fn) -> str:
    parts = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not any(x.startswith("*") for x in parts):
            parts.append("*")
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        parts.append(prefix + p.name + ("" if p.default is p.empty else f"={p.default!r}"))
    return ", ".join(parts)


def fmt_ast(fn: ast.FunctionDef) -> str:
    a = fn.args
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + a.defaults
    show = lambda arg, d: arg.arg + ("" if d is None else "=" + ast.unparse(d))  # noqa: E731
    parts = [show(p, d) for p, d in zip(pos, defaults, strict=True)]
    parts += ["*" + a.vararg.arg] if a.vararg else (["*"] if a.kwonlyargs else [])
    parts += [show(p, d) for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    return ", ".join(parts + (["**" + a.kwarg.arg] if a.kwarg else []))


def standin_function(fi, module, cls, name):
    if cls is None:  # a module-level function of a submodule
        return getattr(getattr(fi, module), name)
    return getattr(getattr(fi, cls), name)


def test_signatures_equal_072(fi):
    for (module, cls, name), expected in EXPECTED.items():
        assert fmt_signature(standin_function(fi, module, cls, name)) == expected, name


@pytest.mark.skipif(not WHEEL.exists(), reason="no FlashInfer wheel at .whl/ (CI)")
def test_expected_signatures_are_the_wheels():
    with zipfile.ZipFile(WHEEL) as whl:
        trees = {m: ast.parse(whl.read(f"flashinfer/{m}.py"))
                 for m in ("prefill", "decode", "sampling", "activation", "cascade")}
    for (module, cls, name), expected in EXPECTED.items():
        body = trees[module].body
        if cls is not None:
            body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
        defs = [n for n in body if isinstance(n, ast.FunctionDef) and n.name == name]
        assert fmt_ast(defs[-1]) == expected, (cls, name)  # the last def: not an @overload


@pytest.mark.skipif(not WHEEL.exists(), reason="no FlashInfer wheel at .whl/ (CI)")
def test_the_decode_wrappers_staging_attribute_is_the_wheels(fi):
    """backends/flashinfer's graph re-plan (``GRAPH_REPLAN``) swaps the decode wrapper's
    host staging buffer, a private attribute: the wheel's ``__init__`` must assign it and
    its ``plan`` pass it to the planner, as the stand-in models."""
    with zipfile.ZipFile(WHEEL) as whl:
        tree = ast.parse(whl.read("flashinfer/decode.py"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == D_)
    uses = {fn.name: {a.attr for a in ast.walk(fn) if isinstance(a, ast.Attribute)}
            for fn in cls.body if isinstance(fn, ast.FunctionDef)}
    assert "_pin_memory_int_workspace_buffer" in uses["__init__"]
    assert "_pin_memory_int_workspace_buffer" in uses["plan"] | uses["_plan_impl"]
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    assert torch.is_tensor(wrapper._pin_memory_int_workspace_buffer)


def test_silu_and_mul_is_silu_of_the_first_half_times_the_second(fi):
    """float32 rows: silu(gate) * up to float32 rounding; an odd last dim, a strided input
    and a wrong ``out`` refused (the last: 0.7.2.post1 asserts; a strided input it would read
    wrong)."""
    import flashinfer.activation as act

    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0))
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(act.silu_and_mul(x), want, rtol=1e-6, atol=1e-6)
    out = torch.empty(3, 5, 8)
    assert act.silu_and_mul(x, out) is out
    with pytest.raises(ValueError, match="must be even"):
        act.silu_and_mul(x[..., :15])
    with pytest.raises(ValueError, match="strided"):
        act.silu_and_mul(x.transpose(0, 1))
    with pytest.raises(AssertionError):
        act.silu_and_mul(x, torch.empty(3, 5, 16))


def test_install_is_a_plain_module(fi):
    import flashinfer
    import flashinfer.sampling as sampling

    assert flashinfer is fi and sampling is fi.sampling is sys.modules["flashinfer.sampling"]
    assert flashinfer.__version__ == "0.7.2.post1"
    for name in ("BatchAttention", "single_decode_with_kv_cache"):
        with pytest.raises(AttributeError):
            getattr(flashinfer, name)
    with pytest.raises(AttributeError):
        sampling.top_p_sampling_from_probs  # noqa: B018


# --------------------------------------------------------------------------- batches
def make_batch(rng, q_lens, kv_lens, num_pages=64, dtype=torch.float32, hq=HQ):
    """Requests on random distinct pages (a random permutation of the cache)."""
    q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
    pages = -(-kv_lens // PS)
    perm = rng.permutation(num_pages)[: pages.sum()]
    table = np.zeros((len(kv_lens), pages.max()), np.int64)
    for i, chunk in enumerate(np.split(perm, np.cumsum(pages)[:-1])):
        table[i, : len(chunk)] = chunk
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    k = torch.randn(num_pages, PS, HKV, HD, generator=g).to(dtype)
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    i32 = lambda a: torch.tensor(np.asarray(a), dtype=torch.int32)  # noqa: E731
    return SimpleNamespace(
        q=torch.randn(int(qsl[-1]), hq, HD, generator=g).to(dtype), k=k,
        v=torch.randn(k.shape, generator=g).to(dtype), qsl=qsl, seq=kv_lens, table=table,
        qo=i32(qsl), indptr=i32(np.concatenate([[0], np.cumsum(pages)])), indices=i32(perm),
        last=i32(kv_lens - (pages - 1) * PS))


def ref(b, scale=HD ** -0.5, causal=True):
    if causal:
        return reference_attention(b.q.double(), b.k.double(), b.v.double(), b.qsl, b.seq,
                                   b.table, scale=scale)
    row = np.repeat(np.arange(len(b.seq)), np.diff(b.qsl))  # each row alone sees every key
    return reference_attention(b.q.double(), b.k.double(), b.v.double(),
                               np.arange(len(row) + 1), b.seq[row], b.table[row], scale=scale)


def ws():
    return torch.zeros(1024, dtype=torch.uint8)


def plan_prefill(fi, b, **kw):
    w = fi.BatchPrefillWithPagedKVCacheWrapper(ws(), "NHD", backend="fa2")
    args = dict(qo_indptr=b.qo, paged_kv_indptr=b.indptr, paged_kv_indices=b.indices,
                paged_kv_last_page_len=b.last, num_qo_heads=HQ, num_kv_heads=HKV,
                head_dim_qk=HD, page_size=PS, causal=True, q_data_type=b.q.dtype)
    w.plan(**{**args, **kw})
    return w


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("seed", range(3))
def test_prefill_matches_dense_reference(fi, seed, dtype, tol):
    rng = np.random.default_rng(seed)
    q_lens = rng.integers(1, 12, 5)
    b = make_batch(rng, q_lens, q_lens + rng.integers(0, 20, 5), dtype=dtype)
    w = plan_prefill(fi, b)
    out = torch.full_like(b.q, float("nan"))
    assert w.run(b.q, (b.k, b.v), out=out) is out
    torch.testing.assert_close(out.double(), ref(b), atol=tol, rtol=tol)
    # q_scale multiplies sm_scale; k_scale too; v_scale scales the output (0.7.2's run()).
    got = w.run(b.q, (b.k, b.v), q_scale=0.5, k_scale=3.0, v_scale=2.0)
    torch.testing.assert_close(got.double(), 2 * ref(b, 1.5 * HD ** -0.5), atol=2 * tol,
                               rtol=tol)
    w = plan_prefill(fi, b, causal=False, sm_scale=0.3)
    torch.testing.assert_close(w.run(b.q, (b.k, b.v)).double(), ref(b, 0.3, causal=False),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("chunk", [None, 8])
def test_ragged_own_keys_merged_with_paged_earlier_keys_is_the_reference(fi, chunk):
    """backends/flashinfer/ragged.py's split through the stand-in: the step's own keys
    (ragged, causal) and the earlier ones (paged, non-causal), merged by merge_state, equal
    the float64 reference; the ragged run's LSE is the log2-sum-exp of the scaled scores."""
    from chunklocal.backends.flashinfer.ragged import ragged_split

    rng = np.random.default_rng(5)
    q_lens = rng.integers(1, 12, 5)
    b = make_batch(rng, q_lens, q_lens + np.array([0, 3, 9, 17, 1]))
    # the step's own K/V: what it writes to the cache at its positions
    req = np.repeat(np.arange(5), q_lens)
    pos = (b.seq - q_lens)[req] + np.arange(int(q_lens.sum())) - b.qsl[:-1][req]
    slot = torch.from_numpy(b.table[req, pos // PS] * PS + pos % PS)
    k_new, v_new = (c.reshape(-1, HKV, HD)[slot] for c in (b.k, b.v))
    split = ragged_split(b.qsl, b.seq, b.table, chunk, PS)
    ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(ws(), "NHD", backend="auto")
    qo = torch.from_numpy(split.qo_indptr)
    ragged.plan(qo, qo, HQ, HKV, HD, causal=True, q_data_type=torch.float32)
    out, lse = ragged.run(b.q, k_new, v_new, return_lse=True)
    assert lse.shape == (b.q.shape[0], HQ) and lse.dtype == torch.float32
    first = int(split.qo_indptr[1])  # segment 0 alone: its row 0 sees one key
    score = (b.q[0].view(HKV, HQ // HKV, HD) * k_new[0][:, None]).sum(-1).reshape(HQ)
    torch.testing.assert_close(lse[0], score * HD ** -0.5 / np.log(2))
    assert first >= 1 and split.paged_rows.size
    p = split.paged
    paged = fi.BatchPrefillWithPagedKVCacheWrapper(ws(), "NHD", backend="fa2")
    paged.plan(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (
        p.qo_indptr, p.kv_indptr, p.kv_indices, p.last_page_len)), HQ, HKV, HD, PS,
        causal=False, q_data_type=torch.float32)
    rows = torch.from_numpy(split.paged_rows)
    part = paged.run(b.q[rows], (b.k, b.v), return_lse=True)
    merged, _ = fi.merge_state(out[rows], lse[rows], *part)
    out[rows] = merged
    want = ref(b) if chunk is None else reference_attention(
        b.q.double(), b.k.double(), b.v.double(), b.qsl, b.seq, b.table, chunk_size=chunk)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    # strided views (the fused projection's rows, as the engine passes them) give the same
    # output; a head_dim that is not contiguous is refused, as the kernels index it densely
    fused = torch.cat([k_new, v_new], dim=1)
    strided = ragged.run(b.q, fused[:, :HKV], fused[:, HKV:])
    torch.testing.assert_close(strided, ragged.run(b.q, k_new, v_new), atol=0, rtol=0)
    with pytest.raises(ValueError, match="head_dim must be contiguous"):
        ragged.run(b.q, k_new.transpose(1, 2).contiguous().transpose(1, 2), v_new)


@pytest.mark.parametrize("tensor_cores, hq", [(True, HQ), (False, 16), (False, 48)])
def test_decode_matches_dense_reference(fi, tensor_cores, hq):
    rng = np.random.default_rng(7)
    b = make_batch(rng, np.ones(6, int), rng.integers(1, 30, 6), hq=hq)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_tensor_cores=tensor_cores)
    w.plan(b.indptr, b.indices, b.last, hq, HKV, HD, PS, q_data_type=torch.float32)
    torch.testing.assert_close(w.run(b.q, (b.k, b.v)).double(), ref(b), atol=2e-5, rtol=2e-5)


def test_decode_q_len_per_req_is_causal_bottom_right(fi):
    rng = np.random.default_rng(3)
    b = make_batch(rng, np.full(4, 3), rng.integers(3, 30, 4))
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_tensor_cores=True)
    w.plan(b.indptr, b.indices, b.last, HQ, HKV, HD, PS, q_data_type=torch.float32,
           q_len_per_req=3)
    torch.testing.assert_close(w.run(b.q, (b.k, b.v)).double(), ref(b), atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------- graph mode
def test_decode_graph_mode_reads_buffers_at_run_time(fi):
    rng = np.random.default_rng(11)
    n = 3
    bufs = (torch.zeros(n + 1, dtype=torch.int32), torch.zeros(40, dtype=torch.int32),
            torch.zeros(n, dtype=torch.int32))
    w = fi.BatchDecodeWithPagedKVCacheWrapper(
        ws(), "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=bufs[0],
        paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2])
    a = make_batch(rng, np.full(n, 2), rng.integers(2, 40, n))
    w.plan(a.indptr, a.indices, a.last, HQ, HKV, HD, PS, q_data_type=torch.float32,
           q_len_per_req=2)
    assert torch.equal(bufs[0], a.indptr) and torch.equal(bufs[2], a.last)
    assert torch.equal(bufs[1][: len(a.indices)], a.indices)
    torch.testing.assert_close(w.run(a.q, (a.k, a.v)).double(), ref(a), atol=2e-5, rtol=2e-5)
    b = make_batch(rng, np.full(n, 2), rng.integers(2, 40, n))  # new pages, new lengths
    for buf, new in zip(bufs, (b.indptr, b.indices, b.last), strict=True):
        buf[: len(new)].copy_(new)  # in place, as the engine does before a replay
    torch.testing.assert_close(w.run(b.q, (b.k, b.v)).double(), ref(b), atol=2e-5, rtol=2e-5)
    bufs[2][0] = PS + 1
    with pytest.raises(ValueError, match="last_page_len"):
        w.run(b.q, (b.k, b.v))
    with pytest.raises(ValueError, match="batch size should be fixed"):
        w.plan(a.indptr[:-1], a.indices, a.last[:-1], HQ, HKV, HD, PS, q_len_per_req=2)
    with pytest.raises(ValueError, match="frozen cudagraph shape"):
        w.plan(a.indptr, a.indices, a.last, HQ, HKV, HD, PS, q_len_per_req=1)
    with pytest.raises(ValueError, match="allocated buffer"):
        w.plan(a.indptr, torch.zeros(41, dtype=torch.int32), a.last, HQ, HKV, HD, PS,
               q_len_per_req=2)


def test_prefill_graph_mode_reads_buffers_at_run_time(fi):
    rng = np.random.default_rng(12)
    bufs = [torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
            torch.zeros(40, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)]
    w = fi.BatchPrefillWithPagedKVCacheWrapper(ws(), "NHD", True, *bufs)
    a = make_batch(rng, [2, 5, 3], [4, 9, 30])
    w.plan(a.qo, a.indptr, a.indices, a.last, HQ, HKV, HD, PS, causal=True,
           q_data_type=torch.float32)
    torch.testing.assert_close(w.run(a.q, (a.k, a.v)).double(), ref(a), atol=2e-5, rtol=2e-5)
    b = make_batch(rng, [4, 4, 2], [20, 4, 17])  # same 10 rows, other split and pages
    for buf, new in zip(bufs, (b.qo, b.indptr, b.indices, b.last), strict=True):
        buf[: len(new)].copy_(new)
    torch.testing.assert_close(w.run(b.q, (b.k, b.v)).double(), ref(b), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="cannot exceed"):
        c = make_batch(rng, [4, 4, 3], [20, 4, 17])
        w.plan(c.qo, c.indptr, c.indices, c.last, HQ, HKV, HD, PS, q_data_type=torch.float32)


# -------------------------------------------------------------------- strict checks
def _bump(t, i, delta):
    t = t.clone()
    t[i] += delta
    return t


PLAN_ERRORS = [
    (lambda b: dict(paged_kv_indptr=b.indptr.long()), TypeError, "int32"),
    (lambda b: dict(paged_kv_indices=b.indices[None]), ValueError, "1-D"),
    (lambda b: dict(paged_kv_last_page_len=b.last.tolist()), TypeError, "torch.Tensor"),
    (lambda b: dict(paged_kv_indptr=b.indptr + 1), ValueError, "start at 0"),
    (lambda b: dict(paged_kv_indptr=_bump(b.indptr, 1, 9)), ValueError, "decreases"),
    (lambda b: dict(paged_kv_indices=b.indices[:-1]), ValueError, "number of page indices"),
    (lambda b: dict(paged_kv_last_page_len=b.last * 0), ValueError, r"\[1, page_size"),
    (lambda b: dict(paged_kv_last_page_len=b.last + PS), ValueError, r"\[1, page_size"),
    (lambda b: dict(qo_indptr=_bump(b.qo, 1, 99)), ValueError, "qo_indptr decreases"),
    (lambda b: dict(num_qo_heads=HQ + 1), ValueError, "multiple of num_kv_heads"),
    (lambda b: dict(window_left=8), NotImplementedError, "window_left"),
    (lambda b: dict(logits_soft_cap=30.0), NotImplementedError, "logits_soft_cap"),
    (lambda b: dict(custom_mask=torch.ones(3, dtype=torch.bool)), NotImplementedError, "mask"),
    (lambda b: dict(pos_encoding_mode="ROPE_LLAMA"), NotImplementedError, "pos_encoding"),
]
RUN_ERRORS = [
    (lambda b: dict(q=b.q.double()), ValueError, "dtype of q"),
    (lambda b: dict(q=b.q[:, :8]), ValueError, "shape"),
    (lambda b: dict(q=b.q[..., :8]), ValueError, "shape"),
    (lambda b: dict(q=b.q[1:]), ValueError, "shape"),
    (lambda b: dict(paged_kv_cache=[b.k, b.v]), TypeError, "paged_kv_cache"),
    (lambda b: dict(paged_kv_cache=torch.stack([b.k, b.v], 1)), NotImplementedError, "5-D"),
    (lambda b: dict(paged_kv_cache=(b.k.double(), b.v.double())), ValueError, "kv_data_type"),
    (lambda b: dict(paged_kv_cache=(b.k[:, :2], b.v[:, :2])), ValueError, "page_size"),
    (lambda b: dict(paged_kv_cache=(b.k[:3], b.v[:3])), ValueError, "not a page of the cache"),
    (lambda b: dict(paged_kv_cache=(b.k[: b.indices.max()], b.v[: b.indices.max()])), ValueError,
     "not a page of the cache"),
    (lambda b: dict(out=b.q[1:].clone()), ValueError, "shape of out"),
    (lambda b: dict(out=b.q.half()), ValueError, "dtype of out"),
    (lambda b: dict(lse=torch.empty(5, HQ)), NotImplementedError, "lse"),
    (lambda b: dict(return_lse=True, lse_base="ln"), NotImplementedError, "lse_base"),
]


@pytest.mark.parametrize("case, error, match", PLAN_ERRORS + RUN_ERRORS)
def test_prefill_strict_checks(fi, case, error, match):
    b = make_batch(np.random.default_rng(0), [3, 2], [9, 14])
    change = case(b)
    run_args = dict(q=b.q, paged_kv_cache=(b.k, b.v))
    with pytest.raises(error, match=match):
        if change.keys() & {"q", "paged_kv_cache", "out", "lse", "return_lse"}:
            plan_prefill(fi, b).run(**{**run_args, **change})
        else:
            plan_prefill(fi, b, **change)
    plan_prefill(fi, b).run(**run_args)  # the unchanged batch passes, also on the pages it uses
    used = int(b.indices.max()) + 1
    plan_prefill(fi, b).run(b.q, (b.k[:used], b.v[:used]))


def test_wrapper_strict_checks(fi):
    b = make_batch(np.random.default_rng(1), [1, 1], [5, 9])
    with pytest.raises(RuntimeError, match="plan"):
        fi.BatchPrefillWithPagedKVCacheWrapper(ws()).run(b.q, (b.k, b.v))
    with pytest.raises(RuntimeError, match="plan"):
        fi.BatchDecodeWithPagedKVCacheWrapper(ws()).run(b.q, (b.k, b.v))
    with pytest.raises(NotImplementedError, match="kv_layout"):
        fi.BatchDecodeWithPagedKVCacheWrapper(ws(), "HND")
    with pytest.raises(ValueError, match="cudagraph mode"):
        fi.BatchDecodeWithPagedKVCacheWrapper(ws(), use_cuda_graph=True)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws())  # CUDA cores: group 5 is not compiled
    with pytest.raises(RuntimeError, match="Unsupported group_size: 5"):
        w.plan(b.indptr, b.indices, b.last, HQ, HKV, HD, PS, q_data_type=torch.float32)
    with pytest.raises(ValueError, match="tensor-core"):
        w.plan(b.indptr, b.indices, b.last, 16, HKV, HD, PS, q_len_per_req=2)
    w.plan(b.indptr, b.indices, b.last, 16, HKV, HD, PS, q_data_type=torch.float32)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws(), use_tensor_cores=True)
    w.plan(b.indptr, b.indices, b.last, HQ, HKV, HD, PS, q_data_type=torch.float32)
    with pytest.raises(ValueError, match="shape"):
        w.run(torch.cat([b.q, b.q]), (b.k, b.v))


# ------------------------------------------------------------------------- sampling
def test_sampling_filters_then_draws(fi):
    s = fi.sampling.top_k_top_p_sampling_from_logits
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4000))
    g = torch.Generator().manual_seed(0)
    draws = s(logits, torch.full((4000,), 3, dtype=torch.int32), 0.6, generator=g)
    assert draws.dtype == torch.int32
    freq = torch.bincount(draws.long(), minlength=4).double() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.625, 0.375, 0, 0], dtype=torch.double),
                               atol=0.03, rtol=0)
    draws = s(logits, 2, torch.full((4000,), 1.0), generator=g)
    freq = torch.bincount(draws.long(), minlength=4).double() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.625, 0.375, 0, 0], dtype=torch.double),
                               atol=0.03, rtol=0)
    rand = torch.randn(8, 50, generator=g)
    assert torch.equal(s(rand, 1, 1.0, generator=g).long(), rand.argmax(-1))
    assert torch.equal(s(rand, 50, 1e-6, generator=g).long(), rand.argmax(-1))
    assert torch.equal(s(rand, 9, 0.9, generator=torch.Generator().manual_seed(5)),
                       s(rand, 9, 0.9, generator=torch.Generator().manual_seed(5)))


@pytest.mark.parametrize("args, error", [
    ((torch.zeros(5), 1, 1.0), ValueError), ((torch.zeros(2, 5, dtype=torch.long), 1, 1.0),
                                             TypeError),
    ((torch.zeros(2, 5), torch.ones(3, dtype=torch.int32), 1.0), ValueError),
    ((torch.zeros(2, 5), torch.ones(2), 1.0), TypeError), ((torch.zeros(2, 5), 0, 1.0),
                                                           ValueError),
    ((torch.zeros(2, 5), 1, 0.0), ValueError), ((torch.zeros(2, 5), 1, 1.5), ValueError)])
def test_sampling_checks(fi, args, error):
    with pytest.raises(error):
        fi.sampling.top_k_top_p_sampling_from_logits(*args)


def test_engine_sampler_runs_through_standin(fi):
    from chunklocal.engine.sampler import Sampler, sampling_row
    from chunklocal.engine.sampling import SamplingParams

    seqs = [SimpleNamespace(sampling_row=sampling_row(SamplingParams(temperature=1.0, top_k=1)),
                            token_ids=[1], num_prompt_tokens=1, generator=None)]
    logits = torch.randn(3, 30)
    result = Sampler("cpu", use_flashinfer=True)(logits, seqs, np.zeros(3, np.int64))
    assert np.array_equal(result.tokens, logits.argmax(-1).numpy())
