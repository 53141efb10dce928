"""plan_paged_attention / run_paged_attention and TorchRefBackend's build-once split.

Everything is checked against the float64 dense-mask oracle (tests/oracle.py); the
plan's reuse across layers is checked by running one plan on several layers'
tensors, and the absence of per-layer host work by making every host step raise
once the plan exists.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import dense_chunked_attention
from test_reference import attention_batches, make_tensors

from chunklocal import reference
from chunklocal.backends import torch_ref
from chunklocal.backends.torch_ref import TorchRefBackend
from chunklocal.kv_spec import ChunkedLocalAttentionSpec, FullAttentionSpec, Kind
from chunklocal.reference import (
    paged_causal_attention,
    plan_paged_attention,
    run_paged_attention,
)
from chunklocal.virtual_batches import make_virtual_batches

SCALE = 0.37


def layer_tensors(b, layer: int, dtype=torch.float64):
    """Different q, k, v per layer, same shapes (as the layers of one KV group)."""
    return make_tensors({**b, "seed": b["seed"] + 7919 * layer}, dtype)


def plan_for(b, chunked: bool, **kwargs):
    """Plan the batch's rows: virtual batches for chunked layers, requests otherwise."""
    num_pages, kv_heads, q_heads, head_dim = b["shape"]
    geometry = dict(block_size=b["block"], num_kv_heads=kv_heads, head_dim=head_dim, **kwargs)
    if not chunked:
        return (b["qsl"], b["seq"], b["table"], None), plan_paged_attention(
            b["qsl"], b["seq"], b["table"], **geometry)
    vb = make_virtual_batches(b["qsl"], b["seq"], b["table"], b["chunk"], b["block"])
    rows = (vb.query_start_loc, vb.seq_lens, vb.block_table, vb.kv_start)
    return rows, plan_paged_attention(*rows[:3], kv_start=rows[3], **geometry)


