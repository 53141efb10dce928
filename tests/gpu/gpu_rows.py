"""Test rows for the GPU kernels' tests: bf16 on CUDA, magnitudes spread over decades."""

from __future__ import annotations

import torch


def spread_rows(m: int, n: int, seed: int, decades: int) -> torch.Tensor:
    """``[m, n]`` normal rows scaled from 10**-decades (first row) to 10**decades (last)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=gen) * torch.logspace(-decades, decades, m).view(-1, 1)
    return x.bfloat16().cuda()
