"""Per-token FP8 activation quantization in one Triton kernel.

:func:`chunklocal.models.quant.quantize_per_token` in torch is a chain of small kernels (cast
to float32, abs, amax, clamps, the scale's division, the rows' division, clamp, cast to e4m3):
about eight launches before every FP8 GEMM, each costing a few microseconds at decode sizes
whatever its size (a Scout decode step quantizes 4 times per layer, 192 times in all).
:func:`quantize_rows` does the same in one launch: one program per row reads the row once for
its amax and once more (from L2) to scale, round and store it.

Bit for bit the torch path's result: the amax is exact; ``scale = max(amax, 1e-12) / 448``
and ``x / scale`` use IEEE division (``div_rn``, torch's ``/`` on tensors), the clamp is
exact, and the cast rounds to nearest even on both (``cvt.rn.satfinite`` on sm90; the values
are in range already).  tests/gpu/test_fp8_quant_gpu.py compares the bytes on the H200.

On by default since the H200 run of 2026-12-02 (BENCHMARKS.md; ``CHUNKLOCAL_FP8_QUANT_TRITON=0``
turns it off): ``quantize_per_token`` takes it for CUDA rows of bf16/fp16 without a
cross-rank amax.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from chunklocal._validate import env_count

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton; the kernels stay off there
    triton = None


class QuantRows(NamedTuple):
    """Rows already quantized per token (``quant.quantize_per_token``'s pair) and the dtype
    the GEMM returns them in.  The MoE layer hands its first expert GEMM these when one
    kernel gathered, scaled and quantized the routed tokens (:func:`quantize_rows` with
    ``rows``; ``moe.GATHER_QUANT``); ``quant.fp8_grouped_mm`` and
    ``moe_triton.fp8_grouped_mm_small`` take them for ``x``."""
    q: torch.Tensor      # [M, K] float8_e4m3fn
    scale: torch.Tensor  # [M, 1] float32
    dtype: torch.dtype


def available(x: torch.Tensor) -> bool:
    """Triton can run a kernel on ``x``: CUDA bf16/fp16 (fp32 inputs would go through TF32
    in ``tl.dot``), or any device under ``TRITON_INTERPRET=1`` (tests)."""
    if triton is None:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1" or (
        x.is_cuda and x.dtype in (torch.bfloat16, torch.float16))


#: The switch, read at import (``CHUNKLOCAL_FP8_QUANT_TRITON=0`` turns it off).  On since
#: the H200 run of 2026-12-02 (BENCHMARKS.md): torch's FP8 GEMMs with it took 23-37 us
#: where torch's chain of small quantization kernels took 40-62 us (dense, 1-256 rows), and
#: full-size Scout FP8 decode 18.6 / 56.8 ms at batch 1 / 64 against 21.7 / 61.1 ms.
QUANT_ENABLED = os.environ.get("CHUNKLOCAL_FP8_QUANT_TRITON", "1") == "1"
MAX_BLOCK_K = 2048  # elements of a row per load (a Scout row of 5120: three loads)
#: Rows of at most this many elements are read once, held in registers for the amax and
#: quantized from there (one program of 16 warps: 16 float32 a thread at 8192), where the
#: two-pass form loads each row three or four times over, twice: at a batch-1 step of
#: full-size Scout FP8 a launch took 3.9 us (192 a step, 0.74 ms; BENCHMARKS.md, fifteenth
#: session), latency more than bytes.  The same bits either way (tests/gpu/test_fp8_quant_gpu.py
#: passed on the H100 in the twenty-first session: every form, eager and replayed).  On by
#: default since the twenty-fourth session: 12 of full-size Scout FP8's layers at batch 1
#: replayed 0.985-0.989x and 0.989-0.992x the two-pass form's time against the defaults of
#: the same round, in every round of two H100 runs (BENCHMARKS.md, "Earlier batch-1 A/Bs
#: re-read"); ``CHUNKLOCAL_FP8_QUANT_ONE_PASS=0`` turns it off (``switch_ab --switches quant1``).
ONE_PASS_ENABLED = os.environ.get("CHUNKLOCAL_FP8_QUANT_ONE_PASS", "1") == "1"
ONE_PASS_MAX_K = 8192
#: Steps of at least this many rows quantize rows whose length is not a power of two
#: (Scout's hidden size, 5120) in two passes of 1024-wide loads at 4 warps, where the one
#: pass held each row in a block of the next power of two (8192 lanes, 37.5% of them
#: masked, 16 warps a row): ``benchmarks/quant_rows.py`` on an H100 at 8,192 rows of 5120
#: took 49.4 us against 96.7 (the shared expert's input) and 52.0 against 104.5 (the
#: routed rows, gathered), the floor 41.4 us at the copy rate, the same bits (thirty-third
#: session, BENCHMARKS.md).  ``silu(gate) * up`` rows (8192 of 16384) stay in one pass:
#: 112.3 us there against 154-202 in two.  Decode steps keep the one pass that measured
#: faster at batch 1.  ``CHUNKLOCAL_FP8_QUANT_TWO_PASS_ROWS``; 0: never.
TWO_PASS_ROWS = env_count("CHUNKLOCAL_FP8_QUANT_TWO_PASS_ROWS", "2048", "rows")
TWO_PASS_BLOCK_K, TWO_PASS_WARPS = 1024, 4


#: Programmatic dependent launch (sm_90 and later) for the Triton kernels of a decode step
#: (``CHUNKLOCAL_PDL=1``; ``benchmarks/switch_ab.py --switches pdl``).  A batch-1 step of
#: full-size Scout FP8 is about 870 launches, most a few microseconds long, and six in a
#: row of each layer are ours (the routing, the rows' quantization, the two expert GEMMs,
#: the SiLU's quantization, the combine, then the next layer's norm): each waited for the
#: one before it to drain before its programs were even dispatched.  Launched with PDL, a
#: kernel's programs are dispatched while its predecessor runs (once every program of the
#: predecessor has passed :func:`pdl_start`), and wait there -- before any load or store --
#: until the predecessor has finished and its writes are visible; so every kernel that
#: takes the attribute calls :func:`pdl_start` first, in every program, and a kernel's
#: completion still implies its predecessors'.  FlashInfer's decode kernels launch this way
#: on sm_90 already.  Results are the same bits either way.  On by default since the H200
#: A/B (27th session, full-size Scout FP8, batch 1: 0.962x the step's replay time alone,
#: faster in every round; BENCHMARKS.md); ``CHUNKLOCAL_PDL=0`` turns it off.
PDL_ENABLED = os.environ.get("CHUNKLOCAL_PDL", "1") == "1"
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # no Triton, or one without grid dependency control
    gdc_wait = gdc_launch_dependents = None


@functools.cache
def _pdl_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_supported(x: torch.Tensor) -> bool:
    """A launch on ``x``'s device can take PDL: a CUDA device of sm_90 or later, a Triton
    with grid dependency control, not Triton's interpreter."""
    if gdc_wait is None or not x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _pdl_device(torch.cuda.current_device() if x.device.index is None
                       else x.device.index)


def pdl_args(x: torch.Tensor) -> dict:
    """A launch's keywords for :data:`PDL_ENABLED`: the kernel's ``PDL`` constexpr (it
    calls :func:`pdl_start`) and Triton's ``launch_pdl``, both on where the switch is on
    and :func:`pdl_supported`."""
    if PDL_ENABLED and pdl_supported(x):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


def quant_available(x: torch.Tensor) -> bool:
    """:func:`quantize_rows` runs on ``x`` and is switched on."""
    return QUANT_ENABLED and available(x) and x.dim() == 2 and x.stride(-1) == 1


if triton is not None:
    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """A PDL kernel's first statement (:data:`PDL_ENABLED`): wait until the kernel
        before it has finished, then let the next one's programs be dispatched."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def _quantize_rows_load(x_row, k, K, row_scale, GATHER: tl.constexpr,
                            SILU_MUL: tl.constexpr):
        """Elements ``k`` of the row to quantize, in float32, as torch makes them: ``x``;
        ``x * row_scale`` (GATHER); or ``silu(gate) * up`` of ``[gate | up]`` (SILU_MUL, K
        the width of each half), each rounded to x's dtype first."""
        if SILU_MUL:
            g = tl.load(x_row + k, mask=k < K, other=0.0)
            u = tl.load(x_row + K + k, mask=k < K, other=0.0).to(tl.float32)
            gf = g.to(tl.float32)
            xk = (gf / (1.0 + tl.exp(-gf)) * u).to(g.dtype)
        else:
            xk = tl.load(x_row + k, mask=k < K, other=0.0)
            if GATHER:
                xk = (xk.to(tl.float32) * row_scale).to(xk.dtype)
        return xk.to(tl.float32)

    @triton.jit(do_not_specialize=["scale_ub"])
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, rows_ptr, rs_ptr, K, scale_ub, stride_xm,
                              stride_qm, HAS_UB: tl.constexpr, GATHER: tl.constexpr,
                              SILU_MUL: tl.constexpr, ONE_PASS: tl.constexpr,
                              BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        if GATHER:
            src = tl.load(rows_ptr + row).to(tl.int64)
            row_scale = tl.load(rs_ptr + row).to(tl.float32)
        else:
            src = row
            row_scale = 1.0
        x_row = x_ptr + src * stride_xm
        if ONE_PASS:  # BLOCK_K >= K: the row stays in registers (masked lanes hold 0)
            held = _quantize_rows_load(x_row, ks, K, row_scale, GATHER, SILU_MUL)
            top = tl.max(tl.abs(held), axis=0)
        else:
            amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + ks
                xk = _quantize_rows_load(x_row, k, K, row_scale, GATHER, SILU_MUL)
                amax = tl.maximum(amax, tl.abs(xk))
            top = tl.max(amax, axis=0)
        if HAS_UB:
            top = tl.minimum(top, scale_ub)
        # Every lane holds the row's scale (vectors only: the division is elementwise).
        zero = tl.zeros((BLOCK_K,), dtype=tl.float32)
        scale = tl.math.div_rn(tl.maximum(zero + top, 1e-12), zero + 448.0)
        if ONE_PASS:
            xq = tl.minimum(tl.maximum(tl.math.div_rn(held, scale), -448.0), 448.0)
            tl.store(q_ptr + row * stride_qm + ks, xq.to(tl.float8e4nv), mask=ks < K)
        else:
            for k0 in range(0, K, BLOCK_K):
                k = k0 + ks
                xk = _quantize_rows_load(x_row, k, K, row_scale, GATHER, SILU_MUL)
                xq = tl.minimum(tl.maximum(tl.math.div_rn(xk, scale), -448.0), 448.0)
                tl.store(q_ptr + row * stride_qm + k, xq.to(tl.float8e4nv), mask=k < K)
        tl.store(s_ptr + row + ks, scale, mask=ks == 0)


def quantize_rows(x: torch.Tensor, scale_ub: float | None = None, rows: torch.Tensor | None
                  = None, row_scale: torch.Tensor | None = None, *,
                  config: tuple[bool, int, int] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant.quantize_per_token(x, scale_ub)`` in one kernel: ``x [M, K]`` (last dim
    contiguous) -> (``[M, K]`` float8_e4m3fn, ``[M, 1]`` float32 scales).

    With ``rows`` [R] (int) and ``row_scale`` [R] (x's dtype) it quantizes ``x[rows] *
    row_scale[:, None]`` -> ``[R, K]`` without making that product: the same bits as
    quantizing the product torch computes (each element rounded to x's dtype), one read
    of each routed token where the MoE layer's gather and scaling took two more passes."""
    if triton is None:
        raise RuntimeError("quantize_rows needs Triton")
    num_rows, k_dim = x.shape
    if rows is not None or row_scale is not None:
        if rows is None or row_scale is None:
            raise ValueError("quantize_rows: rows and row_scale go together")
        if rows.dim() != 1 or row_scale.shape != rows.shape:
            raise ValueError(f"quantize_rows: rows {tuple(rows.shape)} and row_scale "
                             f"{tuple(row_scale.shape)} must be one value per row")
        num_rows = rows.shape[0]
    if x.stride(1) != 1:
        raise ValueError("quantize_rows needs rows contiguous along K")
    return _quantize(x, num_rows, k_dim, scale_ub, rows, row_scale, silu_mul=False,
                     config=config)


def silu_mul_quantize(gate_up: torch.Tensor, scale_ub: float | None = None, *,
                      config: tuple[bool, int, int] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_per_token(silu(gate) * up, scale_ub)`` for ``gate_up = [gate | up]`` [M,
    2I] (contiguous rows) -> (``[M, I]`` float8_e4m3fn, ``[M, 1]`` float32 scales), in one
    kernel: the product (float32, rounded to gate_up's dtype once, as FlashInfer's
    ``silu_and_mul`` rounds it) is never stored, where ``silu_and_mul`` wrote it and the
    quantization read it twice more."""
    if triton is None:
        raise RuntimeError("silu_mul_quantize needs Triton")
    num_rows, width = gate_up.shape
    if width % 2 or not gate_up.is_contiguous():
        raise ValueError(f"silu_mul_quantize needs contiguous [M, 2I] rows, got "
                         f"{tuple(gate_up.shape)} with strides {gate_up.stride()}")
    return _quantize(gate_up, num_rows, width // 2, scale_ub, None, None, silu_mul=True,
                     config=config)


def launch_config(k_dim: int, num_rows: int = 1, silu_mul: bool = False
                  ) -> tuple[bool, int, int]:
    """The quantization kernel's (one pass, ``BLOCK_K``, warps) for ``num_rows`` rows of
    ``k_dim`` values: two 1024-wide passes at 4 warps for long steps of rows whose length
    is not a power of two (:data:`TWO_PASS_ROWS`); else one pass where
    :data:`ONE_PASS_ENABLED` and the row fits :data:`ONE_PASS_MAX_K` (the block then
    covers the row), or loads of at most :data:`MAX_BLOCK_K`; warps by block size.
    ``benchmarks/quant_rows.py`` times the alternatives at prefill sizes."""
    if (TWO_PASS_ROWS and num_rows >= TWO_PASS_ROWS and not silu_mul
            and k_dim > TWO_PASS_BLOCK_K and k_dim & (k_dim - 1)):
        return False, TWO_PASS_BLOCK_K, TWO_PASS_WARPS
    one_pass = ONE_PASS_ENABLED and k_dim <= ONE_PASS_MAX_K
    block_k = triton.next_power_of_2(k_dim)
    if not one_pass:
        block_k = min(block_k, MAX_BLOCK_K)
    return one_pass, block_k, 4 if block_k <= 1024 else 8 if block_k <= 4096 else 16


def _quantize(x, num_rows: int, k_dim: int, scale_ub, rows, row_scale, *, silu_mul: bool,
              config: tuple[bool, int, int] | None = None):
    """The one launch of :func:`quantize_rows` and :func:`silu_mul_quantize`: ``num_rows``
    rows of ``k_dim`` quantized values (made from ``x`` as the kernel's GATHER / SILU_MUL
    forms say) and their scales.  ``config`` overrides :func:`launch_config` (one pass,
    ``BLOCK_K``, warps; the benchmark's sweep): the same bits whatever it is."""
    q = torch.empty(num_rows, k_dim, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows:
        if config is None:
            config = launch_config(k_dim, num_rows, silu_mul)
        elif config[0] and config[1] < k_dim:  # launch_config's own choices always fit
            raise ValueError(f"a one-pass BLOCK_K of {config[1]} cannot hold rows of {k_dim}")
        one_pass, block_k, warps = config
        gather = rows is not None
        _quantize_rows_kernel[(num_rows,)](
            x, q, scale, rows if gather else x, row_scale if gather else x, k_dim,
            0.0 if scale_ub is None else float(scale_ub), x.stride(0), q.stride(0),
            HAS_UB=scale_ub is not None, GATHER=gather, SILU_MUL=silu_mul, ONE_PASS=one_pass,
            BLOCK_K=block_k, num_warps=warps, **pdl_args(x))
    return q, scale