def check_plan_on_layers(b, chunked: bool, num_layers: int = 3, **plan_kwargs):
    rows, plan = plan_for(b, chunked, **plan_kwargs)
    qsl, seq, table, kv_start = rows
    for layer in range(num_layers):
        q, k, v = layer_tensors(b, layer)
        out = run_paged_attention(plan, q, k, v, SCALE)
        want = dense_chunked_attention(q, k, v, b["qsl"], b["seq"], b["table"],
                                       b["chunk"] if chunked else None, SCALE)
        assert out.dtype == torch.float64 and out.shape == q.shape
        torch.testing.assert_close(out, want, atol=1e-10, rtol=0)
        # The one-call API plans afresh for this layer: the reused plan must agree,
        # bit for bit when both group the tiles alike (same head count for the budget).
        again = paged_causal_attention(q, k, v, qsl, seq, table, kv_start=kv_start,
                                       scale=SCALE)
        exact = plan_kwargs.get("num_q_heads") == q.shape[1]
        torch.testing.assert_close(out, again, atol=0 if exact else 1e-12, rtol=0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(attention_batches(), st.booleans(), st.booleans())
def test_one_plan_many_layers_matches_oracle(b, chunked, with_heads):
    heads = dict(num_q_heads=b["shape"][2]) if with_heads else {}
    check_plan_on_layers(b, chunked, **heads)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(attention_batches(), st.booleans(), st.integers(1, 5), st.integers(6, 2000),
       st.sampled_from([0, 7, 1 << 24]))
def test_plan_tiles_groups_and_mask_storage(b, chunked, tile_rows, budget, mask_budget):
    """Many tiles and groups; masks kept in the plan, built in run(), or a mix."""
    with mock.patch.object(reference, "_TILE_ROWS", tile_rows), \
            mock.patch.object(reference, "_GROUP_BUDGET", budget), \
            mock.patch.object(reference, "_PLAN_MASK_BUDGET", mask_budget):
        check_plan_on_layers(b, chunked, num_layers=2, num_q_heads=b["shape"][2])


def test_mask_storage_modes_are_both_used():
    """The mixed case really mixes: the first groups keep masks, later ones limits."""
    b = dict(qsl=np.array([0, 40]), seq=np.array([40]), table=np.arange(10)[None], chunk=16,
             block=4, shape=(10, 1, 2, 4), seed=1, extra_rows=0)
    with mock.patch.object(reference, "_TILE_ROWS", 4), \
            mock.patch.object(reference, "_GROUP_BUDGET", 200), \
            mock.patch.object(reference, "_PLAN_MASK_BUDGET", 64):
        _, plan = plan_for(b, chunked=False, num_q_heads=2)
        kinds = [g.mask is not None for g in plan.groups]
        assert kinds[0] and not kinds[-1], kinds
        check_plan_on_layers(b, chunked=False, num_layers=2, num_q_heads=2)


class _NoNumpy:
    def __getattr__(self, name):
        raise AssertionError(f"run_paged_attention used numpy ({name}) on the host")


HOST_STEPS = [(reference, "plan_paged_attention"), (reference, "validate_batch"),
              (reference, "make_virtual_batches"), (reference, "_tiles"),
              (reference, "_groups"), (reference, "_check_pages"),
              (reference, "plan_validated"), (torch_ref, "plan_validated"),
              (torch_ref, "split_batch"), (torch_ref, "validate_batch")]


def forbid_host_work(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("host planning during forward()")

    for module, name in HOST_STEPS:
        monkeypatch.setattr(module, name, fail)
    monkeypatch.setattr(reference, "np", _NoNumpy())


def spec_for(b, kind: str):
    geometry = (b["block"], b["shape"][1], b["shape"][3], torch.float64)
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(*geometry, attention_chunk_size=b["chunk"])
    if kind == "merged":
        return FullAttentionSpec(*geometry, attention_chunk_size=b["chunk"])
    return FullAttentionSpec(*geometry)


@pytest.mark.parametrize("kind", ["chunked", "global", "merged"])
@pytest.mark.parametrize("with_heads", [True, False])
def test_backend_forward_does_no_host_work(monkeypatch, kind, with_heads):
    """build() plans once; forward() on every layer then runs with all host steps raising."""
    b = dict(qsl=np.array([1, 6, 7, 7, 40]), seq=np.array([13, 30, 0, 33]),
             table=np.array([[4, 11, 2, 0, 0, 0, 0, 0, 0], [5, 6, 7, 8, 9, 10, 12, 13, 1],
                             [0, 0, 0, 0, 0, 0, 0, 0, 0], list(range(14, 23))]),
             chunk=8, block=4, shape=(23, 2, 4, 8), seed=9, extra_rows=2)
    backend = TorchRefBackend(spec_for(b, kind), num_q_heads=4 if with_heads else None)
    args = [torch.from_numpy(b[x]).to(torch.int32) for x in ("qsl", "seq", "table")]
    with mock.patch.object(reference, "_TILE_ROWS", 8):  # several tiles per request
        plans = backend.build(*args)
    kinds = {"chunked": [Kind.CHUNKED], "global": [Kind.GLOBAL],
             "merged": [Kind.CHUNKED, Kind.GLOBAL]}[kind]
    assert list(plans) == kinds
    forbid_host_work(monkeypatch)
    for layer in range(4):
        layer_kind = kinds[layer % len(kinds)]
        q, k, v = layer_tensors(b, layer)
        out = backend.forward(plans, q, k, v, SCALE,
                              kind=layer_kind if kind == "merged" else None)
        want = dense_chunked_attention(q, k, v, b["qsl"], b["seq"], b["table"],
                                       b["chunk"] if layer_kind is Kind.CHUNKED else None,
                                       SCALE)
        torch.testing.assert_close(out, want, atol=1e-10, rtol=0)


def test_backend_lower_precision_cache_and_queries():
    b = dict(qsl=np.array([0, 9, 10, 30]), seq=np.array([12, 5, 30]),
             table=np.arange(24).reshape(3, 8)[:, ::-1].copy(), chunk=8, block=4,
             shape=(24, 2, 4, 16), seed=3, extra_rows=0)
    backend = TorchRefBackend(spec_for(b, "merged"), num_q_heads=4)
    plans = backend.build(b["qsl"], b["seq"], b["table"])
    for kind in Kind:
        q, k, v = make_tensors(b, torch.bfloat16)
        out = backend.forward(plans, q, k, v, SCALE, kind=kind)
        assert out.dtype == torch.bfloat16
        want = dense_chunked_attention(q, k, v, b["qsl"], b["seq"], b["table"],
                                       8 if kind is Kind.CHUNKED else None, SCALE)
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=0)


def test_merged_backend_needs_the_layer_kind():
    b = dict(block=4, shape=(8, 1, 1, 4), chunk=8)
    backend = TorchRefBackend(spec_for(b, "merged"))
    plans = backend.build(np.array([0, 1]), np.array([1]), np.array([[0]]))
    q, k = torch.zeros(1, 1, 4), torch.zeros(8, 4, 1, 4)
    with pytest.raises(ValueError, match="has chunked and global layers: pass kind="):
        backend.forward(plans, q, k, k, 1.0)


def _small():
    plan = plan_paged_attention([0, 4], [6], np.array([[1, 2]]), block_size=4, num_kv_heads=1,
                                head_dim=8, num_q_heads=2)
    q, k = torch.zeros(4, 2, 8), torch.zeros(5, 4, 1, 8)
    return plan, q, k


@pytest.mark.parametrize("q_shape,cache_shape,message", [
    ((4, 2, 8), (5, 2, 1, 8), r"cache \(block_size, num_kv_heads, head_dim\) \(2, 1, 8\)"),
    ((4, 4, 8), (5, 4, 2, 8), r"\(4, 2, 8\) differs from the plan's \(4, 1, 8\)"),
    ((4, 4, 8), (5, 4, 1, 8), r"q has 4 heads, the plan was made for 2"),
    ((3, 2, 8), (5, 4, 1, 8), r"query_start_loc ends at 4 but q has 3 rows"),
    ((4, 2, 8), (2, 4, 1, 8), r"the plan reads page 2 but the cache has 2 pages"),
    ((4, 2, 8), (5, 4, 1, 4), r"head_dim 8 differs from the cache's 4"),
])
def test_run_checks_shapes_against_the_plan(q_shape, cache_shape, message):
    plan, _, _ = _small()
    k = torch.zeros(cache_shape)
    with pytest.raises(ValueError, match=message):
        run_paged_attention(plan, torch.zeros(q_shape), k, k.clone())


def test_run_checks_device():
    plan, q, k = _small()
    meta = torch.zeros(q.shape, device="meta")
    with pytest.raises(ValueError, match="different devices|plan's tensors on cpu"):
        run_paged_attention(plan, meta, k.to("meta"), k.to("meta"))


@pytest.mark.parametrize("change,message", [
    (dict(block_table=np.array([[-1, 2]])), r"request 0: block_table\[0, 0\] = -1"),
    (dict(block_table=np.array([[1, 5]]), num_pages=5),
     r"request 0: block_table\[0, 1\] = 5 is not a page of the cache \(0..4\)"),
    (dict(kv_start=[3]), r"request 0: kv_start offset 3.*3 pages"),
    (dict(kv_start=[-2]), r"request 0: kv_start -2 is negative"),
    (dict(seq_lens=[3]), r"request 0: query length 4 exceeds seq_len 3"),
    (dict(num_q_heads=3), r"num_q_heads 3 is not a positive multiple of num_kv_heads 2"),
    (dict(num_kv_heads=0), r"num_kv_heads 0 and head_dim 8 must be positive"),
    (dict(block_size=4.0), r"block_size must be an integer"),
])
def test_plan_rejects_bad_batches(change, message):
    kwargs = dict(query_start_loc=[0, 4], seq_lens=[6], block_table=np.array([[1, 2]]),
                  block_size=4, num_kv_heads=2, head_dim=8, **{})
    kwargs.update(change)
    with pytest.raises(ValueError, match=message):
        plan_paged_attention(**kwargs)


def test_plan_without_num_pages_defers_the_page_check_to_run():
    plan = plan_paged_attention([0, 4], [6], np.array([[1, 7]]), block_size=4, num_kv_heads=1,
                                head_dim=8)
    assert plan.pages_end == 8
    q, k = torch.zeros(4, 2, 8), torch.zeros(8, 4, 1, 8)
    assert run_paged_attention(plan, q, k, k).shape == q.shape
    with pytest.raises(ValueError, match="reads page 7 but the cache has 7 pages"):
        run_paged_attention(plan, q, k[:7], k[:7])


def test_empty_and_all_padding_batches():
    for qsl, seq in (([0], []), ([0, 0, 0], [0, 5])):
        table = np.zeros((len(seq), 2), dtype=np.int32)
        plan = plan_paged_attention(qsl, seq, table, block_size=4, num_kv_heads=1, head_dim=8)
        assert plan.groups == ()
        q = torch.ones(3, 1, 8)
        k = torch.ones(2, 4, 1, 8)
        assert not run_paged_attention(plan, q, k, k).any()


def test_bare_cuda_device_names_its_index(monkeypatch):
    # Tensors on "cuda" report "cuda:<current>", so a plan made for "cuda" must
    # record the index too, or every forward would refuse q as "on another device".
    from chunklocal import reference

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert reference._concrete_device("cuda") == torch.device("cuda", 3)
    assert reference._concrete_device("cuda:1") == torch.device("cuda", 1)
    assert reference._concrete_device("cpu") == torch.device("cpu")


def test_forward_on_a_missing_layer_kind_is_a_value_error():
    from chunklocal.backends.torch_ref import TorchRefBackend
    from chunklocal.kv_spec import FullAttentionSpec

    backend = TorchRefBackend(FullAttentionSpec(4, 1, 8, torch.float32))
    plans = backend.build([0, 3], [3], [[0]])
    q = torch.randn(3, 1, 8)
    cache = torch.randn(1, 4, 1, 8)
    with pytest.raises(ValueError, match="this KV group has no chunked layers"):
        backend.forward(plans, q, cache, cache, 1.0, kind=Kind.CHUNKED)


@pytest.mark.parametrize("kind", ["chunked", "merged"])
def test_backend_build_errors_name_the_callers_request(kind):
    # Request 0 becomes three virtual batches, so request 1 is virtual batch 3: the
    # error must name the caller's request, as reference_attention does.
    b = dict(block=2, shape=(4, 1, 1, 4), chunk=2)
    backend = TorchRefBackend(spec_for(b, kind))
    table = np.array([[0, 1, 2], [-1, 0, 0]])
    with pytest.raises(ValueError, match=r"^request 1: block_table\[1, 0\] = -1 is not a page"):
        backend.build([0, 6, 7], [6, 1], table)


def test_backend_build_validates_the_batch_once(monkeypatch):
    """The trust boundary: one validate_batch per build, even for a merged group."""
    from chunklocal import virtual_batches

    calls = []
    real = virtual_batches.validate_batch

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    for module in (virtual_batches, torch_ref, reference):
        monkeypatch.setattr(module, "validate_batch", counting)
    b = dict(block=4, shape=(8, 1, 1, 4), chunk=8)
    backend = TorchRefBackend(spec_for(b, "merged"))
    backend.build(np.array([0, 3, 12]), np.array([3, 12]), np.array([[0, 0, 0], [1, 2, 3]]))
    assert len(calls) == 1
    with pytest.raises(ValueError, match="request 1: query length 13 exceeds seq_len 12"):
        backend.build(np.array([0, 3, 16]), np.array([3, 12]), np.array([[0, 0, 0], [1, 2, 3]]))
