"""The benchmark scripts run end to end at tiny sizes (--smoke) and write their JSON.

CPU-capable scripts run here; the GPU-only ones are skipped without CUDA +
flashinfer (their full runs live in BENCHMARKS.md).  The smoke runs still check
numbers, not just exit codes: every attention output the kernel-floor script
produces is compared with float64 on sampled rows inside the script, and the
metadata build count must equal make_virtual_batches' count.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import workloads as wl


def _has_gpu_stack() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


gpu = pytest.mark.skipif(not _has_gpu_stack(), reason="needs CUDA and flashinfer")


def _load(path):
    data = json.loads(path.read_text())
    assert data["errors"] == [], data["errors"]
    assert data["machine"]["date_utc"]
    return data


def test_metadata_smoke(tmp_path):
    from benchmarks import metadata

    assert metadata.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = _load(tmp_path / "metadata_smoke.json")["rows"]
    cases = metadata.cases(smoke=True)
    assert len(rows) == 3 * len(cases)
    from chunklocal.virtual_batches import make_virtual_batches

    for batch in cases:
        expected = make_virtual_batches(batch.query_start_loc, batch.seq_lens,
                                        batch.block_table, wl.CHUNK, wl.BLOCK).num_batches
        mine = [r for r in rows if r["case"] == batch.name]
        assert {r["virtual_batches"] for r in mine} == {expected}
        assert all(r["build_us"] > 0 for r in mine)
        # Each row times what its label says: 1 + 1, 3 + 1 and 36 + 12 builds per step.
        builds = {r["build"]: r["builds_per_step"] for r in mine}
        assert builds == {"once per step": 2, "per KV group (3+1)": 4, "per layer (36+12)": 48}


def test_kernel_floor_smoke_cpu(tmp_path):
    from benchmarks import kernel_floor

    code = kernel_floor.main(["--smoke", "--device", "cpu", "--skip-flex",
                              "--out", str(tmp_path)])
    assert code == 0
    data = _load(tmp_path / "kernel_floor_smoke.json")
    assert len(data["rows"]) == 4
    for row in data["rows"]:
        assert row["chunklocal_rel_err"] < 1e-2 and row["sdpa_rel_err"] < 1e-2


def test_engine_smoke(tmp_path):
    from benchmarks import engine

    code = engine.main(["--smoke", "--configs", "chunked+eager", "global+eager",
                        "--out", str(tmp_path)])
    assert code == 0
    rows = _load(tmp_path / "engine_smoke.json")["rows"]
    assert [r["engine"] for r in rows] == ["chunked+eager"] * 2 + ["global+eager"] * 2
    assert all(r["tokens/s"] > 0 for r in rows)
    # Chunked layers split the 80-token prompts (c = 32) into virtual batches.
    assert rows[0]["peak_virtual_batches"] > rows[0]["requests"]


def test_useful_flops_match_per_row_count():
    batch = wl.chunked_prefills(3, 300, chunk=256)
    rows = 0
    for q, s in zip(batch.query_lens, batch.seq_lens, strict=True):
        pos = np.arange(s - q, s)
        rows += int((pos % 256 + 1).sum())
    assert wl.useful_attention_flops(batch, 256) == 4.0 * wl.HEAD_DIM * wl.NUM_Q_HEADS * rows
    full = int(sum(np.arange(s - q, s).sum() + q for q, s in
                   zip(batch.query_lens, batch.seq_lens, strict=True)))
    assert wl.useful_attention_flops(batch, None) == 4.0 * wl.HEAD_DIM * wl.NUM_Q_HEADS * full


def test_workload_pages_read_are_distinct():
    # The pages a chunked layer reads must not alias, or the kernel would hit the cache.
    from benchmarks.direct import host_metadata

    for batch in (wl.decode_local(64, full_chunks=True), wl.chunked_prefills(4, 1000)):
        meta = host_metadata(batch.query_start_loc, batch.seq_lens, batch.block_table,
                             wl.BLOCK, wl.CHUNK)
        assert np.unique(meta.kv_indices).size == meta.kv_indices.size
        assert meta.kv_indices.max() < batch.num_pages


@gpu
def test_cuda_graphs_smoke(tmp_path):
    from benchmarks import cuda_graphs

    assert cuda_graphs.main(["--smoke", "--out", str(tmp_path)]) == 0


@gpu
def test_kernel_floor_smoke_gpu(tmp_path):
    from benchmarks import kernel_floor

    assert kernel_floor.main(["--smoke", "--skip-flex", "--out", str(tmp_path)]) == 0


def test_metadata_stages_smoke(tmp_path):
    # The script asserts its proposals equal the library's arrays before timing them.
    from benchmarks import metadata_stages

    assert metadata_stages.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "metadata_stages_smoke.json").read_text())["rows"]
    assert {r["layers"] for r in rows} == {"chunked", "global"}


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_dense_alternatives_match_independent_oracle():
    # The dense layouts the alternatives run on (windows of the touched chunks, offsets,
    # masks) must compute chunked attention exactly: float64 against tests/oracle.py.
    from oracle import dense_chunked_attention

    from benchmarks import dense
    from benchmarks.steps import random_inputs

    chunk = 64
    for batch in (wl.chunked_prefills(2, 100, chunk=chunk),
                  wl.decode_local(6, full_chunks=False, chunk=chunk),
                  wl.single_prefill(150, chunk=chunk)):
        q, k, v = (t.double() for t in random_inputs(batch, "cpu", wl.BLOCK, seed=3))
        expected = dense_chunked_attention(q, k, v, batch.query_start_loc, batch.seq_lens,
                                           batch.block_table, chunk_size=chunk)
        d = dense.to_dense(batch, q, k, v, chunk)
        sdpa_out = d.packed(dense.sdpa(d, d.dense_mask(), expand_kv=False)())
        torch.testing.assert_close(sdpa_out, expected, rtol=1e-9, atol=1e-9)
        flex_out = d.packed(dense.flex(d, compiled=False)())
        torch.testing.assert_close(flex_out, expected, rtol=1e-9, atol=1e-9)
        ref, index = dense.reference_rows(d)
        torch.testing.assert_close(ref, expected[index], rtol=1e-9, atol=1e-9)


def test_tp_decode_smoke(tmp_path):
    """Two gloo ranks on the CPU, tiny model: every cell runs, floors and all-reduce are set."""
    from benchmarks import tp_decode

    assert tp_decode.main(["--smoke", "--moe", "tp", "--out", str(tmp_path)]) == 0
    data = _load(tmp_path / "tp_decode_smoke.json")
    rows = data["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(2, 20), (4, 20), (2, 70), (4, 70)]
    assert all(r["step_ms"] > 0 and r["floor_ms"] > 0 and r["allreduce_ms"] > 0 for r in rows)
    # 4 layers: 2 all-reduces each (attention, MoE) + the embedding's
    assert {r["allreduce_calls"] for r in rows} == {9}


def test_fp8_small_m_smoke(tmp_path):
    """Every dense and grouped shape at each row count, torch's path timed (eager on the
    CPU), bytes counted from the experts a round-robin routing touches."""
    from benchmarks import fp8_small_m

    assert fp8_small_m.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = _load(tmp_path / "fp8_small_m_smoke.json")["kernels"]
    assert [(r["gemm"], r["rows"]) for r in rows] == [
        (g, m) for g in ("dense gate_up", "dense down", "experts w13", "experts w2")
        for m in (1, 3)]
    assert [r.get("experts_touched") for r in rows[4:]] == [1, 3, 1, 3]
    assert all(r["bytes"] > 0 and r["floor_us"] > 0 for r in rows)


def test_fp8_small_m_sweep_in_the_interpreter(tmp_path):
    """--sweep times the split-K kernel per tile/split choice (Triton's interpreter on the
    CPU: the kernel and quantization columns run too), every row with its auto split."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    from benchmarks import fp8_small_m
    from chunklocal.models import moe_triton

    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "benchmarks.fp8_small_m", "--smoke",
                          "--sweep", "2", "--tune", "2", "--gemv-tune", "2", "5", "--gemv16-tune",
                          "--engine-batches", "--out",
                          str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    data = _load(tmp_path / "fp8_small_m_smoke.json")
    assert {"torch_us", "quant_us", "triton_us", "reduce_us"} <= set(data["kernels"][0])
    sweep = data["sweep"]
    assert [(r["gemm"], r["rows"]) for r in sweep] == [
        (g, 2) for g in ("dense gate_up", "dense down", "experts w13", "experts w2")]
    assert all("bn32_splitauto_us" in r and "bn32_split1_us" in r and r["split_k_auto"] >= 1
               for r in sweep)
    # --tune: the default choice and the next, each row naming the fastest
    tune = data["tune"]
    assert [(r["gemm"], r["rows"]) for r in tune] == [(r["gemm"], 2) for r in sweep]
    labels = [fp8_small_m.tune_label(*c) for c in fp8_small_m.TUNE[:2]]
    assert fp8_small_m.TUNE[0] == moe_triton.DEFAULT_TILE  # the first is the default
    assert moe_triton.tile_for(True, 5120, 8192) == moe_triton.DEFAULT_TILE  # switch off
    assert {"tiles_us", "torch_over_tiles"} <= set(data["kernels"][0])
    assert all(f"{lab}_us" in r for r in tune for lab in labels)
    assert all(r["best"] in labels and r["unfit"] == [] for r in tune)
    # --gemv-tune: every shape at 2 and 5 rows (a dense layer's rows in one group, the
    # experts' spread one a group)
    gemv = data["gemv_tune"]
    assert [(r["gemm"], r["rows"], r["group_rows"]) for r in gemv] == [
        (g, m, m if g.startswith("dense") else 1)
        for g in ("dense gate_up", "dense down", "experts w13", "experts w2") for m in (2, 5)]
    assert all({"split_us", "split_tuned_us", "split_over_best"} <= set(r) and
               r["best"].startswith("gemv_bn") for r in gemv)
    # each tile's output checked against the split-K kernel's (the interpreter: float32)
    errs = [r[key] for r in gemv for key in r if key.endswith("_err")]
    assert len(errs) == 3 * len(gemv) and max(errs) < fp8_small_m.GEMV_TOLERANCE
    mma = fp8_small_m.gemv_label(fp8_small_m.GEMV_MMA_TUNE[0])
    assert mma == "gemv_bn64_bk256_w4_s3_mma" and all(f"{mma}_err" in r for r in gemv)
    assert data["errors"] == []
    # --gemv16-tune: the three one-row bf16 projections, cuBLAS beside the 16-bit GEMV
    gemv16 = data["gemv16_tune"]
    assert [r["gemm"] for r in gemv16] == ["bf16 qkv", "bf16 o_proj", "bf16 lm_head"]
    assert all({"cublas_us", "cublas_over_best"} <= set(r) and r["best"].startswith("gemv_bn")
               for r in gemv16)


