"""The KV-pool planner (bounds/kv_pools.py): the chunked group's per-request bound, by brute
force against the block manager's own freeing rule, and the pools it plans."""

from __future__ import annotations

import itertools
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from chunklocal._validate import cdiv
from chunklocal.bounds.closed_forms import max_local_pages
from chunklocal.bounds.kv_pools import PageShape, chunked_request_pages, plan_kv_pools
from chunklocal.engine.block_manager import KVGroup
from chunklocal.kv_spec import ChunkedLocalAttentionSpec, Kind


def held_pages(group: KVGroup, computed: int, query: int) -> int:
    """Pages a request holds in ``group`` once a step of ``query`` tokens after ``computed``
    is allocated: every page it ever had (none freed early), less what allocation frees."""
    seq = SimpleNamespace(num_computed=computed, block_tables=[[0] * cdiv(computed,
                                                                          group.block_size)],
                          first_owned_page=[0])
    owned = len(seq.block_tables[0]) - seq.first_owned_page[0]
    return owned - group.stale_pages(seq, 0) + group.new_pages(seq, 0, query)


def brute_force_max(chunk: int, tokens: int, model_len: int, block_size: int) -> int:
    spec = ChunkedLocalAttentionSpec(block_size, 1, 1, torch.float32, attention_chunk_size=chunk)
    group = KVGroup(spec, 1)
    return max(held_pages(group, computed, query)
               for computed in range(model_len)
               for query in range(1, min(tokens, model_len - computed) + 1))


CASES = [(bs * p, t, length, bs) for bs, p, t, length in itertools.product(
    (1, 2, 4), (1, 2, 3), (1, 2, 3, 5, 9), (1, 4, 7, 12, 20))]


@pytest.mark.parametrize("chunk, tokens, model_len, block_size", CASES)
def test_chunked_request_pages_is_the_exact_max(chunk, tokens, model_len, block_size):
    """Never exceeded and attained: one page less would be too small for some request."""
    bound = chunked_request_pages(chunk, tokens, model_len, block_size)
    assert bound == min(cdiv(chunk - 1 + tokens, block_size), cdiv(model_len, block_size))
    assert bound == max_local_pages(1, tokens, chunk, model_len, block_size)
    assert brute_force_max(chunk, tokens, model_len, block_size) == bound


def test_the_bound_binds_past_one_chunk():
    """A case where cdiv(c - 1 + T, bs) (not the whole sequence) is what is attained."""
    assert chunked_request_pages(8, 5, 64, 4) == 3 == brute_force_max(8, 5, 64, 4)
    assert cdiv(64, 4) > 3


def specs(page=100, chunk=32):
    return {Kind.CHUNKED: PageShape(page, chunk), Kind.GLOBAL: PageShape(page)}


LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, block_size=16)


def test_hybrid_pools():
    pools = plan_kv_pools({Kind.CHUNKED: 3, Kind.GLOBAL: 1}, specs(), hybrid=True,
                          available=10**9, num_kv_blocks=40, **LIMITS)
    chunked, global_ = pools.groups
    assert (chunked.name, chunked.need, chunked.pages, chunked.layers) == ("chunked", 3, 12, 3)
    assert (global_.name, global_.need, global_.pages, global_.layers) == ("global", 8, 40, 1)
    assert chunked.bytes == 13 * 300 and global_.bytes == 41 * 100
    assert pools.total_bytes == chunked.bytes + global_.bytes
    assert pools.kind_to_group == {Kind.CHUNKED: 0, Kind.GLOBAL: 1}
    assert pools.requests_fit() == 4 and global_.requests_fit() == 5


def test_merged_pool_and_budget():
    pools = plan_kv_pools({Kind.CHUNKED: 3, Kind.GLOBAL: 1}, specs(), hybrid=False,
                          available=10_000, weight_bytes=2_000, fraction=0.5, **LIMITS)
    (merged,) = pools.groups
    assert merged.kinds == (Kind.CHUNKED, Kind.GLOBAL) and merged.need == 8
    # The budget of 4000 bytes holds the scratch page too: 9 pages + 1 scratch.
    assert pools.num_kv_blocks == merged.pages == 4000 // 400 - 1
    assert pools.total_bytes == 4000
    assert pools.kind_to_group == {Kind.CHUNKED: 0, Kind.GLOBAL: 0}


def test_a_capped_chunked_pool_leaves_its_memory_to_the_global_pool():
    """The reported bug: 40 GiB asked, 28 GiB allocated.  Pages were sized for every layer
    at once and the chunked pool then capped at max_num_seqs requests' need, so its
    remainder was never allocated.  Now the global pool takes it: the plan spends the whole
    budget (less than one page per group), scratch pages included."""
    budget = 40 * 2**30
    layers = {Kind.CHUNKED: 36, Kind.GLOBAL: 12}
    limits = dict(max_num_seqs=8, max_num_batched_tokens=8192, max_model_len=131072,
                  block_size=16)
    pools = plan_kv_pools(layers, specs(page=65536, chunk=8192), hybrid=True,
                          available=budget, fraction=1.0, **limits)
    chunked, global_ = pools.groups
    assert chunked.pages == 8 * chunked.need == 8 * 1024  # capped
    assert global_.pages == (budget - 8193 * 36 * 65536 - 12 * 65536) // (12 * 65536)
    assert budget - global_.page_bytes < pools.total_bytes <= budget
    assert pools.num_kv_blocks == global_.pages and pools.requests_fit() == 3
    # A global pool capped too leaves the rest unspent, never more than the budget.
    small = dict(limits, max_num_seqs=1)
    pools = plan_kv_pools(layers, specs(page=65536, chunk=8192), hybrid=True,
                          available=budget, fraction=1.0, **small)
    assert [g.pages for g in pools.groups] == [1024, 8192]


@pytest.mark.parametrize("budget", [10**5, 123_457, 10**6, 3 * 10**6])
@pytest.mark.parametrize("max_num_seqs", [1, 4, 50])
def test_budget_pools_are_the_most_that_fit(budget, max_num_seqs):
    """Under the budget, and no pool can take one more page: each is at its cap, or one
    more page of it would pass the budget."""
    limits = dict(LIMITS, max_num_seqs=max_num_seqs)
    pools = plan_kv_pools({Kind.CHUNKED: 3, Kind.GLOBAL: 1}, specs(), hybrid=True,
                          available=budget, fraction=1.0, **limits)
    assert pools.total_bytes <= budget
    for g in pools.groups:
        assert g.pages == max_num_seqs * g.need or \
            pools.total_bytes + g.page_bytes > budget


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_kv_blocks=7), r"num_kv_blocks=7 cannot hold one request: the global KV group "
                            r"needs 8 blocks"),
    (dict(num_kv_blocks=8, available=1000), r"num_kv_blocks=8 needs .* GiB of KV cache"),
    (dict(weight_bytes=2 * 10**9), r"the weights need 1.9 GiB"),
    # another engine's weights on the device: totals, never a negative "available"
    (dict(num_kv_blocks=8, weight_bytes=2 * 10**9),
     r"0.9 GiB is available on cpu, 1.9 GiB of weights take it first \(no room left for KV\)"),
    (dict(available=5000), r"one request of max_model_len 128 needs"),
])
def test_refusals(kwargs, message):
    kwargs = dict(dict(available=10**9), **kwargs)
    with pytest.raises(ValueError, match=message):
        plan_kv_pools({Kind.CHUNKED: 3, Kind.GLOBAL: 1}, specs(), hybrid=True, **LIMITS,
                      **kwargs)


def test_imports_no_torch():
    code = ("import sys, chunklocal.bounds.kv_pools; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
