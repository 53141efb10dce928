"""moe_triton's grouped kernel in Triton's interpreter (CPU, float32), where Triton is
installed: the kernel alone against a per-expert float64 loop, and the MoE layer that
uses it against transformers' all-experts Llama4TextMoe.  The interpreter must be
switched on before the kernel is defined, so each check runs in a fresh process.  On
the GPU, tests/gpu/test_moe_gpu.py runs the compiled kernel in bf16."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")
# The H200 image's Triton interpreter cannot run the kernel's data-dependent loop bounds
# (InterpreterError on range(start, end)); there tests/gpu/test_moe_gpu.py runs the compiled
# kernel against transformers instead.
pytestmark = pytest.mark.skipif(__import__("torch").cuda.is_available(),
                                reason="GPU machine: the compiled kernel is tested in tests/gpu")

SCRIPT = textwrap.dedent("""
    import torch
    from test_moe import hf_moe, ours_from, rel_err
    from chunklocal.models import moe_triton
    from chunklocal.models.moe_triton import grouped_mm_small

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 80, 200, generator=gen)
    ends = [0, 5, 5, 39, 50, 50]  # empty experts 0, 2, 5; expert 3 spans three row blocks
    x = torch.randn(50, 200, generator=gen)
    got = grouped_mm_small(x, w, torch.tensor(ends, dtype=torch.int32), block_n=32, block_k=64)
    expected = torch.zeros(50, 80, dtype=torch.float64)
    for e, (a, b) in enumerate(zip([0] + ends[:-1], ends)):
        expected[a:b] = x[a:b].double() @ w[e].double().T
    assert rel_err(got, expected) < 1e-6, rel_err(got, expected)

    calls = []
    real = moe_triton.grouped_mm_small
    moe_triton.grouped_mm_small = lambda *a, **k: calls.append(1) or real(*a, **k)
    for top_k, experts, tokens, stack in ((1, 16, 40, False), (2, 8, 33, True)):
        hf = hf_moe(experts, top_k, seed=top_k)
        ours = ours_from(hf, fuse_max_tokens=10**6)
        if stack:
            ours.stack_shared()
        ours.triton_max_pairs = 10**6
        x = torch.randn(tokens, 16, generator=gen)
        with torch.no_grad():
            err = rel_err(ours(x), hf(x)[0])
        assert err < 2e-6, err
    assert len(calls) == 4, calls
    print("ok")
""")


def run_in_interpreter(script: str) -> None:
    """``script`` in a fresh process with Triton's interpreter on; it must print "ok"."""
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(tests), *sys.path]))
    for switch in ("CHUNKLOCAL_FP8_TRITON", "CHUNKLOCAL_FP8_QUANT_TRITON",
                   "CHUNKLOCAL_NORM_TRITON", "CHUNKLOCAL_FP8_SPLITK_REDUCE",
                   "CHUNKLOCAL_FP8_ROUTED_SLOTS", "CHUNKLOCAL_MOE_GATHER_QUANT",
                   "CHUNKLOCAL_MOE_SILU_QUANT", "CHUNKLOCAL_FP8_QUANT_ONE_PASS",
                   "CHUNKLOCAL_FP8_SPLITK_SUM", "CHUNKLOCAL_MOE_ROUTE_TRITON",
                   "CHUNKLOCAL_MOE_ROUTE_FUSED", "CHUNKLOCAL_MOE_ROUTE_WIDE",
                   "CHUNKLOCAL_MOE_ROUTER_IN_KERNEL", "CHUNKLOCAL_FP8_GEMV",
                   "CHUNKLOCAL_FP8_GEMV_MAX_ROWS", "CHUNKLOCAL_GEMV_LINEAR",
                   "CHUNKLOCAL_GEMV_PARTIAL"):
        env.pop(switch, None)  # the scripts check the switches' defaults
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=tests,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_triton_kernel_in_interpreter():
    run_in_interpreter(SCRIPT)


