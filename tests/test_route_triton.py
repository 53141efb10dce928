"""models/route_triton.py: the MoE block's pair bookkeeping in one launch, in Triton's
interpreter on the CPU, against torch's path (moe.sort_pairs_torch: moe.sort_by_expert and
the cats, division and gather around it), value for value; and the MoE block with it on
against it off."""

from __future__ import annotations

import textwrap

import pytest
from test_moe_triton import run_in_interpreter

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import os
    os.environ["CHUNKLOCAL_MOE_ROUTE_TRITON"] = "1"
    import torch
    from chunklocal.models import moe, route_triton
    from chunklocal.models.route_triton import MAX_PAIRS, route_available, sort_pairs

    gen = torch.Generator().manual_seed(0)
    cases = 0
    for num_experts in (1, 4, 16, 128):
        for k in (1, 2):
            if k > num_experts:
                continue
            for shared in (False, True):
                for tokens in (1, 2, 3, 7, 16, 31, 32, 64):
                    if tokens * (k + shared) > MAX_PAIRS:
                        assert not route_available(torch.zeros(1), tokens * (k + shared))
                        continue
                    for skew in (False, True):
                        logits = torch.randn(tokens, num_experts, generator=gen)
                        if skew:  # most tokens on one expert: the sort's stability shows
                            logits[:, 0] += 3.0
                        top, expert = torch.topk(logits, k, dim=1)
                        for dtype in (torch.float32, torch.float16):
                            score = torch.sigmoid(top).to(dtype)
                            assert route_available(score, tokens * (k + shared))
                            got = sort_pairs(expert, score, num_experts, shared)
                            want = moe.sort_pairs_torch(expert, score, num_experts,
                                                        shared)
                            for name, g, w in zip(("order", "offs", "token", "score"), got,
                                                  want):
                                assert g.dtype == w.dtype and torch.equal(g, w), (
                                    name, num_experts, k, shared, tokens, skew, g, w)
                            cases += 1
    print(cases, "cases")

    # the switch and the size bound
    route_triton.ROUTE_ENABLED = False
    assert not route_available(torch.zeros(1), 1)
    route_triton.ROUTE_ENABLED = True
    assert not route_available(torch.zeros(1), 0)

    # the MoE block, shared expert stacked and run as group E, with the kernel and without
    from torch import nn
    torch.manual_seed(0)
    layer = moe.MoE(16, 1, 64, 32, nn.SiLU(), fuse_max_tokens=16)
    with torch.no_grad():
        for prm in layer.parameters():
            prm.normal_(0, 0.2)
        assert layer.stack_shared()
        for tokens in (1, 5, 16, 40):  # 40: past the shared group (top-1 pairs only)
            x = torch.randn(tokens, 64)
            route_triton.ROUTE_ENABLED = True
            on = layer(x)
            route_triton.ROUTE_ENABLED = False
            off = layer(x)
            assert torch.equal(on, off), (tokens, (on - off).abs().max())
    print("ok")
""")


def test_sort_pairs_equals_torchs_path_in_interpreter():
    run_in_interpreter(SCRIPT)
