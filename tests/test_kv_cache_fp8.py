"""``kv_cache_dtype``: "auto" (pages in the model's dtype, unchanged) or "fp8" (e4m3 pages,
per-layer K / V scales; chunklocal/kv_quant.py).

Measured on this CPU (float32 model, the tiny dense Llama-4 below, 270 teacher-forced
positions): FP8 KV against the float32 cache, prompt logits relative max error
max|a - b| / max|a| = 0.039, greedy agreement 96.3%.  Attention over FP8 pages at 1024 keys:
against the float64 reference on the dequantized K/V, 1e-6 (float32 rounding); against
the unquantized K/V (score std ~3), 0.10-0.14 of max|out| at most, 0.055-0.061 RMS
relative; each K / V element is within e4m3's half-ulp (2**-4 relative).
"""

from __future__ import annotations

import flashinfer_standin
import numpy as np
import pytest
import torch
from llama4_tiny import DENSE_FP8_KV, prompts_of, write_tiny_llama4
from test_engine_flashinfer_cpu import StandinLLM, motif_prompts

import chunklocal
from chunklocal.backends.torch_ref import TorchRefBackend
from chunklocal.engine import llm as llm_module
from chunklocal.kv_quant import FP8_KV_DTYPE, cache_dtype, check_kv_cache_dtype, dequantize
from chunklocal.kv_quant import quantize as fp8_quantize
from chunklocal.kv_spec import ChunkedLocalAttentionSpec, FullAttentionSpec, Kind
from chunklocal.reference import reference_attention
from chunklocal.server.cli import LLM_FLAGS

