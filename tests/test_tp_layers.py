"""Tensor-parallel layers and weight slicing against the unsplit model (one thread per rank).

Oracle: the same weights run unsplit (TP=1).  Every rank must end with bitwise the
same output (the collectives hand every rank the same sum), equal to TP=1's within
float32 summation-order error.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llama4_tiny import rel_err, tiny_config
from tp_sim import groups, prefill_logits, random_full_state, rank_model, run_ranks

from chunklocal.models.parallel import (
    FirstRankOnly,
    ShardRule,
    column_parallel,
    row_parallel,
    vocab_embedding,
)
from chunklocal.models.sharding import check_tensor_parallel, kv_head_split, shard_rules

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_shard_rule_cuts_fused_blocks_separately():
    full = torch.arange(2 * 12).reshape(2, 12)  # [gate 0..5 | up 6..11] per row
    rule = ShardRule(1, 3, 1, parts=2)
    assert rule.take("w", full)[0].tolist() == [2, 3, 8, 9]
    assert ShardRule(0, 2, 1).take("w", full).tolist() == [full[1].tolist()]
    with pytest.raises(ValueError, match=r"w: dimension 1 of shape \(2, 12\).*5 equal"):
        ShardRule(1, 5, 0).take("w", full)


def shard(local: torch.nn.Module, full: torch.nn.Module) -> torch.nn.Module:
    rules = shard_rules(local)
    state = {n: rules[n].take(n, t) if n in rules else t for n, t in full.state_dict().items()}
    local.load_state_dict(state, strict=True)
    return local


@pytest.mark.parametrize("n", [2, 4])
def test_linears_embedding_and_lm_head(n):
    """Column then row parallel (the attention and MLP pattern), embedding, LM head."""
    torch.manual_seed(n)
    x = torch.randn(5, 8)
    up, down = torch.nn.Linear(8, 12, bias=True), torch.nn.Linear(12, 8, bias=True)
    ids = torch.tensor([0, 3, 11, 7, 4, 11])
    emb, head = torch.nn.Embedding(12, 8), torch.nn.Linear(8, 12, bias=False)

    def per_rank(tp):
        col = shard(column_parallel(8, 12, True, tp), up)(x)
        partial = shard(row_parallel(12, 8, True, tp), down)(col)
        return (col, tp.all_reduce(partial), shard(vocab_embedding(12, 8, tp), emb)(ids),
                tp.all_gather_last(shard(column_parallel(8, 12, False, tp), head)(x)))

    with torch.no_grad():
        outs = run_ranks(per_rank, groups(n))
        assert torch.allclose(torch.cat([o[0] for o in outs], dim=-1), up(x), atol=1e-6)
        for o in outs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(o[1:], outs[0][1:], strict=True))
        assert rel_err(outs[0][1], down(up(x))) < 1e-6  # bias of `down` added once
        assert torch.equal(outs[0][2], emb(ids))  # one real row + zeros: exact
        assert torch.allclose(outs[0][3], head(x), atol=1e-6)


def test_one_rank_layers_are_the_plain_ones():
    tp = groups(1)[0]
    for layer in (column_parallel(8, 12, True, tp), row_parallel(12, 8, True, tp)):
        assert type(layer) is torch.nn.Linear and not hasattr(layer, "shard_rules")
    assert type(vocab_embedding(12, 8, tp)) is torch.nn.Embedding
    assert FirstRankOnly(1).take("b", torch.ones(3)).tolist() == [0, 0, 0]


CONFIGS = st.sampled_from([
    # (num_attention_heads, num_key_value_heads, tensor-parallel size)
    (4, 2, 2), (4, 1, 2), (8, 2, 4), (8, 4, 4), (4, 4, 4), (8, 8, 2),
])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads=CONFIGS, moe=st.sampled_from(["tp", "ep"]), top_k=st.sampled_from([1, 2]),
       length=st.integers(1, 90), seed=st.integers(0, 2**16), bias=st.booleans())
def test_model_slices_match_unsplit_model(heads, moe, top_k, length, seed, bias):
    """Whole model, one prefill of 1 to 90 tokens."""
    num_heads, num_kv_heads, n = heads
    config = tiny_config(num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         head_dim=8, attention_chunk_size=16, num_hidden_layers=4,
                         num_experts_per_tok=top_k, attention_bias=bias,
                         moe_layers=[1, 2], no_rope_layers=[1, 1, 0, 1], vocab_size=64)
    assert check_tensor_parallel(config, n, moe) == n
    full = random_full_state(config, seed)
    ids = torch.randint(64, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    expected = prefill_logits(rank_model(config, full, groups(1)[0]), ids)
    outs = run_ranks(lambda tp: prefill_logits(rank_model(config, full, tp), ids),
                     groups(n, moe))
    for rank, out in enumerate(outs):
        assert torch.equal(out, outs[0]), f"rank {rank} differs from rank 0"
    assert rel_err(outs[0], expected) < 1e-5


def test_kv_heads_split_or_replicated():
    assert kv_head_split(8, 2) == (4, 1)
    assert kv_head_split(8, 8) == (1, 1)
    assert kv_head_split(2, 4) == (1, 2)


def test_shard_rules_name_every_split_parameter():
    config = tiny_config()
    with torch.device("meta"):
        from chunklocal.models.llama4 import Llama4ForCausalLM

        tp, ep = groups(2, "tp")[1], groups(2, "ep")[1]
        rules_tp = shard_rules(Llama4ForCausalLM(config, tp=tp))
        rules_ep = shard_rules(Llama4ForCausalLM(config, tp=ep))
    assert rules_tp["model.layers.1.feed_forward.experts.w13"] == ShardRule(1, 2, 1, 2)
    assert rules_tp["model.layers.1.feed_forward.experts.w2"] == ShardRule(2, 2, 1)
    assert rules_ep["model.layers.1.feed_forward.experts.w13"] == ShardRule(0, 2, 1)
    # KV heads 2 on 2 ranks: split; router and norms replicated
    assert rules_tp["model.layers.0.self_attn.k_proj.weight"] == ShardRule(0, 2, 1)
    assert not any("router" in n or "norm" in n for n in rules_tp)


BASE = dict(num_attention_heads=8, num_key_value_heads=2, vocab_size=512, intermediate_size=64,
            intermediate_size_mlp=96, num_local_experts=4)


@pytest.mark.parametrize("n, moe, overrides, message", [
    (3, "tp", {}, "does not divide num_attention_heads = 8"),
    (2, "tp", {"vocab_size": 511}, "does not divide vocab_size = 511"),
    (2, "tp", {"intermediate_size_mlp": 95}, "intermediate_size_mlp = 95"),
    (2, "tp", {"intermediate_size": 63}, "intermediate_size = 63"),
    (8, "ep", {"num_attention_heads": 8}, "num_local_experts = 4"),
    (4, "tp", {"num_key_value_heads": 6, "num_attention_heads": 12}, "num_key_value_heads = 6"),
    (4, "tp", {"num_key_value_heads": 3, "num_attention_heads": 12},
     "must be a multiple of it"),
    (0, "tp", {}, "tensor_parallel_size must be >= 1"),
    (2, "expert", {}, "moe_parallel must be 'tp' or 'ep'"),
])
def test_sizes_that_do_not_split(n, moe, overrides, message):
    config = tiny_config(**{**BASE, **overrides})
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(config, n, moe)


def test_divisibility_only_where_the_scheme_splits():
    # 8 ranks, 4 experts: fine for "tp" (each expert's inner size splits), not for "ep"
    config = tiny_config(**BASE)
    assert check_tensor_parallel(config, 8, "tp") == 8
    # no MoE layer: experts and their inner size are never split
    dense = tiny_config(**{**BASE, "intermediate_size": 63, "moe_layers": []})
    assert check_tensor_parallel(dense, 2, "ep") == 2


@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_moe_layer_float64_padded_path(moe):
    """float64 runs moe.padded_mm, where pairs routed to another rank's experts sort past
    the last group yet get computed with real weights: they must be dropped, not summed."""
    from chunklocal.models.moe import MoE

    torch.manual_seed(0)
    act = torch.nn.SiLU()
    full = MoE(8, 2, 16, 12, act).double()
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(37, 16, dtype=torch.float64)

    def per_rank(tp):
        local = MoE(8, 2, 16, 12, act, tp=tp).double()
        return shard(local, full)(x)

    with torch.no_grad():
        outs = run_ranks(per_rank, groups(4, moe))
        assert all(torch.equal(o, outs[0]) for o in outs)
        assert rel_err(outs[0], full(x)) < 1e-12
