"""quant_triton's one-kernel per-token FP8 quantization, compiled on the GPU: the same bytes
and scales as torch's chain of kernels (``quant.quantize_per_token`` with the switch off) on
random bf16 rows of very different magnitudes, eagerly and replayed in a CUDA graph with new
rows, and the same FP8 GEMM output through ``quant.fp8_linear`` (the CPU interpreter test,
tests/test_moe_triton.py, can only use rows whose quantization is exact).  The engine's
tokens with it (on by default): ``pytest tests/gpu/test_fp8_gpu.py``."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from gpu_rows import spread_rows  # noqa: E402

from chunklocal.models import moe_triton, quant_triton  # noqa: E402
from chunklocal.models.quant import FP8, fp8_linear, quantize_per_token  # noqa: E402


def rows(m, k, seed):
    x = spread_rows(m, k, seed, decades=3)
    x[0] = 0.0  # the amax floor
    return x


def same_bits(got, want):
    (gq, gs), (wq, ws) = got, want
    assert gq.dtype == FP8 and gs.shape == ws.shape
    assert torch.equal(gq.view(torch.uint8), wq.view(torch.uint8))
    assert torch.equal(gs, ws)


@pytest.mark.parametrize("k", [100, 5120, 8192, 16384])
@pytest.mark.parametrize("ub", [None, 1200.0, 2.0])
def test_the_kernel_gives_torchs_bytes(k, ub, monkeypatch):
    monkeypatch.setattr(quant_triton, "QUANT_ENABLED", False)
    for m in (1, 7, 64):
        x = rows(m, k, seed=k + m)
        same_bits(quant_triton.quantize_rows(x, ub), quantize_per_token(x, ub))


def test_replays_in_a_cuda_graph_with_new_rows(monkeypatch):
    monkeypatch.setattr(quant_triton, "QUANT_ENABLED", False)
    x = rows(16, 5120, seed=1)
    quant_triton.quantize_rows(x)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = quant_triton.quantize_rows(x)
    for seed in (2, 3):
        x.copy_(rows(16, 5120, seed=seed))
        graph.replay()
        same_bits(out, quantize_per_token(x))


def test_fp8_linear_gives_the_same_output_through_the_kernel(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(384, 5120, generator=gen) * 8).to(FP8).cuda()
    w_scale = (torch.rand(384, generator=gen) * 1e-3 + 1e-4).cuda()
    x = rows(5, 5120, seed=5)
    monkeypatch.setattr(moe_triton, "FP8_ENABLED", False)  # torch's GEMM, both times
    monkeypatch.setattr(quant_triton, "QUANT_ENABLED", False)
    want = fp8_linear(x, w, w_scale)
    monkeypatch.setattr(quant_triton, "QUANT_ENABLED", True)
    assert torch.equal(fp8_linear(x, w, w_scale), want)


@pytest.mark.parametrize("k", [100, 5120])
@pytest.mark.parametrize("ub", [None, 2.0])
def test_gathered_scaled_rows_give_the_products_bytes(k, ub):
    """``quantize_rows(x, ub, rows, row_scale)`` (moe.GATHER_QUANT's kernel): the bytes and
    scales of quantizing torch's bf16 ``x[rows] * row_scale`` (repeated and unused rows)."""
    x = rows(33, k, seed=k + 7)
    idx = torch.randint(0, 33, (50,), generator=torch.Generator().manual_seed(k),
                        ).cuda()
    scale = (torch.rand(50, generator=torch.Generator().manual_seed(1)) + 0.25).bfloat16()
    scale = scale.cuda()
    same_bits(quant_triton.quantize_rows(x, ub, idx, scale),
              quant_triton.quantize_rows(x[idx] * scale[:, None], ub))


@pytest.mark.parametrize("inner", [100, 8192])
@pytest.mark.parametrize("ub", [None, 2.0])
def test_silu_mul_quantize_against_the_products_quantization(inner, ub):
    """``silu_mul_quantize`` (moe.SILU_QUANT's kernel) against quantizing FlashInfer's
    ``silu_and_mul`` product (the path it replaces): the SiLU's exp may differ by an ulp,
    so a bf16 product and then an FP8 byte may too, rarely; scales within a bf16 ulp."""
    import flashinfer.activation

    gate_up = rows(64, 2 * inner, seed=inner)
    q, s = quant_triton.silu_mul_quantize(gate_up, ub)
    wq, ws = quant_triton.quantize_rows(flashinfer.activation.silu_and_mul(gate_up), ub)
    assert q.shape == wq.shape == (64, inner) and s.shape == ws.shape
    same = (q.view(torch.uint8) == wq.view(torch.uint8)).float().mean().item()
    assert same >= 0.999, same
    assert torch.allclose(s, ws, rtol=2.0 ** -7, atol=0)


@pytest.mark.parametrize("k", [100, 5120, 8192])
@pytest.mark.parametrize("ub", [None, 2.0])
def test_one_pass_gives_the_two_pass_bytes(k, ub, monkeypatch):
    """quant_triton.ONE_PASS_ENABLED (rows held in registers, 16 warps at 8192): every
    form's bytes and scales are the two-pass kernel's, eagerly and replayed in a CUDA graph
    with new rows."""
    x, gate_up = rows(16, k, seed=k), rows(16, 2 * k, seed=k + 1)
    idx = torch.randint(0, 16, (24,), generator=torch.Generator().manual_seed(k)).cuda()
    rs = (torch.rand(24, generator=torch.Generator().manual_seed(2)) + 0.25).bfloat16().cuda()
    forms = [lambda: quant_triton.quantize_rows(x, ub),
             lambda: quant_triton.quantize_rows(x, ub, idx, rs),
             lambda: quant_triton.silu_mul_quantize(gate_up, ub)]
    for form in forms:
        monkeypatch.setattr(quant_triton, "ONE_PASS_ENABLED", False)
        want = form()
        monkeypatch.setattr(quant_triton, "ONE_PASS_ENABLED", True)
        same_bits(form(), want)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = form()
        x.copy_(rows(16, k, seed=k + 2))
        gate_up.copy_(rows(16, 2 * k, seed=k + 3))
        graph.replay()
        monkeypatch.setattr(quant_triton, "ONE_PASS_ENABLED", False)
        same_bits(out, form())
