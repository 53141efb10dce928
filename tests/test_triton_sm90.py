"""Every Triton kernel of the package compiled for the H200 (sm_90) on the CPU, as its own
wrapper launches it.

CI has no GPU, but Triton compiles for a named target without one (LLVM and the ptxas it
ships).  Each kernel object is replaced by a recorder; the real wrappers then run on CPU
tensors of the dtypes the GPU path uses (bf16 rows, e4m3 weights and pages, int32 offsets),
so their argument binding is checked as it is written; and every recorded launch is
compiled to a cubin for sm_90 with the argument types it was given and its constexprs and
launch options.  A renamed kernel argument, a constexpr the wrapper no longer passes, a
type error in a branch the interpreter tests never reach (Triton's interpreter runs Python,
not the compiler), or code the sm_90 backend rejects fails here rather than on the device.
Whether the compiled kernel is right and fast is the GPU tests' and benchmarks' question.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from benchmarks.sass_loops import Recorder, compile_launch  # noqa: E402
from chunklocal.models import (  # noqa: E402
    gemv_triton,
    kv_write_triton,
    moe_triton,
    norm_triton,
    quant_triton,
    route_triton,
)
from chunklocal.models.quant import FP8  # noqa: E402

BF16 = torch.bfloat16


@pytest.fixture
def recorded(monkeypatch):
    """Every kernel of the package replaced by a Recorder (the wrappers look them up in
    their own modules at each call)."""
    recorders = {}
    for module, name in ((quant_triton, "_quantize_rows_kernel"),
                         (moe_triton, "_fp8_splitk_kernel"),
                         (gemv_triton, "_gemv_kernel"),
                         (gemv_triton, "_gemv_mma_kernel"),
                         (moe_triton, "_grouped_gemm_kernel"),
                         (moe_triton, "_splitk_sum_kernel"),
                         (kv_write_triton, "_write_kv_kernel"),
                         (norm_triton, "_add_rms_norm_kernel"),
                         (norm_triton, "_rope_norm_kernel"),
                         (route_triton, "_sort_pairs_kernel"),
                         (route_triton, "_route_pairs_kernel"),
                         (route_triton, "_combine_kernel"),
                         (route_triton, "_router_pairs_kernel")):
        recorders[name] = Recorder(getattr(module, name))
        monkeypatch.setattr(module, name, recorders[name])
    return recorders


def compile_all(recorder, expect: int) -> set:
    assert len(recorder.launches) == expect, len(recorder.launches)
    names = set()
    for _grid, args, kwargs in recorder.launches:
        kernel = compile_launch(recorder.fn, args, dict(kwargs))
        assert kernel.asm["cubin"], recorder.fn.__name__
        names.add(kernel.name)
    return names


def test_quantization_kernel_every_form(recorded):
    x = torch.zeros(3, 5120, dtype=BF16)
    quant_triton.quantize_rows(x)
    quant_triton.quantize_rows(x, 1200.0)
    quant_triton.quantize_rows(x, None, torch.tensor([2, 0]), torch.ones(2, dtype=BF16))
    quant_triton.silu_mul_quantize(torch.zeros(3, 2 * 8192, dtype=BF16), 2.0)
    compile_all(recorded["_quantize_rows_kernel"], 4)


def test_one_pass_quantization_kernel_every_form(recorded, monkeypatch):
    """The one-pass form (rows of up to 8192 held in registers, 16 warps) compiles for
    sm_90 in every form, at Scout's hidden size and inner size."""
    monkeypatch.setattr(quant_triton, "ONE_PASS_ENABLED", True)
    x = torch.zeros(3, 5120, dtype=BF16)
    quant_triton.quantize_rows(x)
    quant_triton.quantize_rows(x, 1200.0, torch.tensor([2, 0]), torch.ones(2, dtype=BF16))
    quant_triton.silu_mul_quantize(torch.zeros(3, 2 * 8192, dtype=BF16), 2.0)
    assert [kw["ONE_PASS"] for _, _, kw in recorded["_quantize_rows_kernel"].launches] == \
        [True] * 3
    compile_all(recorded["_quantize_rows_kernel"], 3)


