"""models/moe.py against transformers' all-experts ``Llama4TextMoe`` on the CPU.

transformers runs every expert on every token (unchosen experts get score
``sigmoid(-inf) = 0``), with the router score scaling each expert's input; the
grouped path must give the same numbers while multiplying only routed rows.  Both
sides compute the router logits with the same op in the same dtype, so their top-k
choices are identical and the comparison is tight.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from chunklocal.models import moe as moe_module
from chunklocal.models.moe import MoE, expert_mm, hf_expert_tensor, padded_mm
from chunklocal.models.routing import sort_by_expert

HIDDEN, INNER = 16, 8


def hf_moe(num_experts, top_k, seed, dtype=torch.float32, hidden=HIDDEN, inner=INNER,
           fan_in_std=False):
    """transformers' Llama4TextMoe with random weights (its gate_up_proj starts at 0):
    normal, std 0.5, or 1/sqrt(fan-in) with ``fan_in_std`` (tests/gpu/test_moe_gpu.py)."""
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    config = Llama4TextConfig(hidden_size=hidden, intermediate_size=inner,
                              num_local_experts=num_experts, num_experts_per_tok=top_k)
    gen = torch.Generator().manual_seed(seed)
    hf = Llama4TextMoe(config)
    with torch.no_grad():
        for param in hf.parameters():
            noise = torch.randn(param.shape, generator=gen)
            if fan_in_std:
                fan_in = param.shape[-2] if param.dim() == 3 else param.shape[-1]
                param.copy_(noise / fan_in ** 0.5)
            else:
                param.copy_(noise * 0.5)
    return hf.to(dtype).eval()


def ours_from(hf, dtype=torch.float32, **kwargs):
    """Our MoE loaded (strict) from transformers' state dict through hf_expert_tensor."""
    from transformers.activations import ACT2FN

    moe = MoE(hf.num_experts, hf.top_k, hf.hidden_dim, hf.experts.expert_dim, ACT2FN["silu"],
              **kwargs)
    state = dict(hf_expert_tensor(name, t) for name, t in hf.state_dict().items())
    moe.load_state_dict(state, strict=True)
    return moe.to(dtype).eval()


def fp8_experts(moe):
    """``moe``'s experts quantized in place to e4m3 with per-output-channel scales (the
    FP8 checkpoints' layout); returns ``moe``."""
    from chunklocal.models.quant import FP8

    ex = moe.experts
    for name in ("w13", "w2"):
        w = getattr(ex, name).data
        scale = w.abs().amax(-1).clamp(min=1e-6) / 448.0
        setattr(ex, name, nn.Parameter((w / scale[..., None]).to(FP8), requires_grad=False))
        setattr(ex, name + "_scale", scale.float())
    return moe


def rel_err(actual, expected):
    return float((actual.double() - expected.double()).abs().max() / expected.abs().max())


MODES = {  # constructor kwargs, stack the shared expert
    "separate": ({}, False),
    "stacked": ({}, True),                            # shared expert dense on slot E
    "fused": ({"fuse_max_tokens": 10**6}, True),      # shared expert as group E
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=st.integers(1, 600), top_k=st.sampled_from([1, 2]),
       num_experts=st.integers(4, 128), mode=st.sampled_from(sorted(MODES)),
       skew=st.booleans(), seed=st.integers(0, 2**16))