FP8_SCRIPT = textwrap.dedent("""
    import torch
    from chunklocal.models import moe_triton
    from chunklocal.models.moe import expert_mm
    from chunklocal.models.quant import FP8, dequantize, fp8_linear, quantize_per_token

    assert moe_triton.FP8_ENABLED  # on by default (CHUNKLOCAL_FP8_TRITON=0 turns it off)
    gen = torch.Generator().manual_seed(0)
    e, n, k = 5, 48, 96
    w = (torch.randn(e, n, k, generator=gen) * 0.5).to(FP8)
    w_scale = torch.rand(e, n, generator=gen) + 0.5
    # Rows whose quantization is exact (e4m3 values times 2**j, amax 448 * 2**j): the
    # interpreter's float32 -> e4m3 cast drops the carry when a value rounds up into the
    # next binade (31.98 -> 16, not 32), where the GPU's cvt.rn is right; tests/gpu checks
    # rounding on random rows.  float32 rows: its float32 -> bf16 cast truncates.
    m = 23
    x = (torch.randn(m, k, generator=gen) * 100).clamp(-448, 448).to(FP8).float()
    x[:, 0] = 448.0
    x = x * 2.0 ** torch.randint(-6, 6, (m, 1), generator=gen).float()
    x[7] = 0.0  # an all-zero row: the amax floor, not a division by zero
    ends = torch.tensor([3, 3, 20, 20, 23], dtype=torch.int32)  # experts 1 and 3 empty
    rows_of = torch.repeat_interleave(torch.arange(e), torch.diff(ends, prepend=ends[:1] * 0))

    def check(got, rows, experts, ub):
        # float64 on the per-token quantization (the CPU's, bit for bit the GPU's), the
        # error measured against sum_k |x_k w_k| (accumulation order differs)
        xq, scale = quantize_per_token(x[rows], ub)
        xd, wd = xq.double() * scale.double(), dequantize(w, w_scale).double()[experts]
        want = torch.einsum("mk,mnk->mn", xd, wd)
        mag = torch.einsum("mk,mnk->mn", xd.abs(), wd.abs())
        err = float(((got.double() - want).abs() / (mag + 1e-30)).max())
        assert err < 2.0 ** -12, (ub, err)

    for ub in (None, 112.0):  # caps rows of larger amax (they saturate); 112 / 448 = 2**-2
        for split_k in (None, 1, 3):  # K = 96: slices of 32 (3), 64 + 32 (None: 2), all
            got = moe_triton.fp8_grouped_mm_small(x, w, w_scale, ends, ub, block_n=16,
                                                  block_k=32, split_k=split_k)
            check(got, slice(None), rows_of, ub)
        # the MoE layer's entry point takes the kernel for few rows per expert
        calls, real = [], moe_triton.fp8_grouped_mm_small
        moe_triton.fp8_grouped_mm_small = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        routed = expert_mm(x, w, ends, w_scale, small_m=True, act_scale_ub=ub)
        moe_triton.fp8_grouped_mm_small = real
        assert calls == [1]
        check(routed, slice(None), rows_of, ub)
        # a dense layer: one group, no offsets tensor, through quant.fp8_linear's dispatch
        calls, real = [], moe_triton.fp8_linear_small
        moe_triton.fp8_linear_small = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        dense = fp8_linear(x[:9], w[2], w_scale[2], act_scale_ub=ub)
        moe_triton.fp8_linear_small = real
        assert calls == [1]
        check(dense, slice(0, 9), torch.full((9,), 2), ub)
    # the switch off: both dispatch points back on torch's path
    moe_triton.FP8_ENABLED = False
    calls = []
    for name in ("fp8_grouped_mm_small", "fp8_linear_small"):
        setattr(moe_triton, name, lambda *a, **kw: calls.append(1))
    expert_mm(x, w, ends, w_scale, small_m=True)
    fp8_linear(x[:9], w[2], w_scale[2])
    assert calls == []
    print("ok")
""")


def test_fp8_triton_kernel_in_interpreter():
    """The FP8 kernel with its fused quantization: groups with empty experts, an all-zero
    row, fbgemm's amax cap, the one-group (dense) form, and both dispatch points."""
    run_in_interpreter(FP8_SCRIPT)


REDUCE_SCRIPT = textwrap.dedent("""
    import torch
    from chunklocal.models import moe_triton
    from chunklocal.models.quant import FP8

    assert not moe_triton.SPLITK_REDUCE_IN_KERNEL  # off by default (=1 turns it on)
    gen = torch.Generator().manual_seed(2)
    e, n, k = 4, 40, 96  # N not a multiple of the 16-wide tiles: the last tile is masked
    w = (torch.randn(e, n, k, generator=gen) * 0.5).to(FP8)
    w_scale = torch.rand(e, n, generator=gen) + 0.5
    m = 37  # expert 2: rows 5-36, two row tiles; expert 1 empty (its programs take no ticket)
    x = (torch.randn(m, k, generator=gen) * 100).clamp(-448, 448).to(FP8).float()
    x[:, 0] = 448.0  # exactly quantizable rows (see FP8_SCRIPT)
    ends = torch.tensor([5, 5, 37, 37], dtype=torch.int32)
    for split_k in (1, 2, 3):
        kw = dict(block_n=16, block_k=32, split_k=split_k)
        want = moe_triton.fp8_grouped_mm_small(x, w, w_scale, ends, reduce_in_kernel=False,
                                               **kw)
        for _ in range(2):  # the counters are left zeroed: a second call reduces again
            got = moe_triton.fp8_grouped_mm_small(x, w, w_scale, ends, reduce_in_kernel=True,
                                                  **kw)
            # the same partials added in slice order: torch's sum over the slices' dim
            assert torch.equal(got, want), (split_k, (got - want).abs().max())
            assert not moe_triton._TILE_COUNTERS[x.device].any()
    dense = moe_triton.fp8_grouped_mm_small(x[:9], w[:1], w_scale[:1], None, split_k=3,
                                            block_n=16, block_k=32, reduce_in_kernel=True)
    assert torch.equal(dense, moe_triton.fp8_grouped_mm_small(
        x[:9], w[:1], w_scale[:1], None, split_k=3, block_n=16, block_k=32,
        reduce_in_kernel=False))
    try:
        moe_triton.tile_counters(x.device, moe_triton.MAX_TILE_COUNTERS + 1)
    except ValueError as err:
        assert "MAX_TILE_COUNTERS" in str(err)
    else:
        raise AssertionError("no refusal past MAX_TILE_COUNTERS")
    print("ok")
""")


