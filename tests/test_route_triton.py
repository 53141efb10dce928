"""models/route_triton.py: the MoE block's pair bookkeeping in one launch, in Triton's
interpreter on the CPU, against torch's path (routing.sort_pairs_torch: routing.sort_by_expert
and the cats, division and gather around it), value for value; the fused routing from the
logits (route_pairs) against routing.route + torch's path; the combine against torch's
scatter and sum; and the MoE block with each on against all off."""

from __future__ import annotations

import textwrap

import pytest
from test_moe_triton import run_in_interpreter

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import os
    os.environ["CHUNKLOCAL_MOE_ROUTE_TRITON"] = "1"
    import torch
    from chunklocal.models import moe, moe_triton, route_triton, routing
    from chunklocal.models.route_triton import MAX_PAIRS, route_available, sort_pairs

    def pytest_raises(kind, text):
        import contextlib

        @contextlib.contextmanager
        def check():
            try:
                yield
            except kind as error:
                assert text in str(error), error
            else:
                raise AssertionError(f"no {kind.__name__}")
        return check()

    gen = torch.Generator().manual_seed(0)
    cases = 0
    for num_experts in (1, 4, 16, 128):
        for k in (1, 2):
            if k > num_experts:
                continue
            for shared in (False, True):
                for tokens in (1, 2, 3, 7, 16, 31, 32, 64):
                    if tokens * (k + shared) > MAX_PAIRS:
                        assert not route_available(torch.zeros(1), tokens * (k + shared),
                                                   num_experts + shared)
                        continue
                    for skew in (False, True):
                        logits = torch.randn(tokens, num_experts, generator=gen)
                        if skew:  # most tokens on one expert: the sort's stability shows
                            logits[:, 0] += 3.0
                        top, expert = torch.topk(logits, k, dim=1)
                        for dtype in (torch.float32, torch.float16):
                            score = torch.sigmoid(top).to(dtype)
                            assert route_available(score, tokens * (k + shared),
                                                   num_experts + shared)
                            got = sort_pairs(expert, score, num_experts, shared)
                            want = routing.sort_pairs_torch(expert, score, num_experts,
                                                            shared)
                            for name, g, w in zip(("order", "offs", "token", "score"),
                                                  got[:4], want, strict=True):
                                assert g.dtype == w.dtype and torch.equal(g, w), (
                                    name, num_experts, k, shared, tokens, skew, g, w)
                            order, rank = got[0], got[4]
                            assert torch.equal(order[rank], torch.arange(order.numel()))
                            cases += 1
    print(cases, "cases")

    # wide steps (route_triton.WIDE_ENABLED): the counting sort's [P, groups] tile up to
    # MAX_LANES; the sort and the fused routing against torch's path as above
    assert not route_triton.WIDE_ENABLED  # off by default (=1 turns it on)
    route_triton.WIDE_ENABLED = True
    assert route_triton.max_pairs(17) == 512 and route_triton.max_pairs(16) == 1024
    assert route_triton.max_pairs(129) == 64 and route_triton.max_pairs(128) == 128
    for num_experts, k, shared, tokens in ((16, 1, True, 256), (16, 1, False, 1024),
                                           (16, 2, False, 300), (128, 1, False, 128)):
        pairs, groups = tokens * (k + shared), num_experts + shared
        logits = torch.randn(tokens, num_experts, generator=gen)
        logits[: tokens // 3, 5] += 3.0
        top, expert = torch.topk(logits, k, dim=1)
        score = torch.sigmoid(top)
        assert route_available(score, pairs, groups)
        assert not route_available(score, route_triton.max_pairs(groups) + 1, groups)
        got = sort_pairs(expert, score, num_experts, shared)
        want = routing.sort_pairs_torch(expert, score, num_experts, shared)
        for g, w in zip(got[:4], want, strict=True):
            assert torch.equal(g, w), (num_experts, k, shared, tokens)
        if k == 1:
            fused = route_triton.route_pairs(logits, num_experts, shared, torch.float32)
            for g, w in zip(fused[:3], want[:3], strict=True):
                assert torch.equal(g, w), (num_experts, shared, tokens)
    route_triton.WIDE_ENABLED = False

    # route_pairs: top-1 from the logits (or the balanced rotation) against routing.route
    # and torch's sort; scores within two units in the last place of their dtype
    fused = 0
    for num_experts in (1, 4, 16, 128):
        for shared in (False, True):
            for tokens in (1, 2, 5, 16, 31, 32, 64):
                if tokens * (1 + shared) > MAX_PAIRS:
                    continue
                for dtype in (torch.float32, torch.bfloat16):
                    # distinct logits (a permutation): the top-1 has no tie to break
                    logits = (torch.randperm(tokens * num_experts, generator=gen).float()
                              .view(tokens, num_experts) / (tokens * num_experts) * 8 - 4)
                    logits = logits.to(dtype)
                    for offset in (None, 0, 3, 1000003):
                        if offset is None:
                            expert = torch.topk(logits, 1, dim=1).indices
                        else:
                            expert = (torch.arange(tokens).view(-1, 1) + offset) % num_experts
                        score = torch.sigmoid(logits.gather(1, expert).float()).to(dtype)
                        want = routing.sort_pairs_torch(expert, score, num_experts, shared)
                        got = route_triton.route_pairs(logits, num_experts, shared, dtype,
                                                       offset)
                        for name, g, w in zip(("order", "offs", "token"), got[:3], want[:3],
                                              strict=False):
                            assert g.dtype == w.dtype and torch.equal(g, w), (
                                name, num_experts, shared, tokens, offset, g, w)
                        g, w = got[3], want[3]
                        ulp = 2 * torch.finfo(dtype).eps * w.float().abs()
                        assert g.dtype == dtype and bool(
                            ((g.float() - w.float()).abs() <= ulp).all()), (g, w)
                        assert torch.equal(got[0][got[4]], torch.arange(got[0].numel()))
                        fused += 1
    print(fused, "fused cases")
    # ties: the lowest index wins, as torch.argmax picks
    tied = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 3.0, 3.0, 3.0]])
    got = route_triton.route_pairs(tied, 4, False, torch.float32)
    assert got[0].tolist() == [1, 0] and got[1].tolist() == [1, 2, 2, 2], got
    assert torch.equal(torch.argmax(tied, 1), torch.tensor([1, 0]))
    with pytest_raises(ValueError, "route_pairs: logits of 4 experts for 5 groups"):
        route_triton.route_pairs(tied, 5, False, torch.float32)

    # route_pairs_from_x: the router's GEMM in the launch (float32 rows: IEEE dots, sums of
    # 128-wide slices in slice order), against torch's logits routed as above
    router_default = route_triton.ROUTER_IN_KERNEL
    assert router_default  # on by default (=0 turns it off; the runner clears the switch)
    for num_experts, hidden, shared, tokens, offset in (
            (16, 5120, True, 1, None), (16, 5120, False, 16, 7), (4, 300, True, 5, None),
            (128, 256, False, 64, None), (16, 640, True, 32, 2)):
        x = torch.randn(tokens, hidden, generator=gen)
        weight = torch.randn(num_experts, hidden, generator=gen) / hidden ** 0.5
        logits = x @ weight.T
        if offset is None:
            expert = torch.topk(logits, 1, dim=1).indices
            top2 = torch.topk(logits, min(2, num_experts), dim=1).values
            assert num_experts == 1 or bool((top2[:, 0] - top2[:, -1] > 1e-4).all())
        else:
            expert = (torch.arange(tokens).view(-1, 1) + offset) % num_experts
        score = torch.sigmoid(logits.gather(1, expert))
        want = routing.sort_pairs_torch(expert, score, num_experts, shared)
        for _ in range(2):  # the ticket is left zeroed: a second call routes again
            got = route_triton.route_pairs_from_x(x, weight, shared, offset)
            for g, w in zip(got[:3], want[:3], strict=True):
                assert torch.equal(g, w), (num_experts, hidden, shared, tokens, offset)
            torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=0)
            assert not moe_triton._TILE_COUNTERS[x.device].any()
    with pytest_raises(ValueError, "route_pairs_from_x: a router (4, 8) for rows of 9"):
        route_triton.route_pairs_from_x(torch.zeros(2, 9), torch.zeros(4, 8), False)
    lin = torch.nn.Linear(8, 4, bias=False)
    x8 = torch.zeros(2, 8)
    route_triton.ROUTER_IN_KERNEL = False
    assert route_triton.router_weight(x8, lin) is None  # switched off
    route_triton.ROUTER_IN_KERNEL = True
    assert route_triton.router_weight(x8, lin) is lin.weight
    assert route_triton.router_weight(x8, torch.nn.Linear(8, 4)) is None  # a bias
    assert route_triton.router_weight(x8.half(), lin) is None  # another dtype
    route_triton.ROUTER_IN_KERNEL = router_default

    # combine_rows against the scatter back to pair order and the sum over the slots
    # (float16, not bfloat16: the interpreter rounds float32 to bfloat16 toward zero, where
    # the GPU rounds to nearest even; tests/gpu/test_moe_gpu.py checks bfloat16)
    for slots in (1, 2, 3):
        for tokens in (1, 7, 32):
            for hidden in (8, 1000, 5120):
                for dtype in (torch.float32, torch.float16):
                    rows = torch.randn(tokens * slots, hidden, generator=gen).to(dtype)
                    order = torch.randperm(tokens * slots, generator=gen)
                    rank = torch.empty_like(order)
                    rank[order] = torch.arange(order.numel())
                    per_slot = torch.empty_like(rows).index_copy_(0, order, rows)
                    want = per_slot.view(tokens, slots, hidden).sum(1)
                    got = route_triton.combine_rows(rows, rank, tokens, slots)
                    # with the shared expert's rows added: torch's ``addend + sum``, the
                    # sum rounded first (float16: a second rounding the kernel must keep)
                    addend = torch.randn(tokens, hidden, generator=gen).to(dtype)
                    got_added = route_triton.combine_rows(rows, rank, tokens, slots, addend)
                    if slots <= 2:  # one float32 add, one rounding: torch's bits
                        assert torch.equal(got, want), (slots, tokens, hidden, dtype)
                        assert torch.equal(got_added, addend + want), (slots, tokens, hidden)
                    else:
                        torch.testing.assert_close(got, want)
                        torch.testing.assert_close(got_added, addend + want)
    for bad in (torch.zeros(3, 8), torch.zeros(2, 8, dtype=torch.float16),
                torch.zeros(8, 2).t()):
        try:
            route_triton.combine_rows(torch.zeros(4, 8), torch.arange(4), 2, 2, bad)
        except ValueError as err:
            assert "addend must be [2, 8]" in str(err), err
        else:
            raise AssertionError(f"addend {tuple(bad.shape)} {bad.dtype} taken")

    # the switch and the size bound
    route_triton.ROUTE_ENABLED = False
    assert not route_available(torch.zeros(1), 1, 16)
    route_triton.ROUTE_ENABLED = True
    assert not route_available(torch.zeros(1), 0, 16)

    # the MoE block, shared expert stacked and run as group E, with the kernel and without
    from torch import nn
    torch.manual_seed(0)
    layer = moe.MoE(16, 1, 64, 32, nn.SiLU(), fuse_max_tokens=16)
    with torch.no_grad():
        for prm in layer.parameters():
            prm.normal_(0, 0.2)
        assert layer.stack_shared()
        # the router's logits from torch here (the in-kernel router, a default, has its own
        # comparison below: its sums' order differs in the last place)
        route_triton.ROUTER_IN_KERNEL = False
        for tokens in (1, 5, 16, 40):  # 40: past the shared group (top-1 pairs only)
            x = torch.randn(tokens, 64)
            route_triton.ROUTE_ENABLED, route_triton.FUSED_ENABLED = True, False
            on = layer(x)
            route_triton.ROUTE_ENABLED, route_triton.FUSED_ENABLED = False, True
            fused_on = layer(x)
            route_triton.FUSED_ENABLED = False
            off = layer(x)
            assert torch.equal(on, off), (tokens, (on - off).abs().max())
            # float32 scores: Triton's sigmoid may differ by an ulp, and the expert's input
            # with it
            torch.testing.assert_close(fused_on, off, rtol=1e-5, atol=1e-6)
        # pairs past the kernels' bounds (torch sorts): combined by rank (COMBINE_RANKED)
        # or scattered back and summed, the same bits (one add of two slots)
        x = torch.randn(route_triton.MAX_WIDE_PAIRS, 64)
        route_triton.ROUTE_ENABLED, route_triton.FUSED_ENABLED = True, True
        assert not routing.COMBINE_RANKED  # off by default
        calls, real = [], route_triton.combine_rows
        route_triton.combine_rows = lambda *a: calls.append(1) or real(*a)
        scattered = layer(x)
        assert calls == []
        routing.COMBINE_RANKED = True
        ranked = layer(x)
        routing.COMBINE_RANKED = False
        route_triton.combine_rows = real
        assert calls == [1] and torch.equal(ranked, scattered)
        # the router's GEMM in the launch too: the same block to float32's rounding
        x = torch.randn(7, 64)
        route_triton.FUSED_ENABLED, route_triton.ROUTER_IN_KERNEL = True, True
        in_kernel = layer(x)
        route_triton.FUSED_ENABLED, route_triton.ROUTER_IN_KERNEL = False, False
        torch.testing.assert_close(in_kernel, layer(x), rtol=1e-5, atol=1e-6)
        # balanced simulation: the fused kernel's rotation is routing.route's
        routing.ROUTING_SIMULATION = "balanced"
        x = torch.randn(9, 64)
        calls = routing._SIMULATED_CALLS[0]
        route_triton.FUSED_ENABLED = True
        fused_on = layer(x)
        route_triton.FUSED_ENABLED = False
        routing._SIMULATED_CALLS[0] = calls
        off = layer(x)
        torch.testing.assert_close(fused_on, off, rtol=1e-5, atol=1e-6)
        routing.ROUTING_SIMULATION = ""
        # past MAX_EXPERTS the fused kernel is not asked (torch's top-k and sort run)
        wide = moe.MoE(route_triton.MAX_EXPERTS + 1, 1, 16, 8, nn.SiLU())
        for prm in wide.parameters():
            prm.normal_(0, 0.2)
        x = torch.randn(3, 16)
        route_triton.FUSED_ENABLED = True
        on = wide(x)
        route_triton.FUSED_ENABLED = False
        assert torch.equal(on, wide(x))
    print("ok")
""")


def test_sort_pairs_equals_torchs_path_in_interpreter():
    run_in_interpreter(SCRIPT)
