"""models/moe.py on the GPU in bf16: grouped GEMMs against transformers' all-experts
``Llama4TextMoe`` (bmm over every expert), eagerly and replayed from a CUDA graph.

The GPU's torch and its grouped kernel (CUTLASS on sm90) are other code than the
CPU's, so the CPU property test does not cover them.  Both sides compute the router
logits with the same bf16 op, so they route identically; what differs is only the
accumulation order of the GEMMs (relative error ~1e-3 in bf16).  Skips without CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from test_moe import hf_moe, ours_from  # noqa: E402

from chunklocal.models import moe as moe_module  # noqa: E402

BF16 = torch.bfloat16
HIDDEN, INNER = 512, 256
MODES = {  # constructor kwargs, stack the shared expert, Triton kernel for every step
    "separate": ({}, False, False), "stacked": ({}, True, False),
    "fused": ({"fuse_max_tokens": 10**6}, True, False),
    "triton": ({}, False, True), "triton-fused": ({"fuse_max_tokens": 10**6}, True, True)}


def make_pair(num_experts, top_k, mode, dtype=BF16, seed=0):
    """transformers' MoE and ours with the same random weights, on the GPU."""
    hf = hf_moe(num_experts, top_k, seed, hidden=HIDDEN, inner=INNER, fan_in_std=True)
    kwargs, stack, triton = MODES[mode]
    ours = ours_from(hf, **kwargs)
    if stack:
        assert ours.stack_shared()
    if triton:
        pytest.importorskip("triton")
        ours.triton_max_pairs = 10**6
    return hf.to("cuda", dtype).eval(), ours.to("cuda", dtype).eval()