@pytest.mark.parametrize("reduce", [False, True], ids=["sum", "reduce"])
@pytest.mark.parametrize("slots", [False, True], ids=["per-expert", "routed-slots"])
def test_fp8_split_k_kernel_every_form(recorded, reduce, slots):
    """Routed experts (offsets, 1 row of 16 experts) and a dense layer (no offsets), with
    the in-kernel sum and the routed-slot grid on and off, the rows quantized by the kernel
    or coming quantized (QuantRows)."""
    w, scale = torch.zeros(16, 256, 5120, dtype=FP8), torch.ones(16, 256)
    offs = torch.ones(16, dtype=torch.int32)
    kw = dict(reduce_in_kernel=reduce, routed_slots_in_kernel=slots)
    moe_triton.fp8_grouped_mm_small(torch.zeros(1, 5120, dtype=BF16), w, scale, offs, **kw)
    moe_triton.fp8_grouped_mm_small(torch.zeros(5, 5120, dtype=BF16), w[:1], scale[:1], None,
                                    2.0, **kw)
    rows = quant_triton.QuantRows(torch.zeros(1, 5120, dtype=FP8), torch.ones(1, 1), BF16)
    moe_triton.fp8_grouped_mm_small(rows, w, scale, offs, **kw)
    compile_all(recorded["_fp8_splitk_kernel"], 3)
    compile_all(recorded["_quantize_rows_kernel"], 2)