SUM_SCRIPT = textwrap.dedent("""
    import torch
    from chunklocal.models import moe_triton
    from chunklocal.models.quant import FP8

    assert not moe_triton.SPLITK_SUM_TRITON  # off by default (=1 turns it on)
    gen = torch.Generator().manual_seed(4)
    moe_triton.SUM_BLOCK = 64  # several programs, the last one masked
    for splits in (2, 3, 5):
        part = torch.randn(splits, 7, 45, generator=gen) * 1e3
        want = part[0].clone()
        for s in range(1, splits):  # in slice order (torch's sum may pair them up)
            want += part[s]
        got = moe_triton.splitk_sum(part, torch.float32)
        assert got.shape == (7, 45) and torch.equal(got, want), splits
        # bf16 out: the interpreter's cast may round where the GPU's rounds to nearest even
        # (tests/gpu/test_fp8_triton_gpu.py holds the bits there): within one bf16 step
        got = moe_triton.splitk_sum(part, torch.bfloat16)
        assert got.dtype == torch.bfloat16
        assert ((got.float() - want).abs() <= want.abs() * 2.0 ** -7).all(), splits
    try:
        moe_triton.splitk_sum(part.transpose(1, 2), torch.bfloat16)
    except ValueError as err:
        assert "contiguous" in str(err)
    else:
        raise AssertionError("strided partials taken")
    # through the GEMM: the switch on gives the switch-off output, and runs the kernel
    e, n, k, m = 3, 40, 96, 11
    w = (torch.randn(e, n, k, generator=gen) * 0.5).to(FP8)
    w_scale = torch.rand(e, n, generator=gen) + 0.5
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    ends = torch.tensor([4, 4, 11], dtype=torch.int32)
    calls, real = [], moe_triton.splitk_sum
    moe_triton.splitk_sum = lambda *a: calls.append(1) or real(*a)
    kw = dict(block_n=16, block_k=32, split_k=3)
    want = moe_triton.fp8_grouped_mm_small(x, w, w_scale, ends, **kw)
    moe_triton.SPLITK_SUM_TRITON = True
    got = moe_triton.fp8_grouped_mm_small(x, w, w_scale, ends, **kw)
    assert calls == [1] and got.dtype == torch.bfloat16
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2.0 ** -7).all()
    moe_triton.fp8_grouped_mm_small(x, w, w_scale, ends, **dict(kw, split_k=1))
    assert calls == [1]  # one slice: nothing to add, no launch
    print("ok")
""")


def test_fp8_split_k_sum_and_cast_in_one_kernel():
    """SPLITK_SUM_TRITON: the slices' float32 partials added in slice order and cast in one
    launch give torch's ``part.sum(0).to(dtype)`` (several programs, a masked last one),
    refuse strided partials, and leave the GEMM's output as it was."""
    run_in_interpreter(SUM_SCRIPT)


def test_fp8_kernel_adds_its_k_slices_itself():
    """SPLITK_REDUCE_IN_KERNEL: the last program of each tile sums the slices and writes
    the output; the same values as the separate sum, every split, empty experts, masked
    tiles, the dense form, and the counters zeroed for the next call."""
    run_in_interpreter(REDUCE_SCRIPT)


FEW_ROWS_SCRIPT = textwrap.dedent("""
    import torch
    from chunklocal.models import moe_triton
    from chunklocal.models.quant import FP8, dequantize, quantize_per_token

    assert not moe_triton.ROUTED_SLOTS_ENABLED  # off by default (=1 turns it on)
    gen = torch.Generator().manual_seed(3)
    e, n, k = 5, 24, 64
    w = (torch.randn(e, n, k, generator=gen) * 0.5).to(FP8)
    w_scale = torch.rand(e, n, generator=gen) + 0.5
    x = (torch.randn(3, k, generator=gen) * 100).clamp(-448, 448).to(FP8).float()
    x[:, 0] = 448.0  # exactly quantizable rows (see FP8_SCRIPT)
    # fewer rows than experts: min(E, M) slots, each the j-th expert with rows; the last
    # case has a padding row past offs[-1] (its output unspecified)
    cases = (([0, 0, 0, 1, 1], 1, [3]), ([0, 1, 1, 1, 2], 2, [1, 4]),
             ([1, 1, 2, 2, 2], 3, [0, 2]), ([0, 0, 0, 0, 0], 2, []))
    for ends, m, experts in cases:
        offs = torch.tensor(ends, dtype=torch.int32)
        xq, scale = quantize_per_token(x[:m], None)
        wd = dequantize(w, w_scale).double()
        for reduce in (False, True):
            got = moe_triton.fp8_grouped_mm_small(x[:m], w, w_scale, offs, block_n=16,
                                                  block_k=32, split_k=2,
                                                  reduce_in_kernel=reduce,
                                                  routed_slots_in_kernel=True)
            for row, expert in enumerate(experts):
                want = (xq[row].double() * scale[row].double()) @ wd[expert].T
                err = float((got[row].double() - want).abs().max() / want.abs().max())
                assert err < 2.0 ** -12, (ends, reduce, row, expert, err)
            assert not reduce or not moe_triton._TILE_COUNTERS[x.device].any()
    assert moe_triton.routed_slots(0, e) == 1 and moe_triton.routed_slots(9, e) == e
    print("ok")
""")


