"""Fused projections (models/fused.py): q/k/v and gate/up as one GEMM after loading.

Each fused module against its parts (float and FP8, with and without bias); whole engines
fused against unfused on published layouts (16-bit, compressed-tensors FP8 with its FP8
shared expert, fbgemm FP8 Maverick with FP8 dense MLPs) and over two tensor-parallel ranks:
the same greedy tokens and prompt logits; and the refusals."""

from __future__ import annotations

import pytest
import torch
from llama4_published import (
    MAVERICK,
    SCOUT,
    compressed_tensors_fp8,
    hf_model,
    write_maverick_fbgemm,
    write_published,
)
from torch import nn

import chunklocal
from chunklocal.models import fused
from chunklocal.models.moe import SharedExpert
from chunklocal.models.quant import FP8, Fp8Linear

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

PROMPTS = [[(5 * i + 3 * j) % 400 + 7 for j in range(n)] for i, n in enumerate([9, 23, 40])]


def fp8_linear_module(n, k, seed, ub=None, bias=False):
    gen = torch.Generator().manual_seed(seed)
    layer = Fp8Linear(k, n, bias, ub)
    w = torch.randn(n, k, generator=gen)
    scale = w.abs().amax(-1) / 448
    layer.weight.data = (w / scale[:, None]).to(FP8)
    layer.weight_scale.data = scale
    if bias:
        layer.bias.data = torch.randn(n, generator=gen)
    return layer


def float_linear_module(n, k, seed, bias=False):
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


@pytest.mark.parametrize("make", [float_linear_module, fp8_linear_module], ids=["float", "fp8"])
@pytest.mark.parametrize("bias", [False, True])
def test_a_fused_linear_gives_each_part_its_columns(make, bias):
    parts = [make(n, 48, seed=i, bias=bias) for i, n in enumerate([32, 8, 8])]
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(7)) * \
        torch.logspace(-2, 2, 5).view(-1, 1)  # rows of different scale: per-token FP8 scales
    with torch.no_grad():
        got = fused.concat_linears(parts)(x).split([32, 8, 8], dim=-1)
        for part, out in zip(parts, got, strict=True):
            torch.testing.assert_close(out, part(x), rtol=1e-5, atol=1e-4)  # |out| to 1e3


def test_parts_that_cannot_share_a_gemm_are_refused():
    with pytest.raises(ValueError, match="one kind of Linear"):
        fused.concat_linears([float_linear_module(8, 16, 0), fp8_linear_module(8, 16, 1)])
    with pytest.raises(ValueError, match="same input features"):
        fused.concat_linears([float_linear_module(8, 16, 0), float_linear_module(8, 32, 1)])
    with pytest.raises(ValueError, match="one activation cap"):
        fused.concat_linears([fp8_linear_module(8, 16, 0, ub=2.0), fp8_linear_module(8, 16, 1)])
    cross_rank = fp8_linear_module(8, 16, 0)
    cross_rank.amax_reduce = lambda a: a
    with pytest.raises(ValueError, match="cross-rank amax"):
        fused.concat_linears([cross_rank, fp8_linear_module(8, 16, 1)])


def test_parts_of_different_kinds_stay_apart_and_fusing_twice_changes_nothing():
    """A checkpoint that quantizes q_proj but not k_proj / v_proj loads unfused (no error);
    a second fuse() of a fused module does nothing."""
    torch.manual_seed(0)
    mlp = SharedExpert(16, 24, nn.SiLU())
    mlp.gate_proj = fp8_linear_module(24, 16, 3)
    assert not mlp.fuse() and mlp.gate_up_proj is None and hasattr(mlp, "up_proj")
    mlp = SharedExpert(16, 24, nn.SiLU())
    assert mlp.fuse() and not mlp.fuse()


def test_a_shared_expert_fuses_in_place():
    torch.manual_seed(0)
    mlp = SharedExpert(16, 24, nn.SiLU())
    x = torch.randn(3, 16)
    with torch.no_grad():
        want = mlp(x)
        assert mlp.fuse()
        got = mlp(x)
    assert not hasattr(mlp, "gate_proj") and mlp.gate_up_proj.out_features == 48
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_fused_shared_expert_still_stacks_into_the_experts():
    """MoE.stack_shared (slot E of the stacks) takes the fused gate_up weight as it is."""
    from chunklocal.models.moe import MoE

    torch.manual_seed(1)
    layer = MoE(4, 1, 16, 24, nn.SiLU(), fuse_max_tokens=1 << 30)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.2)
    x = torch.randn(5, 16)
    with torch.no_grad():
        want = layer(x)
        assert layer.shared_expert.fuse() and layer.stack_shared()
        got = layer(x)  # the shared expert as group E of the grouped GEMMs
    assert layer.shared_expert is None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def engine(path, **kwargs):
    args = dict(device="cpu", dtype=torch.float32, max_model_len=256,
                max_num_batched_tokens=64, block_size=4)
    return chunklocal.LLM(path, **{**args, **kwargs})