def test_gemv_kernel_every_form(recorded, monkeypatch):
    """The GEMV on Scout's expert shapes (17 groups with the shared one) at a batch-1 step,
    through fp8_grouped_mm_small's dispatch with rows quantized by the kernel or coming
    quantized; a masked tile; the dense form."""
    from chunklocal.models.quant_triton import QuantRows

    monkeypatch.setattr(gemv_triton, "PARTIAL_ENABLED", False)  # the plain form first
    for n, k in ((16384, 5120), (5120, 8192)):
        w, scale = torch.zeros(17, n, k, dtype=FP8), torch.ones(17, n)
        offs = torch.full((17,), 2, dtype=torch.int32)
        moe_triton.fp8_grouped_mm_small(torch.zeros(2, k, dtype=BF16), w, scale, offs,
                                        group_rows=1)
    rows = QuantRows(torch.zeros(2, 5120, dtype=FP8), torch.ones(2, 1), BF16)
    moe_triton.fp8_grouped_mm_small(rows, w[:, :, :5120], scale, offs, group_rows=1)
    gemv_triton.fp8_gemv(rows.q[:, :5000], rows.scale, BF16, torch.zeros(1, 200, 5000,
                         dtype=FP8), torch.ones(1, 200), None)
    moe_triton.fp8_linear_small(torch.zeros(1, 5120, dtype=BF16), w[0, :, :5120], scale[0])
    # the 16-bit form (gemv16, off by default): Scout's fused q/k/v and a masked LM head
    for n in (7168, 1000):
        gemv_triton.gemv16(torch.empty(1, 5120, dtype=BF16), torch.empty(n, 5120, dtype=BF16))
    # the partial sums' form (on by default), e4m3 and 16-bit
    gemv_triton.fp8_gemv(rows.q, rows.scale, BF16, w[:, :, :5120], scale, offs, partial=True)
    monkeypatch.setattr(gemv_triton, "PARTIAL_ENABLED", True)
    gemv_triton.gemv16(torch.empty(1, 5120, dtype=BF16), torch.empty(7168, 5120, dtype=BF16))
    launches = recorded["_gemv_kernel"].launches
    assert [kw["EVEN_K"] for _, _, kw in launches] == [True] * 3 + [False] + [True] * 5
    assert [kw["HAS_OFFS"] for _, _, kw in launches] == [True] * 3 + [False] * 4 + [
        True, False]
    assert [kw["SCALED"] for _, _, kw in launches] == [True] * 5 + [False] * 2 + [True, False]
    assert [(kw["PARTIAL"], kw["GROUP"]) for _, _, kw in launches][-3:] == [
        (False, 8), (True, 16), (True, 8)]
    # the e4m3 partial form takes its own tile (PARTIAL_TILE), the 16-bit one the default
    assert [(kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"]) for _, _, kw in launches][-3:] == [
        gemv_triton.DEFAULT_TILE, gemv_triton.PARTIAL_TILE, gemv_triton.DEFAULT_TILE]
    assert gemv_triton.PARTIAL_TILE == (16, 1024, 4)  # the H100 tune's pick (BENCHMARKS.md)
    assert recorded["_fp8_splitk_kernel"].launches == []
    compile_all(recorded["_gemv_kernel"], 9)


def test_gemv_mma_kernel_every_form(recorded):
    """The tensor-core GEMV (off by default) on Scout's expert shapes at a batch-1 step (17
    groups, two of one row) and at 16 rows a group, a masked tile and the dense form, its
    grid one routed slot per group with rows (its K loop: the test below)."""
    for n, k, per_group in ((16384, 5120, 1), (5120, 8192, 1), (5120, 8192, 16)):
        w, scale = torch.zeros(17, n, k, dtype=FP8), torch.ones(17, n)
        offs = torch.full((17,), 2 * per_group, dtype=torch.int32)
        offs[-2] = per_group
        rows = torch.zeros(2 * per_group, k, dtype=FP8)
        gemv_triton.fp8_gemv(rows, torch.ones(2 * per_group, 1), BF16, w, scale, offs,
                             mma=True)
    gemv_triton.fp8_gemv(torch.zeros(3, 5000, dtype=FP8), torch.ones(3, 1), BF16,
                         torch.zeros(1, 200, 5000, dtype=FP8), torch.ones(1, 200), None,
                         mma=True)
    launches = recorded["_gemv_mma_kernel"].launches
    assert [kw["EVEN_K"] and kw["EVEN_N"] for _, _, kw in launches] == [True] * 3 + [False]
    assert [grid for grid, _, _ in launches] == [(256, 2), (80, 2), (80, 17), (4, 1)]
    assert gemv_triton.MMA_TILE == (64, 256, 4, 3) and gemv_triton.MMA_ROWS == 16
    compile_all(recorded["_gemv_mma_kernel"], 4)


def test_gemv_forms_k_loops_as_the_jit_compiles_them():
    """benchmarks/sass_loops.py's reading of Scout's batch-1 w13 launch: the tensor-core
    form's K loop is e4m3 wgmma (``QGMMA``) with no conversion (``F2FP``) and no f16 MMA
    (``HMMA``: Triton's form below M = 64, or with ``max_num_imprecise_acc=0``), where the
    elementwise forms convert every byte (the reason for the form:
    gemv_triton.MMA_ENABLED)."""
    from benchmarks.sass_loops import gemv_rows

    rows = {row["form"]: row for row in gemv_rows()}
    mma = rows["tensor cores"]
    assert mma["QGMMA_a_byte"] > 0 and mma["F2FP_a_byte"] == 0 and mma["HMMA_a_byte"] == 0
    for form in ("elementwise", "partial sums"):
        assert rows[form]["F2FP_a_byte"] > 0.5 and rows[form]["QGMMA_a_byte"] == 0, form
    assert mma["instructions_a_byte"] < rows["elementwise"]["instructions_a_byte"] / 1.5


def test_split_k_sum_kernel(recorded):
    moe_triton.splitk_sum(torch.zeros(4, 1, 5120), BF16)
    compile_all(recorded["_splitk_sum_kernel"], 1)


def test_float_grouped_kernel(recorded):
    offs = torch.tensor([1, 1, 3], dtype=torch.int32)
    moe_triton.grouped_mm_small(torch.zeros(3, 512, dtype=BF16),
                                torch.zeros(3, 256, 512, dtype=BF16), offs)
    compile_all(recorded["_grouped_gemm_kernel"], 1)


def test_kv_write_kernel_fp8_and_16bit_pages(recorded):
    qkv = torch.zeros(4, 3 * 8 * 128, dtype=BF16)  # k and v strided, as the projection's
    k, v = qkv[:, 1024:2048].view(4, 8, 128), qkv[:, 2048:].view(4, 8, 128)
    slots = torch.arange(4)
    pages = [torch.zeros(64, 8, 128, dtype=FP8) for _ in range(2)]
    kv_write_triton.write_kv_fp8(*pages, slots, k, v, 0.5, 2.0)
    kv_write_triton.write_kv(*[torch.zeros(64, 8, 128, dtype=BF16) for _ in range(2)], slots,
                             k, v)
    compile_all(recorded["_write_kv_kernel"], 2)


def test_norm_and_rope_kernels(recorded):
    h = torch.zeros(3, 5120, dtype=BF16)
    norm_triton.add_rms_norm_rows(h, torch.zeros_like(h), torch.ones(5120, dtype=BF16), 1e-5)
    norm_triton.add_rms_norm_rows(h, None, torch.ones(5120, dtype=BF16), 1e-5)
    compile_all(recorded["_add_rms_norm_kernel"], 2)
    x = torch.zeros(3, 40, 128, dtype=BF16)
    freqs = torch.polar(torch.ones(3, 64), torch.zeros(3, 64))
    norm_triton.rope_norm_rows(x, freqs, 1e-6)
    norm_triton.rope_norm_rows(x, freqs, None)
    tiled, vec = norm_triton.ROPE_TILED, norm_triton.ROPE_VEC
    try:  # tiles of heads (CHUNKLOCAL_ROPE_TILED), q and k of one launch; whole heads (VEC)
        for norm_triton.ROPE_TILED, norm_triton.ROPE_VEC in ((True, False), (False, True)):
            norm_triton.rope_norm_rows(torch.zeros(3, 48, 128, dtype=BF16), freqs, 1e-6,
                                       split=40)
    finally:
        norm_triton.ROPE_TILED, norm_triton.ROPE_VEC = tiled, vec
    compile_all(recorded["_rope_norm_kernel"], 4)


def launch_every_kernel():
    """One launch of each of the package's kernels through its wrapper, at Scout's sizes."""
    h, w1 = torch.zeros(1, 5120, dtype=BF16), torch.ones(5120, dtype=BF16)
    quant_triton.quantize_rows(h)
    w, scale = torch.zeros(17, 256, 5120, dtype=FP8), torch.ones(17, 256)
    offs = torch.full((17,), 2, dtype=torch.int32)
    moe_triton.fp8_grouped_mm_small(torch.zeros(2, 5120, dtype=BF16), w, scale, offs,
                                    reduce_in_kernel=False)
    moe_triton.fp8_grouped_mm_small(torch.zeros(2, 5120, dtype=BF16), w, scale, offs,
                                    group_rows=1)
    gemv_triton.fp8_gemv(torch.zeros(2, 5120, dtype=FP8), torch.ones(2, 1), BF16, w, scale,
                         offs, mma=True)
    moe_triton.splitk_sum(torch.zeros(4, 1, 5120), BF16)
    moe_triton.grouped_mm_small(torch.zeros(3, 512, dtype=BF16),
                                torch.zeros(3, 256, 512, dtype=BF16), offs[:3])
    kv = torch.zeros(1, 8, 128, dtype=BF16)
    kv_write_triton.write_kv_fp8(*[torch.zeros(64, 8, 128, dtype=FP8) for _ in range(2)],
                                 torch.arange(1), kv, kv, 0.5, 2.0)
    norm_triton.add_rms_norm_rows(h, h, w1, 1e-5)
    norm_triton.rope_norm_rows(torch.zeros(1, 48, 128, dtype=BF16),
                               torch.polar(torch.ones(1, 64), torch.zeros(1, 64)), 1e-6, 40)
    route_triton.sort_pairs(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, dtype=BF16),
                            16, True)
    route_triton.route_pairs(torch.zeros(1, 16, dtype=BF16), 16, True, BF16)
    route_triton.combine_rows(torch.zeros(2, 5120, dtype=BF16),
                              torch.zeros(2, dtype=torch.int64), 1, 2)
    route_triton.route_pairs_from_x(h, torch.zeros(16, 5120, dtype=BF16), True)


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_every_kernel_with_and_without_pdl(recorded, monkeypatch, pdl):
    """With ``quant_triton.PDL_ENABLED`` on a device that takes it, every kernel is
    launched with ``launch_pdl`` and its sm_90 code waits on the kernel before it
    (``griddepcontrol.wait``) and releases the next (``griddepcontrol.launch_dependents``);
    with the switch off no kernel carries either."""
    monkeypatch.setattr(quant_triton, "PDL_ENABLED", pdl)
    monkeypatch.setattr(quant_triton, "pdl_supported", lambda x: True)
    launch_every_kernel()
    for name, recorder in recorded.items():
        assert recorder.launches, name
        _grid, args, kwargs = recorder.launches[-1]
        assert kwargs["PDL"] is pdl and kwargs.get("launch_pdl", False) is pdl, name
        kernel = compile_launch(recorder.fn, args, dict(kwargs))
        ptx = kernel.asm["ptx"]
        for op in ("griddepcontrol.wait", "griddepcontrol.launch_dependents"):
            assert (op in ptx) is pdl, (name, op)
        assert kernel.metadata.launch_pdl is pdl, name