def test_fp8_kernel_launches_only_routed_experts():
    """ROUTED_SLOTS_ENABLED's grid, fewer rows than experts: min(E, M) expert slots, slot j
    serving the j-th expert with rows, the last expert included, with and without the
    in-kernel sum; a step where no expert has rows leaves the counters zeroed."""
    run_in_interpreter(FEW_ROWS_SCRIPT)


GEMV_SCRIPT = textwrap.dedent("""
    import torch
    from test_moe import fp8_experts, hf_moe, ours_from
    from chunklocal.models import gemv_triton, moe_triton
    from chunklocal.models.moe import expert_mm
    from chunklocal.models.quant import FP8, dequantize, fp8_linear, quantize_per_token

    assert gemv_triton.GEMV_ENABLED and gemv_triton.MAX_ROWS == 1  # CHUNKLOCAL_FP8_GEMV=0
    gen = torch.Generator().manual_seed(5)

    def rows_like_fp8(m, k):
        # exactly quantizable rows (see FP8_SCRIPT: the interpreter's e4m3 cast)
        x = (torch.randn(m, k, generator=gen) * 100).clamp(-448, 448).to(FP8).float()
        x[:, 0] = 448.0
        return x * 2.0 ** torch.randint(-6, 6, (m, 1), generator=gen).float()

    def check(got, x, w, w_scale, experts):
        xq, scale = quantize_per_token(x, None)
        xd, wd = xq.double() * scale.double(), dequantize(w, w_scale).double()[experts]
        want = torch.einsum("mk,mnk->mn", xd, wd)
        mag = torch.einsum("mk,mnk->mn", xd.abs(), wd.abs())
        err = float(((got.double() - want).abs() / (mag + 1e-30)).max())
        assert err < 2.0 ** -12, err

    # N = 40 and K = 100 are no multiples of the tiles (masked), K = 96 is (unmasked)
    for e, n, k in ((5, 40, 100), (5, 48, 96)):
        w = (torch.randn(e, n, k, generator=gen) * 0.5).to(FP8)
        w_scale = torch.rand(e, n, generator=gen) + 0.5
        # groups of 0, 1, 2, 3 and 5 rows (a second row re-reads the slab), the last
        # group's, none at all
        for ends in ([0, 1, 1, 1, 1], [1, 1, 2, 2, 2], [2, 2, 2, 3, 5], [0, 3, 3, 8, 11],
                     [0, 0, 0, 0, 1], [0, 0, 0, 0, 0]):
            offs = torch.tensor(ends, dtype=torch.int32)
            m = max(ends[-1], 1)
            x = rows_like_fp8(m, k)
            sizes = torch.diff(offs, prepend=offs[:1] * 0)
            experts = torch.repeat_interleave(torch.arange(e), sizes)
            for tile in ({}, dict(block_n=8, block_k=32, num_warps=2), dict(partial=True),
                         dict(block_n=8, block_k=32, num_warps=2, partial=True),
                         dict(mma=True), dict(mma=True, block_n=16, block_k=32)):
                xq, xs = quantize_per_token(x, None)
                got = gemv_triton.fp8_gemv(xq, xs, torch.float32, w, w_scale, offs, **tile)
                assert got.shape == (m, n) and got.dtype == torch.float32
                if ends[-1]:  # else a row past offs[-1], unspecified
                    check(got[:ends[-1]], x[:ends[-1]], w, w_scale, experts)
            # through fp8_grouped_mm_small, forced, against the split-K kernel
            split = moe_triton.fp8_grouped_mm_small(x, w, w_scale, offs, gemv=False)
            gemv = moe_triton.fp8_grouped_mm_small(x, w, w_scale, offs, gemv=True)
            if ends[-1]:
                err = float((gemv[:ends[-1]] - split[:ends[-1]]).abs().max()
                            / split[:ends[-1]].abs().max())
                assert err < 2.0 ** -12, (ends, err)
        # a dense layer: one group, no offsets
        x = rows_like_fp8(3, k)
        xq, xs = quantize_per_token(x, None)
        got = gemv_triton.fp8_gemv(xq, xs, torch.float32, w[1:2], w_scale[1:2], None)
        check(got, x, w, w_scale, torch.full((3,), 1))

    # the tensor-core form: a group of more rows than one pass takes (MMA_ROWS), masked
    # (N = 40, K = 100) and unmasked at its own tile's multiples; a dense layer of 17 rows
    assert gemv_triton.MMA_ROWS == 16 and not gemv_triton.MMA_ENABLED
    for n_mma, k_mma, tile in ((40, 100, dict(block_n=16, block_k=32)),
                               (64, 256, {})):
        w_mma = (torch.randn(3, n_mma, k_mma, generator=gen) * 0.5).to(FP8)
        s_mma = torch.rand(3, n_mma, generator=gen) + 0.5
        ends = [2, 2, 37]  # 2 rows, none, 35 rows: three passes of 16
        x_mma = rows_like_fp8(ends[-1], k_mma)
        xq, xs = quantize_per_token(x_mma, None)
        got = gemv_triton.fp8_gemv(xq, xs, torch.float32, w_mma, s_mma,
                                   torch.tensor(ends, dtype=torch.int32), mma=True, **tile)
        check(got, x_mma, w_mma, s_mma, torch.tensor([0] * 2 + [2] * 35))
        got = gemv_triton.fp8_gemv(xq[:17], xs[:17], torch.float32, w_mma[1:2], s_mma[1:2],
                                   None, mma=True, **tile)
        check(got, x_mma[:17], w_mma, s_mma, torch.full((17,), 1))

    # the partial form at its own tile (PARTIAL_TILE, 1024-wide K steps): two groups of one
    # row, as a batch-1 step's routed and shared experts; K = 2048 unmasked, K = 2560 a
    # multiple of the default tile's 512 but not of 1024 (masked)
    assert gemv_triton.PARTIAL_TILE == (16, 1024, 4)
    for k_pt in (2048, 2560):
        w_pt = (torch.randn(2, 32, k_pt, generator=gen) * 0.5).to(FP8)
        s_pt = torch.rand(2, 32, generator=gen) + 0.5
        x_pt = rows_like_fp8(2, k_pt)
        xq, xs = quantize_per_token(x_pt, None)
        got = gemv_triton.fp8_gemv(xq, xs, torch.float32, w_pt, s_pt,
                                   torch.tensor([1, 2], dtype=torch.int32), partial=True)
        check(got, x_pt, w_pt, s_pt, torch.arange(2))

    # dispatch: groups of at most MAX_ROWS (1) rows take the GEMV, the MoE layer's bound
    # being its tokens, a dense layer's its rows; a named split-K knob, the split-K kernel
    calls, real = [], gemv_triton.fp8_gemv
    gemv_triton.fp8_gemv = lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw)
    x = rows_like_fp8(6, 96)
    offs = torch.tensor([1, 1, 3, 3, 6], dtype=torch.int32)
    expert_mm(x, w, offs, w_scale, small_m=True, group_rows=1)  # 6 rows, 1 a group: GEMV
    expert_mm(x, w, offs, w_scale, small_m=True, group_rows=3)  # past MAX_ROWS: split-K
    expert_mm(x, w, offs, w_scale, small_m=True)  # no bound: M = 6 rows, split-K
    moe_triton.fp8_grouped_mm_small(x[:1], w, w_scale, offs * 0 + 1)  # one row: GEMV
    moe_triton.fp8_grouped_mm_small(x[:1], w, w_scale, offs * 0 + 1, split_k=1)
    moe_triton.fp8_grouped_mm_small(x[:1], w, w_scale, offs * 0 + 1, reduce_in_kernel=False)
    fp8_linear(x[:1], w[2], w_scale[2])  # a dense layer of one row: GEMV
    fp8_linear(x[:2], w[2], w_scale[2])
    assert calls == [6, 1, 1], calls
    gemv_triton.GEMV_ENABLED = False
    expert_mm(x, w, offs, w_scale, small_m=True, group_rows=1)
    fp8_linear(x[:1], w[2], w_scale[2])
    assert calls == [6, 1, 1], calls  # the switch off: no GEMV
    gemv_triton.GEMV_ENABLED = True

    # the FP8 MoE layer at 1 token (GEMV) against the switch off, and at 3 (no GEMV)
    moe = fp8_experts(ours_from(hf_moe(16, 1, seed=3)))
    moe.triton_max_pairs = 10**6
    for tokens, gemvs in ((1, 2), (3, 0)):
        h = torch.randn(tokens, 16, generator=gen)
        with torch.no_grad():
            gemv_triton.GEMV_ENABLED = False
            want = moe(h)
            gemv_triton.GEMV_ENABLED = True
            calls.clear()
            got = moe(h)
        assert len(calls) == gemvs, (tokens, calls)  # w13 and w2
        err = float((got - want).abs().max() / want.abs().max())
        assert err < 2.0 ** -10, (tokens, err)
    print("ok")
""")