def test_quant_rows_smoke_in_the_interpreter(tmp_path):
    """benchmarks.quant_rows: each shape's launch choices (the default first) give the
    default's bits, in Triton's interpreter; a one-pass block narrower than the row is
    refused, not run over half a row."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    import torch

    from chunklocal.models import quant_triton

    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "benchmarks.quant_rows", "--smoke", "--out",
                          str(tmp_path)], env=env, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    data = _load(tmp_path / "quant_rows_smoke.json")
    assert data["errors"] == []
    assert [(r["shape"], r["k"]) for r in data["rows"]] == [("input", 96), ("gather", 96),
                                                           ("silu", 64)]
    assert [r["default"] for r in data["rows"]] == ["one_b128_w4", "one_b128_w4",
                                                    "one_b64_w4"]
    assert {"one_b128_w16_us", "two_b32_w4_us", "two_b64_w4_us"} <= set(data["rows"][0])
    with pytest.raises(ValueError, match="BLOCK_K of 64 cannot hold rows of 96"):
        quant_triton.quantize_rows(torch.zeros(2, 96, dtype=torch.bfloat16),
                                   config=(True, 64, 4))


def test_gc_pauses_smoke(tmp_path, monkeypatch):
    """Both modes run on one engine; the frozen one holds the start-up heap frozen."""
    import gc

    from benchmarks import gc_pauses

    monkeypatch.setenv("CHUNKLOCAL_GC_FREEZE", "0")  # restored after: the script sets it
    try:
        assert gc_pauses.main(["--smoke", "--device", "cpu", "--out", str(tmp_path)]) == 0
    finally:
        gc.unfreeze()
    data = _load(tmp_path / "gc_pauses_smoke.json")
    assert [r["mode"] for r in data["rounds"]] == ["unfrozen", "frozen"]
    rows = {r["mode"]: r for r in data["rows"]}
    assert rows["unfrozen"]["frozen_objects"] == 0 < rows["frozen"]["frozen_objects"]
    assert all(r["gen0_count"] >= 0 and r["full_collect_ms"] >= 0 for r in data["rounds"])


def test_stream_chunks_smoke(tmp_path):
    """The per-chunk timing, this tree against itself as the --before tree."""
    from benchmarks import stream_chunks

    src = Path(__file__).resolve().parent.parent / "src"
    assert stream_chunks.main(["--smoke", "--before", str(src), "--out", str(tmp_path)]) == 0
    rows = _load(tmp_path / "stream_chunks_smoke.json")["rows"]
    assert [(r["stream"], r["usage"], r["tree"]) for r in rows] == [
        (s, u, t) for u in ("none", "every chunk") for s in ("chat", "completion")
        for t in ("before", "this tree")]
    assert all(r["us_per_chunk_min"] > 0 for r in rows)
    with pytest.raises(SystemExit, match="no chunklocal/server/responses.py"):
        stream_chunks.main(["--smoke", "--before", str(tmp_path), "--out", str(tmp_path)])


def test_fp8_small_m_engine_variants_set_and_restore_their_switches():
    from benchmarks import fp8_small_m
    from chunklocal.models import fused, moe_triton, norm_triton, quant_triton

    def now():
        return (fused.FUSE_PROJECTIONS, moe_triton.FP8_ENABLED, quant_triton.QUANT_ENABLED,
                norm_triton.NORM_ENABLED, moe_triton.SPLITK_REDUCE_IN_KERNEL,
                moe_triton.ROUTED_SLOTS_ENABLED)

    before = now()
    for want in fp8_small_m.ENGINE_PATHS.values():
        with fp8_small_m.switches(*want):
            assert now() == want + (False,) * (6 - len(want))
        assert now() == before


def test_kernel_classes_of_the_names_seen_on_the_h200():
    """floors.kernel_class on kernel names from the H200 profiles of 2026-12-02 (the
    profiler's full names; the JSON keeps their first 80 characters)."""
    from benchmarks.floors import kernel_class

    seen = {
        "nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT": "dense GEMMs, FP8",
        "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT": "dense GEMMs, bf16",
        "_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalINS1_17GroupProblemShap":
            "expert GEMMs",
        "void flashinfer::BatchPrefillWithPagedKVCacheKernel<true, flashinfer::KernelTrai":
            "attention",
        # with an FP8 KV cache the same kernel names its e4m3 operands (once "dense GEMMs,
        # FP8"), and split-KV's merge (once "other")
        "void flashinfer::BatchPrefillWithPagedKVCacheKernel<true, flashinfer::KernelTraits"
        "<(flashinfer::MaskMode)0, 16u, 1u, 8u, __nv_bfloat16, __nv_fp8_e4m3, float>":
            "attention",
        "void flashinfer::PersistentVariableLengthMergeStatesKernel<8u, 16u, 8u, 4u, "
        "__nv_bfloat16, __nv_bfloat16, int>": "attention",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda":
            "copies",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
        "at::native::func_wrapper_t<float, at::native::MaxNanFunctor<float> >":
            "quantization (amax)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
        "at::native::MeanOps<float, float, float, float>": "norms, reductions",
        "void at::native::index_elementwise_kernel<128, 4, at::native::index_copy_kernel_":
            "KV writes",
        "void at::native::index_elementwise_kernel<128, 4, at::native::index_kernel_impl":
            "gathers",
        "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<a":
            "elementwise",
        "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespa":
            "elementwise",
        "some_new_kernel": "other",
    }
    assert {name: kernel_class(name) for name in seen} == seen


#: Our Triton kernels and the class each must land in.  A kernel renamed (or added) without
#: its pattern in floors.KERNEL_CLASSES fails here: the split-K kernel's rename once sent
#: 24 ms of the decode step to "other" in an H200 profile.
TRITON_KERNEL_CLASSES = {
    "_fp8_splitk_kernel": "FP8 GEMMs, Triton (experts and dense)",
    "_gemv_kernel": "FP8 GEMMs, Triton (experts and dense)",  # one row a group
    "_gemv_mma_kernel": "FP8 GEMMs, Triton (experts and dense)",  # its tensor-core form
    "group_span": "other",  # the grouped kernels' jit helper, inlined (no launch)
    "gemv_slab": "other",  # the GEMV forms' jit helper, inlined (no launch)
    "pdl_start": "other",  # every kernel's first statement (PDL), inlined (no launch)
    "_grouped_gemm_kernel": "expert GEMMs",
    "_splitk_sum_kernel": "norms, reductions",  # the split-K slices' sum, where torch's sum was
    "_quantize_rows_kernel": "quantization (amax)",
    "_quantize_rows_load": "quantization (amax)",  # its jit helper, inlined (no launch)
    "_add_rms_norm_kernel": "norms, reductions",
    "_rope_norm_kernel": "norms, reductions",  # rope + QK norm
    "_write_kv_kernel": "KV writes",  # the FP8 KV write, quantization included
    "_sort_pairs_kernel": "MoE routing, Triton",  # where sorts, cats and gathers were
    "_sort_pairs_store": "MoE routing, Triton",  # its jit helper, inlined (no launch)
    "_route_pairs_kernel": "MoE routing, Triton",  # top-k, sigmoid and the sort
    "_route_pairs_select": "MoE routing, Triton",  # its jit helper, inlined (no launch)
    "_router_pairs_kernel": "MoE routing, Triton",  # the router's GEMM, top-k and the sort
    "_combine_kernel": "MoE routing, Triton",  # where a scatter and a sum over slots were
}


def test_every_triton_kernel_of_the_package_has_its_class():
    """Read from the source (CI has no Triton): every ``@triton.jit`` function."""
    import ast

    from benchmarks.floors import kernel_class

    found = {}
    for path in (Path(__file__).resolve().parents[1] / "src" / "chunklocal").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    "triton.jit" in ast.unparse(d) for d in node.decorator_list):
                found[node.name] = kernel_class(node.name)
    assert found == TRITON_KERNEL_CLASSES


def test_balanced_routing_spreads_every_call_and_restores_the_models_routing():
    """floors.BalancedRouting: token t of the i-th call to experts (t * top_k + j + i) mod E,
    scored by the router's own logits there; the model's routing is back on exit."""
    from benchmarks.floors import BalancedRouting, routing
    from chunklocal.models import routing as moe

    router = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    assert moe.ROUTING_SIMULATION == ""
    with BalancedRouting():
        first, score = moe.route(x, router, 2)
        second, _ = moe.route(x, router, 2)
    assert moe.ROUTING_SIMULATION == ""
    slots = torch.arange(12).view(6, 2)
    shift = int(first[0, 0])  # the process's MoE calls so far, mod E
    assert torch.equal(first, (slots + shift) % 4) and torch.equal(second, (first + 1) % 4)
    assert torch.allclose(score, torch.sigmoid((x @ router.T).gather(1, first)))
    with routing("model"):
        assert moe.ROUTING_SIMULATION == ""
    top = torch.topk(x @ router.T, 2, dim=1).indices
    assert torch.equal(moe.route(x, router, 2)[0], top)  # the weights' routing again
    with pytest.raises(ValueError, match="routing must be"):
        routing("uniform")


