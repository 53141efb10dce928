"""Projections that read the same input, fused into one GEMM after loading.

``q_proj``, ``k_proj`` and ``v_proj`` of an attention layer all multiply the normed hidden
state, as do ``gate_proj`` and ``up_proj`` of a dense MLP or shared expert.  Run apart, a
decode step pays each GEMM's fixed cost (and, for FP8, each per-token quantization of the
same rows: several small kernels apiece) three or two times.  :func:`fuse_projections`
concatenates their weights along the output features once the checkpoint has loaded
(vLLM's ``qkv_proj`` / ``gate_up_proj``), so the step runs one GEMM on one quantization.

Exactness: a fused GEMM's output column ``j`` is the same dot product as column ``j`` of the
part it came from (the same quantized rows for FP8, since the per-token scale depends only
on the input row; per-output-channel weight scales and biases are concatenated with their
rows).  Only the library's choice of kernel for the wider matrix can change rounding.

The checkpoint keeps its own names (routes, shard rules and tensor-parallel slices are
those of the parts: each rank fuses its own slices, ``[q slice | k slice | v slice]``).
The parts are freed as each layer is fused, so the peak is one layer's projections more.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from chunklocal.models.quant import FP8, Fp8Linear

#: Fuse at load (``models.loader.load_model``); False keeps the checkpoint's modules (A/B).
FUSE_PROJECTIONS = True


def concat_linears(parts: Sequence[nn.Module]) -> nn.Module:
    """One linear whose outputs are ``parts``' outputs side by side (same input features,
    all ``nn.Linear`` or all :class:`Fp8Linear` with the same activation cap and no
    cross-rank amax)."""
    kinds = {type(p) for p in parts}
    if len(kinds) != 1 or kinds.pop() not in (nn.Linear, Fp8Linear):
        raise ValueError(f"cannot fuse {[type(p).__name__ for p in parts]}: one kind of "
                         "Linear is needed")
    linears = [p for p in parts if isinstance(p, (nn.Linear, Fp8Linear))]
    if len({p.in_features for p in linears}) != 1 \
            or len({p.bias is None for p in linears}) != 1:
        raise ValueError("fused projections need the same input features and all or no bias")
    first, out_features = linears[0], sum(p.out_features for p in linears)
    # FP8 weights are concatenated as bytes: a copy any device's cat does for uint8
    weight = torch.cat([p.weight.data.view(torch.uint8) if p.weight.dtype == FP8
                        else p.weight.data for p in linears]).view(first.weight.dtype)
    biases = [p.bias.data for p in linears if p.bias is not None]
    bias = torch.cat(biases) if biases else None
    fused: nn.Module
    with torch.device("meta"):  # shapes only: the concatenated tensors are assigned below
        if isinstance(first, Fp8Linear):
            fp8 = [p for p in linears if isinstance(p, Fp8Linear)]
            if len({p.act_scale_ub for p in fp8}) != 1 or any(p.amax_reduce for p in fp8):
                raise ValueError("fused FP8 projections need one activation cap and no "
                                 "cross-rank amax")
            fused = Fp8Linear(first.in_features, out_features, bias is not None,
                              first.act_scale_ub)
            scales = torch.cat([p.weight_scale.reshape(-1) for p in fp8])
        else:
            fused = nn.Linear(first.in_features, out_features, bias=bias is not None)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if isinstance(fused, Fp8Linear):
        fused.weight_scale = nn.Parameter(scales, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


def fuse_into(owner: nn.Module, names: tuple[str, ...], fused_name: str) -> list[int] | None:
    """Replace ``owner``'s modules ``names`` by one ``fused_name``; returns the split
    sizes (output features of each part, in order), or None, changing nothing, where the
    parts cannot share a GEMM (a checkpoint that quantizes some of them and not the others
    keeps them apart)."""
    parts = [getattr(owner, n) for n in names]
    sizes = [p.out_features for p in parts]
    try:
        fused = concat_linears(parts)
    except ValueError:
        return None
    setattr(owner, fused_name, fused)
    for n in names:
        delattr(owner, n)
    return sizes


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Fuse every attention layer's q/k/v and every dense MLP's and shared expert's
    gate/up of a loaded model (modules that define ``fuse()``), unless
    ``FUSE_PROJECTIONS`` is off; returns how many."""
    count = 0
    if not FUSE_PROJECTIONS:
        return count
    for module in list(model.modules()):
        fuse = getattr(module, "fuse", None)
        if callable(fuse) and fuse():
            count += 1
    return count


class GatedMLPBase(nn.Module):
    """``down(act(gate(x)) * up(x))``'s projections, whose gate and up can fuse into one
    ``gate_up_proj`` (output ``[gate | up]``); subclasses make ``act`` and the three
    projections and own ``down_proj`` and the forward."""

    act: nn.Module
    gate_proj: nn.Module
    up_proj: nn.Module

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj: nn.Module | None = None  # set by fuse()

    def fuse(self) -> bool:
        if self.gate_up_proj is not None:  # fused already
            return False
        return fuse_into(self, ("gate_proj", "up_proj"), "gate_up_proj") is not None

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """``act(gate(x)) * up(x)``: the down projection's input."""
        # In place on the activation's own output: one [T, inner] less at the peak.
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.act(gate).mul_(up)
        return self.act(self.gate_proj(x)).mul_(self.up_proj(x))
