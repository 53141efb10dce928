"""norm_triton's kernels, compiled on the GPU, against torch's path (the switch off):
residual add + RMSNorm (``llama4.add_rms_norm``) on bf16 rows of Scout's and Maverick's
hidden size and of very different magnitudes, the residual sum bit for bit and the
normalized rows within one bf16 unit (the mean's float32 summation order is the kernel's
own); rope + QK norm (``llama4.rope_heads``) on Scout's query and key heads cut from a fused
projection's rows, within one bf16 unit; both eagerly and replayed in a CUDA graph with new
inputs; and the trained copy model's greedy tokens with the kernels on against
transformers (the CPU interpreter test is tests/test_norm_triton.py)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from gpu_rows import spread_rows  # noqa: E402

from chunklocal.models import norm_triton  # noqa: E402
from chunklocal.models.llama4 import RMSNorm, add_rms_norm, rope_heads  # noqa: E402


def rows(m, n, seed):
    return spread_rows(m, n, seed, decades=2)


def norm_of(n, seed):
    norm = RMSNorm(n, 1e-5).cuda().bfloat16()
    gen = torch.Generator().manual_seed(seed)
    norm.weight.data = (torch.rand(n, generator=gen) + 0.5).bfloat16().cuda()
    return norm


def torch_path(h, residual, norm, monkeypatch):
    monkeypatch.setattr(norm_triton, "NORM_ENABLED", False)
    out = add_rms_norm(h, residual, norm)
    monkeypatch.setattr(norm_triton, "NORM_ENABLED", True)
    return out


def within_one_bf16_unit(got, want, scale=None):
    """|got - want| at most one bf16 unit in the last place of want (2**-7 relative), plus,
    where ``scale`` is given, float32 rounding of the terms that made want (2**-20 of
    ``scale``): a rotated component is a difference of two products, and where they
    cancel, want is far smaller than the products whose last-place rounding (fused or not)
    it carries."""
    diff = (got.float() - want.float()).abs()
    slack = 1e-30 if scale is None else scale * 2**-20
    assert (diff <= want.float().abs() * 2**-7 + slack).all(), diff.max()
    assert (got == want).float().mean() > 0.95  # nearly all bit for bit


def pair_magnitude(x):
    """|(re, im)| of each rotated pair of heads ``x [T, H, D]``, for both of its entries:
    the size of the products a rotated component is the difference of."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    return pairs.norm(dim=-1, keepdim=True).expand_as(pairs).reshape(x.shape)


@pytest.mark.parametrize("n", [5120, 8192])
@pytest.mark.parametrize("m", [1, 16, 64, 300])
@pytest.mark.parametrize("with_residual", [True, False])
def test_the_kernel_gives_torchs_sum_and_norm(n, m, with_residual, monkeypatch):
    h, r, norm = rows(m, n, seed=m), rows(m, n, seed=m + 1), norm_of(n, seed=n)
    residual = r if with_residual else None
    want_out, want_total = torch_path(h, residual, norm, monkeypatch)
    assert norm_triton.norm_available(h)
    got_out, got_total = add_rms_norm(h, residual, norm)
    assert torch.equal(got_total, want_total)
    within_one_bf16_unit(got_out, want_out)


def test_replays_in_a_cuda_graph_with_new_rows(monkeypatch):
    monkeypatch.setattr(norm_triton, "NORM_ENABLED", True)
    h, r, norm = rows(16, 5120, seed=1), rows(16, 5120, seed=2), norm_of(5120, seed=3)
    add_rms_norm(h, r, norm)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, total = add_rms_norm(h, r, norm)
    for seed in (4, 5):
        h.copy_(rows(16, 5120, seed=seed))
        r.copy_(rows(16, 5120, seed=seed + 10))
        graph.replay()
        want_out, want_total = torch_path(h, r, norm, monkeypatch)
        assert torch.equal(total, want_total)
        within_one_bf16_unit(out, want_out)