def test_long_context_smoke(tmp_path, monkeypatch, capsys):
    """Both parts on the tiny model: the long request is prefilled in chunks and decoded to
    its last token, reporting its progress on the way (a partial row that the final one
    replaces); the capacity part runs both KV dtypes and decodes the batch that fits."""
    from benchmarks import long_context

    monkeypatch.setattr(long_context, "PROGRESS_EVERY", 2)
    assert long_context.main(["--smoke", "--part", "long", "--out", str(tmp_path)]) == 0
    assert "prefilled_tokens 128," in capsys.readouterr().out  # 2 steps of 64 tokens
    (row,) = _load(tmp_path / "long_context_long_smoke.json")["rows"]
    assert "partial" not in row and row["engine_build_s"] > 0
    assert row["new_tokens"] == 4 and row["prefill_steps"] == -(-300 // 64)
    assert row["prefill_s"] > 0 and row["tpot_ms"] > 0
    assert long_context.main(["--smoke", "--part", "capacity", "--out", str(tmp_path)]) == 0
    rows = _load(tmp_path / "long_context_capacity_smoke.json")["rows"]
    assert [r["kv_cache_dtype"] for r in rows] == ["auto", "fp8"]
    assert all(r["fit"] == r["asked"] == 6 and r["decode_ms"] > 0 for r in rows)
    assert all(r["memory_gib"] is None for r in rows)  # the CPU profiles nothing
    assert long_context.main(["--smoke", "--part", "capacity", "--capacity-dtypes", "fp8",
                              "--out", str(tmp_path)]) == 0
    rows = _load(tmp_path / "long_context_capacity_smoke.json")["rows"]
    assert [r["kv_cache_dtype"] for r in rows] == ["fp8"]


def test_long_context_names_where_the_memory_went():
    """On a GPU each capacity row carries the budget's parts (what the KV pools could not
    take); read from a profiled budget, in GiB."""
    from types import SimpleNamespace

    from benchmarks import long_context
    from chunklocal.engine.memory import MemoryBudget

    gib = 1 << 30
    budget = MemoryBudget(0.9, 140 * gib, 105 * gib, 2 * gib, gib, gib // 2, gib // 8, gib // 4)
    llm = SimpleNamespace(memory_budget=budget,
                          kv_pools=SimpleNamespace(total_bytes=7 * gib))
    got = long_context.memory_gib(llm)
    assert got == {"total": 140, "weights": 105, "activations": 2, "graphs": 1,
                   "outside_torch": 0.5, "cached": 0.25, "headroom": 0.125, "requested": 126,
                   "kv": 7}


def test_fp8_kv_accuracy_smoke(tmp_path):
    """Every cell (2 lengths x global/chunked x decode/prefill) on the torch reference
    backend: FP8 pages read with their scales agree with float64 over the dequantized pages
    to float32 rounding, and with the bf16 keys to e4m3's rounding."""
    from benchmarks import fp8_kv_accuracy

    assert fp8_kv_accuracy.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = _load(tmp_path / "fp8_kv_accuracy_smoke.json")["rows"]
    assert len(rows) == 8 and {r["layer"] for r in rows} == {"global", "chunked"}
    for r in rows:
        assert r["fp8_vs_dequantized_max"] < 1e-5 and r["bf16_pages_max"] < 1e-5
        assert 1e-3 < r["fp8_vs_unquantized_rms"] < 0.1


def test_decode_ab_smoke(tmp_path):
    """Both children run (here the same tree twice) and the ratio is written."""
    from pathlib import Path

    from benchmarks import decode_ab

    root = str(Path(decode_ab.__file__).resolve().parents[1])
    assert decode_ab.main(["--a", root, "--b", root, "--smoke", "--out", str(tmp_path)]) == 0
    data = _load(tmp_path / "decode_ab_smoke.json")
    assert [r["tree"] for r in data["rows"]] == ["A", "B"]
    assert all(r["decode_ms"] > 0 and r["decode_steps"] > 0 for r in data["rows"])
    assert data["b_over_a"] > 0


def test_decode_ab_child_keeps_the_parents_other_paths(tmp_path, monkeypatch):
    """A child imports chunklocal from its own tree and keeps the parent's other entries
    (on the H200 FlashInfer lives in /tmp/site; a child without it failed both trees)."""
    import os

    from benchmarks import decode_ab

    other, site = tmp_path / "other" / "src", tmp_path / "site"
    (other / "chunklocal").mkdir(parents=True)
    site.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), str(other)]))
    tree = tmp_path / "tree"
    assert decode_ab.child_path(tree).split(os.pathsep) == [str(tree.resolve() / "src"),
                                                             str(site)]


def test_decode_trace_counts_files_to_the_kernel(tmp_path):
    """The decode-path trace reaches the kernel; issue 15 measured 11 files on the CPU path,
    the engine core (issue 13: a loop thread, streams, per-request sampling) made it 17,
    prefix caching (the prompt's block hashes at admission) 18, the KV-cache dtype check
    before each layer's write 19, and the runner's host half in its own module
    (engine/input_builder.py, which tensor parallelism composes) 20, the elementwise tail's
    switch (models/norm_triton.py, consulted by each norm and rope on the CPU too) 21, the
    16-bit KV write's check (models/kv_write_triton.py, on by default) 22, the one-row
    projections' GEMV check (models/gemv_triton.py's ``linear``, consulted by q/k/v, o_proj
    and the LM head on the CPU too) 23 (BENCHMARKS.md): a change that adds a hop should say
    why."""
    from benchmarks import decode_trace

    decode_trace.write_checkpoint(tmp_path)
    result = decode_trace.trace_decode(tmp_path)
    files = result["decode_files"]
    assert files[0] == "chunklocal/engine/llm.py"
    assert {"chunklocal/reference.py", "chunklocal/models/llama4.py",
            "chunklocal/backends/torch_ref.py"} <= set(files)
    assert result["count"] == len(files) <= 23


def test_switch_ab_smoke(tmp_path, monkeypatch):
    """benchmarks/switch_ab.py: rounds of the defaults and of each switch flipped alone,
    the graphs captured again after each flip and after it is put back, the switches left
    as they were, a row per variant against the defaults."""
    from benchmarks import switch_ab
    from chunklocal.engine.model_runner import ModelRunner
    from chunklocal.models import kv_write_triton, norm_triton

    before = (norm_triton.NORM_ENABLED, kv_write_triton.KV_WRITE_16BIT_ENABLED)
    seen, real_timed = [], switch_ab.timed

    def recording(llm, steps, device):
        seen.append((norm_triton.NORM_ENABLED, kv_write_triton.KV_WRITE_16BIT_ENABLED))
        return real_timed(llm, steps, device)

    captures = []
    monkeypatch.setattr(switch_ab, "timed", recording)
    monkeypatch.setattr(ModelRunner, "recapture_graphs", lambda self: captures.append(1))
    assert switch_ab.main(["--smoke", "--switches", "norm", "kv16", "--out",
                           str(tmp_path)]) == 0
    norm, kv16 = before
    # a warm-up round (dropped) and two kept rounds
    assert seen == [(norm, kv16), (not norm, kv16), (norm, not kv16)] * 3
    assert len(captures) == 3 * 2 * 2  # each flip, each restore
    assert (norm_triton.NORM_ENABLED, kv_write_triton.KV_WRITE_16BIT_ENABLED) == before
    rows = _load(tmp_path / "switch_ab_smoke.json")["rows"]
    assert [r["variant"] for r in rows] == ["defaults", "norm", "kv16"]
    assert rows[2]["switch"] == f"kv_write_triton.KV_WRITE_16BIT_ENABLED={not kv16}"
    assert rows[0]["step_ms_over_defaults"] == 1
    assert all(r["floor_ms"] > 0 and r["step_ms_median"] > 0 for r in rows)
    rounds = _load(tmp_path / "switch_ab_smoke.json")["rounds"]
    assert [len(v) for v in rounds.values()] == [2, 2, 2]  # the warm-up round not kept
    assert rows[1]["step_ms_every_round"] in ("faster", "slower", "mixed")


def test_every_switch_ab_name_is_a_boolean_the_engine_reads():
    """Each switch switch_ab flips is a module-level bool that exists: a renamed switch
    fails here, not in a device call that flips nothing."""
    import importlib

    from benchmarks import switch_ab

    for name, (module, attr) in switch_ab.SWITCHES.items():
        value = getattr(importlib.import_module(module), attr)
        assert isinstance(value, bool), (name, module, attr, value)


def test_switch_ab_saves_each_round_it_completes(tmp_path, monkeypatch):
    """A run stopped in its second kept round (a time limit on the device) has written
    the warm-up-less first round: the JSON holds one round of each variant."""
    from benchmarks import switch_ab
    from chunklocal.engine.model_runner import ModelRunner

    calls, real_timed = [], switch_ab.timed

    def stopping(llm, steps, device):
        calls.append(1)
        if len(calls) == 3 * 2 + 1:  # warm-up round, first kept round, then stop
            raise TimeoutError("the call's time limit")
        return real_timed(llm, steps, device)

    monkeypatch.setattr(switch_ab, "timed", stopping)
    monkeypatch.setattr(ModelRunner, "recapture_graphs", lambda self: None)
    with pytest.raises(TimeoutError):
        switch_ab.main(["--smoke", "--switches", "norm", "kv16", "--out", str(tmp_path)])
    saved = _load(tmp_path / "switch_ab_smoke.json")
    assert [len(v) for v in saved["rounds"].values()] == [1, 1, 1]
    assert [r["variant"] for r in saved["rows"]] == ["defaults", "norm", "kv16"]


