"""moe_triton's FP8 small-M kernel (rows quantized once, a split-K grouped GEMM) compiled on
the GPU: against the CPU's fake-quantized float32 reference (the error model of
test_fp8_gpu.py), on random rows (the interpreter test on the CPU, tests/test_moe_triton.py,
can only use rows whose quantization is exact), eagerly and replayed in a CUDA graph with new
routing, and through the two dispatch points (``quant.fp8_linear`` and ``moe.expert_mm``)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from test_fp8_gpu import check_replays_with_new_routing, error_ratio, fp8_weights  # noqa: E402

from chunklocal.models import moe_triton, quant  # noqa: E402
from chunklocal.models.moe import expert_mm  # noqa: E402
from chunklocal.models.quant import fp8_grouped_mm, fp8_linear  # noqa: E402


def bf16_rows(m, k, seed, spread=True):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    if spread:  # rows of very different magnitude: per-token scales matter
        x = x * torch.logspace(-2, 2, m).view(-1, 1)
    return x.bfloat16()


@pytest.mark.parametrize("m", [1, 2, 7, 16, 33, 64])
@pytest.mark.parametrize("ub", [None, 2.0])
@pytest.mark.parametrize("n,k", [(384, 256), (5120, 8192)], ids=["small", "scout-down"])
def test_dense_kernel_equals_cpu_reference(m, ub, n, k):
    w, scale = fp8_weights(1, n, k, seed=m + 1000)
    x = bf16_rows(m, k, seed=m)
    got = moe_triton.fp8_linear_small(x.cuda(), w[0].cuda(), scale[0].cuda(), ub)
    want = fp8_linear(x.float(), w[0], scale[0], act_scale_ub=ub)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert error_ratio(got, x, w, scale, want, ub=ub) <= 1.0


@pytest.mark.parametrize("sizes", [[1, 0, 0, 0], [16, 32, 0, 48], [1, 0, 5, 3, 0, 7, 2, 1],
                                   [0, 0, 130, 1], [4] * 16],
                         ids=["one-row", "aligned", "ragged", "empty-groups", "spread"])
@pytest.mark.parametrize("ub", [None, 2.0])
@pytest.mark.parametrize("split_k", [None, 1, 3], ids=["split-auto", "split-1", "split-3"])
def test_grouped_kernel_equals_cpu_reference(sizes, ub, split_k):
    e, n, k = len(sizes), 256, 512
    w, scale = fp8_weights(e, n, k, seed=e)
    m = sum(sizes)
    x = bf16_rows(m, k, seed=2)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    got = moe_triton.fp8_grouped_mm_small(x.cuda(), w.cuda(), scale.cuda(), offs.cuda(), ub,
                                          split_k=split_k)
    want = fp8_grouped_mm(x.float(), w, scale, offs, act_scale_ub=ub)
    rows_of = torch.repeat_interleave(torch.arange(e), torch.tensor(sizes))
    assert error_ratio(got, x, w, scale, want, rows_of, ub=ub) <= 1.0


@torch.inference_mode()
def test_grouped_kernel_replays_in_a_cuda_graph_with_new_routing():
    check_replays_with_new_routing(moe_triton.fp8_grouped_mm_small)


def test_dispatch_takes_the_kernel_up_to_its_row_limits(monkeypatch):
    """fp8_linear: up to quant.SMALL_M_ROWS rows (no bias, no cross-rank amax); expert_mm:
    when the MoE layer says the step is small."""
    w, scale = fp8_weights(3, 128, 256, seed=9)
    w, scale = w.cuda(), scale.cuda()
    monkeypatch.setattr(moe_triton, "FP8_ENABLED", True)  # as CHUNKLOCAL_FP8_TRITON=0 may say
    calls = []
    for name in ("fp8_linear_small", "fp8_grouped_mm_small"):
        real = getattr(moe_triton, name)
        monkeypatch.setattr(moe_triton, name,
                            lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    limit = quant.SMALL_M_ROWS
    fp8_linear(bf16_rows(limit, 256, 1).cuda(), w[0], scale[0])
    fp8_linear(bf16_rows(limit + 1, 256, 1).cuda(), w[0], scale[0])
    fp8_linear(bf16_rows(4, 256, 1).cuda(), w[0], scale[0], amax_reduce=lambda a: a)
    offs = torch.tensor([2, 2, 5], dtype=torch.int32, device="cuda")
    expert_mm(bf16_rows(5, 256, 1).cuda(), w, offs, scale, small_m=True)
    expert_mm(bf16_rows(5, 256, 1).cuda(), w, offs, scale, small_m=False)
    # fp8_linear_small is the grouped kernel's one-group case: it calls through
    # fp8_grouped_mm_small, so the dense call records both names, the expert call one.
    assert calls == ["fp8_linear_small", "fp8_grouped_mm_small", "fp8_grouped_mm_small"]


@pytest.mark.parametrize("sizes", [[1, 0, 0, 0], [16, 32, 0, 48], [1, 0, 5, 3, 0, 7, 2, 1],
                                   [4] * 16], ids=["one-row", "aligned", "ragged", "spread"])
@pytest.mark.parametrize("split_k", [None, 1, 3], ids=["split-auto", "split-1", "split-3"])
def test_kernel_adding_its_k_slices_equals_the_separate_sum(sizes, split_k):
    """SPLITK_REDUCE_IN_KERNEL (off by default): the last program of each tile adds the
    slices (acquire-release ticket, L2 loads) -- within bf16 rounding of the separate sum
    (the order of float32 adds may differ from torch's), under the reference's error bound,
    the same bits on every call, and the counters left zeroed."""
    e, n, k = len(sizes), 320, 8192
    w, scale = fp8_weights(e, n, k, seed=e + 7)
    m = sum(sizes)
    x = bf16_rows(m, k, seed=3)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    args = (x.cuda(), w.cuda(), scale.cuda(), offs.cuda())
    separate = moe_triton.fp8_grouped_mm_small(*args, split_k=split_k, reduce_in_kernel=False)
    fused = [moe_triton.fp8_grouped_mm_small(*args, split_k=split_k, reduce_in_kernel=True)
             for _ in range(3)]
    assert all(torch.equal(f, fused[0]) for f in fused[1:])
    assert not moe_triton._TILE_COUNTERS[torch.device("cuda", 0)].any()
    diff = (fused[0].float() - separate.float()).abs()
    assert float(diff.max()) <= float(separate.float().abs().max()) * 2.0 ** -7
    want = fp8_grouped_mm(x.float(), w, scale, offs)
    rows_of = torch.repeat_interleave(torch.arange(e), torch.tensor(sizes))
    assert error_ratio(fused[0], x, w, scale, want, rows_of) <= 1.0


@torch.inference_mode()
def test_kernel_adding_its_k_slices_replays_in_a_cuda_graph():
    check_replays_with_new_routing(lambda *a: moe_triton.fp8_grouped_mm_small(
        *a, reduce_in_kernel=True))


@pytest.mark.parametrize("sizes", [[0, 0, 0, 1], [1, 0, 0, 0, 0, 0, 0, 0], [0, 2, 0, 1, 0],
                                   [16, 32, 0, 48], [4] * 16],
                         ids=["last-expert", "first-of-8", "two-of-5", "aligned", "spread"])
@pytest.mark.parametrize("reduce", [False, True], ids=["sum", "reduce"])
def test_routed_slots_grid_gives_the_same_bits(sizes, reduce):
    """ROUTED_SLOTS_ENABLED (off by default): min(E, M) slots, the j-th serving the j-th
    expert with rows, compute each tile as the one-slot-per-expert grid does -- the same
    bits -- and the counters are left zeroed."""
    e, n, k = len(sizes), 320, 8192
    w, scale = fp8_weights(e, n, k, seed=e + 11)
    x = bf16_rows(sum(sizes), k, seed=5)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    args = (x.cuda(), w.cuda(), scale.cuda(), offs.cuda())
    per_expert = moe_triton.fp8_grouped_mm_small(*args, reduce_in_kernel=reduce,
                                                 routed_slots_in_kernel=False)
    routed = moe_triton.fp8_grouped_mm_small(*args, reduce_in_kernel=reduce,
                                             routed_slots_in_kernel=True)
    assert torch.equal(routed, per_expert)
    if reduce:
        assert not moe_triton._TILE_COUNTERS[torch.device("cuda", 0)].any()


@torch.inference_mode()
def test_routed_slots_grid_replays_in_a_cuda_graph_with_new_routing():
    """Two rows over six experts: a graph of two slots, captured once, follows each step's
    routing (the slots' experts are found on the device at every replay)."""
    check_replays_with_new_routing(lambda *a: moe_triton.fp8_grouped_mm_small(
        *a, routed_slots_in_kernel=True))
    e, n, k, m = 6, 256, 512, 2
    w, scale = fp8_weights(e, n, k, seed=13)
    w, scale = w.cuda(), scale.cuda()
    x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
    offs = torch.zeros(e, dtype=torch.int32, device="cuda")

    def step(compact):
        return moe_triton.fp8_grouped_mm_small(x, w, scale, offs, routed_slots_in_kernel=compact)

    step(True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(True)
    for seed, sizes in enumerate([[2, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 1], [0, 0, 0, 0, 0, 2],
                                  [0, 0, 1, 1, 0, 0]]):
        x.copy_(bf16_rows(m, k, seed=seed))
        offs.copy_(torch.tensor(sizes).cumsum(0))
        graph.replay()
        assert torch.equal(out, step(False)), sizes


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("shape", list(moe_triton.TUNED_TILES),
                         ids=lambda s: f"{'grouped' if s[0] else 'dense'}-{s[1]}x{s[2]}")
def test_tuned_tiles_equal_cpu_reference(monkeypatch, shape, m):
    """CHUNKLOCAL_FP8_TUNED_TILES' tile of each shape it names (two experts stand for the
    routed layers' sixteen: the tile depends on N, K and grouping only) against the CPU
    reference, as the default tile is above; its launches and shared memory are checked on
    the CPU (tests/test_triton_sm90.py), its registers only here."""
    monkeypatch.setattr(moe_triton, "TUNED_TILES_ENABLED", True)
    grouped, n, k = shape
    e = 2 if grouped else 1
    w, scale = fp8_weights(e, n, k, seed=n + k)
    x = bf16_rows(m, k, seed=m + 7)
    sizes = [m - m // 2, m // 2] if grouped else [m]
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    got = moe_triton.fp8_grouped_mm_small(x.cuda(), w.cuda(), scale.cuda(),
                                          offs.cuda() if grouped else None, gemv=False)
    want = fp8_grouped_mm(x.float(), w, scale, offs)
    ends = offs.tolist()
    for expert, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        if end > start:  # one expert at a time: an [M, N, K] bound would not fit in memory
            rows = slice(start, end)
            assert error_ratio(got[rows], x[rows], w[expert:expert + 1],
                               scale[expert:expert + 1], want[rows]) <= 1.0


@pytest.mark.parametrize("splits", [2, 3, 8])
def test_split_k_sum_is_the_slice_order_sum_rounded_once(splits):
    """moe_triton.splitk_sum (SPLITK_SUM_TRITON) on the device: float32 partials added in
    slice order and rounded to bf16 once (round to nearest even), bit for bit, eagerly and
    replayed in a CUDA graph."""
    gen = torch.Generator(device="cuda").manual_seed(splits)
    part = torch.randn(splits, 16, 5120, device="cuda", generator=gen) * 100
    want = part[0].clone()
    for s in range(1, splits):
        want += part[s]
    assert torch.equal(moe_triton.splitk_sum(part, torch.bfloat16), want.bfloat16())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_triton.splitk_sum(part, torch.bfloat16)
    part.mul_(-0.5)
    graph.replay()
    assert torch.equal(out, (want * -0.5).bfloat16())


@pytest.mark.parametrize("sizes", [[1, 0, 0, 0], [0, 0, 0, 1], [1] + [0] * 15 + [1],
                                   [0, 2, 0, 1, 0], [3, 0, 4, 1], [1] * 16 + [16]],
                         ids=["one-row", "last", "batch-1-shared", "two", "four",
                              "batch-16-shared"])
@pytest.mark.parametrize("ub", [None, 2.0])
@pytest.mark.parametrize("n,k", [(320, 8192), (1000, 5000)], ids=["scout-k", "masked"])
@pytest.mark.parametrize("form", ["elementwise", "partial", "mma"])
def test_gemv_equals_cpu_reference(monkeypatch, sizes, ub, n, k, form):
    """gemv_triton.fp8_gemv (on by default for one row a group) against the CPU's
    fake-quantized reference on random rows, as the split-K kernel is above: one row a
    group (a batch-1 step with the shared group last), groups of several rows (each row
    re-reads the slab; the tensor-core form takes 16 a pass), masked tiles (N and K no
    multiples of the tile); each form (the partial sums, gemv_triton.PARTIAL_ENABLED, and
    the tensor-core form, MMA_ENABLED, both off by default)."""
    from chunklocal.models import gemv_triton

    monkeypatch.setattr(gemv_triton, "PARTIAL_ENABLED", form == "partial")
    monkeypatch.setattr(gemv_triton, "MMA_ENABLED", form == "mma")
    e = len(sizes)
    w, scale = fp8_weights(e, n, k, seed=e + 21)
    x = bf16_rows(sum(sizes), k, seed=7)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    got = moe_triton.fp8_grouped_mm_small(x.cuda(), w.cuda(), scale.cuda(), offs.cuda(), ub,
                                          gemv=True)
    want = fp8_grouped_mm(x.float(), w, scale, offs, act_scale_ub=ub)
    rows_of = torch.repeat_interleave(torch.arange(e), torch.tensor(sizes))
    assert got.dtype == torch.bfloat16
    assert error_ratio(got, x, w, scale, want, rows_of, ub=ub) <= 1.0


@pytest.mark.parametrize("m", [1, 2, 3, 17])
@pytest.mark.parametrize("mma", [False, True], ids=["elementwise", "mma"])
def test_gemv_dense_equals_cpu_reference(m, mma):
    """The dense form (one group, no offsets) at Scout's down projection, elementwise and
    on tensor cores (17 rows: two passes of 16)."""
    from chunklocal.models import gemv_triton

    n, k = 5120, 8192
    w, scale = fp8_weights(1, n, k, seed=m + 2000)
    x = bf16_rows(m, k, seed=m)
    xq, xs = quant.quantize_per_token(x.cuda())
    got = gemv_triton.fp8_gemv(xq, xs, torch.bfloat16, w.cuda(), scale.cuda(), None, mma=mma)
    want = fp8_linear(x.float(), w[0], scale[0])
    assert error_ratio(got, x, w, scale, want) <= 1.0


@torch.inference_mode()
@pytest.mark.parametrize("mma", [False, True], ids=["elementwise", "mma"])
def test_gemv_replays_in_a_cuda_graph_with_new_routing(monkeypatch, mma):
    """A graph captured once follows each step's routing (the slots' groups are found on
    the device at every replay) and gives the eager call's bits, in both forms."""
    from chunklocal.models import gemv_triton

    monkeypatch.setattr(gemv_triton, "MMA_ENABLED", mma)
    check_replays_with_new_routing(lambda *a: moe_triton.fp8_grouped_mm_small(
        *a, gemv=True))


@pytest.mark.parametrize("n,k", [(7168, 5120), (5120, 5120), (1000, 5000)],
                         ids=["scout-qkv", "scout-o", "masked"])
@pytest.mark.parametrize("partial", [False, True], ids=["elementwise", "partial"])
def test_gemv16_equals_float64(monkeypatch, n, k, partial):
    """gemv_triton.gemv16 (CHUNKLOCAL_GEMV_LINEAR, off by default): one bf16 row against
    float64 within bf16's rounding of the output plus float32 accumulation, eagerly and
    replayed from a CUDA graph (the same bits)."""
    from chunklocal.models import gemv_triton

    monkeypatch.setattr(gemv_triton, "PARTIAL_ENABLED", partial)
    gen = torch.Generator().manual_seed(n)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).bfloat16()
    x = torch.randn(1, k, generator=gen).bfloat16()
    want = x.double() @ w.double().T
    xc, wc = x.cuda(), w.cuda()
    got = gemv_triton.gemv16(xc, wc)
    bound = 2.0 ** -8 * want.abs() + 2.0 ** -16 * (x.double().abs() @ w.double().abs().T)
    assert got.dtype == torch.bfloat16
    assert bool(((got.double().cpu() - want).abs() <= bound).all())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = gemv_triton.gemv16(xc, wc)
    graph.replay()
    assert torch.equal(replayed, got)