def rel_norm(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def test_bf16_uses_the_grouped_kernel():
    """On the H200 the bf16 path is torch's one-kernel grouped GEMM, not a fallback."""
    assert torch.cuda.get_device_capability()[0] in (9, 10), "expected sm90/sm100"
    assert moe_module._native_grouped_mm(torch.device("cuda", torch.cuda.current_device()), BF16)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("num_experts, top_k", [(16, 1), (128, 1), (8, 2), (128, 2)])
@torch.no_grad()
def test_grouped_equals_all_experts_eager_and_graph(num_experts, top_k, mode, monkeypatch):
    hf, ours = make_pair(num_experts, top_k, mode)
    if MODES[mode][2]:  # the Triton kernel must really run
        from chunklocal.models import moe_triton

        calls, real = [], moe_triton.grouped_mm_small
        monkeypatch.setattr(moe_triton, "grouped_mm_small",
                            lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = torch.Generator(device="cuda").manual_seed(1)
    for tokens in (1, 7, 64, 300, 1024, 4096):
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=BF16, generator=gen)
        expected = hf(x)[0]
        torch.cuda.set_sync_debug_mode("error")  # a host sync in the layer raises
        try:
            eager = ours(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert rel_norm(eager, expected) < 1e-2, f"eager, {tokens} tokens"

        static_x = torch.zeros_like(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the default stream, as capture needs
            ours(static_x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = ours(static_x)
        static_out.fill_(float("nan"))
        static_x.copy_(x)
        graph.replay()
        assert rel_norm(static_out, eager) < 1e-3, f"graph replay != eager at {tokens} tokens"
        # a second input through the same graph: the routing really is recomputed
        x2 = torch.randn_like(x)
        static_x.copy_(x2)
        graph.replay()
        assert rel_norm(static_out, hf(x2)[0]) < 1e-2, f"graph, {tokens} tokens"
    if MODES[mode][2]:
        assert calls, "the Triton kernel never ran"


@torch.no_grad()
def test_float32_eager_and_captured():
    """float32 has no grouped kernel on CUDA: torch's per-group fallback eagerly, and
    padded_mm under capture (torch's fallback reads the offsets on the host)."""
    hf, ours = make_pair(16, 2, "separate", dtype=torch.float32)
    x = torch.randn(200, HIDDEN, device="cuda")
    expected = hf(x)[0]
    assert rel_norm(ours(x), expected) < 1e-5
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ours(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ours(static_x)
    graph.replay()
    assert rel_norm(out, expected) < 1e-5


def _stranded() -> int:
    """Bytes torch's allocator holds but cannot give back: cached, unallocated, in segments
    that are partly in use (what the engine's memory profile counts as non-torch memory)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def _layers(n: int) -> list:
    """MoE layers whose stacks are large (w13 134 MB, w2 67 MB in bf16), built in bf16 on
    the host and moved whole: each tensor its own segment, as the loader's are."""
    from torch import nn
    return [moe_module.MoE(4, 1, 2048, 4096, nn.SiLU()).to(BF16).to("cuda") for _ in range(n)]


def _stack_w13_first(layer) -> None:
    """The control: the order stack_shared had, the new w13 replacing the old before the
    new w2 is made, so the new (smaller) w2 can take a piece of the freed w13."""
    from torch import nn
    ex, sh = layer.experts, layer.shared_expert
    gate_up = torch.cat([sh.gate_proj.weight, sh.up_proj.weight])
    ex.w13 = nn.Parameter(torch.cat([ex.w13, gate_up.unsqueeze(0)]), requires_grad=False)
    ex.w2 = nn.Parameter(torch.cat([ex.w2, sh.down_proj.weight.unsqueeze(0)]),
                         requires_grad=False)
    layer.shared_expert = None


def test_stacking_the_shared_expert_gives_the_old_stacks_back_whole():
    """Full-size Scout FP8 lost 26 GiB of its KV pool to stacks freed in pieces (models/
    moe.py, MoE.stack_shared).  The control shows the measurement sees such a split (about
    50 MB a layer here); stack_shared must leave nothing stranded.  In a process of its own:
    after other tests the allocator's segments have holes the new stacks can land in (it
    failed so after test_fp8_gpu.py on an H100, passing alone)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parent), *sys.path]))
    run = subprocess.run([sys.executable, "-c", "import test_moe_gpu as t; t.stacking_check()"],
                         cwd=here, env=env, capture_output=True, text=True, timeout=300)
    print(run.stdout)
    assert run.returncode == 0, run.stderr[-3000:]


@torch.no_grad()
def stacking_check() -> None:
    """The measurement of the test above, in a fresh process."""
    mib = 1 << 20
    control = _layers(4)
    start = _stranded()
    for layer in control:
        _stack_w13_first(layer)
    split = _stranded() - start
    del control, layer
    _stranded()  # the control's segments go back: ours are made fresh, as the loader's are
    ours = _layers(4)
    start = _stranded()
    for layer in ours:
        assert layer.stack_shared() and layer.experts.w13.shape[0] == 5
    left = _stranded() - start
    print(f"\nstranded by stacking 4 layers: w13 first {split / mib:.1f} MiB, "
          f"stack_shared {left / mib:.1f} MiB")
    assert split > 64 * mib, split / mib
    assert left < 4 * mib, left / mib


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared-group"])
@pytest.mark.parametrize("tokens", [1, 2, 16, 32, 64])
@torch.no_grad()
def test_sort_pairs_equals_torchs_path_on_the_gpu(tokens, shared):
    """models/route_triton.py's one-launch bookkeeping against torch's
    (routing.sort_pairs_torch), bf16 scores, eagerly and replayed from a CUDA graph (its switch
    is off by default: this is the check an A/B needs first)."""
    pytest.importorskip("triton")
    from chunklocal.models.route_triton import MAX_PAIRS, sort_pairs

    if tokens * (1 + shared) > MAX_PAIRS:
        pytest.skip("past the kernel's pairs")
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, 16, device="cuda", generator=gen, dtype=BF16)
    logits[: tokens // 2, 3] += 4  # half the tokens on one expert: the sort's stability
    top, expert = torch.topk(logits, 1, dim=1)
    score = torch.sigmoid(top.float()).to(BF16)
    from chunklocal.models import routing

    want = routing.sort_pairs_torch(expert, score, 16, shared)
    got = sort_pairs(expert, score, 16, shared)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = sort_pairs(expert, score, 16, shared)
    graph.replay()
    torch.cuda.synchronize()
    for name, g, r, w in zip(("order", "offs", "token", "score"), got[:4], replayed[:4], want,
                             strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w), (name, g, w)
        assert torch.equal(r, w), name
    assert torch.equal(got[0][got[4]], torch.arange(got[0].numel(), device="cuda"))


@pytest.mark.parametrize("balanced", [None, 5], ids=["top1", "balanced"])
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared-group"])
@pytest.mark.parametrize("tokens", [1, 3, 16, 32, 64, 256])
@torch.no_grad()
def test_fused_routing_and_combine_on_the_gpu(tokens, shared, balanced, monkeypatch):
    """route_triton.route_pairs from bf16 logits against routing's torch path (experts,
    order, offsets and tokens equal; scores within two bf16 ulps), and combine_rows against
    the scatter and sum (bf16, equal), eagerly and replayed from a CUDA graph; 256 tokens
    as a wide step (route_triton.WIDE_ENABLED)."""
    pytest.importorskip("triton")
    from chunklocal.models import route_triton, routing

    if tokens * (1 + shared) > route_triton.MAX_PAIRS:
        monkeypatch.setattr(route_triton, "WIDE_ENABLED", True)
    if tokens * (1 + shared) > route_triton.max_pairs(16 + shared):
        pytest.skip("past the kernel's pairs")
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    # each row a permutation of 16 logits a quarter apart: no tie for the top-1 to break
    logits = torch.stack([torch.randperm(16, device="cuda", generator=gen)
                          for _ in range(tokens)]).to(BF16) * 0.25 - 2
    if balanced is None:
        expert = torch.topk(logits, 1, dim=1).indices
    else:
        expert = (torch.arange(tokens, device="cuda").view(-1, 1) + balanced) % 16
    score = torch.sigmoid(logits.gather(1, expert).float()).to(BF16)
    want = routing.sort_pairs_torch(expert, score, 16, shared)
    got = route_triton.route_pairs(logits, 16, shared, BF16, balanced)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = route_triton.route_pairs(logits, 16, shared, BF16, balanced)
    graph.replay()
    torch.cuda.synchronize()
    for name, g, r, w in zip(("order", "offs", "token"), got[:3], replayed[:3], want[:3],
                             strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w), (name, g, w)
        assert torch.equal(r, w), name
    ulps = (got[3].float() - want[3].float()).abs() / (torch.finfo(BF16).eps
                                                       * want[3].float().abs())
    assert float(ulps.max()) <= 2 and torch.equal(replayed[3], got[3]), ulps
    slots = 1 + shared
    rows = torch.randn(tokens * slots, 5120, device="cuda", generator=gen).to(BF16)
    order, rank = got[0], got[4]
    per_slot = torch.empty_like(rows).index_copy_(0, order, rows)
    expect = per_slot.view(tokens, slots, -1).sum(1)
    summed = route_triton.combine_rows(rows, rank, tokens, slots)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        summed_replayed = route_triton.combine_rows(rows, rank, tokens, slots)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(summed, expect) and torch.equal(summed_replayed, expect)


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared-group"])
@pytest.mark.parametrize("tokens", [1, 16, 64])
@torch.no_grad()
def test_router_gemm_in_the_routing_launch_on_the_gpu(tokens, shared):
    """route_triton.route_pairs_from_x (bf16 rows of Scout's hidden size, 16 experts)
    against routing's torch path on cuBLAS's logits, with no near-tie to route either way;
    eager and replayed from a CUDA graph alike, the ticket left zeroed."""
    pytest.importorskip("triton")
    from chunklocal.models import moe_triton, route_triton, routing

    if tokens * (1 + shared) > route_triton.MAX_PAIRS:
        pytest.skip("past the kernel's pairs")
    gen = torch.Generator(device="cuda").manual_seed(100 + tokens)
    # token t leans on expert t mod 16 by about 8 logits: no near-tie for the sum's order
    # (not cuBLAS's) to turn; the rest is noise over all 5120 columns
    x = torch.randn(tokens, 5120, device="cuda", generator=gen) * 0.05
    x[torch.arange(tokens), torch.arange(tokens) % 16] = 8.0
    weight = torch.randn(16, 5120, device="cuda", generator=gen) * 0.05
    weight[:, :16] += torch.eye(16, device="cuda")
    x, weight = x.to(BF16), weight.to(BF16)
    logits = torch.nn.functional.linear(x, weight)
    expert = torch.topk(logits, 1, dim=1).indices
    score = torch.sigmoid(logits.gather(1, expert).float()).to(BF16)
    want = routing.sort_pairs_torch(expert, score, 16, shared)
    got = route_triton.route_pairs_from_x(x, weight, shared)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = route_triton.route_pairs_from_x(x, weight, shared)
    graph.replay()
    torch.cuda.synchronize()
    for name, g, r, w in zip(("order", "offs", "token"), got[:3], replayed[:3], want[:3],
                             strict=True):
        assert torch.equal(g, w) and torch.equal(r, w), name
    ulps = (got[3].float() - want[3].float()).abs() / (2.0 ** -7 * want[3].float().abs())
    assert float(ulps.max()) <= 2 and torch.equal(replayed[3], got[3]), ulps
    assert not moe_triton._TILE_COUNTERS[x.device].any()


@pytest.mark.parametrize("mode", ["stacked", "separate"])
@torch.no_grad()
def test_torch_sorted_pairs_combined_by_rank_give_the_same_bits(mode, monkeypatch):
    """routing.COMBINE_RANKED: a prefill-sized step (pairs past the routing kernels'
    bounds, so torch sorts) combined by route_triton.combine_rows with the inverse of
    torch's order, against the scatter back to pair order and the sum over the slots:
    one float32 add of two slots and one rounding either way, so the same bits."""
    from chunklocal.models import route_triton, routing

    _, ours = make_pair(16, 1, mode)
    x = torch.randn(2048, HIDDEN, device="cuda", dtype=BF16)
    calls, real = [], route_triton.combine_rows
    monkeypatch.setattr(route_triton, "combine_rows", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(routing, "COMBINE_RANKED", False)
    scattered = ours(x)
    assert calls == []
    monkeypatch.setattr(routing, "COMBINE_RANKED", True)
    ranked = ours(x)
    assert calls == [1]
    assert torch.equal(ranked, scattered)