def test_switch_ab_reads_each_variant_against_its_own_rounds_defaults():
    """The twenty-fourth session's H100 rounds (12 layers, batch 1, graph replay ms): the
    defaults' fast first round puts "pdl" inside their spread, though it was faster in
    every round; the paired ratios say so."""
    from benchmarks import switch_ab

    defaults = [2.248, 2.320, 2.325, 2.328, 2.319]
    pdl = [2.220, 2.273, 2.277, 2.276, 2.265]
    runs = {"defaults": [{"step_ms": None, "replay_ms": v} for v in defaults],
            "pdl": [{"step_ms": None, "replay_ms": v} for v in pdl]}
    switches = {"pdl": "quant_triton.PDL_ENABLED=True"}
    _, row = switch_ab.summary(runs, switches, {})
    assert row["switch"] == "quant_triton.PDL_ENABLED=True"
    assert row["replay_ms_inside_spread"] is True  # 2.277 >= 2.248
    # 2.220 / 2.248 = 0.98754..., 2.265 / 2.319 = 0.97671...
    assert row["replay_ms_paired_max"] == pytest.approx(0.98754, abs=1e-5)
    assert row["replay_ms_paired_min"] == pytest.approx(0.97671, abs=1e-5)
    assert row["replay_ms_every_round"] == "faster"
    assert "step_ms_paired_max" not in row  # no step times: nothing to pair
    runs["pdl"][2]["replay_ms"] = 2.330  # one round slower than its defaults
    assert switch_ab.summary(runs, switches, {})[1]["replay_ms_every_round"] == "mixed"
    assert switch_ab.paired([1.0, None, 3.0], [2.0, 2.0, None]) == [0.5]


def test_switch_ab_rereads_a_saved_run_without_its_first_rounds(tmp_path, capsys):
    """``--reread``: a saved run's rows again, its first rounds dropped; nothing runs."""
    import json

    from benchmarks import switch_ab

    def measured(values):
        return [{"step_ms": v + 1, "replay_ms": v} for v in values]

    saved = {"rounds": {"defaults": measured([2.0, 2.4, 2.4]), "pdl": measured([2.3, 2.3, 2.2])},
             "rows": [{"model": "m", "batch": 1, "floor_ms": 3.0, "variant": "defaults"},
                      {"model": "m", "batch": 1, "floor_ms": 3.0, "variant": "pdl",
                       "switch": "quant_triton.PDL_ENABLED=True"}]}
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(saved))
    assert switch_ab.main(["--reread", str(path)]) == 0  # the default: one round dropped
    out = capsys.readouterr().out.splitlines()
    pdl = next(line for line in out if "| pdl " in line)
    # rounds 2-3: 2.3 / 2.4 = 0.958 and 2.2 / 2.4 = 0.917, faster in both
    assert "faster" in pdl and "PDL_ENABLED=True" in pdl
    assert "| 0.917 " in pdl and "| 0.958 " in pdl
    assert switch_ab.main(["--reread", str(path), "--warmup-rounds", "0"]) == 0
    pdl = next(line for line in capsys.readouterr().out.splitlines() if "| pdl " in line)
    assert "mixed" in pdl  # round 1: 2.3 against 2.0
    with pytest.raises(SystemExit, match="leave none"):
        switch_ab.main(["--reread", str(path), "--warmup-rounds", "3"])


def test_switch_ab_flips_joined_switches_together(tmp_path, monkeypatch):
    """``a+b``: one variant with both switches flipped, both put back after each round;
    an unknown or repeated part is refused by name before any engine loads."""
    from benchmarks import switch_ab
    from chunklocal.engine.model_runner import ModelRunner
    from chunklocal.models import kv_write_triton, norm_triton

    before = (norm_triton.NORM_ENABLED, kv_write_triton.KV_WRITE_16BIT_ENABLED)
    seen, real_timed = [], switch_ab.timed

    def recording(llm, steps, device):
        seen.append((norm_triton.NORM_ENABLED, kv_write_triton.KV_WRITE_16BIT_ENABLED))
        return real_timed(llm, steps, device)

    monkeypatch.setattr(switch_ab, "timed", recording)
    monkeypatch.setattr(ModelRunner, "recapture_graphs", lambda self: None)
    assert switch_ab.main(["--smoke", "--switches", "norm+kv16", "--out",
                           str(tmp_path)]) == 0
    norm, kv16 = before
    assert seen == [(norm, kv16), (not norm, not kv16)] * 3  # a warm-up round, two kept
    assert (norm_triton.NORM_ENABLED, kv_write_triton.KV_WRITE_16BIT_ENABLED) == before
    rows = _load(tmp_path / "switch_ab_smoke.json")["rows"]
    assert [r["variant"] for r in rows] == ["defaults", "norm+kv16"]
    assert rows[1]["switch"] == (f"norm_triton.NORM_ENABLED={not norm} "
                                 f"kv_write_triton.KV_WRITE_16BIT_ENABLED={not kv16}")
    for bad in ("norm+nope", "norm+norm"):
        with pytest.raises(SystemExit):
            switch_ab.main(["--smoke", "--switches", bad])


def test_switch_ab_flips_the_shared_expert_group_on_every_moe_layer(tmp_path, monkeypatch):
    """The "shared" switch: the engine loads with the shared expert stacked into the
    experts (and the module setting is put back after loading), its defaults run the slot
    as dense GEMMs (threshold 0) and the flipped rounds as group E of steps up to 16
    tokens, on every MoE layer; each round ends with the threshold put back."""
    from benchmarks import switch_ab
    from chunklocal.engine.model_runner import ModelRunner
    from chunklocal.models import moe

    seen, real_timed = [], switch_ab.timed

    def recording(llm, steps, device):
        layers = switch_ab.moe_layers(llm)
        assert layers and all(m.stacked for m in layers)
        seen.append({m.fuse_max_tokens for m in layers})
        return real_timed(llm, steps, device)

    monkeypatch.setattr(switch_ab, "timed", recording)
    monkeypatch.setattr(ModelRunner, "recapture_graphs", lambda self: None)
    assert not moe.STACK_SHARED
    assert switch_ab.main(["--smoke", "--switches", "shared", "--out", str(tmp_path)]) == 0
    assert not moe.STACK_SHARED
    assert seen == [{0}, {16}] * 3  # a warm-up round, two kept
    rows = _load(tmp_path / "switch_ab_smoke.json")["rows"]
    assert rows[1]["switch"] == "MoE.fuse_max_tokens=16"


def test_switch_ab_turns_an_on_layer_switch_off():
    """FP8 layers load with the shared expert as group E (fuse_max_tokens 16): the "shared"
    switch then flips it to 0, labels the row so, and puts 16 back."""
    from types import SimpleNamespace

    from benchmarks import switch_ab
    from chunklocal.models.moe import MoE

    layers = [MoE(4, 1, 16, 8, torch.nn.SiLU(), fuse_max_tokens=16) for _ in range(2)]
    llm = SimpleNamespace(model=torch.nn.Sequential(*layers))
    restore = switch_ab.flip(llm, "shared")
    assert [m.fuse_max_tokens for m in layers] == [0, 0]
    assert switch_ab.FLIPPED["shared"] == "MoE.fuse_max_tokens=0"
    restore()
    assert [m.fuse_max_tokens for m in layers] == [16, 16]


def test_engine_core_smoke(tmp_path):
    """benchmarks/engine_core.py: step breakdown, sampling cases and the sampler alone."""
    from benchmarks import engine_core

    assert engine_core.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = _load(tmp_path / "engine_core_smoke.json")
    steps = data["steps"]
    assert steps["steps"] == 6 and steps["host_ms"] < steps["step_ms"]
    assert {row["case"] for row in data["sampling"]} >= {"greedy", "seeded_T0.8_top_p0.95"}
    assert [row["async_scheduling"] for row in data["overlap"]] == [False, True] * 2


def test_host_step_smoke(tmp_path):
    from benchmarks import host_step

    assert host_step.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = _load(tmp_path / "host_step_smoke.json")
    assert len(data["rows"]) == 4 and len(data["detokenize"]) == 2 and len(data["mixed"]) == 2
    assert all(r["host_us"] > 0 for r in data["rows"])


def test_device_busy_time_is_the_union_of_kernel_intervals():
    from benchmarks.floors import busy_and_span

    # [0,4) and [2,5) overlap -> 5; [7,8) -> 1; [7.5,7.6) inside; span 0..8
    assert busy_and_span([(7, 8), (0, 4), (2, 5), (7.5, 7.6)]) == (6, 8)
    assert busy_and_span([(1, 2)]) == (1, 1)


def test_decode_floor_smoke(tmp_path):
    from benchmarks import decode_floor
    from benchmarks.fp8_dummy import SCOUT_TEXT, SMOKE

    assert decode_floor.main(["--smoke", "--profile", "--out", str(tmp_path)]) == 0
    data = _load(tmp_path / "decode_floor_smoke.json")
    assert [(r["batch"], r["context"]) for r in data["decode"]] == [(1, 40), (3, 40), (1, 70),
                                                                   (3, 70)]
    # One routed expert (gate, up, down; float32 on the CPU) from the config alone.
    expert = 3 * SMOKE["hidden_size"] * SMOKE["intermediate_size"] * 4
    kv_per_key = 2 * SMOKE["num_key_value_heads"] * SMOKE["head_dim"] * 4
    chunk = SMOKE["attention_chunk_size"]
    for row in data["decode"]:
        distinct = row["experts_per_moe_layer"]
        # balanced routing (the default): every layer touches min(E, tokens * top_k) experts
        text = {**SCOUT_TEXT, **SMOKE}
        spread = min(text["num_local_experts"], row["batch"] * text["num_experts_per_tok"])
        assert distinct == [spread] * 4
        assert row["routed_bytes"] == sum(distinct) * expert
        assert row["kv_bytes"] % kv_per_key == 0
        keys = row["kv_bytes"] // kv_per_key  # 3 chunked + 1 global layer, queries past ctx
        assert row["batch"] * (3 * 1 + row["context"]) <= keys
        assert keys <= row["batch"] * (3 * chunk + row["context"] + 200)
        assert row["bytes"] == row["dense_bytes"] + row["routed_bytes"] + row["kv_bytes"]
        assert row["graph_ms"] > 0 and row["eager_ms"] > 0 and row["floor_ms"] > 0
    assert [r["prompt_len"] for r in data["prefill"]] == [90]
    assert {(r["model"], r["mode"]) for r in data["alternate"]} >= {("chunked", "graphs"),
                                                                    ("unchunked", "eager")}