def test_pdl_needs_the_switch_and_a_device_that_takes_it(monkeypatch):
    x = torch.zeros(1, 8, dtype=BF16)
    assert quant_triton.pdl_args(x) == {"PDL": False}  # off by default
    monkeypatch.setattr(quant_triton, "PDL_ENABLED", True)
    assert quant_triton.pdl_args(x) == {"PDL": False}  # a CPU tensor
    monkeypatch.setattr(quant_triton, "pdl_supported", lambda t: True)
    assert quant_triton.pdl_args(x) == {"PDL": True, "launch_pdl": True}


def test_every_kernel_of_the_package_is_compiled_here():
    """The fixture's list is the package's: a new kernel joins these tests."""
    import ast
    from pathlib import Path

    found = set()
    for path in (Path(__file__).resolve().parents[1] / "src" / "chunklocal").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                    "triton.jit" in ast.unparse(d) for d in node.decorator_list):
                found.add(node.name)
    assert found == {"_quantize_rows_kernel", "_fp8_splitk_kernel", "_grouped_gemm_kernel",
                     "_gemv_kernel", "_gemv_mma_kernel",
                     "_splitk_sum_kernel",
                     "_write_kv_kernel", "_add_rms_norm_kernel", "_rope_norm_kernel",
                     "_sort_pairs_kernel", "_route_pairs_kernel", "_combine_kernel",
                     "_router_pairs_kernel"}


