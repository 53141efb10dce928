"""KV-cache specs: chunk detection (duck-typed), merge rules, validation."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from chunklocal import ChunkedLocalAttentionSpec, FullAttentionSpec, chunk_size_of, merge
from chunklocal.kv_spec import needs_global_pages

GEOMETRY = dict(block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def full(**kw):
    return FullAttentionSpec(**{**GEOMETRY, **kw})


def local(chunk=8192, **kw):
    return ChunkedLocalAttentionSpec(**{**GEOMETRY, **kw}, attention_chunk_size=chunk)


def test_chunk_size_of_is_duck_typed():
    assert chunk_size_of(full()) is None
    assert chunk_size_of(local()) == 8192
    # A full spec that carries a chunk size (merged mode) counts as chunked.
    assert chunk_size_of(full(attention_chunk_size=4096)) == 4096
    # Foreign objects: only the attribute matters.
    assert chunk_size_of(SimpleNamespace(attention_chunk_size=2048)) == 2048
    assert chunk_size_of(SimpleNamespace()) is None


def test_positional_construction_and_page_bytes():
    spec = ChunkedLocalAttentionSpec(16, 8, 128, torch.bfloat16, 8192)
    assert spec.attention_chunk_size == 8192 and not spec.has_global_layers
    assert spec.page_size_bytes == 2 * 16 * 8 * 128 * 2
    assert full(dtype=torch.float32).page_size_bytes == 2 * 16 * 8 * 128 * 4


@pytest.mark.parametrize("make,message", [
    (lambda: full(block_size=0), r"block_size must be positive, got 0"),
    (lambda: full(num_kv_heads=-1), r"num_kv_heads must be positive, got -1"),
    (lambda: full(head_dim=0), r"head_dim must be positive, got 0"),
    (lambda: full(attention_chunk_size=100), r"attention_chunk_size 100.*block_size 16"),
    (lambda: full(attention_chunk_size=-16), r"attention_chunk_size -16"),
    (lambda: full(dtype="bf16"), r"dtype must be a torch.dtype"),
    (lambda: full(sliding_window=0), r"sliding_window must be positive, got 0"),
    (lambda: ChunkedLocalAttentionSpec(**GEOMETRY), r"needs attention_chunk_size"),
])
def test_invalid_specs(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_merge_chunked_only_group():
    merged = merge([local(), local()])
    assert isinstance(merged, ChunkedLocalAttentionSpec)
    assert merged.attention_chunk_size == 8192
    assert not merged.has_global_layers and not needs_global_pages(merged)


def test_merge_mixed_group_keeps_chunk_and_records_global_layers():
    # vLLM's merged mode: 1 global + 3 chunked Llama-4 layers in one group.
    merged = merge([full(), local(), local(), local()])
    assert type(merged) is FullAttentionSpec
    assert merged.attention_chunk_size == 8192
    assert merged.has_global_layers and needs_global_pages(merged)
    assert chunk_size_of(merged) == 8192


def test_merge_global_only_group():
    merged = merge([full(), full()])
    assert merged.attention_chunk_size is None and needs_global_pages(merged)


def test_merge_checks_the_chunk_size():
    # PR 50022's question: the chunk size is part of the consistency check here.
    with pytest.raises(ValueError, match=r"different chunk sizes: \[4096, 8192\]"):
        merge([local(8192), local(4096)])
    with pytest.raises(ValueError, match=r"different chunk sizes"):
        merge([full(attention_chunk_size=4096), local(8192)])


@pytest.mark.parametrize("field,value", [("block_size", 32), ("num_kv_heads", 4),
                                         ("head_dim", 64), ("dtype", torch.float16),
                                         ("sliding_window", 512)])
def test_merge_rejects_geometry_mismatch(field, value):
    with pytest.raises(ValueError, match=rf"spec 2: {field}="):
        merge([local(), local(), local(**{field: value})])


def test_merge_of_nothing():
    with pytest.raises(ValueError, match="at least one spec"):
        merge([])


def test_needs_global_pages_is_conservative_for_foreign_specs():
    # A chunked spec that does not say whether global layers read it gets whole-sequence pages.
    assert needs_global_pages(SimpleNamespace(attention_chunk_size=8192))
    assert needs_global_pages(SimpleNamespace(attention_chunk_size=None))
    assert not needs_global_pages(SimpleNamespace(attention_chunk_size=8192,
                                                  has_global_layers=False))
    # A merged spec that carries a chunk size is read by the global layers too.
    assert needs_global_pages(full(attention_chunk_size=8192))


@pytest.mark.parametrize("field", ["block_size", "num_kv_heads", "head_dim"])
def test_fractional_geometry_is_refused_not_truncated(field):
    values = dict(block_size=16, num_kv_heads=8, head_dim=128)
    values[field] = 16.5
    with pytest.raises(ValueError, match=rf"{field} must be an integer, got 16.5"):
        FullAttentionSpec(dtype=torch.bfloat16, **values)
    with pytest.raises(ValueError, match="attention_chunk_size must be an integer"):
        ChunkedLocalAttentionSpec(16, 8, 128, torch.bfloat16, attention_chunk_size=8192.5)


@pytest.mark.parametrize("window", ["x", 2.5, 512.0, True, -4])
def test_sliding_window_must_be_a_positive_integer(window):
    with pytest.raises(ValueError, match=r"sliding_window"):
        FullAttentionSpec(16, 1, 8, torch.float32, sliding_window=window)


def test_sliding_window_accepts_none_and_integers():
    assert FullAttentionSpec(16, 1, 8, torch.float32).sliding_window is None
    assert FullAttentionSpec(16, 1, 8, torch.float32, sliding_window=512).sliding_window == 512
    assert FullAttentionSpec(16, 1, 8, torch.float32,
                             sliding_window=np.int64(7)).sliding_window == 7


@pytest.mark.parametrize("value", ["no", 0, None])
def test_has_global_layers_takes_only_booleans(value):
    with pytest.raises(ValueError, match=rf"has_global_layers must be True or False, got "
                                         rf"{value!r}"):
        FullAttentionSpec(**GEOMETRY, attention_chunk_size=64, has_global_layers=value)
    assert not FullAttentionSpec(**GEOMETRY, attention_chunk_size=64,
                                 has_global_layers=np.bool_(False)).has_global_layers
