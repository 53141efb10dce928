"""Residual add + RMSNorm, and rope + QK norm, each in one Triton kernel.

A decoder layer adds each sublayer's output to the residual stream and normalizes the sum
for the next sublayer.  In torch that is the add, then ``_rms``'s chain (cast to float32,
square, mean, add eps, rsqrt, product, cast back, product with the weight): about nine
launches, each a few microseconds at decode sizes whatever its size, twice per layer (a
full-size Scout decode step had 1,607 elementwise and 361 reduction launches on the H200;
BENCHMARKS.md).  :func:`add_rms_norm_rows` does it in one: one program per row reads the
sublayer's output and the residual once, writes the new residual and the normalized row.

Its arithmetic is the torch path's: the sum is rounded to the activation dtype before it is
squared (``h + residual`` in bf16 is a float32 sum rounded to bf16), the normalized row is
rounded before the weight product (``_rms(x).type_as(x) * weight``), and the product is
rounded once.  Only the mean's float32 summation order differs from torch's reduction, so an
output may differ from torch's in its last bit; tests/gpu/test_norm_triton_gpu.py bounds
that and checks the engine's tokens with the kernel on.

:func:`rope_heads` does the same for the attention's rope layers: the rotation of each
query and key head (``_rotate``: float32 pairs times the step's ``freqs_cis``, rounded) and
Llama-4's weightless QK norm after it (``_rms``), about ten launches each for q and k, in one
launch each: one program per (token, head) reads the head once from the fused projection's
output (strided rows) and writes it rotated and normalized.  The same roundings as torch's;
the complex product and the mean may differ from torch's in the last float32 bit.

On by default since the H200 measured them (``CHUNKLOCAL_NORM_TRITON=0`` turns both off):
full-size Scout FP8 decode at batch 64 went from 45.3 to 39.6 ms per step with CUDA graphs,
batch 1 unchanged (BENCHMARKS.md, "elementwise tail").
:func:`chunklocal.models.llama4.add_rms_norm` and :func:`chunklocal.models.llama4.rope_heads`
take them for CUDA rows of bf16/fp16.
"""

from __future__ import annotations

import os

import torch

from chunklocal.models.quant_triton import available, pdl_args, triton

if triton is not None:
    import triton.language as tl

    from chunklocal.models.quant_triton import pdl_start

#: The switch, read at import (``CHUNKLOCAL_NORM_TRITON=0`` turns it off).
NORM_ENABLED = os.environ.get("CHUNKLOCAL_NORM_TRITON", "1") == "1"
MAX_HIDDEN = 16384  # one block holds a row: Llama-4's 5120 and 8192 fit with room
#: Rope + QK norm over a tile of heads of one token per program (``CHUNKLOCAL_ROPE_TILED=1``,
#: ``--switches rope_tiled``): the token's cos / sin loaded once for ``ROPE_TILE_HEADS``
#: heads, four warps a program.  One head a program (the default) was 4.3 ms of a
#: 12-layer 8k prefill step on the H100 (28th session) for 9 launches of 8192 x 48 heads:
#: about 7x the bytes it moves at the copy rate, 393k one-warp programs each reading the
#: token's 512 bytes of cos / sin again.  Measured no faster (29th session: 4.49 ms), so
#: off; :data:`ROPE_VEC` keeps its tiles and changes the access width.
ROPE_TILED = os.environ.get("CHUNKLOCAL_ROPE_TILED", "0") == "1"
ROPE_TILE_HEADS = 16
#: Tiles of heads (as ``ROPE_TILED``) read and written as whole contiguous heads, the
#: (re, im) pairs split and joined in registers (``CHUNKLOCAL_ROPE_VEC=1``, ``--switches
#: rope_vec``): 16-byte accesses where the pair-strided loads and stores move 2 bytes each.
#: The same operations; the tile's float32 sum and the compiler's FMA contraction may
#: differ from one head a program in the last float32 bit (as both do from torch's), so a
#: bf16 output may differ by one unit.  H100, 29th session, a 12-layer 8k prefill step: the
#: kernel 4.27 ms (one head a program) and 4.49 (tiled) against **0.62 ms** here.  On by
#: default since the 30th session (H100, 12 of Scout FP8's layers): the torch comparison of
#: every form at 1 / 64 / 257 tokens, the engine's bf16 tokens with graphs, its logits and
#: the reporter's scenario, and the FP8 oracle test with it alone passed; the 8k / 32k
#: prefill 0.0969 / 0.430 s against the defaults' 0.0985-0.0997 / 0.434-0.438 s of the same
#: call (BENCHMARKS.md).  ``CHUNKLOCAL_ROPE_VEC=0`` turns it off (one head a program).
ROPE_VEC = os.environ.get("CHUNKLOCAL_ROPE_VEC", "1") == "1"