def test_fp8_gemv_in_interpreter():
    """gemv_triton.fp8_gemv (on by default for one row a group): groups of 0-5 rows,
    masked and unmasked tiles, the dense form, against float64 on the quantized rows and
    against the split-K kernel; the dispatch of fp8_grouped_mm_small (the MoE layer's
    bound is its tokens; a named split-K knob keeps the split-K kernel; the switch) and
    the FP8 MoE layer with it on against off."""
    run_in_interpreter(GEMV_SCRIPT)


GEMV16_SCRIPT = textwrap.dedent("""
    import tempfile
    import torch
    from torch import nn
    import chunklocal
    from llama4_tiny import write_tiny_llama4
    from chunklocal.engine.sampling import SamplingParams
    from chunklocal.models import gemv_triton

    gen = torch.Generator().manual_seed(9)
    # the kernel's 16-bit form (float32 in the interpreter): masked (N = 40, K = 100) and
    # unmasked (N = 48, K = 512) tiles, against float64
    for n, k in ((40, 100), (48, 512)):
        w = torch.randn(n, k, generator=gen)
        x = torch.randn(1, k, generator=gen)
        got = gemv_triton.gemv16(x, w)
        want = x.double() @ w.double().T
        assert got.shape == (1, n) and got.dtype == x.dtype
        assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-6
    # the partial sums' form (gemv_triton.PARTIAL_ENABLED, on by default) and the plain one
    assert gemv_triton.PARTIAL_ENABLED
    gemv_triton.PARTIAL_ENABLED = False
    got = gemv_triton.gemv16(x, w)
    assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-6
    gemv_triton.PARTIAL_ENABLED = True
    # linear's dispatch: off by default; on, one row of a plain nn.Linear without bias only
    calls, real = [], gemv_triton.gemv16
    gemv_triton.gemv16 = lambda *a: calls.append(tuple(a[1].shape)) or real(*a)
    lin, x = nn.Linear(100, 40, bias=False), torch.randn(1, 100, generator=gen)
    assert not gemv_triton.LINEAR_ENABLED  # CHUNKLOCAL_GEMV_LINEAR=1 turns it on
    gemv_triton.linear(lin, x)
    assert calls == []
    gemv_triton.LINEAR_ENABLED = True
    torch.testing.assert_close(gemv_triton.linear(lin, x), lin(x), rtol=1e-5, atol=1e-5)
    gemv_triton.linear(lin, torch.randn(2, 100))  # two rows
    gemv_triton.linear(nn.Linear(100, 40), x)  # a bias
    assert calls == [(40, 100)], calls

    # the engine at batch 1: its decode steps' q/k/v, o_proj and LM head through the GEMV,
    # the same greedy tokens as with it off
    path = tempfile.mkdtemp()
    write_tiny_llama4(path, seed=4)
    llm = chunklocal.LLM(path, device="cpu", dtype=torch.float32, max_model_len=128,
                         block_size=4)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outs = {}
    for on in (False, True):
        gemv_triton.LINEAR_ENABLED = on
        calls.clear()
        outs[on] = llm.generate([[5, 17, 300, 42, 9, 77]], params)[0].outputs[0].token_ids
    assert len(calls) >= 4 * 2, calls  # decode steps x (qkv, o_proj per layer + LM head)
    assert outs[True] == outs[False], outs
    print("ok")
""")


