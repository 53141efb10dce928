"""FP8 (e4m3) weights with dynamic per-token activation scales: the math of both published
Llama-4 FP8 layouts (fbgemm_fp8 and compressed-tensors FP8-dynamic).

A weight ``w [N, K]`` is stored as float8_e4m3fn with one float32 scale per output
channel, ``w_scale [N]``: the real weight is ``w * w_scale[:, None]``.  Activations are
quantized at run time, one scale per token (row): ``scale = max(|x|) / 448`` (the amax
clamped to ``[1e-12, scale_ub]``), ``x_fp8 = clamp(x / scale, -448, 448)``.  The product
is ``(x_fp8 * scale) @ (w * w_scale).T``.

On CUDA the FP8 operands go to the FP8 tensor cores (``torch._scaled_mm`` with row-wise
scales, ``torch._scaled_grouped_mm`` for experts); elsewhere the same fake-quantized math
runs in float32 on dequantized weights, which is also the oracle the GPU path is tested
against.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from chunklocal.models.quant_triton import QuantRows

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0          # largest finite e4m3fn value
AMAX_FLOOR = 1e-12       # an all-zero row quantizes to zeros instead of dividing by zero
# Dense FP8 layers of at most this many rows (decode steps) run moe_triton's small-M kernel,
# with the activation quantization fused in, where Triton runs (CUDA); larger ones, and
# row-parallel slices (their amax is reduced across ranks) or layers with a bias, go
# through torch._scaled_mm.  16 from benchmarks/fp8_small_m.py on the H200 (2026-12-02):
# the kernel took 18-22 us for Scout's dense shapes at 1-16 rows against 29-37 us for
# torch's path, and 50 us against 23-28 us at 64 rows (it re-streams the weights per
# 16-row tile).
SMALL_M_ROWS = 16


def parse_fast_accum(value: str) -> tuple[bool, bool]:
    """(routed experts, dense layers) from ``CHUNKLOCAL_FP8_FAST_ACCUM``."""
    forms = {"0": (False, False), "experts": (True, False), "1": (True, True)}
    if value not in forms:
        raise ValueError(f"CHUNKLOCAL_FP8_FAST_ACCUM={value!r}: expected one of {sorted(forms)}")
    return forms[value]


#: Which of torch's FP8 GEMMs (the prefill-sized ones: decode sizes take the Triton kernels)
#: keep the tensor cores' own FP8 partial sums instead of promoting them to float32 every few
#: K blocks (``use_fast_accum``): ``0`` none, ``experts`` the routed experts' grouped GEMM,
#: ``1`` that and the dense layers.  vLLM's sm90 FP8 kernels (CUTLASS's FP8FastAccum
#: schedules, its Triton MoE kernel) all accumulate so; torch's grouped kernel also takes a
#: 256 x 128 tile with it where the promoting form keeps 128 x 128 (ScaledGroupMM.cu).  ``1``
#: by default since the H100 runs of the 32nd session (BENCHMARKS.md): 12 of Scout FP8's
#: layers prefilled 8k prompts in 0.927x and 32k in 0.936x the promoting form's time (four
#: alternated pairs, faster in each); per 8,192-token step the experts' GEMM took 19.3-19.9
#: ms for 23.3-23.8 and the dense FP8 GEMMs 15.8-16.0 for 18.4-19.3.  Its error stayed
#: within about 2**-11 of sum |x w| at K = 5120 and 8192 (the promoting form: 2**-13), and
#: the FP8 oracle tests on trained models passed with it on, both layouts, twice.
FAST_ACCUM_EXPERTS, FAST_ACCUM_DENSE = parse_fast_accum(
    os.environ.get("CHUNKLOCAL_FP8_FAST_ACCUM", "1"))


def quantize_per_token(x: torch.Tensor, scale_ub: float | None = None, amax_reduce=None):
    """x [M, K] -> (x_fp8 [M, K] float8_e4m3fn, scale [M, 1] float32), ``x ~ x_fp8 * scale``.

    ``scale_ub`` (fbgemm's ``activation_scale_ub``) caps a row's amax: larger values
    saturate at +-448 instead of coarsening the whole row.  ``amax_reduce``: the max of
    the row amaxes over the tensor-parallel ranks, when x holds one rank's columns of
    each row (a row-parallel layer): every rank then scales a token as one rank would.
    On CUDA, with ``CHUNKLOCAL_FP8_QUANT_TRITON=1`` and no ``amax_reduce``, one Triton
    kernel computes the same bits (models/quant_triton.py).
    """
    if amax_reduce is None:
        import chunklocal.models.quant_triton as quant_triton

        if quant_triton.quant_available(x):
            return quant_triton.quantize_rows(x, scale_ub)
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    if amax_reduce is not None:
        amax = amax_reduce(amax)
    if scale_ub is not None:
        amax = amax.clamp(max=float(scale_ub))
    # A tensor divisor, not the Python float: CUDA divides a tensor by a Python scalar as a
    # product with the scalar's float32 reciprocal, 1 ulp off ``amax / 448`` for some rows,
    # and a scale 1 ulp off sends ~0.1% of the activations to the neighbouring e4m3 value
    # (a 1-2% error in the products).  True division gives the CPU's bits on every device.
    scale = amax.clamp(min=AMAX_FLOOR) / amax.new_full((), FP8_MAX)
    x_fp8 = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x_fp8, scale


def dequantize(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """float32 weight of an FP8 weight ``[..., N, K]`` with per-channel scales ``[..., N]``."""
    return w.float() * w_scale.float().unsqueeze(-1)


def fp8_linear(x: torch.Tensor | QuantRows, w: torch.Tensor, w_scale: torch.Tensor, bias=None,
               *, act_scale_ub: float | None = None, amax_reduce=None) -> torch.Tensor:
    """x [M, K] @ w[N, K].T with per-token activation and per-channel weight scales -> [M, N]
    in ``x.dtype``.  CUDA: ``torch._scaled_mm`` (FP8 tensor cores, bf16 out); CPU: float32
    on dequantized weights and fake-quantized activations.  ``x`` may come quantized
    (:class:`QuantRows`; ``act_scale_ub`` and ``amax_reduce`` were then the quantizer's)."""
    if isinstance(x, QuantRows):
        x_fp8, scale, dtype = x
        if x_fp8.shape[0] == 0:
            return torch.zeros(0, w.shape[0], dtype=dtype, device=x_fp8.device)
    else:
        if x.shape[0] == 0:
            return x.new_zeros(0, w.shape[0])
        if bias is None and amax_reduce is None and x.shape[0] <= SMALL_M_ROWS \
                and x.stride(-1) == 1:
            import chunklocal.models.moe_triton as moe_triton

            if moe_triton.fp8_available(x):
                return moe_triton.fp8_linear_small(x, w, w_scale, act_scale_ub)
        (x_fp8, scale), dtype = quantize_per_token(x, act_scale_ub, amax_reduce), x.dtype
    if x_fp8.is_cuda:
        # b must be column-major: w [N, K] row-major transposed is exactly that.  A bf16
        # bias (the dtype the H200's torch 2.11 was seen to take) is added in the kernel's
        # float32 epilogue, so the output is rounded to bf16 once; added to the bf16
        # product afterwards it would round twice.
        fused = bias is not None and bias.dtype == torch.bfloat16
        out = torch._scaled_mm(x_fp8, w.t(), scale_a=scale, scale_b=w_scale.float().view(1, -1),
                               bias=bias if fused else None, out_dtype=torch.bfloat16,
                               use_fast_accum=FAST_ACCUM_DENSE)
        if bias is not None and not fused:
            out = out.float() + bias
        return out.to(dtype)
    out = (x_fp8.float() * scale) @ dequantize(w, w_scale).t()
    if bias is not None:
        out = out + bias
    return out.to(dtype)


def fp8_grouped_mm(x: torch.Tensor | QuantRows, w: torch.Tensor, w_scale: torch.Tensor,
                   offs: torch.Tensor, *, act_scale_ub: float | None = None,
                   amax_reduce=None) -> torch.Tensor:
    """Rows of x [M, K] sorted by expert; expert e owns rows ``offs[e-1]:offs[e]`` (int32
    cumulative end offsets, ``offs[-1] <= M``) and multiplies them by w[e] [N, K] (FP8,
    scales ``w_scale [E, N]``).  Returns [M, N] in ``x.dtype``; rows past ``offs[-1]`` are
    unspecified on CUDA and zero elsewhere.  ``x`` may come quantized (:class:`QuantRows`;
    ``act_scale_ub`` and ``amax_reduce`` were then the quantizer's to apply)."""
    if isinstance(x, QuantRows):
        x_fp8, scale, dtype = x
    else:
        (x_fp8, scale), dtype = quantize_per_token(x, act_scale_ub, amax_reduce), x.dtype
    if x_fp8.is_cuda:
        out = torch._scaled_grouped_mm(x_fp8, w.transpose(-2, -1), scale.view(-1),
                                       w_scale.float(), offs=offs, out_dtype=torch.bfloat16,
                                       use_fast_accum=FAST_ACCUM_EXPERTS)
        return out.to(dtype)
    out = torch.zeros(x_fp8.shape[0], w.shape[1], dtype=torch.float32)
    x_deq = x_fp8.float() * scale
    start = 0
    for e, end in enumerate(offs.tolist()):  # CPU only: the offsets already live on the host
        if end > start:
            out[start:end] = x_deq[start:end] @ dequantize(w[e], w_scale[e]).t()
        start = end
    return out.to(dtype)


class Fp8Linear(nn.Module):
    """``nn.Linear`` with an FP8 weight [out, in] and float32 per-output-channel scales."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 act_scale_ub: float | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.act_scale_ub = act_scale_ub
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32),
                                         requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.amax_reduce = None  # set on row-parallel slices (models/parallel.py)

    def forward(self, x):
        flat = x.reshape(-1, self.in_features)
        out = fp8_linear(flat, self.weight, self.weight_scale, self.bias,
                         act_scale_ub=self.act_scale_ub, amax_reduce=self.amax_reduce)
        return out.view(*x.shape[:-1], self.out_features)


@dataclass(frozen=True)
class Fp8Plan:
    """Which modules of a model hold FP8 weights (by module name, e.g.
    ``model.layers.3.self_attn.q_proj`` or ``model.layers.1.feed_forward.experts``)."""

    modules: frozenset = frozenset()
    act_scale_ub: float | None = None

    def linear(self, name: str, in_features: int, out_features: int, bias: bool = False):
        if name in self.modules:
            return Fp8Linear(in_features, out_features, bias, self.act_scale_ub)
        return nn.Linear(in_features, out_features, bias=bias)


NO_FP8 = Fp8Plan()