def test_grouped_equals_all_experts(tokens, top_k, num_experts, mode, skew, seed):
    """float32: grouped GEMMs (the CPU's torch._grouped_mm) == transformers' bmm over all
    experts.  ``skew`` biases the router so a few experts take most tokens and most
    experts none (empty groups)."""
    hf = hf_moe(num_experts, top_k, seed)
    if skew:
        with torch.no_grad():
            hf.router.weight[: num_experts // 2] -= 5.0 * hf.router.weight.abs().max()
    kwargs, stack = MODES[mode]
    ours = ours_from(hf, **kwargs)
    if stack:
        assert ours.stack_shared() and ours.shared_expert is None
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        expected, _ = hf(x)
        got = ours(x)
    assert got.shape == (tokens, HIDDEN) and got.dtype == torch.float32
    assert rel_err(got, expected) < 2e-6, mode


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_float64_through_padded_mm(top_k, mode):
    """float64 has no torch grouped kernel: padded_mm, exact to float64 rounding."""
    hf = hf_moe(12, top_k, seed=7, dtype=torch.float64)
    kwargs, stack = MODES[mode]
    ours = ours_from(hf, torch.float64, **kwargs)
    if stack:
        ours.stack_shared()
    x = torch.randn(257, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert rel_err(ours(x), hf(x)[0]) < 1e-13


@torch.no_grad()
def test_routing_scales_expert_input_not_output():
    """An independent float64 reading of Llama-4's routing, token by token: the score
    multiplies the expert's input.  Scaling the output instead is far off (silu is not
    linear), so this pins the semantics whatever transformers does."""
    hf = hf_moe(8, 2, seed=3, dtype=torch.float64)
    ours = ours_from(hf, torch.float64)
    x = torch.randn(40, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    gate_up, down = hf.experts.gate_up_proj, hf.experts.down_proj
    expected, wrong = [], []
    for row in x:
        logits = hf.router.weight @ row
        top = torch.topk(logits, 2).indices
        shared = hf.shared_expert(row)
        ins, outs = shared.clone(), shared.clone()
        for e in top.tolist():
            s = torch.sigmoid(logits[e].float()).double()  # float32, as transformers
            g, u = (s * row @ gate_up[e]).chunk(2)
            ins += (torch.nn.functional.silu(g) * u) @ down[e]
            g, u = (row @ gate_up[e]).chunk(2)
            outs += s * ((torch.nn.functional.silu(g) * u) @ down[e])
        expected.append(ins)
        wrong.append(outs)
    got = ours(x)
    # The score is a float32 sigmoid: a last-bit difference in the float64 logit (a
    # matvec here, a matmul there) can move it by one float32 ulp.
    assert rel_err(got, torch.stack(expected)) < 1e-6
    assert rel_err(got, torch.stack(wrong)) > 1e-2


@settings(max_examples=50, deadline=None)
@given(tokens=st.integers(1, 300), slots=st.integers(1, 3),
       num_groups=st.one_of(st.integers(1, 130), st.integers(250, 260),
                            st.integers(32_760, 32_775)),
       past_end=st.booleans(), seed=st.integers(0, 2**16))
def test_sort_by_expert_offsets(tokens, slots, num_groups, past_end, seed):
    """offs are int32 group ends, order lists every pair once, grouped and stable; pairs
    with id ``num_groups`` (another rank's) sort after every group.  The group counts
    around 255 and 32,767 are where the sort's narrowed key type changes."""
    gen = torch.Generator().manual_seed(seed)
    expert = torch.randint(num_groups + past_end, (tokens, slots), generator=gen)
    expert[0, 0] = num_groups - 1 + past_end  # the largest id is always present
    order, offs = sort_by_expert(expert, num_groups)
    flat = expert.reshape(-1)
    counts = torch.bincount(flat, minlength=num_groups + 1)[:num_groups]
    assert offs.dtype == torch.int32 and offs.shape == (num_groups,)
    assert offs.tolist() == torch.cumsum(counts, 0).tolist()
    assert sorted(order.tolist()) == list(range(tokens * slots))
    assert (flat[order[int(offs[-1]):]] == num_groups).all()
    starts = [0] + offs[:-1].tolist()
    for e, (a, b) in enumerate(zip(starts, offs.tolist(), strict=True)):
        assert (flat[order[a:b]] == e).all()
        assert order[a:b].tolist() == sorted(order[a:b].tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("path", ["expert_mm", "padded_mm"])
def test_expert_mm_segments(path, dtype):
    """Each segment of rows times its own expert, empty segments included, against a
    per-segment float64 loop."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 12, 16, generator=gen).to(dtype)
    ends = [0, 5, 5, 9, 20, 20]  # experts 0, 2 and 5 get no rows
    x = torch.randn(ends[-1], 16, generator=gen).to(dtype)
    offs = torch.tensor(ends, dtype=torch.int32)
    got = (expert_mm if path == "expert_mm" else padded_mm)(x, w, offs)
    expected = torch.zeros(ends[-1], 12, dtype=torch.float64)
    for e, (a, b) in enumerate(zip([0] + ends[:-1], ends, strict=True)):
        expected[a:b] = x[a:b].double() @ w[e].double().T
    assert got.dtype == dtype
    assert rel_err(got, expected) < (1e-6 if dtype == torch.float32 else 1e-14)


def test_expert_mm_refuses_mismatched_scales():
    w = torch.zeros(2, 8, 8)
    offs = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="weight scale was given"):
        expert_mm(torch.zeros(2, 8), w, offs, torch.ones(2, 8))
    with pytest.raises(ValueError, match="need a weight scale"):
        expert_mm(torch.zeros(2, 8), w.to(torch.float8_e4m3fn), offs)


def test_top_k_must_fit_the_experts():
    for top_k in (0, 5):
        with pytest.raises(ValueError, match="num_experts_per_tok must be in 1..4"):
            MoE(4, top_k, HIDDEN, INNER, torch.nn.SiLU())


def test_hf_expert_tensor_layout():
    """gate rows then up rows in w13; w2 in (N, K) = (hidden, inner) order."""
    gate_up = torch.randn(3, HIDDEN, 2 * INNER)
    name, w13 = hf_expert_tensor("model.layers.1.feed_forward.experts.gate_up_proj", gate_up)
    assert name == "model.layers.1.feed_forward.experts.w13" and w13.is_contiguous()
    assert torch.equal(w13[1, :INNER], gate_up[1, :, :INNER].T)
    assert torch.equal(w13[1, INNER:], gate_up[1, :, INNER:].T)
    down = torch.randn(3, INNER, HIDDEN)
    name, w2 = hf_expert_tensor("model.layers.1.feed_forward.experts.down_proj", down)
    assert name.endswith("experts.w2") and torch.equal(w2[2], down[2].T)
    other = torch.randn(4, 4)
    assert hf_expert_tensor("model.layers.0.feed_forward.down_proj.weight", other)[1] is other


def test_fp8_experts_dispatch_to_quant(monkeypatch):
    """float8 expert weights with per-output-channel scales go through
    quant.fp8_grouped_mm (branch ckpt) and match the dequantized weights."""
    quant = pytest.importorskip("chunklocal.models.quant")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = hf_moe(16, 2, seed=11, hidden=128, inner=64)  # fp8 GEMMs want K % 16 == 0
    ours = ours_from(hf, torch.bfloat16).to(device)
    reference = ours_from(hf, torch.bfloat16).to(device)
    ex = ours.experts
    for name in ("w13", "w2"):
        w = getattr(ex, name).float()
        scale = w.abs().amax(-1).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
        fp8 = (w / scale[..., None]).to(torch.float8_e4m3fn)
        setattr(ex, name, torch.nn.Parameter(fp8, requires_grad=False))
        setattr(ex, name + "_scale", scale)
        getattr(reference.experts, name).data = (fp8.float() * scale[..., None]).bfloat16()
    calls, real = [], quant.fp8_grouped_mm
    monkeypatch.setattr(quant, "fp8_grouped_mm", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(300, 128, device=device).bfloat16()
    with torch.no_grad():
        assert rel_err(ours(x), reference(x)) < 0.1
    assert len(calls) == 2  # w13 and w2


def test_dtype_without_grouped_kernel_goes_to_padded_mm(monkeypatch):
    """The dispatch: a dtype torch has no grouped kernel for goes to padded_mm."""
    calls = []
    real = moe_module.padded_mm
    monkeypatch.setattr(moe_module, "padded_mm", lambda *a: calls.append(1) or real(*a))
    w = torch.randn(3, 4, 8, dtype=torch.float64)
    offs = torch.tensor([2, 2, 5], dtype=torch.int32)
    moe_module.expert_mm(torch.randn(5, 8, dtype=torch.float64), w, offs)
    moe_module.expert_mm(torch.randn(5, 8), w.float(), offs)
    assert calls == [1]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=st.integers(1, 300), chunk=st.integers(1, 64), top_k=st.sampled_from([1, 2]),
       mode=st.sampled_from(sorted(MODES)), seed=st.integers(0, 2**16))
def test_sliced_steps_equal_transformers(tokens, chunk, top_k, mode, seed):
    """A step longer than ``chunk_tokens`` runs in ceil(T / chunk) slices (the memory
    profile's peak; moe.MOE_CHUNK_TOKENS) and gives transformers' output, every row."""
    hf = hf_moe(8, top_k, seed)
    kwargs, stack = MODES[mode]
    ours = ours_from(hf, **kwargs)
    if stack:
        ours.stack_shared()
    ours.chunk_tokens = chunk
    calls = []
    block = ours._block
    ours._block = lambda x: calls.append(x.shape[0]) or block(x)  # this instance only
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        expected, _ = hf(x)
        got = ours(x)
    assert rel_err(got, expected) < 2e-6, mode
    assert calls == ([tokens] if tokens <= chunk else
                     [min(chunk, tokens - s) for s in range(0, tokens, chunk)])


def test_configure_slices_long_steps_by_default():
    hf = hf_moe(4, 1, 0)
    ours = ours_from(hf)
    assert ours.chunk_tokens == 0  # a bare layer never slices
    wrapper = torch.nn.Sequential(ours)
    assert moe_module.configure(wrapper) == 1
    assert ours.chunk_tokens == moe_module.MOE_CHUNK_TOKENS == 8192
    moe_module.configure(wrapper, chunk_tokens=0)
    assert ours.chunk_tokens == 0


def test_routing_simulation_strategies(monkeypatch):
    """CHUNKLOCAL_MOE_ROUTING_SIMULATION_STRATEGY: "uniform_random" draws every pair's
    expert in range and spreads a long step over all experts; "balanced" rotates by one
    expert per call; both score by the router's logits at the chosen experts; "" is top-k."""
    from chunklocal.models import routing

    gen = torch.Generator().manual_seed(4)
    router, x = torch.randn(16, 8, generator=gen), torch.randn(512, 8, generator=gen)
    logits = x @ router.T
    monkeypatch.setattr(routing, "ROUTING_SIMULATION", "uniform_random")
    torch.manual_seed(0)
    expert, score = routing.route(x, router, 2)
    assert expert.shape == (512, 2) and expert.dtype == torch.int64
    assert int(expert.min()) >= 0 and int(expert.max()) < 16
    assert torch.unique(expert).numel() == 16  # 1,024 draws: every expert (1 - 1e-28)
    assert torch.equal(score, torch.sigmoid(logits.gather(1, expert)))
    monkeypatch.setattr(routing, "ROUTING_SIMULATION", "balanced")
    first, _ = routing.route(x[:3], router, 1)
    second, _ = routing.route(x[:3], router, 1)
    assert torch.equal(second, (first + 1) % 16)
    assert torch.equal(first[:, 0], (torch.arange(3) + first[0, 0]) % 16)
    monkeypatch.setattr(routing, "ROUTING_SIMULATION", "")
    assert torch.equal(routing.route(x, router, 2)[0], torch.topk(logits, 2, dim=1).indices)


def test_routing_simulation_names_a_bad_value():
    import subprocess
    import sys

    env = {**__import__("os").environ, "CHUNKLOCAL_MOE_ROUTING_SIMULATION_STRATEGY": "uniform"}
    run = subprocess.run([sys.executable, "-c", "import chunklocal.models.moe"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "ValueError: CHUNKLOCAL_MOE_ROUTING_SIMULATION_STRATEGY must be one of" in run.stderr
    assert "'uniform_random'" in run.stderr and "got 'uniform'" in run.stderr