def test_gemv16_and_its_linear_dispatch_in_interpreter():
    """gemv_triton.gemv16 (the kernel without scales) against float64, linear's dispatch
    (off by default; one row of a plain nn.Linear without bias), and the engine's greedy
    tokens at batch 1 with it on against off."""
    run_in_interpreter(GEMV16_SCRIPT)


GATHER_QUANT_SCRIPT = textwrap.dedent("""
    import torch
    from test_moe import fp8_experts, hf_moe, ours_from
    from chunklocal.models import moe as moe_mod, quant_triton

    gen = torch.Generator().manual_seed(7)
    # the kernel: gathered, scaled rows quantize to the bits of torch's product's (repeats,
    # an unused row, a row whose scaled amax the cap of 1.5 cuts)
    x = torch.randn(9, 100, generator=gen) * 3
    rows = torch.tensor([4, 0, 0, 8, 2, 7])
    rs = torch.rand(6, generator=gen) + 0.25
    for ub in (None, 1.5):
        q, s = quant_triton.quantize_rows(x, ub, rows, rs)
        wq, ws = quant_triton.quantize_rows(x[rows] * rs[:, None], ub)
        assert q.shape == (6, 100) and s.shape == (6, 1)
        assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s, ws)
    for bad in ((rows, None), (rows, rs[:5]), (rows.view(2, 3), rs.view(2, 3))):
        try:
            quant_triton.quantize_rows(x, None, *bad)
        except ValueError as err:
            assert "rows" in str(err)
        else:
            raise AssertionError(f"no refusal of rows {bad}")

    # the MoE layer with FP8 experts: the same output with the switch on as off, on the
    # Triton kernel's steps and on quant.fp8_grouped_mm's, and the fused call is made
    moe = fp8_experts(ours_from(hf_moe(16, 1, seed=3)))
    x = torch.randn(40, 16, generator=gen)

    def on_against_off(switch, kernel, tolerance):
        # the layer with moe.<switch> on against off, on torch's grouped GEMM path and the
        # split-K kernel's; the fused kernel called once a step (with rows: GATHER_QUANT)
        assert getattr(moe_mod, switch)  # on by default (=0 turns it off)
        calls, real = [], getattr(quant_triton, kernel)
        def counting(*a, **kw):
            calls.append(kernel != "quantize_rows" or len(a) > 2 or "rows" in kw)
            return real(*a, **kw)
        setattr(moe_mod, kernel, counting)
        for limit in (0, 10**6):
            moe.triton_max_pairs = limit
            with torch.no_grad():
                setattr(moe_mod, switch, False)
                want = moe(x)
                setattr(moe_mod, switch, True)
                calls.clear()
                got = moe(x)
            assert calls == [True], calls
            err = float((got - want).abs().max() / want.abs().max())
            assert err <= tolerance, (switch, limit, err)
        setattr(moe_mod, kernel, real)
        setattr(moe_mod, switch, True)

    on_against_off("GATHER_QUANT", "quantize_rows", 0.0)  # the same bits

    # SILU_QUANT: silu(gate) * up quantized in the same kernel, against quantizing the
    # product made in torch (float32 here: the interpreter's exp may differ by an ulp, and
    # its e4m3 cast can drop a carry, so a few bytes may differ; the scales agree closely)
    gate_up = torch.randn(12, 2 * 72, generator=gen) * 4
    g, u = gate_up.chunk(2, dim=-1)
    for ub in (None, 2.0):
        q, s = quant_triton.silu_mul_quantize(gate_up, ub)
        wq, ws = quant_triton.quantize_rows((g / (1 + torch.exp(-g)) * u).contiguous(), ub)
        assert q.shape == (12, 72) and s.shape == (12, 1)
        same = (q.view(torch.uint8) == wq.view(torch.uint8)).float().mean()
        assert same >= 0.99, same
        assert torch.allclose(s, ws, rtol=1e-6, atol=0)
    try:
        quant_triton.silu_mul_quantize(gate_up[:, :-1])
    except ValueError as err:
        assert "[M, 2I]" in str(err)
    else:
        raise AssertionError("an odd width was taken")
    # torch's SiLU (x * sigmoid(x)) against the kernel's x / (1 + exp(-x)): float32 ulps in
    # the scales, no byte of this seed's rows flips (a flip: about 2**-5)
    on_against_off("SILU_QUANT", "silu_mul_quantize", 2 ** -12)

    # SHARED_SILU_QUANT (off): the stacked FP8 shared expert's dense GEMMs (steps past
    # fuse_max_tokens) take its silu(gate) * up quantized by the same kernel too
    from chunklocal.models.quant import FP8, Fp8Linear
    layer = fp8_experts(ours_from(hf_moe(16, 1, seed=5)))
    sh = layer.shared_expert
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(sh, name)
        w = lin.weight.data
        scale = w.abs().amax(-1).clamp(min=1e-6) / 448.0
        fp8 = Fp8Linear(lin.in_features, lin.out_features)
        fp8.weight.data, fp8.weight_scale.data = (w / scale[:, None]).to(FP8), scale.float()
        setattr(sh, name, fp8)
    assert layer.stack_shared()
    layer.fuse_max_tokens = 16
    x = torch.randn(40, 16, generator=gen) * 2
    assert not moe_mod.SHARED_SILU_QUANT  # off by default (=1 turns it on)
    calls, real = [], quant_triton.silu_mul_quantize
    moe_mod.silu_mul_quantize = lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw)
    with torch.no_grad():
        want = layer(x)
        assert calls == [40]  # the routed pairs' only
        moe_mod.SHARED_SILU_QUANT = True
        got = layer(x)
        moe_mod.SHARED_SILU_QUANT = False
    assert calls == [40, 40, 40], calls  # and the shared expert's 40 rows
    moe_mod.silu_mul_quantize = real
    err = float((got - want).abs().max() / want.abs().max())
    assert 0 < err <= 2 ** -10 or torch.equal(got, want), err
    print("ok")
""")