def test_decode_floor_alternates_one_engine_at_a_time(tmp_path):
    """--alternate-reload: the path full-size Scout takes (two engines do not fit one H200;
    the session-12 run failed building the second): every repeat of each model is measured
    on an engine loaded for it, and the repeats still alternate."""
    from benchmarks import decode_floor

    assert decode_floor.main(["--smoke", "--alternate-reload", "--out", str(tmp_path)]) == 0
    rows = _load(tmp_path / "decode_floor_smoke.json")["alternate"]
    measured = [r for r in rows if r["model"] in ("chunked", "unchunked")]
    assert {(r["model"], r["mode"]) for r in measured} == {
        (m, mode) for m in ("chunked", "unchunked") for mode in ("graphs", "eager")}
    assert all(not r["resident"] and len(r["repeats_ms"]) == 2 for r in measured)
    assert [r["model"] for r in rows][-2:] == ["chunked / unchunked"] * 2


def test_decode_floor_counts_fp8_pages_at_one_byte(tmp_path):
    """--kv-cache-dtype fp8: the same cells, the KV bytes of the floor a quarter of the
    float32 pages' (e4m3, one byte a value)."""
    from benchmarks import decode_floor

    bytes_of = {}
    for dtype in ("auto", "fp8"):
        out = tmp_path / dtype
        assert decode_floor.main(["--smoke", "--kv-cache-dtype", dtype, "--out", str(out)]) == 0
        bytes_of[dtype] = [r["kv_bytes"] for r in _load(out / "decode_floor_smoke.json")["decode"]]
    assert bytes_of["fp8"] and [4 * b for b in bytes_of["fp8"]] == bytes_of["auto"]