def test_route_kernel(recorded):
    """Top-1 ids and bf16 scores of 1 and 16 tokens (Scout's 16 experts), with and without
    the shared expert's group, and Maverick's 128 with it (a 256-wide group block)."""
    for tokens, experts, shared in ((1, 16, True), (16, 16, True), (64, 16, False),
                                    (8, 128, True), (256, 16, True), (1024, 16, False)):
        route_triton.sort_pairs(torch.zeros(tokens, 1, dtype=torch.int64),
                                torch.zeros(tokens, 1, dtype=BF16), experts, shared)
    compile_all(recorded["_sort_pairs_kernel"], 6)  # the last two: wide steps


def test_fused_routing_kernels(recorded):
    """route_pairs from bf16 logits (Scout's 16 experts with and without the shared group,
    the balanced rotation, Maverick's 128) and combine_rows over Scout's hidden size."""
    for tokens, experts, shared, offset in ((1, 16, True, None), (16, 16, True, 3),
                                            (64, 16, False, None), (8, 128, True, 7),
                                            (256, 16, True, None)):
        route_triton.route_pairs(torch.zeros(tokens, experts, dtype=BF16), experts, shared,
                                 BF16, offset)
    compile_all(recorded["_route_pairs_kernel"], 5)
    for tokens, slots in ((1, 2), (64, 1)):
        route_triton.combine_rows(torch.zeros(tokens * slots, 5120, dtype=BF16),
                                  torch.zeros(tokens * slots, dtype=torch.int64), tokens, slots)
    # the shared expert's rows added in (COMBINE_RANKED's prefill steps, one slot)
    route_triton.combine_rows(torch.zeros(64, 5120, dtype=BF16),
                              torch.zeros(64, dtype=torch.int64), 64, 1,
                              torch.zeros(64, 5120, dtype=BF16))
    compile_all(recorded["_combine_kernel"], 3)
    # the router's GEMM in the launch: bf16 rows of Scout's hidden size, 16 and 128 experts
    for tokens, experts, shared, offset in ((1, 16, True, None), (64, 16, False, 5),
                                            (8, 128, True, None)):
        route_triton.route_pairs_from_x(torch.zeros(tokens, 5120, dtype=BF16),
                                        torch.zeros(experts, 5120, dtype=BF16), shared, offset)
    compile_all(recorded["_router_pairs_kernel"], 3)