def test_moe_gathers_scales_and_quantizes_its_rows_in_one_kernel():
    """moe.GATHER_QUANT (on by default): quantize_rows with ``rows`` / ``row_scale`` gives
    the bits of quantizing torch's ``x[rows] * row_scale``, refuses mismatched ones naming
    them, and an FP8 MoE layer's output is bit for bit the same with it on as off.
    moe.SILU_QUANT (on): silu_mul_quantize against quantizing torch's product, and the
    layer's output with it on within FP8's step of the output with it off."""
    run_in_interpreter(GATHER_QUANT_SCRIPT)


QUANT_SCRIPT = textwrap.dedent("""
    import torch
    from chunklocal.models import moe_triton, quant_triton
    from chunklocal.models.quant import FP8, fp8_linear, quantize_per_token

    assert quant_triton.QUANT_ENABLED  # on by default (CHUNKLOCAL_FP8_QUANT_TRITON=0: off)
    quant_triton.QUANT_ENABLED = False
    moe_triton.FP8_ENABLED = False  # fp8_linear on torch's GEMM, whose quantization this is
    gen = torch.Generator().manual_seed(1)
    m, k = 9, 100  # K not a power of two: the last load of a row is masked
    # Rows whose quantization is exact (see FP8_SCRIPT), of different binades; an all-zero
    # row (the amax floor); a row whose amax the cap of 112 = 448 / 4 cuts (it saturates).
    x = (torch.randn(m, k, generator=gen) * 100).clamp(-448, 448).to(FP8).float()
    x[:, 3] = -448.0
    x = x * 2.0 ** torch.randint(-6, 6, (m, 1), generator=gen).float()
    x[2] = 0.0
    x[5] = x[5].abs().clamp(min=1.0) * 4.0
    quant_triton.MAX_BLOCK_K = 32  # four loads per row
    for ub in (None, 112.0):
        want_q, want_s = quantize_per_token(x, ub)  # the switch off: torch's path
        got_q, got_s = quant_triton.quantize_rows(x, ub)
        assert got_q.dtype == FP8 and got_s.shape == (m, 1)
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), ub
        assert torch.equal(got_s, want_s), ub
    # the switch on: quantize_per_token takes the kernel, except with a cross-rank amax
    calls, real = [], quant_triton.quantize_rows
    quant_triton.quantize_rows = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    quant_triton.QUANT_ENABLED = True
    w = (torch.randn(16, k, generator=gen) * 0.5).to(FP8)
    w_scale = torch.rand(16, generator=gen) + 0.5
    on = fp8_linear(x, w, w_scale)
    assert calls == [1]
    quantize_per_token(x, None, amax_reduce=lambda a: a)
    assert calls == [1]
    quant_triton.QUANT_ENABLED = False
    assert torch.equal(on, fp8_linear(x, w, w_scale))
    print("ok")
""")


