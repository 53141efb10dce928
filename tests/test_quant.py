"""FP8 math (models/quant.py) and quantization_config parsing (models/quant_config.py).

Oracles: compressed-tensors' own fake quantization (the package that writes the FP8-dynamic
checkpoints) for the per-token and per-channel rounding, float64 matmuls on the
fake-quantized operands for the products, per-group fp8_linear for the grouped product.
The CUDA paths are compared with these CPU ones in tests/gpu/test_fp8_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunklocal.models.quant import (
    FP8,
    Fp8Linear,
    dequantize,
    fp8_grouped_mm,
    fp8_linear,
    parse_fast_accum,
    quantize_per_token,
)
from chunklocal.models.quant_config import parse_quantization_config
from chunklocal.models.quant_triton import QuantRows

SETTINGS = settings(max_examples=40, deadline=None)


def tensors(seed, *shape, spread=3.0):
    gen = torch.Generator().manual_seed(seed)
    # log-uniform magnitudes: rows from tiny to large, entries over several binades
    mags = torch.exp(torch.empty(*shape).uniform_(-spread, spread, generator=gen))
    return torch.randn(*shape, generator=gen) * mags


@SETTINGS
@given(rows=st.integers(1, 9), cols=st.integers(1, 40), seed=st.integers(0, 10**6))
def test_per_token_quantization_equals_compressed_tensors(rows, cols, seed):
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    x = tensors(seed, rows, cols)
    x[0] = 0.0  # an all-zero token
    q, scale = quantize_per_token(x)
    assert q.dtype == FP8 and q.shape == x.shape and scale.shape == (rows, 1)
    args = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True,
                            symmetric=True)
    batch = x[None]  # compressed-tensors keeps dims 0 and 1 (batch, token) for "token"
    ct_scale, zp = compute_dynamic_scales_and_zp(batch, args, torch.nn.Module())
    expected = fake_quantize(batch, ct_scale, zp, args)[0]
    torch.testing.assert_close(q.float() * scale, expected, rtol=0, atol=0)
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormal step 2^-9 of the scale
    err = (q.float() * scale - x).abs()
    assert bool((err <= torch.maximum(x.abs() * 2**-4, scale * 2**-10) * 1.0001).all())


def test_activation_scale_upper_bound_saturates_large_tokens():
    x = torch.tensor([[3000.0, -600.0, 1.0], [10.0, -5.0, 0.5]])
    q, scale = quantize_per_token(x, scale_ub=1200.0)
    assert scale[:, 0].tolist() == pytest.approx([1200.0 / 448, 10.0 / 448])
    assert q[0].float().tolist()[:2] == [448.0, -224.0]  # 3000 saturates; -600 exact
    assert q.float().abs().max() <= 448


@SETTINGS
@given(m=st.integers(0, 7), n=st.integers(1, 24), k=st.integers(1, 40),
       seed=st.integers(0, 10**6), bias=st.booleans())
def test_fp8_linear_is_the_product_of_the_fake_quantized_operands(m, n, k, seed, bias):
    x, w_full = tensors(seed, m, k), tensors(seed + 1, n, k, spread=1.0)
    w_scale = w_full.abs().amax(1) / 448
    w = (w_full / w_scale[:, None]).to(FP8)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 2)) if bias else None
    out = fp8_linear(x, w, w_scale, b)
    assert out.shape == (m, n) and out.dtype == x.dtype
    q, s = quantize_per_token(x)
    # the rows quantized already (QuantRows, as the MoE's fused kernels hand them): the same
    assert torch.equal(fp8_linear(QuantRows(q, s, x.dtype), w, w_scale, b), out)
    xq, wq = q.double() * s.double(), w.double() * w_scale.double()[:, None]
    ref = xq @ wq.t()
    if bias:
        ref = ref + b.double()
    # float32 accumulation: at most about k ulps of the largest |x_i w_i| sum (not of |ref|,
    # which cancellation can make small), plus one rounding of the result.
    magnitude = xq.abs() @ wq.abs().t() + (b.double().abs() if bias else 0.0)
    bound = (k + 2) * 2.0**-24 * magnitude + 1e-30
    assert bool(((out.double() - ref).abs() <= bound).all())


@SETTINGS
@given(sizes=st.lists(st.integers(0, 6), min_size=1, max_size=5), tail=st.integers(0, 3),
       seed=st.integers(0, 10**6))
def test_fp8_grouped_mm_equals_fp8_linear_per_group(sizes, tail, seed):
    """Expert-sorted rows (empty groups included); rows past the last offset are zero."""
    n, k, e = 6, 10, len(sizes)
    x = tensors(seed, sum(sizes) + tail, k)
    w_full = tensors(seed + 1, e, n, k, spread=1.0)
    w_scale = w_full.abs().amax(-1) / 448
    w = (w_full / w_scale[..., None]).to(FP8)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    out = fp8_grouped_mm(x, w, w_scale, offs)
    start = 0
    for g, end in enumerate(offs.tolist()):
        torch.testing.assert_close(out[start:end], fp8_linear(x[start:end], w[g], w_scale[g]))
        start = end
    assert not out[start:].any()


def test_fp8_linear_module_keeps_leading_dims():
    layer = Fp8Linear(8, 4, bias=True, act_scale_ub=1200.0)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(4, 8).to(FP8))
        layer.weight_scale.fill_(0.5)
        layer.bias.fill_(1.0)
    x = torch.randn(2, 3, 8)
    out = layer(x)
    assert out.shape == (2, 3, 4)
    torch.testing.assert_close(out.reshape(6, 4), fp8_linear(
        x.reshape(6, 8), layer.weight, layer.weight_scale, layer.bias))
    torch.testing.assert_close(dequantize(layer.weight, layer.weight_scale),
                               layer.weight.float() * 0.5)


# -- quantization_config ----------------------------------------------------------------------

def test_fbgemm_modules_to_not_convert_follow_transformers_rules():
    scheme = parse_quantization_config({
        "quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
        "modules_to_not_convert": ["language_model.model.layers.1.self_attn", "router",
                                   "vision_model",
                                   r"model.language_model.layers.\d+.shared_expert"]})
    assert scheme.act_scale_ub == 1200.0

    def quantizes(name):
        return scheme.quantizes([name], ("Linear",))

    assert not quantizes("language_model.model.layers.1.self_attn.q_proj")  # prefix
    assert quantizes("language_model.model.layers.11.self_attn.q_proj")     # not layer 1
    assert not quantizes("language_model.model.layers.3.feed_forward.router")  # suffix
    # a regex matches from the start of the name (re.match), as in transformers
    assert quantizes("model.language_model.layers.3.feed_forward.shared_expert.up_proj")
    assert not quantizes("model.language_model.layers.3.shared_expert.up_proj")  # regex
    assert quantizes("language_model.model.layers.3.feed_forward.gate_proj")
    default = parse_quantization_config({"quant_method": "fbgemm_fp8"})
    assert not default.quantizes(["lm_head"], ("Linear",))  # transformers' default skip


def test_compressed_tensors_targets_and_ignore():
    group = {"targets": ["Linear"],
             "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                         "symmetric": True, "dynamic": False},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                   "symmetric": True, "dynamic": True}}
    scheme = parse_quantization_config({
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed", "config_groups": {"group_0": group},
        "ignore": ["re:.*self_attn", "lm_head", "Llama4Router"]})
    assert scheme.quantizes(["model.layers.0.feed_forward.experts.0.gate_proj"], ("Linear",))
    assert not scheme.quantizes(["model.layers.0.self_attn.q_proj"], ("Linear",))
    assert not scheme.quantizes(["lm_head"], ("Linear",))
    assert not scheme.quantizes(["model.layers.0.feed_forward.router"],
                                ("Llama4Router", "Linear"))
    weight_only = dict(group, input_activations=None)
    with pytest.raises(ValueError, match="input_activations none"):
        parse_quantization_config({"quant_method": "compressed-tensors",
                                   "config_groups": {"g": weight_only}})
    with pytest.raises(ValueError, match="quantization_status 'frozen' is not served"):
        parse_quantization_config({"quant_method": "compressed-tensors",
                                   "quantization_status": "frozen",
                                   "config_groups": {"g": group}})
    with pytest.raises(ValueError, match="activation_scale_ub must be a positive number"):
        parse_quantization_config({"quant_method": "fbgemm_fp8", "activation_scale_ub": -1})


def test_moe_expert_mm_passes_the_activation_scale_bound():
    """fbgemm_fp8's activation_scale_ub reaches the experts' grouped product."""
    from chunklocal.models.moe import expert_mm

    x = tensors(1, 6, 16, spread=6.0) * 100  # token amaxes far above the bound
    w_full = tensors(2, 2, 8, 16, spread=1.0)
    w_scale = w_full.abs().amax(-1) / 448
    w = (w_full / w_scale[..., None]).to(FP8)
    offs = torch.tensor([4, 6], dtype=torch.int32)
    capped = expert_mm(x, w, offs, w_scale, act_scale_ub=1.0)
    torch.testing.assert_close(capped, fp8_grouped_mm(x, w, w_scale, offs, act_scale_ub=1.0))
    assert not torch.allclose(capped, expert_mm(x, w, offs, w_scale))


def test_fast_accum_switch_forms_and_refusal():
    """CHUNKLOCAL_FP8_FAST_ACCUM's three forms; anything else is refused naming the variable
    (a typo must not leave the promoting GEMMs on unnoticed).  The GPU test
    test_fast_accum_error_at_prefill_sizes measures what each form costs in accuracy."""
    assert parse_fast_accum("0") == (False, False)
    assert parse_fast_accum("experts") == (True, False)
    assert parse_fast_accum("1") == (True, True)
    for bad in ("", "true", "dense", "2"):
        with pytest.raises(ValueError, match="CHUNKLOCAL_FP8_FAST_ACCUM"):
            parse_fast_accum(bad)