def scout_heads(tokens, seed):
    """q [T, 40, 128] and k [T, 8, 128] as views of one fused q/k/v row each, and the
    step's freqs_cis at scattered positions (Scout's rope theta)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (40 + 16) * 128, generator=gen) * 4).bfloat16().cuda()
    positions = torch.randint(0, 1 << 20, (tokens,), generator=gen).cuda()
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    angles = positions.float()[:, None] * inv_freq[None, :]
    freqs = torch.polar(torch.ones_like(angles), angles)
    return (qkv[:, :40 * 128].view(tokens, 40, 128),
            qkv[:, 40 * 128:48 * 128].view(tokens, 8, 128), freqs, qkv)


def rope_mode(monkeypatch, mode) -> None:
    """One head a program (False), tiles of heads (True: ROPE_TILED), or tiles read and
    written as whole heads ("vec": ROPE_VEC)."""
    monkeypatch.setattr(norm_triton, "ROPE_TILED", mode is True)
    monkeypatch.setattr(norm_triton, "ROPE_VEC", mode == "vec")


@pytest.mark.parametrize("tiled", [False, True, "vec"], ids=["one-head", "tiled", "vec"])
@pytest.mark.parametrize("tokens", [1, 64, 257])
@pytest.mark.parametrize("eps", [1e-5, None])
def test_rope_kernel_gives_torchs_heads(tokens, eps, tiled, monkeypatch):
    """``tiled``: CHUNKLOCAL_ROPE_TILED (16 heads a program; Scout's 40 query heads take
    two full tiles and a masked one); ``vec`` (CHUNKLOCAL_ROPE_VEC): those tiles read and
    written as whole heads.  Each within one bf16 unit of torch's (not the bits of one
    head a program: a tile's float32 sum and FMA contraction differ, as the 29th session's
    run showed)."""
    rope_mode(monkeypatch, tiled)
    q, k, freqs, _ = scout_heads(tokens, seed=tokens)
    for x in (q, k):
        monkeypatch.setattr(norm_triton, "NORM_ENABLED", False)
        want = rope_heads(x, freqs, eps)
        monkeypatch.setattr(norm_triton, "NORM_ENABLED", True)
        assert norm_triton.rope_available(x)
        within_one_bf16_unit(rope_heads(x, freqs, eps), want, pair_magnitude(want))


@pytest.mark.parametrize("tiled", [False, True, "vec"], ids=["one-head", "tiled", "vec"])
@pytest.mark.parametrize("tokens", [1, 64])
def test_rope_of_queries_and_keys_in_one_launch(tokens, tiled, monkeypatch):
    """llama4.rope_qk: the fused projection's q and k heads in one launch, the bits of one
    launch each, eagerly and replayed from a CUDA graph (tiled: the split inside a tile)."""
    from chunklocal.models.llama4 import rope_qk

    monkeypatch.setattr(norm_triton, "NORM_ENABLED", True)
    rope_mode(monkeypatch, tiled)
    q, k, freqs, _ = scout_heads(tokens, seed=5)
    calls, real = [], norm_triton.rope_norm_rows
    monkeypatch.setattr(norm_triton, "rope_norm_rows",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got_q, got_k = rope_qk(q, k, freqs, 1e-5)
    assert calls == [1]
    assert torch.equal(got_q, real(q, freqs, 1e-5)) and torch.equal(got_k, real(k, freqs, 1e-5))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_q, out_k = rope_qk(q, k, freqs, 1e-5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_q, got_q) and torch.equal(out_k, got_k)


def test_rope_kernel_replays_in_a_cuda_graph(monkeypatch):
    monkeypatch.setattr(norm_triton, "NORM_ENABLED", True)
    q, _, freqs, qkv = scout_heads(16, seed=1)
    rope_heads(q, freqs, 1e-5)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rope_heads(q, freqs, 1e-5)
    for seed in (2, 3):
        _, _, new_freqs, new_qkv = scout_heads(16, seed=seed)
        qkv.copy_(new_qkv)
        freqs.copy_(new_freqs)
        graph.replay()
        monkeypatch.setattr(norm_triton, "NORM_ENABLED", False)
        want = rope_heads(q, freqs, 1e-5)
        within_one_bf16_unit(out, want, pair_magnitude(want))
        monkeypatch.setattr(norm_triton, "NORM_ENABLED", True)


@torch.inference_mode()
def test_engine_tokens_with_the_kernels_match_transformers(copy_model, monkeypatch):
    """The trained copy model (conftest.py) with both kernels on: greedy tokens, CUDA
    graphs, against transformers bf16, as test_engine_gpu's bf16 test asks of the default
    path."""
    from llama4_tiny import copy_prompts
    from test_engine_gpu import LENGTHS, NEW, engine, hf_generate, load_hf, same_fraction

    monkeypatch.setattr(norm_triton, "NORM_ENABLED", True)
    calls, real, rope = [], norm_triton.add_rms_norm_rows, norm_triton.rope_norm_rows
    monkeypatch.setattr(norm_triton, "add_rms_norm_rows",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(norm_triton, "rope_norm_rows",
                        lambda *a, **k: calls.append(2) or rope(*a, **k))
    prompts = copy_prompts(LENGTHS, seed=1, vocab=128)
    llm = engine(copy_model)
    outs = llm.generate(prompts, max_new_tokens=NEW, ignore_eos=True)
    assert 1 in calls and 2 in calls and llm.runner.graph_steps > 0
    refs = hf_generate(load_hf(copy_model, torch.bfloat16), prompts)
    assert same_fraction(outs, refs) >= 0.95