def norm_available(x: torch.Tensor) -> bool:
    """:func:`add_rms_norm_rows` runs on ``x`` and is switched on."""
    return (NORM_ENABLED and available(x) and x.dim() == 2 and x.stride(-1) == 1
            and x.shape[-1] <= MAX_HIDDEN)


if triton is not None:
    @triton.jit(do_not_specialize=["eps"])
    def _add_rms_norm_kernel(h_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, N, eps, stride_h,
                             stride_r, stride_out, stride_sum, HAS_RES: tl.constexpr,
                             BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)  # torch's rounded sum
            tl.store(sum_ptr + row * stride_sum + cols, h, mask=mask)
        x = h.to(tl.float32)
        mean_sq = tl.sum(x * x, axis=0) / N
        normed = (x * tl.rsqrt(mean_sq + eps)).to(h.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = normed.to(tl.float32) * w.to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_rows(h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = h + residual`` (``h`` when ``residual`` is None) and ``RMSNorm(s) * weight``
    for rows ``h [M, N]``, in one kernel: returns (normalized rows, s).  The output dtype is
    torch's for ``bf16 rows * weight``."""
    if triton is None:
        raise RuntimeError("add_rms_norm_rows needs Triton")
    num_rows, hidden = h.shape
    if h.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("add_rms_norm_rows needs rows contiguous along the hidden size")
    out = torch.empty(num_rows, hidden, device=h.device,
                      dtype=torch.promote_types(h.dtype, weight.dtype))
    total = h if residual is None else torch.empty_like(h)
    if num_rows:
        block = triton.next_power_of_2(hidden)
        r = h if residual is None else residual
        _add_rms_norm_kernel[(num_rows,)](
            h, r, weight, out, total, hidden, float(eps), h.stride(0), r.stride(0),
            out.stride(0), total.stride(0), HAS_RES=residual is not None, BLOCK=block,
            num_warps=4 if block <= 2048 else 8, **pdl_args(h))
    return out, total


if triton is not None:
    @triton.jit(do_not_specialize=["eps"])
    def _rope_norm_kernel(x_ptr, f_ptr, out_ptr, out2_ptr, eps, heads, split, stride_xt,
                          stride_xh, stride_ft, stride_ot, stride_oh, stride_o2t, stride_o2h,
                          HALF: tl.constexpr, HEADS: tl.constexpr, HAS_NORM: tl.constexpr,
                          VEC: tl.constexpr, PDL: tl.constexpr):
        # program (t, g): token t's heads [g * HEADS, (g + 1) * HEADS), a [HEADS, HALF]
        # tile of (re, im) pairs; the token's cos / sin loaded once for all of them
        pdl_start(PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64) * HEADS + tl.arange(0, HEADS).to(tl.int64)
        pair = tl.arange(0, HALF) * 2
        live = (h < heads)[:, None]
        if VEC:  # whole heads, contiguous; the pairs split in registers
            dims = tl.arange(0, 2 * HALF)
            x = tl.load(x_ptr + t * stride_xt + h[:, None] * stride_xh + dims[None, :],
                        mask=live, other=0.0)
            x_re, x_im = tl.split(tl.reshape(x, (HEADS, HALF, 2)))
            x_im = x_im.to(tl.float32)
            cos, sin = tl.split(tl.reshape(tl.load(f_ptr + t * stride_ft + dims), (HALF, 2)))
            cos, sin = cos[None, :], sin[None, :]
        else:
            src = x_ptr + t * stride_xt + h[:, None] * stride_xh + pair[None, :]
            x_re = tl.load(src, mask=live, other=0.0)
            x_im = tl.load(src + 1, mask=live, other=0.0).to(tl.float32)
            cos = tl.load(f_ptr + t * stride_ft + pair)[None, :]
            sin = tl.load(f_ptr + t * stride_ft + pair + 1)[None, :]
        re = x_re.to(tl.float32) * cos - x_im * sin
        im = x_re.to(tl.float32) * sin + x_im * cos
        re = re.to(x_re.dtype).to(tl.float32)  # _rotate's type_as
        im = im.to(x_re.dtype).to(tl.float32)
        if HAS_NORM:
            mean_sq = (tl.sum(re * re, axis=1) + tl.sum(im * im, axis=1)) / (2 * HALF)
            inv = tl.rsqrt(mean_sq + eps)[:, None]
            re = re * inv
            im = im * inv
        # heads [0, split) to out, the rest to out2 (q and k of one launch)
        first = (h < split)[:, None]
        head_dst = tl.where(first, out_ptr + t * stride_ot + h[:, None] * stride_oh,
                            out2_ptr + t * stride_o2t + (h[:, None] - split) * stride_o2h)
        if VEC:
            both = tl.reshape(tl.join(re.to(x_re.dtype), im.to(x_re.dtype)), (HEADS, 2 * HALF))
            tl.store(head_dst + tl.arange(0, 2 * HALF)[None, :], both, mask=live)
        else:
            tl.store(head_dst + pair[None, :], re.to(x_re.dtype), mask=live)
            tl.store(head_dst + pair[None, :] + 1, im.to(x_re.dtype), mask=live)


def rope_available(x: torch.Tensor) -> bool:
    """:func:`rope_norm_rows` runs on heads ``x [T, H, D]`` and is switched on (D / 2 a
    power of two: one block per head)."""
    half = x.shape[-1] // 2
    return (NORM_ENABLED and available(x) and x.dim() == 3 and x.stride(-1) == 1
            and half > 0 and half & (half - 1) == 0 and x.shape[-1] == 2 * half)


def rope_norm_rows(x: torch.Tensor, freqs_cis: torch.Tensor, eps: float | None,
                   split: int | None = None):
    """Heads ``x [T, H, D]`` (any token and head strides, D contiguous) rotated by
    ``freqs_cis [T, D / 2]`` (complex64) as ``llama4._rotate``, then RMS-normalized without a
    weight as ``llama4._rms`` when ``eps`` is given: a new contiguous ``[T, H, D]``; with
    ``split`` (``0 < split < H``) two, heads ``[:split]`` and ``[split:]`` (the queries and
    keys of one fused projection, in one launch)."""
    if triton is None:
        raise RuntimeError("rope_norm_rows needs Triton")
    tokens, heads, head_dim = x.shape
    if split is not None and not 0 < split < heads:
        raise ValueError(f"rope_norm_rows: split must be in 1..{heads - 1}, got {split}")
    first = heads if split is None else split
    out = torch.empty(tokens, first, head_dim, dtype=x.dtype, device=x.device)
    out2 = out if split is None else torch.empty(tokens, heads - first, head_dim,
                                                 dtype=x.dtype, device=x.device)
    freqs = torch.view_as_real(freqs_cis)  # [T, D / 2, 2] float32: cos, sin pairs
    if freqs.stride(-1) != 1 or freqs.stride(-2) != 2:
        freqs = freqs.contiguous()
    if tokens and heads:
        tiled = ROPE_TILED or ROPE_VEC
        tile = min(ROPE_TILE_HEADS, triton.next_power_of_2(heads)) if tiled else 1
        _rope_norm_kernel[(tokens, triton.cdiv(heads, tile))](
            x, freqs, out, out2, 0.0 if eps is None else float(eps), heads, first,
            x.stride(0), x.stride(1), freqs.stride(0), out.stride(0), out.stride(1),
            out2.stride(0), out2.stride(1), HALF=head_dim // 2, HEADS=tile,
            HAS_NORM=eps is not None, VEC=ROPE_VEC, num_warps=4 if tile > 1 else 1,
            **pdl_args(x))
    return out if split is None else (out, out2)
