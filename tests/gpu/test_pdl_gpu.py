"""Programmatic dependent launch (``quant_triton.PDL_ENABLED``) on the GPU: the Triton
kernels of a decode step's MoE layers, chained as the engine chains them (norm, the
router's cuBLAS GEMM between, routing, quantization, both expert GEMMs, the combine, the
next layer's norm), give the same bits with PDL as without it, eagerly and replayed from a
CUDA graph over several inputs.  A kernel that read or wrote before its ``pdl_start`` could
see its predecessor's output half written; tests/test_triton_sm90.py checks on the CPU
that every kernel's code waits first.

Skips without CUDA or on a device before sm_90.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from chunklocal.models import (  # noqa: E402
    moe_triton,
    norm_triton,
    quant_triton,
    route_triton,
)
from chunklocal.models.quant import FP8  # noqa: E402
from chunklocal.models.quant_triton import QuantRows  # noqa: E402

BF16 = torch.bfloat16
HIDDEN, INNER, EXPERTS, LAYERS = 5120, 8192, 16, 4


def fp8(shape, gen):
    w = torch.randn(*shape, generator=gen) * shape[-1] ** -0.5
    scale = w.abs().amax(-1).clamp(min=1e-6) / 448.0
    return (w / scale[..., None]).to(FP8).cuda(), scale.float().cuda()


def make_layers(seed=0):
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        w13, s13 = fp8((EXPERTS + 1, 2 * INNER, HIDDEN), gen)  # the shared expert: group E
        w2, s2 = fp8((EXPERTS + 1, HIDDEN, INNER), gen)
        router = (torch.randn(EXPERTS, HIDDEN, generator=gen) * HIDDEN ** -0.5).to(BF16).cuda()
        norm = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(BF16).cuda()
        layers.append((w13, s13, w2, s2, router, norm))
    return layers


def forward(h, residual, layers):
    """``LAYERS`` MoE layers of a decode step, as the engine launches them."""
    tokens = h.shape[0]
    for w13, s13, w2, s2, router, norm in layers:
        normed, residual = norm_triton.add_rms_norm_rows(h, residual, norm, 1e-5)
        logits = normed @ router.T  # cuBLAS: a kernel without PDL in the chain
        _order, offs, token, score, rank = route_triton.route_pairs(logits, EXPERTS, True,
                                                                    BF16)
        rows = QuantRows(*quant_triton.quantize_rows(normed, None, token, score), BF16)
        gate_up = moe_triton.fp8_grouped_mm_small(rows, w13, s13, offs, group_rows=tokens)
        inner = QuantRows(*quant_triton.silu_mul_quantize(gate_up), BF16)
        out = moe_triton.fp8_grouped_mm_small(inner, w2, s2, offs, group_rows=tokens)
        h = route_triton.combine_rows(out, rank, tokens, 2)
    return norm_triton.add_rms_norm_rows(h, residual, layers[-1][5], 1e-5)


@pytest.mark.parametrize("tokens", [1, 4], ids=["gemv", "split-k"])
def test_pdl_chain_gives_the_same_bits_eager_and_replayed(tokens, monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90")
    layers = make_layers()
    gen = torch.Generator().manual_seed(tokens)
    inputs = [(torch.randn(tokens, HIDDEN, generator=gen).to(BF16).cuda(),
               torch.randn(tokens, HIDDEN, generator=gen).to(BF16).cuda()) for _ in range(3)]
    monkeypatch.setattr(quant_triton, "PDL_ENABLED", False)
    want = [forward(h, r, layers) for h, r in inputs]

    monkeypatch.setattr(quant_triton, "PDL_ENABLED", True)
    assert quant_triton.pdl_args(inputs[0][0]) == {"PDL": True, "launch_pdl": True}
    for (h, r), (normed, total) in zip(inputs, want, strict=True):
        got = forward(h, r, layers)
        assert torch.equal(got[0], normed) and torch.equal(got[1], total)

    static_h, static_r = (t.clone() for t in inputs[0])
    forward(static_h, static_r, layers)  # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward(static_h, static_r, layers)
    for _round in range(3):
        for (h, r), (normed, total) in zip(inputs, want, strict=True):
            static_h.copy_(h)
            static_r.copy_(r)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out[0], normed) and torch.equal(out[1], total)
