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

import os
from collections.abc import Sequence

import torch
from torch import nn

from chunklocal.models.quant import FP8, Fp8Linear

#: Fuse at load (``models.loader.load_model``); False keeps the checkpoint's modules (A/B).
FUSE_PROJECTIONS = True

#: ``act(gate) * up`` of a fused ``[gate | up]`` as FlashInfer's one-kernel
#: ``flashinfer.activation.silu_and_mul`` (CUDA, SiLU): torch runs the SiLU and the product
#: as two kernels over the strided halves, 18.8 + 26.0 ms of a full-size Scout FP8 8k
#: prefill step of 440 (96 + 159 launches; BENCHMARKS.md, thirteenth session), where one
#: pass reads the pair once and writes the product once.  It rounds to bf16 once (torch:
#: after the SiLU and after the product).  On by default since the fourteenth session's H200
#: run (8k / 32k prefill 0.435 -> 0.415 s / 2.05 -> 1.96 s); ``CHUNKLOCAL_SILU_MUL=0`` is torch.
SILU_MUL_ENABLED = os.environ.get("CHUNKLOCAL_SILU_MUL", "1") == "1"


def is_silu(act: nn.Module) -> bool:
    """transformers' ``ACT2FN["silu"]`` (SiLUActivation, or nn.SiLU in other versions)."""
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def silu_mul_available(gate_up: torch.Tensor, act: nn.Module) -> bool:
    """FlashInfer's ``silu_and_mul`` runs on ``gate_up`` and is switched on: CUDA rows of
    bf16/fp16, contiguous (its kernel walks rows from the data pointer), an even width
    (its check).  Each half a whole number of 16-byte vectors too: 0.7.2.post1 no longer
    asks it, but that keeps to its full-width vector loads until an H200 run has measured
    the switch (every Llama-4 width is such a multiple)."""
    return (SILU_MUL_ENABLED and gate_up.is_cuda and is_silu(act)
            and gate_up.dtype in (torch.bfloat16, torch.float16) and gate_up.is_contiguous()
            and gate_up.shape[-1] % 2 == 0
            and gate_up.shape[-1] // 2 * gate_up.element_size() % 16 == 0)


def gated_act(gate_up: torch.Tensor, act: nn.Module) -> torch.Tensor:
    """``act(gate) * up`` for ``gate_up = [gate | up]`` along the last dim: FlashInfer's
    ``silu_and_mul`` where :func:`silu_mul_available`, else torch, the activation's own
    output taking the product in place (one ``[T, inner]`` less at the memory peak)."""
    if silu_mul_available(gate_up, act):
        import flashinfer.activation

        return flashinfer.activation.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate).mul_(up)


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
        if self.gate_up_proj is not None:
            return gated_act(self.gate_up_proj(x), self.act)
        # In place on the activation's own output: one [T, inner] less at the peak.
        return self.act(self.gate_proj(x)).mul_(self.up_proj(x))