ONE_PASS_SCRIPT = textwrap.dedent("""
    import torch
    from chunklocal.models import quant_triton

    assert quant_triton.ONE_PASS_ENABLED  # on by default (=0 turns it off)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 100, generator=gen) * 30   # K not a power of two: masked lanes
    x[3] = 0.0                                    # the amax floor
    x[4, 17] = -5000.0                            # an amax the cap of 112 cuts
    gate_up = torch.randn(5, 2 * 100, generator=gen) * 4
    rows, rs = torch.tensor([6, 0, 0, 4, 3]), torch.rand(5, generator=gen) + 0.25
    quant_triton.MAX_BLOCK_K = 32  # the two-pass form: four loads of each row, twice
    launches, real = [], quant_triton._quantize_rows_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((kwargs["ONE_PASS"], kwargs["BLOCK_K"]))
                return real[grid](*args, **kwargs)
            return launch

    quant_triton._quantize_rows_kernel = Spy()
    forms = [lambda ub: quant_triton.quantize_rows(x, ub),
             lambda ub: quant_triton.quantize_rows(x, ub, rows, rs),
             lambda ub: quant_triton.silu_mul_quantize(gate_up, ub)]
    for form in forms:
        for ub in (None, 112.0):
            quant_triton.ONE_PASS_ENABLED = False
            want_q, want_s = form(ub)
            quant_triton.ONE_PASS_ENABLED = True
            got_q, got_s = form(ub)
            assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), ub
            assert torch.equal(got_s, want_s), ub
    assert launches == [(False, 32), (True, 128)] * 6, launches
    quant_triton.ONE_PASS_MAX_K = 64  # rows longer than the bound keep two passes
    launches.clear()
    forms[0](None)
    assert launches == [(False, 32)], launches
    # long steps of rows that are not a power of two: two passes of TWO_PASS_BLOCK_K (7
    # rows here, so the 5 gathered ones and the SiLU rows keep the one pass), same bits
    quant_triton.ONE_PASS_MAX_K, quant_triton.TWO_PASS_ROWS = 8192, 7
    quant_triton.TWO_PASS_BLOCK_K = 64
    launches.clear()
    got = [form(112.0) for form in forms]
    assert launches == [(False, 64), (True, 128), (True, 128)], launches
    quant_triton.TWO_PASS_ROWS = 0
    for (got_q, got_s), form in zip(got, forms):
        want_q, want_s = form(112.0)
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(got_s, want_s)
    assert launches[3:] == [(True, 128)] * 3, launches
    print("ok")
""")


def test_one_pass_quantization_gives_the_two_pass_bits_in_interpreter():
    """quant_triton.ONE_PASS_ENABLED: a row held in registers quantizes to the two-pass
    form's bytes and scales in every form (plain, capped, gathered and scaled, SiLU
    product), with masked lanes and the amax floor; rows past ONE_PASS_MAX_K keep two."""
    run_in_interpreter(ONE_PASS_SCRIPT)


def test_quantization_launch_choice_by_step_length(monkeypatch):
    """quant_triton.launch_config: two 1024-wide passes at 4 warps from TWO_PASS_ROWS rows
    of a length that is no power of two (Scout's 5120); one pass below it, for SiLU rows
    and for powers of two; TWO_PASS_ROWS = 0 never; a bad variable names itself."""
    pytest.importorskip("triton")
    from chunklocal.models import quant_triton

    choose = quant_triton.launch_config
    assert quant_triton.TWO_PASS_ROWS == 2048
    assert choose(5120, 2048) == choose(5120, 8192) == (False, 1024, 4)
    assert choose(5120, 2047) == choose(5120, 1) == (True, 8192, 16)
    assert choose(5120, 8192, silu_mul=True) == (True, 8192, 16)
    assert choose(8192, 8192) == (True, 8192, 16)  # a power of two: no masked lanes
    assert choose(1000, 8192) == (True, 1024, 4)   # fits one load already
    monkeypatch.setattr(quant_triton, "TWO_PASS_ROWS", 0)
    assert choose(5120, 8192) == (True, 8192, 16)
    env = dict(os.environ, CHUNKLOCAL_FP8_QUANT_TWO_PASS_ROWS="-1")
    run = subprocess.run([sys.executable, "-c", "import chunklocal.models.quant_triton"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert "CHUNKLOCAL_FP8_QUANT_TWO_PASS_ROWS='-1': expected a whole number" in run.stderr


def test_fp8_quantization_kernel_in_interpreter():
    """quant_triton's one-kernel quantization gives torch's bytes and scales (exactly
    quantizable rows, several loads per row, the amax floor and cap), and
    quantize_per_token dispatches to it only when switched on and without amax_reduce."""
    run_in_interpreter(QUANT_SCRIPT)


def test_gemv_row_limit_variable_is_checked_at_import():
    """CHUNKLOCAL_FP8_GEMV_MAX_ROWS that is no whole number is refused naming itself."""
    env = dict(os.environ, CHUNKLOCAL_FP8_GEMV_MAX_ROWS="two")
    run = subprocess.run([sys.executable, "-c", "import chunklocal.models.gemv_triton"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "CHUNKLOCAL_FP8_GEMV_MAX_ROWS='two': expected a whole number" in run.stderr