def fused_and_unfused(monkeypatch, path, **kwargs):
    monkeypatch.setattr(fused, "FUSE_PROJECTIONS", False)
    plain = engine(path, **kwargs)
    monkeypatch.setattr(fused, "FUSE_PROJECTIONS", True)
    return engine(path, **kwargs), plain


def check_same_outputs(one, other):
    for a, b in zip(one.prompt_logits(PROMPTS), other.prompt_logits(PROMPTS), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert one.generate(PROMPTS, max_new_tokens=12, ignore_eos=True) == \
        other.generate(PROMPTS, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def scout_hf():
    return hf_model(SCOUT, seed=0)


@pytest.mark.parametrize("layout", ["bf16", "compressed-tensors"])
def test_scout_fused_equals_unfused(scout_hf, tmp_path, monkeypatch, layout):
    from chunklocal.models import moe

    monkeypatch.setattr(moe, "SHARED_GROUP_TOKENS", 0)  # FP8 shared experts keep their layers
    if layout == "bf16":
        path = write_published(tmp_path, SCOUT, scout_hf.state_dict())
    else:
        tensors, qc = compressed_tensors_fp8(scout_hf)
        path = write_published(tmp_path, SCOUT, tensors, quantization_config=qc)
    on, off = fused_and_unfused(monkeypatch, path)
    attn = on.model.layers[0].self_attn
    assert attn.qkv_sizes == [off.model.layers[0].self_attn.q_proj.out_features,
                              *[off.model.layers[0].self_attn.k_proj.out_features] * 2]
    assert not hasattr(attn, "q_proj")
    shared = on.model.layers[0].feed_forward.shared_expert
    assert isinstance(shared.gate_up_proj, Fp8Linear if layout != "bf16" else nn.Linear)
    check_same_outputs(on, off)


def test_maverick_fbgemm_fp8_dense_mlps_fused_equal_unfused(tmp_path, monkeypatch):
    """fbgemm's FP8 dense MLPs (with activation_scale_ub) fused into one FP8 GEMM."""
    path = write_maverick_fbgemm(tmp_path, hf_model(MAVERICK, seed=2))
    on, off = fused_and_unfused(monkeypatch, path)
    mlp = on.model.layers[0].feed_forward
    assert mlp.gate_up_proj.weight.dtype == FP8 and mlp.gate_up_proj.act_scale_ub == 1200.0
    check_same_outputs(on, off)


def test_two_ranks_fuse_their_own_slices(scout_hf, tmp_path, monkeypatch):
    """Each tensor-parallel rank fuses its slices; two ranks over gloo equal one rank
    unfused."""
    path = write_published(tmp_path, SCOUT, scout_hf.state_dict())
    monkeypatch.setattr(fused, "FUSE_PROJECTIONS", False)
    plain = engine(path)
    monkeypatch.setattr(fused, "FUSE_PROJECTIONS", True)  # CPU ranks are forked: they see it
    with engine(path, tensor_parallel_size=2) as two:
        check_same_outputs(two, plain)


def test_gated_act_reaches_flashinfer_silu_and_mul_where_available(ckpt, monkeypatch):
    """With FlashInfer's silu_and_mul available (here: the strict stand-in, made available
    on the CPU), every fused act(gate) * up -- the routed experts, the shared experts and
    the dense MLPs -- goes through it with a contiguous [rows, 2 * inner], and the prompt
    logits stay those of torch's two kernels."""
    import flashinfer_standin

    fi = flashinfer_standin.install(monkeypatch)
    path, _ = ckpt
    kw = dict(dtype=torch.float32, max_num_seqs=2, max_model_len=64, num_kv_blocks=16)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    want = chunklocal.LLM(path, **kw).prompt_logits(prompts)
    assert not fused.silu_mul_available(torch.zeros(2, 8), nn.SiLU())  # CPU rows: never
    calls, real = [], fi.activation.silu_and_mul
    monkeypatch.setattr(fi.activation, "silu_and_mul",
                        lambda x, *a, **k: calls.append(tuple(x.shape)) or real(x, *a, **k))
    monkeypatch.setattr(fused, "silu_mul_available", lambda gate_up, act: fused.is_silu(act))
    llm = chunklocal.LLM(path, **kw)
    got = llm.prompt_logits(prompts)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    config = llm.config
    widths = {2 * config.intermediate_size, 2 * config.intermediate_size_mlp}
    assert calls and {shape[-1] for shape in calls} == widths  # experts and dense MLPs


def test_silu_mul_needs_the_switch_cuda_and_silu(monkeypatch):
    monkeypatch.setattr(fused, "SILU_MUL_ENABLED", False)
    x = torch.zeros(2, 8)
    assert not fused.silu_mul_available(x, nn.SiLU())
    monkeypatch.setattr(fused, "SILU_MUL_ENABLED", True)
    assert not fused.silu_mul_available(x, nn.SiLU())  # a CPU tensor
    assert fused.is_silu(nn.SiLU()) and not fused.is_silu(nn.GELU())
    gate, up = torch.randn(2, 4), torch.randn(2, 4)
    out = fused.gated_act(torch.cat([gate, up], dim=1), nn.SiLU())
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up)