def test_mixed_step_smoke_times_only_mixed_steps(tmp_path):
    """benchmarks/mixed_step.py --smoke: every timed step is the decodes plus one chunk of
    the long prompt (3 + 24 tokens), eager on the CPU (piecewise graphs need CUDA); the
    long prompts (72 tokens, 3 chunks) end and new ones start, so the prefix stays bounded."""
    from benchmarks import mixed_step

    assert mixed_step.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = _load(tmp_path / "mixed_step_smoke.json")
    assert data["step_tokens"] == [3 + 24]
    steps = 2 + 2 + 3  # warm-up, timed (1 repeat of 2), profiled
    assert data["long_prompts"] >= -(-steps // 3)
    assert [(r["mode"], r.get("decodes")) for r in data["rows"]] == [
        ("eager", 3), ("loop, eager", None), ("loop, eager", None)]
    assert data["rows"][0]["step_ms"] > 0
    # the engine-loop rows: eager steps collected first, then overlapped; the same traffic
    # (fresh prompts each run, so no prefix-cache hits shorten the second), most steps a
    # prefill chunk beside decodes
    off, on = data["rows"][1:]
    assert (off["overlap_eager"], on["overlap_eager"]) == (False, True)
    assert off["steps"] == on["steps"] and off["mixed_steps"] == on["mixed_steps"]
    assert on["mixed_steps"] >= 2 * 3  # two long prompts of three chunks each


def test_overlap_decode_smoke_checks_equal_outputs(tmp_path, monkeypatch):
    """benchmarks/overlap_decode.py --smoke: both modes at both batches, a decode time
    each, and the outputs compared across modes (a changed output is an error row)."""
    from benchmarks import overlap_decode

    assert overlap_decode.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = _load(tmp_path / "overlap_decode_smoke.json")
    assert [(r["batch"], r["async_scheduling"]) for r in data["rows"]] == [
        (1, False), (1, True), (3, False), (3, True)]
    assert all(r["decode_ms"] > 0 for r in data["rows"])
    real = overlap_decode.timed_generate

    def flipped(llm, prompts, new, device):  # async_scheduling's run gives other tokens
        seconds, outs = real(llm, prompts, new, device)
        return seconds, [o[::-1] for o in outs] if llm.async_scheduling else outs

    monkeypatch.setattr(overlap_decode, "timed_generate", flipped)
    assert overlap_decode.main(["--smoke", "--out", str(tmp_path)]) == 1
    assert "async_scheduling changed the outputs" in str(
        json.loads((tmp_path / "overlap_decode_smoke.json").read_text())["errors"])


def test_overlap_decode_profile_is_per_decode_step(tmp_path):
    """--profile: each mode's row carries a profile whose figures are per decode step: the
    one profiled generate's, divided by --new."""
    from benchmarks import overlap_decode

    profile = {"device_busy_ms_per_step": 50.0, "device_idle_ms_per_step": 10.0,
               "kernels_ms_per_step": {"k": 1.0},
               "classes_per_step": {"expert GEMMs": {"ms": 20.0, "launches": 5.0}}}
    got = overlap_decode.per_decode_step(profile, 5)
    assert got == {"device_busy_ms_per_step": 10.0, "device_idle_ms_per_step": 2.0,
                   "classes_per_step": {"expert GEMMs": {"ms": 4.0, "launches": 1.0}}}
    assert overlap_decode.main(["--smoke", "--profile", "--out", str(tmp_path)]) == 0
    rows = _load(tmp_path / "overlap_decode_smoke.json")["rows"]
    assert all("classes_per_step" in r["profile"] for r in rows)


def test_overlap_decode_floor_counts_the_experts_balanced_routing_touches(tmp_path):
    """overlap_decode.floor_ms: the bytes of every weight but the routed experts, plus
    min(E, batch * top_k) experts per MoE layer, plus the KV, at the given copy rate; none
    under the model's own routing (its expert count is not known)."""
    import argparse

    import chunklocal
    from benchmarks import floors, overlap_decode
    from benchmarks.decode_floor import write_config

    llm = chunklocal.LLM(write_config(tmp_path / "smoke", "smoke"), load_format="dummy",
                         dtype=torch.float32, max_num_seqs=4, max_model_len=64)
    args = argparse.Namespace(routing="balanced", context=20, new=6)
    rates = {"copy_bytes_per_s": 1e9}
    dense, moe = floors.weight_bytes(llm.model)
    num_experts, per_expert = moe[0]
    top_k = llm.config.num_experts_per_tok
    spans = [overlap_decode.floor_ms(llm, b, args, rates) * 1e6 for b in (1, 2)]
    # one more request: top_k more experts per MoE layer (while under E) and its KV
    assert spans[1] - spans[0] > min(top_k, num_experts - top_k) * per_expert * len(moe) - 1
    assert spans[0] > dense + top_k * per_expert * len(moe)
    assert overlap_decode.floor_ms(llm, 1, argparse.Namespace(routing="model"), rates) is None
    llm.shutdown()


def test_prefill_profile_smoke_and_its_flop_split(tmp_path, monkeypatch):
    """benchmarks/prefill_profile.py --smoke: both prompts prefilled in whole steps, a
    profile; its FLOP split adds up to floors.prefill_flops' total (an independent count:
    every 2-d weight but the embedding and LM head, top_k experts per token), attention
    is additive over a prefix, and an FP8 checkpoint's experts count at the FP8 rate."""
    from benchmarks import floors, prefill_profile
    from benchmarks.decode_floor import write_config
    from benchmarks.fp8_dummy import FP8_DYNAMIC, write_llama4_config
    from benchmarks.fp8_dummy import SMOKE as SMOKE_TEXT

    assert prefill_profile.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = _load(tmp_path / "prefill_profile_smoke.json")
    assert [(r["prompt_len"], r["steps"]) for r in data["rows"]] == [(40, 2), (90, 3)]
    # through LLM.generate too: the same steps (the first sampled token ends the request)
    assert [r["steps_loop"] for r in data["rows"]] == [2, 3]
    assert all(r["share_loop"] == pytest.approx(r["floor_s"] / r["prefill_s_loop"])
               for r in data["rows"])
    assert data["rows"][-1]["profile"]["step_flops"]["bf16"] > 0  # kernels: CUDA only
    import chunklocal

    llm = chunklocal.LLM(write_config(tmp_path / "smoke", "smoke"), load_format="dummy",
                         dtype=torch.float32, max_model_len=128)
    params = prefill_profile.linear_params(llm.model)
    dense, expert = floors.param_counts(llm.model)
    vectors = sum(p.numel() for n, p in llm.model.named_parameters()
                  if p.dim() < 2 and "embed_tokens" not in n and "lm_head" not in n)
    assert params["dense_fp8"] == params["expert_fp8"] == 0
    assert (params["dense_16"], params["expert_16"]) == (dense - vectors, expert)
    split = prefill_profile.prefill_split(llm.config, llm.layer_kinds, params, 90)
    assert sum(split.values()) == pytest.approx(floors.prefill_flops(
        llm.config, llm.layer_kinds, 90, dense - vectors, expert))
    later = prefill_profile.prefill_split(llm.config, llm.layer_kinds, params, 50, prefix=40)
    first = prefill_profile.prefill_split(llm.config, llm.layer_kinds, params, 40)
    assert first["attention"] + later["attention"] == pytest.approx(split["attention"])
    llm.shutdown()
    fp8 = chunklocal.LLM(write_llama4_config(tmp_path / "fp8", SMOKE_TEXT, FP8_DYNAMIC),
                         load_format="dummy", dtype=torch.float32, max_model_len=128)
    params8 = prefill_profile.linear_params(fp8.model)
    assert params8["expert_fp8"] == expert and params8["expert_16"] == 0
    assert params8["dense_fp8"] > 0 and params8["dense_16"] > 0  # attention stays 16-bit
    rates = {"bf16_flops_per_s": 1.0, "fp8_flops_per_s": 2.0}
    split8 = prefill_profile.prefill_split(fp8.config, fp8.layer_kinds, params8, 90)
    assert prefill_profile.floor_seconds(split8, rates) == pytest.approx(
        split8["fp8"] / 2 + split8["bf16"] + split8["attention"])
    # the FP8 shared experts are stacked into the experts (moe.SHARED_GROUP_TOKENS): the
    # same counts as with each in its own layers
    assert fp8.model.layers[0].feed_forward.stacked
    fp8.shutdown()
    from chunklocal.models import moe

    monkeypatch.setattr(moe, "SHARED_GROUP_TOKENS", 0)
    apart = chunklocal.LLM(tmp_path / "fp8", load_format="dummy", dtype=torch.float32,
                           max_model_len=128)
    assert not apart.model.layers[0].feed_forward.stacked
    assert prefill_profile.linear_params(apart.model) == params8
    apart.shutdown()


def test_proc_cpu_finds_the_saturated_thread_and_the_idle_child():
    """benchmarks/proc_cpu.py, as the load test reads a launched server: the process tree
    (a grandchild too), per process the cores used, and the busiest thread, here one
    spinning thread beside an idle main thread and an idle child process."""
    import subprocess
    import sys
    import time

    from benchmarks import proc_cpu

    script = ("import subprocess, sys, threading, time\n"
              "def spin():\n"
              "    end = time.time() + 4\n"
              "    while time.time() < end: pass\n"
              "threading.Thread(target=spin).start()\n"
              "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(4)'])\n"
              "time.sleep(4); kid.wait()\n")
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        time.sleep(1.0)
        before, start = proc_cpu.sample(proc.pid), time.perf_counter()
        time.sleep(1.5)
        rows = proc_cpu.usage(before, proc_cpu.sample(proc.pid), time.perf_counter() - start,
                              proc.pid)
    finally:
        proc.wait(30)
    server, child = rows
    assert server["process"] == "server" and child["process"].startswith("child ")
    assert len(server["threads"]) == 2 and server["threads"][0][2] > 0.3  # the spinner
    assert server["threads"][1][2] < 0.2 and child["cores"] < 0.2
    assert server["cores"] == pytest.approx(sum(t[2] for t in server["threads"]), abs=0.01)
    assert "busiest thread" in proc_cpu.summary(rows)


def test_replay_only_times_the_graph_the_timed_steps_used():
    """decode_floor.replay_only_ms replays, alone, the graph whose replay count the timed
    steps raised (not one used before them), reps times; None without graphs or replays."""
    from collections import Counter
    from types import SimpleNamespace

    from benchmarks import decode_floor

    replayed = []
    graphs = SimpleNamespace(
        replays=Counter({(64, 1): 9, (1, 1): 3}),
        graphs={k: SimpleNamespace(replay=lambda k=k: replayed.append(k))
                for k in [(1, 1), (64, 1)]})
    before = graphs.replays.copy()
    graphs.replays[(1, 1)] += 5  # the timed steps
    cpu = torch.device("cpu")
    assert decode_floor.replay_only_ms(graphs, before, 4, cpu) >= 0
    assert replayed == [(1, 1)] * 4
    assert decode_floor.replay_only_ms(graphs, graphs.replays.copy(), 4, cpu) is None
    assert decode_floor.replay_only_ms(None, before, 4, cpu) is None


def test_decode_floor_sizes_the_pool_from_memory_when_the_whole_batch_does_not_fit(
        tmp_path, monkeypatch):
    import torch

    from benchmarks import decode_floor
    from benchmarks.fp8_dummy import SMOKE

    path = decode_floor.write_config(tmp_path / "m", "smoke")
    real, asked = decode_floor.make_llm, []

    def make_llm(path, device, seqs, max_len, pages, kv_cache_dtype="auto"):
        asked.append((pages, kv_cache_dtype))
        if pages is not None:
            raise ValueError("does not fit")
        return real(path, device, seqs, max_len, pages, kv_cache_dtype)

    monkeypatch.setattr(decode_floor, "make_llm", make_llm)
    llm = decode_floor.make_llm_with_kv(path, torch.device("cpu"), 4, 100)
    # the whole batch (4 x ceil(100 / 16) pages), then the default; the KV dtype passed on
    assert asked == [(4 * 7, "auto"), (None, "auto")]
    # K and V, 16 tokens a page, float32, 3 chunked + 1 global layer, one scratch page each
    page = 2 * 16 * SMOKE["num_key_value_heads"] * SMOKE["head_dim"] * 4
    layers = {"chunked": 3, "global": 1}
    want = sum((g.num_blocks + 1) * page * layers[name]
               for name, g in zip(llm.group_names, llm.groups, strict=True))
    assert decode_floor.kv_bytes(llm) == want
    llm.shutdown()


@given(positions=st.lists(st.integers(0, 300), min_size=1, max_size=6),
       chunk=st.integers(1, 64), kinds=st.lists(st.booleans(), min_size=1, max_size=4))
@settings(max_examples=100, deadline=None)
def test_kv_keys_count_the_keys_the_chunk_mask_lets_a_query_see(positions, chunk, kinds):
    """floors.kv_keys against the mask itself: key k is visible from position p when
    k <= p and, on a chunked layer, k // c == p // c."""
    from benchmarks.floors import kv_keys
    from chunklocal.backends.base import Kind

    layer_kinds = [Kind.CHUNKED if c else Kind.GLOBAL for c in kinds]
    want = sum(1 for kind in layer_kinds for p in positions for k in range(p + 1)
               if kind is Kind.GLOBAL or k // chunk == p // chunk)
    assert kv_keys(np.array(positions), layer_kinds, chunk) == want


@given(prompt_len=st.integers(1, 200), chunk=st.integers(1, 64),
       kinds=st.lists(st.booleans(), min_size=1, max_size=3))
@settings(max_examples=60, deadline=None)
def test_prefill_flops_count_every_visible_query_key_pair(prompt_len, chunk, kinds):
    """Attention FLOPs of floors.prefill_flops (no weights) = 4 * heads * head_dim per
    (query, key) pair the chunked-causal mask allows, counted pair by pair."""
    from types import SimpleNamespace

    from benchmarks.floors import prefill_flops
    from chunklocal.backends.base import Kind

    config = SimpleNamespace(num_attention_heads=3, head_dim=8, attention_chunk_size=chunk,
                             num_experts_per_tok=1, vocab_size=10, hidden_size=4)
    layer_kinds = [Kind.CHUNKED if c else Kind.GLOBAL for c in kinds]
    pairs = sum(1 for kind in layer_kinds for p in range(prompt_len) for k in range(p + 1)
                if kind is Kind.GLOBAL or k // chunk == p // chunk)
    lm_head = 2.0 * 10 * 4
    assert prefill_flops(config, layer_kinds, prompt_len, 0, 0) == 4 * 3 * 8 * pairs + lm_head


def test_prefix_chat_smoke(tmp_path):
    """The chat workload runs with caching on and off; the shared system prompt and the
    earlier turns are served from the cache only with caching on."""
    from benchmarks import prefix_chat

    assert prefix_chat.main(["--smoke", "--device", "cpu", "--out", str(tmp_path)]) == 0
    data = _load(tmp_path / "prefix_chat_smoke.json")
    cached = {on: sum(r["cached_tokens"] for r in data["chat"] if r["caching"] is on)
              for on in (True, False)}
    assert cached[False] == 0 and cached[True] > 0
    warm = [r for r in data["cached_prefix"] if r["caching"]]
    assert warm and all(r["warm_cached_tokens"] == 128 for r in warm)


def test_kernel_profile_tables_from_profiler_events(monkeypatch):
    """floors.kernel_profile's tables from torch.profiler's events, with a stand-in
    profiler whose events are shaped as torch's: CUDA events carry device time, and the
    launching aten ops carry their kernels (``FunctionEvent.kernels``)."""
    from types import SimpleNamespace

    import torch.profiler
    from torch.autograd.profiler_util import Kernel

    from benchmarks import floors

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def kernel_event(name, start, end):
        return SimpleNamespace(device_type=cuda, name=name, kernels=[],
                               time_range=SimpleNamespace(start=start, end=end))

    events = [kernel_event("nvjet_sm90_tst_64x8", 0, 40),
              kernel_event("elementwise_kernel", 50, 54),
              kernel_event("elementwise_kernel", 60, 66),
              SimpleNamespace(device_type=cpu, name="aten::mul", time_range=None,
                              kernels=[Kernel("elementwise_kernel", 0, 4),
                                       Kernel("elementwise_kernel", 0, 6)]),
              SimpleNamespace(device_type=cpu, name="aten::mm", time_range=None,
                              kernels=[Kernel("nvjet_sm90_tst_64x8", 0, 40)])]

    class Profile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return SimpleNamespace(events=lambda: events)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    got = floors.kernel_profile(lambda: None, 2, torch.device("cpu"))
    assert got["kernels_ms_per_step"] == {"nvjet_sm90_tst_64x8": 0.02,
                                          "elementwise_kernel": 0.005}
    assert got["kernel_launches_per_step"] == {"nvjet_sm90_tst_64x8": 0.5,
                                               "elementwise_kernel": 1.0}
    assert got["launches_by_op_per_step"] == {"aten::mul": {"ms": 0.005, "launches": 1.0},
                                              "aten::mm": {"ms": 0.02, "launches": 0.5}}
    assert got["device_busy_ms_per_step"] == 0.025  # 50 us of 66 busy, over 2 steps
    assert got["device_idle_ms_per_step"] == 0.008
    # the idle 16 us: gaps of 10 and 6 us (both launch-sized), the kernels either side
    assert got["idle_gaps_per_step"] == {"0-5us": {"gaps": 0.0, "ms": 0.0},
                                         "5-20us": {"gaps": 1.0, "ms": 0.008},
                                         "20-100us": {"gaps": 0.0, "ms": 0.0},
                                         ">=100us": {"gaps": 0.0, "ms": 0.0}}
    assert got["largest_idle_gaps"] == [
        {"us": 10.0, "after": "nvjet_sm90_tst_64x8", "before": "elementwise_kernel"},
        {"us": 6.0, "after": "elementwise_kernel", "before": "elementwise_kernel"}]


def test_idle_gaps_skip_overlaps_and_name_the_kernel_that_ended_last():
    """A kernel inside another's interval leaves no gap, and the gap after two
    overlapping kernels is named after the one that ended last; gaps fall in their size
    class at its lower end (a 5 us gap is not a 0-5 us one)."""
    from benchmarks.floors import idle_gaps

    got = idle_gaps([(0, 100, "long"), (10, 20, "inside"), (105, 110, "a"),
                     (130, 140, "b"), (300, 301, "c")], num_steps=1, largest=3)
    assert got["idle_gaps_per_step"]["5-20us"] == {"gaps": 1.0, "ms": 0.005}
    assert got["idle_gaps_per_step"]["20-100us"] == {"gaps": 1.0, "ms": 0.02}
    assert got["idle_gaps_per_step"][">=100us"] == {"gaps": 1.0, "ms": 0.16}
    assert got["largest_idle_gaps"] == [{"us": 160.0, "after": "b", "before": "c"},
                                        {"us": 20.0, "after": "a", "before": "b"},
                                        {"us": 5.0, "after": "long", "before": "a"}]


def test_activation_peak_finds_the_live_set_at_the_peak():
    """The allocations live at the trace's peak, frees of blocks from before the trace
    ignored, summed by the innermost frame of this project."""
    from benchmarks.activation_peak import by_site, live_at_peak

    ours = [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": "/x/src/chunklocal/models/moe.py", "line": 40, "name": "experts"}]
    other = [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"}]
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": ours},
        {"action": "free_completed", "addr": 99, "size": 1000, "frames": []},  # before
        {"action": "alloc", "addr": 2, "size": 50, "frames": other},
        {"action": "free_requested", "addr": 2, "size": 50, "frames": other},  # not yet
        {"action": "alloc", "addr": 3, "size": 30, "frames": ours},            # peak 180
        {"action": "free_completed", "addr": 2, "size": 50, "frames": other},
        {"action": "free_completed", "addr": 1, "size": 100, "frames": ours},
        {"action": "alloc", "addr": 4, "size": 120, "frames": ours},           # 150 < 180
    ]
    peak, live = live_at_peak(events)
    assert peak == 180 and sorted(a["addr"] for a in live) == [1, 2, 3]
    sites = by_site(live)
    assert [(s["site"], s["blocks"]) for s in sites] == [
        ("chunklocal/models/moe.py:40 experts", 2), ("elsewhere", 1)]
    assert sites[0]["gib"] * (1 << 30) == 130


def test_serve_routing_sets_the_servers_strategy_and_refuses_verify(tmp_path, monkeypatch,
                                                                     capsys):
    """benchmarks/serve.py --routing: refused beside --verify (simulated routing moves the
    experts per call, so two runs of a prompt differ); otherwise the strategy is in the
    environment a launched server inherits, and --make-scout-fp8 writes full-size Scout
    FP8's config (dummy weights)."""
    import json
    import os

    from benchmarks import serve
    from chunklocal.models import routing as moe

    with pytest.raises(SystemExit):
        serve.main(["--routing", "balanced", "--url", "http://127.0.0.1:9"])
    assert "give --verify 0" in capsys.readouterr().err
    monkeypatch.setenv("CHUNKLOCAL_MOE_ROUTING_SIMULATION_STRATEGY", "")
    monkeypatch.setattr(moe, "ROUTING_SIMULATION", "")
    monkeypatch.setattr(serve, "_run", lambda *a: 0)  # no server to talk to
    assert serve.main(["--routing", "uniform_random", "--verify", "0", "--url", "http://x",
                       "--make-scout-fp8", str(tmp_path / "fp8")]) == 0
    assert os.environ["CHUNKLOCAL_MOE_ROUTING_SIMULATION_STRATEGY"] == "uniform_random"
    assert moe.ROUTING_SIMULATION == "uniform_random"
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["text_config"]["num_hidden_layers"] == 48 and config["quantization_config"]


def test_scout_fp8_12_is_scouts_first_twelve_layers(tmp_path):
    """decode_floor's "scout-fp8-12": full-size Scout FP8's layers (every shape, the
    chunked/global pattern, FP8-dynamic) cut to 12, so a per-layer A/B fits an H100."""
    import json

    from benchmarks import decode_floor

    full = json.loads((decode_floor.write_config(tmp_path / "a", "scout-fp8")
                       / "config.json").read_text())
    cut = json.loads((decode_floor.write_config(tmp_path / "b", "scout-fp8-12")
                      / "config.json").read_text())
    assert cut["quantization_config"] == full["quantization_config"]
    ft, ct = full["text_config"], cut["text_config"]
    assert ct["num_hidden_layers"] == 12 and ct["moe_layers"] == list(range(12))
    assert ct["no_rope_layers"] == ft["no_rope_layers"][:12]
    same = {k for k in ft if k not in ("num_hidden_layers", "moe_layers", "no_rope_layers",
                                       "layer_types")}
    assert {k: ct[k] for k in same} == {k: ft[k] for k in same}


def _serve_args(monkeypatch, *flags):
    """benchmarks/serve.py's parsed flags (main with no server: _run captures them)."""
    from benchmarks import serve

    seen = {}
    monkeypatch.setattr(serve, "_run", lambda args, *a: seen.setdefault("args", args) and 0)
    assert serve.main(["--url", "http://x", "--verify", "0", *flags]) == 0
    return seen["args"]


def test_serve_request_rate_draws_vllm_s_arrivals_and_each_waits_for_its_own(
        monkeypatch, capsys):
    """--request-rate / --burstiness as vLLM's benchmark (get_request): the first request at
    0, then gamma gaps of shape burstiness and mean 1 / rate; inf sends all at once.  A
    request is not sent before its arrival time, nor at all when that is past --duration;
    bad values are refused naming the flag."""
    import asyncio
    import math
    import statistics
    import time

    from benchmarks import serve

    assert serve.arrival_times(5, math.inf, 1.0, "0/x") == [0.0] * 5
    times = serve.arrival_times(4001, 50.0, 1.0, "0/server 8")
    gaps = list(np.diff(times))
    assert times[0] == 0.0 and all(g > 0 for g in gaps)
    assert abs(statistics.mean(gaps) - 1 / 50) < 0.1 / 50  # mean 1 / rate
    cv2 = statistics.pvariance(gaps) / statistics.mean(gaps) ** 2
    assert 0.9 < cv2 < 1.1  # exponential gaps: Poisson arrivals
    steady = serve.arrival_times(4001, 50.0, 4.0, "0/server 8")
    steady_gaps = list(np.diff(steady))
    assert 0.2 < statistics.pvariance(steady_gaps) / statistics.mean(steady_gaps) ** 2 < 0.3
    assert serve.arrival_times(50, 50.0, 1.0, "0/server 8") == times[:50] != \
        serve.arrival_times(50, 50.0, 1.0, "1/server 8")  # the seed and level decide
    assert serve.arrival_times(50, 5.0, 1.0, "0/server 8") == pytest.approx(
        [10 * t for t in times[:50]])  # a tenth of the rate: ten times the gaps
    args = _serve_args(monkeypatch)
    assert math.isinf(args.request_rate) and args.burstiness == 1.0
    for flag, bad in (("--request-rate", "0"), ("--request-rate", "nan"),
                      ("--burstiness", "0"), ("--burstiness", "inf")):
        with pytest.raises(SystemExit):
            _serve_args(monkeypatch, flag, bad)
        assert f"{flag} {float(bad)}" in capsys.readouterr().err

    sent = {}

    async def one(conn, body, progress=None):
        sent[body["prompt"][0]] = time.perf_counter()
        return {"error": None}

    monkeypatch.setattr(serve, "_one", one)
    send_at = [0.0, 0.15, 0.3, 5.0]  # the last arrives after --duration 1
    start = time.perf_counter()
    records, wall = asyncio.run(serve.run_level("http://127.0.0.1:9", "m", {}, [[i] for i in
                                                                              range(4)],
                                             4, [1] * 4, 1.0, 10.0, send_at=send_at))
    assert sorted(sent) == [0, 1, 2] and len(records) == 3
    assert wall < 1.0  # the late one was dropped, not waited for
    for i in range(3):
        assert sent[i] - start >= send_at[i] - 0.01, (i, sent[i] - start)
    assert sent[2] - start < 0.3 + 0.25  # and soon after: it did not wait for a client


def test_serve_random_range_ratio_draws_vllm_s_lengths(monkeypatch, capsys):
    """benchmarks/serve.py --random-range-ratio as vLLM's random dataset
    (RandomDataset.get_sampling_params): r 0 (the default) sends exactly --prompt-tokens and
    --max-tokens, with the prompts of before; r > 0 draws each from the integers of
    [floor(L(1 - r)), ceil(L(1 + r))] (max_tokens at least 1), the same for the same seed and
    tag; r outside [0, 1) or an empty prompt is refused."""
    import random

    from benchmarks import serve

    args = _serve_args(monkeypatch, "--prompt-tokens", "40", "--max-tokens", "8")
    assert args.random_range_ratio == 0.0
    prompts, max_tokens = serve.prompt_set(args, "server 4", 16)
    assert [len(p) for p in prompts] == [40] * 16 and max_tokens == [8] * 16
    rng = random.Random("0/server 4")  # the fixed-length prompts as before the flag
    assert prompts == [[rng.randint(0, 255) for _ in range(40)] for _ in range(16)]

    args = _serve_args(monkeypatch, "--prompt-tokens", "40", "--max-tokens", "8",
                       "--random-range-ratio", "0.5", "--seed", "3")
    prompts, max_tokens = serve.prompt_set(args, "server 4", 64)
    lens = [len(p) for p in prompts]
    assert set(lens) <= set(range(20, 61)) and set(max_tokens) <= set(range(4, 13))
    assert len(set(lens)) > 10 and len(set(max_tokens)) > 5
    assert min(lens) < 30 and max(lens) > 50 and min(max_tokens) < 6 < 10 < max(max_tokens)
    assert serve.prompt_set(args, "server 4", 64) == (prompts, max_tokens)
    other, other_max = serve.prompt_set(args, "server 1", 64)
    assert other_max != max_tokens and all(a[:16] != b[:16] for a in prompts for b in other)
    args.seed = 4
    assert serve.prompt_set(args, "server 4", 64)[1] != max_tokens

    # floor below, ceil above (7 * 0.7 = 4.9, 7 * 1.3 = 9.1); max_tokens never 0
    assert serve.length_range(7, 0.3) == (4, 10) and serve.length_range(40, 0.0) == (40, 40)
    args = _serve_args(monkeypatch, "--prompt-tokens", "7", "--max-tokens", "1",
                       "--random-range-ratio", "0.3")
    lens, max_tokens = serve.request_lengths(args, "t", 200)
    assert set(lens) == set(range(4, 11)) and set(max_tokens) == {1, 2}  # ceil(1.3) = 2
    for bad in ("1.0", "-0.1"):
        with pytest.raises(SystemExit):
            _serve_args(monkeypatch, "--random-range-ratio", bad)
        assert "must be in [0, 1)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _serve_args(monkeypatch, "--prompt-tokens", "3", "--random-range-ratio", "0.7")
    assert "empty prompt" in capsys.readouterr().err


def test_serve_checks_and_counts_each_request_s_own_max_tokens():
    """benchmarks/serve.py with per-request max_tokens: a request is complete only with
    exactly the tokens it asked for (one that streamed the mean, 8, but asked for 10 fails),
    and each throughput row -- a server level's (summarize) and the in-process ones
    (closed_loop, waves: a SamplingParams per prompt) -- sums the completed requests' own."""
    from types import SimpleNamespace

    from benchmarks import serve
    from chunklocal.engine.sampling import SamplingParams

    asked = [8, 10, 5, 12]
    streamed = [8, 8, 5, 12]  # prompt 1 asked for 10 and got the mean
    records = [(i, {"error": None, "finish": "length", "tokens": t, "usage": t, "ttft": 0.1,
                    "gaps": [0.01] * (t - 1), "chunk_tokens": [1] * (t - 1), "e2e": 0.2,
                    "cached": 0})
               for i, t in enumerate(streamed)]
    problems = serve._problems("4 clients", records, asked)
    assert problems == ["4 clients, prompt 1: incomplete: finish_reason length, 8 streamed "
                        "tokens, usage 8, expected 10"]
    row = serve.summarize(4, records, 2.0, asked)
    assert (row["completed"], row["failed"]) == (3, 1)
    assert row["output_tokens_per_s"] == (8 + 5 + 12) / 2.0

    class Engine:  # each prompt [i] gets streamed[i] tokens, whatever it asked for
        def __init__(self):
            self.calls = []

        def generate(self, prompts, params, use_tqdm=False):
            assert isinstance(params, list) and len(params) == len(prompts)
            self.calls.append([p.max_tokens for p in params])
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1] * streamed[p[0]])],
                                    metrics=None) for p in prompts]

    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in asked]
    prompts = [[i] for i in range(4)]
    engine = Engine()
    row = serve.waves(engine, prompts, params, clients=3)
    assert engine.calls == [[8, 10, 5], [12]]
    assert (row["completed"], row["failed"]) == (3, 1)
    assert row["output_tokens_per_s"] == (8 + 5 + 12) / row["wall_s"]
    row = serve.closed_loop(engine, prompts, params, clients=2)
    assert sorted(m for c in engine.calls[2:] for m in c) == sorted(asked)
    assert (row["completed"], row["failed"]) == (3, 1)
    assert row["output_tokens_per_s"] == (8 + 5 + 12) / row["wall_s"]