ENGINE = dict(max_num_seqs=5, max_num_batched_tokens=48, max_model_len=160, num_kv_blocks=64)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A dense tiny Llama-4 (no MoE layer: top-1 routing turns small KV errors into
    expert flips, which would measure the router, not the cache)."""
    path = tmp_path_factory.mktemp("llama4_fp8kv")
    write_tiny_llama4(path, **DENSE_FP8_KV)
    return path


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4_fp8kv_moe")
    write_tiny_llama4(path, seed=4, attention_chunk_size=16)
    return path


# ------------------------------------------------------------------ arguments
@pytest.mark.parametrize("bad", ["fp16x", "FP8", "", None, 8, "fp8_e5m2"])
def test_kv_cache_dtype_is_checked(ckpt, bad):
    with pytest.raises(ValueError, match=f"kv_cache_dtype.*{bad!r}" if bad else
                       "kv_cache_dtype"):
        chunklocal.LLM(ckpt, kv_cache_dtype=bad, **ENGINE)


def test_kv_cache_dtype_names():
    assert [check_kv_cache_dtype(n) for n in ("auto", "fp8", "fp8_e4m3")] == \
        ["auto", "fp8", "fp8"]
    assert cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert cache_dtype("fp8_e4m3", torch.bfloat16) is torch.float8_e4m3fn
    assert LLM_FLAGS["kv_cache_dtype"] == "kv_cache_dtype"


def test_server_flag():
    import argparse

    from chunklocal.server.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["m"]).kv_cache_dtype == "auto"
    assert p.parse_args(["m", "--kv-cache-dtype", "fp8_e4m3"]).kv_cache_dtype == "fp8_e4m3"


# ------------------------------------------------------------------ "auto" is unchanged
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "merged"])
def test_auto_is_bit_for_bit_unchanged(moe_ckpt, hybrid):
    prompts = prompts_of((9, 17, 30, 45))
    before = chunklocal.LLM(moe_ckpt, hybrid_kv_cache=hybrid, **ENGINE)
    auto = chunklocal.LLM(moe_ckpt, hybrid_kv_cache=hybrid, kv_cache_dtype="auto", **ENGINE)
    assert auto.kv_cache_dtype == "auto"
    assert all(layer.self_attn.k_cache.dtype == torch.float32 for layer in auto.model.layers)
    assert [g.spec for g in auto.groups] == [g.spec for g in before.groups]
    for a, b in zip(before.prompt_logits(prompts), auto.prompt_logits(prompts), strict=True):
        assert torch.equal(a, b)
    assert before.generate(prompts, max_new_tokens=12) == \
        auto.generate(prompts, max_new_tokens=12)


# ------------------------------------------------------------------ engine accuracy
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "merged"])
def test_fp8_kv_logits_and_greedy_agreement(ckpt, hybrid):
    prompts = prompts_of((9, 17, 30, 45, 5, 64, 100))
    ref = chunklocal.LLM(ckpt, hybrid_kv_cache=hybrid, **ENGINE)
    fp8 = chunklocal.LLM(ckpt, hybrid_kv_cache=hybrid, kv_cache_dtype="fp8", **ENGINE)
    assert fp8.kv_cache_dtype == "fp8"
    for layer in fp8.model.layers:
        assert layer.self_attn.k_cache.dtype == layer.self_attn.v_cache.dtype == FP8_KV_DTYPE
    assert all(g.spec.dtype == FP8_KV_DTYPE for g in fp8.groups)
    a = torch.cat(ref.prompt_logits(prompts))
    b = torch.cat(fp8.prompt_logits(prompts))
    err = (a - b).abs().max()
    assert 0 < err / a.abs().max() < 0.08  # measured 0.039 (hybrid and merged alike)
    agree = a.argmax(-1) == b.argmax(-1)
    assert agree.float().mean() >= 0.95, agree.float().mean()  # measured 0.963
    # (No check that choices with a top-1 margin over 2 * err agree: each logit moves by at
    # most err, so a margin moves by at most 2 * err and such a choice cannot flip.)
    out = fp8.generate(prompts[:3], max_new_tokens=8)
    assert all(len(o) == 8 for o in out)


# ------------------------------------------------------------------ attention vs reference
def _pages(x: torch.Tensor, block_size: int) -> torch.Tensor:
    pad = (-x.shape[0]) % block_size
    x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    return x.view(-1, block_size, *x.shape[1:])


@pytest.mark.parametrize("chunk", [None, 256], ids=["global", "chunked"])
def test_fp8_attention_against_the_float64_reference(chunk):
    gen = torch.Generator().manual_seed(0)
    bs, hkv, hq, d = 16, 2, 8, 64
    seq_lens = np.array([1024, 600])
    query_lens = np.array([40, 600])
    keys = int(seq_lens.sum())
    k = 3 * torch.randn(keys, hkv, d, generator=gen)
    v = 2 * torch.randn(keys, hkv, d, generator=gen)
    q = torch.randn(int(query_lens.sum()), hq, d, generator=gen)
    k_scale, v_scale = 0.04, 0.025  # |k| / k_scale, |v| / v_scale < 448: no clamping
    # request i's keys are contiguous: pages of request 0, then of request 1
    kq, vq = fp8_quantize(k, k_scale), fp8_quantize(v, v_scale)
    starts = np.concatenate([[0], np.cumsum(seq_lens)]).tolist()

    def paged(x):
        return torch.cat([_pages(x[s:e], bs) for s, e in zip(starts[:-1], starts[1:],
                                                             strict=True)])

    k_pages, v_pages, k_orig, v_orig = paged(kq), paged(vq), paged(k), paged(v)
    per_req = -(-seq_lens // bs)
    table = np.zeros((2, per_req.max()), np.int32)
    table[0, :per_req[0]] = np.arange(per_req[0])
    table[1, :per_req[1]] = per_req[0] + np.arange(per_req[1])
    qsl = np.concatenate([[0], np.cumsum(query_lens)])
    spec = (ChunkedLocalAttentionSpec(bs, hkv, d, FP8_KV_DTYPE, attention_chunk_size=chunk)
            if chunk else FullAttentionSpec(bs, hkv, d, FP8_KV_DTYPE))
    backend = TorchRefBackend(spec, num_q_heads=hq)
    md = backend.build(qsl, seq_lens, table)
    kind = Kind.CHUNKED if chunk else Kind.GLOBAL
    out = backend.forward(md, q, k_pages, v_pages, d ** -0.5, kind=kind,
                          k_scale=k_scale, v_scale=v_scale)

    def ref(kc, vc):
        return reference_attention(q.double(), kc.double(), vc.double(), qsl, seq_lens, table,
                                   chunk_size=chunk, scale=d ** -0.5)

    exact = ref(dequantize(k_pages, k_scale), dequantize(v_pages, v_scale))
    scale = exact.abs().max()
    assert float((k / k_scale).abs().max()) < 448 and float((v / v_scale).abs().max()) < 448
    exact_err = (out.double() - exact).abs().max() / scale
    print(f"vs dequantized: {exact_err:.2e}")
    assert exact_err < 1e-5  # measured ~1e-6
    unquantized = ref(k_orig, v_orig)
    rel = (out.double() - unquantized).abs().max() / unquantized.abs().max()
    rms = (out.double() - unquantized).norm() / unquantized.norm()
    print(f"vs unquantized: max {rel:.3f}, rms {rms:.4f}")
    # measured: max 0.104 / 0.136 (global / chunked), rms 0.061 / 0.055 of the output: the
    # score errors q . (k - e4m3(k)) of peaked softmaxes (score std ~3)
    assert rel < 0.2 and rms < 0.1, (rel, rms)
    # each element within e4m3's rounding: half an ulp (2**-4 relative) for normals,
    # 2**-10 (half the smallest subnormal step) times the scale below 2**-6
    for x, xq, sc in ((k, kq, k_scale), (v, vq, v_scale)):
        bound = 2.0 ** -4 * x.abs() + 2.0 ** -10 * sc
        assert ((dequantize(xq, sc) - x).abs() <= bound * (1 + 1e-6)).all()
    # the guard: pages read without their scales are far off
    unscaled = backend.forward(md, q, k_pages, v_pages, d ** -0.5, kind=kind)
    assert (unscaled.double() - exact).abs().max() / scale > 1


def test_quantize_clamps_to_the_e4m3_range():
    x = torch.tensor([1000.0, -1000.0, 0.5, 0.0])
    q = fp8_quantize(x, 1.0).float()
    assert q.tolist() == [448.0, -448.0, 0.5, 0.0]
    # 1000 / 4 = 250 rounds to 256 (e4m3 steps of 16 in [256, 448]; 250 is nearer 256)
    assert dequantize(fp8_quantize(x, 4.0), 4.0).tolist() == [1024.0, -1024.0, 0.5, 0.0]


# ------------------------------------------------------------------ FlashInfer stand-in
@pytest.fixture
def standin(monkeypatch):
    flashinfer_standin.install(monkeypatch)


def _set_scales(llm, k_scale, v_scale):
    for layer in llm.model.layers:
        layer.self_attn.k_scale, layer.self_attn.v_scale = k_scale, v_scale


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "merged"])
def test_flashinfer_fp8_equals_the_torch_backend(ckpt, standin, hybrid, graphs):
    kw = dict(ENGINE, hybrid_kv_cache=hybrid, kv_cache_dtype="fp8", dtype=torch.float32)
    prompts = motif_prompts(1)
    fi = StandinLLM(ckpt, attention_backend="flashinfer", cuda_graphs=graphs, **kw)
    ref = chunklocal.LLM(ckpt, attention_backend="torch", **kw)
    backend = fi.runner.backends[0]
    assert type(backend).__name__ == "FlashInferBackend"
    assert backend._plan_kwargs()["kv_data_type"] == FP8_KV_DTYPE
    assert fi.model.layers[0].self_attn.k_cache.dtype == FP8_KV_DTYPE
    for llm in (fi, ref):
        _set_scales(llm, 0.5, 0.25)  # non-unit: run(k_scale=, v_scale=) must be right
    outputs = fi.generate(prompts, max_new_tokens=16)
    assert outputs == ref.generate(prompts, max_new_tokens=16)
    if graphs:
        assert any(fi.runner.graphs.replays.values())


def test_flashinfer_fp8_with_bf16_queries(ckpt, standin):
    """dtype None on the FlashInfer path: bf16 queries over e4m3 pages (0.7.2's FP8 KV)."""
    kw = dict(ENGINE, kv_cache_dtype="fp8", cuda_graphs=False)
    fi = StandinLLM(ckpt, attention_backend="flashinfer", **kw)
    plan = fi.runner.backends[0]._plan_kwargs()
    assert plan["q_data_type"] == torch.bfloat16 and plan["kv_data_type"] == FP8_KV_DTYPE
    ref = chunklocal.LLM(ckpt, attention_backend="torch", dtype=torch.bfloat16, **kw)
    prompts = prompts_of((9, 30, 45))
    a = torch.cat(fi.prompt_logits(prompts))
    b = torch.cat(ref.prompt_logits(prompts))
    assert (a - b).abs().max() / b.abs().max() < 0.05


# ------------------------------------------------------------------ sizing
def test_fp8_pages_are_one_byte_per_element(ckpt, monkeypatch):
    bf16 = FullAttentionSpec(16, 2, 64, torch.bfloat16)
    fp8 = FullAttentionSpec(16, 2, 64, FP8_KV_DTYPE)
    assert bf16.page_size_bytes == 2 * fp8.page_size_bytes == 2 * (2 * 16 * 2 * 64)
    kw = dict(max_num_seqs=256, max_num_batched_tokens=48, max_model_len=1024,
              dtype=torch.bfloat16)
    monkeypatch.setattr(llm_module, "available_memory", lambda device: 40 << 20)
    pools = {}
    for name in ("auto", "fp8"):
        llm = chunklocal.LLM(ckpt, kv_cache_dtype=name, **kw)
        pools[name] = {n: g.num_blocks for n, g in zip(llm.group_names, llm.groups, strict=True)}
    n_auto, n_fp8 = pools["auto"]["global"], pools["fp8"]["global"]
    assert n_auto < 256 * 64  # the memory budget binds, not max_num_seqs
    # The chunked pools are capped (256 x 4 pages + scratch, 3 layers) and the global pool
    # takes the rest of the budget: twice the pages at half the bytes, and the bf16 bytes
    # the fp8 chunked pool does not take (3 x 1025 global pages of 1 layer).
    assert pools["auto"]["chunked"] == pools["fp8"]["chunked"] == 1024, pools
    assert n_fp8 - 2 * n_auto - 3 * 1025 in (0, 1, 2), pools


def test_fp8_kv_under_tensor_parallelism(ckpt):
    """Two ranks over gloo: each rank's FP8 pages (its KV heads) give the one-rank logits
    up to the all-reduce's rounding."""
    kw = dict(ENGINE, kv_cache_dtype="fp8")
    prompts = prompts_of((9, 17, 30))
    one = chunklocal.LLM(ckpt, **kw)
    with chunklocal.LLM(ckpt, tensor_parallel_size=2, **kw) as two:
        a, b = torch.cat(one.prompt_logits(prompts)), torch.cat(two.prompt_logits(prompts))
        assert (a - b).abs().max() / a.abs().max() < 1e-5  # measured 4e-7
        assert one.generate(prompts, max_new_tokens=8) == two.generate(prompts, max_new_tokens=8)


# ------------------------------------------------------------------ checkpoint scales
def _with_scales(src, dst, scales: dict):
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    save_file({name: torch.tensor(value) if isinstance(value, float) else value
               for name, value in scales.items()}, str(dst / "kv_scales.safetensors"))
    return dst


def test_checkpoint_kv_scales_are_read(ckpt, tmp_path):
    path = _with_scales(ckpt, tmp_path / "scaled", {
        "model.layers.0.self_attn.k_scale": 0.5, "model.layers.0.self_attn.v_scale": 0.25,
        "model.layers.3.self_attn.k_proj.output_scale": torch.tensor([0.125]),
    })
    fp8 = chunklocal.LLM(path, kv_cache_dtype="fp8", **ENGINE)
    attn = [layer.self_attn for layer in fp8.model.layers]
    assert [(a.k_scale, a.v_scale) for a in attn] == [(0.5, 0.25), (1.0, 1.0), (1.0, 1.0),
                                                      (0.125, 1.0)]
    prompts = prompts_of((30, 45))
    a = torch.cat(chunklocal.LLM(ckpt, **ENGINE).prompt_logits(prompts))
    b = torch.cat(fp8.prompt_logits(prompts))
    assert (a - b).abs().max() / a.abs().max() < 0.08
    # layer 0's keys do not depend on the cache: stored as k / 0.5, twice the unscaled pages
    # (exactly, but where the unscaled value is an e4m3 subnormal: steps of 2**-9)
    unscaled = chunklocal.LLM(ckpt, kv_cache_dtype="fp8", **ENGINE)
    unscaled.prompt_logits(prompts)
    pages = [e.model.layers[0].self_attn.k_cache.float() for e in (fp8, unscaled)]
    assert pages[1].abs().max() > 1
    assert (pages[0] - 2 * pages[1]).abs().max() <= 2.0 ** -8


@pytest.mark.parametrize("scales, message", [
    ({"model.layers.9.self_attn.k_scale": 0.5}, "4 layers"),
    ({"model.layers.0.self_attn.k_scale": torch.ones(2)}, "must be one float"),
    ({"model.layers.0.self_attn.v_scale": 0.5,
      "model.layers.0.self_attn.v_proj.output_scale": 0.5}, "both give layer 0's v_scale"),
    ({"model.layers.1.self_attn.k_scale": -1.0}, "positive and finite"),
])
def test_bad_checkpoint_kv_scales(ckpt, tmp_path, scales, message):
    path = _with_scales(ckpt, tmp_path / "bad", scales)
    with pytest.raises(ValueError, match=message):
        chunklocal.LLM(path, kv_cache_dtype="fp8", **ENGINE)


# ------------------------------------------------------------------ calculate_kv_scales
def _record_calibrations(monkeypatch):
    """Every calibrated_scales call: (max |K|, max |V|, the scales it returned)."""
    from chunklocal.kv_quant import calibrated_scales
    from chunklocal.models import llama4

    seen = []

    def recording(k, v):
        scales = calibrated_scales(k, v)
        seen.append((float(k.abs().amax()), float(v.abs().amax()), scales))
        return scales

    monkeypatch.setattr(llama4, "calibrated_scales", recording)
    return seen


def test_calculate_kv_scales_sets_each_layer_from_the_first_step(ckpt, monkeypatch):
    """vLLM's calculate_kv_scales: on the first real step (not the memory profile's, not a
    later one) every layer's k_scale is that step's max |K| / 200 and v_scale max |V| / 100,
    set before its pages are written; the logits stay as close to a 16-bit cache."""
    seen = _record_calibrations(monkeypatch)
    kw = dict(ENGINE, kv_cache_dtype="fp8")
    llm = chunklocal.LLM(ckpt, calculate_kv_scales=True, **kw)
    assert seen == [] and all(layer.self_attn.k_scale == 1.0 for layer in llm.model.layers)
    prompts = prompts_of((9, 30, 45))
    got = torch.cat(llm.prompt_logits(prompts))
    layers = llm.model.layers
    assert len(seen) == len(layers)  # once per layer
    for (k_amax, v_amax, _), layer in zip(seen, layers, strict=True):
        assert layer.self_attn.k_scale == k_amax / 200 and layer.self_attn.v_scale == v_amax / 100
        assert layer.self_attn.k_scale != 1.0
    llm.generate(prompts, max_new_tokens=4)
    assert len(seen) == len(layers)  # not again
    want = torch.cat(chunklocal.LLM(ckpt, **ENGINE).prompt_logits(prompts))
    assert (got - want).abs().max() / want.abs().max() < 0.05


def test_calculate_kv_scales_recaptures_the_graphs(ckpt, standin, monkeypatch):
    """With CUDA graphs (FlashInfer stand-in): the first step runs eagerly, whatever its
    shape, and the graphs captured with the scales of 1 are captured again, so replayed
    decodes read the pages with the calibrated scales: the tokens of an eager engine."""
    kw = dict(ENGINE, kv_cache_dtype="fp8", dtype=torch.float32, calculate_kv_scales=True,
              attention_backend="flashinfer")
    prompts = motif_prompts(1)
    graphs = StandinLLM(ckpt, cuda_graphs=True, **kw)
    eager = StandinLLM(ckpt, cuda_graphs=False, **kw)
    first = graphs.runner.graphs
    outputs = graphs.generate(prompts, max_new_tokens=16)
    assert graphs.runner.graphs is not first and any(graphs.runner.graphs.replays.values())
    assert outputs == eager.generate(prompts, max_new_tokens=16)
    scales = [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in graphs.model.layers]
    assert scales == [(layer.self_attn.k_scale, layer.self_attn.v_scale)
                      for layer in eager.model.layers] and scales[0] != (1.0, 1.0)


def test_the_memory_profile_step_does_not_calibrate(ckpt, monkeypatch):
    """gpu_memory_utilization's profile step (dummy prompts) runs before any real one: the
    scales come from the first real step, not from it."""
    from test_engine_memory import FakeMemory

    seen = _record_calibrations(monkeypatch)
    memory = FakeMemory(64 << 20)
    monkeypatch.setattr(chunklocal.LLM, "device_memory", lambda device: memory)
    kw = {k: v for k, v in ENGINE.items() if k != "num_kv_blocks"}
    llm = chunklocal.LLM(ckpt, kv_cache_dtype="fp8", calculate_kv_scales=True, **kw)
    assert llm.memory_budget is not None and "reset" in memory.events  # it was profiled
    assert seen == []
    llm.generate(prompts_of((9,)), max_new_tokens=2)
    assert len(seen) == len(llm.model.layers)


def test_calculate_kv_scales_needs_fp8_pages(ckpt):
    with pytest.raises(ValueError, match="calculate_kv_scales=True calibrates FP8 KV pages: "
                                         "it needs kv_cache_dtype='fp8'"):
        chunklocal.LLM(ckpt, calculate_kv_scales=True, **ENGINE)
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        chunklocal.LLM(ckpt, calculate_kv_scales="yes", kv_cache_dtype="fp8", **ENGINE)
    assert LLM_FLAGS["calculate_kv_scales"] == "calculate_kv_scales"


@pytest.mark.parametrize("calibrate", [False, True], ids=["scales", "calculate_kv_scales"])
def test_piecewise_graphs_over_fp8_pages(ckpt, standin, monkeypatch, calibrate):
    """Piecewise graphs (engine/piecewise_graphs.py) with an FP8 KV cache: the eager
    attention between segments writes and reads e4m3 pages with each layer's scales; with
    calculate_kv_scales the first step calibrates eagerly, the whole-forward graphs (whose
    KV writes hold the scales) are captured again and the segments (which hold none) are
    kept.  Tokens equal an eager engine's (the torch backend, or the stand-in
    without graphs when calibrating)."""
    from chunklocal.engine import piecewise_graphs

    monkeypatch.setattr(piecewise_graphs, "PIECEWISE_ENABLED", True)
    kw = dict(ENGINE, kv_cache_dtype="fp8", dtype=torch.float32,
              calculate_kv_scales=calibrate)
    prompts = motif_prompts(4)
    fi = StandinLLM(ckpt, attention_backend="flashinfer", **kw)
    first = fi.runner.piecewise
    assert first is not None
    if calibrate:
        ref = StandinLLM(ckpt, attention_backend="flashinfer", cuda_graphs=False, **kw)
    else:
        ref = chunklocal.LLM(ckpt, attention_backend="torch", **kw)
        for llm in (fi, ref):
            _set_scales(llm, 0.5, 0.25)
    assert fi.generate(prompts, max_new_tokens=16) == ref.generate(prompts, max_new_tokens=16)
    assert fi.runner.piecewise_steps > 0
    assert fi.runner.piecewise is first
