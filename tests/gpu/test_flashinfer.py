"""FlashInfer backend vs the PyTorch reference (float32 on upcast inputs), on the GPU.

Every output buffer is filled with NaN before the kernel runs, so a row the kernel
fails to write cannot pass.  Page 0 is the scratch page: tables never use it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
flashinfer = pytest.importorskip("flashinfer")

from chunklocal.backends.base import EngineLimits  # noqa: E402
from chunklocal.backends.flashinfer import FlashInferBackend  # noqa: E402
from chunklocal.backends.flashinfer import backend as fi_backend  # noqa: E402
from chunklocal.kv_spec import ChunkedLocalAttentionSpec, FullAttentionSpec, Kind, merge  # noqa: E402,E501
from chunklocal.reference import reference_attention  # noqa: E402

HQ, HKV, D, BS = 40, 8, 128, 16
DT = torch.bfloat16
SCALE = D ** -0.5
NAN = float("nan")


def spec(chunk):
    if chunk:
        return ChunkedLocalAttentionSpec(BS, HKV, D, DT, attention_chunk_size=chunk)
    return FullAttentionSpec(BS, HKV, D, DT)


def kv_cache(num_pages, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (num_pages, BS, HKV, D)
    return (torch.randn(shape, device="cuda", dtype=DT, generator=g),
            torch.randn(shape, device="cuda", dtype=DT, generator=g))


def tables(rng, num_reqs, width, num_pages):
    """Distinct random pages per request, never the scratch page 0."""
    pages = rng.permutation(np.arange(1, num_pages))[: num_reqs * width]
    return pages.reshape(num_reqs, width).astype(np.int32)


def queries(rows, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(rows, HQ, D, device="cuda", dtype=DT, generator=g)


def check(out, q, k, v, qsl, seq, table, chunk):
    ref = reference_attention(q.float(), k.float(), v.float(), np.asarray(qsl), np.asarray(seq),
                              np.asarray(table), chunk_size=chunk, scale=SCALE)
    assert torch.isfinite(out).all(), "kernel left rows unwritten (NaN poison survived)"
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"relative error {err:.2e}"
    return err


def own_kv(md, k_cache, v_cache, qsl, seq, table) -> dict:
    """``k=``, ``v=`` for a step whose metadata reads its own keys from them (the ragged
    path, CHUNKLOCAL_RAGGED_OWN_KEYS=1): the rows the step wrote; nothing otherwise."""
    if not any(isinstance(w, fi_backend.OwnKeys) for w in md.wrappers.values()):
        return {}
    rows = own_rows(qsl, seq, table)
    return dict(k=k_cache.view(-1, HKV, D)[rows], v=v_cache.view(-1, HKV, D)[rows])


def run_eager(backend, q, k_cache, v_cache, qsl, seq, table, **kw):
    md = backend.build(qsl, seq, table)
    if "k" not in kw:
        kw |= own_kv(md, k_cache, v_cache, qsl, seq, table)
    out = torch.full_like(q, NAN)
    backend.forward(md, q, k_cache, v_cache, SCALE, out=out, **kw)
    return out


# ------------------------------------------------------------------- (a)
@pytest.mark.parametrize("prefill_backend", ["fa2", "auto"])
def test_reporter_config_full_size(prefill_backend):
    """One 36000-token prompt, c=8192, bs=16, max_num_seqs=1, 40/8 heads, dim 128."""
    if prefill_backend == "auto" and os.environ.get("CHUNKLOCAL_UNDER_SANITIZER"):
        # Not run under compute-sanitizer: there FA3 ("auto" on sm90) returned ~20 wrong
        # (row, head) pairs with 0 memory errors on the H200 (docs/gpu.md), while it is exact
        # without the sanitizer and FA2 is exact in both.  An xfail would also pass if the
        # case broke in some new way; the plain (unsanitized) run of this case is the check.
        pytest.skip("FA3 under compute-sanitizer memcheck: known wrong rows from the tool "
                    "run, see docs/gpu.md; checked by the unsanitized run")
    limits = EngineLimits(1, 36000, 36000, BS)
    backend = FlashInferBackend(spec(8192), limits, HQ, HKV, D, DT, "cuda",
                                prefill_backend=prefill_backend)
    k, v = kv_cache(2251, seed=0)
    table = tables(np.random.default_rng(0), 1, 2250, 2251)
    q = queries(36000, seed=1)
    qsl, seq = np.array([0, 36000]), np.array([36000])
    out = run_eager(backend, q, k, v, qsl, seq, table)
    check(out, q, k, v, qsl, seq, table, 8192)


# ------------------------------------------------------------------- (b)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("chunk", [None, 256])
@pytest.mark.parametrize("mode", ["mixed", "decode"])
def test_random_batches_ragged_context(seed, chunk, mode):
    rng = np.random.default_rng(seed)
    n, model_len = 8, 2048
    limits = EngineLimits(n, 4096, model_len, BS)
    backend = FlashInferBackend(spec(chunk), limits, HQ, HKV, D, DT, "cuda")
    if mode == "decode":
        q_lens = np.ones(n, np.int64)
    else:
        q_lens = np.where(rng.random(n) < 0.5, 1, rng.integers(2, 500, n))
    context = rng.integers(0, model_len - q_lens + 1)
    seq = context + q_lens
    width = -(-model_len // BS)
    num_pages = n * width + 1
    k, v = kv_cache(num_pages, seed)
    table = tables(rng, n, width, num_pages)
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    q = queries(int(qsl[-1]), seed + 10)
    out = run_eager(backend, q, k, v, qsl, seq, table)
    check(out, q, k, v, qsl, seq, table, chunk)


def own_rows(qsl, seq, table):
    """Flat cache rows (page * BS + offset) of each query token: where its K/V were written."""
    q_lens = np.diff(qsl)
    req = np.repeat(np.arange(q_lens.shape[0]), q_lens)
    pos = (seq - q_lens)[req] + np.arange(int(qsl[-1])) - qsl[:-1][req]
    return torch.from_numpy(table[req, pos // BS].astype(np.int64) * BS + pos % BS).cuda()


@pytest.mark.parametrize("every_row", [False, True], ids=["some-rows", "every-row"])
@pytest.mark.parametrize("gathered", [False, True], ids=["paged-earlier", "gathered"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("chunk", [None, 256])
def test_own_keys_ragged_path(seed, chunk, gathered, every_row, monkeypatch):
    """``RAGGED_OWN_KEYS``: mixed batches with the step's own keys from its K/V (ragged,
    FA3 on sm_90), the earlier ones paged, merged by LSE, against the reference.
    ``gathered`` (``RAGGED_EARLIER``): segments of 64+ rows read their earlier keys copied
    from the pages in blocks of at most 700 keys (several a long segment), ragged too."""
    from chunklocal.backends.flashinfer import backend as fi_backend

    monkeypatch.setattr(fi_backend, "RAGGED_OWN_KEYS", True)
    monkeypatch.setattr(fi_backend, "RAGGED_EARLIER", gathered)
    monkeypatch.setattr(fi_backend, "GATHER_MIN_ROWS", 64)
    rng = np.random.default_rng(seed)
    n, model_len = 8, 2048
    backend = FlashInferBackend(spec(chunk), EngineLimits(n, 4096, model_len, BS), HQ, HKV,
                                D, DT, "cuda")
    backend.gather.keys = 700
    q_lens = np.where(rng.random(n) < 0.3, 1, rng.integers(2, 500, n))
    context = rng.integers(0, model_len - q_lens + 1)
    context[0] = 0  # one request with no earlier keys
    if every_row:  # on global layers every row reads earlier keys: the parts run on q
        context = np.maximum(context, 1)
    seq = context + q_lens
    width = -(-model_len // BS)
    k, v = kv_cache(n * width + 1, seed)
    table = tables(rng, n, width, n * width + 1)
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    q = queries(int(qsl[-1]), seed + 10)
    rows = own_rows(qsl, seq, table)
    md = backend.build(qsl, seq, table)
    assert all(isinstance(w, fi_backend.OwnKeys) for w in md.wrappers.values())
    if gathered and chunk is None and not every_row:  # a long segment's keys span blocks
        assert max(len(w.blocks) for w in md.wrappers.values()) > 1
    if every_row and chunk is None and not gathered:
        from chunklocal.backends.flashinfer.own_keys import ALL_ROWS
        assert all(w.rows is ALL_ROWS for w in md.wrappers.values())
    own_k, own_v = k.view(-1, HKV, D)[rows], v.view(-1, HKV, D)[rows]
    if seed % 2:  # as the engine passes them: strided views of one fused projection's rows
        fused = torch.full((own_k.shape[0], HQ + 2 * HKV, D), NAN, dtype=DT, device="cuda")
        fused[:, HQ:HQ + HKV], fused[:, HQ + HKV:] = own_k, own_v
        own_k, own_v = fused[:, HQ:HQ + HKV], fused[:, HQ + HKV:]
        assert not own_k.is_contiguous() and not own_v.is_contiguous()
    out = run_eager(backend, q, k, v, qsl, seq, table, k=own_k, v=own_v)
    check(out, q, k, v, qsl, seq, table, chunk)


# ------------------------------------------------------------------- (c)
def decode_steps(rng, batch, model_len, count):
    """Changing real batch sizes (<= batch) and lengths, short and long."""
    steps = []
    for i in range(count):
        n = batch if i == 0 else int(rng.integers(1, batch + 1))
        seq = rng.integers(1, model_len + 1, n)
        seq[rng.random(n) < 0.3] = rng.integers(1, 4)
        steps.append(seq)
    return steps


@pytest.mark.parametrize("replan", [False, True], ids=["planned-once", "replanned"])
@pytest.mark.parametrize("chunk", [None, 512])
def test_decode_graph_replay_changing_lengths(chunk, replan, monkeypatch):
    """Replays of one captured decode graph over random lengths, longer and shorter, against
    the reference: planned once for the longest keys, or re-planned by each ``build``
    (``GRAPH_REPLAN``)."""
    from chunklocal.backends.flashinfer import backend as fi_backend

    monkeypatch.setattr(fi_backend, "GRAPH_REPLAN", replan)
    rng = np.random.default_rng(1)
    model_len, sizes = 2048, (1, 4, 8)
    limits = EngineLimits(8, 4096, model_len, BS)
    backend = FlashInferBackend(spec(chunk), limits, HQ, HKV, D, DT, "cuda", True,
                                graph_batch_sizes=sizes, scratch_page=0)
    width = -(-model_len // BS)
    num_pages = 8 * width + 1
    k, v = kv_cache(num_pages, 2)
    for batch in sizes:
        steps = decode_steps(rng, batch, model_len, 4)
        q_static = torch.zeros(batch, HQ, D, device="cuda", dtype=DT)
        out_static = torch.zeros_like(q_static)
        md = backend.capture_step(batch, 1)  # what the engine captures: all padding
        backend.forward(md, q_static, k, v, SCALE, out=out_static)  # warm-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            backend.forward(md, q_static, k, v, SCALE, out=out_static)
        for i, seq in enumerate(steps):
            n = seq.shape[0]
            table = tables(rng, n, width, num_pages)
            assert backend.build(np.arange(n + 1), seq, table, graph_batch_size=batch) is md
            q_static.copy_(queries(batch, 100 + i))
            out_static.fill_(NAN)
            graph.replay()
            check(out_static[:n], q_static[:n], k, v, np.arange(n + 1), seq, table, chunk)


# ------------------------------------------------------------------- (d)
def verify_lengths(rng, n, chunk, model_len, query_len):
    """Half the windows straddle a chunk boundary (s - query_len < b <= s - 1)."""
    boundary = rng.integers(1, model_len // chunk, n) * chunk
    straddle = boundary + rng.integers(1, query_len, n)
    inside = rng.integers(query_len, model_len + 1, n)
    inside = np.where(inside % chunk < query_len, inside // chunk * chunk + query_len, inside)
    inside = np.minimum(inside, model_len)
    seq = np.where(np.arange(n) % 2 == 0, straddle, inside)
    crosses = (seq - query_len) // chunk != (seq - 1) // chunk
    return seq, crosses


@pytest.mark.parametrize("chunk", [512, None])
def test_verify_k3_graph_straddling_windows(chunk):
    rng = np.random.default_rng(5)
    model_len, batch, query_len = 2048, 8, 4  # k = 3 draft tokens
    limits = EngineLimits(8, 4096, model_len, BS)
    backend = FlashInferBackend(spec(chunk), limits, HQ, HKV, D, DT, "cuda", True,
                                graph_batch_sizes=(batch,), verify_len=query_len,
                                scratch_page=0)
    width = -(-model_len // BS)
    num_pages = 8 * width + 1
    k, v = kv_cache(num_pages, 6)
    q_static = torch.zeros(batch * query_len, HQ, D, device="cuda", dtype=DT)
    out_static = torch.zeros_like(q_static)
    md = backend.capture_step(batch, query_len)  # what the engine captures: all padding
    backend.forward(md, q_static, k, v, SCALE, out=out_static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.forward(md, q_static, k, v, SCALE, out=out_static)
    for i, n in enumerate((batch, 5, batch)):
        seq, crosses = verify_lengths(rng, n, 512, model_len, query_len)
        assert crosses.sum() == (n + 1) // 2
        table = tables(rng, n, width, num_pages)
        assert backend.build(np.arange(n + 1) * query_len, seq, table,
                             graph_batch_size=batch) is md
        q_static.copy_(queries(batch * query_len, 300 + i))
        out_static.fill_(NAN)
        graph.replay()
        rows = n * query_len
        check(out_static[:rows], q_static[:rows], k, v, np.arange(n + 1) * query_len, seq,
              table, chunk)


# ------------------------------------------------------------------- (e)
def test_merged_group_global_and_chunked_layers():
    rng = np.random.default_rng(7)
    n, model_len, chunk = 6, 2048, 256
    limits = EngineLimits(n, 4096, model_len, BS)
    merged = merge([spec(chunk), spec(None)])
    backend = FlashInferBackend(merged, limits, HQ, HKV, D, DT, "cuda", True,
                                graph_batch_sizes=(n,), scratch_page=0)
    width = -(-model_len // BS)
    num_pages = n * width + 1
    k, v = kv_cache(num_pages, 8)
    q_lens = np.array([1, 700, 1, 300, 5, 1])
    seq = q_lens + rng.integers(0, model_len - q_lens + 1)
    table = tables(rng, n, width, num_pages)
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    q = queries(int(qsl[-1]), 9)
    md = backend.build(qsl, seq, table)  # one build serves both layer kinds
    own = own_kv(md, k, v, qsl, seq, table)
    with pytest.raises(ValueError, match="pass kind=Kind.CHUNKED or kind=Kind.GLOBAL"):
        backend.forward(md, q, k, v, SCALE, **own)
    for kind in Kind:
        out = torch.full_like(q, NAN)
        backend.forward(md, q, k, v, SCALE, kind=kind, out=out, **own)
        check(out, q, k, v, qsl, seq, table, chunk if kind is Kind.CHUNKED else None)
    # Decode under a graph, both kinds from one graph build.
    dec_seq = rng.integers(1, model_len + 1, n)
    md = backend.build(np.arange(n + 1), dec_seq, table, graph_batch_size=n)
    q_dec = queries(n, 11)
    for kind in Kind:
        out = torch.full_like(q_dec, NAN)
        backend.forward(md, q_dec, k, v, SCALE, kind=kind, out=out)
        check(out, q_dec, k, v, np.arange(n + 1), dec_seq, table,
              chunk if kind is Kind.CHUNKED else None)