def test_serve_keeps_one_gap_per_chunk_beside_the_split_itl():
    """A chunk carrying two tokens after 20 ms counts as two 10 ms gaps in the ITL (the
    gap split over its tokens) but as one 20 ms gap in ``chunk_gap_*`` (vLLM's benchmark
    keeps one gap per chunk), and ``multi_token_chunks`` says how often that happens."""
    from benchmarks import serve

    rec = {"error": None, "finish": "length", "tokens": 4, "usage": 4, "ttft": 0.1,
           "gaps": [0.005, 0.020], "chunk_tokens": [1, 2],
           "e2e": 0.2, "cached": 0}
    row = serve.summarize(1, [(0, rec)], 1.0, [4])
    assert row["itl_max_ms"] == 10.0
    assert (row["chunk_gap_p50_ms"], row["chunk_gap_p99_ms"]) == (5.0, 20.0)
    assert row["multi_token_chunks"] == 0.5


def test_serve_progress_line_reports_the_interval_s_rate(monkeypatch):
    """The running figure of a level cut short: tokens streamed in the last interval over
    its length (the clock is stepped by hand, so the rate is exact)."""
    import asyncio

    from benchmarks import serve

    clock = iter([10.5, 12.5])  # two ticks: 0.5 s, then 2.0 s after the level's start at 10.0
    monkeypatch.setattr(serve.time, "perf_counter", lambda: next(clock))
    progress, lines = {"tokens": 100, "finished": 1}, []

    async def sleep(_):
        if len(lines) == 1:
            progress.update(tokens=400, finished=3)
        if len(lines) == 2:
            raise asyncio.CancelledError

    monkeypatch.setattr(serve.asyncio, "sleep", sleep)
    try:
        asyncio.run(serve.report_progress(progress, 10.0, 1.0,
                                          lambda line, **_: lines.append(line)))
    except asyncio.CancelledError:
        pass
    assert "1 requests finished, 100 tokens streamed, 200 tok/s over the last 0.5 s" in lines[0]
    assert "3 requests finished, 400 tokens streamed, 150 tok/s over the last 2.0 s" in lines[1]


def test_serve_make_dummy_writes_a_moe_geometry_and_refuses_unknown_names(tmp_path,
                                                                          monkeypatch, capsys):
    """--make-dummy scout4 writes the 4-layer Scout geometry with its experts (every layer
    MoE, 16 experts), unlike --make-scout's dense checkpoint; an unknown name is refused
    with the flag and the known names."""
    import json

    _serve_args(monkeypatch, "--make-dummy", "scout4", str(tmp_path / "s4"))
    text = json.loads((tmp_path / "s4" / "config.json").read_text())["text_config"]
    assert text["moe_layers"] == [0, 1, 2, 3] and text["num_local_experts"] == 16
    assert text["num_hidden_layers"] == 4
    with pytest.raises(SystemExit):
        _serve_args(monkeypatch, "--make-dummy", "scout5", str(tmp_path / "x"))
    err = capsys.readouterr().err
    assert "--make-dummy scout5" in err and "scout4" in err
    assert not (tmp_path / "x").exists()


def test_serve_sim_accounts_steps_in_closed_form(tmp_path):
    """benchmarks.serve_sim: one request's time is its prefill step plus one decode step a
    new token after the first (which the prefill step samples); a pool too small for every
    request at once preempts and still delivers every token; the script writes its JSON."""
    from benchmarks import serve_sim

    table = np.array([[0.0, 0.0], [1.0, 2.0], [8.0, 4.0]])
    one = serve_sim.simulate(max_num_seqs=1, mnbt=64, cost="add", table=table,
                             ms_per_token=0.5, clients=1, requests=1, prompt_tokens=32,
                             max_tokens=16, pool_tokens=64)
    assert one["output_tokens"] == 16 and one["steps"] == 16
    assert one["seconds"] == pytest.approx((32 * 0.5 + 15 * 2.0) / 1e3)
    # roofline: the prompt rides along at the table's price up to RIDE_ALONG_ROWS, but the
    # compute term (0.5 ms a row) is larger here
    roof = serve_sim.simulate(max_num_seqs=1, mnbt=64, cost="roofline", table=table,
                              ms_per_token=0.5, clients=1, requests=1, prompt_tokens=32,
                              max_tokens=16, pool_tokens=64)
    assert roof["seconds"] == pytest.approx((32 * 0.5 + 15 * 2.0) / 1e3)
    crowded = serve_sim.simulate(max_num_seqs=8, mnbt=64, cost="add", table=table,
                                 ms_per_token=0.5, clients=8, requests=12, prompt_tokens=32,
                                 max_tokens=16, pool_tokens=320)
    assert crowded["output_tokens"] == 12 * 16 and crowded["preemptions"] > 0
    assert serve_sim.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = _load(tmp_path / "serve_sim.json")
    assert len(data["rows"]) == 4
